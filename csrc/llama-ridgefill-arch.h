// The architectures RidgeFill prefill supports, in one table: what the late phase needs to know of
// each (its K path, whether it has recurrent layers, what it refuses) and the layer rules the
// selectors use. Adding an architecture means one entry here, one builder hook (patches/) and one
// oracle (ridgefill_cpp/oracle/).
#pragma once

#include "llama-arch.h"

#include <string>

struct ggml_tensor;
struct llama_hparams;
struct llama_model;
struct llm_graph_context;

struct llama_ridgefill_arch {
    llm_arch     arch;
    const char * name;   // GGUF general.architecture
    bool         hybrid; // some layers are recurrent (Gated DeltaNet): the late phase's hybrid path

    // the query part of a fused QKV projection is this many times n_head * d_k wide (qwen35: the
    // output gate is fused into it)
    int32_t q_width;

    // K of rows after the K projection, k [d_k, n_head_kv, n]: the k-norm and RoPE at positions pos,
    // as the model builder computes them; pos == nullptr: no RoPE (RoPE keeps norms: only the norm
    // is wanted)
    ggml_tensor * (*k_path)(const llm_graph_context & g, int il, ggml_tensor * k, ggml_tensor * pos);

    // the models of this architecture that are not supported: the reason, or nullptr
    const char * (*refuse)(const llama_model & model);
};

// the table entry of an architecture; nullptr: not supported
const llama_ridgefill_arch * llama_ridgefill_arch_find(llm_arch arch);

// the i-th supported architecture; nullptr past the last
const llama_ridgefill_arch * llama_ridgefill_arch_at(int32_t i);

// "llama, qwen3, ...": the supported architectures, for messages
std::string llama_ridgefill_arch_list();

// "" when RidgeFill prefill supports the model, else why not (the message lists what is supported)
std::string llama_ridgefill_arch_check(const llama_model & model);

// a layer that attends to every earlier row: not recurrent, no sliding window
bool llama_ridgefill_is_full_attention(const llama_hparams & hparams, int32_t il);

// the attention selector's default layer: the last full-attention layer below the split (-1: none)
int32_t llama_ridgefill_default_sel_layer(const llama_hparams & hparams, int32_t split);
