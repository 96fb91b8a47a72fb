"""Helpers shared by the filled-row prefill tests (dense and hybrid): context settings under which
llama.cpp and the float64 oracle agree to float32 rounding, logits and error measures, and a
capture of llama.cpp's log."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np

import ridgefill_cpp  # noqa: F401  (first: llama_cpp then loads the patched libraries)
import llama_cpp  # noqa: E402
from ridgefill_cpp import Llama

F32 = 0  # GGML_TYPE_F32


def ctx_kwargs(**kw):
    """F32 KV cache, no flash attention (the CPU kernel rounds K/V to F16), one thread."""
    base = dict(n_ctx=256, n_batch=256, n_ubatch=64, n_threads=1, n_threads_batch=1, verbose=False,
                flash_attn=False, type_k=F32, type_v=F32)
    base.update(kw)
    return base


def last_logits(llm) -> np.ndarray:
    n_vocab = llm.n_vocab()
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()


def rel(a, b) -> float:
    """Largest absolute difference relative to the largest magnitude of `b`."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def stock_logits(path, tokens, **kw) -> np.ndarray:
    llm = Llama(str(path), **ctx_kwargs(**kw))
    try:
        llm.eval(tokens)
        return last_logits(llm)
    finally:
        llm.close()


def assert_degenerate_plans_are_stock(path, tokens, *, n_layer: int, split: int, tail: int) -> None:
    """docs/design.md §4.6: S = L, N <= T and N < min_prompt run stock prefill, bit for bit (no plan)."""
    from ridgefill_cpp import RidgeFill

    stock = stock_logits(path, tokens)
    n = len(tokens)
    settings = [
        RidgeFill.identity(n_layer, tail=tail, min_prompt=0),      # S = L
        RidgeFill.identity(split, tail=n, min_prompt=0),           # N <= T
        RidgeFill.identity(split, tail=tail, min_prompt=n + 1),    # N < min_prompt
    ]
    for rf in settings:
        llm = Llama(str(path), ridgefill=rf, **ctx_kwargs())
        try:
            llm.eval(tokens)
            assert llm.ridgefill_stats == {}
            assert np.array_equal(last_logits(llm), stock), rf
        finally:
            llm.close()


@contextlib.contextmanager
def captured_log():
    """llama.cpp's log lines while the block runs (a list that fills up), then the usual logger again."""
    from llama_cpp import _logger

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
