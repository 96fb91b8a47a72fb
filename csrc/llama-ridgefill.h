// RidgeFill: faster long-prompt prefill by filling late-layer KV from ridge maps.
// Public C API of the ridgefill-cpp additions to libllama (see DESIGN.md §6).
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

    // Build information as a JSON object (static storage, never freed):
    //   ridgefill_version, llama_cpp_commit, llama_cpp_python, patchset, build_type, compiler,
    //   backends (registered ggml backends, e.g. ["CPU"] or ["CUDA", "CPU"])
    LLAMA_API const char * llama_ridgefill_build_info(void);

    //
    // hidden-state capture (calibration, tests): the input of layer il (the residual stream
    // entering it) for every token of the last llama_decode() call, il in [0, n_layer]
    //

    // enable or disable capturing the input of layer il; returns 0, or -1 if il is out of range
    LLAMA_API int32_t llama_ridgefill_capture_layer_input(struct llama_context * ctx, int32_t il, bool enable);

    // float[n_embd * n_tokens] of the last decode call (row-major per token), or NULL when the layer
    // is not captured or nothing was decoded yet; valid until the next decode call
    LLAMA_API const float * llama_ridgefill_get_layer_input(struct llama_context * ctx, int32_t il);

#ifdef __cplusplus
}
#endif
