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

#ifdef __cplusplus
}
#endif
