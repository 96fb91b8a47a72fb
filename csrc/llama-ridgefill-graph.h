// RidgeFill inside the model graphs: what a graph of a planned prompt computes, and the hooks the
// model builders and llm_graph_context::build_attn call (docs/design.md §4, §6).
//
// A planned prompt is processed in two phases:
//   early - inside the ordinary llama_decode() calls, however the caller chunks the prompt: every row
//           runs layers 0..S-1 only; the input of layer S (x_S) is stored per row in `xs`; the last
//           rows of the prompt add their attention at the selector layer to `scores`;
//   late  - once, by the decode call that brought the last row, layer-major: for each late layer l,
//           for each chunk of the exact rows X (tail and selected rows, in position order), a graph
//           runs layer l on the chunk, carrying the rows' states in `xx`. In the first chunk's graph,
//           before the attention, the hook in build_attn measures the value scale on the tail rows
//           and writes the filled rows' K/V (x̂ = A φ(x_S) + b → the layer's K/V path → V · s).
//           When X fits one chunk, one graph runs several consecutive attention layers (each filled
//           in turn, its value scale measured on the tail rows' inputs inside the graph).
//           A recurrent (Gated DeltaNet) late layer instead runs every planned row in position order,
//           in chunks: filled rows feed only the state update from x̂, exact rows run the whole layer;
//           the first chunk of the tail may start from a corrected state (terminal-state correction).
//           One graph per chunk runs a run of consecutive recurrent late layers: at each layer after
//           the first, x̂ of the filled rows joins the exact rows' outputs of the layer before.
#pragma once

#include "llama-graph.h"

#include <cstdint>
#include <utility>
#include <vector>

struct llama_model;
struct llama_ridgefill_maps;
class  llama_kv_cache;
class  llama_kv_cache_context;
struct llama_ubatch;

struct llm_graph_input_ridgefill;

// the filled rows of one pass over the late layers, written at each attention layer the pass fills
// (owned by the pass, alive while its graphs are built and their inputs set)
struct llama_ridgefill_fill {
    std::vector<int32_t> rows;      // [|F|] xs row of each filled row
    std::vector<int32_t> pos;       // [|F|] position of each filled row (M-RoPE: [4 |F|], each fill
                                    //   step's rows section-major)
    std::vector<int64_t> cells;     // [|F|] row of each filled row in the full-attention cache's storage:
                                    //   its cell, plus the sequence's stream times kv_size (as
                                    //   llama_kv_cache::set_input_k_idxs addresses several streams)
    std::vector<int64_t> cells_swa; // [|F|] ... in the sliding-window cache (iSWA models)
    std::vector<ggml_tensor *> v_trans; // [n_layer] a transposed V cache (no flash attention): the V
                                        //   storage of each late attention layer; empty otherwise
    int32_t strm     = 0;           // the sequence's KV stream in the full-attention cache
    int32_t strm_swa = 0;           // ... in the sliding-window cache
    std::vector<int64_t> cells_v;   // a transposed V cache and a stream other than 0: the cells
    std::vector<int64_t> cells_v_swa; //   themselves (the stream's V planes are viewed); empty otherwise
    int32_t n_chunk = 512;          // filled rows per fill step
    int32_t splice  = 0;            // enum llama_ridgefill_splice: keep the cells' K and/or V
};

// a late sliding-window layer over the scratch cache (a window-sized sliding-window cache, see
// llama_ridgefill_window): the graph's exact rows that the sliding-window cache still holds get their
// K/V written there too, as the graph stores them in the scratch
struct llama_ridgefill_write {
    std::vector<int32_t> ids;        // [n] their rows in the graph's ubatch
    std::vector<int64_t> cells;      // [n] their rows in the cache's storage (stream × kv_size + cell)
    std::vector<int64_t> cells_v;    // a transposed V cache and a stream other than 0: the cells; else empty
    std::vector<ggml_tensor *> k;    // [n_layer] the cache's K storage of each late sliding-window layer
    std::vector<ggml_tensor *> v;    // [n_layer] ... V storage
    bool    v_trans = false;
    int32_t strm    = 0;
};

// the RidgeFill part of one graph's parameters (llm_graph_params::ridgefill); owned by the
// llama_ridgefill_context, alive while the graph is built and its inputs are set.
//
//   early phase: layers [0, S) of a ubatch of planned rows; the input of layer S is stored in xs
//   late phase:  layers [l0, l1) of a chunk of the exact rows (a recurrent layer: of every row), input
//                gathered from xs (l0 = S) or from the carried states xx, output stored into xx; the
//                last layer ends with the logits of the chunk's last row. The first chunk of an
//                attention layer also fills it.
struct llama_ridgefill_graph {
    const llama_model          * model = nullptr;
    const llama_ridgefill_maps * maps  = nullptr; // nullptr: identity fill (x̂ = x_S)

    int32_t split = 0;    // S

    ggml_tensor * xs = nullptr; // [n_embd, n_ctx] F32, persistent: x_S of planned row (pos - pos0)
    ggml_tensor * xx = nullptr; // [n_embd, n_ctx] F32, persistent: current input of exact row i

    // a model split over devices: the copy of xs on the device of each layer ([n_layer]; empty: xs
    // serves every layer), and the copies the early phase writes with xs
    std::vector<ggml_tensor *> xs_layer;
    std::vector<ggml_tensor *> xs_copies;

    // the x_S rows layer il reads: those on its own device
    ggml_tensor * xs_at(int il) const { return xs_layer.empty() ? xs : xs_layer[il]; }

    // the layers this graph runs: [il_begin, il_end); il_begin > 0 gathers the rows' inputs of layer
    // il_begin from src at src_rows, il_end < n_layer stores the inputs of layer il_end into dst at
    // dst_rows (and the graph has no output)
    int32_t il_begin = 0;
    int32_t il_end   = 0;
    ggml_tensor * src = nullptr;
    ggml_tensor * dst = nullptr;
    std::vector<int32_t> src_rows; // [n_tokens] (recurrent late layer: [n_x], the exact rows only)
    std::vector<int32_t> dst_rows; // [n_tokens] (recurrent late layer: [n_x])

    // rows of the last layer's output whose logits are kept (indices among the rows that reach the
    // output: the graph's rows, or its exact rows for a recurrent layer)
    std::vector<int32_t> out_ids;

    // a recurrent late layer (gdn): the graph's rows are a chunk of every planned row, in position
    // order. Filled rows (their xs rows: m_f_rows) feed the state update from x̂ only; exact rows (the
    // ubatch rows x_ids, inputs at src_rows of src) run the whole layer. m_perm: for each ubatch row,
    // its row in concat(x̂ of the filled rows, inputs of the exact rows)
    bool gdn = false;
    std::vector<int32_t> m_f_rows;
    std::vector<int32_t> m_perm;
    std::vector<int32_t> x_ids;
    bool state_gain = false; // each layer's state is multiplied by its gain (maps->g) before the rows

    // attention selector (early phase) and probe pass (late phase): the query rows' attention at
    // sel_layer (sel_late: at every full-attention layer of the graph) is added to scores
    int32_t       sel_layer = -1;   // -1: none in this graph
    bool          sel_late  = false;
    ggml_tensor * scores = nullptr; // [n_cells] F32, persistent: selector score per cell
    std::vector<int32_t> sel_ids;   // ubatch rows among the selector's query rows

    // fill (late phase): at each attention layer of the graph, the value scale then the filled rows' K/V
    const llama_ridgefill_fill * fill = nullptr;  // the filled rows of the pass (nullptr: no fill)
    ggml_tensor * r_src = nullptr;    // value-scale rows (the first min(c, T) tail rows): their exact
    std::vector<int32_t> r_src_rows;  //   inputs of layer il_begin (rows of r_src: xs at l = S, else xx),
    std::vector<int32_t> r_ids;       //   their rows in the graph (the inputs of a later layer of the
    std::vector<int32_t> r_rows;      //   graph) and their xs rows; empty: no value scale
    std::vector<int32_t> rk_src_rows; // key-scale rows, as r_src_rows / r_ids / r_rows; empty: no key scale
    std::vector<int32_t> rk_ids;
    std::vector<int32_t> rk_rows;
    std::vector<float>   v_scale_in;  // the value scale measured by an earlier graph of the layer, [n_head_kv]
    std::vector<float>   k_scale_in;  //   (and the key scale): a fill without scale rows uses it; empty: none

    // a window graph (a late sliding-window layer over the scratch cache): exact rows also written to
    // the sliding-window cache (nullptr: none)
    const llama_ridgefill_write * wt = nullptr;

    // the graph computes its KQ masks from the positions of the cells and of its rows
    // (llama_ridgefill_build_kq_mask) instead of reading llama.cpp's host-built masks
    bool graph_mask = false;

    // the graph reuse key (llm_graph_params::ridgefill_reuse): graphs of equal keys >= 0 have the same
    // topology for ubatches of the same shape (llm_graph_params::allow_reuse checks those), so the
    // scheduler's graph can be reused with new index data. Only early-phase graphs without selector
    // rows are reusable (key: their split layer); any other RidgeFill graph has -1, stock graphs 0
    int32_t reuse_key() const {
        const bool early = il_begin == 0 && src == nullptr && fill == nullptr && !gdn;
        return early && sel_ids.empty() && sel_layer < 0 && out_ids.empty() ? 1 + il_end : -1;
    }

    // set while the graph is built: its inputs, the input of the layer being built, and the value and
    // key scales to read back, (layer, [1, n_head_kv])
    mutable llm_graph_input_ridgefill * inp = nullptr;
    mutable ggml_tensor * layer_inp = nullptr;
    mutable std::vector<std::pair<int32_t, ggml_tensor *>> v_scales;
    mutable std::vector<std::pair<int32_t, ggml_tensor *>> k_scales;
};

// the first layer a builder runs
static inline int llama_ridgefill_first_layer(const llama_ridgefill_graph * rf) {
    return rf ? rf->il_begin : 0;
}

// whether the builder starts past layer 0, from llama_ridgefill_build_inp
static inline bool llama_ridgefill_is_late(const llama_ridgefill_graph * rf) {
    return rf && rf->il_begin > 0;
}

// whether the graph stops before the last layer (it then has no outputs)
static inline bool llama_ridgefill_stops_early(const llama_ridgefill_graph * rf, int n_layer) {
    return rf && rf->il_end < n_layer;
}

// the rows' inputs of layer il_begin, gathered from src ([n_embd, n_tokens]); for a recurrent late
// layer, x̂ for the filled rows and the stored inputs of the exact rows, merged in position order
ggml_tensor * llama_ridgefill_build_inp(const llm_graph_context & g);

// the output rows of a RidgeFill graph (out_ids); nullptr for a graph without outputs (one that stops
// before the last layer, or a chunk of a recurrent last layer whose rows are all filled)
ggml_tensor * llama_ridgefill_build_out_ids(const llm_graph_context & g);

// recurrent late layer: the start state of the graph's rows, s [S_v, S_v, H_v, 1], with the
// terminal-state correction when the graph is the first chunk of the tail (s otherwise)
ggml_tensor * llama_ridgefill_build_gdn_state(const llm_graph_context & g, ggml_tensor * s, int il);

// recurrent late layer, after the state update: only the exact rows read the state out. *output
// ([S_v, H_v, n_tokens, 1]) becomes the exact rows' output and *z their output gate (the z projection
// of their rows of x_norm, the layer's attention-normed input). false: the graph has no exact row
// (its rows only updated the state) and the layer ends there. Other graphs: true, nothing changed
bool llama_ridgefill_build_gdn_readout(const llm_graph_context & g, int il, ggml_tensor * x_norm,
        ggml_tensor ** output, ggml_tensor ** z);

// recurrent late layer: the exact rows of x ([n_embd, n_tokens], e.g. the residual); x otherwise
ggml_tensor * llama_ridgefill_build_gdn_rows(const llm_graph_context & g, ggml_tensor * x);

// called at the start of each layer il the builder runs, inpL the rows' inputs of layer il:
//   il == il_end < n_layer: store inpL into dst and return true - the builder then returns, so the
//                           graph has no later layers and no output
//   il_begin < il < il_end of a recurrent late graph: inpL (the exact rows' outputs of the layer
//                           before) becomes every row's input, x̂ of layer il for the filled rows
// false otherwise
bool llama_ridgefill_build_split(const llm_graph_context & g, int il, ggml_tensor *& inpL);

// called by build_attn after the ubatch's own K/V are stored, before attention reads the cache:
//   a filling late graph: the value scale s_{l,h} from the value-scale rows, then the filled rows'
//                     K/V written to their cells
//   il == sel_layer (a late graph with sel_late: every full-attention layer): add the selector query
//                     rows' attention probabilities (summed over heads and rows) to `scores` (after
//                     the fill: the probe pass scores the filled cache)
//   a window graph:   its exact rows that the sliding-window cache holds: their K/V (k_cur, v_cur, as
//                     stored) written there too
// q_cur: [n_embd_head, n_head, n_tokens] as build_attn uses it (after rotation); sinks: the layer's
// attention sinks [n_head] (gpt-oss; nullptr: none), in the selector's softmax as in the attention
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
                            int   il);

// the KQ mask attention reads in a RidgeFill graph with graph_mask: computed in the graph from one
// input of n_kv + n_tokens floats (the position of the sequence's row in each cell, +inf for a cell
// that holds none; then each row's position), with the values llama_kv_cache::set_input_kq_mask
// gives (0 kept, -inf masked; F16 where kq_mask is). llama.cpp's host-built mask (kq_mask, n_kv x
// n_tokens) is then left out of the graph: a backend in device memory gets a small upload and a few
// elementwise ops instead of a host loop over every (row, cell) and its copy. swa: the mask of the
// sliding-window cache (standard windows). kq_mask itself where the graph has no graph_mask, or
// where the host path is needed (as llama_ridgefill_set_input_kq_mask: non-causal attention, ALiBi,
// several streams or sequences, another window type)
ggml_tensor * llama_ridgefill_build_kq_mask(const llm_graph_context & g, const llama_kv_cache_context * mctx,
        ggml_tensor * kq_mask, bool swa);

// whether t is the positions input of llama_ridgefill_build_kq_mask (llama_kv_cache_context::set_input_kq_mask
// passes it to llama_ridgefill_set_input_kq_mask)
bool llama_ridgefill_is_kq_pos(const ggml_tensor * t);

// the KQ mask of a late-phase graph, whose rows (of one sequence) are already in the cache at
// scattered positions: keep the cells of the sequence at positions <= the row's (and inside the
// window of a standard sliding-window cache), as llama_kv_cache::set_input_kq_mask would, from one
// pass over the cells instead of a scan of every cell per row. false: the general path is needed
// (non-causal attention, ALiBi, several streams or sequences, another window type). dst the positions
// input of llama_ridgefill_build_kq_mask: its positions (any graph, early or late)
bool llama_ridgefill_set_input_kq_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch, bool causal_attn);
