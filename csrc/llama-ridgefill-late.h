// The late phase of a planned prompt (docs/design.md §4, §6): once every row has run the early layers,
// a pass over the late layers, layer-major (a graph may run several consecutive layers, see
// llama_ridgefill_segment). Each pass is cut into graphs by one builder
// (llama_ridgefill_context::late_graph), which the run, the probe pass and the compute-buffer
// reservation share, so a graph input added there is reserved and run alike.
#pragma once

#include "llama-ridgefill-graph.h"

#include "llama-batch.h"

#include <utility>
#include <vector>

// A window-sized sliding-window cache (llama.cpp's default, swa_full off) holds only the last rows of
// the prompt once the early phase is done: an exact row whose window [p - n_swa + 1, p] reaches rows the
// cache no longer holds runs each late sliding-window layer over the scratch cache instead
// (llama_ridgefill_context::swa_scratch), in groups of exact rows in position order. A window graph
// runs a group: the rows its windows need that are not in the scratch yet enter it (the filled ones
// filled there, the group's exact rows stored there by the graph), after the rows no later window
// needs have left it, as a sliding-window cache keeps its cells
struct llama_ridgefill_window {
    int32_t   c0 = 0; // the group: exact rows X[c0, c1)
    int32_t   c1 = 0;
    llama_pos lo = 0; // rows at positions below lo leave the scratch first

    std::vector<llama_pos> pos_new;   // the rows entering the scratch (ascending) ...
    std::vector<uint32_t>  cells_new; // ... and their cells there
    std::vector<uint32_t>  cells_x;   // [c1 - c0] the scratch cell of each exact row of the group

    llama_ridgefill_fill  fill; // the filled rows among those entering, written to the scratch
    llama_ridgefill_write wt;   // the group's exact rows the sliding-window cache holds: written there too
};

// one pass over the late layers: the role of every planned row
struct llama_ridgefill_pass {
    llama_seq_id seq_id   = 0;
    llama_pos    pos0     = 0;
    int32_t      N        = 0; // planned rows
    int32_t      T        = 0; // tail rows: the last rows of the prompt, the last rows of X
    int32_t      n_prefix = 0; // N - T

    std::vector<int64_t> cells;     // [N] cell of each planned row in the full-attention cache
    std::vector<int64_t> cells_swa; // [N] ... in the sliding-window cache (iSWA models), else empty

    std::vector<int32_t> X;  // the exact rows (planned rows, ascending, the tail last)
    std::vector<int32_t> xi; // [N] the row of each planned row among X (its row of xx), -1: filled

    llama_ridgefill_fill fill; // the filled rows (a windowed pass: written to the full-attention layers only)

    // a windowed pass (some planned rows have left a window-sized sliding-window cache): at a late
    // sliding-window layer, the exact rows X[0, n_x_win) run in window graphs over the scratch cache,
    // the others over the cache, whose filled rows fill_swa holds (written by the first of their graphs)
    bool windowed = false;
    int32_t n_x_win = 0;
    std::vector<llama_ridgefill_window> windows;
    llama_ridgefill_fill fill_swa;

    bool    fills   = true; // the first graph of each attention layer writes the filled rows, after
                            // measuring the value (and key) scale on the first tail rows
    int32_t n_query = 0;    // probe pass: the last n_query rows of X score the prefix at every
                            // full-attention late layer
    bool    logits  = true; // tail rows that asked for logits get them
    std::vector<std::pair<llama_pos, int32_t>> out_rows; // (position, batch index) of those rows
};

// a run of consecutive late layers [l0, l1) whose graphs each run all of them on a chunk of rows:
// recurrent layers (each chunk of every row runs them in turn), or attention layers whose exact rows
// fit one chunk (llama_ridgefill_context::late_segments)
struct llama_ridgefill_segment {
    int32_t l0 = 0;
    int32_t l1 = 0;
};

// one graph of a pass: late layers [il, il_end) on rows [c0, c1) of the rows the layers run (the exact
// rows X for attention layers, every planned row in position order for recurrent ones)
struct llama_ridgefill_late_graph {
    int32_t il     = 0;
    int32_t il_end = 0;
    int32_t c0     = 0;
    int32_t c1     = 0;

    llama_ridgefill_graph rf;        // what the model builder builds
    llama_ubatch          ub;        // the graph's rows, no tokens
    std::vector<uint32_t> cells;     // the cells they already occupy
    std::vector<uint32_t> cells_swa;
    int32_t               window = -1; // a window graph: its group (llama_ridgefill_pass::windows)
    std::vector<int32_t>  out_idx;   // batch index of each output row (-1: an output nobody asked for)
};
