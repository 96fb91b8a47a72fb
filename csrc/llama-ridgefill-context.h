// RidgeFill attached to a llama_context: parameters, the per-row scratch buffers, the plan of the
// prompt being prefilled and its two phases (docs/design.md §4, §6). The early phase runs inside
// llama_context::decode through the hooks below; the late phase, its graphs and the reservation of
// their compute buffers are in llama-ridgefill-late.cpp; the diagnostic entry points in
// llama-ridgefill-debug.cpp.
#pragma once

#include "llama-ridgefill.h"
#include "llama-ridgefill-graph.h"
#include "llama-ridgefill-late.h"

#include "ggml-cpp.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

struct llama_context;
struct llama_model;
struct llama_batch;
struct llama_ubatch;
class  llm_graph_result;
struct llama_ridgefill_caches;

// the prompt being prefilled with RidgeFill: rows [pos0, pos_end) of one sequence
struct llama_ridgefill_plan {
    bool         active  = false; // begun, late phase not run yet
    bool         pending = false; // the last row has been decoded: run the late phase
    llama_seq_id seq_id  = 0;
    llama_pos    pos0    = 0;
    llama_pos    pos_end = 0;

    bool                   exact_set = false; // exact prefix rows given by the caller
    std::vector<llama_pos> exact;

    std::vector<llama_token> tokens; // token of each planned row (LLAMA_TOKEN_NULL: embeddings input)

    // the sequence had rows before pos0 in a window-sized sliding-window cache (its first planned rows
    // attend to them at sliding-window layers, so none of the plan's rows may leave the cache)
    bool swa_prefix = false;

    // rows of the last decode call that asked for logits: tail rows get them from the late phase,
    // (position, batch index); any other planned row gets NaN (its logits are never computed)
    std::vector<std::pair<llama_pos, int32_t>> out_rows;
    std::vector<int32_t> nan_batch_idxs;
};

struct llama_ridgefill_context {
    llama_ridgefill_context(llama_context & lctx, const llama_ridgefill_maps * maps, const llama_ridgefill_params & params);
    ~llama_ridgefill_context();

    // the checks of llama_ridgefill_attach; "" when the settings work with this context
    static std::string check(const llama_context & lctx, const llama_ridgefill_maps * maps, llama_ridgefill_params & params);
    // ... of the context's settings and memory
    static std::string check_context(const llama_context & lctx);

    //
    // the C API (llama-ridgefill.h); the results of the last finished plan are the fields below
    //

    int32_t begin(llama_seq_id seq_id, llama_pos pos0, llama_pos pos_end);
    int32_t set_exact(const llama_pos * pos, int32_t n);
    void    cancel();
    int32_t splice_state(int32_t il, const float * state, int32_t n);

    //
    // called by llama_context::decode
    //

    // a batch holds either only rows of the plan, in range, or none; false (with the error recorded
    // and the plan dropped) otherwise
    bool check_batch(const llama_batch & batch);

    // the ubatch about to be processed: its graph is an early-phase graph when it holds planned rows
    void set_ubatch(const llama_ubatch & ubatch);
    void set_ubatch_done();
    // LLAMA_RIDGEFILL_EARLY_GRAPHS: the least KV extent of an early ubatch's graph (llama_kv_cache::n_kv_min)
    void set_kv_min(const llama_ubatch & ubatch);

    // the RidgeFill part of the graph being built (nullptr: stock)
    const llama_ridgefill_graph * graph() const { return graph_active ? &cur : nullptr; }
    // its reuse key (llama_ridgefill_graph::reuse_key; 0: stock)
    int32_t graph_reuse_key() const { return graph_active ? cur.reuse_key() : 0; }

    // a model with RPC devices: wait for the graphs in flight, then the servers lost meanwhile (a loss
    // during a call's last graphs fails no compute call); "" when none was, or without RPC devices
    std::string lost_servers_after_sync();

    // end of a decode call: logits asked for planned rows before the last are NaN (only the last
    // prompt row has logits); the call that brought the last row runs the late phase; a call of
    // other rows on a model with RPC devices fails when a server was lost. 0, or the error code
    // decode returns
    int decode_done();

    // grow the scheduler's compute buffers to the worst case of the early phase (a ubatch with the
    // selector's query rows) and of the late phase's graphs; false on failure (llama-ridgefill-reserve.cpp)
    bool reserve();

    //
    // the phases
    //

    // the graph fields every RidgeFill graph shares
    llama_ridgefill_graph base_graph() const;

    // an early-phase graph: layers [0, S) of a ubatch, x_S stored into xs at dst_rows; sel_ids: the
    // ubatch rows among the attention selector's query rows
    llama_ridgefill_graph early_graph(std::vector<int32_t> dst_rows, std::vector<int32_t> sel_ids) const;

    // the late phase (llama-ridgefill-late.cpp), run by the decode call that brought the plan's last
    // row: 0, or the error code decode returns. Its steps, in order:
    int finish();
    // wait for the early phase's graphs (the wait counts as early-phase time); when the late phase starts
    int64_t wait_early_phase();
    // the cells of the planned rows in each cache; "" when every row the late phase reads is there
    std::string plan_cells(const llama_ridgefill_plan & p, std::vector<int64_t> & cells, std::vector<int64_t> & cells_swa) const;
    // the value (and key) scales of each late layer and KV head start at 1 (not measured)
    void reset_scales(int32_t T);
    // the selector, then the late passes (the probe selector's two, or one): which rows ran exact
    // (is_exact, exact: the selected ones), the probe's rows; "" on success, else what failed
    std::string run_late_passes(const llama_ridgefill_plan & p, int32_t T, std::vector<int64_t> cells,
            std::vector<int64_t> cells_swa, std::vector<char> & is_exact, std::vector<llama_pos> & exact, int32_t & n_probe);
    // the statistics of the finished plan (llama_ridgefill_get_stats): n_exact selected rows, n_x
    // rows run exact in all
    void record_stats(const llama_ridgefill_plan & p, int32_t T, int32_t n_exact, int32_t n_x, int32_t n_probe,
            int64_t t_start_us);
    // LLAMA_RIDGEFILL_TIMING=1: where the time of the plan went, in one log line
    void log_timing() const;
    // a plan that cannot finish: msg recorded (naming a lost RPC server), the prompt's rows removed; -3
    int fail_plan(const llama_ridgefill_plan & p, const std::string & msg);

    // a pass whose exact rows are those marked in is_exact (the last T rows among them)
    llama_ridgefill_pass make_pass(llama_seq_id seq_id, llama_pos pos0, std::vector<int64_t> cells,
            std::vector<int64_t> cells_swa, const std::vector<char> & is_exact, int32_t T) const;

    // the runs of late layers that share their graphs, for a pass with n_x exact rows, n_f filled rows
    // (fills: the pass fills the attention layers) and the fill steps of fill_chunk
    // (windowed: every attention layer has graphs of its own)
    std::vector<llama_ridgefill_segment> late_segments(int32_t n_x, int32_t n_f, bool fills, bool windowed = false) const;

    // a pass whose sliding-window cache no longer holds its first rows: the groups of exact rows that
    // run the late sliding-window layers over the scratch cache, and the filled rows the cache holds
    void make_windows(llama_ridgefill_pass & ps) const;

    // a window-sized sliding-window cache: the scratch cache the late sliding-window layers of a windowed
    // pass run over (created by reserve; n_swa + 2 n_ubatch cells); nullptr otherwise
    // (make_windows and create_swa_scratch: llama-ridgefill-window.cpp)
    bool create_swa_scratch();

    // the graphs of late layer il in a pass: row ranges [c0, c1) of the rows the layer runs
    std::vector<std::pair<int32_t, int32_t>> late_chunks(const llama_ridgefill_pass & ps, int32_t il) const;

    // the one builder of late-phase graphs: layers [il, il_end) on rows [c0, c1) of a pass
    void late_graph(const llama_ridgefill_pass & ps, int32_t il, int32_t il_end, int32_t c0, int32_t c1,
            llama_ridgefill_late_graph & lg) const;
    void late_rows_recurrent(const llama_ridgefill_pass & ps, int32_t il, int32_t c0, const std::vector<int32_t> & rows,
            llama_ridgefill_graph & g) const;
    void late_rows_attention(const llama_ridgefill_pass & ps, int32_t il, int32_t il_end, int32_t c0,
            const std::vector<int32_t> & rows, const llama_ridgefill_window * w, llama_ridgefill_graph & g) const;

    // run every graph of a pass; "" on success, else what failed
    std::string run_pass(const llama_ridgefill_pass & ps);
    // rs_cell: the sequence's recurrent cell (hybrid models; caches: the context's, run_pass's)
    std::string run_graph(const llama_ridgefill_pass & ps, llama_ridgefill_late_graph & lg,
            const llama_ridgefill_caches & caches, int32_t rs_cell);

    // the probe selector (docs/design.md §5): a pass with every prefix row filled whose tail scores the
    // prefix, then the pass with the selected rows exact. is_exact, exact, n_probe: the outcome
    std::string run_probe(const llama_ridgefill_plan & p, const std::vector<int64_t> & cells,
            const std::vector<int64_t> & cells_swa, std::vector<char> & is_exact, std::vector<llama_pos> & exact,
            int32_t & n_probe);

    // the selector seam: the exact prefix rows of a plan whose rows are all decoded, ascending;
    // cells: the cell of each planned row in the full-attention cache (the scores are per cell)
    std::vector<llama_pos> select_exact(const llama_ridgefill_plan & p, const std::vector<int64_t> & cells, int32_t n_prefix);

    // filled rows per fill step for n_f filled rows: n_ubatch (or params.n_fill_chunk), larger when
    // the steps would not fit the graph's node budget
    int32_t fill_chunk(int32_t n_f) const;
    // rows of a fill step before the node budget counts: params.n_fill_chunk, or n_ubatch
    int32_t fill_step_rows() const;
    // the fill steps one graph may hold (the graph's node budget)
    int32_t fill_steps_max() const;

    // build a graph of cur into res_late, n_outputs outputs; nullptr on failure
    ggml_cgraph * build_graph(const llama_ubatch & ub, const llama_memory_context_i * mctx, uint32_t n_outputs);

    //
    // state
    //

    llama_context              & lctx;
    const llama_model          & model;
    const llama_ridgefill_maps * maps; // nullptr: identity fill
    llama_ridgefill_params       params;
    int32_t                      params_from_maps = 0; // enum llama_ridgefill_tunable bits: tuned values of the map file

    int32_t n_layer   = 0;
    bool    rpc       = false; // some of the model's devices are RPC servers (docs/design.md §6.5)
    int32_t n_embd    = 0;
    int32_t sel_layer = -1; // attention selector layer (-1: selector none)

    // rows of a recurrent late layer's graph (reserve: n_ubatch to 8 n_ubatch, as many as the
    // compute buffers reserved for the other graphs hold)
    int32_t n_late_rows_recr = 0;

    // the steps in which the early phase's KV extent grows over a plan (LLAMA_RIDGEFILL_EARLY_GRAPHS;
    // 0: as in stock prefill, with the cells used)
    int32_t n_early_steps = 0;
    bool    kv_min_set    = false;

    // the plan's graphs compute their KQ masks from the cells' positions (llama_ridgefill_build_kq_mask)
    // instead of llama.cpp's host-built masks: LLAMA_RIDGEFILL_GRAPH_MASK=0/1; by default where the
    // KV cache is in device memory (a GPU), where a host mask of n_ubatch x n_kv values is built and
    // copied for every graph
    bool graph_mask = false;

    ggml_context_ptr        ctx_buf;
    ggml_backend_buffer_ptr buf;
    ggml_tensor * xs     = nullptr; // [n_embd, n_ctx]
    ggml_tensor * xx     = nullptr; // [n_embd, n_ctx]
    ggml_tensor * scores = nullptr; // [n_cells of the selector layer's cache]

    // a copy of xs on each other device that holds a late layer (see the constructor)
    std::vector<ggml_context_ptr>        ctx_copies;
    std::vector<ggml_backend_buffer_ptr> buf_copies;
    std::vector<ggml_tensor *>           xs_copies;
    std::vector<ggml_tensor *>           xs_layer; // [n_layer]; empty without copies

    llama_ridgefill_plan  plan;
    std::string           stock_reason; // why the last begin() returned 0 (llama_ridgefill_stock_reason)
    llama_ridgefill_graph cur;
    bool                  graph_active = false;

    std::unique_ptr<llm_graph_result> res_late;

    // the late sliding-window layers' scratch cache (create_swa_scratch; nullptr: none needed)
    std::unique_ptr<llama_kv_cache> swa_scratch;

    // the last finished plan
    llama_ridgefill_stats  stats = {};
    std::vector<llama_pos> last_exact;
    std::vector<float>     last_scores;
    std::vector<float>     last_v_scales;
    std::vector<float>     last_k_scales;

    // where the time of the current plan goes (LLAMA_RIDGEFILL_TIMING=1 logs it when the plan ends)
    struct {
        int64_t t_ubatch_us = 0;
        int64_t early_us    = 0;
        int32_t n_reused0   = 0; // llama_context's count of reused graphs before the ubatch
        int32_t n_early     = 0; // early-phase graphs built
        int32_t n_early_reused = 0;
        int32_t n_graphs    = 0;
        int32_t n_window    = 0; // window graphs among them
        int64_t n_nodes     = 0;
        int64_t build_us    = 0;
        int64_t alloc_us    = 0;
        int64_t inputs_us   = 0;
        int64_t compute_us  = 0;
        int64_t wait_us     = 0;
    } timing;

    // hybrid models: record each late recurrent layer's state after the last prefix row (before any
    // terminal-state correction) into boundary_states
    bool record_boundary = false;
    std::map<int32_t, std::vector<float>> boundary_states;

    // the splice test: late recurrent layer -> the state its tail starts from (llama_ridgefill_splice_state)
    std::map<int32_t, std::vector<float>> splice_states;
};

// the RidgeFill of a context for a C API function; nullptr (with the error recorded) when none is attached
llama_ridgefill_context * llama_ridgefill_get(llama_context * ctx, const char * func);

// the RPC servers (host:port, comma-separated) of the model's devices whose connection failed; ""
// when none did (llama-ridgefill-rpc.cpp)
std::string llama_ridgefill_lost_servers(const llama_model & model);

// whether some of the model's devices are RPC devices
bool llama_ridgefill_uses_rpc(const llama_model & model);

// copy up to n elements of v to out (when out is not NULL); the number of elements there are
template <typename T>
int32_t llama_ridgefill_copy_out(const std::vector<T> & v, T * out, int32_t n) {
    const int32_t m = (int32_t) v.size();
    if (out) {
        std::copy_n(v.begin(), std::min(m, std::max(n, 0)), out);
    }
    return m;
}
