// RidgeFill attached to a llama_context: the checks of llama_ridgefill_attach, the plan of a prompt,
// the early-phase hooks of llama_context::decode, the selector's inputs and the C API of filled-row
// prefill (docs/design.md §4-§6). The late phase is in llama-ridgefill-late.cpp, the diagnostic entry
// points in llama-ridgefill-debug.cpp.

#include "llama-ridgefill-context.h"
#include "llama-ridgefill-arch.h"
#include "llama-ridgefill-error.h"
#include "llama-ridgefill-params.h"
#include "llama-ridgefill-maps.h"
#include "llama-ridgefill-memory.h"
#include "llama-ridgefill-select.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

//
// llama_ridgefill_context
//

std::string llama_ridgefill_context::check(const llama_context & lctx, const llama_ridgefill_maps * maps, llama_ridgefill_params & params) {
    const llama_model   & model   = lctx.get_model();
    const llama_hparams & hparams = model.hparams;
    const int32_t n_layer = (int32_t) hparams.n_layer();

    if (std::string err = llama_ridgefill_arch_check(model); !err.empty()) {
        return err;
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
    if (llama_ridgefill_selector_name(params.selector) == nullptr) {
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
            any = any || llama_ridgefill_is_full_attention(hparams, il);
        }
        if (!any) {
            return format("no full-attention layer at or above split %d for the probe selector: use a shallower split or another selector",
                    params.split_layer);
        }
    }
    if (params.span < 1 || params.span > LLAMA_RIDGEFILL_MAX_SPAN) {
        return format("span %d: the selector's span must be 1..%d rows (1: single rows)", params.span, LLAMA_RIDGEFILL_MAX_SPAN);
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
            params.sel_layer = llama_ridgefill_default_sel_layer(hparams, params.split_layer);
            if (params.sel_layer < 0) {
                return format("no full-attention layer below split %d for the attention selector: use a deeper split or selector none",
                        params.split_layer);
            }
        } else if (params.sel_layer >= params.split_layer || !llama_ridgefill_is_full_attention(hparams, params.sel_layer)) {
            return format("selector layer %d must be a full-attention layer below the split %d", params.sel_layer, params.split_layer);
        }
    }
    return check_context(lctx);
}

std::string llama_ridgefill_context::check_context(const llama_context & lctx) {
    const llama_cparams & cparams = lctx.get_cparams();
    if (cparams.embeddings) {
        return "embeddings contexts are not supported by RidgeFill prefill";
    }
    const llama_ridgefill_caches caches(lctx.get_memory());
    if (!caches.base) {
        return "RidgeFill prefill needs a KV-cache or hybrid memory (this model's memory is recurrent only)";
    }
    if (caches.recr && cparams.n_rs_seq > 0) {
        return format("recurrent-state rollback snapshots (n_rs_seq = %u) are not supported by RidgeFill prefill: "
                "create the context with n_rs_seq = 0", cparams.n_rs_seq);
    }
    return "";
}

llama_ridgefill_context::llama_ridgefill_context(llama_context & lctx, const llama_ridgefill_maps * maps, const llama_ridgefill_params & params) :
        lctx(lctx), model(lctx.get_model()), maps(maps), params(params) {
    const llama_hparams & hparams = model.hparams;

    n_layer   = (int32_t) hparams.n_layer();
    n_embd    = (int32_t) hparams.n_embd;
    rpc       = llama_ridgefill_uses_rpc(model);
    const bool attention = params.selector == LLAMA_RIDGEFILL_SELECTOR_ATTENTION ||
                           params.selector == LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED;
    sel_layer = attention && params.split_layer < n_layer ? params.sel_layer : -1;

    // LLAMA_RIDGEFILL_EARLY_GRAPHS=k: the early phase's KV extent grows in k steps over a plan, so
    // that its ubatches reuse k graphs (docs/design.md §6.1); 0 (default): as stock prefill grows it
    if (const char * env = getenv("LLAMA_RIDGEFILL_EARLY_GRAPHS")) {
        n_early_steps = std::max(0, atoi(env));
    }

    const llama_ridgefill_caches caches(lctx.get_memory());
    const int64_t n_ctx   = lctx.get_cparams().n_ctx;
    const int64_t n_cells = caches.base->get_size();

    // KQ masks computed in the graphs: where the cache of the last attention layer is in device memory
    // (llama.cpp's masks are built on the host), or as LLAMA_RIDGEFILL_GRAPH_MASK says
    const std::vector<uint32_t> kv_layers = caches.base->get_layer_ids();
    graph_mask = !kv_layers.empty() && !ggml_backend_buffer_is_host(caches.base->get_k_storage(kv_layers.back())->buffer);
    if (const char * env = getenv("LLAMA_RIDGEFILL_GRAPH_MASK")) {
        graph_mask = atoi(env) > 0;
    }

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

    // a model split over devices: the early phase writes x_S also into a copy on every other device
    // that holds a late layer, so that the rows cross to each device once a plan, as the hidden
    // states of a stock prefill do, and not once for every late layer's graph (docs/design.md §6.5)
    size_t copies_size = 0;
    std::vector<ggml_backend_dev_t> copy_devs;
    for (int32_t il = params.split_layer; il < n_layer; ++il) {
        ggml_backend_dev_t d = model.dev_layer(il);
        if (d == dev) {
            continue;
        }
        const size_t i = std::find(copy_devs.begin(), copy_devs.end(), d) - copy_devs.begin();
        if (i == copy_devs.size()) {
            ggml_init_params cp = { /*.mem_size =*/ ggml_tensor_overhead(), /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
            ggml_context_ptr c { ggml_init(cp) };
            ggml_tensor * t = ggml_new_tensor_2d(c.get(), GGML_TYPE_F32, n_embd, n_ctx);
            ggml_format_name(t, "ridgefill_xs_copy-%zu", i);
            ggml_backend_buffer_ptr b { ggml_backend_alloc_ctx_tensors_from_buft(c.get(), ggml_backend_dev_buffer_type(d)) };
            if (!b) {
                throw std::runtime_error(format("failed to allocate %.1f MiB for a copy of the RidgeFill row buffer on %s",
                        ggml_nbytes(t)/1024.0/1024.0, ggml_backend_dev_name(d)));
            }
            ggml_backend_buffer_clear(b.get(), 0);
            copies_size += ggml_backend_buffer_get_size(b.get());
            copy_devs.push_back(d);
            xs_copies.push_back(t);
            ctx_copies.push_back(std::move(c));
            buf_copies.push_back(std::move(b));
        }
        xs_layer.resize(n_layer, xs);
        xs_layer[il] = xs_copies[i];
    }
    if (!xs_copies.empty()) {
        LLAMA_LOG_INFO("%s: RidgeFill late layers on %zu more device(s): copies of x_S there, %.1f MiB\n", __func__,
                xs_copies.size(), copies_size/1024.0/1024.0);
    }
    LLAMA_LOG_INFO("%s: RidgeFill attached: split %d of %d, %s, tail %d, selector %s (%.3g, layer %d, span %d), value rescale %d, "
            "row buffers %.1f MiB on %s\n", __func__, params.split_layer, n_layer, maps ? "ridge maps" : "identity fill",
            params.n_tail, sel_layer >= 0 ? "attention" : "none", params.exact_fraction, sel_layer, params.span, params.n_rescale,
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

    // logits: tail rows brought by the call that ends the prompt get them (docs/design.md §4.5), others NaN
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
    timing.n_reused0   = llama_perf_context(&lctx).n_reused;
    if (!plan.active || ubatch.n_tokens == 0 || ubatch.seq_id[0][0] != plan.seq_id) {
        return; // check_batch: a ubatch holds planned rows only, or none
    }

    // x_S of each row goes to its xs row; the attention selector's query rows are the last
    // n_sel_queries rows of the prompt
    std::vector<int32_t> dst_rows(ubatch.n_tokens);
    std::vector<int32_t> sel_ids;
    const llama_pos q0 = std::max(plan.pos0, plan.pos_end - params.n_sel_queries);
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        dst_rows[i] = ubatch.pos[i] - plan.pos0;
        if (sel_layer >= 0 && !plan.exact_set && ubatch.pos[i] >= q0) {
            sel_ids.push_back(i);
        }
    }
    cur = early_graph(std::move(dst_rows), std::move(sel_ids));
    graph_active = true;

    if (n_early_steps > 0 && cur.reuse_key() >= 0) {
        set_kv_min(ubatch);
    }
}

void llama_ridgefill_context::set_kv_min(const llama_ubatch & ubatch) {
    // the cells the plan's rows will end at if placed after those used now, padded as
    // llama_kv_cache::get_n_kv pads; the extent of this ubatch's graph is that in n_early_steps
    // steps. A hint only: the mask covers any extent, so a different placement only changes shapes
    const llama_ridgefill_caches caches(lctx.get_memory());
    for (llama_kv_cache * kv : { caches.base, caches.swa }) {
        if (kv == nullptr) {
            continue;
        }
        const uint32_t n_pad  = 256;
        const uint32_t size   = kv->get_size();
        const uint32_t used   = kv->get_cells(plan.seq_id).used_max_p1();
        const uint32_t end    = std::min<uint32_t>(size, GGML_PAD(used + (plan.pos_end - ubatch.pos[0]), n_pad));
        const uint32_t step   = GGML_PAD((end + n_early_steps - 1)/n_early_steps, n_pad);
        const uint32_t needed = std::min<uint32_t>(end, GGML_PAD(used + ubatch.n_tokens, n_pad));
        kv->n_kv_min = std::min(end, (needed + step - 1)/step*step); // step: not a power of 2
    }
    kv_min_set = true;
}

void llama_ridgefill_context::set_ubatch_done() {
    if (kv_min_set) {
        const llama_ridgefill_caches caches(lctx.get_memory());
        for (llama_kv_cache * kv : { caches.base, caches.swa }) {
            if (kv != nullptr) {
                kv->n_kv_min = 0;
            }
        }
        kv_min_set = false;
    }
    if (graph_active) {
        timing.early_us += ggml_time_us() - timing.t_ubatch_us;
        // the ubatch's graph was built, or the previous one reused (llama_context counts reuses)
        if (llama_perf_context(&lctx).n_reused > timing.n_reused0) {
            timing.n_early_reused++;
        } else {
            timing.n_early++;
        }
    }
    graph_active = false;
}

llama_ridgefill_graph llama_ridgefill_context::base_graph() const {
    llama_ridgefill_graph g;
    g.model = &model;
    g.maps  = maps;
    g.split = params.split_layer;
    g.xs    = xs;
    g.xx    = xx;
    g.xs_layer = xs_layer;
    g.graph_mask = graph_mask;
    return g;
}

llama_ridgefill_graph llama_ridgefill_context::early_graph(std::vector<int32_t> dst_rows, std::vector<int32_t> sel_ids) const {
    llama_ridgefill_graph g = base_graph();
    g.il_begin = 0;
    g.il_end   = params.split_layer;
    g.dst      = xs;
    g.dst_rows = std::move(dst_rows);
    g.xs_copies = xs_copies;
    if (!sel_ids.empty()) {
        g.sel_layer = sel_layer;
        g.scores    = scores;
        g.sel_ids   = std::move(sel_ids);
    }
    return g;
}

int32_t llama_ridgefill_context::begin(llama_seq_id seq_id, llama_pos pos0, llama_pos pos_end) {
    stock_reason.clear();
    if (plan.active) {
        llama_ridgefill_set_error("llama_ridgefill_begin", format("a planned prompt is in progress (sequence %d, rows [%d, %d)): "
                "decode its rows, or llama_ridgefill_cancel", plan.seq_id, plan.pos0, plan.pos_end));
        return -1;
    }
    const uint32_t n_ctx = lctx.get_cparams().n_ctx;
    if (seq_id < 0 || seq_id >= (llama_seq_id) LLAMA_MAX_SEQ) {
        llama_ridgefill_set_error("llama_ridgefill_begin", format("invalid sequence %d", seq_id));
        return -1;
    }
    if (pos0 < 0 || pos_end <= pos0) {
        llama_ridgefill_set_error("llama_ridgefill_begin", format("empty or invalid prompt rows [%d, %d)", pos0, pos_end));
        return -1;
    }
    if ((uint32_t) (pos_end - pos0) > n_ctx) {
        llama_ridgefill_set_error("llama_ridgefill_begin", format("the prompt has %d rows, more than the context size %u",
                pos_end - pos0, n_ctx));
        return -1;
    }
    llama_ridgefill_clear_error();

    // degenerate: stock prefill (docs/design.md §4.6)
    const int32_t N = pos_end - pos0;
    if (params.split_layer >= n_layer) {
        stock_reason = format("the split is the model's last layer (%d): every row runs every layer", n_layer);
        return 0;
    }
    if (N <= params.n_tail || N < params.min_prompt) {
        stock_reason = N <= params.n_tail ? format("%d new prompt rows, no more than the tail (%d)", N, params.n_tail) :
                                            format("%d new prompt rows, fewer than min_prompt (%d)", N, params.min_prompt);
        return 0;
    }

    // outputs computed inside the prompt's graphs, from the last ubatch before the late phase has
    // run: embeddings switched on after attaching (llama_set_embeddings) and a backend sampler
    // (llama_set_sampler). The prompt runs stock prefill, which gives them what they expect
    if (lctx.get_cparams().embeddings || lctx.has_sampler(seq_id)) {
        stock_reason = format("the sequence %s inside the prompt's graph, before the late layers would run",
                lctx.get_cparams().embeddings ? "computes embeddings" : "samples on the backend (llama_set_sampler)");
        LLAMA_LOG_INFO("%s: stock prefill for the %d rows of sequence %d: %s\n", __func__, N, seq_id, stock_reason.c_str());
        return 0;
    }

    // a layer-input capture needs every layer of every row in the graph; a planned prompt's graphs
    // run some of them
    const auto & capture = lctx.get_cparams().embeddings_layer_inp;
    if (std::find(capture.begin(), capture.end(), true) != capture.end()) {
        llama_ridgefill_set_error("llama_ridgefill_begin", "a layer-input capture is enabled (llama_ridgefill_capture_layer_input): "
                "RidgeFill prefill does not run every layer of every row; disable the capture first");
        return -1;
    }

    // a window-sized sliding-window cache keeps the last rows only: rows before pos0 that the first
    // planned rows attend to may leave it while the early phase runs, and are not in xs to refill. When
    // the plan's rows do not all fit next to the sequence's rows, the prompt runs stock prefill
    const llama_ridgefill_caches caches(lctx.get_memory());
    const bool swa_prefix = swa_scratch && caches.swa->seq_pos_min(seq_id) >= 0 && caches.swa->seq_pos_min(seq_id) < pos0;
    if (swa_prefix && caches.swa->get_cells(seq_id).get_used() + (uint32_t) N > caches.swa->get_size()) {
        stock_reason = format("%d new prompt rows after cached rows: the window-sized sliding-window cache (%u cells) "
                "cannot keep the cached rows they attend to (a full-size cache, swa_full or --swa-full, can)", N, caches.swa->get_size());
        LLAMA_LOG_INFO("%s: stock prefill for sequence %d: %s\n", __func__, seq_id, stock_reason.c_str());
        return 0;
    }

    plan   = {};
    timing = {}; // what a plan dropped before its late phase counts for no other
    plan.active  = true;
    plan.seq_id  = seq_id;
    plan.pos0    = pos0;
    plan.pos_end = pos_end;
    plan.tokens.assign(N, LLAMA_TOKEN_NULL);
    plan.swa_prefix = swa_prefix;
    if (sel_layer >= 0) {
        ggml_backend_tensor_memset(scores, 0, 0, ggml_nbytes(scores));
    }
    return 1;
}

int32_t llama_ridgefill_context::set_exact(const llama_pos * pos, int32_t n) {
    if (!plan.active || plan.pending) {
        llama_ridgefill_set_error("llama_ridgefill_set_exact", "no planned prompt waiting for its rows (llama_ridgefill_begin)");
        return -1;
    }
    if (n < 0 || (n > 0 && pos == nullptr)) {
        llama_ridgefill_set_error("llama_ridgefill_set_exact", "invalid position list");
        return -1;
    }
    const int32_t N = plan.pos_end - plan.pos0;
    const llama_pos prefix_end = plan.pos0 + N - std::min(params.n_tail, N);
    std::vector<llama_pos> exact(pos, pos + n);
    for (llama_pos p : exact) {
        if (p < plan.pos0 || p >= prefix_end) {
            llama_ridgefill_set_error("llama_ridgefill_set_exact", format("exact position %d outside the prompt's prefix [%d, %d)", p, plan.pos0, prefix_end));
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

void llama_ridgefill_context::cancel() {
    if (plan.active) {
        lctx.get_memory()->seq_rm(plan.seq_id, plan.pos0, -1);
    }
    plan = {};
}

int32_t llama_ridgefill_context::splice_state(int32_t il, const float * state, int32_t n) {
    if (state == nullptr) {
        splice_states.clear();
        llama_ridgefill_clear_error();
        return 0;
    }
    const llama_hparams & hparams = model.hparams;
    const llama_ridgefill_caches caches(lctx.get_memory());
    if (!caches.recr || il < params.split_layer || il >= n_layer || !hparams.is_recr(il)) {
        llama_ridgefill_set_error("llama_ridgefill_splice_state", format("layer %d is not a late recurrent layer (split %d of %d)",
                il, params.split_layer, n_layer));
        return -1;
    }
    const int64_t n_state = caches.state_size(il);
    if (n != n_state) {
        llama_ridgefill_set_error("llama_ridgefill_splice_state", format("a state of layer %d has %lld values, not %d",
                il, (long long) n_state, n));
        return -1;
    }
    splice_states[il].assign(state, state + n);
    llama_ridgefill_clear_error();
    return 0;
}

std::vector<llama_pos> llama_ridgefill_context::select_exact(const llama_ridgefill_plan & p, const std::vector<int64_t> & cells, int32_t n_prefix) {
    last_scores.clear();
    if (p.exact_set) {
        return p.exact; // the caller's positions override any selector
    }

    llama_ridgefill_select_input in;
    in.selector = params.selector;
    in.fraction = params.exact_fraction;
    in.n_prefix = n_prefix;
    in.pos0     = p.pos0;
    in.classes  = params.protected_classes;
    in.span     = params.span;

    // the scores accumulated per cell in the early phase (attention) or the probe pass (probe), for
    // the planned rows
    in.has_scores = params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE || sel_layer >= 0;
    if (in.has_scores) {
        std::vector<float> sc(ggml_nelements(scores));
        ggml_backend_tensor_get(scores, sc.data(), 0, ggml_nbytes(scores));
        last_scores.resize(cells.size());
        for (size_t j = 0; j < cells.size(); ++j) {
            last_scores[j] = sc[cells[j]];
        }
        in.scores = last_scores;
    }

    // the rows' tokens and their text (protected selectors)
    const llama_vocab & vocab = model.vocab;
    in.tokens = p.tokens;
    in.piece  = [&vocab](llama_token t) {
        llama_ridgefill_piece res;
        if (t >= 0 && t < (llama_token) vocab.n_tokens()) {
            res.text    = &vocab.token_to_piece(t);
            res.control = vocab.is_control(t);
        }
        return res;
    };
    return llama_ridgefill_select_rows(in);
}

std::string llama_ridgefill_context::lost_servers_after_sync() {
    if (!rpc) {
        return "";
    }
    ggml_backend_sched_synchronize(lctx.get_sched());
    return llama_ridgefill_lost_servers(model);
}

int llama_ridgefill_context::decode_done() {
    if (!plan.active) {
        // fail the call rather than hand out outputs computed without a lost server's layers (the
        // planned path does the same at the end of its late phase)
        if (const std::string lost = lost_servers_after_sync(); !lost.empty()) {
            llama_ridgefill_set_error("llama_decode", format("RPC server %s stopped responding, the model's tensors "
                    "there are lost", lost.c_str()));
            return -3;
        }
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
    return plan.pending ? finish() : 0;
}

//
// C API
//

llama_ridgefill_context * llama_ridgefill_get(llama_context * ctx, const char * func) {
    if (ctx == nullptr || !ctx->ridgefill) {
        llama_ridgefill_set_error(func, "no RidgeFill attached to this context (llama_ridgefill_attach)");
        return nullptr;
    }
    return ctx->ridgefill.get();
}

int32_t llama_ridgefill_attach(struct llama_context * ctx, const struct llama_ridgefill_maps * maps, struct llama_ridgefill_params params) {
    if (ctx == nullptr) {
        llama_ridgefill_set_error(__func__, "no context");
        return -1;
    }
    // unset tunable fields: the map file's tuned values, else the built-in ones
    int32_t from_maps = 0;
    try {
        from_maps = llama_ridgefill_apply_tuned(maps ? &maps->tuned : nullptr, maps ? maps->path : "", params);
    } catch (const std::exception & e) {
        llama_ridgefill_set_error(__func__, e.what());
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
        ctx->ridgefill->params_from_maps = from_maps;
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

int32_t llama_ridgefill_get_params(const struct llama_context * ctx, struct llama_ridgefill_params * out) {
    if (ctx == nullptr || !ctx->ridgefill || out == nullptr) {
        llama_ridgefill_set_error(__func__, "no RidgeFill attached to the context");
        return -1;
    }
    *out = ctx->ridgefill->params;
    return ctx->ridgefill->params_from_maps;
}

void llama_ridgefill_detach(struct llama_context * ctx) {
    if (ctx) {
        ctx->ridgefill.reset();
    }
}

int32_t llama_ridgefill_begin(struct llama_context * ctx, llama_seq_id seq_id, llama_pos pos0, llama_pos pos_end) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    return rf ? rf->begin(seq_id, pos0, pos_end) : -1;
}

int32_t llama_ridgefill_set_exact(struct llama_context * ctx, const llama_pos * pos, int32_t n) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    return rf ? rf->set_exact(pos, n) : -1;
}

void llama_ridgefill_cancel(struct llama_context * ctx) {
    if (ctx && ctx->ridgefill) {
        ctx->ridgefill->cancel();
    }
}

int32_t llama_ridgefill_get_stats(struct llama_context * ctx, struct llama_ridgefill_stats * out) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    if (!rf || out == nullptr) {
        return -1;
    }
    *out = rf->stats;
    return 0;
}

const char * llama_ridgefill_stock_reason(const struct llama_context * ctx) {
    return ctx != nullptr && ctx->ridgefill ? ctx->ridgefill->stock_reason.c_str() : "";
}

int32_t llama_ridgefill_get_exact(struct llama_context * ctx, llama_pos * out, int32_t n) {
    auto * rf = llama_ridgefill_get(ctx, __func__);
    return rf ? llama_ridgefill_copy_out(rf->last_exact, out, n) : -1;
}
