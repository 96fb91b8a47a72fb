"""RidgeFill on a window-sized sliding-window cache (``swa_full=False``: llama.cpp's own default in
llama-server): once the early phase is done the cache holds only the last rows of a long prompt, and the
late sliding-window layers of the exact rows whose windows reach further back run over a scratch cache
of n_swa + 2 n_ubatch cells (docs/design.md §6.2). Checked on the tiny gemma3 and gpt-oss models
against the float64 oracle of docs/design.md §4 and against the same plan on a full-size cache
(``swa_full=True``): the last row's logits, the value scales, and the K/V of every row the cache keeps;
the KV buffers are stock's, and the scratch is bounded by the window and the ubatch, not by n_ctx.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import evaluation_tokens
from prefill_helpers import ctx_kwargs, last_logits, rel
from ridgefill_cpp import Llama, RidgeFill  # first: llama_cpp then loads the patched libraries
import ridgefill_cpp.core.native as N
from ridgefill_cpp.core.gguf_model import read_model_info
from ridgefill_cpp.oracle import load_oracle
from ridgefill_cpp.oracle.fill import fill_forward

import llama_cpp  # noqa: E402

ARCHS = ("gemma3", "gpt-oss")
N_CTX, N_UBATCH, N_BATCH = 1024, 16, 64
TAIL = 16
#: relative tolerance against the oracle (gemma3's GELU uses an F16 table in llama.cpp)
TOL = {"gemma3": 2e-3, "gpt-oss": 2e-5}
#: windowed against full-size, same plan: only the attention's extents (summation order) differ
TOL_SAME = 1e-4
TOL_FLASH = 3e-3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def oracles(tiny_models):
    return {arch: load_oracle(tiny_models[arch], dtype=torch.float64) for arch in ARCHS}


def _exact_rows(n: int, n_swa: int, seed: int) -> list[int]:
    """Exact prefix rows: a random tenth, plus spans straddling every multiple of the window (rows at
    window edges, spans crossing them) and a run longer than the window."""
    rng = np.random.default_rng(seed)
    rows = set(rng.choice(n - TAIL, size=(n - TAIL) // 10, replace=False).tolist())
    for edge in range(n_swa, n - TAIL, n_swa * 5):
        rows.update(range(edge - 3, edge + 3))
    rows.update(range(n // 3, n // 3 + 2 * n_swa))
    return sorted(r for r in rows if 0 <= r < n - TAIL)


def _run(path, tokens, exact, split, tail, *, swa_full: bool, flash: bool = False):
    """Eval ``tokens`` with the given exact rows: (last logits, value scales, {layer: (K, V)} of the rows
    the cache holds at the end, stats, the positions those rows are)."""
    rf = RidgeFill.identity(split, tail=tail, selector=exact, min_prompt=0)
    llm = Llama(str(path), ridgefill=rf, swa_full=swa_full,
                **ctx_kwargs(n_ctx=N_CTX, n_ubatch=N_UBATCH, n_batch=N_BATCH, flash_attn=flash))
    try:
        llm.eval(tokens)
        st = llm.ridgefill_stats
        assert st["exact_positions"] == exact
        mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
        first = llama_cpp.llama_memory_seq_pos_min(mem, 0)  # the sliding-window cache's first row
        kept = list(range(first, len(tokens)))
        kv = {il: llm.read_kv(il, kept) for il in range(read_model_info(path).n_layer)}
        return last_logits(llm), np.array(llm.ridgefill_value_scales()), kv, st, kept
    finally:
        llm.close()


def _stock_logits(path, tokens, *, swa_full: bool) -> np.ndarray:
    llm = Llama(str(path), swa_full=swa_full, **ctx_kwargs(n_ctx=N_CTX, n_ubatch=N_UBATCH, n_batch=N_BATCH, flash_attn=True))
    try:
        llm.eval(tokens)
        return last_logits(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("flash", [False, True], ids=["v-transposed", "flash-attn"])
@pytest.mark.parametrize("n", [14, 200, 1000], ids=["shorter-than-window", "no-row-leaves", "rows-leave"])
@pytest.mark.parametrize("arch", ARCHS)
def test_window_sized_cache_matches_the_oracle_and_the_full_size_cache(arch, n, flash, tiny_models, oracles):
    path = tiny_models[arch]
    o = oracles[arch]
    info = read_model_info(path)
    n_swa = info.sliding_window
    assert n_swa == 16 and info.swa_layers
    split = o.n_layer // 2
    tokens = evaluation_tokens(path, n)
    tail = TAIL if n > 2 * TAIL else 4
    exact = _exact_rows(n, n_swa, seed=n) if n > 2 * TAIL else [3, 7]

    logits, scales, kv, st, kept = _run(path, tokens, exact, split, tail, swa_full=False, flash=flash)
    full_logits, full_scales, full_kv, full_st, _ = _run(path, tokens, exact, split, tail, swa_full=True, flash=flash)

    # the scratch: only where rows left the cache, and bounded by the window and the ubatch
    scratch = st["window"]
    if n == 1000:
        assert kept[0] > 0 and scratch["graphs"] > 1
        assert 0 < scratch["scratch_cells"] <= -(-(n_swa + 2 * N_UBATCH) // 256) * 256 < N_CTX
        row = 2 * info.n_head_kv * info.head_dim * 4  # a cell's K and V, F32
        n_late_swa = sum(1 for il in info.swa_layers if il >= split)
        assert scratch["scratch_bytes"] == n_late_swa * scratch["scratch_cells"] * row
    else:
        assert kept[0] == 0 and scratch["graphs"] == 0
    assert full_st["window"] == {"scratch_cells": 0, "scratch_bytes": 0, "graphs": 0}

    # windowed = full-size, same plan. The CPU flash-attention kernel rounds to F16, so the order of
    # the cells it reads shows, in stock too: there the logits may differ by 4 times what the two
    # caches give stock (measured here: 5e-4 on gemma3, already in the early layers' K/V), the K/V by
    # TOL_FLASH
    tol_same = TOL_FLASH if flash else TOL_SAME
    if flash:
        stock = [_stock_logits(path, tokens, swa_full=full) for full in (False, True)]
        assert rel(logits, full_logits) < max(TOL_SAME, 4 * rel(*stock))
    assert rel(logits, full_logits) < tol_same
    np.testing.assert_allclose(scales, full_scales, rtol=tol_same, atol=0)
    for il, (k, v) in kv.items():
        fk, fv = full_kv[il]  # every row (the full-size cache keeps them all)
        assert rel(k, fk[kept]) < tol_same and rel(v, fv[kept]) < tol_same, il

    # and the oracle (F32 K/V without flash attention only: the CPU flash kernel rounds K/V to F16)
    if flash:
        return
    ref = fill_forward(o, tokens, split=split, maps=None, tail=tail, exact_positions=exact, value_rescale=512)
    tol = TOL[arch]
    assert rel(logits, ref.last_logits.numpy()) < tol
    np.testing.assert_allclose(scales, ref.value_scales.numpy(), rtol=tol, atol=0)
    for il, (k, v) in kv.items():
        assert rel(k, ref.keys[il].reshape(n, -1)[kept].numpy()) < tol, il
        assert rel(v, ref.values[il].reshape(n, -1)[kept].numpy()) < tol, il


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_buffers_are_stocks_with_the_same_flags(arch, tiny_models):
    """A RidgeFill context's KV cache is the one stock creates with the same flags; the scratch is the
    only memory a window-sized cache adds, and it is reported."""
    from prefill_helpers import captured_log

    path = tiny_models[arch]
    sizes = {}
    for rf in (None, RidgeFill.identity(read_model_info(path).n_layer // 2, tail=TAIL, min_prompt=0, selector="protected")):
        with captured_log() as log:
            llm = Llama(str(path), ridgefill=rf, swa_full=False, **ctx_kwargs(n_ctx=N_CTX, n_ubatch=N_UBATCH, verbose=True))
            llm.close()
        sizes[rf is None] = [line for line in log if "KV cache, size =" in line or "KV buffer size" in line]
    stock, planned = sizes[True], sizes[False]
    assert stock and planned[:len(stock)] == stock
    # llama.cpp's sliding-window cache is window-sized: n_swa + n_ubatch cells, padded to 256
    assert any("SWA KV cache, size = 256 cells" in line for line in stock)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_sequence_with_cached_rows_plans_while_they_stay(arch, tiny_models):
    """Rows of the sequence before pos0 are not in x_S: a plan after them runs while the window-sized
    cache keeps them (the new rows fit next to them; the same as on a full-size cache), and runs stock
    prefill when the cache would drop them."""
    path = tiny_models[arch]
    split = read_model_info(path).n_layer // 2
    tokens = evaluation_tokens(path, 700)
    out = {}
    for full in (False, True):
        rf = RidgeFill.identity(split, tail=TAIL, min_prompt=0, selector="protected")
        llm = Llama(str(path), ridgefill=rf, swa_full=full, **ctx_kwargs(n_ctx=N_CTX, n_ubatch=N_UBATCH, n_batch=N_BATCH))
        try:
            llm.eval(tokens[:100])
            llm.eval(tokens[100:250])  # 250 rows: the window-sized cache (256 cells) keeps them all
            st = llm.ridgefill_stats
            assert st["pos0"] == 100 and st["n_prompt"] == 150 and st["window"]["graphs"] == 0
            logits = last_logits(llm)
            llm.eval(tokens[250:700])
            out[full] = (logits, dict(llm.ridgefill_stats), N.llama_ridgefill_stock_reason(llm._ctx.ctx).decode())
        finally:
            llm.close()
    assert rel(out[False][0], out[True][0]) < TOL_SAME
    assert out[False][1] == {}  # stock prefill: the first new rows attend to rows the cache would drop
    assert out[False][2] == ("450 new prompt rows after cached rows: the window-sized sliding-window cache (256 cells) "
                             "cannot keep the cached rows they attend to (a full-size cache, swa_full or --swa-full, can)")
    assert out[True][1]["pos0"] == 250 and out[True][2] == ""  # a full-size cache keeps them
