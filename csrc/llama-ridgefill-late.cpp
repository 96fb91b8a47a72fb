// The late phase of a planned prompt: plan -> passes -> graphs -> run (see llama-ridgefill-late.h).
// The window graphs' planning is in llama-ridgefill-window.cpp, the compute buffers' reservation in
// llama-ridgefill-reserve.cpp.

#include "llama-ridgefill-context.h"
#include "llama-ridgefill-arch.h"
#include "llama-ridgefill-error.h"
#include "llama-ridgefill-maps.h"
#include "llama-ridgefill-memory.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>

//
// passes and their graphs
//

llama_ridgefill_pass llama_ridgefill_context::make_pass(llama_seq_id seq_id, llama_pos pos0, std::vector<int64_t> cells,
        std::vector<int64_t> cells_swa, const std::vector<char> & is_exact, int32_t T) const {
    const llama_hparams & hparams = model.hparams;
    const llama_ridgefill_caches caches(lctx.get_memory());

    llama_ridgefill_pass ps;
    ps.seq_id    = seq_id;
    ps.pos0      = pos0;
    ps.N         = (int32_t) is_exact.size();
    ps.T         = T;
    ps.n_prefix  = ps.N - T;
    ps.cells     = std::move(cells);
    ps.cells_swa = std::move(cells_swa);
    ps.xi.assign(ps.N, -1);

    llama_ridgefill_fill & f = ps.fill;
    if (caches.base->get_v_trans()) {
        // a transposed V cache is written plane by plane (llama_ridgefill_build_fill)
        f.v_trans.assign(n_layer, nullptr);
        for (int32_t il = params.split_layer; il < n_layer; ++il) {
            if (!hparams.is_recr(il)) {
                const llama_kv_cache * kv = caches.swa && hparams.is_swa(il) ? caches.swa : caches.base;
                f.v_trans[il] = kv->get_v_storage(il);
            }
        }
    }
    // the sequence's stream in each cache: a filled row's K and V go to its cell of that stream
    f.strm     = (int32_t) caches.base->get_stream(seq_id);
    f.strm_swa = caches.swa ? (int32_t) caches.swa->get_stream(seq_id) : 0;
    const int64_t offs     = (int64_t) f.strm*caches.base->get_size();
    const int64_t offs_swa = caches.swa ? (int64_t) f.strm_swa*caches.swa->get_size() : 0;
    const bool    local_v  = !f.v_trans.empty() && (offs != 0 || offs_swa != 0);
    // a window-sized sliding-window cache that no longer holds the first rows (they left it first)
    ps.windowed = !ps.cells_swa.empty() && ps.cells_swa[0] < 0;
    for (int32_t j = 0; j < ps.N; ++j) {
        if (is_exact[j]) {
            ps.xi[j] = (int32_t) ps.X.size();
            ps.X.push_back(j);
        } else {
            f.rows .push_back(j);
            f.pos  .push_back(pos0 + j);
            f.cells.push_back(ps.cells[j] + offs);
            if (local_v) {
                f.cells_v.push_back(ps.cells[j]);
            }
            if (!ps.cells_swa.empty() && !ps.windowed) {
                f.cells_swa.push_back(ps.cells_swa[j] + offs_swa);
                if (local_v) {
                    f.cells_v_swa.push_back(ps.cells_swa[j]);
                }
            }
        }
    }
    GGML_ASSERT((int32_t) ps.X.size() >= T);

    const int32_t n_f = f.rows.size();
    f.n_chunk = fill_chunk(n_f);
    f.splice  = params.splice;

    const uint32_t n_pos = hparams.n_pos_per_embd();
    if (n_pos > 1) {
        // M-RoPE: each fill step's positions section-major
        std::vector<int32_t> sections((size_t) n_f*n_pos);
        for (int32_t i0 = 0; i0 < n_f; i0 += f.n_chunk) {
            llama_ridgefill_text_positions(f.pos.data() + i0, std::min(f.n_chunk, n_f - i0), n_pos, sections.data() + (size_t) i0*n_pos);
        }
        f.pos = std::move(sections);
    }
    if (ps.windowed) {
        make_windows(ps);
    }
    return ps;
}

std::vector<llama_ridgefill_segment> llama_ridgefill_context::late_segments(int32_t n_x, int32_t n_f, bool fills, bool windowed) const {
    const llama_hparams & hparams = model.hparams;
    const int32_t n_ubatch = (int32_t) lctx.get_cparams().n_ubatch;

    // consecutive attention layers share their graph when the exact rows fit one chunk (with several
    // chunks, a later chunk's rows need the layer filled, and the fill needs the value scale of the
    // tail, the last chunk) and their fill steps fit the graph's node budget together
    int32_t n_att = 1;
    if (n_x <= n_ubatch && !windowed) {
        const int32_t n_chunk = fill_step_rows();
        const int32_t n_steps = fills && n_f > 0 ? (n_f + n_chunk - 1)/n_chunk : 0;
        n_att = n_steps > 0 ? std::max(1, fill_steps_max()/n_steps) : n_layer;
    }
    // consecutive recurrent layers always do: each chunk of rows runs them in turn
    std::vector<llama_ridgefill_segment> segments;
    for (int32_t l0 = params.split_layer; l0 < n_layer; ) {
        const bool recurrent = hparams.is_recr(l0);
        int32_t l1 = l0 + 1;
        while (l1 < n_layer && hparams.is_recr(l1) == recurrent && (recurrent || l1 - l0 < n_att)) {
            ++l1;
        }
        segments.push_back({ l0, l1 });
        l0 = l1;
    }
    return segments;
}

std::vector<std::pair<int32_t, int32_t>> llama_ridgefill_context::late_chunks(const llama_ridgefill_pass & ps, int32_t il) const {
    // an attention layer runs the exact rows in chunks of n_ubatch, in position order (a chunk attends
    // to the rows of the chunks before it, already written); a recurrent layer every row in position
    // order, in chunks of up to n_late_rows_recr rows of which at most n_ubatch exact, that start anew
    // at the tail (its first chunk may start from the corrected state)
    const bool    recurrent = model.hparams.is_recr(il);
    const int32_t n_rows    = recurrent ? ps.N : (int32_t) ps.X.size();
    const int32_t n_ubatch  = (int32_t) lctx.get_cparams().n_ubatch;
    const int32_t n_max     = recurrent ? std::max(n_late_rows_recr, n_ubatch) : n_ubatch;

    // a windowed pass's sliding-window layer: the window graphs first, then the chunks over the cache
    std::vector<std::pair<int32_t, int32_t>> chunks;
    const bool window = ps.windowed && model.hparams.is_swa(il) && !recurrent;
    for (size_t i = 0; window && i < ps.windows.size(); ++i) {
        chunks.emplace_back(ps.windows[i].c0, ps.windows[i].c1);
    }
    for (int32_t c0 = window ? ps.n_x_win : 0; c0 < n_rows; ) {
        const int32_t end = recurrent && c0 < ps.n_prefix ? ps.n_prefix : n_rows;
        int32_t c1  = c0;
        int32_t n_x = 0;
        while (c1 < end && c1 - c0 < n_max) {
            const bool exact = !recurrent || ps.xi[c1] >= 0;
            if (exact && n_x == n_ubatch) {
                break;
            }
            n_x += exact;
            ++c1;
        }
        chunks.emplace_back(c0, c1);
        c0 = c1;
    }
    return chunks;
}

// the rows of a recurrent late layer's graph, a chunk of every planned row: filled rows feed the
// state from x̂ (xs row j), exact rows run the layer (xs row j at the split layer, their carried
// state after it)
void llama_ridgefill_context::late_rows_recurrent(const llama_ridgefill_pass & ps, int32_t il, int32_t c0,
        const std::vector<int32_t> & rows, llama_ridgefill_graph & g) const {
    const int32_t S  = params.split_layer;
    const int32_t nc = rows.size();

    int32_t n_f = 0;
    for (int32_t j : rows) {
        n_f += ps.xi[j] < 0;
    }
    int32_t k_f = 0;
    for (int32_t i = 0; i < nc; ++i) {
        const int32_t j = rows[i];
        if (ps.xi[j] < 0) {
            g.m_f_rows.push_back(j);
            g.m_perm.push_back(k_f++);
        } else {
            g.m_perm.push_back(n_f + (int32_t) g.x_ids.size());
            g.x_ids.push_back(i);
            g.src_rows.push_back(il == S ? j : ps.xi[j]);
            g.dst_rows.push_back(ps.xi[j]);
        }
    }
    // the terminal-state correction: the tail's first chunk starts from the corrected state
    g.state_gain = c0 == ps.n_prefix && params.state_correction == LLAMA_RIDGEFILL_STATE_CORRECTION_GAIN && maps;
}

// the rows of an attention late graph, a chunk of the exact rows; the first chunk of a filling pass
// also fills the graph's layers, and a probe pass's query rows score the prefix
void llama_ridgefill_context::late_rows_attention(const llama_ridgefill_pass & ps, int32_t il, int32_t il_end,
        int32_t c0, const std::vector<int32_t> & rows, const llama_ridgefill_window * w, llama_ridgefill_graph & g) const {
    const llama_hparams & hparams = model.hparams;
    const int32_t S   = params.split_layer;
    const int32_t n_x = ps.X.size();
    const int32_t nc  = rows.size();

    for (int32_t i = 0; i < nc; ++i) {
        g.src_rows.push_back(il == S ? rows[i] : ps.xi[rows[i]]);
        g.dst_rows.push_back(ps.xi[rows[i]]);
    }
    // a windowed pass's sliding-window layer is filled by several graphs: each window graph fills the
    // scratch (a pass that does not fill too: the scratch holds nothing of the pass before), and the
    // first graph over the cache the filled rows the cache holds
    const bool window_layer = ps.windowed && hparams.is_swa(il);
    if (w) {
        g.fill = &w->fill;
        g.wt   = w->wt.ids.empty() ? nullptr : &w->wt;
    } else if (ps.fills && c0 == (window_layer ? ps.n_x_win : 0)) {
        g.fill = window_layer ? &ps.fill_swa : &ps.fill;
    }
    if (g.fill && (c0 > 0 || !ps.fills)) {
        // the layer's scales, measured by its first graph (a pass that does not fill: by the probe pass)
        const size_t n_head_kv_max = last_v_scales.size()/(n_layer - S);
        const size_t i0 = (size_t) (il - S)*n_head_kv_max;
        if (std::min(params.n_rescale, ps.T) > 0) {
            g.v_scale_in.assign(last_v_scales.begin() + i0, last_v_scales.begin() + i0 + hparams.n_head_kv(il));
        }
        if (std::min(params.n_key_rescale, ps.T) > 0) {
            g.k_scale_in.assign(last_k_scales.begin() + i0, last_k_scales.begin() + i0 + hparams.n_head_kv(il));
        }
    } else if (g.fill) {
        // the fill, after the value (and key) scale measured on the first tail rows: their exact
        // inputs (xs at the split layer, else their carried states; at a later layer of the graph,
        // their rows of its input) against x̂ from their xs rows
        g.r_src = g.src;
        for (int32_t i = 0; i < std::min(params.n_rescale, ps.T); ++i) {
            g.r_src_rows.push_back(il == S ? ps.n_prefix + i : n_x - ps.T + i);
            g.r_ids.push_back(n_x - ps.T + i);
            g.r_rows.push_back(ps.n_prefix + i);
        }
        for (int32_t i = 0; i < std::min(params.n_key_rescale, ps.T); ++i) {
            g.rk_src_rows.push_back(il == S ? ps.n_prefix + i : n_x - ps.T + i);
            g.rk_ids.push_back(n_x - ps.T + i);
            g.rk_rows.push_back(ps.n_prefix + i);
        }
    }
    // the probe's query rows, the last n_query rows of X, at each full-attention layer of the graph
    bool full = false;
    for (int32_t l = il; l < il_end; ++l) {
        full = full || llama_ridgefill_is_full_attention(hparams, l);
    }
    if (ps.n_query > 0 && full) {
        for (int32_t i = 0; i < nc; ++i) {
            if (c0 + i >= n_x - ps.n_query) {
                g.sel_ids.push_back(i);
            }
        }
        g.sel_late = true;
    }
}

void llama_ridgefill_context::late_graph(const llama_ridgefill_pass & ps, int32_t il, int32_t il_end, int32_t c0,
        int32_t c1, llama_ridgefill_late_graph & lg) const {
    const llama_hparams & hparams = model.hparams;

    const int32_t S          = params.split_layer;
    const int32_t nc         = c1 - c0;
    const bool    last_layer = il_end == n_layer;
    const bool    recurrent  = hparams.is_recr(il);
    const bool    swa        = !ps.cells_swa.empty();

    // the graph's rows: the planned row of each ubatch row
    std::vector<int32_t>   rows(nc);
    std::vector<llama_pos> pos(nc);
    lg.il     = il;
    lg.il_end = il_end;
    lg.c0     = c0;
    lg.c1     = c1;
    lg.cells.resize(nc);
    lg.cells_swa.resize(swa ? nc : 0);
    for (int32_t i = 0; i < nc; ++i) {
        const int32_t j = recurrent ? c0 + i : ps.X[c0 + i];
        rows[i]       = j;
        pos[i]        = ps.pos0 + j;
        lg.cells[i]   = ps.cells[j];
        if (swa) {
            // a windowed pass: a row the sliding-window cache no longer holds is not read there by a
            // graph that runs over the cache (a full-attention layer's)
            lg.cells_swa[i] = (uint32_t) std::max<int64_t>(ps.cells_swa[j], 0);
        }
    }
    // a window graph: its rows are in the scratch
    lg.window = -1;
    for (size_t k = 0; ps.windowed && hparams.is_swa(il) && !recurrent && k < ps.windows.size(); ++k) {
        if (ps.windows[k].c0 == c0) {
            GGML_ASSERT(ps.windows[k].c1 == c1 && il_end == il + 1);
            lg.window    = (int32_t) k;
            lg.cells_swa = ps.windows[k].cells_x;
        }
    }
    lg.ub = llama_ridgefill_make_ubatch(ps.seq_id, pos, false, hparams.n_pos_per_embd());

    llama_ridgefill_graph & g = lg.rf;
    g = base_graph();
    g.il_begin = il;
    g.il_end   = il_end;
    g.src      = il == S ? xs : xx;
    g.dst      = xx;
    g.gdn      = recurrent;

    // the ubatch rows that reach the output: all of them, or the exact ones of a recurrent layer
    std::vector<int32_t> out_rows;
    if (recurrent) {
        late_rows_recurrent(ps, il, c0, rows, g);
        out_rows = g.x_ids;
    } else {
        late_rows_attention(ps, il, il_end, c0, rows, lg.window >= 0 ? &ps.windows[lg.window] : nullptr, g);
        out_rows.resize(nc);
        std::iota(out_rows.begin(), out_rows.end(), 0);
    }
    if (!g.sel_ids.empty()) {
        g.scores = scores;
    }

    // the last layer outputs the logits of the rows that asked for them (at least one row when the
    // graph has rows that reach the output: a graph needs an output; a row nobody asked for is discarded)
    lg.out_idx.clear();
    if (last_layer && !out_rows.empty()) {
        for (size_t k = 0; k < out_rows.size() && ps.logits; ++k) {
            const int32_t i = out_rows[k];
            for (const auto & [op, bi] : ps.out_rows) {
                if (op == pos[i]) {
                    lg.ub.output[i] = 1;
                    g.out_ids.push_back((int32_t) k);
                    lg.out_idx.push_back(bi);
                }
            }
        }
        if (lg.out_idx.empty()) {
            lg.ub.output[out_rows.back()] = 1;
            g.out_ids.push_back((int32_t) out_rows.size() - 1);
            lg.out_idx.push_back(-1);
        }
    }
}

ggml_cgraph * llama_ridgefill_context::build_graph(const llama_ubatch & ub, const llama_memory_context_i * mctx, uint32_t n_outputs) {
    if (!res_late) {
        res_late.reset(new llm_graph_result(lctx.graph_max_nodes(lctx.get_cparams().n_ubatch)));
    }
    graph_active = true;
    ggml_cgraph * gf = lctx.graph_build_ext(res_late.get(), ub, mctx, n_outputs);
    graph_active = false;
    return gf;
}

//
// running a pass
//

std::string llama_ridgefill_context::run_pass(const llama_ridgefill_pass & ps) {
    // hybrid models: the recurrent cell of the sequence, whose late layers' states continue here
    const llama_ridgefill_caches caches(lctx.get_memory());
    const int32_t rs_cell = caches.recr_cell(ps.seq_id);
    if (caches.recr && rs_cell < 0) {
        return format("sequence %d has no recurrent state", ps.seq_id);
    }

    const llama_hparams & hparams = model.hparams;
    llama_ridgefill_late_graph lg;
    for (const auto & sg : late_segments((int32_t) ps.X.size(), (int32_t) ps.fill.rows.size(), ps.fills, ps.windowed)) {
        for (const auto & [c0, c1] : late_chunks(ps, sg.l0)) {
            // a chunk of recurrent rows without an exact row runs its layers one graph each: such a
            // graph ends with its first layer's state update
            bool split = hparams.is_recr(sg.l0) && sg.l1 - sg.l0 > 1;
            for (int32_t j = c0; j < c1 && split; ++j) {
                split = ps.xi[j] < 0;
            }
            for (int32_t l0 = sg.l0; l0 < sg.l1; ) {
                const int32_t l1 = split ? l0 + 1 : sg.l1;
                late_graph(ps, l0, l1, c0, c1, lg);
                std::string err = run_graph(ps, lg, caches, rs_cell);
                if (!err.empty()) {
                    return err;
                }
                l0 = l1;
            }
        }
    }
    return "";
}

std::string llama_ridgefill_context::run_graph(const llama_ridgefill_pass & ps, llama_ridgefill_late_graph & lg,
        const llama_ridgefill_caches & caches, int32_t rs_cell) {
    ggml_backend_sched_t sched = lctx.get_sched();

    const int32_t il        = lg.il;
    const bool    recurrent = model.hparams.is_recr(il);

    // the splice test: the tail starts from the given states (the graphs before wrote the cell)
    for (int32_t l = il; recurrent && lg.c0 == ps.n_prefix && l < lg.il_end; ++l) {
        if (splice_states.count(l)) {
            ggml_backend_sched_synchronize(sched);
            caches.write_state(l, rs_cell, splice_states.at(l));
        }
    }

    const bool rs_zero = recurrent && ps.pos0 == 0 && lg.c0 == 0; // a new sequence starts from a zero state
    llama_memory_context_ptr mctx;
    if (lg.window >= 0) {
        // a window graph: the rows its windows need into the scratch, the graph over it
        const llama_ridgefill_window & w = ps.windows[lg.window];
        llama_ridgefill_scratch_enter(swa_scratch.get(), ps.seq_id, lg.window == 0, w.lo, w.pos_new, w.cells_new);
        mctx = caches.scratch_context(swa_scratch.get(), ps.seq_id, lg.ub, lg.cells, lg.cells_swa);
        timing.n_window++;
    } else {
        mctx = caches.reuse_context(ps.seq_id, lg.ub, lg.cells, lg.cells_swa, rs_cell, rs_zero);
    }
    if (!mctx->apply()) {
        return "failed to address the memory of the late rows";
    }

    cur = std::move(lg.rf);
    const int64_t t0 = ggml_time_us();
    ggml_cgraph * gf = build_graph(lg.ub, mctx.get(), lg.out_idx.size());
    const int64_t t1 = ggml_time_us();
    if (!gf || !ggml_backend_sched_alloc_graph(sched, gf)) {
        return format("failed to build or allocate the late-phase graph of layers %d..%d", il, lg.il_end - 1);
    }
    const int64_t t2 = ggml_time_us();
    res_late->set_inputs(&lg.ub);
    const int64_t t3 = ggml_time_us();
    if (lctx.graph_compute(gf, true) != GGML_STATUS_SUCCESS) {
        return format("failed to compute the late-phase graph of layers %d..%d", il, lg.il_end - 1);
    }
    // wait only for results read back here; otherwise the next graph is built while this one runs,
    // as llama_context::decode does with its ubatches
    const int64_t t4 = ggml_time_us();
    const bool record = recurrent && lg.c1 == ps.n_prefix && record_boundary;
    if (!cur.v_scales.empty() || !cur.k_scales.empty() || record || !lg.out_idx.empty()) {
        ggml_backend_sched_synchronize(sched);
    }
    const int64_t t5 = ggml_time_us();
    timing.n_graphs++;
    timing.n_nodes    += ggml_graph_n_nodes(gf);
    timing.build_us   += t1 - t0;
    timing.alloc_us   += t2 - t1;
    timing.inputs_us  += t3 - t2;
    timing.compute_us += t4 - t3;
    timing.wait_us    += t5 - t4;

    // what the graph measured: the value and key scales, the states at the end of the prefix, the logits
    const size_t n_head_kv_max = last_v_scales.size()/(n_layer - params.split_layer);
    for (const auto & [l, t] : cur.v_scales) {
        ggml_backend_tensor_get(t, last_v_scales.data() + (size_t) (l - params.split_layer)*n_head_kv_max, 0, ggml_nbytes(t));
    }
    for (const auto & [l, t] : cur.k_scales) {
        ggml_backend_tensor_get(t, last_k_scales.data() + (size_t) (l - params.split_layer)*n_head_kv_max, 0, ggml_nbytes(t));
    }
    for (int32_t l = il; record && l < lg.il_end; ++l) {
        // the state after the last prefix row, before any correction
        boundary_states[l] = caches.read_state(l, rs_cell);
    }
    if (!lg.out_idx.empty()) {
        ggml_tensor * t_logits = res_late->get_logits();
        GGML_ASSERT(t_logits != nullptr && t_logits->ne[1] == (int64_t) lg.out_idx.size());
        for (size_t k = 0; k < lg.out_idx.size(); ++k) {
            if (lg.out_idx[k] < 0) {
                continue;
            }
            float * dst = lctx.get_logits_ith(lg.out_idx[k]);
            if (dst == nullptr) {
                return "no logits row for a tail row that asked for logits";
            }
            ggml_backend_tensor_get(t_logits, dst, k*t_logits->nb[1], t_logits->nb[1]);
        }
    }
    return "";
}

std::string llama_ridgefill_context::run_probe(const llama_ridgefill_plan & p, const std::vector<int64_t> & cells,
        const std::vector<int64_t> & cells_swa, std::vector<char> & is_exact, std::vector<llama_pos> & exact,
        int32_t & n_probe) {
    // every prefix row filled (with the value and key scales of this pass); the tail runs the late
    // layers against the filled cache and its last rows score the prefix at every full-attention late
    // layer. The selected rows then run the late layers exactly, with the tail again (it attends to
    // them), over the cells the probe filled
    const llama_hparams & hparams = model.hparams;
    const llama_ridgefill_caches caches(lctx.get_memory());
    const int32_t N = p.pos_end - p.pos0;
    const int32_t T = std::min(params.n_tail, N);

    llama_ridgefill_pass ps = make_pass(p.seq_id, p.pos0, cells, cells_swa, is_exact, T);
    ps.n_query  = std::min(params.n_sel_queries, T);
    ps.out_rows = p.out_rows;
    ggml_backend_tensor_memset(scores, 0, 0, ggml_nbytes(scores));

    // the probe pass runs the late recurrent layers over every row: their states are put back for the
    // second pass (a sequence from position 0 starts from zero anyway)
    std::map<int32_t, std::vector<float>> saved;
    const int32_t rs_cell = caches.recr_cell(p.seq_id);
    if (caches.recr && rs_cell >= 0 && p.pos0 > 0) {
        for (int32_t il = params.split_layer; il < n_layer; ++il) {
            if (hparams.is_recr(il)) {
                saved[il] = caches.read_state(il, rs_cell);
            }
        }
    }
    std::string err = run_pass(ps);
    if (!err.empty()) {
        return err;
    }
    for (const auto & [il, state] : saved) {
        caches.write_state(il, rs_cell, state);
    }

    exact = select_exact(p, cells, N - T);
    if (exact.empty()) {
        return "";
    }
    for (llama_pos pos : exact) {
        is_exact[pos - p.pos0] = 1;
    }
    llama_ridgefill_pass second = make_pass(p.seq_id, p.pos0, cells, cells_swa, is_exact, T);
    second.fills    = false;
    second.out_rows = p.out_rows;
    n_probe = T;
    return run_pass(second);
}

//
// the late phase of a plan
//

int llama_ridgefill_context::finish() {
    const int64_t t_start_us = wait_early_phase();

    const llama_ridgefill_plan p = plan;
    plan = {};
    const int32_t N = p.pos_end - p.pos0;
    const int32_t T = std::min(params.n_tail, N);

    std::vector<int64_t> cells;
    std::vector<int64_t> cells_swa;
    std::string err = plan_cells(p, cells, cells_swa);
    if (!err.empty()) {
        return fail_plan(p, err);
    }
    reset_scales(T);

    std::vector<char>      is_exact(N, 0);
    std::vector<llama_pos> exact;
    int32_t                n_probe = 0;
    err = run_late_passes(p, T, std::move(cells), std::move(cells_swa), is_exact, exact, n_probe);
    if (err.empty() && !lost_servers_after_sync().empty()) {
        err = "the late phase did not complete";
    }
    if (!err.empty()) {
        return fail_plan(p, err);
    }

    // the scheduler now holds the late-phase graph: the next decode builds its own
    lctx.graph_forget(false);
    cur = {};
    last_exact = exact;

    record_stats(p, T, (int32_t) exact.size(), (int32_t) std::count(is_exact.begin(), is_exact.end(), 1), n_probe, t_start_us);
    log_timing();
    timing = {};
    return 0;
}

int64_t llama_ridgefill_context::wait_early_phase() {
    // the early phase's graphs may still run (llama_context::decode does not wait): the selector's
    // scores are read next. The wait is the early phase's compute, so it counts there
    const int64_t t_sync_us = ggml_time_us();
    ggml_backend_sched_synchronize(lctx.get_sched());
    const int64_t t_start_us = ggml_time_us();
    timing.early_us += t_start_us - t_sync_us;
    return t_start_us;
}

int llama_ridgefill_context::fail_plan(const llama_ridgefill_plan & p, const std::string & msg) {
    const std::string lost = llama_ridgefill_lost_servers(model);
    llama_ridgefill_set_error("llama_decode", (lost.empty() ? msg : format("%s: RPC server %s stopped responding, "
            "the model's tensors there are lost", msg.c_str(), lost.c_str())) + "; the prompt's rows are removed");
    lctx.get_memory()->seq_rm(p.seq_id, p.pos0, -1);
    lctx.graph_forget(false);
    cur = {};
    return -3;
}

std::string llama_ridgefill_context::plan_cells(const llama_ridgefill_plan & p, std::vector<int64_t> & cells,
        std::vector<int64_t> & cells_swa) const {
    const int32_t N = p.pos_end - p.pos0;
    const llama_ridgefill_caches caches(lctx.get_memory());
    cells     = llama_ridgefill_find_cells(caches.base, p.seq_id, p.pos0, N);
    cells_swa = caches.swa ? llama_ridgefill_find_cells(caches.swa, p.seq_id, p.pos0, N) : std::vector<int64_t>();
    // a window-sized sliding-window cache no longer holds the first rows of a long prompt (the late
    // sliding-window layers run them over the scratch, make_windows); every other row must be there
    const size_t n_left = swa_scratch ? std::find_if(cells_swa.begin(), cells_swa.end(), [](int64_t c) { return c >= 0; }) - cells_swa.begin() : 0;
    if (n_left > 0 && p.swa_prefix) {
        return "rows before the planned prompt that its first rows attend to at sliding-window layers have left the "
               "window-sized sliding-window cache";
    }
    if (std::find(cells.begin(), cells.end(), -1) != cells.end() ||
        std::find(cells_swa.begin() + n_left, cells_swa.end(), -1) != cells_swa.end() ||
        (!cells_swa.empty() && n_left == cells_swa.size())) {
        return "a row of the planned prompt is missing from the KV cache (removed while the plan was in progress?)";
    }
    return "";
}

void llama_ridgefill_context::reset_scales(int32_t T) {
    const llama_hparams & hparams = model.hparams;
    const int32_t S = params.split_layer;
    uint32_t n_head_kv_max = 0;
    for (int32_t il = S; il < n_layer; ++il) {
        n_head_kv_max = std::max(n_head_kv_max, hparams.n_head_kv(il));
    }
    last_v_scales.assign((size_t) (n_layer - S)*n_head_kv_max, 1.0f);
    last_k_scales.assign(std::min(params.n_key_rescale, T) > 0 ? (size_t) (n_layer - S)*n_head_kv_max : 0, 1.0f);
    boundary_states.clear();
}

std::string llama_ridgefill_context::run_late_passes(const llama_ridgefill_plan & p, int32_t T, std::vector<int64_t> cells,
        std::vector<int64_t> cells_swa, std::vector<char> & is_exact, std::vector<llama_pos> & exact, int32_t & n_probe) {
    const int32_t n_prefix = (int32_t) is_exact.size() - T;
    std::fill(is_exact.begin() + n_prefix, is_exact.end(), 1);
    if (params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE && !p.exact_set) {
        return run_probe(p, cells, cells_swa, is_exact, exact, n_probe);
    }
    exact = select_exact(p, cells, n_prefix);
    for (llama_pos pos : exact) {
        is_exact[pos - p.pos0] = 1;
    }
    llama_ridgefill_pass ps = make_pass(p.seq_id, p.pos0, std::move(cells), std::move(cells_swa), is_exact, T);
    ps.out_rows = p.out_rows;
    return run_pass(ps);
}

void llama_ridgefill_context::record_stats(const llama_ridgefill_plan & p, int32_t T, int32_t n_exact, int32_t n_x,
        int32_t n_probe, int64_t t_start_us) {
    const int32_t S = params.split_layer;
    const int32_t N = p.pos_end - p.pos0;
    const double  r = double(S)/n_layer + (1.0 - double(S)/n_layer)*double(n_x + n_probe)/N;
    stats = {};
    stats.active       = 1;
    stats.seq_id       = p.seq_id;
    stats.pos0         = p.pos0;
    stats.n_prompt     = N;
    stats.n_layer      = n_layer;
    stats.split_layer  = S;
    stats.n_tail       = T;
    stats.n_exact      = n_exact;
    stats.n_filled     = N - n_x;
    stats.sel_layer    = p.exact_set ? -1 : params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE ? S : sel_layer;
    stats.n_scale_rows = std::min(params.n_rescale, T);
    stats.ceiling      = (float) (1.0/r);
    stats.n_probe      = n_probe;
    stats.t_late_ms    = (ggml_time_us() - t_start_us)/1000.0;

    // early-phase graphs are reused for ubatches of the same shape (llm_graph_params::allow_reuse);
    // late-phase graphs are all different
    stats.n_early_built  = timing.n_early;
    stats.n_early_reused = timing.n_early_reused;
    stats.n_late_built   = timing.n_graphs;
    stats.n_late_reused  = 0;
    stats.n_late_rows    = (int32_t) lctx.get_cparams().n_ubatch;
    stats.n_late_rows_recr = n_late_rows_recr;
    stats.n_scratch_cells = swa_scratch ? (int32_t) swa_scratch->get_size() : 0;
    stats.n_window_graphs = timing.n_window;
    stats.graph_kq_mask   = graph_mask ? 1 : 0;
    stats.scratch_bytes   = 0;
    for (const auto & [buft, size] : swa_scratch ? swa_scratch->memory_breakdown() : std::map<ggml_backend_buffer_type_t, size_t>()) {
        stats.scratch_bytes += (int64_t) size;
    }
    stats.t_early_ms     = timing.early_us/1000.0;
    stats.t_build_ms     = timing.build_us/1000.0;
    stats.t_alloc_ms     = timing.alloc_us/1000.0;
    stats.t_set_input_ms = timing.inputs_us/1000.0;
    stats.t_compute_ms   = timing.compute_us/1000.0;
    stats.t_wait_ms      = timing.wait_us/1000.0;
    stats.t_other_ms     = stats.t_late_ms - (stats.t_build_ms + stats.t_alloc_ms + stats.t_set_input_ms +
                                              stats.t_compute_ms + stats.t_wait_ms);
}

void llama_ridgefill_context::log_timing() const {
    // LLAMA_RIDGEFILL_TIMING=1: where the time of this prompt went
    if (const char * env = getenv("LLAMA_RIDGEFILL_TIMING"); env && atoi(env) > 0) {
        LLAMA_LOG_INFO("%s: RidgeFill timing: early phase %d graphs built, %d reused, %.1f ms (graph + launch, compute may be async); "
                "late phase %.1f ms: %d graphs (%lld nodes), build %.1f ms, alloc %.1f ms, inputs %.1f ms, "
                "compute %.1f ms, wait %.1f ms, other %.1f ms\n", __func__, stats.n_early_built, stats.n_early_reused, stats.t_early_ms,
                stats.t_late_ms, stats.n_late_built, (long long) timing.n_nodes, stats.t_build_ms, stats.t_alloc_ms,
                stats.t_set_input_ms, stats.t_compute_ms, stats.t_wait_ms, stats.t_other_ms);
    }
}

//
// fill steps
//

int32_t llama_ridgefill_context::fill_steps_max() const {
    // about 40 nodes a step, in half the node budget of a ubatch's graph
    const uint32_t n_ubatch = lctx.get_cparams().n_ubatch;
    return std::max<int32_t>(1, ((int32_t) lctx.graph_max_nodes(n_ubatch)/2 - 256)/40);
}

int32_t llama_ridgefill_context::fill_step_rows() const {
    return params.n_fill_chunk > 0 ? params.n_fill_chunk : (int32_t) lctx.get_cparams().n_ubatch;
}

int32_t llama_ridgefill_context::fill_chunk(int32_t n_f) const {
    const int32_t max_steps = fill_steps_max();
    const int32_t n_chunk   = fill_step_rows();
    return std::max({ 1, n_chunk, (n_f + max_steps - 1)/max_steps });
}
