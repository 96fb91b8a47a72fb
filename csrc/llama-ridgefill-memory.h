// RidgeFill and the memory of a llama_context: the caches a planned prompt's rows live in, the cells
// that hold them, the recurrent states of hybrid models, and memory contexts and ubatches over rows
// that are already in the memory (the late phase re-addresses them instead of allocating new cells).
#pragma once

#include "llama-batch.h"
#include "llama-kv-cache.h"
#include "llama-memory.h"

#include <cstdint>
#include <vector>

class llama_kv_cache_iswa;
class llama_memory_hybrid;
class llama_memory_recurrent;

// the caches of a context's memory: the full-attention KV cache, the sliding-window one of iSWA
// models, and the recurrent states of hybrid models (nullptr where the memory has none)
struct llama_ridgefill_caches {
    explicit llama_ridgefill_caches(llama_memory_i * mem);

    llama_kv_cache         * base   = nullptr;
    llama_kv_cache         * swa    = nullptr;
    llama_kv_cache_iswa    * iswa   = nullptr;
    llama_memory_hybrid    * hybrid = nullptr;
    llama_memory_recurrent * recr   = nullptr;

    // the recurrent cell holding a sequence's state (-1: none)
    int32_t recr_cell(llama_seq_id seq_id) const;

    // the values of one recurrent state (conv state, then ssm state) of layer il
    int64_t state_size(int32_t il) const;

    // the recurrent state (conv state, then ssm state; F32) of layer il in cell `cell`
    std::vector<float> read_state(int32_t il, int32_t cell) const;
    void               write_state(int32_t il, int32_t cell, const std::vector<float> & state) const;

    // a memory context over rows already in the memory: the KV cells `cells` (`cells_swa`) of the
    // ubatch's rows; for hybrid models also the recurrent state of cell rs_cell, continued (rs_zero:
    // from a zeroed state)
    llama_memory_context_ptr reuse_context(llama_seq_id seq_id, const llama_ubatch & ub, const std::vector<uint32_t> & cells,
            const std::vector<uint32_t> & cells_swa, int32_t rs_cell, bool rs_zero) const;

    // the same over the scratch cache of the late sliding-window layers: the full-attention cache's cells
    // `cells` and the scratch's cells `cells_scratch` (an iSWA context whose sliding-window part is the
    // scratch)
    llama_memory_context_ptr scratch_context(llama_kv_cache * scratch, llama_seq_id seq_id, const llama_ubatch & ub,
            const std::vector<uint32_t> & cells, const std::vector<uint32_t> & cells_scratch) const;

    // a memory context to reserve the compute buffers of a plan's graphs: one stream (sequence 0's)
    // with n_kv the whole stream, for the caches themselves or, with a scratch, the full-attention cache
    // and the scratch. A plan's graphs run over the stream of their own sequence: init_full() spans
    // every stream, over which a ubatch of one sequence cannot be spread (llama.cpp cuts a ubatch into
    // n_stream equal parts, so n_tokens not a multiple of n_stream would not even build)
    llama_memory_context_ptr reserve_context(llama_kv_cache * scratch) const;
};

// the rows of seq_id in the scratch cache of the late sliding-window layers, as a window graph needs
// them: every row below position lo leaves (first: every row does), then the rows at positions pos
// enter cells `cells`, which are empty by then
void llama_ridgefill_scratch_enter(llama_kv_cache * scratch, llama_seq_id seq_id, bool first, llama_pos lo,
        const std::vector<llama_pos> & pos, const std::vector<uint32_t> & cells);

// cell of each position pos0 + j, j < n, of seq_id in a cache (-1 where none)
std::vector<int64_t> llama_ridgefill_find_cells(const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos pos0, int32_t n);

// the n_pos positions of n text rows, section-major, into out[n*n_pos]: the positions themselves
// (n_pos = 1), or M-RoPE's sections p, p, p, 0 (n_pos = 4), as llama.cpp expands text positions
void llama_ridgefill_text_positions(const llama_pos * pos, size_t n, uint32_t n_pos, llama_pos * out);

// a ubatch of rows of one sequence at the given positions, no tokens (the inputs come from x_S);
// n_pos positions per row (llama_ridgefill_text_positions)
llama_ubatch llama_ridgefill_make_ubatch(llama_seq_id seq_id, const std::vector<llama_pos> & pos, bool output_last, uint32_t n_pos);
