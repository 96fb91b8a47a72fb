// RidgeFill maps inside libllama: the loaded side tensors of a map file (docs/design.md §7) and the graph
// step that turns split-layer states into predicted late-layer inputs.
#pragma once

#include "llama-ridgefill.h"
#include "llama-ridgefill-params.h"

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
    std::string type_name;       // the map matrices' ggml type ("f16", "q8_0", ...)
    llama_ridgefill_tuned tuned; // the operating point of ridgefill-gguf tune (ridgefill.tuned.*), if any
    std::string path;            // the map file

    // the map matrices, all of one type (F32, F16, Q8_0, Q4_0 or Q4_K): a full A per mapped layer, or,
    // for a low-rank form, its two factors (A = I + U V^T or A = U V^T, docs/design.md §7.1)
    bool identity_low_rank = false;  // form "identity_low_rank": x_hat adds phi(x_S) itself
    std::string form = "full";       // "full", "identity_low_rank" or "low_rank"
    std::vector<ggml_tensor *> a;    // [n_layer], [n_embd(in), n_embd(out)]; nullptr for il <= S or low rank
    std::vector<ggml_tensor *> down; // [n_layer], V^T [n_embd(in), r]; low-rank forms only
    std::vector<ggml_tensor *> up;   // [n_layer], U [r, n_embd(out)]; low-rank forms only
    std::vector<ggml_tensor *> b; // [n_layer], [n_embd] F32
    std::vector<ggml_tensor *> g; // [n_layer], [n_v_heads] F32: state gains of the late recurrent layers
                                  //   (terminal-state correction); nullptr where none (optional)

    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;

    explicit llama_ridgefill_maps(const llama_model & model) : model(model) {}

    size_t n_bytes() const;
};

// the map matrices of one layer as a graph reads them: A, or the low-rank factors V^T (down) and U (up)
struct llama_ridgefill_map_weights {
    ggml_tensor * a    = nullptr;
    ggml_tensor * down = nullptr;
    ggml_tensor * up   = nullptr;
};

// x_hat = A_il * phi(xs) + b_il for the rows of xs [n_embd, n_rows] (F32); identity fill when maps is
// nullptr or il has no map (il == S). A low-rank map is applied as two thin products,
// U * (V^T * phi(xs)) (+ phi(xs) for I + U V^T). Built from ggml ops only (mul_mat takes every
// stored type), so it runs on every backend.
// w: the matrices as the graph should read them (llama_ridgefill_stage), or nullptr for the maps' own
ggml_tensor * llama_ridgefill_build_xhat(ggml_context * ctx0, const llama_ridgefill_maps * maps, int il, ggml_tensor * xs,
        const llama_ridgefill_map_weights * w = nullptr);

// the map matrices of layer il for a graph that multiplies them several times (fill steps):
// host-placed maps of a layer that runs on an accelerator are copied to it once (a CONT node, which
// the scheduler's op offload runs there), so every step reads the device copy instead of uploading
// the map again; the maps' own tensors otherwise (resident maps, or a CPU layer). All nullptr when
// il has no map.
llama_ridgefill_map_weights llama_ridgefill_stage(ggml_context * ctx0, const llama_ridgefill_maps * maps, int il);
