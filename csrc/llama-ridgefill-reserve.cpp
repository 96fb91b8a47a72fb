// The compute buffers of a plan's graphs, reserved when RidgeFill is attached (llama_ridgefill_attach)
// and whenever llama.cpp reserves its own, so that no graph of a plan reallocates them.

#include "llama-ridgefill-context.h"
#include "llama-ridgefill-arch.h"
#include "llama-ridgefill-memory.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <map>
#include <numeric>

// Reserving the compute buffers of a plan's graphs, as named steps: the scheduler keeps the largest
// buffers of the graphs it reserves, so each step reserves the largest graph of one kind a plan can
// build - an early ubatch, the late graph of each layer whose graph differs, the window graph over
// the scratch cache, the multi-layer segments, and the larger chunks of recurrent late layers that
// fit what the others reserved.
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
        mctx     = caches.reserve_context(nullptr);
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
        llama_memory_context_ptr m = caches.reserve_context(rf.swa_scratch.get());
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
