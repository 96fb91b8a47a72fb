// RidgeFill attached to a llama_context: parameters, the per-row scratch buffers, the plan of the
// prompt being prefilled, and the late phase (docs/method.md §4, §6; llama-ridgefill-graph.h).
#pragma once

#include "llama-ridgefill.h"
#include "llama-ridgefill-graph.h"

#include "ggml-cpp.h"

#include <map>
#include <memory>
#include <vector>

struct llama_context;
struct llama_model;
struct llama_batch;
struct llama_ubatch;
class  llm_graph_result;

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

    //
    // called by llama_context::decode
    //

    // a batch holds either only rows of the plan, in range, or none; false (with the error recorded
    // and the plan dropped) otherwise
    bool check_batch(const llama_batch & batch);

    // the ubatch about to be processed: its graph is an early-phase graph when it holds planned rows
    void set_ubatch(const llama_ubatch & ubatch);
    void set_ubatch_done();

    // the RidgeFill part of the graph being built (nullptr: stock)
    const llama_ridgefill_graph * graph() const { return graph_active ? &cur : nullptr; }

    // end of a decode call: logits asked for planned rows before the last are NaN (only the last
    // prompt row has logits); the call that brought the last row runs the late phase. 0, or the
    // error code decode returns
    int decode_done(llama_context & lctx);

    // the late phase
    int finish(llama_context & lctx);

    // one pass over the late layers, layer-major: the exact rows X (rows of plan p, ascending, the
    // tail last) run every late layer in chunks of n_ubatch. fill: the first chunk's graph of each
    // layer writes the filled rows (cur.f_*) with the value and key scales; n_query > 0: the last
    // n_query rows of X add their attention at each full-attention late layer to `scores` (the probe
    // pass); logits: the tail rows that asked for logits get them. "" on success, else what failed
    std::string run_late(llama_context & lctx, const llama_ridgefill_plan & p, const std::vector<int32_t> & X,
            const std::vector<int64_t> & cells, const std::vector<int64_t> & cells_swa, bool fill, int32_t n_query, bool logits);

    // the selector seam (docs/method.md §5): the exact prefix rows of a plan whose rows are all decoded,
    // ascending; cells: the cell of each planned row in the full-attention cache. The attention
    // selector's scores accumulate in the early phase (llama_ridgefill_build_attn at sel_layer), the
    // probe's in the probe pass of finish(); the protected selector reads the rows' tokens
    std::vector<llama_pos> select_exact(const llama_ridgefill_plan & p, const std::vector<int64_t> & cells, int32_t n_prefix);

    // filled rows per fill step for n_f filled rows: n_ubatch (or params.n_fill_chunk), larger when
    // the steps would not fit the graph's node budget
    int32_t fill_chunk(int32_t n_f) const;

    // grow the scheduler's compute buffers to the worst case of the early phase (a ubatch with the
    // selector's query rows) and of the late phase (a chunk of exact rows, a fill step); false on failure
    bool reserve();

    //
    // state
    //

    llama_context              & lctx;
    const llama_model          & model;
    const llama_ridgefill_maps * maps; // nullptr: identity fill
    llama_ridgefill_params       params;

    int32_t n_layer   = 0;
    int32_t n_embd    = 0;
    int32_t sel_layer = -1; // attention selector layer (-1: selector none)

    ggml_context_ptr        ctx_buf;
    ggml_backend_buffer_ptr buf;
    ggml_tensor * xs     = nullptr; // [n_embd, n_ctx]
    ggml_tensor * xx     = nullptr; // [n_embd, n_ctx]
    ggml_tensor * scores = nullptr; // [n_cells of the selector layer's cache]

    llama_ridgefill_plan  plan;
    llama_ridgefill_graph cur;
    bool                  graph_active = false;

    std::unique_ptr<llm_graph_result> res_late;

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
        int32_t n_early     = 0;
        int32_t n_graphs    = 0;
        int64_t n_nodes     = 0;
        int64_t build_us    = 0;
        int64_t alloc_us    = 0;
        int64_t inputs_us   = 0;
        int64_t compute_us  = 0;
    } timing;

    // hybrid models: record each late recurrent layer's state after the last prefix row (before any
    // terminal-state correction) into boundary_states
    bool record_boundary = false;
    std::map<int32_t, std::vector<float>> boundary_states;

    // the splice test: late recurrent layer -> the state its tail starts from (llama_ridgefill_splice_state)
    std::map<int32_t, std::vector<float>> splice_states;
};
