// Window graphs: the late sliding-window layers of a prompt longer than a window-sized
// sliding-window cache (llama-server's default on gemma3 and gpt-oss; swa_full off). The cache no
// longer holds the prompt's first rows when the late phase runs, so the exact rows whose windows reach
// them run those layers over a scratch cache of n_swa + 2 n_ubatch cells, in groups whose windows fit
// it (docs/design.md §6.6): the scratch made with the compute buffers (create_swa_scratch), and the
// groups of a pass with the rows each brings into the scratch (make_windows). The graphs themselves
// are built and run with the other late graphs (llama-ridgefill-late.cpp: late_graph, run_graph).

#include "llama-ridgefill-context.h"
#include "llama-ridgefill-memory.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>

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
