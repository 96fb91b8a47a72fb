// RidgeFill maps inside libllama: the loaded side tensors of a map file (docs/design.md §7) and the graph
// step that turns split-layer states into predicted late-layer inputs.
#pragma once

#include "llama-ridgefill.h"

#include "ggml-cpp.h"

#include <string>
#include <vector>

struct llama_model;

// loaded maps, a sibling of llama_adapter_lora / llama_adapter_cvec: owns its contexts and buffers
struct llama_ridgefill_maps {
    const llama_model & model;

    int32_t n_layer     = 0;
    int32_t n_embd      = 0;
    int32_t split_layer = 0;     // S: maps exist for layers S+1 .. n_layer-1
    bool    normalized  = true;  // phi = RMS normalisation (objective "normalized"), else identity
    float   norm_eps    = 1e-6f;
    bool    host        = false; // placement: false = with the layer's weights
    bool    digest_checked = false; // every tensor matched the file's content digest

    std::string objective;
    std::string fingerprint;     // of the model the maps were fitted on (checked by the caller)
    std::string buft_names;      // the buffer types holding the maps, comma-separated

    std::vector<ggml_tensor *> a; // [n_layer], [n_embd(in), n_embd(out)] F16/F32; nullptr for il <= S
    std::vector<ggml_tensor *> b; // [n_layer], [n_embd] F32
    std::vector<ggml_tensor *> g; // [n_layer], [n_v_heads] F32: state gains of the late recurrent layers
                                  //   (terminal-state correction); nullptr where none (optional)

    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;

    explicit llama_ridgefill_maps(const llama_model & model) : model(model) {}

    size_t n_bytes() const;
};

// x_hat = A_il * phi(xs) + b_il for the rows of xs [n_embd, n_rows] (F32); identity fill when maps is
// nullptr or il has no map (il == S). Built from ggml ops only, so it runs on every backend.
// a: A_il as the graph should read it (llama_ridgefill_stage_a), or nullptr for maps->a[il]
ggml_tensor * llama_ridgefill_build_xhat(ggml_context * ctx0, const llama_ridgefill_maps * maps, int il, ggml_tensor * xs,
        ggml_tensor * a = nullptr);

// A_il for a graph that multiplies it several times (fill steps): host-placed maps of a layer that
// runs on an accelerator are copied to it once (a CONT node, which the scheduler's op offload runs
// there), so every step reads the device copy instead of uploading the map again; maps->a[il]
// otherwise (resident maps, or a CPU layer). nullptr when il has no map.
ggml_tensor * llama_ridgefill_stage_a(ggml_context * ctx0, const llama_ridgefill_maps * maps, int il);

// record the message of a failed call for llama_ridgefill_last_error() and log it
void llama_ridgefill_set_error(const char * func, const std::string & msg);

// a call succeeded: llama_ridgefill_last_error() returns ""
void llama_ridgefill_clear_error();

// throws when path names something other than a regular file (or a link to one): a FIFO or a
// device would block or stream, a directory fail with a less clear message. A missing file is left
// to the reader's own message. what: "model", "map file"
void llama_ridgefill_check_regular_file(const char * path, const char * what);

// the fingerprint of the model GGUF at path (llama-ridgefill-fingerprint.cpp); throws with a
// message naming the file when it cannot be read
std::string llama_ridgefill_model_fingerprint_file(const char * path);
