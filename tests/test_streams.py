"""RidgeFill on a KV cache with one stream per sequence (``kv_unified = false``, ``n_seq_max > 1``: what
llama-server gives each slot by default): a plan fills and runs its own sequence's stream, leaves the
other streams as they were, and computes what the same plan computes on a single-stream cache (itself
checked against the oracle in test_prefill.py), with a transposed V cache (no flash attention) and with
flash attention, on a dense model and on gemma3's sliding-window layers (full-size and window-sized). Any
number of streams: llama-server's -np 3 once aborted at attach, its reserve graphs cut a ubatch of one
sequence into as many parts as there are streams."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from conftest import evaluation_tokens
from ridgefill_cpp import RidgeFill  # first: llama_cpp then loads the patched libraries
import ridgefill_cpp.core.native as N
from ridgefill_cpp.core.gguf_model import read_model_info

import llama_cpp  # noqa: E402

F32 = 0
N_CTX, N_BATCH, N_UBATCH = 1024, 256, 64
SPLIT, TAIL = 3, 16


class Context:
    """A raw llama_context with n_seq streams (or one unified), RidgeFill attached (identity fill)."""

    def __init__(self, path, n_seq: int, unified: bool, flash: bool, selector: str = "attention", swa_full: bool = True):
        mp = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = N_CTX * n_seq, N_BATCH, N_UBATCH
        cp.n_seq_max, cp.kv_unified, cp.swa_full = n_seq, unified, swa_full
        cp.n_threads = cp.n_threads_batch = 1
        cp.type_k = cp.type_v = F32
        cp.flash_attn_type = 1 if flash else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.info = read_model_info(path)
        self.swa_full = swa_full
        rf = RidgeFill.identity(SPLIT, tail=TAIL, min_prompt=0, exact_fraction=0.1, selector=selector)
        assert N.llama_ridgefill_attach(self.ctx, None, rf.params()) == 0, N.llama_ridgefill_last_error()

    def prefill(self, tokens: list[int], seq: int, planned: bool = True) -> np.ndarray:
        """Decode ``tokens`` into sequence ``seq`` from position 0 (planned or stock); the last row's logits."""
        if planned:
            assert N.llama_ridgefill_begin(self.ctx, seq, 0, len(tokens)) == 1, N.llama_ridgefill_last_error()
        batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)
        try:
            for i0 in range(0, len(tokens), N_BATCH):
                chunk = tokens[i0:i0 + N_BATCH]
                batch.n_tokens = len(chunk)
                for j, t in enumerate(chunk):
                    batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, i0 + j, 1
                    batch.seq_id[j][0] = seq
                    batch.logits[j] = i0 + j == len(tokens) - 1
                assert llama_cpp.llama_decode(self.ctx, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def kv(self, seq: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """K and V of every late layer at positions 0..n-1 of sequence ``seq`` (of a sliding-window layer
        on a window-sized cache, the last window's positions: the cache holds no others)."""
        width = self.info.n_head_kv * self.info.head_dim
        f = ctypes.POINTER(ctypes.c_float)
        out = []
        for il in range(SPLIT, self.info.n_layer):
            p0 = max(0, n - self.info.sliding_window) if not self.swa_full and il in self.info.swa_layers else 0
            pos = (ctypes.c_int32 * (n - p0))(*range(p0, n))
            k = np.empty((n - p0, width), dtype=np.float32)
            v = np.empty((n - p0, width), dtype=np.float32)
            assert N.llama_ridgefill_read_kv(self.ctx, il, seq, pos, n - p0, k.ctypes.data_as(f), v.ctypes.data_as(f)) == 0
            out.append((k, v))
        return out

    def close(self):
        N.llama_ridgefill_detach(self.ctx)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


@pytest.mark.parametrize("arch, swa_full", [("llama", True), ("gemma3", True), ("gemma3", False)],
                         ids=["llama", "gemma3", "gemma3-window-sized"])
@pytest.mark.parametrize("n_seq", [2, 3])
@pytest.mark.parametrize("flash", [False, True], ids=["v-transposed", "flash-attn"])
def test_a_plan_runs_in_its_own_stream(tiny_models, arch, swa_full, n_seq, flash):
    """Sequence 0 holds a planned prompt; the last sequence's plan (in the last stream) computes what it
    computes alone on one stream and leaves stream 0 as it was. n_seq = 3: N_UBATCH is not a multiple
    of the streams."""
    path = tiny_models[arch]
    a = evaluation_tokens(path, 300)
    b = evaluation_tokens(path, 420)[60:]  # another prompt, longer than gemma3's window
    # the attention selector where a full-attention layer lies below the split (not the tiny gemma3's)
    selector = "protected" if arch == "gemma3" else "attention"
    one = Context(path, 1, unified=False, flash=flash, selector=selector, swa_full=swa_full)
    many = Context(path, n_seq, unified=False, flash=flash, selector=selector, swa_full=swa_full)
    last = n_seq - 1
    try:
        ref_logits = one.prefill(b, 0)
        ref_kv = one.kv(0, len(b))
        stats = N.llama_ridgefill_stats()
        assert N.llama_ridgefill_get_stats(one.ctx, ctypes.byref(stats)) == 0 and stats.n_filled > 0

        many.prefill(a, 0)  # sequence 0 (stream 0) holds a planned prompt
        a_kv = many.kv(0, len(a))
        logits = many.prefill(b, last)  # the plan of the last sequence runs in the last stream
        assert N.llama_ridgefill_get_stats(many.ctx, ctypes.byref(stats)) == 0 and stats.seq_id == last
        assert stats.n_filled > 0
        np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-5)
        for (k, v), (rk, rv) in zip(many.kv(last, len(b)), ref_kv):
            np.testing.assert_allclose(k, rk, rtol=0, atol=1e-5)
            np.testing.assert_allclose(v, rv, rtol=0, atol=1e-5)
        # stream 0 is as sequence 0's plan left it
        for (k, v), (ak, av) in zip(many.kv(0, len(a)), a_kv):
            assert np.array_equal(k, ak) and np.array_equal(v, av)
    finally:
        one.close()
        many.close()
