"""Helpers shared by the filled-row prefill tests (dense and hybrid): context settings under which
llama.cpp and the float64 oracle agree to float32 rounding, logits and error measures, and a
capture of llama.cpp's log."""

from __future__ import annotations

import contextlib
import ctypes
import math

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
    """llama.cpp's log lines while the block runs (a list that fills up), then ridgefill_cpp's log callback again."""
    from ridgefill_cpp.core import log as _log

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        _log.install()


def early_graph_counts(calls: list[int], n_ubatch: int, n_prompt: int, n_sel_queries: int) -> tuple[int, int]:
    """(built, reused) early-phase graphs of a plan whose rows come in decode calls of these sizes
    (docs/design.md §6): each call is cut into ubatches of n_ubatch rows; a ubatch holding one of the
    attention selector's query rows (the last n_sel_queries of the prompt; 0: no selector) builds its
    graph, any other reuses the previous ubatch's graph when that one was such a ubatch of the same
    size."""
    built = reused = 0
    prev = None  # rows of the previous reusable early graph
    pos = 0
    for c in calls:
        for u0 in range(0, c, n_ubatch):
            n = min(n_ubatch, c - u0)
            sel = n_sel_queries > 0 and pos + u0 + n - 1 >= n_prompt - n_sel_queries
            if not sel and prev == n:
                reused += 1
            else:
                built += 1
            prev = None if sel else n
        pos += c
    return built, reused


def late_graph_count(*, recurrent: list[bool], split: int, n_prompt: int, tail: int, exact: list[int],
                     n_ubatch: int, recurrent_rows: int | None = None, fill_chunk: int | None = None,
                     fills: bool = True) -> int:
    """Late-phase graphs of one pass (docs/design.md §6): runs of consecutive recurrent late layers share
    a graph per chunk of every row (chunks of up to recurrent_rows rows, at most n_ubatch of them exact,
    anew at the tail; a chunk without an exact row runs its layers one graph each); runs of attention
    layers share one graph when the exact rows fit one chunk, else each attention layer runs
    ceil(|X| / n_ubatch) graphs. exact: the exact prefix rows (0-based). Only for settings where the
    fill-step budget does not decide (one fill step per layer, or several chunks of exact rows, or no
    fill), which the assertion checks."""
    recurrent_rows = recurrent_rows or n_ubatch
    n_layer = len(recurrent)
    n_prefix = n_prompt - tail
    x = set(exact) | set(range(n_prefix, n_prompt))
    n_x, n_f = len(x), n_prompt - len(x)
    chunk = fill_chunk or n_ubatch
    one_chunk = n_x <= n_ubatch
    count = 0
    l0 = split
    while l0 < n_layer:
        l1 = l0 + 1
        while l1 < n_layer and recurrent[l1] == recurrent[l0] and (recurrent[l0] or one_chunk):
            l1 += 1
        if not recurrent[l0] and l1 - l0 > 1:
            # a graph holds at least 6 fill steps (llama-ridgefill-late.cpp fill_steps_max)
            assert not (fills and n_f > chunk) and l1 - l0 <= 6, "the graph's fill-step budget would decide"
        if recurrent[l0]:
            c0 = 0
            while c0 < n_prompt:
                end = n_prefix if c0 < n_prefix else n_prompt
                c1, n_x_chunk = c0, 0
                while c1 < end and c1 - c0 < recurrent_rows and not (c1 in x and n_x_chunk == n_ubatch):
                    n_x_chunk += c1 in x
                    c1 += 1
                has_exact = n_x_chunk > 0
                count += 1 if has_exact or l1 - l0 == 1 else l1 - l0
                c0 = c1
        else:
            count += math.ceil(n_x / n_ubatch)
        l0 = l1
    return count
