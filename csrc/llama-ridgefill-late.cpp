// The late phase of a planned prompt: plan -> passes -> graphs -> run (see llama-ridgefill-late.h),
// and the reservation of the compute buffers its graphs need.

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

void llama_ridgefill_context::make_windows(llama_ridgefill_pass & ps) const {
    const llama_hparams & hparams = model.hparams;
    const llama_ridgefill_caches caches(lctx.get_memory());
    GGML_ASSERT(swa_scratch && caches.swa && hparams.n_pos_per_embd() == 1);

    const int32_t n_swa    = (int32_t) hparams.n_swa;
    const int32_t n_ubatch = (int32_t) lctx.get_cparams().n_ubatch;
    const int32_t n_cells  = (int32_t) swa_scratch->get_size();
    const int32_t n_x      = (int32_t) ps.X.size();
    const llama_ridgefill_fill & f = ps.fill;

    // the rows the cache holds: the last ones, from j_r0 on
    int32_t j_r0 = 0;
    while (j_r0 < ps.N && ps.cells_swa[j_r0] < 0) {
        ++j_r0;
    }
    GGML_ASSERT(std::find(ps.cells_swa.begin() + j_r0, ps.cells_swa.end(), -1) == ps.cells_swa.end());

    // its filled rows, written by the first graph of each late sliding-window layer over the cache
    const int64_t offs_swa = (int64_t) f.strm_swa*caches.swa->get_size();
    const bool    local_v  = !f.v_trans.empty() && offs_swa != 0;
    llama_ridgefill_fill & fs = ps.fill_swa;
    fs.v_trans  = f.v_trans;
    fs.strm     = f.strm;
    fs.strm_swa = f.strm_swa;
    fs.splice   = f.splice;
    for (int32_t j = j_r0; j < ps.N; ++j) {
        if (ps.xi[j] < 0) {
            fs.rows     .push_back(j);
            fs.pos      .push_back(ps.pos0 + j);
            fs.cells_swa.push_back(ps.cells_swa[j] + offs_swa);
            if (local_v) {
                fs.cells_v_swa.push_back(ps.cells_swa[j]);
            }
        }
    }
    fs.n_chunk = fill_chunk((int32_t) fs.rows.size());

    // the exact rows whose window reaches a row the cache no longer holds: X[0, n_x_win)
    ps.n_x_win = 0;
    while (ps.n_x_win < n_x && ps.X[ps.n_x_win] - n_swa + 1 < j_r0) {
        ++ps.n_x_win;
    }

    // the scratch's storage, and the cache's for the exact rows written to both
    llama_ridgefill_write wt0;
    wt0.k.assign(n_layer, nullptr);
    wt0.v.assign(n_layer, nullptr);
    wt0.v_trans = caches.swa->get_v_trans();
    wt0.strm    = f.strm_swa;
    std::vector<ggml_tensor *> v_scratch;
    if (wt0.v_trans) {
        v_scratch.assign(n_layer, nullptr);
    }
    for (int32_t il = params.split_layer; il < n_layer; ++il) {
        if (hparams.is_swa(il) && !hparams.is_recr(il)) {
            wt0.k[il] = caches.swa->get_k_storage(il);
            wt0.v[il] = caches.swa->get_v_storage(il);
            if (wt0.v_trans) {
                v_scratch[il] = swa_scratch->get_v_storage(il);
            }
        }
    }

    // groups in position order, each at most n_ubatch exact rows whose windows (the rows [max(p - n_swa
    // + 1, 0), p] of each, as planned rows) fit the scratch together. The rows of a group's windows below
    // its first row were in the previous group's windows, so the scratch holds them already; the others
    // enter, into cells whose rows have left (positions below the group's first window)
    std::vector<int32_t> cell_row(n_cells, -1); // the planned row in each scratch cell
    int32_t in_end = -1;                        // the last row in the scratch
    for (int32_t k0 = 0; k0 < ps.n_x_win; ) {
        llama_ridgefill_window w;
        w.c0 = k0;
        const int32_t lo = std::max(ps.X[k0] - n_swa + 1, 0);
        int32_t n_rows = 0;
        int32_t end    = lo - 1;
        int32_t k      = k0;
        while (k < ps.n_x_win && k - k0 < n_ubatch) {
            const int32_t a = std::max({ ps.X[k] - n_swa + 1, end + 1, 0 });
            if (k > k0 && n_rows + (ps.X[k] - a + 1) > n_cells) {
                break;
            }
            n_rows += ps.X[k] - a + 1;
            end = ps.X[k];
            ++k;
        }
        w.c1 = k;
        w.lo = ps.pos0 + lo;

        for (int32_t & r : cell_row) {
            if (r >= 0 && r < lo) {
                r = -1;
            }
        }
        w.fill.v_trans  = v_scratch;
        w.fill.strm_swa = 0;
        w.fill.splice   = f.splice;
        w.wt.k       = wt0.k;
        w.wt.v       = wt0.v;
        w.wt.v_trans = wt0.v_trans;
        w.wt.strm    = wt0.strm;
        int32_t c    = 0;   // the next cell to try
        int32_t last = in_end;
        for (int32_t kk = k0; kk < w.c1; ++kk) {
            for (int32_t j = std::max({ ps.X[kk] - n_swa + 1, last + 1, 0 }); j <= ps.X[kk]; ++j) {
                while (cell_row[c] >= 0) {
                    ++c;
                    GGML_ASSERT(c < n_cells);
                }
                cell_row[c] = j;
                w.pos_new  .push_back(ps.pos0 + j);
                w.cells_new.push_back((uint32_t) c);
                if (ps.xi[j] < 0) {
                    w.fill.rows     .push_back(j);
                    w.fill.pos      .push_back(ps.pos0 + j);
                    w.fill.cells_swa.push_back(c);
                } else {
                    GGML_ASSERT(j == ps.X[kk]);
                    w.cells_x.push_back((uint32_t) c);
                    if (ps.cells_swa[j] >= 0) {
                        w.wt.ids.push_back(kk - k0);
                        w.wt.cells.push_back(ps.cells_swa[j] + offs_swa);
                        if (local_v) {
                            w.wt.cells_v.push_back(ps.cells_swa[j]);
                        }
                    }
                }
            }
            last = std::max(last, ps.X[kk]);
        }
        w.fill.n_chunk = fill_chunk((int32_t) w.fill.rows.size());
        in_end = last;
        k0     = w.c1;
        ps.windows.push_back(std::move(w));
    }
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
    // the early phase's graphs may still run (llama_context::decode does not wait): the selector's
    // scores are read below. The wait is the early phase's compute, so it counts there
    const int64_t t_sync_us = ggml_time_us();
    ggml_backend_sched_synchronize(lctx.get_sched());
    const int64_t t_start_us = ggml_time_us();
    timing.early_us += t_start_us - t_sync_us;

    const llama_hparams & hparams = model.hparams;
    const llama_ridgefill_plan p = plan;
    plan = {};

    const int32_t S        = params.split_layer;
    const int32_t N        = p.pos_end - p.pos0;
    const int32_t T        = std::min(params.n_tail, N);
    const int32_t n_prefix = N - T;

    auto fail = [&](const std::string & msg) {
        const std::string lost = llama_ridgefill_lost_servers(model);
        llama_ridgefill_set_error("llama_decode", (lost.empty() ? msg : format("%s: RPC server %s stopped responding, "
                "the model's tensors there are lost", msg.c_str(), lost.c_str())) + "; the prompt's rows are removed");
        lctx.get_memory()->seq_rm(p.seq_id, p.pos0, -1);
        lctx.graph_forget(false);
        cur = {};
        return -3;
    };

    // the cells of the planned rows
    const llama_ridgefill_caches caches(lctx.get_memory());
    std::vector<int64_t> cells     = llama_ridgefill_find_cells(caches.base, p.seq_id, p.pos0, N);
    std::vector<int64_t> cells_swa = caches.swa ? llama_ridgefill_find_cells(caches.swa, p.seq_id, p.pos0, N) : std::vector<int64_t>();
    // a window-sized sliding-window cache no longer holds the first rows of a long prompt (the late
    // sliding-window layers run them over the scratch, make_windows); every other row must be there
    const size_t n_left = swa_scratch ? std::find_if(cells_swa.begin(), cells_swa.end(), [](int64_t c) { return c >= 0; }) - cells_swa.begin() : 0;
    if (n_left > 0 && p.swa_prefix) {
        return fail("rows before the planned prompt that its first rows attend to at sliding-window layers have left the "
                "window-sized sliding-window cache");
    }
    if (std::find(cells.begin(), cells.end(), -1) != cells.end() ||
        std::find(cells_swa.begin() + n_left, cells_swa.end(), -1) != cells_swa.end() ||
        (!cells_swa.empty() && n_left == cells_swa.size())) {
        return fail("a row of the planned prompt is missing from the KV cache (removed while the plan was in progress?)");
    }

    // the scales measured per late layer and KV head (1: not measured)
    uint32_t n_head_kv_max = 0;
    for (int32_t il = S; il < n_layer; ++il) {
        n_head_kv_max = std::max(n_head_kv_max, hparams.n_head_kv(il));
    }
    last_v_scales.assign((size_t) (n_layer - S)*n_head_kv_max, 1.0f);
    last_k_scales.assign(std::min(params.n_key_rescale, T) > 0 ? (size_t) (n_layer - S)*n_head_kv_max : 0, 1.0f);
    boundary_states.clear();

    std::vector<char> is_exact(N, 0);
    std::fill(is_exact.begin() + n_prefix, is_exact.end(), 1);

    std::vector<llama_pos> exact;
    int32_t     n_probe = 0;
    std::string err;
    if (params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE && !p.exact_set) {
        err = run_probe(p, cells, cells_swa, is_exact, exact, n_probe);
    } else {
        exact = select_exact(p, cells, n_prefix);
        for (llama_pos pos : exact) {
            is_exact[pos - p.pos0] = 1;
        }
        llama_ridgefill_pass ps = make_pass(p.seq_id, p.pos0, std::move(cells), std::move(cells_swa), is_exact, T);
        ps.out_rows = p.out_rows;
        err = run_pass(ps);
    }
    if (err.empty() && !lost_servers_after_sync().empty()) {
        err = "the late phase did not complete";
    }
    if (!err.empty()) {
        return fail(err);
    }
    const int32_t n_x = std::count(is_exact.begin(), is_exact.end(), 1);

    // the scheduler now holds the late-phase graph: the next decode builds its own
    lctx.graph_forget(false);
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

    // LLAMA_RIDGEFILL_TIMING=1: where the time of this prompt went
    if (const char * env = getenv("LLAMA_RIDGEFILL_TIMING"); env && atoi(env) > 0) {
        LLAMA_LOG_INFO("%s: RidgeFill timing: early phase %d graphs built, %d reused, %.1f ms (graph + launch, compute may be async); "
                "late phase %.1f ms: %d graphs (%lld nodes), build %.1f ms, alloc %.1f ms, inputs %.1f ms, "
                "compute %.1f ms, wait %.1f ms, other %.1f ms\n", __func__, stats.n_early_built, stats.n_early_reused, stats.t_early_ms,
                stats.t_late_ms, stats.n_late_built, (long long) timing.n_nodes, stats.t_build_ms, stats.t_alloc_ms,
                stats.t_set_input_ms, stats.t_compute_ms, stats.t_wait_ms, stats.t_other_ms);
    }
    timing = {};
    return 0;
}

//
// the compute buffers
//

// Reserving the compute buffers of a plan's graphs, as named steps: the scheduler keeps the largest
// buffers of the graphs it reserves, so each step reserves the largest graph of one kind a plan can
// build - an early ubatch, the late graph of each layer whose graph differs, the multi-layer
// segments, and the larger chunks of recurrent late layers that fit what the others reserved.
struct llama_ridgefill_reserver {
    llama_ridgefill_context & rf;
    const llama_hparams     & hparams;
    const llama_cparams     & cparams;
    const llama_ridgefill_caches caches;
    ggml_backend_sched_t      sched;

    llama_memory_context_ptr mctx;
    int32_t n_tokens = 0; // rows of a ubatch
    int32_t n_f_max  = 0; // the most filled rows a prompt can have
    int32_t n_query  = 0; // probe query rows
    llama_ridgefill_late_graph lg;
    bool ok = true;

    explicit llama_ridgefill_reserver(llama_ridgefill_context & rf) :
            rf(rf), hparams(rf.model.hparams), cparams(rf.lctx.get_cparams()), caches(rf.lctx.get_memory()),
            sched(rf.lctx.get_sched()) {
        mctx     = rf.lctx.get_memory()->init_full();
        n_tokens = (int32_t) std::min(cparams.n_ctx, cparams.n_ubatch);
        n_f_max  = std::max<int32_t>(1, (int32_t) cparams.n_ctx - 1);
        n_query  = rf.params.selector == LLAMA_RIDGEFILL_SELECTOR_PROBE ? rf.params.n_sel_queries : 0;
    }

    void reserve_graph(const llama_ubatch & ub, uint32_t n_outputs) {
        ggml_cgraph * gf = rf.build_graph(ub, mctx.get(), n_outputs);
        ok = ok && gf && ggml_backend_sched_reserve(sched, gf);
    }

    // a pass of n_f filled and n_x exact rows (the last min(T, n_x) of them the tail)
    llama_ridgefill_pass pass(int32_t n_f, int32_t n_x, int32_t n_q) {
        std::vector<char> is_exact(n_f + n_x, 0);
        std::fill(is_exact.begin() + n_f, is_exact.end(), 1);
        llama_ridgefill_pass ps = rf.make_pass(0, 0, std::vector<int64_t>(n_f + n_x, 0),
                std::vector<int64_t>(caches.swa ? n_f + n_x : 0, 0), is_exact, std::min(rf.params.n_tail, n_x));
        ps.n_query = std::min(n_q, ps.T);
        return ps;
    }

    void reserve_late(const llama_ridgefill_pass & ps, int32_t l0, int32_t l1, int32_t n_rows) {
        rf.late_graph(ps, l0, l1, 0, n_rows, lg);
        rf.cur = std::move(lg.rf);
        reserve_graph(lg.ub, lg.out_idx.size());
    }

    // a recurrent layer's graphs: a chunk of n_tokens rows half of them filled, and one all exact
    void reserve_recurrent(int32_t l0, int32_t l1) {
        reserve_late(pass(n_tokens/2, n_tokens - n_tokens/2, 0), l0, l1, n_tokens);
        reserve_late(pass(0, n_tokens, 0), l0, l1, n_tokens);
    }

    // an early ubatch holding the selector's query rows
    void early() {
        std::vector<llama_pos> pos(n_tokens);
        std::iota(pos.begin(), pos.end(), 0);
        const llama_ubatch ub = llama_ridgefill_make_ubatch(0, pos, false, hparams.n_pos_per_embd());
        rf.cur = rf.early_graph(std::vector<int32_t>(n_tokens, 0),
                std::vector<int32_t>(rf.sel_layer >= 0 ? std::min(n_tokens, rf.params.n_sel_queries) : 0, 0));
        reserve_graph(ub, 0);
    }

    // the late graphs of one layer, at the layers whose graphs differ: the last (with logits), the
    // split layer (input from xs), the probe's last full-attention layer, and the first recurrent late
    // layer. An attention layer's graph: a chunk of n_tokens exact rows with the most filled rows a
    // prompt can have in their fill steps
    void late_layers() {
        const int32_t S = rf.params.split_layer;
        std::vector<int32_t> layers = { rf.n_layer - 1, S };
        for (int32_t il = rf.n_layer - 1; il >= S && n_query > 0; --il) {
            if (llama_ridgefill_is_full_attention(hparams, il)) {
                layers.push_back(il);
                break;
            }
        }
        for (int32_t il = S; il < rf.n_layer; ++il) {
            if (hparams.is_recr(il)) {
                layers.push_back(il);
                break;
            }
        }
        std::sort(layers.begin(), layers.end());
        layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
        for (int32_t il : layers) {
            if (hparams.is_recr(il)) {
                reserve_recurrent(il, il + 1);
            } else {
                reserve_late(pass(n_f_max, n_tokens, n_query), il, il + 1, n_tokens);
            }
        }
    }

    // the graphs of several layers (llama_ridgefill_context::late_segments): each run of recurrent
    // layers, and the runs of attention layers a pass of one chunk of exact rows shares, for each count
    // of fill steps (the most filled rows for that count) and for a pass that does not fill (probe)
    void late_multi_layer() {
        std::map<std::pair<int32_t, int32_t>, int32_t> multi; // (l0, l1) -> filled rows (-1: no fill)
        const int32_t n_chunk = rf.fill_step_rows();
        for (int32_t n_steps = 0; n_steps <= rf.fill_steps_max(); ++n_steps) {
            const int32_t n_f = std::min(n_f_max, n_steps*n_chunk);
            for (const auto & sg : rf.late_segments(n_tokens, n_steps > 0 ? n_f : 0, n_steps > 0)) {
                if (sg.l1 - sg.l0 > 1) {
                    auto it = multi.emplace(std::make_pair(sg.l0, sg.l1), -1).first;
                    it->second = std::max(it->second, hparams.is_recr(sg.l0) ? 0 : (n_steps > 0 ? n_f : -1));
                }
            }
        }
        for (const auto & [sg, n_f] : multi) {
            if (hparams.is_recr(sg.first)) {
                reserve_recurrent(sg.first, sg.second);
            } else if (n_f > 0) {
                reserve_late(pass(n_f, n_tokens, n_query), sg.first, sg.second, n_tokens);
            } else {
                llama_ridgefill_pass ps = pass(n_f_max, n_tokens, n_query);
                ps.fills = false;
                reserve_late(ps, sg.first, sg.second, n_tokens);
            }
        }
    }

    // a window-sized sliding-window cache: the graph of a late sliding-window layer over the scratch
    // (its attention reads up to all of it), at the first such layer and the last layer (with logits)
    void late_window() {
        if (!rf.swa_scratch) {
            return;
        }
        llama_memory_context_ptr m = caches.scratch_context(rf.swa_scratch.get(), 0,
                llama_ridgefill_make_ubatch(0, {}, false, 1), {}, {});
        std::swap(m, mctx);
        const int32_t n_f = std::min<int32_t>(n_f_max, (int32_t) rf.swa_scratch->get_size());
        bool first = true;
        for (int32_t il = rf.params.split_layer; il < rf.n_layer; ++il) {
            if (hparams.is_swa(il) && !hparams.is_recr(il) && (first || il == rf.n_layer - 1)) {
                reserve_late(pass(n_f, n_tokens, n_query), il, il + 1, n_tokens);
                first = false;
            }
        }
        std::swap(m, mctx);
    }

    // recurrent late layers: chunks of more rows than n_ubatch (at most n_ubatch of them exact), as
    // many as the compute buffers reserved so far hold: fewer graphs, and no more memory. Sets
    // rf.n_late_rows_recr
    void recurrent_chunks() {
        rf.n_late_rows_recr = n_tokens;
        std::vector<llama_ridgefill_segment> recurrent;
        for (const auto & sg : rf.late_segments(n_tokens, 0, false)) {
            if (hparams.is_recr(sg.l0)) {
                recurrent.push_back(sg);
            }
        }
        const int n_backends = ggml_backend_sched_get_n_backends(sched);
        std::vector<size_t> have(n_backends);
        std::vector<size_t> need(n_backends);
        for (int i = 0; i < n_backends; ++i) {
            have[i] = ggml_backend_sched_get_buffer_size(sched, ggml_backend_sched_get_backend(sched, i));
        }
        for (int32_t m = 8; ok && !recurrent.empty() && m >= 2 && rf.n_late_rows_recr == n_tokens; m /= 2) {
            const int32_t n_rows = std::min<int32_t>(m*n_tokens, cparams.n_ctx);
            if (n_rows <= n_tokens) {
                continue;
            }
            // a chunk with n_ubatch exact rows runs the segment in one graph, one without exact rows
            // each layer in its own
            const llama_ridgefill_pass mixed  = pass(n_rows - n_tokens, n_tokens, 0);
            const llama_ridgefill_pass filled = pass(n_rows, 0, 0);
            std::vector<std::pair<const llama_ridgefill_pass *, llama_ridgefill_segment>> graphs;
            for (const auto & sg : recurrent) {
                graphs.push_back({ &mixed,  sg });
                graphs.push_back({ &filled, { sg.l0, sg.l0 + 1 } });
            }
            bool fits = true;
            for (const auto & [ps, sg] : graphs) {
                rf.late_graph(*ps, sg.l0, sg.l1, 0, n_rows, lg);
                rf.cur = std::move(lg.rf);
                ggml_cgraph * gf = rf.build_graph(lg.ub, mctx.get(), lg.out_idx.size());
                if (gf == nullptr) {
                    fits = false;
                    break;
                }
                ggml_backend_sched_reserve_size(sched, gf, need.data());
                for (int i = 0; i < n_backends; ++i) {
                    fits = fits && need[i] <= have[i];
                }
            }
            if (fits) {
                for (const auto & [ps, sg] : graphs) {
                    reserve_late(*ps, sg.l0, sg.l1, n_rows);
                }
                rf.n_late_rows_recr = n_rows;
            }
        }
    }
};

bool llama_ridgefill_context::reserve() {
    const llama_cparams & cparams = lctx.get_cparams();
    if (params.split_layer >= n_layer) {
        return true; // every prompt runs stock
    }
    const auto & capture = cparams.embeddings_layer_inp;
    if (std::find(capture.begin(), capture.end(), true) != capture.end()) {
        return true; // no plan begins while a layer-input capture is on; turning it off reserves again
    }
    if (cparams.embeddings) {
        return true; // no plan begins while embeddings are on (llama_set_embeddings); turning them off reserves again
    }

    if (!create_swa_scratch()) {
        return false;
    }
    llama_ridgefill_reserver rs(*this);
    if (!rs.mctx) {
        return false;
    }
    rs.early();
    rs.late_layers();
    rs.late_window();
    rs.late_multi_layer();
    rs.recurrent_chunks();

    res_late->reset();
    cur = {};

    // the scheduler no longer holds the previous graph; the compute buffers are what is expected now
    lctx.graph_forget(true);
    return rs.ok;
}

bool llama_ridgefill_context::create_swa_scratch() {
    const llama_hparams & hparams = model.hparams;
    const llama_cparams & cparams = lctx.get_cparams();
    const llama_ridgefill_caches caches(lctx.get_memory());
    if (swa_scratch || !caches.swa || caches.swa->get_size() >= caches.base->get_size()) {
        return true; // made already, or the sliding-window cache holds every row of a prompt
    }
    int32_t il0 = -1;
    for (int32_t il = params.split_layer; il < n_layer && il0 < 0; ++il) {
        il0 = hparams.is_swa(il) && !hparams.is_recr(il) ? il : -1;
    }
    if (il0 < 0) {
        return true; // no late sliding-window layer
    }
    // room for a window and two ubatches of exact rows' positions, like the sliding-window cache's
    // n_swa + n_ubatch cells (fewer window graphs for a little more memory)
    const uint32_t n_pad  = 256;
    const uint32_t n_size = std::min(caches.base->get_size(), GGML_PAD(hparams.n_swa + 2*cparams.n_ubatch, n_pad));
    const int32_t  S      = params.split_layer;
    try {
        swa_scratch = std::make_unique<llama_kv_cache>(model, hparams,
                caches.swa->get_k_storage(il0)->type, caches.swa->get_v_storage(il0)->type, caches.swa->get_v_trans(),
                cparams.offload_kqv, /*unified =*/ true, n_size, cparams.n_seq_max, n_pad, hparams.n_swa, hparams.swa_type,
                nullptr, [&](int32_t il) { return il >= S && hparams.is_swa(il); }, nullptr, nullptr, "ridgefill_window_");
    } catch (const std::exception & err) {
        LLAMA_LOG_ERROR("%s: failed to create the scratch cache of the late sliding-window layers: %s\n", __func__, err.what());
        return false;
    }
    return true;
}

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
