// The diagnostic entry points of the C API: what the last plan measured (selector scores, value and
// key scales), the K/V and recurrent states a context holds, and the hybrid models' boundary-state
// record and splice test. Nothing here changes what a prefill computes, except a splice the caller
// asked for.

#include "llama-ridgefill-context.h"
#include "llama-ridgefill-error.h"
#include "llama-ridgefill-maps.h"
#include "llama-ridgefill-memory.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <cstring>

int32_t llama_ridgefill_get_scores(struct llama_context * ctx, float * out, int32_t n) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    return rf ? llama_ridgefill_copy_out(rf->last_scores, out, n) : -1;
}

int32_t llama_ridgefill_get_value_scales(struct llama_context * ctx, float * out, int32_t n) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    return rf ? llama_ridgefill_copy_out(rf->last_v_scales, out, n) : -1;
}

int32_t llama_ridgefill_get_key_scales(struct llama_context * ctx, float * out, int32_t n) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    return rf ? llama_ridgefill_copy_out(rf->last_k_scales, out, n) : -1;
}

int32_t llama_ridgefill_read_kv(
        struct llama_context * ctx,
                     int32_t   il,
                llama_seq_id   seq_id,
             const llama_pos * pos,
                     int32_t   n,
                       float * k_out,
                       float * v_out) {
    if (ctx == nullptr || pos == nullptr || n < 0) {
        llama_ridgefill_set_error(__func__, "invalid arguments");
        return -1;
    }
    const llama_hparams & hparams = ctx->get_model().hparams;
    if (il < 0 || il >= (int32_t) hparams.n_layer() || hparams.is_recr(il)) {
        llama_ridgefill_set_error(__func__, format("layer %d has no KV cache", il));
        return -1;
    }
    const llama_ridgefill_caches caches(ctx->get_memory());
    if (!caches.base) {
        llama_ridgefill_set_error(__func__, "the context has no KV cache");
        return -1;
    }
    const llama_kv_cache * kv = caches.swa && hparams.is_swa(il) ? caches.swa : caches.base;
    const uint32_t kv_size = kv->get_size();

    ctx->synchronize();
    for (int which = 0; which < 2; ++which) {
        float * out = which == 0 ? k_out : v_out;
        if (out == nullptr) {
            continue;
        }
        ggml_tensor * t = which == 0 ? kv->get_k_storage(il) : kv->get_v_storage(il);
        const bool trans = which == 1 && kv->get_v_trans();
        const int64_t n_embd_gqa = which == 0 ? hparams.n_embd_k_gqa(il) : hparams.n_embd_v_gqa(il);

        std::vector<uint8_t> raw(ggml_nbytes(t));
        ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
        std::vector<float> all(ggml_nelements(t));
        const auto * traits = ggml_get_type_traits(t->type);
        if (t->type == GGML_TYPE_F32) {
            memcpy(all.data(), raw.data(), raw.size());
        } else if (traits->to_float) {
            traits->to_float(raw.data(), all.data(), all.size());
        } else {
            llama_ridgefill_set_error(__func__, format("cannot read a %s cache", ggml_type_name(t->type)));
            return -1;
        }
        const int64_t row = t->ne[0]; // K / untransposed V: [n_embd_gqa, kv_size]; transposed V: [kv_size, n_embd_gqa]
        // the sequence's KV stream (one per sequence without a unified cache): its block of the storage
        const size_t base = (size_t) kv->get_stream(seq_id)*t->ne[0]*t->ne[1];
        for (int32_t i = 0; i < n; ++i) {
            const std::vector<int64_t> c = llama_ridgefill_find_cells(kv, seq_id, pos[i], 1);
            if (c[0] < 0) {
                llama_ridgefill_set_error(__func__, format("position %d of sequence %d is not in the cache", pos[i], seq_id));
                return -1;
            }
            for (int64_t e = 0; e < n_embd_gqa; ++e) {
                out[i*n_embd_gqa + e] = trans ? all[base + e*kv_size + c[0]] : all[base + c[0]*row + e];
            }
        }
    }
    llama_ridgefill_clear_error();
    return 0;
}

int32_t llama_ridgefill_read_state(struct llama_context * ctx, int32_t il, llama_seq_id seq_id, float * out, int32_t n) {
    if (ctx == nullptr || n < 0) {
        llama_ridgefill_set_error(__func__, "invalid arguments");
        return -1;
    }
    const llama_hparams & hparams = ctx->get_model().hparams;
    const llama_ridgefill_caches caches(ctx->get_memory());
    if (!caches.recr || il < 0 || il >= (int32_t) hparams.n_layer() || !hparams.is_recr(il)) {
        llama_ridgefill_set_error(__func__, format("layer %d has no recurrent state", il));
        return -1;
    }
    const int32_t cell = caches.recr_cell(seq_id);
    if (cell < 0) {
        llama_ridgefill_set_error(__func__, format("sequence %d has no recurrent state", seq_id));
        return -1;
    }
    ctx->synchronize();
    llama_ridgefill_clear_error();
    return llama_ridgefill_copy_out(caches.read_state(il, cell), out, n);
}

void llama_ridgefill_record_boundary_states(struct llama_context * ctx, bool record) {
    if (ctx && ctx->ridgefill) {
        ctx->ridgefill->record_boundary = record;
    }
}

int32_t llama_ridgefill_get_boundary_state(struct llama_context * ctx, int32_t il, float * out, int32_t n) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    if (!rf) {
        return -1;
    }
    auto it = rf->boundary_states.find(il);
    return it == rf->boundary_states.end() ? 0 : llama_ridgefill_copy_out(it->second, out, n);
}

int32_t llama_ridgefill_splice_state(struct llama_context * ctx, int32_t il, const float * state, int32_t n) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    return rf ? rf->splice_state(il, state, n) : -1;
}
