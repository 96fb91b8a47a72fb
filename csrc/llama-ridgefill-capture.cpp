// Hidden-state capture for calibration and tests: a stable C entry point over llama-ext.h's
// per-layer input extraction (which has C++ linkage).

#include "llama-ridgefill.h"

#include "llama-context.h"
#include "llama-ext.h"
#include "llama-impl.h"
#include "llama-model.h"

int32_t llama_ridgefill_capture_layer_input(struct llama_context * ctx, int32_t il, bool enable) {
    const int32_t n_layer = (int32_t) llama_model_n_layer(llama_get_model(ctx));
    if (il < 0 || il > n_layer) {
        LLAMA_LOG_ERROR("%s: layer %d out of range [0, %d]\n", __func__, il, n_layer);
        return -1;
    }
    llama_set_embeddings_layer_inp(ctx, (uint32_t) il, enable);
    return 0;
}

const float * llama_ridgefill_get_layer_input(struct llama_context * ctx, int32_t il) {
    const int32_t n_layer = (int32_t) llama_model_n_layer(llama_get_model(ctx));
    if (il < 0 || il > n_layer) {
        LLAMA_LOG_ERROR("%s: layer %d out of range [0, %d]\n", __func__, il, n_layer);
        return nullptr;
    }
    // llama_get_embeddings_layer_inp asserts on a layer that was not captured: check first
    const auto & enabled = ctx->get_cparams().embeddings_layer_inp;
    if ((size_t) il >= enabled.size() || !enabled[il]) {
        LLAMA_LOG_ERROR("%s: the input of layer %d is not captured (llama_ridgefill_capture_layer_input)\n", __func__, il);
        return nullptr;
    }
    return llama_get_embeddings_layer_inp(ctx, (uint32_t) il);
}
