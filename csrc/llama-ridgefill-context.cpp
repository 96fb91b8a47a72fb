// RidgeFill attached to a llama_context: the C API of filled-row prefill, the plan of a prompt, the
// early-phase bookkeeping and the late phase (docs/method.md §4-§6).

#include "llama-ridgefill-context.h"
#include "llama-ridgefill-maps.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <tuple>
#include <unordered_map>

//
// helpers
//

namespace {

// the caches of a context's memory: the full-attention KV cache, the sliding-window one of iSWA
// models, and the recurrent states of hybrid models
struct rf_caches {
    llama_kv_cache         * base   = nullptr;
    llama_kv_cache         * swa    = nullptr;
    llama_kv_cache_iswa    * iswa   = nullptr;
    llama_memory_hybrid    * hybrid = nullptr;
    llama_memory_recurrent * recr   = nullptr;
};

rf_caches rf_get_caches(llama_memory_i * mem) {
    rf_caches res;
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        res.iswa = iswa;
        res.base = iswa->get_base();
        res.swa  = iswa->get_swa();
    } else if (auto * hybrid = dynamic_cast<llama_memory_hybrid *>(mem)) {
        res.hybrid = hybrid;
        res.base   = hybrid->get_mem_attn();
        res.recr   = hybrid->get_mem_recr();
    } else {
        res.base = dynamic_cast<llama_kv_cache *>(mem);
    }
    return res;
}

// the recurrent cell holding a sequence's state (-1: none)
int32_t rf_recr_cell(const llama_memory_recurrent * recr, llama_seq_id seq_id) {
    if (recr == nullptr || seq_id < 0 || (uint32_t) seq_id >= recr->size) {
        return -1;
    }
    return recr->cells[seq_id].tail;
}

// the recurrent state (conv state, then ssm state; F32) of layer il in a cell of the recurrent memory
std::vector<float> rf_read_state(const llama_memory_recurrent * recr, int32_t il, int32_t cell) {
    GGML_ASSERT(recr && cell >= 0 && (uint32_t) cell < recr->size);
    std::vector<float> res;
    for (ggml_tensor * t : { recr->r_l[il], recr->s_l[il] }) {
        GGML_ASSERT(t->type == GGML_TYPE_F32);
        const size_t row = ggml_nbytes(t)/recr->size;
        const size_t n0  = res.size();
        res.resize(n0 + row/sizeof(float));
        ggml_backend_tensor_get(t, res.data() + n0, (size_t) cell*row, row);
    }
    return res;
}

void rf_write_state(const llama_memory_recurrent * recr, int32_t il, int32_t cell, const std::vector<float> & state) {
    GGML_ASSERT(recr && cell >= 0 && (uint32_t) cell < recr->size);
    size_t off = 0;
    for (ggml_tensor * t : { recr->r_l[il], recr->s_l[il] }) {
        const size_t row = ggml_nbytes(t)/recr->size;
        GGML_ASSERT((off + row/sizeof(float)) <= state.size());
        ggml_backend_tensor_set(t, state.data() + off, (size_t) cell*row, row);
        off += row/sizeof(float);
    }
}

bool rf_is_full_attention(const llama_hparams & hparams, int il) {
    return !hparams.is_swa(il) && !hparams.is_recr(il);
}

// the attention selector's default layer: the last full-attention layer below S (-1: none)
int32_t rf_default_sel_layer(const llama_hparams & hparams, int32_t split) {
    for (int32_t il = split - 1; il >= 0; --il) {
        if (rf_is_full_attention(hparams, il)) {
            return il;
        }
    }
    return -1;
}

// how many prefix rows the selector keeps: ceil(fraction * n_prefix), with a tolerance against
// rounding (0.1 * 30 is 3, not 4); the oracle's n_selected
int32_t rf_n_selected(int32_t n_prefix, double fraction) {
    if (n_prefix <= 0) {
        return 0;
    }
    const double k = std::ceil(fraction*n_prefix - 1e-9);
    return (int32_t) std::max(0.0, std::min<double>(n_prefix, k));
}

// cell of each position pos0 + j, j < n, of seq_id in a cache (-1 where none)
std::vector<int64_t> rf_find_cells(const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos pos0, int32_t n) {
    std::vector<int64_t> res(n, -1);
    const auto & cells = kv->get_cells(seq_id);
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (cells.is_empty(i) || !cells.seq_has(i, seq_id)) {
            continue;
        }
        const llama_pos p = cells.pos_get(i);
        if (p >= pos0 && p < pos0 + n) {
            res[p - pos0] = i;
        }
    }
    return res;
}

// a slot that re-uses the cells of rows that are already in the cache
llama_kv_cache::slot_info rf_reuse_slot(const llama_kv_cache * kv, llama_seq_id seq_id, const std::vector<uint32_t> & cells) {
    llama_kv_cache::slot_info sinfo;
    const uint32_t strm = kv->get_stream(seq_id);
    sinfo.s0 = strm;
    sinfo.s1 = strm;
    sinfo.strm = { (llama_seq_id) strm };
    sinfo.idxs = { cells };
    sinfo.reuse = true;
    return sinfo;
}

// a memory context over rows already in the memory: the KV cells `cells` of the ubatch's rows; for
// hybrid models also the recurrent state of cell rs_cell, continued (rs_zero: from a zeroed state)
llama_memory_context_ptr rf_reuse_context(const rf_caches & caches, llama_seq_id seq_id, const llama_ubatch & ub,
        const std::vector<uint32_t> & cells, const std::vector<uint32_t> & cells_swa, int32_t rs_cell, bool rs_zero) {
    if (caches.iswa) {
        return std::make_unique<llama_kv_cache_iswa_context>(caches.iswa,
                llama_kv_cache::slot_info_vec_t { rf_reuse_slot(caches.base, seq_id, cells) },
                llama_kv_cache::slot_info_vec_t { rf_reuse_slot(caches.swa,  seq_id, cells_swa) },
                std::vector<llama_ubatch> { ub });
    }
    if (caches.hybrid) {
        GGML_ASSERT(rs_cell >= 0);
        return std::make_unique<llama_memory_hybrid_context>(caches.hybrid,
                llama_kv_cache::slot_info_vec_t { rf_reuse_slot(caches.base, seq_id, cells) },
                std::vector<llama_ubatch> { ub }, (uint32_t) rs_cell, rs_zero ? rs_cell : -1);
    }
    return std::make_unique<llama_kv_cache_context>(caches.base,
            llama_kv_cache::slot_info_vec_t { rf_reuse_slot(caches.base, seq_id, cells) },
            std::vector<llama_ubatch> { ub });
}

// the n_pos positions of n text rows, section-major, into out[n*n_pos]: the positions themselves
// (n_pos = 1), or M-RoPE's sections p, p, p, 0 (n_pos = 4), as llama.cpp expands text positions
void rf_text_positions(const llama_pos * pos, size_t n, uint32_t n_pos, llama_pos * out) {
    for (uint32_t k = 0; k < n_pos; ++k) {
        if (k < 3) {
            std::copy_n(pos, n, out + k*n);
        } else {
            std::fill_n(out + k*n, n, 0);
        }
    }
}

// a ubatch of rows of one sequence at the given positions, no tokens (the inputs come from x_S);
// n_pos positions per row (rf_text_positions)
llama_ubatch rf_make_ubatch(llama_seq_id seq_id, const std::vector<llama_pos> & pos, bool output_last, uint32_t n_pos = 1) {
    auto data = std::make_shared<llama_ubatch::data_t>();
    const uint32_t n = pos.size();

    data->pos.resize((size_t) n*n_pos);
    rf_text_positions(pos.data(), n, n_pos, data->pos.data());
    data->n_seq_id   .assign(n, 1);
    data->seq_id_data.assign(1, seq_id);
    data->seq_id     .assign(n, data->seq_id_data.data());
    data->seq_id_unq = { seq_id };
    data->seq_idx    .assign(LLAMA_MAX_SEQ, -1);
    data->seq_idx[seq_id] = 0;
    data->output     .assign(n, 0);
    if (output_last && n > 0) {
        data->output[n - 1] = 1;
    }
    data->batch_idxs.resize(n);
    std::iota(data->batch_idxs.begin(), data->batch_idxs.end(), 0);

    llama_ubatch ub {
        /*.b_equal_seqs =*/ 1, // one sequence (the recurrent layers need it)
        /*.n_tokens     =*/ n,
        /*.n_seq_tokens =*/ n,
        /*.n_seqs       =*/ 1,
        /*.n_seqs_unq   =*/ 1,
        /*.n_pos        =*/ n_pos,
        /*.token        =*/ nullptr,
        /*.embd         =*/ nullptr,
        /*.pos          =*/ data->pos.data(),
        /*.n_seq_id     =*/ data->n_seq_id.data(),
        /*.seq_id       =*/ data->seq_id.data(),
        /*.seq_id_unq   =*/ data->seq_id_unq.data(),
        /*.seq_idx      =*/ data->seq_idx.data(),
        /*.output       =*/ data->output.data(),
        /*.data         =*/ data,
    };
    return ub;
}

} // namespace

//
// llama_ridgefill_context
//

std::string llama_ridgefill_context::check(const llama_context & lctx, const llama_ridgefill_maps * maps, llama_ridgefill_params & params) {
    const llama_model   & model   = lctx.get_model();
    const llama_hparams & hparams = model.hparams;
    const llama_cparams & cparams = lctx.get_cparams();
    const int32_t n_layer = (int32_t) hparams.n_layer();

    switch (model.arch) {
        case LLM_ARCH_LLAMA:
        case LLM_ARCH_QWEN3:
        case LLM_ARCH_GEMMA3:
        case LLM_ARCH_QWEN35:
            break;
        default:
            return format("architecture '%s' is not supported by RidgeFill prefill (supported: llama, qwen3, gemma3, qwen35)",
                    llm_arch_name(model.arch));
    }
    if (model.arch == LLM_ARCH_LLAMA && hparams.n_expert > 0) {
        return "mixture-of-experts llama models are not supported by RidgeFill prefill";
    }

    if (maps) {
        if (&maps->model != &model) {
            return "the maps were loaded for another model (llama_ridgefill_maps_init with this model)";
        }
        if (params.split_layer < 0) {
            params.split_layer = maps->split_layer;
        } else if (params.split_layer != maps->split_layer) {
            return format("split %d requested, but the maps were fitted for split %d", params.split_layer, maps->split_layer);
        }
    } else if (params.split_layer < 0) {
        return "identity fill (no maps) needs a split layer";
    }
    if (params.split_layer < 1 || params.split_layer > n_layer) {
        return format("split %d outside 1..%d (the model has %d layers; %d = stock prefill)",
                params.split_layer, n_layer, n_layer, n_layer);
    }
    if (params.n_tail < 1) {
        return format("tail %d: at least the last prompt row must be exact (tail >= 1)", params.n_tail);
    }
    if (!std::isfinite(params.exact_fraction) || params.exact_fraction < 0.0 || params.exact_fraction > 1.0) {
        return format("exact_fraction %g outside [0, 1]", params.exact_fraction);
    }
    if (params.selector < LLAMA_RIDGEFILL_SELECTOR_NONE || params.selector > LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED) {
        return format("unknown selector %d", params.selector);
    }
    const int32_t all_classes = LLAMA_RIDGEFILL_CLASS_DIGIT | LLAMA_RIDGEFILL_CLASS_RARE | LLAMA_RIDGEFILL_CLASS_LINE_START |
                                LLAMA_RIDGEFILL_CLASS_SINK;
    const bool uses_classes = params.selector == LLAMA_RIDGEFILL_SELECTOR_PROTECTED ||
                              params.selector == LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED;
    if (uses_classes &&
        (params.protected_classes == 0 || (params.protected_classes & ~all_classes) != 0)) {
        return format("protected selector: token classes 0x%x must be a non-empty set of llama_ridgefill_token_class bits",
                params.protected_classes);
    }
    if (params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE && params.split_layer < n_layer) {
        bool any = false;
        for (int32_t il = params.split_layer; il < n_layer; ++il) {
            any = any || rf_is_full_attention(hparams, il);
        }
        if (!any) {
            return format("no full-attention layer at or above split %d for the probe selector: use a shallower split or another selector",
                    params.split_layer);
        }
    }
    if (params.n_sel_queries < 1) {
        return format("n_sel_queries %d: the attention selector needs at least one query row", params.n_sel_queries);
    }
    if (params.n_rescale < 0) {
        return format("value rescale rows %d must be >= 0 (0: off)", params.n_rescale);
    }
    if (params.n_key_rescale < 0) {
        return format("key rescale rows %d must be >= 0 (0: off)", params.n_key_rescale);
    }
    if (params.min_prompt < 0 || params.n_fill_chunk < 0) {
        return "min_prompt and n_fill_chunk must be >= 0";
    }
    if (params.splice < LLAMA_RIDGEFILL_SPLICE_NONE || params.splice > LLAMA_RIDGEFILL_SPLICE_KV) {
        return format("unknown splice mode %d", params.splice);
    }
    if (params.state_correction < LLAMA_RIDGEFILL_STATE_CORRECTION_NONE || params.state_correction > LLAMA_RIDGEFILL_STATE_CORRECTION_GAIN) {
        return format("unknown state correction %d", params.state_correction);
    }
    if (params.state_correction == LLAMA_RIDGEFILL_STATE_CORRECTION_GAIN && params.split_layer < n_layer - 1) {
        bool any_recurrent = false;
        for (int32_t il = params.split_layer + 1; il < n_layer; ++il) {
            any_recurrent = any_recurrent || hparams.is_recr(il);
        }
        if (any_recurrent && !llama_ridgefill_maps_has_state_gains(maps)) {
            return "the state correction 'gain' needs maps with state gains (ridgefill-gguf fit --state-gains); "
                   "these maps have none (or identity fill has no maps)";
        }
    }
    if ((params.selector == LLAMA_RIDGEFILL_SELECTOR_ATTENTION || params.selector == LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED) &&
        params.split_layer < n_layer) {
        if (params.sel_layer < 0) {
            params.sel_layer = rf_default_sel_layer(hparams, params.split_layer);
            if (params.sel_layer < 0) {
                return format("no full-attention layer below split %d for the attention selector: use a deeper split or selector none",
                        params.split_layer);
            }
        } else if (params.sel_layer >= params.split_layer || !rf_is_full_attention(hparams, params.sel_layer)) {
            return format("selector layer %d must be a full-attention layer below the split %d", params.sel_layer, params.split_layer);
        }
    }

    if (cparams.embeddings) {
        return "embeddings contexts are not supported by RidgeFill prefill";
    }
    const rf_caches caches = rf_get_caches(lctx.get_memory());
    if (!caches.base) {
        return "RidgeFill prefill needs a KV-cache or hybrid memory (this model's memory is recurrent only)";
    }
    if (caches.recr && cparams.n_rs_seq > 0) {
        return format("recurrent-state rollback snapshots (n_rs_seq = %u) are not supported by RidgeFill prefill: "
                "create the context with n_rs_seq = 0", cparams.n_rs_seq);
    }
    if (caches.base->get_n_stream() != 1) {
        return "RidgeFill prefill needs a single KV stream (kv_unified = true, or n_seq_max = 1)";
    }
    if (caches.swa && caches.swa->get_size() < caches.base->get_size()) {
        return format("the sliding-window KV cache holds %u cells, fewer than the context (%u): filled and exact rows of "
                "sliding-window layers need their cells kept; create the context with swa_full = true",
                caches.swa->get_size(), caches.base->get_size());
    }
    return "";
}

llama_ridgefill_context::llama_ridgefill_context(llama_context & lctx, const llama_ridgefill_maps * maps, const llama_ridgefill_params & params) :
        lctx(lctx), model(lctx.get_model()), maps(maps), params(params) {
    const llama_hparams & hparams = model.hparams;

    n_layer   = (int32_t) hparams.n_layer();
    n_embd    = (int32_t) hparams.n_embd;
    const bool attention = params.selector == LLAMA_RIDGEFILL_SELECTOR_ATTENTION ||
                           params.selector == LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED;
    sel_layer = attention && params.split_layer < n_layer ? params.sel_layer : -1;

    const rf_caches caches = rf_get_caches(lctx.get_memory());
    const int64_t n_ctx   = lctx.get_cparams().n_ctx;
    const int64_t n_cells = caches.base->get_size();

    ggml_init_params ip = {
        /*.mem_size   =*/ 3*ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ctx_buf.reset(ggml_init(ip));
    xs     = ggml_new_tensor_2d(ctx_buf.get(), GGML_TYPE_F32, n_embd, n_ctx);
    xx     = ggml_new_tensor_2d(ctx_buf.get(), GGML_TYPE_F32, n_embd, n_ctx);
    scores = ggml_new_tensor_1d(ctx_buf.get(), GGML_TYPE_F32, n_cells);
    ggml_set_name(xs,     "ridgefill_xs");
    ggml_set_name(xx,     "ridgefill_xx");
    ggml_set_name(scores, "ridgefill_scores");

    // with the KV cache of the split layer
    ggml_backend_dev_t dev = model.dev_layer(std::min(params.split_layer, n_layer - 1));
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
    buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx_buf.get(), buft));
    if (!buf) {
        throw std::runtime_error(format("failed to allocate %.1f MiB for the RidgeFill row buffers on %s",
                (2.0*ggml_nbytes(xs) + ggml_nbytes(scores))/1024.0/1024.0, ggml_backend_dev_name(dev)));
    }
    ggml_backend_buffer_clear(buf.get(), 0);
    LLAMA_LOG_INFO("%s: RidgeFill attached: split %d of %d, %s, tail %d, selector %s (%.3g, layer %d), value rescale %d, "
            "row buffers %.1f MiB on %s\n", __func__, params.split_layer, n_layer, maps ? "ridge maps" : "identity fill",
            params.n_tail, sel_layer >= 0 ? "attention" : "none", params.exact_fraction, sel_layer, params.n_rescale,
            ggml_backend_buffer_get_size(buf.get())/1024.0/1024.0, ggml_backend_dev_name(dev));
}

llama_ridgefill_context::~llama_ridgefill_context() = default;

bool llama_ridgefill_context::check_batch(const llama_batch & batch) {
    if (!plan.active) {
        return true;
    }
    plan.nan_batch_idxs.clear();
    plan.out_rows.clear();

    const int32_t   N       = plan.pos_end - plan.pos0;
    const llama_pos tail0   = plan.pos_end - std::min(params.n_tail, N);
    bool            has_end = false;

    int32_t n_plan  = 0;
    int32_t n_other = 0;
    std::string err;

    for (int32_t i = 0; i < batch.n_tokens && err.empty(); ++i) {
        bool in_seq = false;
        for (int32_t s = 0; s < batch.n_seq_id[i]; ++s) {
            in_seq = in_seq || batch.seq_id[i][s] == plan.seq_id;
        }
        if (!in_seq) {
            n_other++;
            continue;
        }
        const llama_pos pos = batch.pos[i];
        if (batch.n_seq_id[i] != 1) {
            err = format("a row of the planned prompt (position %d) is shared with other sequences", pos);
        } else if (pos < plan.pos0 || pos >= plan.pos_end) {
            err = format("row at position %d of sequence %d is outside the planned prompt [%d, %d)",
                    pos, plan.seq_id, plan.pos0, plan.pos_end);
        }
        n_plan++;
        has_end = has_end || pos == plan.pos_end - 1;
    }
    if (err.empty() && n_plan > 0 && n_other > 0) {
        err = "a batch holds rows of the planned prompt and rows of other sequences";
    }
    if (err.empty() && n_plan > 0 && !batch.token && model.hparams.n_pos_per_embd() > 1) {
        err = "rows given as embeddings with multi-section positions (M-RoPE) are not supported by RidgeFill prefill";
    }
    if (!err.empty()) {
        llama_ridgefill_set_error("llama_decode", err + "; the RidgeFill plan is dropped and its rows removed");
        lctx.get_memory()->seq_rm(plan.seq_id, plan.pos0, -1);
        plan = {};
        return false;
    }

    // the rows' tokens (protected selector)
    if (batch.token && n_plan > 0) {
        for (int32_t i = 0; i < batch.n_tokens; ++i) {
            plan.tokens[batch.pos[i] - plan.pos0] = batch.token[i];
        }
    }

    // logits: tail rows brought by the call that ends the prompt get them (docs/method.md §4.5), others NaN
    for (int32_t i = 0; i < batch.n_tokens && n_plan > 0; ++i) {
        if (!batch.logits[i]) {
            continue;
        }
        if (has_end && batch.pos[i] >= tail0) {
            plan.out_rows.emplace_back(batch.pos[i], i);
        } else {
            plan.nan_batch_idxs.push_back(i);
        }
    }
    plan.pending = plan.pending || has_end;
    return true;
}

void llama_ridgefill_context::set_ubatch(const llama_ubatch & ubatch) {
    graph_active = false;
    timing.t_ubatch_us = ggml_time_us();
    if (!plan.active || ubatch.n_tokens == 0 || ubatch.seq_id[0][0] != plan.seq_id) {
        return; // check_batch: a ubatch holds planned rows only, or none
    }

    cur = {};
    cur.model    = &model;
    cur.maps     = maps;
    cur.split    = params.split_layer;
    cur.xs       = xs;
    cur.xx       = xx;
    cur.il_begin = 0;
    cur.il_end   = params.split_layer;
    cur.dst      = xs;
    cur.dst_rows.resize(ubatch.n_tokens);
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        cur.dst_rows[i] = ubatch.pos[i] - plan.pos0;
    }

    // the attention selector's query rows: the last n_sel_queries rows of the prompt
    if (sel_layer >= 0 && !plan.exact_set) {
        const llama_pos q0 = std::max(plan.pos0, plan.pos_end - params.n_sel_queries);
        for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
            if (ubatch.pos[i] >= q0) {
                cur.sel_ids.push_back(i);
            }
        }
        if (!cur.sel_ids.empty()) {
            cur.sel_layer = sel_layer;
            cur.scores    = scores;
        }
    }

    graph_active = true;
}

void llama_ridgefill_context::set_ubatch_done() {
    if (graph_active) {
        timing.early_us += ggml_time_us() - timing.t_ubatch_us;
        timing.n_early++;
    }
    graph_active = false;
}

bool llama_ridgefill_context::reserve() {
    const llama_hparams & hparams = model.hparams;
    const llama_cparams & cparams = lctx.get_cparams();
    const int32_t S = params.split_layer;
    if (S >= n_layer) {
        return true; // every prompt runs stock
    }
    const auto & capture = cparams.embeddings_layer_inp;
    if (std::find(capture.begin(), capture.end(), true) != capture.end()) {
        return true; // no plan begins while a layer-input capture is on; turning it off reserves again
    }

    const uint32_t n_tokens  = std::min(cparams.n_ctx, cparams.n_ubatch);
    const uint32_t max_nodes = lctx.graph_max_nodes(cparams.n_ubatch);
    if (!res_late) {
        res_late.reset(new llm_graph_result(max_nodes));
    }

    llama_memory_context_ptr mctx = lctx.get_memory()->init_full();
    if (!mctx) {
        return false;
    }

    std::vector<llama_pos> pos(n_tokens);
    std::iota(pos.begin(), pos.end(), 0);

    const uint32_t n_outputs_saved = lctx.n_outputs;
    ggml_backend_sched_t sched = lctx.sched.get();
    const rf_caches caches = rf_get_caches(lctx.get_memory());

    // the late layer a graph of phase `phase` runs (-1: none): the last layer (with logits; probe
    // selector: from the last full-attention layer, whose graph also scores), the first late layer
    // S (its graph is laid out differently: input from x_S, output stored for the next layer), and
    // the first recurrent late layer (a chunk of every row: filled and exact rows merged)
    auto late_layer = [&](int phase) -> int32_t {
        if (phase == 1) {
            int32_t il = n_layer - 1;
            if (params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE) {
                while (il > S && !rf_is_full_attention(hparams, il)) {
                    il--;
                }
            }
            return il;
        }
        if (phase == 2) {
            return S < n_layer - 1 ? S : -1;
        }
        // phases 3, 4
        for (int32_t il = S; il < n_layer; ++il) {
            if (hparams.is_recr(il)) {
                return il;
            }
        }
        return -1;
    };

    // the scheduler keeps the largest buffers of the graphs it reserves: an early ubatch and the
    // late graphs above (the recurrent one twice: with half of its rows filled, and all exact)
    bool ok = true;
    for (int phase = 0; phase < 5 && ok; ++phase) {
        const bool    late   = phase > 0;
        const int32_t il_res = late ? late_layer(phase) : -1;
        if (late && il_res < 0) {
            continue;
        }
        const bool last = late && (phase == 1 || il_res == n_layer - 1);
        const bool gdn  = late && hparams.is_recr(il_res);

        llama_ubatch ub = rf_make_ubatch(0, pos, false, hparams.n_pos_per_embd());

        cur = {};
        cur.model = &model;
        cur.maps  = maps;
        cur.split = S;
        cur.xs    = xs;
        cur.xx    = xx;
        if (!late) {
            // an early ubatch holding the selector's query rows
            cur.il_begin = 0;
            cur.il_end   = S;
            cur.dst      = xs;
            cur.dst_rows.assign(n_tokens, 0);
            if (sel_layer >= 0) {
                cur.sel_layer = sel_layer;
                cur.scores    = scores;
                cur.sel_ids.assign(std::min<uint32_t>(n_tokens, params.n_sel_queries), 0);
            }
        } else {
            // the late layer il_res on a chunk of n_tokens rows; n_x of them exact, reaching the output
            // (a recurrent layer's chunk: half of them filled, or none)
            const uint32_t n_f_gdn = gdn && phase == 3 ? n_tokens/2 : 0;
            const uint32_t n_x     = n_tokens - n_f_gdn;
            cur.il_begin = il_res;
            cur.il_end   = last ? n_layer : il_res + 1;
            cur.src      = il_res == S ? xs : xx;
            cur.src_rows.assign(n_x, 0);
            if (last) {
                cur.out_ids = { (int32_t) n_x - 1 };
            } else {
                cur.dst = xx;
                cur.dst_rows.assign(n_x, 0);
            }
        }
        if (gdn) {
            // filled rows get x̂ from the maps, exact rows their stored inputs, merged in order
            const uint32_t n_x = cur.src_rows.size();
            cur.gdn = true;
            cur.m_f_rows.assign(n_tokens - n_x, 0);
            cur.m_perm.resize(n_tokens);
            std::iota(cur.m_perm.begin(), cur.m_perm.end(), 0);
            cur.x_ids.resize(n_x);
            std::iota(cur.x_ids.begin(), cur.x_ids.end(), n_tokens - n_x);
        } else if (late) {
            // the fill and the value scale; the most filled rows a prompt can have, n_ctx - 1, in the
            // fill steps they need (the index inputs and the steps are as large as they get)
            const int32_t n_f     = std::max<int32_t>(1, (int32_t) cparams.n_ctx - 1);
            const int32_t n_chunk = fill_chunk(n_f);
            if (params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE && phase == 1 && rf_is_full_attention(hparams, il_res)) {
                cur.sel_layer = il_res;
                cur.scores    = scores;
                cur.sel_ids.assign(std::min<uint32_t>(n_tokens, params.n_sel_queries), 0);
            }
            cur.fill_layer = il_res;
            cur.n_chunk    = n_chunk;
            cur.f_rows.assign(n_f, 0);
            cur.f_pos.assign((size_t) n_f*hparams.n_pos_per_embd(), 0);
            cur.f_cells.assign(n_f, 0);
            if (hparams.is_swa_any()) {
                cur.f_cells_swa.assign(n_f, 0);
            }
            if (caches.base->get_v_trans()) {
                cur.f_vidx.assign((size_t) n_f*hparams.n_embd_v_gqa_max(), 0);
                if (caches.swa) {
                    cur.f_vidx_swa = cur.f_vidx;
                }
            }
            const int32_t n_r = std::min(params.n_rescale, params.n_tail);
            cur.r_src = il_res == S ? xs : xx;
            cur.r_src_rows.assign(n_r, 0);
            cur.r_rows.assign(n_r, 0);
            const int32_t n_rk = std::min(params.n_key_rescale, params.n_tail);
            cur.rk_src_rows.assign(n_rk, 0);
            cur.rk_rows.assign(n_rk, 0);
        }

        lctx.n_outputs = last ? 1 : 0;
        ggml_backend_sched_reset(sched);
        res_late->reset();
        graph_active = true;
        const auto gparams = lctx.graph_params(res_late.get(), ub, mctx.get(), LLM_GRAPH_TYPE_DECODER);
        ggml_cgraph * gf = model.build_graph(gparams);
        graph_active = false;
        ok = gf && ggml_backend_sched_reserve(sched, gf);
    }
    lctx.n_outputs = n_outputs_saved;
    res_late->reset();
    cur = {};

    // the scheduler no longer holds the previous graph; the compute buffers are what is expected now
    lctx.gf_res_prev_active = nullptr;
    for (size_t i = 0; i < lctx.backend_ptrs.size(); ++i) {
        lctx.backend_buf_exp_size[i] = ggml_backend_sched_get_buffer_size(sched, lctx.backend_ptrs[i]);
    }
    return ok;
}

int32_t llama_ridgefill_context::fill_chunk(int32_t n_f) const {
    const uint32_t n_ubatch  = lctx.get_cparams().n_ubatch;
    const int32_t  max_steps = std::max<int32_t>(1, ((int32_t) lctx.graph_max_nodes(n_ubatch)/2 - 256)/40);
    const int32_t  n_chunk   = params.n_fill_chunk > 0 ? params.n_fill_chunk : (int32_t) n_ubatch;
    return std::max({ 1, n_chunk, (n_f + max_steps - 1)/max_steps });
}

std::vector<llama_pos> llama_ridgefill_context::select_exact(const llama_ridgefill_plan & p, const std::vector<int64_t> & cells, int32_t n_prefix) {
    last_scores.clear();
    if (p.exact_set) {
        return p.exact; // the caller's positions override any selector
    }

    const int32_t k = rf_n_selected(n_prefix, params.exact_fraction);

    // prefix rows by score, highest first (ties: the earlier row): the scores accumulated per cell in
    // the early phase (attention) or the probe pass (probe), for the planned rows
    auto by_score = [&]() {
        std::vector<float> sc(ggml_nelements(scores));
        ggml_backend_tensor_get(scores, sc.data(), 0, ggml_nbytes(scores));
        last_scores.resize(cells.size());
        for (size_t j = 0; j < cells.size(); ++j) {
            last_scores[j] = sc[cells[j]];
        }
        std::vector<int32_t> order(n_prefix);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return last_scores[a] > last_scores[b]; });
        return order;
    };

    // prefix rows in a protected class: sink rows first, then digits, then once-in-the-prompt tokens,
    // then line starts; within a class rarer tokens (fewer occurrences in the prompt) first, then the
    // earlier row
    auto protected_rows = [&]() {
        const llama_vocab & vocab = model.vocab;
        const int32_t N = (int32_t) p.tokens.size();
        std::unordered_map<llama_token, int32_t> count;
        for (llama_token t : p.tokens) {
            if (t != LLAMA_TOKEN_NULL) {
                count[t]++;
            }
        }
        auto known = [&](llama_token t) {
            return t != LLAMA_TOKEN_NULL && t >= 0 && t < (llama_token) vocab.n_tokens();
        };
        struct cand { int32_t rank; int32_t count; int32_t j; };
        std::vector<cand> cands;
        for (int32_t j = 0; j < std::min(n_prefix, N); ++j) {
            const llama_token t = p.tokens[j];
            int32_t cls = 0;
            if (p.pos0 + j < LLAMA_RIDGEFILL_N_SINK) {
                cls |= LLAMA_RIDGEFILL_CLASS_SINK;
            }
            if (known(t) && !vocab.is_control(t)) {
                const std::string & piece = vocab.token_to_piece(t);
                if (std::any_of(piece.begin(), piece.end(), [](char c) { return c >= '0' && c <= '9'; })) {
                    cls |= LLAMA_RIDGEFILL_CLASS_DIGIT;
                }
                if (count[t] == 1) {
                    cls |= LLAMA_RIDGEFILL_CLASS_RARE;
                }
                if (j > 0 && known(p.tokens[j - 1])) {
                    const std::string & prev = vocab.token_to_piece(p.tokens[j - 1]);
                    if (!prev.empty() && prev.back() == '\n') {
                        cls |= LLAMA_RIDGEFILL_CLASS_LINE_START;
                    }
                }
            }
            cls &= params.protected_classes;
            if (cls) {
                const int32_t rank = (cls & LLAMA_RIDGEFILL_CLASS_SINK)  ? 0 :
                                     (cls & LLAMA_RIDGEFILL_CLASS_DIGIT) ? 1 :
                                     (cls & LLAMA_RIDGEFILL_CLASS_RARE)  ? 2 : 3;
                cands.push_back({ rank, known(t) ? count[t] : 0, j });
            }
        }
        std::sort(cands.begin(), cands.end(), [](const cand & a, const cand & b) {
            return std::tie(a.rank, a.count, a.j) < std::tie(b.rank, b.count, b.j);
        });
        std::vector<int32_t> rows;
        for (const cand & c : cands) {
            rows.push_back(c.j);
        }
        return rows;
    };

    // the first k distinct rows of the lists, in turn
    std::vector<char> chosen(n_prefix, 0);
    std::vector<llama_pos> exact;
    auto take = [&](const std::vector<int32_t> & rows) {
        for (size_t i = 0; i < rows.size() && (int32_t) exact.size() < k; ++i) {
            if (!chosen[rows[i]]) {
                chosen[rows[i]] = 1;
                exact.push_back(p.pos0 + rows[i]);
            }
        }
    };

    switch (params.selector) {
        case LLAMA_RIDGEFILL_SELECTOR_NONE:
            break;
        case LLAMA_RIDGEFILL_SELECTOR_ATTENTION:
            if (sel_layer >= 0) {
                take(by_score());
            }
            break;
        case LLAMA_RIDGEFILL_SELECTOR_PROBE:
            take(by_score());
            break;
        case LLAMA_RIDGEFILL_SELECTOR_PROTECTED:
            take(protected_rows());
            break;
        case LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED:
            take(protected_rows());
            if (sel_layer >= 0) {
                take(by_score());
            }
            break;
        default:
            GGML_ABORT("unknown selector %d", params.selector);
    }
    std::sort(exact.begin(), exact.end());
    return exact;
}

int llama_ridgefill_context::decode_done(llama_context & lctx) {
    if (!plan.active) {
        return 0;
    }
    if (!plan.nan_batch_idxs.empty()) {
        const int64_t n_vocab = model.vocab.n_tokens();
        for (int32_t i : plan.nan_batch_idxs) {
            if (float * dst = lctx.get_logits_ith(i)) {
                std::fill(dst, dst + n_vocab, NAN);
            }
        }
        plan.nan_batch_idxs.clear();
    }
    return plan.pending ? finish(lctx) : 0;
}

int llama_ridgefill_context::finish(llama_context & lctx) {
    const int64_t t_start_us = ggml_time_us();

    // the early phase's graphs may still run (llama_context::decode does not wait): the selector's
    // scores are read below
    ggml_backend_sched_synchronize(lctx.sched.get());

    const llama_hparams & hparams = model.hparams;
    const llama_ridgefill_plan p = plan;
    plan = {};

    const int32_t S        = params.split_layer;
    const int32_t N        = p.pos_end - p.pos0;
    const int32_t T        = std::min(params.n_tail, N);
    const int32_t n_prefix = N - T;

    auto fail = [&](const std::string & msg) {
        llama_ridgefill_set_error("llama_decode", msg + "; the prompt's rows are removed");
        lctx.get_memory()->seq_rm(p.seq_id, p.pos0, -1);
        lctx.gf_res_prev_active = nullptr;
        cur = {};
        return -3;
    };

    // the cells of the planned rows
    const rf_caches caches = rf_get_caches(lctx.get_memory());
    const std::vector<int64_t> cells     = rf_find_cells(caches.base, p.seq_id, p.pos0, N);
    const std::vector<int64_t> cells_swa = caches.swa ? rf_find_cells(caches.swa, p.seq_id, p.pos0, N) : std::vector<int64_t>();
    if (std::find(cells.begin(), cells.end(), -1) != cells.end() ||
        std::find(cells_swa.begin(), cells_swa.end(), -1) != cells_swa.end()) {
        return fail("a row of the planned prompt is missing from the KV cache (removed while the plan was in progress?)");
    }

    const uint32_t n_ubatch  = lctx.get_cparams().n_ubatch;
    const uint32_t max_nodes = lctx.graph_max_nodes(n_ubatch);

    // the graph fields of a pass that fills the rows not marked exact, and the exact rows X, in
    // position order (the tail last)
    auto set_roles = [&](const std::vector<char> & is_exact, std::vector<int32_t> & X) {
        cur = {};
        X.clear();
        for (int32_t j = 0; j < N; ++j) {
            if (is_exact[j]) {
                X.push_back(j);
            } else {
                cur.f_rows.push_back(j);
                cur.f_pos.push_back(p.pos0 + j);
                cur.f_cells.push_back(cells[j]);
                if (caches.swa) {
                    cur.f_cells_swa.push_back(cells_swa[j]);
                }
            }
        }
        const int32_t n_f = cur.f_rows.size();
        cur.n_chunk = fill_chunk(n_f);
        const uint32_t n_pos = hparams.n_pos_per_embd();
        if (n_pos > 1) {
            // M-RoPE: each fill step's positions section-major
            std::vector<int32_t> sections((size_t) n_f*n_pos);
            for (int32_t i0 = 0; i0 < n_f; i0 += cur.n_chunk) {
                rf_text_positions(cur.f_pos.data() + i0, std::min(cur.n_chunk, n_f - i0), n_pos, sections.data() + (size_t) i0*n_pos);
            }
            cur.f_pos = std::move(sections);
        }
        if (caches.base->get_v_trans()) {
            const int64_t n_embd_v = hparams.n_embd_v_gqa_max();
            auto fill_vidx = [&](const llama_kv_cache * kv, const std::vector<int64_t> & c, std::vector<int64_t> & out) {
                const int64_t kv_size = kv->get_size();
                out.resize(c.size()*n_embd_v);
                for (size_t i = 0; i < c.size(); ++i) {
                    for (int64_t e = 0; e < n_embd_v; ++e) {
                        out[i*n_embd_v + e] = e*kv_size + c[i];
                    }
                }
            };
            fill_vidx(caches.base, cur.f_cells, cur.f_vidx);
            if (caches.swa) {
                fill_vidx(caches.swa, cur.f_cells_swa, cur.f_vidx_swa);
            }
        }
    };

    const int32_t n_scale_rows = std::min(params.n_rescale, T);
    const int32_t n_key_rows   = std::min(params.n_key_rescale, T);

    if (!res_late) {
        res_late.reset(new llm_graph_result(max_nodes));
    }

    const uint32_t n_head_kv_max = [&]() {
        uint32_t n = 0;
        for (int32_t il = S; il < n_layer; ++il) {
            n = std::max(n, hparams.n_head_kv(il));
        }
        return n;
    }();
    last_v_scales.assign((size_t) (n_layer - S)*n_head_kv_max, 1.0f);
    last_k_scales.assign(n_key_rows > 0 ? (size_t) (n_layer - S)*n_head_kv_max : 0, 1.0f);

    std::vector<char>    is_exact(N, 0);
    std::vector<int32_t> X;
    std::fill(is_exact.begin() + n_prefix, is_exact.end(), 1);

    std::vector<llama_pos> exact;
    int32_t n_probe = 0;
    std::string err;
    boundary_states.clear();

    if (params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE && !p.exact_set) {
        // probe pass (docs/method.md §5): every prefix row filled (with the value and key scales of this
        // pass), the tail runs the late layers against the filled cache and its last rows score the
        // prefix at every full-attention late layer; the selected rows then run the late layers
        // exactly, with the tail again (it attends to them), over the cells the probe filled
        set_roles(is_exact, X);
        ggml_backend_tensor_memset(scores, 0, 0, ggml_nbytes(scores));
        // the probe pass runs the late recurrent layers over every row: their states are put back
        // for the second pass (a sequence from position 0 starts from zero anyway)
        std::map<int32_t, std::vector<float>> saved;
        const int32_t rs_cell = rf_recr_cell(caches.recr, p.seq_id);
        if (caches.recr && rs_cell >= 0 && p.pos0 > 0) {
            for (int32_t il = S; il < n_layer; ++il) {
                if (hparams.is_recr(il)) {
                    saved[il] = rf_read_state(caches.recr, il, rs_cell);
                }
            }
        }
        err = run_late(lctx, p, X, cells, cells_swa, /*fill =*/ true, std::min(params.n_sel_queries, T), /*logits =*/ true);
        if (!err.empty()) {
            return fail(err);
        }
        for (const auto & [il, state] : saved) {
            rf_write_state(caches.recr, il, rs_cell, state);
        }
        exact = select_exact(p, cells, n_prefix);
        if (!exact.empty()) {
            for (llama_pos pos : exact) {
                is_exact[pos - p.pos0] = 1;
            }
            set_roles(is_exact, X);
            n_probe = T;
            err = run_late(lctx, p, X, cells, cells_swa, /*fill =*/ false, 0, /*logits =*/ true);
        }
    } else {
        exact = select_exact(p, cells, n_prefix);
        for (llama_pos pos : exact) {
            is_exact[pos - p.pos0] = 1;
        }
        set_roles(is_exact, X);
        err = run_late(lctx, p, X, cells, cells_swa, /*fill =*/ true, 0, /*logits =*/ true);
    }
    if (!err.empty()) {
        return fail(err);
    }
    const int32_t n_x = X.size();
    const int32_t n_f = N - n_x;

    // the scheduler now holds the late-phase graph: the next decode builds its own
    lctx.gf_res_prev_active = nullptr;
    cur = {};

    last_exact = exact;

    const double r = double(S)/n_layer + (1.0 - double(S)/n_layer)*double(n_x + n_probe)/N;
    stats = {};
    stats.active       = 1;
    stats.seq_id       = p.seq_id;
    stats.pos0         = p.pos0;
    stats.n_prompt     = N;
    stats.n_layer      = n_layer;
    stats.split_layer  = S;
    stats.n_tail       = T;
    stats.n_exact      = (int32_t) exact.size();
    stats.n_filled     = n_f;
    stats.sel_layer    = p.exact_set ? -1 : params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE ? S : sel_layer;
    stats.n_scale_rows = n_scale_rows;
    stats.ceiling      = (float) (1.0/r);
    stats.n_probe      = n_probe;
    stats.t_late_ms    = (ggml_time_us() - t_start_us)/1000.0;

    // LLAMA_RIDGEFILL_TIMING=1: where the time of this prompt went
    if (const char * env = getenv("LLAMA_RIDGEFILL_TIMING"); env && atoi(env) > 0) {
        LLAMA_LOG_INFO("%s: RidgeFill timing: early phase %d ubatches %.1f ms (graph + launch, compute may be async); "
                "late phase %.1f ms: %d graphs (%lld nodes), build %.1f ms, alloc %.1f ms, inputs %.1f ms, "
                "compute %.1f ms, other %.1f ms\n", __func__, timing.n_early, timing.early_us/1000.0, stats.t_late_ms,
                timing.n_graphs, (long long) timing.n_nodes, timing.build_us/1000.0, timing.alloc_us/1000.0,
                timing.inputs_us/1000.0, timing.compute_us/1000.0,
                stats.t_late_ms - (timing.build_us + timing.alloc_us + timing.inputs_us + timing.compute_us)/1000.0);
    }
    timing = {};

    return 0;
}

std::string llama_ridgefill_context::run_late(llama_context & lctx, const llama_ridgefill_plan & p, const std::vector<int32_t> & X,
        const std::vector<int64_t> & cells, const std::vector<int64_t> & cells_swa, bool fill, int32_t n_query, bool logits) {
    const llama_hparams & hparams = model.hparams;
    const rf_caches caches = rf_get_caches(lctx.get_memory());

    const int32_t S        = params.split_layer;
    const int32_t N        = p.pos_end - p.pos0;
    const int32_t T        = std::min(params.n_tail, N);
    const int32_t n_prefix = N - T;
    const int32_t n_x      = X.size();
    GGML_ASSERT(n_x >= T && X[n_x - T] == n_prefix);

    const uint32_t n_ubatch = lctx.get_cparams().n_ubatch;
    const uint32_t n_pos    = hparams.n_pos_per_embd();
    const int32_t n_scale_rows = fill ? std::min(params.n_rescale, T) : 0;
    const int32_t n_key_rows   = fill ? std::min(params.n_key_rescale, T) : 0;
    const size_t  n_head_kv_max = last_v_scales.size()/(n_layer - S);

    // hybrid models: the recurrent cell of the sequence, whose late layers' states continue here
    const int32_t rs_cell = rf_recr_cell(caches.recr, p.seq_id);
    if (caches.recr && rs_cell < 0) {
        return format("sequence %d has no recurrent state", p.seq_id);
    }

    // the row of each planned row among the exact rows X (the row of xx holding its state), -1: filled
    std::vector<int32_t> xi(N, -1);
    for (int32_t k = 0; k < n_x; ++k) {
        xi[X[k]] = k;
    }
    std::vector<int32_t> all_rows(N);
    std::iota(all_rows.begin(), all_rows.end(), 0);

    cur.model  = &model;
    cur.maps   = maps;
    cur.split  = S;
    cur.xs     = xs;
    cur.xx     = xx;
    cur.dst    = xx;
    cur.splice = params.splice;
    cur.r_rows.clear();
    cur.rk_rows.clear();
    for (int32_t i = 0; i < n_scale_rows; ++i) {
        cur.r_rows.push_back(n_prefix + i);
    }
    for (int32_t i = 0; i < n_key_rows; ++i) {
        cur.rk_rows.push_back(n_prefix + i);
    }

    const uint32_t n_outputs_saved = lctx.n_outputs;
    ggml_backend_sched_t sched = lctx.sched.get();
    std::string err;

    // the late layers, layer-major. Within an attention layer the exact rows in chunks of n_ubatch,
    // in position order (a chunk attends to the rows of the chunks before it, already written);
    // within a recurrent layer every row in position order, in chunks of n_ubatch that start anew at
    // the tail (its first chunk may start from the corrected state)
    for (int32_t il = S; il < n_layer && err.empty(); ++il) {
        const bool last_layer = il == n_layer - 1;
        const bool recurrent  = hparams.is_recr(il);
        const bool probe      = n_query > 0 && rf_is_full_attention(hparams, il);

        const std::vector<int32_t> & rows = recurrent ? all_rows : X;
        std::vector<std::pair<int32_t, int32_t>> chunks;
        for (int32_t c0 = 0; c0 < (int32_t) rows.size(); ) {
            const int32_t end = recurrent && c0 < n_prefix ? n_prefix : (int32_t) rows.size();
            const int32_t c1  = std::min<int32_t>(c0 + n_ubatch, end);
            chunks.emplace_back(c0, c1);
            c0 = c1;
        }

        for (const auto & [c0, c1] : chunks) {
            const int32_t nc = c1 - c0;

            std::vector<llama_pos> pos(nc);
            std::vector<uint32_t>  kc(nc), kc_swa(caches.swa ? nc : 0);
            for (int32_t i = 0; i < nc; ++i) {
                const int32_t j = rows[c0 + i];
                pos[i] = p.pos0 + j;
                kc[i]  = cells[j];
                if (caches.swa) {
                    kc_swa[i] = cells_swa[j];
                }
            }
            llama_ubatch ub = rf_make_ubatch(p.seq_id, pos, false, n_pos);

            cur.il_begin = il;
            cur.il_end   = last_layer ? n_layer : il + 1;
            cur.src      = il == S ? xs : xx;
            cur.gdn      = recurrent;
            cur.src_rows.clear();
            cur.dst_rows.clear();
            cur.m_f_rows.clear();
            cur.m_perm.clear();
            cur.x_ids.clear();
            cur.out_ids.clear();
            cur.state_gain = nullptr;

            // the graph's rows that reach the output: ubatch rows (all of them, or the exact ones)
            std::vector<int32_t> out_rows;
            if (recurrent) {
                // filled rows feed the state from x̂ (xs row j), exact rows run the layer (xs row j at
                // the split layer, their carried state after it)
                int32_t n_f = 0;
                for (int32_t i = 0; i < nc; ++i) {
                    n_f += xi[rows[c0 + i]] < 0;
                }
                int32_t k_f = 0;
                for (int32_t i = 0; i < nc; ++i) {
                    const int32_t j = rows[c0 + i];
                    if (xi[j] < 0) {
                        cur.m_f_rows.push_back(j);
                        cur.m_perm.push_back(k_f++);
                    } else {
                        cur.m_perm.push_back(n_f + (int32_t) cur.x_ids.size());
                        cur.x_ids.push_back(i);
                        cur.src_rows.push_back(il == S ? j : xi[j]);
                        cur.dst_rows.push_back(xi[j]);
                    }
                }
                out_rows = cur.x_ids;
                // the terminal-state correction: the tail's first chunk starts from the corrected state
                if (c0 == n_prefix && params.state_correction == LLAMA_RIDGEFILL_STATE_CORRECTION_GAIN && maps &&
                    il < (int32_t) maps->g.size()) {
                    cur.state_gain = maps->g[il];
                }
                cur.fill_layer = -1;
                cur.r_src_rows.clear();
                cur.rk_src_rows.clear();
                cur.sel_ids.clear();
            } else {
                for (int32_t i = 0; i < nc; ++i) {
                    const int32_t j = rows[c0 + i];
                    cur.src_rows.push_back(il == S ? j : xi[j]);
                    cur.dst_rows.push_back(xi[j]);
                    out_rows.push_back(i);
                }
                cur.fill_layer = fill && c0 == 0 ? il : -1;
                cur.r_src      = il == S ? xs : xx;
                cur.r_src_rows.clear();
                for (int32_t i = 0; i < n_scale_rows; ++i) {
                    cur.r_src_rows.push_back(il == S ? n_prefix + i : n_x - T + i);
                }
                cur.rk_src_rows.clear();
                for (int32_t i = 0; i < n_key_rows; ++i) {
                    cur.rk_src_rows.push_back(il == S ? n_prefix + i : n_x - T + i);
                }
                // the probe's query rows: the last n_query rows of X
                cur.sel_ids.clear();
                if (probe) {
                    for (int32_t i = 0; i < nc; ++i) {
                        if (c0 + i >= n_x - n_query) {
                            cur.sel_ids.push_back(i);
                        }
                    }
                }
            }
            cur.sel_layer = cur.sel_ids.empty() ? -1 : il;
            cur.scores    = cur.sel_ids.empty() ? nullptr : scores;
            cur.inp     = nullptr;
            cur.v_scale = nullptr;
            cur.k_scale = nullptr;

            // the last layer outputs the logits of the rows that asked for them (at least one row when
            // the graph has rows that reach the output: a graph needs an output; a row nobody asked
            // for is discarded)
            std::vector<int32_t> out_idx; // batch index per output row, -1: discarded
            if (last_layer && !out_rows.empty()) {
                for (size_t k = 0; k < out_rows.size() && logits; ++k) {
                    const int32_t i = out_rows[k];
                    for (const auto & [op, bi] : p.out_rows) {
                        if (op == pos[i]) {
                            ub.output[i] = 1;
                            cur.out_ids.push_back((int32_t) k);
                            out_idx.push_back(bi);
                        }
                    }
                }
                if (out_idx.empty()) {
                    ub.output[out_rows.back()] = 1;
                    cur.out_ids.push_back((int32_t) out_rows.size() - 1);
                    out_idx.push_back(-1);
                }
            }

            // the splice test: the tail starts from the given state (the graphs before wrote the cell)
            if (recurrent && c0 == n_prefix && splice_states.count(il)) {
                ggml_backend_sched_synchronize(sched);
                rf_write_state(caches.recr, il, rs_cell, splice_states.at(il));
            }

            const bool rs_zero = recurrent && p.pos0 == 0 && c0 == 0; // a new sequence starts from a zero state
            llama_memory_context_ptr mctx = rf_reuse_context(caches, p.seq_id, ub, kc, kc_swa, rs_cell, rs_zero);
            if (!mctx->apply()) {
                err = "failed to address the memory of the late rows";
                break;
            }

            lctx.n_outputs = (int32_t) out_idx.size();

            llm_graph_result * res = res_late.get();
            const int64_t t0 = ggml_time_us();
            res->reset();
            ggml_backend_sched_reset(sched);
            ggml_backend_sched_set_eval_callback(sched, lctx.get_cparams().cb_eval, lctx.get_cparams().cb_eval_user_data);

            graph_active = true;
            const auto gparams = lctx.graph_params(res, ub, mctx.get(), LLM_GRAPH_TYPE_DECODER);
            ggml_cgraph * gf = model.build_graph(gparams);
            graph_active = false;
            const int64_t t1 = ggml_time_us();

            if (!gf || !ggml_backend_sched_alloc_graph(sched, gf)) {
                err = format("failed to build or allocate the late-phase graph of layer %d", il);
                break;
            }
            const int64_t t2 = ggml_time_us();
            res->set_inputs(&ub);
            const int64_t t3 = ggml_time_us();
            if (lctx.graph_compute(gf, true) != GGML_STATUS_SUCCESS) {
                err = format("failed to compute the late-phase graph of layer %d", il);
                break;
            }
            // wait only for results read back here; otherwise the next graph is built while this one
            // runs, as llama_context::decode does with its ubatches
            const bool record = recurrent && c1 == n_prefix && record_boundary;
            if (cur.v_scale || cur.k_scale || record || !out_idx.empty()) {
                ggml_backend_sched_synchronize(sched);
            }
            const int64_t t4 = ggml_time_us();
            timing.n_graphs++;
            timing.n_nodes   += ggml_graph_n_nodes(gf);
            timing.build_us  += t1 - t0;
            timing.alloc_us  += t2 - t1;
            timing.inputs_us += t3 - t2;
            timing.compute_us += t4 - t3;

            if (cur.v_scale) {
                ggml_backend_tensor_get(cur.v_scale, last_v_scales.data() + (size_t) (il - S)*n_head_kv_max, 0, ggml_nbytes(cur.v_scale));
            }
            if (cur.k_scale) {
                ggml_backend_tensor_get(cur.k_scale, last_k_scales.data() + (size_t) (il - S)*n_head_kv_max, 0, ggml_nbytes(cur.k_scale));
            }
            if (record) {
                // the state after the last prefix row, before any correction
                boundary_states[il] = rf_read_state(caches.recr, il, rs_cell);
            }
            if (!out_idx.empty()) {
                ggml_tensor * t_logits = res->get_logits();
                GGML_ASSERT(t_logits != nullptr && t_logits->ne[1] == (int64_t) out_idx.size());
                lctx.n_outputs = n_outputs_saved;
                for (size_t k = 0; k < out_idx.size(); ++k) {
                    if (out_idx[k] < 0) {
                        continue;
                    }
                    float * dst = lctx.get_logits_ith(out_idx[k]);
                    if (dst == nullptr) {
                        err = "no logits row for a tail row that asked for logits";
                        break;
                    }
                    ggml_backend_tensor_get(t_logits, dst, k*t_logits->nb[1], t_logits->nb[1]);
                }
            }
        }
    }

    lctx.n_outputs = n_outputs_saved;
    return err;
}

//
// C API
//

static llama_ridgefill_context * rf_get(llama_context * ctx, const char * func) {
    if (ctx == nullptr || !ctx->ridgefill) {
        llama_ridgefill_set_error(func, "no RidgeFill attached to this context (llama_ridgefill_attach)");
        return nullptr;
    }
    return ctx->ridgefill.get();
}

// copy up to n elements of v to out (when out is not NULL); the number of elements there are
template <typename T>
static int32_t rf_copy_out(const std::vector<T> & v, T * out, int32_t n) {
    const int32_t m = (int32_t) v.size();
    if (out) {
        std::copy_n(v.begin(), std::min(m, std::max(n, 0)), out);
    }
    return m;
}

struct llama_ridgefill_params llama_ridgefill_default_params(void) {
    llama_ridgefill_params p = {
        /*.split_layer    =*/ -1,
        /*.n_tail         =*/ 64,
        /*.exact_fraction =*/ 0.10,
        /*.selector       =*/ LLAMA_RIDGEFILL_SELECTOR_ATTENTION,
        /*.n_sel_queries  =*/ 64,
        /*.sel_layer      =*/ -1,
        /*.n_rescale      =*/ 512,
        /*.min_prompt     =*/ 1024,
        /*.n_fill_chunk   =*/ 0,
        /*.splice         =*/ LLAMA_RIDGEFILL_SPLICE_NONE,
        /*.n_key_rescale  =*/ 0,
        /*.protected_classes =*/ LLAMA_RIDGEFILL_CLASS_SINK | LLAMA_RIDGEFILL_CLASS_DIGIT,
        /*.state_correction  =*/ LLAMA_RIDGEFILL_STATE_CORRECTION_NONE,
    };
    return p;
}

int32_t llama_ridgefill_attach(struct llama_context * ctx, const struct llama_ridgefill_maps * maps, struct llama_ridgefill_params params) {
    if (ctx == nullptr) {
        llama_ridgefill_set_error(__func__, "no context");
        return -1;
    }
    const std::string err = llama_ridgefill_context::check(*ctx, maps, params);
    if (!err.empty()) {
        llama_ridgefill_set_error(__func__, err);
        return -1;
    }
    try {
        ctx->ridgefill.reset();
        ctx->ridgefill = std::make_unique<llama_ridgefill_context>(*ctx, maps, params);
        if (!ctx->ridgefill->reserve()) {
            throw std::runtime_error("failed to reserve the compute buffers of the RidgeFill phases");
        }
    } catch (const std::exception & e) {
        ctx->ridgefill.reset();
        llama_ridgefill_set_error(__func__, e.what());
        return -1;
    }
    llama_ridgefill_clear_error();
    return 0;
}

void llama_ridgefill_detach(struct llama_context * ctx) {
    if (ctx) {
        ctx->ridgefill.reset();
    }
}

int32_t llama_ridgefill_begin(struct llama_context * ctx, llama_seq_id seq_id, llama_pos pos0, llama_pos pos_end) {
    auto * rf = rf_get(ctx, __func__);
    if (!rf) {
        return -1;
    }
    auto & plan = rf->plan;
    if (plan.active) {
        llama_ridgefill_set_error(__func__, format("a planned prompt is in progress (sequence %d, rows [%d, %d)): "
                "decode its rows, or llama_ridgefill_cancel", plan.seq_id, plan.pos0, plan.pos_end));
        return -1;
    }
    const uint32_t n_ctx = ctx->get_cparams().n_ctx;
    if (seq_id < 0 || seq_id >= (llama_seq_id) LLAMA_MAX_SEQ) {
        llama_ridgefill_set_error(__func__, format("invalid sequence %d", seq_id));
        return -1;
    }
    if (pos0 < 0 || pos_end <= pos0) {
        llama_ridgefill_set_error(__func__, format("empty or invalid prompt rows [%d, %d)", pos0, pos_end));
        return -1;
    }
    if ((uint32_t) (pos_end - pos0) > n_ctx) {
        llama_ridgefill_set_error(__func__, format("the prompt has %d rows, more than the context size %u",
                pos_end - pos0, n_ctx));
        return -1;
    }
    llama_ridgefill_clear_error();

    const int32_t N = pos_end - pos0;
    const auto & p = rf->params;
    if (p.split_layer >= rf->n_layer || N <= p.n_tail || N < p.min_prompt) {
        return 0; // degenerate: stock prefill (docs/method.md §4.6)
    }

    // a layer-input capture needs every layer of every row in the graph; a planned prompt's graphs
    // run some of them
    const auto & capture = ctx->get_cparams().embeddings_layer_inp;
    if (std::find(capture.begin(), capture.end(), true) != capture.end()) {
        llama_ridgefill_set_error(__func__, "a layer-input capture is enabled (llama_ridgefill_capture_layer_input): "
                "RidgeFill prefill does not run every layer of every row; disable the capture first");
        return -1;
    }

    plan = {};
    plan.active  = true;
    plan.seq_id  = seq_id;
    plan.pos0    = pos0;
    plan.pos_end = pos_end;
    plan.tokens.assign(N, LLAMA_TOKEN_NULL);
    if (rf->sel_layer >= 0) {
        ggml_backend_tensor_memset(rf->scores, 0, 0, ggml_nbytes(rf->scores));
    }
    return 1;
}

int32_t llama_ridgefill_set_exact(struct llama_context * ctx, const llama_pos * pos, int32_t n) {
    auto * rf = rf_get(ctx, __func__);
    if (!rf) {
        return -1;
    }
    auto & plan = rf->plan;
    if (!plan.active || plan.pending) {
        llama_ridgefill_set_error(__func__, "no planned prompt waiting for its rows (llama_ridgefill_begin)");
        return -1;
    }
    if (n < 0 || (n > 0 && pos == nullptr)) {
        llama_ridgefill_set_error(__func__, "invalid position list");
        return -1;
    }
    const int32_t N = plan.pos_end - plan.pos0;
    const llama_pos prefix_end = plan.pos0 + N - std::min(rf->params.n_tail, N);
    std::vector<llama_pos> exact(pos, pos + n);
    for (llama_pos p : exact) {
        if (p < plan.pos0 || p >= prefix_end) {
            llama_ridgefill_set_error(__func__, format("exact position %d outside the prompt's prefix [%d, %d)", p, plan.pos0, prefix_end));
            return -1;
        }
    }
    std::sort(exact.begin(), exact.end());
    exact.erase(std::unique(exact.begin(), exact.end()), exact.end());
    plan.exact     = std::move(exact);
    plan.exact_set = true;
    llama_ridgefill_clear_error();
    return 0;
}

void llama_ridgefill_cancel(struct llama_context * ctx) {
    if (ctx == nullptr || !ctx->ridgefill) {
        return;
    }
    auto & plan = ctx->ridgefill->plan;
    if (plan.active) {
        llama_memory_seq_rm(llama_get_memory(ctx), plan.seq_id, plan.pos0, -1);
    }
    plan = {};
}

int32_t llama_ridgefill_get_stats(struct llama_context * ctx, struct llama_ridgefill_stats * out) {
    auto * rf = rf_get(ctx, __func__);
    if (!rf || out == nullptr) {
        return -1;
    }
    *out = rf->stats;
    return 0;
}

int32_t llama_ridgefill_get_exact(struct llama_context * ctx, llama_pos * out, int32_t n) {
    auto * rf = rf_get(ctx, __func__);
    return rf ? rf_copy_out(rf->last_exact, out, n) : -1;
}

int32_t llama_ridgefill_get_scores(struct llama_context * ctx, float * out, int32_t n) {
    auto * rf = rf_get(ctx, __func__);
    return rf ? rf_copy_out(rf->last_scores, out, n) : -1;
}

int32_t llama_ridgefill_get_value_scales(struct llama_context * ctx, float * out, int32_t n) {
    auto * rf = rf_get(ctx, __func__);
    return rf ? rf_copy_out(rf->last_v_scales, out, n) : -1;
}

int32_t llama_ridgefill_get_key_scales(struct llama_context * ctx, float * out, int32_t n) {
    auto * rf = rf_get(ctx, __func__);
    return rf ? rf_copy_out(rf->last_k_scales, out, n) : -1;
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
    const rf_caches caches = rf_get_caches(ctx->get_memory());
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
        for (int32_t i = 0; i < n; ++i) {
            const std::vector<int64_t> c = rf_find_cells(kv, seq_id, pos[i], 1);
            if (c[0] < 0) {
                llama_ridgefill_set_error(__func__, format("position %d of sequence %d is not in the cache", pos[i], seq_id));
                return -1;
            }
            for (int64_t e = 0; e < n_embd_gqa; ++e) {
                out[i*n_embd_gqa + e] = trans ? all[e*kv_size + c[0]] : all[c[0]*row + e];
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
    const rf_caches caches = rf_get_caches(ctx->get_memory());
    if (!caches.recr || il < 0 || il >= (int32_t) hparams.n_layer() || !hparams.is_recr(il)) {
        llama_ridgefill_set_error(__func__, format("layer %d has no recurrent state", il));
        return -1;
    }
    const int32_t cell = rf_recr_cell(caches.recr, seq_id);
    if (cell < 0) {
        llama_ridgefill_set_error(__func__, format("sequence %d has no recurrent state", seq_id));
        return -1;
    }
    ctx->synchronize();
    llama_ridgefill_clear_error();
    return rf_copy_out(rf_read_state(caches.recr, il, cell), out, n);
}

void llama_ridgefill_record_boundary_states(struct llama_context * ctx, bool record) {
    if (ctx && ctx->ridgefill) {
        ctx->ridgefill->record_boundary = record;
    }
}

int32_t llama_ridgefill_get_boundary_state(struct llama_context * ctx, int32_t il, float * out, int32_t n) {
    auto * rf = rf_get(ctx, __func__);
    if (!rf) {
        return -1;
    }
    auto it = rf->boundary_states.find(il);
    return it == rf->boundary_states.end() ? 0 : rf_copy_out(it->second, out, n);
}


int32_t llama_ridgefill_splice_state(struct llama_context * ctx, int32_t il, const float * state, int32_t n) {
    auto * rf = rf_get(ctx, __func__);
    if (!rf) {
        return -1;
    }
    if (state == nullptr) {
        rf->splice_states.clear();
        llama_ridgefill_clear_error();
        return 0;
    }
    const llama_hparams & hparams = rf->model.hparams;
    const rf_caches caches = rf_get_caches(ctx->get_memory());
    if (!caches.recr || il < rf->params.split_layer || il >= rf->n_layer || !hparams.is_recr(il)) {
        llama_ridgefill_set_error(__func__, format("layer %d is not a late recurrent layer (split %d of %d)",
                il, rf->params.split_layer, rf->n_layer));
        return -1;
    }
    const int64_t n_state = (ggml_nbytes(caches.recr->r_l[il]) + ggml_nbytes(caches.recr->s_l[il]))/caches.recr->size/sizeof(float);
    if (n != n_state) {
        llama_ridgefill_set_error(__func__, format("a state of layer %d has %lld values, not %d", il, (long long) n_state, n));
        return -1;
    }
    rf->splice_states[il].assign(state, state + n);
    llama_ridgefill_clear_error();
    return 0;
}
