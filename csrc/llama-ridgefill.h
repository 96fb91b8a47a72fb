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

    //
    // maps (DESIGN §7): the ridge maps of a map file, loaded for one model
    //

    struct llama_ridgefill_maps;

    struct llama_ridgefill_maps_params {
        int32_t split_layer; // the split S the caller expects, or -1 to take the file's
        bool    host;        // keep the maps in (pinned) host memory, streamed to the accelerator when
                             // used, instead of with their layer's weights; the same on CPU
    };

    LLAMA_API struct llama_ridgefill_maps_params llama_ridgefill_maps_default_params(void);

    // load the maps of a map file and check them against the model: file type and format version,
    // architecture, n_layer, n_embd, split, the list of mapped layers, tensor names, shapes, types and
    // finite values. Returns NULL on any mismatch; llama_ridgefill_last_error() says what did not match.
    // (The fingerprint of the model the maps were fitted on is returned by
    // llama_ridgefill_maps_fingerprint for the caller to compare: the model file is not known here.)
    LLAMA_API struct llama_ridgefill_maps * llama_ridgefill_maps_init(
            const struct llama_model * model,
                          const char * path,
     struct llama_ridgefill_maps_params params);

    LLAMA_API void        llama_ridgefill_maps_free       (struct llama_ridgefill_maps * maps);
    LLAMA_API int32_t     llama_ridgefill_maps_split_layer(const struct llama_ridgefill_maps * maps);
    LLAMA_API const char * llama_ridgefill_maps_fingerprint(const struct llama_ridgefill_maps * maps);
    LLAMA_API uint64_t    llama_ridgefill_maps_n_bytes    (const struct llama_ridgefill_maps * maps);

    // the predicted input of layer il for n_rows split-layer states xs ([n_rows][n_embd], row-major):
    // x_hat = A_il phi(xs) + b_il, or xs itself for il == S; computed on the CPU backend with the same
    // graph step the fill uses. For tests and tools. Returns 0, or -1 (see llama_ridgefill_last_error)
    LLAMA_API int32_t llama_ridgefill_maps_predict(
            const struct llama_ridgefill_maps * maps,
                                    int32_t   il,
                                const float * xs,
                                    int32_t   n_rows,
                                      float * out);

    // the message of the last failed RidgeFill call on this thread ("" after a success)
    LLAMA_API const char * llama_ridgefill_last_error(void);

#ifdef __cplusplus
}
#endif
