// RidgeFill graph pieces: the inputs of a planned prompt's graphs, the split-layer store, the
// attention selector, the value scale and the filled rows' K/V (see llama-ridgefill-graph.h).

#include "llama-ridgefill-graph.h"
#include "llama-ridgefill-arch.h"
#include "llama-ridgefill.h"
#include "llama-ridgefill-maps.h"

#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>


// the index tensors of a RidgeFill graph. Each one is filled from a vector of the graph's RidgeFill
// part, read when the inputs are set, not when the graph is built: an early-phase graph is reused for
// the next ubatch of the same shape (llama_ridgefill_graph::reuse_key), whose rows differ
class llm_graph_input_ridgefill : public llm_graph_input_i {
public:
    explicit llm_graph_input_ridgefill(const llama_ridgefill_graph & rf) : rf(rf) {}
    virtual ~llm_graph_input_ridgefill() = default;

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        for (const auto & s : sets) {
            if (s.t->buffer) { // an input no node used is not allocated
                GGML_ASSERT(s.size() == ggml_nbytes(s.t));
                ggml_backend_tensor_set(s.t, s.data(), 0, ggml_nbytes(s.t));
            }
        }
    }

    // the graph is reused only for graphs of the same RidgeFill kind (llm_graph_params::allow_reuse
    // compares their keys); their index vectors must still have the sizes of the tensors
    bool can_reuse(const llm_graph_params & params) override {
        if (params.ridgefill != &rf || rf.reuse_key() < 0) {
            return false;
        }
        for (const auto & s : sets) {
            if (s.size() != ggml_nbytes(s.t)) {
                return false;
            }
        }
        return true;
    }

    // a new input tensor filled from v (a vector of the graph's RidgeFill part, or of the pass it
    // belongs to), as v is when the inputs are set
    ggml_tensor * add(ggml_context * ctx0, const std::vector<int32_t> & v, const char * name) {
        sets.push_back({ new_input(ctx0, GGML_TYPE_I32, v.size(), name), &v, nullptr });
        return sets.back().t;
    }
    ggml_tensor * add(ggml_context * ctx0, const std::vector<int64_t> & v, const char * name) {
        sets.push_back({ new_input(ctx0, GGML_TYPE_I64, v.size(), name), nullptr, &v });
        return sets.back().t;
    }
    ggml_tensor * add(ggml_context * ctx0, const std::vector<float> & v, const char * name) {
        sets.push_back({ new_input(ctx0, GGML_TYPE_F32, v.size(), name), nullptr, nullptr, &v });
        return sets.back().t;
    }

    const llama_ridgefill_graph & rf;

    ggml_tensor * f_rows      = nullptr;
    ggml_tensor * f_pos       = nullptr;
    ggml_tensor * f_cells     = nullptr;
    ggml_tensor * f_cells_swa = nullptr;
    ggml_tensor * f_vcells     = nullptr;
    ggml_tensor * f_vcells_swa = nullptr;
    ggml_tensor * x_ids       = nullptr; // recurrent late layer: the exact rows among the graph's rows
    ggml_tensor * m_f_rows    = nullptr; // ... the xs rows of its filled rows
    ggml_tensor * m_perm      = nullptr; // ... and each row's place among concat(filled, exact)
    ggml_tensor * sel_ids     = nullptr; // the selector's query rows
    ggml_tensor * r_src_rows  = nullptr; // the value-scale rows: in r_src, in the graph, in xs
    ggml_tensor * r_ids       = nullptr;
    ggml_tensor * r_rows      = nullptr;
    ggml_tensor * rk_src_rows = nullptr; // the key-scale rows
    ggml_tensor * rk_ids      = nullptr;
    ggml_tensor * rk_rows     = nullptr;

private:
    static ggml_tensor * new_input(ggml_context * ctx0, ggml_type type, size_t n, const char * name) {
        ggml_tensor * t = ggml_new_tensor_1d(ctx0, type, (int64_t) n);
        ggml_set_input(t);
        ggml_set_name(t, name);
        return t;
    }

    // an input tensor and the vector it is filled from (one of i32, i64, f32)
    struct input_set {
        ggml_tensor                * t;
        const std::vector<int32_t> * i32;
        const std::vector<int64_t> * i64;
        const std::vector<float>   * f32 = nullptr;

        const void * data() const {
            return i32 ? (const void *) i32->data() : i64 ? (const void *) i64->data() : (const void *) f32->data();
        }
        size_t size() const {
            return i32 ? i32->size()*sizeof(int32_t) : i64 ? i64->size()*sizeof(int64_t) : f32->size()*sizeof(float);
        }
    };
    std::vector<input_set> sets;
};

static llm_graph_input_ridgefill * rf_inputs(const llm_graph_context & g) {
    const llama_ridgefill_graph * rf = g.rf;
    if (rf->inp == nullptr) {
        auto inp = std::make_unique<llm_graph_input_ridgefill>(*rf);
        rf->inp = (llm_graph_input_ridgefill *) g.res->add_input(std::move(inp));
    }
    return rf->inp;
}

// the inputs of layer il for the rows of a recurrent late graph, in position order: x̂ of layer il for
// the filled rows joins x_x, the exact rows' inputs (nullptr: the graph has none)
static ggml_tensor * rf_merge_rows(const llm_graph_context & g, int il, ggml_tensor * x_x) {
    const llama_ridgefill_graph * rf = g.rf;
    if (rf->m_f_rows.empty()) {
        return x_x; // every row is exact
    }
    GGML_ASSERT(x_x == nullptr || x_x->ne[1] == (int64_t) rf->x_ids.size());
    ggml_context * ctx0 = g.ctx0;
    auto * inp = rf_inputs(g);
    if (!inp->m_f_rows) {
        inp->m_f_rows = inp->add(ctx0, rf->m_f_rows, "ridgefill_m_f_rows");
    }
    const llama_ridgefill_map_weights w = llama_ridgefill_stage(ctx0, rf->maps, il);
    ggml_tensor * x_f = llama_ridgefill_build_xhat(ctx0, rf->maps, il, ggml_get_rows(ctx0, rf->xs_at(il), inp->m_f_rows), &w);
    if (x_x == nullptr) {
        return x_f; // every row is filled: already in position order
    }
    if (!inp->m_perm) {
        inp->m_perm = inp->add(ctx0, rf->m_perm, "ridgefill_m_perm");
    }
    return ggml_get_rows(ctx0, ggml_concat(ctx0, x_f, x_x, 1), inp->m_perm);
}

// rows [0, max(rows) + 1) of a persistent row buffer (xs, xx): a graph on another device gets a copy
// of these, not of the whole buffer. (The graphs reserve builds index past the buffer: they get all of
// it, the most a graph can copy.)
static ggml_tensor * rf_used_rows(ggml_context * ctx0, ggml_tensor * buf, const std::vector<int32_t> & rows) {
    const int64_t n = rows.empty() ? 1 : std::min<int64_t>(*std::max_element(rows.begin(), rows.end()) + 1, buf->ne[1]);
    return ggml_view_2d(ctx0, buf, buf->ne[0], n, buf->nb[1], 0);
}

// writes v [n_embd_head, n_head, n] into the cells kidx [n] of a transposed V storage [n_embd_v, kv_size]
// (element e of cell c at e*kv_size + c; one stream), as llama_kv_cache::cpy_v does with an index per
// element: rows narrower than the storage are padded with zeros, as there
static ggml_tensor * rf_cpy_v_trans(ggml_context * ctx0, ggml_tensor * v_store, ggml_tensor * v, ggml_tensor * kidx, int32_t strm) {
    const int64_t n        = v->ne[2];
    const int64_t n_embd   = v->ne[0]*v->ne[1];
    const int64_t n_planes = v_store->ne[0];
    const int64_t kv_size  = v_store->ne[1];
    GGML_ASSERT(ggml_nelements(v_store) == n_planes*kv_size*v_store->ne[2] && n_embd <= n_planes && strm < v_store->ne[2]);

    ggml_tensor * cur = ggml_cont_2d(ctx0, v, n_embd, n);
    if (n_embd < n_planes) {
        cur = ggml_pad(ctx0, cur, n_planes - n_embd, 0, 0, 0);
    }
    // [1, n, n_planes]: row i of plane e is element e of row i
    cur = ggml_reshape_3d(ctx0, ggml_cont(ctx0, ggml_transpose(ctx0, cur)), 1, n, n_planes);
    // the planes of the sequence's stream (a cache with one stream per sequence holds n_stream blocks)
    ggml_tensor * planes = ggml_view_3d(ctx0, v_store, 1, kv_size, n_planes,
            ggml_element_size(v_store), kv_size*ggml_element_size(v_store), (size_t) strm*n_planes*kv_size*ggml_element_size(v_store));
    return ggml_set_rows(ctx0, planes, cur, kidx);
}

ggml_tensor * llama_ridgefill_build_inp(const llm_graph_context & g) {
    const llama_ridgefill_graph * rf = g.rf;
    GGML_ASSERT(llama_ridgefill_is_late(rf) && rf->src);
    ggml_context * ctx0 = g.ctx0;

    auto * inp = rf_inputs(g);

    if (!rf->gdn) {
        GGML_ASSERT(rf->src_rows.size() == g.ubatch.n_tokens);
        ggml_tensor * rows = inp->add(ctx0, rf->src_rows, "ridgefill_src_rows");

        ggml_tensor * cur = ggml_get_rows(ctx0, rf_used_rows(ctx0, rf->src, rf->src_rows), rows);
        g.cb(cur, "ridgefill_inp", -1);
        return cur;
    }

    // a recurrent late layer: x̂ of the filled rows and the exact rows' inputs, merged in position order
    const int64_t n_f = rf->m_f_rows.size();
    const int64_t n_x = rf->src_rows.size();
    GGML_ASSERT(n_f + n_x == g.ubatch.n_tokens && rf->m_perm.size() == g.ubatch.n_tokens);

    ggml_tensor * x_x = nullptr;
    if (n_x > 0) {
        ggml_tensor * rows = inp->add(ctx0, rf->src_rows, "ridgefill_src_rows");
        x_x = ggml_get_rows(ctx0, rf_used_rows(ctx0, rf->src, rf->src_rows), rows);
    }
    GGML_ASSERT(n_f > 0 || x_x != nullptr);
    ggml_tensor * cur = rf_merge_rows(g, rf->il_begin, x_x);
    g.cb(cur, "ridgefill_inp", -1);
    return cur;
}

ggml_tensor * llama_ridgefill_build_out_ids(const llm_graph_context & g) {
    const llama_ridgefill_graph * rf = g.rf;
    if (llama_ridgefill_stops_early(rf, g.n_layer) || rf->out_ids.empty()) {
        return nullptr; // no output: stops early, or a chunk of a recurrent last layer without exact rows
    }
    return rf_inputs(g)->add(g.ctx0, rf->out_ids, "ridgefill_out_ids");
}

// the exact rows among a recurrent late layer's rows (nullptr: every row is exact, or not such a graph)
static ggml_tensor * rf_gdn_x_ids(const llm_graph_context & g) {
    const llama_ridgefill_graph * rf = g.rf;
    if (rf == nullptr || !rf->gdn || rf->m_f_rows.empty()) {
        return nullptr;
    }
    auto * inp = rf_inputs(g);
    if (!inp->x_ids) {
        inp->x_ids = inp->add(g.ctx0, rf->x_ids, "ridgefill_x_ids");
    }
    return inp->x_ids;
}

ggml_tensor * llama_ridgefill_build_gdn_state(const llm_graph_context & g, ggml_tensor * s, int il) {
    const llama_ridgefill_graph * rf = g.rf;
    if (rf == nullptr || !rf->gdn || !rf->state_gain || rf->maps == nullptr || il >= (int) rf->maps->g.size() ||
        rf->maps->g[il] == nullptr) {
        return s;
    }
    ggml_tensor * state_gain = rf->maps->g[il];
    GGML_ASSERT(state_gain->ne[0] == s->ne[2]);
    ggml_tensor * gain = ggml_reshape_4d(g.ctx0, state_gain, 1, 1, s->ne[2], 1);
    ggml_tensor * cur = ggml_mul(g.ctx0, s, gain);
    g.cb(cur, "ridgefill_state_corrected", il);
    return cur;
}

bool llama_ridgefill_build_gdn_readout(const llm_graph_context & g, int il, ggml_tensor * x_norm,
        ggml_tensor ** output, ggml_tensor ** z) {
    const llama_ridgefill_graph * rf = g.rf;
    if (rf == nullptr || !rf->gdn) {
        return true;
    }
    GGML_ASSERT(il >= rf->il_begin && il < rf->il_end);
    if (rf->x_ids.empty()) {
        return false;
    }
    ggml_tensor * ids = rf_gdn_x_ids(g);
    if (ids == nullptr) {
        return true; // every row is exact
    }
    ggml_context * ctx0 = g.ctx0;
    const llama_layer & layer = g.rf->model->layers[il];

    ggml_tensor * out = *output; // [S_v, H_v, n_tokens, 1]
    const int64_t S_v = out->ne[0];
    const int64_t H_v = out->ne[1];
    const int64_t n_x = rf->x_ids.size();
    if (!ggml_is_contiguous(out)) {
        out = ggml_cont(ctx0, out);
    }
    out = ggml_get_rows(ctx0, ggml_reshape_2d(ctx0, out, S_v*H_v, out->ne[2]*out->ne[3]), ids);
    *output = ggml_reshape_4d(ctx0, out, S_v, H_v, n_x, 1);

    // the output gate of the exact rows, as the model computes it for every row
    *z = g.build_lora_mm(layer.wqkv_gate, ggml_get_rows(ctx0, x_norm, ids), layer.wqkv_gate_s);
    return true;
}

ggml_tensor * llama_ridgefill_build_gdn_rows(const llm_graph_context & g, ggml_tensor * x) {
    ggml_tensor * ids = rf_gdn_x_ids(g);
    return ids ? ggml_get_rows(g.ctx0, x, ids) : x;
}

bool llama_ridgefill_build_split(const llm_graph_context & g, int il, ggml_tensor *& inpL) {
    const llama_ridgefill_graph * rf = g.rf;
    if (rf == nullptr) {
        return false;
    }
    if (llama_ridgefill_is_late(rf) && il > rf->il_begin && il < rf->il_end) {
        if (rf->gdn) {
            inpL = rf_merge_rows(g, il, inpL);
            g.cb(inpL, "ridgefill_inp", il);
        }
        rf->layer_inp = inpL; // the value scale of an attention layer reads its tail rows' inputs here
        return false;
    }
    rf->layer_inp = nullptr;
    if (!llama_ridgefill_stops_early(rf, g.n_layer) || il != rf->il_end) {
        return false;
    }
    GGML_ASSERT(rf->dst && (int64_t) rf->dst_rows.size() == inpL->ne[1]);

    auto * inp = rf_inputs(g);
    ggml_tensor * rows = inp->add(g.ctx0, rf->dst_rows, "ridgefill_dst_rows");

    ggml_tensor * x = inpL->type == rf->dst->type ? inpL : ggml_cast(g.ctx0, inpL, rf->dst->type);
    ggml_build_forward_expand(g.gf, ggml_set_rows(g.ctx0, rf->dst, x, rows));
    if (rf->dst == rf->xs) {
        for (ggml_tensor * copy : rf->xs_copies) {
            ggml_build_forward_expand(g.gf, ggml_set_rows(g.ctx0, copy, x, rows));
        }
    }
    return true;
}

//
// the K/V path of a layer: attention norm -> K, V projections (+ biases) -> k-norm -> RoPE, exactly as
// the model builders compute it, for rows of predicted inputs x [n_embd, n] at positions pos [n]
//

static void rf_build_kv(
        const llm_graph_context & g,
                            int   il,
                    ggml_tensor * x,
                    ggml_tensor * pos,
                    ggml_tensor ** k_out,
                    ggml_tensor ** v_out) {
    const llama_model   & model   = *g.rf->model;
    const llama_hparams & hparams = g.hparams;
    const llama_layer   & layer   = model.layers[il];
    ggml_context        * ctx0    = g.ctx0;

    const llama_ridgefill_arch * arch = llama_ridgefill_arch_find(model.arch);
    GGML_ASSERT(arch != nullptr);

    const int64_t n         = x->ne[1];
    const int64_t n_head    = hparams.n_head(il);
    const int64_t n_head_kv = hparams.n_head_kv(il);
    const int64_t d_k       = hparams.n_embd_head_k(il);
    const int64_t d_v       = hparams.n_embd_head_v(il);

    ggml_tensor * cur = g.build_norm(x, layer.attn_norm, nullptr, LLM_NORM_RMS, il);

    ggml_tensor * k = nullptr;
    ggml_tensor * v = nullptr;

    if (layer.wqkv) {
        // fused QKV: the whole projection (keeps adapters and scales right), then the K and V parts
        // (the Q part may be wider: llama_ridgefill_arch::q_width)
        const int64_t n_embd_q = arch->q_width*d_k*n_head;
        ggml_tensor * qkv = g.build_lora_mm(layer.wqkv, cur, layer.wqkv_s);
        if (layer.wqkv_b) {
            qkv = ggml_add(ctx0, qkv, layer.wqkv_b);
        }
        const size_t es = ggml_element_size(qkv);
        k = ggml_cont(ctx0, ggml_view_2d(ctx0, qkv, d_k*n_head_kv, n, qkv->nb[1], es*n_embd_q));
        v = ggml_cont(ctx0, ggml_view_2d(ctx0, qkv, d_v*n_head_kv, n, qkv->nb[1], es*(n_embd_q + d_k*n_head_kv)));
        if (!layer.wqkv_b && layer.wq_b && layer.wk_b && layer.wv_b) {
            // fused weights with separate Q/K/V biases, as build_qkv adds them
            k = ggml_add(ctx0, k, layer.wk_b);
            v = ggml_add(ctx0, v, layer.wv_b);
        }
    } else {
        k = g.build_lora_mm(layer.wk, cur, layer.wk_s);
        if (layer.wk_b) {
            k = ggml_add(ctx0, k, layer.wk_b);
        }
        if (v_out) {
            v = g.build_lora_mm(layer.wv, cur, layer.wv_s);
            if (layer.wv_b) {
                v = ggml_add(ctx0, v, layer.wv_b);
            }
        }
    }

    if (hparams.f_clamp_kqv > 0.0f) {
        k = ggml_clamp(ctx0, k, -hparams.f_clamp_kqv, hparams.f_clamp_kqv);
        if (v) {
            v = ggml_clamp(ctx0, v, -hparams.f_clamp_kqv, hparams.f_clamp_kqv);
        }
    }

    if (v_out) {
        *v_out = ggml_reshape_3d(ctx0, v, d_v, n_head_kv, n);
    }
    if (!k_out) {
        return;
    }

    k = ggml_reshape_3d(ctx0, k, d_k, n_head_kv, n);

    // the architecture's k-norm and RoPE (pos == nullptr: the caller wants norms only, and RoPE
    // rotates pairs of dimensions, norms unchanged)
    k = arch->k_path(g, il, k, pos);

    *k_out = k;
}

// per-KV-head mean L2 norm over the rows of v [d_v, n_head_kv, n] -> [1, n_head_kv]
static ggml_tensor * rf_mean_head_norm(ggml_context * ctx0, ggml_tensor * v) {
    const int64_t n = v->ne[2];
    ggml_tensor * nrm = ggml_sqrt(ctx0, ggml_sum_rows(ctx0, ggml_sqr(ctx0, v)));   // [1, n_head_kv, n]
    nrm = ggml_cont(ctx0, ggml_permute(ctx0, nrm, 1, 2, 0, 3));                     // [n, 1, n_head_kv]
    nrm = ggml_sum_rows(ctx0, nrm);                                                 // [1, 1, n_head_kv]
    nrm = ggml_reshape_2d(ctx0, nrm, 1, v->ne[1]);
    return ggml_scale(ctx0, nrm, 1.0f/float(n));
}

// s = num / den per head, and 1 where den = 0 (a head whose predicted K or V vanishes): with
// m = step(den), s = (num·m + 1 - m) / (den + 1 - m)
static ggml_tensor * rf_safe_ratio(ggml_context * ctx0, ggml_tensor * num, ggml_tensor * den) {
    ggml_tensor * m    = ggml_step(ctx0, den);
    ggml_tensor * notm = ggml_scale_bias(ctx0, m, -1.0f, 1.0f);
    return ggml_div(ctx0, ggml_add(ctx0, ggml_mul(ctx0, num, m), notm), ggml_add(ctx0, den, notm));
}

// early phase: the selector query rows' attention at this layer, summed over heads and rows, added
// to the scores of the cells (k: the layer's cache view, which already holds this ubatch's keys)
static void rf_build_selector(
        const llm_graph_context & g,
   const llama_kv_cache_context * mctx,
                    ggml_tensor * kq_mask,
                    ggml_tensor * q_cur,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il) {
    const llama_ridgefill_graph * rf = g.rf;
    ggml_context * ctx0 = g.ctx0;

    auto * inp = rf_inputs(g);
    if (!inp->sel_ids) {
        inp->sel_ids = inp->add(ctx0, rf->sel_ids, "ridgefill_sel_ids");
    }
    ggml_tensor * ids = inp->sel_ids;

    const int64_t n_sel = rf->sel_ids.size();
    const int64_t d_k   = q_cur->ne[0];
    const int64_t n_q_h = q_cur->ne[1];

    ggml_tensor * q = ggml_is_contiguous(q_cur) ? q_cur : ggml_cont(ctx0, q_cur);
    q = ggml_get_rows(ctx0, ggml_reshape_2d(ctx0, q, d_k*n_q_h, q->ne[2]), ids);   // [d_k*n_head, n_sel]
    q = ggml_permute(ctx0, ggml_reshape_3d(ctx0, q, d_k, n_q_h, n_sel), 0, 2, 1, 3); // [d_k, n_sel, n_head]

    // [d_k, n_head_kv, n_kv, n_stream]: a plan's rows are one sequence's, in one stream; only the
    // reserve of a cache with a stream per sequence views them all, and the first stands for each
    ggml_tensor * k_all = mctx->get_k(ctx0, il);
    ggml_tensor * k = ggml_view_3d(ctx0, k_all, k_all->ne[0], k_all->ne[1], k_all->ne[2], k_all->nb[1], k_all->nb[2], 0);
    k = ggml_permute(ctx0, k, 0, 2, 1, 3);                                           // [d_k, n_kv, n_head_kv]
    const int64_t n_kv = k->ne[1];

    ggml_tensor * kq = ggml_mul_mat(ctx0, k, q);                                     // [n_kv, n_sel, n_head]
    ggml_prec_set_acc(kq, GGML_PREC_F32);

    ggml_tensor * mask = ggml_view_2d(ctx0, kq_mask, kq_mask->ne[0], kq_mask->ne[1], kq_mask->nb[1], 0);
    mask = ggml_get_rows(ctx0, mask, ids);                                           // [n_kv, n_sel] F32
    if (mask->type != GGML_TYPE_F32) {
        mask = ggml_cast(ctx0, mask, GGML_TYPE_F32);
    }
    ggml_tensor * p = ggml_soft_max_ext(ctx0, kq, mask, kq_scale, 0.0f);
    if (sinks) {
        // each head's sink logit joins the softmax's denominator, as in the layer's attention
        ggml_soft_max_add_sinks(p, sinks);
    }

    p = ggml_cont(ctx0, ggml_transpose(ctx0, ggml_reshape_2d(ctx0, p, n_kv, n_sel*n_q_h))); // [n_sel*n_head, n_kv]
    p = ggml_reshape_1d(ctx0, ggml_sum_rows(ctx0, p), n_kv);

    ggml_tensor * dst = ggml_view_1d(ctx0, rf->scores, n_kv, 0);
    ggml_build_forward_expand(g.gf, ggml_cpy(ctx0, ggml_add(ctx0, dst, p), dst));
}

// per-KV-head scale of layer il, mean ||P(x_l)|| / mean ||P(x̂_l)|| over the scale rows, P the layer's
// K path (key: after k-norm; RoPE rotates pairs of dimensions, norms unchanged) or V path: the exact
// inputs are rows src_rows of r_src at the graph's first layer, rows ids of the layer's input inside
// the graph at a later one; the predictions come from rows `rows` of xs. [1, n_head_kv], an output
// of the graph (read back for the statistics)
static ggml_tensor * rf_build_head_scale(const llm_graph_context & g, int il, const llama_ridgefill_map_weights & w, bool key) {
    const llama_ridgefill_graph * rf = g.rf;
    ggml_context * ctx0 = g.ctx0;

    auto * inp = rf_inputs(g);
    ggml_tensor *& t_src  = key ? inp->rk_src_rows : inp->r_src_rows;
    ggml_tensor *& t_ids  = key ? inp->rk_ids      : inp->r_ids;
    ggml_tensor *& t_rows = key ? inp->rk_rows     : inp->r_rows;
    if (!t_rows) {
        t_rows = inp->add(ctx0, key ? rf->rk_rows : rf->r_rows, key ? "ridgefill_k_scale_rows" : "ridgefill_v_scale_rows");
    }

    ggml_tensor * xe = nullptr;
    if (il == rf->il_begin) {
        if (!t_src) {
            t_src = inp->add(ctx0, key ? rf->rk_src_rows : rf->r_src_rows,
                    key ? "ridgefill_k_scale_src_rows" : "ridgefill_v_scale_src_rows");
        }
        xe = ggml_get_rows(ctx0, rf_used_rows(ctx0, rf->r_src, key ? rf->rk_src_rows : rf->r_src_rows), t_src);
    } else {
        GGML_ASSERT(rf->layer_inp != nullptr);
        if (!t_ids) {
            t_ids = inp->add(ctx0, key ? rf->rk_ids : rf->r_ids, key ? "ridgefill_k_scale_ids" : "ridgefill_v_scale_ids");
        }
        xe = ggml_get_rows(ctx0, rf->layer_inp, t_ids);
    }
    ggml_tensor * xp = llama_ridgefill_build_xhat(ctx0, rf->maps, il, ggml_get_rows(ctx0, rf->xs_at(il), t_rows), &w);

    ggml_tensor * pe = nullptr;
    ggml_tensor * pp = nullptr;
    rf_build_kv(g, il, xe, nullptr, key ? &pe : nullptr, key ? nullptr : &pe);
    rf_build_kv(g, il, xp, nullptr, key ? &pp : nullptr, key ? nullptr : &pp);

    ggml_tensor * scale = rf_safe_ratio(ctx0, rf_mean_head_norm(ctx0, pe), rf_mean_head_norm(ctx0, pp));
    ggml_set_name(scale, format("ridgefill_%s_scale-%d", key ? "k" : "v", il).c_str());
    ggml_set_output(scale);
    ggml_build_forward_expand(g.gf, scale);
    (key ? rf->k_scales : rf->v_scales).emplace_back(il, scale);
    return scale;
}

// late phase: the value scale of layer il, then the filled rows' K/V into their cells
static void rf_build_fill(
        const llm_graph_context & g,
   const llama_kv_cache_context * mctx,
                    ggml_tensor * k_rot,
                    ggml_tensor * v_rot,
                            int   il) {
    const llama_ridgefill_graph * rf = g.rf;
    const llama_hparams & hparams = g.hparams;
    ggml_context * ctx0 = g.ctx0;

    auto * inp = rf_inputs(g);

    const int64_t n_head_kv = hparams.n_head_kv(il);

    // the layer's map, read by every step below: host-placed maps are uploaded once per layer
    const llama_ridgefill_map_weights w = llama_ridgefill_stage(ctx0, rf->maps, il);

    // (a) s_{l,h} = mean ||V(x_l)|| / mean ||V(x̂_l)|| over the value-scale rows, both through the
    //     layer's own V path (the one the cache stores, before any rotation: it keeps norms)
    ggml_tensor * scale = nullptr;
    if (!rf->r_rows.empty()) {
        scale = ggml_reshape_3d(ctx0, rf_build_head_scale(g, il, w, /*key =*/ false), 1, n_head_kv, 1);
    } else if (!rf->v_scale_in.empty()) {
        // measured by the layer's first graph (a layer filled by several graphs: window graphs)
        GGML_ASSERT((int64_t) rf->v_scale_in.size() == n_head_kv);
        scale = ggml_reshape_3d(ctx0, inp->add(ctx0, rf->v_scale_in, "ridgefill_v_scale_in"), 1, n_head_kv, 1);
    }

    // (a') the key scale (issue #8), the same measurement on K (after k-norm; RoPE keeps norms)
    ggml_tensor * kscale = nullptr;
    if (!rf->rk_rows.empty()) {
        kscale = ggml_reshape_3d(ctx0, rf_build_head_scale(g, il, w, /*key =*/ true), 1, n_head_kv, 1);
    } else if (!rf->k_scale_in.empty()) {
        GGML_ASSERT((int64_t) rf->k_scale_in.size() == n_head_kv);
        kscale = ggml_reshape_3d(ctx0, inp->add(ctx0, rf->k_scale_in, "ridgefill_k_scale_in"), 1, n_head_kv, 1);
    }

    // (b) the filled rows, in chunks
    const llama_ridgefill_fill & fill = *rf->fill;
    const int64_t n_f = fill.rows.size();
    if (n_f == 0) {
        return;
    }
    const bool swa = hparams.is_swa(il) && !fill.cells_swa.empty();
    // positions per row (M-RoPE: f_pos holds each fill step's rows section-major, n_pos per row)
    const int64_t n_pos = fill.pos.size()/n_f;
    GGML_ASSERT((int64_t) fill.pos.size() == n_pos*n_f);
    if (!inp->f_rows) {
        inp->f_rows = inp->add(ctx0, fill.rows, "ridgefill_f_rows");
        inp->f_pos  = inp->add(ctx0, fill.pos, "ridgefill_f_pos");
    }
    ggml_tensor *& cells = swa ? inp->f_cells_swa : inp->f_cells;
    if (!cells) {
        const auto & data = swa ? fill.cells_swa : fill.cells;
        cells = inp->add(ctx0, data, swa ? "ridgefill_f_cells_swa" : "ridgefill_f_cells");
    }
    // a transposed V cache addresses the cells within the stream's planes
    ggml_tensor *& vcells = swa ? inp->f_vcells_swa : inp->f_vcells;
    if (!vcells) {
        const auto & data = swa ? fill.cells_v_swa : fill.cells_v;
        vcells = data.empty() ? cells : inp->add(ctx0, data, swa ? "ridgefill_f_vcells_swa" : "ridgefill_f_vcells");
    }
    const int32_t strm = swa ? fill.strm_swa : fill.strm;

    // a transposed V cache (no flash attention) holds one plane of kv_size values per element of a
    // row: one set_rows writes a chunk's rows into every plane, its cell indices broadcast over the
    // planes, where llama_kv_cache::cpy_v takes an index per element (|F| x n_embd_v int64 per layer,
    // sent to the device with each layer's graph)
    ggml_tensor * v_trans = fill.v_trans.empty() ? nullptr : fill.v_trans[il];
    GGML_ASSERT(fill.v_trans.empty() || v_trans != nullptr);

    for (int64_t i0 = 0; i0 < n_f; i0 += fill.n_chunk) {
        const int64_t nc = std::min<int64_t>(fill.n_chunk, n_f - i0);

        ggml_tensor * rows = ggml_view_1d(ctx0, inp->f_rows, nc, i0*ggml_element_size(inp->f_rows));
        ggml_tensor * pos  = ggml_view_1d(ctx0, inp->f_pos,  nc*n_pos, i0*n_pos*ggml_element_size(inp->f_pos));
        ggml_tensor * kidx = ggml_view_1d(ctx0, cells,       nc, i0*ggml_element_size(cells));
        ggml_tensor * vidx = ggml_view_1d(ctx0, vcells,      nc, i0*ggml_element_size(vcells));

        ggml_tensor * x = llama_ridgefill_build_xhat(ctx0, rf->maps, il, ggml_get_rows(ctx0, rf->xs_at(il), rows), &w);

        ggml_tensor * k = nullptr;
        ggml_tensor * v = nullptr;
        rf_build_kv(g, il, x, pos, &k, &v);

        if (scale) {
            v = ggml_mul(ctx0, v, scale);
        }
        if (kscale) {
            k = ggml_mul(ctx0, k, kscale);
        }
        if (k_rot) {
            k = llama_mul_mat_hadamard(ctx0, k, k_rot);
        }
        if (v_rot) {
            v = llama_mul_mat_hadamard(ctx0, v, v_rot);
        }

        if (!(fill.splice & LLAMA_RIDGEFILL_SPLICE_K)) {
            ggml_build_forward_expand(g.gf, mctx->cpy_k(ctx0, k, kidx, il));
        }
        if (!(fill.splice & LLAMA_RIDGEFILL_SPLICE_V)) {
            ggml_build_forward_expand(g.gf, v_trans ? rf_cpy_v_trans(ctx0, v_trans, v, vidx, strm)
                                                    : mctx->cpy_v(ctx0, v, kidx, il));
        }
    }
}

// a window graph: the ubatch rows wt->ids, whose K/V the graph stores in the scratch cache, into the
// sliding-window cache too (k_cur, v_cur: [n_embd_head, n_head_kv, n_tokens] as stored)
static void rf_build_write_through(const llm_graph_context & g, ggml_tensor * k_cur, ggml_tensor * v_cur, int il) {
    const llama_ridgefill_write & wt = *g.rf->wt;
    ggml_context * ctx0 = g.ctx0;
    auto * inp = rf_inputs(g);

    ggml_tensor * ids   = inp->add(ctx0, wt.ids,   "ridgefill_wt_ids");
    ggml_tensor * cells = inp->add(ctx0, wt.cells, "ridgefill_wt_cells");
    ggml_tensor * k_st  = wt.k[il];
    ggml_tensor * v_st  = wt.v[il];
    GGML_ASSERT(k_st != nullptr && v_st != nullptr);

    const int64_t n_tokens = k_cur->ne[2];
    ggml_tensor * k = ggml_get_rows(ctx0, ggml_reshape_2d(ctx0, ggml_cont(ctx0, k_cur), k_cur->ne[0]*k_cur->ne[1], n_tokens), ids);
    ggml_tensor * v = ggml_get_rows(ctx0, ggml_reshape_2d(ctx0, ggml_cont(ctx0, v_cur), v_cur->ne[0]*v_cur->ne[1], n_tokens), ids);

    // the rows of every stream, as llama_kv_cache::cpy_k addresses them
    ggml_tensor * k_dst = ggml_reshape_2d(ctx0, k_st, k_st->ne[0], ggml_nelements(k_st)/k_st->ne[0]);
    GGML_ASSERT(k->ne[0] == k_dst->ne[0]);
    ggml_build_forward_expand(g.gf, ggml_set_rows(ctx0, k_dst, k, cells));
    if (wt.v_trans) {
        ggml_tensor * vidx = wt.cells_v.empty() ? cells : inp->add(ctx0, wt.cells_v, "ridgefill_wt_vcells");
        v = ggml_reshape_3d(ctx0, v, v_cur->ne[0], v_cur->ne[1], v->ne[1]);
        ggml_build_forward_expand(g.gf, rf_cpy_v_trans(ctx0, v_st, v, vidx, wt.strm));
    } else {
        ggml_tensor * v_dst = ggml_reshape_2d(ctx0, v_st, v_st->ne[0], ggml_nelements(v_st)/v_st->ne[0]);
        GGML_ASSERT(v->ne[0] == v_dst->ne[0]);
        ggml_build_forward_expand(g.gf, ggml_set_rows(ctx0, v_dst, v, cells));
    }
}

void llama_ridgefill_build_attn(
        const llm_graph_context & g,
   const llama_kv_cache_context * mctx,
                    ggml_tensor * kq_mask,
                    ggml_tensor * k_rot,
                    ggml_tensor * v_rot,
                    ggml_tensor * q_cur,
                    ggml_tensor * k_cur,
                    ggml_tensor * v_cur,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il) {
    const llama_ridgefill_graph * rf = g.rf;
    if (rf == nullptr) {
        return;
    }
    if (rf->wt != nullptr && g.hparams.is_swa(il)) {
        rf_build_write_through(g, k_cur, v_cur, il);
    }
    // the fill first: a probe pass scores the query rows' attention against the filled cells
    if (rf->fill != nullptr) {
        rf_build_fill(g, mctx, k_rot, v_rot, il);
    }
    const bool sel = il == rf->sel_layer || (rf->sel_late && llama_ridgefill_is_full_attention(g.hparams, il));
    if (sel && !rf->sel_ids.empty()) {
        rf_build_selector(g, mctx, kq_mask, q_cur, sinks, kq_scale, il);
    }
}

// the positions input of a KQ mask computed in the graph (llama_ridgefill_build_kq_mask). It is set
// through its memory context, as llama.cpp sets its own masks; a reused early-phase graph takes the
// memory context of the ubatch it now serves
class llm_graph_input_ridgefill_kq_pos : public llm_graph_input_i {
public:
    // where the KV cache context is in a graph's memory context
    enum which { KV, ISWA_BASE, ISWA_SWA, HYBRID_ATTN };

    llm_graph_input_ridgefill_kq_pos(ggml_tensor * pos, const llama_kv_cache_context * mctx, which w) :
        pos(pos), mctx(mctx), w(w) {}
    virtual ~llm_graph_input_ridgefill_kq_pos() = default;

    void set_input(const llama_ubatch * ubatch) override {
        if (pos->buffer) {
            mctx->set_input_kq_mask(pos, ubatch, true);
        }
    }

    bool can_reuse(const llm_graph_params & params) override {
        mctx = kv_context(params.mctx, w);
        return mctx != nullptr && pos->ne[0] == (int64_t) mctx->get_n_kv() + (int64_t) params.ubatch.n_tokens;
    }

    static const llama_kv_cache_context * kv_context(const llama_memory_context_i * m, which w) {
        switch (w) {
            case KV:          return dynamic_cast<const llama_kv_cache_context *>(m);
            case ISWA_BASE:
            case ISWA_SWA: {
                const auto * iswa = dynamic_cast<const llama_kv_cache_iswa_context *>(m);
                return iswa == nullptr ? nullptr : w == ISWA_BASE ? iswa->get_base() : iswa->get_swa();
            }
            case HYBRID_ATTN: {
                const auto * hybrid = dynamic_cast<const llama_memory_hybrid_context *>(m);
                return hybrid == nullptr ? nullptr : hybrid->get_attn();
            }
        }
        return nullptr;
    }

    ggml_tensor * pos;

private:
    const llama_kv_cache_context * mctx;
    which w;
};

static constexpr const char * RF_KQ_POS_NAME = "ridgefill_kq_pos";

// whether a KQ mask follows from the cells' positions alone (one sequence in one stream, causal, no
// ALiBi, no window or a standard one): llama_ridgefill_set_input_kq_mask on the host and
// llama_ridgefill_build_kq_mask in the graph; otherwise llama.cpp's general path builds it
static bool rf_mask_from_positions(bool causal_attn, const llama_hparams & hparams, llama_swa_type swa_type,
        int64_t n_stream, uint32_t n_seqs_unq) {
    return causal_attn && !hparams.use_alibi && n_stream == 1 && n_seqs_unq == 1 &&
           (swa_type == LLAMA_SWA_TYPE_NONE || swa_type == LLAMA_SWA_TYPE_STANDARD);
}

bool llama_ridgefill_is_kq_pos(const ggml_tensor * t) {
    return t != nullptr && strcmp(t->name, RF_KQ_POS_NAME) == 0;
}

ggml_tensor * llama_ridgefill_build_kq_mask(const llm_graph_context & g, const llama_kv_cache_context * mctx,
        ggml_tensor * kq_mask, bool swa) {
    const llama_ridgefill_graph * rf = g.rf;
    const llama_hparams & hparams  = g.hparams;
    const llama_swa_type  swa_type = swa ? hparams.swa_type : LLAMA_SWA_TYPE_NONE;
    if (rf == nullptr || !rf->graph_mask || kq_mask == nullptr || kq_mask->ne[2] != 1 ||
        !rf_mask_from_positions(g.cparams.causal_attn, hparams, swa_type, kq_mask->ne[3], g.ubatch.n_seqs_unq)) {
        return kq_mask;
    }
    using input = llm_graph_input_ridgefill_kq_pos;
    input::which w = input::KV;
    if (g.mctx != mctx) {
        if (const auto * iswa = dynamic_cast<const llama_kv_cache_iswa_context *>(g.mctx)) {
            w = iswa->get_base() == mctx ? input::ISWA_BASE : input::ISWA_SWA;
        } else {
            w = input::HYBRID_ATTN;
        }
    }
    GGML_ASSERT(input::kv_context(g.mctx, w) == mctx);

    ggml_context * ctx0 = g.ctx0;
    const int64_t n_kv     = kq_mask->ne[0];
    const int64_t n_tokens = kq_mask->ne[1];

    // [n_kv + n_tokens]: p0 of each cell (+inf: not the sequence's), then p1 + 1/2 of each row
    ggml_tensor * pos = ggml_new_tensor_1d(ctx0, GGML_TYPE_F32, n_kv + n_tokens);
    ggml_set_input(pos);
    ggml_set_name(pos, RF_KQ_POS_NAME);
    g.res->add_input(std::make_unique<input>(pos, mctx, w));

    ggml_tensor * p0 = ggml_view_2d(ctx0, pos, n_kv, 1, n_kv*sizeof(float), 0);
    ggml_tensor * p1 = ggml_view_2d(ctx0, pos, 1, n_tokens, sizeof(float), n_kv*sizeof(float));

    // d = p1 - p0 + 1/2: a cell is kept when p0 <= p1 (d > 0) and, in a window of n_swa, p1 - p0 < n_swa
    // (n_swa - d > 0), as llama_hparams::is_masked_swa; log turns 1 into 0 and 0 into -inf
    ggml_tensor * d    = ggml_sub(ctx0, ggml_repeat_4d(ctx0, p1, n_kv, n_tokens, 1, 1), p0);
    ggml_tensor * keep = ggml_step(ctx0, d);
    if (swa_type == LLAMA_SWA_TYPE_STANDARD) {
        keep = ggml_mul(ctx0, keep, ggml_step(ctx0, ggml_scale_bias(ctx0, d, -1.0f, (float) hparams.n_swa)));
    }
    ggml_tensor * mask = ggml_log(ctx0, keep);
    if (kq_mask->type != GGML_TYPE_F32) {
        mask = ggml_cast(ctx0, mask, kq_mask->type); // flash attention reads an F16 mask
    }
    mask = ggml_reshape_4d(ctx0, mask, n_kv, n_tokens, 1, 1);
    ggml_set_name(mask, swa ? "ridgefill_kq_mask_swa" : "ridgefill_kq_mask");
    return mask;
}

bool llama_ridgefill_set_input_kq_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch, bool causal_attn) {
    if (llama_ridgefill_is_kq_pos(dst)) {
        // the positions of llama_ridgefill_build_kq_mask (which checked the cases the general path needs)
        GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer) && dst->type == GGML_TYPE_F32);
        const int64_t n_tokens = ubatch->n_tokens;
        const int64_t n_kv     = dst->ne[0] - n_tokens;
        GGML_ASSERT(n_kv > 0 && ubatch->n_seqs_unq == 1);

        const llama_seq_id     seq_id = ubatch->seq_id[0][0];
        const llama_kv_cells & cells  = kv.get_cells(seq_id);
        float * data = (float *) dst->data;
        for (int64_t j = 0; j < n_kv; ++j) {
            data[j] = !cells.is_empty(j) && cells.seq_has(j, seq_id) ? (float) cells.pos_get(j) : INFINITY;
        }
        for (int64_t i = 0; i < n_tokens; ++i) {
            data[n_kv + i] = (float) ubatch->pos[i] + 0.5f;
        }
        return true;
    }

    const llama_hparams & hparams  = kv.get_hparams();
    const llama_swa_type  swa_type = kv.get_swa_type();
    if (!rf_mask_from_positions(causal_attn, hparams, swa_type, dst->ne[3], ubatch->n_seqs_unq)) {
        return false;
    }
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));

    const int64_t  n_kv     = dst->ne[0];
    const uint32_t n_tokens = ubatch->n_tokens;
    GGML_ASSERT(dst->ne[1] == (int64_t) n_tokens);

    const llama_seq_id     seq_id = ubatch->seq_id[0][0];
    const llama_kv_cells & cells  = kv.get_cells(seq_id);

    // the position of the sequence's row in each cell (never kept: an empty cell, another sequence)
    constexpr llama_pos never = std::numeric_limits<llama_pos>::max();
    std::vector<llama_pos> cpos(n_kv, never);
    for (int64_t j = 0; j < n_kv; ++j) {
        if (!cells.is_empty(j) && cells.seq_has(j, seq_id)) {
            cpos[j] = cells.pos_get(j);
        }
    }

    // keep p0 <= p1 (causal) and, in a standard window of n_swa, p1 - p0 < n_swa (llama_hparams::is_masked_swa);
    // text rows only (a plan refuses embeddings with multi-section positions), so no 2-D position test
    const bool     swa   = swa_type == LLAMA_SWA_TYPE_STANDARD;
    const uint32_t n_swa = kv.get_n_swa();
    auto fill = [&](auto * data, auto keep, auto drop) {
        for (uint32_t i = 0; i < n_tokens; ++i) {
            const llama_pos p1 = ubatch->pos[i];
            const llama_pos lo = swa ? p1 - (llama_pos) n_swa : std::numeric_limits<llama_pos>::min();
            auto * row = data + (size_t) i*n_kv;
            for (int64_t j = 0; j < n_kv; ++j) {
                row[j] = cpos[j] <= p1 && cpos[j] > lo ? keep : drop;
            }
        }
    };
    if (dst->type == GGML_TYPE_F16) {
        fill((ggml_fp16_t *) dst->data, ggml_fp32_to_fp16(0.0f), ggml_fp32_to_fp16(-INFINITY));
    } else {
        GGML_ASSERT(dst->type == GGML_TYPE_F32);
        fill((float *) dst->data, 0.0f, -INFINITY);
    }
    return true;
}
