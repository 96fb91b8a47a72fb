"""KQ masks computed inside RidgeFill's graphs (docs/design.md §6.1; ``LLAMA_RIDGEFILL_GRAPH_MASK``).

A planned prompt's graphs can compute the KQ mask attention reads from the positions of the cells and of
the graph's rows (one input of n_kv + n_tokens floats) instead of reading llama.cpp's host-built mask
(n_kv x n_tokens values per graph, built on the host and copied to the device). It is the default where
the KV cache is in device memory; on the CPU backend the host mask stays the default, and the tests turn
the graph mask on. The two masks hold the same values (0 kept, -inf masked), so a plan computes the same
numbers either way: the tests ask for bit-identical logits, selector scores, value scales and K/V, on
every architecture family (dense, sliding-window on full-size and window-sized caches, attention sinks,
the hybrid), with and without flash attention, with the early phase's graphs reused, and in a KV cache
shared with another sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import evaluation_tokens
from prefill_helpers import ctx_kwargs, last_logits
from ridgefill_cpp import Llama, RidgeFill  # first: llama_cpp then loads the patched libraries
from ridgefill_cpp.core.gguf_model import read_model_info

N_CTX, N_BATCH, N_UBATCH, TAIL = 1024, 256, 64, 16


def _plan(path, tokens, monkeypatch, *, graph_mask: bool | None, flash: bool, swa_full: bool = True,
          early_graphs: int = 0, selector: str = "attention"):
    """A planned prefill of ``tokens``: (last logits, stats, scores, value scales, K/V of every layer)."""
    if graph_mask is None:
        monkeypatch.delenv("LLAMA_RIDGEFILL_GRAPH_MASK", raising=False)
    else:
        monkeypatch.setenv("LLAMA_RIDGEFILL_GRAPH_MASK", "1" if graph_mask else "0")
    if early_graphs:
        monkeypatch.setenv("LLAMA_RIDGEFILL_EARLY_GRAPHS", str(early_graphs))
    else:
        monkeypatch.delenv("LLAMA_RIDGEFILL_EARLY_GRAPHS", raising=False)
    info = read_model_info(path)
    rf = RidgeFill.identity(info.n_layer // 2, tail=TAIL, exact_fraction=0.1, selector=selector, min_prompt=0)
    llm = Llama(str(path), ridgefill=rf, swa_full=swa_full,
                **ctx_kwargs(n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, flash_attn=flash))
    try:
        llm.eval(tokens)
        st = dict(llm.ridgefill_stats)
        kept = range(len(tokens) - TAIL, len(tokens))  # rows every cache layout still holds
        kv = [llm.read_kv(il, kept) for il in range(info.n_layer) if il not in info.recurrent_layers]
        return last_logits(llm), st, np.array(llm.ridgefill_scores()), np.array(llm.ridgefill_value_scales()), kv
    finally:
        llm.close()


def _assert_same(a, b):
    logits, st, scores, scales, kv = a
    logits_b, st_b, scores_b, scales_b, kv_b = b
    assert st["exact_positions"] == st_b["exact_positions"] and st["n_filled"] == st_b["n_filled"] > 0
    assert np.array_equal(scores, scores_b) and np.array_equal(scales, scales_b)
    assert np.array_equal(logits, logits_b)
    for (k, v), (k_b, v_b) in zip(kv, kv_b):
        assert np.array_equal(k, k_b) and np.array_equal(v, v_b)


CASES = [("llama", True), ("qwen3", True), ("gemma3", True), ("gemma3", False), ("gpt-oss", False), ("qwen35", True)]


@pytest.mark.parametrize("flash", [False, True], ids=["v-transposed", "flash-attn"])
@pytest.mark.parametrize("arch,swa_full", CASES, ids=[f"{a}-{'full' if f else 'window'}" for a, f in CASES])
def test_graph_mask_gives_the_host_masks_results(arch, swa_full, flash, tiny_models, monkeypatch):
    path = tiny_models[arch]
    n = 1000 if not swa_full else 600  # a window-sized cache: rows leave it, window graphs run
    tokens = evaluation_tokens(path, n)
    host = _plan(path, tokens, monkeypatch, graph_mask=False, flash=flash, swa_full=swa_full)
    graph = _plan(path, tokens, monkeypatch, graph_mask=True, flash=flash, swa_full=swa_full)
    assert host[1]["kq_mask"] == "host" and graph[1]["kq_mask"] == "graph"
    if not swa_full:
        assert graph[1]["window"]["graphs"] > 0
    _assert_same(graph, host)


def test_the_cpu_backend_keeps_the_host_mask_by_default(tiny_models, monkeypatch):
    path = tiny_models["llama"]
    st = _plan(path, evaluation_tokens(path, 200), monkeypatch, graph_mask=None, flash=False)[1]
    assert st["kq_mask"] == "host"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_reused_early_graphs_take_each_ubatchs_positions(arch, tiny_models, monkeypatch):
    """LLAMA_RIDGEFILL_EARLY_GRAPHS: the early phase's graphs (with their positions input) serve later
    ubatches, which set their own positions."""
    path = tiny_models[arch]
    tokens = evaluation_tokens(path, 800)
    host = _plan(path, tokens, monkeypatch, graph_mask=False, flash=True, early_graphs=2)
    graph = _plan(path, tokens, monkeypatch, graph_mask=True, flash=True, early_graphs=2)
    assert graph[1]["graphs"]["early_reused"] > 0
    assert graph[1]["graphs"] == host[1]["graphs"]
    _assert_same(graph, host)


def test_a_shared_cache_masks_the_other_sequences_cells(tiny_models, monkeypatch):
    """One KV stream for two sequences (kv_unified): the cells of the other sequence are masked out by
    the positions input (+inf), as llama.cpp's host mask does."""
    from test_streams import Context

    path = tiny_models["llama"]
    tokens = evaluation_tokens(path, 700)
    other = evaluation_tokens(path, 900)[700:]
    out = {}
    for graph_mask in (False, True):
        monkeypatch.setenv("LLAMA_RIDGEFILL_GRAPH_MASK", "1" if graph_mask else "0")
        ctx = Context(path, n_seq=2, unified=True, flash=True)
        try:
            ctx.prefill(other, seq=1, planned=False)  # the other sequence's rows first, in the same cells
            out[graph_mask] = ctx.prefill(tokens, seq=0)
        finally:
            ctx.close()
    assert np.array_equal(out[True], out[False])
