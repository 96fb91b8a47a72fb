// RidgeFill and the memory of a llama_context (see llama-ridgefill-memory.h).

#include "llama-ridgefill-memory.h"

#include "llama-kv-cache-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"

#include <algorithm>
#include <memory>
#include <numeric>

llama_ridgefill_caches::llama_ridgefill_caches(llama_memory_i * mem) {
    if (auto * m = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        iswa = m;
        base = m->get_base();
        swa  = m->get_swa();
    } else if (auto * m = dynamic_cast<llama_memory_hybrid *>(mem)) {
        hybrid = m;
        base   = m->get_mem_attn();
        recr   = m->get_mem_recr();
    } else {
        base = dynamic_cast<llama_kv_cache *>(mem);
    }
}

int32_t llama_ridgefill_caches::recr_cell(llama_seq_id seq_id) const {
    if (recr == nullptr || seq_id < 0 || (uint32_t) seq_id >= recr->size) {
        return -1;
    }
    return recr->cells[seq_id].tail;
}

int64_t llama_ridgefill_caches::state_size(int32_t il) const {
    GGML_ASSERT(recr);
    return (ggml_nbytes(recr->r_l[il]) + ggml_nbytes(recr->s_l[il]))/recr->size/sizeof(float);
}

std::vector<float> llama_ridgefill_caches::read_state(int32_t il, int32_t cell) const {
    GGML_ASSERT(recr && cell >= 0 && (uint32_t) cell < recr->size);
    std::vector<float> res;
    for (ggml_tensor * t : { recr->r_l[il], recr->s_l[il] }) {
        GGML_ASSERT(t->type == GGML_TYPE_F32);
        const size_t row = ggml_nbytes(t)/recr->size;
        const size_t n0  = res.size();
        res.resize(n0 + row/sizeof(float));
        ggml_backend_tensor_get(t, res.data() + n0, (size_t) cell*row, row);
    }
    return res;
}

void llama_ridgefill_caches::write_state(int32_t il, int32_t cell, const std::vector<float> & state) const {
    GGML_ASSERT(recr && cell >= 0 && (uint32_t) cell < recr->size);
    size_t off = 0;
    for (ggml_tensor * t : { recr->r_l[il], recr->s_l[il] }) {
        const size_t row = ggml_nbytes(t)/recr->size;
        GGML_ASSERT((off + row/sizeof(float)) <= state.size());
        ggml_backend_tensor_set(t, state.data() + off, (size_t) cell*row, row);
        off += row/sizeof(float);
    }
}

// a slot that re-uses the cells of rows that are already in the cache
static llama_kv_cache::slot_info rf_reuse_slot(const llama_kv_cache * kv, llama_seq_id seq_id, const std::vector<uint32_t> & cells) {
    llama_kv_cache::slot_info sinfo;
    const uint32_t strm = kv->get_stream(seq_id);
    sinfo.s0    = strm;
    sinfo.s1    = strm;
    sinfo.strm  = { (llama_seq_id) strm };
    sinfo.idxs  = { cells };
    sinfo.reuse = true;
    return sinfo;
}

llama_memory_context_ptr llama_ridgefill_caches::reuse_context(llama_seq_id seq_id, const llama_ubatch & ub,
        const std::vector<uint32_t> & cells, const std::vector<uint32_t> & cells_swa, int32_t rs_cell, bool rs_zero) const {
    if (iswa) {
        return std::make_unique<llama_kv_cache_iswa_context>(iswa,
                llama_kv_cache::slot_info_vec_t { rf_reuse_slot(base, seq_id, cells) },
                llama_kv_cache::slot_info_vec_t { rf_reuse_slot(swa,  seq_id, cells_swa) },
                std::vector<llama_ubatch> { ub });
    }
    if (hybrid) {
        GGML_ASSERT(rs_cell >= 0);
        return std::make_unique<llama_memory_hybrid_context>(hybrid,
                llama_kv_cache::slot_info_vec_t { rf_reuse_slot(base, seq_id, cells) },
                std::vector<llama_ubatch> { ub }, (uint32_t) rs_cell, rs_zero ? rs_cell : -1);
    }
    return std::make_unique<llama_kv_cache_context>(base,
            llama_kv_cache::slot_info_vec_t { rf_reuse_slot(base, seq_id, cells) },
            std::vector<llama_ubatch> { ub });
}

llama_memory_context_ptr llama_ridgefill_caches::scratch_context(llama_kv_cache * scratch, llama_seq_id seq_id,
        const llama_ubatch & ub, const std::vector<uint32_t> & cells, const std::vector<uint32_t> & cells_scratch) const {
    GGML_ASSERT(iswa && scratch);
    std::vector<llama_ubatch> ubs = { ub };
    return std::make_unique<llama_kv_cache_iswa_context>(
            std::make_unique<llama_kv_cache_context>(base,    llama_kv_cache::slot_info_vec_t { rf_reuse_slot(base,    seq_id, cells) }, ubs),
            std::make_unique<llama_kv_cache_context>(scratch, llama_kv_cache::slot_info_vec_t { rf_reuse_slot(scratch, seq_id, cells_scratch) }, ubs),
            ubs);
}

llama_memory_context_ptr llama_ridgefill_caches::reserve_context(llama_kv_cache * scratch) const {
    // a context over cell 0 of sequence 0's stream, applied with n_kv_min the whole stream: reused
    // cells are left as they are, and n_kv becomes the size of the cache (of each cache)
    const llama_ubatch ub = llama_ridgefill_make_ubatch(0, { 0 }, false, 1);
    const std::vector<uint32_t> cell0 = { 0 };
    llama_memory_context_ptr res = scratch ? scratch_context(scratch, 0, ub, cell0, cell0) :
                                             reuse_context(0, ub, cell0, cell0, recr ? 0 : -1, true);
    std::vector<std::pair<llama_kv_cache *, uint32_t>> n_kv_min;
    for (llama_kv_cache * kv : { base, scratch ? scratch : swa }) {
        if (kv) {
            n_kv_min.emplace_back(kv, kv->n_kv_min);
            kv->n_kv_min = kv->get_size();
        }
    }
    const bool ok = res->apply();
    for (const auto & [kv, n] : n_kv_min) {
        kv->n_kv_min = n;
    }
    GGML_ASSERT(ok);
    return res;
}

void llama_ridgefill_scratch_enter(llama_kv_cache * scratch, llama_seq_id seq_id, bool first, llama_pos lo,
        const std::vector<llama_pos> & pos, const std::vector<uint32_t> & cells) {
    if (first) {
        scratch->clear(false);
    } else {
        scratch->seq_rm(seq_id, -1, lo);
    }
    if (pos.empty()) {
        return;
    }
    // the rows' positions into the cells (apply_ubatch of a slot that is not reused writes them)
    llama_kv_cache::slot_info sinfo;
    sinfo.s0   = 0;
    sinfo.s1   = 0;
    sinfo.strm = { (llama_seq_id) scratch->get_stream(seq_id) };
    sinfo.idxs = { cells };
    const llama_ubatch ub = llama_ridgefill_make_ubatch(seq_id, pos, false, 1);
    scratch->apply_ubatch(sinfo, ub);
}

std::vector<int64_t> llama_ridgefill_find_cells(const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos pos0, int32_t n) {
    std::vector<int64_t> res(n, -1);
    const auto & cells = kv->get_cells(seq_id);
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (cells.is_empty(i) || !cells.seq_has(i, seq_id)) {
            continue;
        }
        const llama_pos p = cells.pos_get(i);
        if (p >= pos0 && p < pos0 + n) {
            res[p - pos0] = i;
        }
    }
    return res;
}

void llama_ridgefill_text_positions(const llama_pos * pos, size_t n, uint32_t n_pos, llama_pos * out) {
    for (uint32_t k = 0; k < n_pos; ++k) {
        if (k < 3) {
            std::copy_n(pos, n, out + k*n);
        } else {
            std::fill_n(out + k*n, n, 0);
        }
    }
}

llama_ubatch llama_ridgefill_make_ubatch(llama_seq_id seq_id, const std::vector<llama_pos> & pos, bool output_last, uint32_t n_pos) {
    auto data = std::make_shared<llama_ubatch::data_t>();
    const uint32_t n = pos.size();

    data->pos.resize((size_t) n*n_pos);
    llama_ridgefill_text_positions(pos.data(), n, n_pos, data->pos.data());
    data->n_seq_id   .assign(n, 1);
    data->seq_id_data.assign(1, seq_id);
    data->seq_id     .assign(n, data->seq_id_data.data());
    data->seq_id_unq = { seq_id };
    data->seq_idx    .assign(LLAMA_MAX_SEQ, -1);
    data->seq_idx[seq_id] = 0;
    data->output     .assign(n, 0);
    if (output_last && n > 0) {
        data->output[n - 1] = 1;
    }
    data->batch_idxs.resize(n);
    std::iota(data->batch_idxs.begin(), data->batch_idxs.end(), 0);

    llama_ubatch ub {
        /*.b_equal_seqs =*/ 1, // one sequence (the recurrent layers need it)
        /*.n_tokens     =*/ n,
        /*.n_seq_tokens =*/ n,
        /*.n_seqs       =*/ 1,
        /*.n_seqs_unq   =*/ 1,
        /*.n_pos        =*/ n_pos,
        /*.token        =*/ nullptr,
        /*.embd         =*/ nullptr,
        /*.pos          =*/ data->pos.data(),
        /*.n_seq_id     =*/ data->n_seq_id.data(),
        /*.seq_id       =*/ data->seq_id.data(),
        /*.seq_id_unq   =*/ data->seq_id_unq.data(),
        /*.seq_idx      =*/ data->seq_idx.data(),
        /*.output       =*/ data->output.data(),
        /*.data         =*/ data,
    };
    return ub;
}
