"""Filled-row prefill in libllama (``Llama(..., ridgefill=...)``) against the reference of docs/design.md §4
(``ridgefill_cpp.oracle.fill``) on the same GGUF weights, for every supported architecture.

The tiny models store F32 weights and the contexts keep F32 K/V without flash attention (the CPU
flash-attention kernel rounds K/V to F16), so llama.cpp and the float64 oracle agree to float32
rounding: the exact forward already differs by ~1e-6 (llama, qwen3, qwen2, mistral3, qwen3moe,
gpt-oss) and ~1e-4 (gemma3, whose GELU uses an F16 table in llama.cpp). The tolerances below sit a
little above those.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ridgefill_cpp.testing import tiny_models as mtm
from conftest import evaluation_tokens

import ridgefill_cpp  # first: llama_cpp then loads the patched libraries
import llama_cpp  # noqa: E402
from prefill_helpers import (assert_degenerate_plans_are_stock, captured_log, ctx_kwargs, early_graph_counts,
                             last_logits, late_graph_count, rel, stock_logits)
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.core import native as N
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import read_map_file, write_map_file
from ridgefill_cpp.oracle import load_oracle
from ridgefill_cpp.oracle.fill import (RECENCY_SHARE, attention_scores, default_selector_layer, fill_forward, is_full_attention, piece_texts,
                                      probe_fill_forward, select_attention_protected_rows, select_exact_rows,
                                      select_protected_rows, span_extent)

#: every non-hybrid architecture (the hybrids are in test_prefill_qwen35.py)
DENSE = tuple(a for a in mtm.ARCHS if a not in ("qwen35", "qwen35moe"))
N_TOKENS = 160
TAIL = 16
#: relative tolerance against the oracle (gemma3: 2e-3)
TOL = {a: 2e-3 if a == "gemma3" else 2e-5 for a in DENSE}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def oracles(tiny_models):
    return {arch: load_oracle(tiny_models[arch], dtype=torch.float64) for arch in DENSE}


@pytest.fixture(scope="module")
def prompt(tiny_models) -> list[int]:
    """N_TOKENS tokens of evaluation text (BOS first), tokenized by llama.cpp (shared vocabulary)."""
    return evaluation_tokens(tiny_models["llama"], N_TOKENS)


def _split(arch: str, oracle) -> int:
    return oracle.n_layer // 2


@pytest.fixture(scope="module")
def map_files(tiny_models, oracles, tmp_path_factory):
    """arch -> F32 map file at S = L/2 (fitted on llama.cpp's hidden states of calibration text)."""
    root = tmp_path_factory.mktemp("prefill-maps")
    out = {}
    for arch in DENSE:
        res = fit_ridge_maps(tiny_models[arch], corpus.default_documents("calibration"),
                             FitOptions(n_tokens=4000, ctx=128, split=_split(arch, oracles[arch]), n_threads=1))
        out[arch] = write_map_file(root / f"{arch}.ridgefill.gguf", res.maps, dtype="f32")
    return out


def _has_sinks(oracle) -> bool:
    return any(getattr(layer, "sinks", None) is not None for layer in getattr(oracle, "layers", ()))


def _assert_score_total(oracle, scores, ref_scores, full: float) -> None:
    """Selector scores sum to one unit of probability per head and query row; with attention sinks
    (gpt-oss) the sinks take a share of it, the same share as in the oracle."""
    if _has_sinks(oracle):
        assert 0 < scores.sum() < full
        assert scores.sum() == pytest.approx(ref_scores.sum(), rel=1e-4)
    else:
        assert scores.sum() == pytest.approx(full, rel=1e-4)


# ------------------------------------------------------------------------------------------------
# agreement with the oracle: last-row logits, filled K/V rows, value scales


CASES = [
    # maps, value_rescale, n_prompt, tail, n_ubatch, n_batch (decode calls per eval), exact fraction
    ("ridge", 512, N_TOKENS, TAIL, 64, 256, 0.10),
    ("ridge", 0, N_TOKENS, TAIL, 16, 48, 0.10),
    ("identity", 512, N_TOKENS, TAIL, 64, 40, 0.25),
    ("ridge", 5, 97, 7, 32, 97, 0.0),
    ("identity", 0, 97, 40, 8, 16, 0.05),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("arch", DENSE)
def test_prefill_matches_the_oracle(arch, case, tiny_models, oracles, prompt, map_files):
    kind, c, n, tail, n_ubatch, n_batch, fraction = case
    o = oracles[arch]
    S, L = _split(arch, o), o.n_layer
    tokens = prompt[:n]
    exact = select_exact_rows(attention_scores(o, tokens, default_selector_layer(o, S)), n - tail, fraction)
    maps = read_map_file(map_files[arch]) if kind == "ridge" else None
    ref = fill_forward(o, tokens, split=S, maps=maps, tail=tail, exact_positions=exact, value_rescale=c)

    rf = RidgeFill(map_files[arch] if kind == "ridge" else None, split=S, tail=tail, selector=exact,
                   value_rescale=c, min_prompt=0)
    llm = Llama(str(tiny_models[arch]), ridgefill=rf, **ctx_kwargs(n_ubatch=n_ubatch, n_batch=n_batch))
    try:
        llm.eval(tokens)
        st = llm.ridgefill_stats
        assert st["n_prompt"] == n and st["split"] == S and st["tail"] == tail
        assert st["exact_positions"] == exact and st["n_exact"] == len(exact)
        assert st["n_filled"] == n - tail - len(exact) > 0
        assert st["ceiling"] == pytest.approx(1 / ref.compute_ratio, rel=1e-6)

        tol = TOL[arch]
        assert rel(last_logits(llm), ref.last_logits.numpy()) < tol

        scales = np.array(llm.ridgefill_value_scales())
        assert scales.shape == (L - S, o.n_head_kv)
        np.testing.assert_allclose(scales, ref.value_scales.numpy(), rtol=tol, atol=0)
        if c:
            assert np.abs(scales[1:] - 1).max() > 1e-3  # the scale did something past S

        positions = list(range(n))
        for il in range(L):
            k, v = llm.read_kv(il, positions)
            assert rel(k, ref.keys[il].reshape(n, -1).numpy()) < tol, il
            assert rel(v, ref.values[il].reshape(n, -1).numpy()) < tol, il
    finally:
        llm.close()


@pytest.mark.parametrize("flash_attn", [False, True])
@pytest.mark.parametrize("arch", DENSE)
def test_attention_selector_matches_the_oracle(arch, flash_attn, tiny_models, oracles, prompt):
    o = oracles[arch]
    S = _split(arch, o)
    layer = default_selector_layer(o, S)
    ref_scores = attention_scores(o, prompt, layer).numpy()
    kw = dict(flash_attn=True, type_k=1, type_v=1) if flash_attn else {}  # flash: F16 cache and mask
    llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill.identity(S, tail=TAIL, min_prompt=0),
                **ctx_kwargs(n_ubatch=32, n_batch=64, **kw))
    try:
        llm.eval(prompt)
        st = llm.ridgefill_stats
        assert st["selector_layer"] == layer
        scores = np.array(llm.ridgefill_scores())
        assert scores.shape == (N_TOKENS,)
        # each of the 64 query rows spreads one unit of probability per head (less the sinks' share)
        _assert_score_total(o, scores, ref_scores, o.n_head * 64)
        tol = 2e-3 if flash_attn else TOL[arch]  # an F16 cache rounds K to 11 bits
        np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=tol * ref_scores.max())
        chosen = select_exact_rows(torch.from_numpy(scores), N_TOKENS - TAIL, 0.10)
        assert st["exact_positions"] == chosen and len(chosen) == math.ceil(0.1 * (N_TOKENS - TAIL))
        ref_chosen = select_exact_rows(torch.from_numpy(ref_scores), N_TOKENS - TAIL, 0.10)
        assert len(set(chosen) & set(ref_chosen)) >= len(ref_chosen) - 1  # at most one near-tie swapped
    finally:
        llm.close()


@pytest.mark.parametrize("selector", ["attention", "attention+protected", "probe"])
@pytest.mark.parametrize("arch", DENSE)
def test_selector_spans_through_libllama(arch, selector, tiny_models, oracles, prompt):
    """span= reaches the selector: the exact rows are the oracle's span rule applied to the scores
    libllama measured (the rule itself: test_select_unit.py), whole spans around the top rows."""
    o = oracles[arch]
    S = _split(arch, o)
    span, n_prefix = 8, N_TOKENS - TAIL
    llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill.identity(S, tail=TAIL, min_prompt=0, selector=selector,
                                                                     span=span),
                **ctx_kwargs(n_ubatch=32, n_batch=64))
    try:
        llm.eval(prompt)
        st = llm.ridgefill_stats
        scores = torch.tensor(llm.ridgefill_scores(), dtype=torch.float32)
        recency = 0.0 if selector == "probe" else RECENCY_SHARE  # the attention selectors' recency share
        if selector == "attention+protected":
            texts, control = _vocab(tiny_models[arch])
            want = select_attention_protected_rows(scores, prompt, texts, control, n_prefix, 0.10, span=span)
        else:
            want = select_exact_rows(scores, n_prefix, 0.10, span, recency=recency)
        assert st["exact_positions"] == want and len(want) == math.ceil(0.1 * n_prefix)
        single = select_exact_rows(scores, n_prefix, 0.10, span=1, recency=recency)
        assert want != single  # the span changed the choice
        if selector != "attention+protected":
            top = int(torch.argmax(scores[:n_prefix]))
            before, after = span_extent(span)
            assert set(range(max(0, top - before), min(n_prefix, top + after + 1))) <= set(want)
    finally:
        llm.close()
    with pytest.raises(ValueError, match="span 0 must be >= 1"):
        RidgeFill.identity(S, span=0)


@pytest.mark.parametrize("arch", DENSE)
def test_plan_spanning_several_eval_calls(arch, tiny_models, oracles, prompt, map_files):
    """One plan, the prompt brought by three ``eval`` calls (and several decode calls each)."""
    o = oracles[arch]
    S = _split(arch, o)
    exact = [0, 3, 50, 101]
    ref = fill_forward(o, prompt, split=S, maps=read_map_file(map_files[arch]), tail=TAIL, exact_positions=exact)
    llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill(map_files[arch], tail=TAIL, selector=exact, min_prompt=0),
                **ctx_kwargs(n_batch=32, n_ubatch=16))
    try:
        ctx = llm._ctx.ctx
        assert N.llama_ridgefill_begin(ctx, 0, 0, N_TOKENS) == 1
        pos = (ctypes.c_int32 * len(exact))(*exact)
        assert N.llama_ridgefill_set_exact(ctx, pos, len(exact)) == 0
        for part in (prompt[:70], prompt[70:121], prompt[121:]):
            llama_cpp.Llama.eval(llm, part)
        assert rel(last_logits(llm), ref.last_logits.numpy()) < TOL[arch]
    finally:
        llm.close()


@pytest.mark.parametrize("arch", DENSE)
def test_prefix_reuse_plans_only_the_new_rows(arch, tiny_models, oracles, prompt):
    """A second prompt sharing a prefix with the first: only its new rows are planned (p0 > 0), and
    generation after a RidgeFill prefill runs every layer."""
    o = oracles[arch]
    S = _split(arch, o)
    llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill.identity(S, tail=8, min_prompt=20),
                **ctx_kwargs(n_batch=64, n_ubatch=32))
    try:
        llm.eval(prompt[:100])
        assert llm.ridgefill_stats["pos0"] == 0 and llm.ridgefill_stats["n_prompt"] == 100
        llm.eval(prompt[100:])  # 60 new rows
        st = llm.ridgefill_stats
        assert st["pos0"] == 100 and st["n_prompt"] == N_TOKENS - 100
        assert all(100 <= p < N_TOKENS - 8 for p in st["exact_positions"])
        llm.eval(prompt[:5][:1])  # a generated token: every layer, stats untouched
        assert llm.ridgefill_stats == st
        out = llm.create_completion(prompt[:40] + prompt[:40], max_tokens=4, temperature=0.0)
        assert len(out["choices"][0]["text"]) >= 0 and llm.ridgefill_stats["pos0"] == 40
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# degenerate cases (docs/design.md §4.6)


@pytest.mark.parametrize("arch", DENSE)
def test_degenerate_plans_are_bit_identical_to_stock(arch, tiny_models, oracles, prompt):
    o = oracles[arch]
    assert_degenerate_plans_are_stock(tiny_models[arch], prompt, n_layer=o.n_layer, split=_split(arch, o), tail=TAIL)


@pytest.mark.parametrize("flash_attn", [False, True])
@pytest.mark.parametrize("arch", DENSE)
def test_all_rows_exact_equals_stock(arch, flash_attn, tiny_models, oracles, prompt, map_files):
    """exact_fraction 1.0, value rescale off: the late phase recomputes every late layer exactly."""
    kw = dict(flash_attn=flash_attn, n_ubatch=48)
    if flash_attn:
        kw.update(type_k=1, type_v=1)  # F16 cache, as flash attention uses it
    stock = stock_logits(tiny_models[arch], prompt, **kw)
    rf = RidgeFill(map_files[arch], tail=TAIL, exact_fraction=1.0, value_rescale=0, min_prompt=0)
    llm = Llama(str(tiny_models[arch]), ridgefill=rf, **ctx_kwargs(**kw))
    try:
        llm.eval(prompt)
        assert llm.ridgefill_stats["n_filled"] == 0
        assert rel(last_logits(llm), stock) < 1e-5
    finally:
        llm.close()


@pytest.mark.parametrize("n_batch, n_ubatch, fraction", [(64, 32, 0.25), (256, 256, 0.1)])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3moe"])
def test_plan_accounting_counts_every_graph_and_millisecond(arch, n_batch, n_ubatch, fraction, tiny_models, oracles,
                                                            prompt, map_files):
    """ridgefill_stats' graphs and times_ms: early graphs built for the first ubatch and those holding
    the selector's query rows, reused for the others; late graphs as the schedule of docs/design.md §6
    has them (several chunks of exact rows: ceil(|X| / n_ubatch) per late layer; one chunk: one graph
    for all late layers), none reused; the late phase split into its parts with `other` the rest."""
    o = oracles[arch]
    S, L = _split(arch, o), o.n_layer
    llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill(map_files[arch], tail=TAIL, exact_fraction=fraction,
                                                            min_prompt=0),
                **ctx_kwargs(n_batch=n_batch, n_ubatch=n_ubatch))
    try:
        llm.eval(prompt)
        st = llm.ridgefill_stats
        calls = [min(n_batch, N_TOKENS - i) for i in range(0, N_TOKENS, n_batch)]  # Llama.eval's decode calls
        built, reused = early_graph_counts(calls, n_ubatch, N_TOKENS, n_sel_queries=64)
        late = late_graph_count(recurrent=[False] * L, split=S, n_prompt=N_TOKENS, tail=TAIL,
                                exact=st["exact_positions"], n_ubatch=n_ubatch)
        assert st["graphs"] == {"early_built": built, "early_reused": reused, "late_built": late, "late_reused": 0}
        n_x = st["tail"] + st["n_exact"]
        assert late == ((L - S) * math.ceil(n_x / n_ubatch) if n_x > n_ubatch else 1)
        assert (built, reused) == ((3, 2) if n_ubatch == 32 else (1, 0))  # 5 ubatches, the last 2 hold query rows
        t = st["times_ms"]
        assert set(t) == {"early", "late", "build", "alloc", "set_input", "compute", "wait", "other"}
        assert all(v >= 0 for v in t.values()), t
        parts = t["build"] + t["alloc"] + t["set_input"] + t["compute"] + t["wait"] + t["other"]
        assert parts == pytest.approx(t["late"], abs=1e-6) and t["late"] == st["late_ms"]
        assert t["early"] + t["late"] <= st["prefill_ms"]
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_early_graphs_reused_without_the_selector(arch, tiny_models, oracles, prompt, map_files):
    """Selector none: every early ubatch of the same size reuses the first one's graph (the last,
    shorter ubatch of a call builds its own), and the plan's logits are those of the attention-free
    plan with graph reuse off."""
    o = oracles[arch]
    rf = RidgeFill(map_files[arch], tail=TAIL, selector="none", min_prompt=0)
    llm = Llama(str(tiny_models[arch]), ridgefill=rf, **ctx_kwargs(n_batch=64, n_ubatch=16))
    try:
        llm.eval(prompt)  # calls of 64, 64, 32 rows: ubatches of 16 rows
        assert llm.ridgefill_stats["graphs"]["early_built"] == 1
        assert llm.ridgefill_stats["graphs"]["early_reused"] == N_TOKENS // 16 - 1
        assert llm.ridgefill_stats["n_filled"] > 0 and o.n_layer > _split(arch, o)
    finally:
        llm.close()


@pytest.mark.parametrize("steps", [1, 2])
def test_early_graphs_reused_while_the_cells_fill(steps, tiny_models, oracles, map_files, monkeypatch):
    """A prompt of 600 rows: stock prefill's KV extent grows with the cells used (padded to 256), so
    its ubatches change shape and rebuild; LLAMA_RIDGEFILL_EARLY_GRAPHS=k lets the early phase's
    extent grow in k steps instead, and its ubatches reuse k graphs. The logits stay those of the
    growing extent (the mask hides the cells not written yet)."""
    arch = "llama"
    tokens = evaluation_tokens(tiny_models[arch], 600)
    rf = RidgeFill(map_files[arch], tail=TAIL, min_prompt=0)
    kw = ctx_kwargs(n_ctx=1024, n_batch=256, n_ubatch=64)
    out = {}
    for k in (0, steps):
        monkeypatch.setenv("LLAMA_RIDGEFILL_EARLY_GRAPHS", str(k))
        llm = Llama(str(tiny_models[arch]), ridgefill=rf, **kw)
        try:
            llm.eval(tokens)  # calls of 256, 256, 88 rows; the selector's query rows are 536..599
            out[k] = (llm.ridgefill_stats["graphs"], last_logits(llm))
        finally:
            llm.close()
    # 8 ubatches of 64 rows before the query rows, then 2 holding them (64 and 24 rows). Extents: the
    # cells used after the ubatch, padded to 256 (stock), rounded up to a step of the plan's extent
    # (768 cells: 600 rows padded) cut in k
    pad = lambda n, m: -(-n // m) * m  # noqa: E731
    stock = [pad(64 * (i + 1), 256) for i in range(8)]
    step = pad(-(-768 // steps), 256)
    extents = [min(768, pad(e, step)) for e in stock]
    assert out[0][0]["early_built"] == len(set(stock)) + 2 == 4 and out[0][0]["early_reused"] == 6
    assert out[steps][0]["early_built"] == len(set(extents)) + 2 and out[steps][0]["early_reused"] == 8 - len(set(extents))
    assert len(set(extents)) == 1
    assert rel(out[steps][1], out[0][1]) < 1e-5


def _reuse_scenario(path, rf, prompt) -> tuple[list[np.ndarray], list[dict]]:
    """Stock prompt rows, then a plan whose first early ubatch has the shape of the stock graph before
    it, then generated rows (stock graphs after early ones): the logits of each step and the plan's
    graph counts."""
    llm = Llama(str(path), ridgefill=rf, **ctx_kwargs(n_batch=64, n_ubatch=32))
    try:
        out, graphs = [], []
        llm.eval(prompt[:64])  # 64 rows < min_prompt: stock, two ubatches of 32 (the second reuses the first)
        assert llm.ridgefill_stats == {}
        out.append(last_logits(llm))
        llm.eval(prompt[64:])  # 96 new rows: a plan; its first ubatch has 32 rows
        assert llm.ridgefill_stats["n_filled"] > 0
        graphs.append(llm.ridgefill_stats["graphs"])
        out.append(last_logits(llm))
        for tok in prompt[:3]:  # generated rows: stock one-row graphs
            llm.eval([tok])
            out.append(last_logits(llm))
        return out, graphs
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_reuse_never_crosses_phases(arch, tiny_models, prompt, map_files, monkeypatch):
    """Reuse on and off give bit-identical logits for stock rows, a plan and generated rows in one
    context: a stock graph is never reused for an early-phase ubatch of the same shape, nor an early
    graph for a stock ubatch."""
    rf = RidgeFill(map_files[arch], tail=TAIL, selector="none", min_prompt=65)
    on, graphs_on = _reuse_scenario(tiny_models[arch], rf, prompt)
    monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")
    off, graphs_off = _reuse_scenario(tiny_models[arch], rf, prompt)
    assert graphs_on[0]["early_built"] == 1 and graphs_on[0]["early_reused"] == 2  # 32, 32 | 32: the first built
    assert graphs_off[0]["early_reused"] == 0 and graphs_off[0]["early_built"] == 3
    for a, b in zip(on, off):
        assert np.array_equal(a, b)


def _fused_with_separate_biases(tmp_path) -> tuple[Path, Path]:
    """Two tiny qwen2 models with the same weights: separate Q/K/V projections and biases, and one
    fused attn_qkv weight with the separate attn_q/k/v biases (a layout llama.cpp's build_qkv
    accepts: it adds the concatenated biases to the fused product)."""
    import gguf

    from ridgefill_cpp.maps.gguf_copy import copy_gguf

    separate = mtm.make_tiny_model("qwen2", tmp_path / "separate.gguf", seed=3, qkv_bias=True)
    fused = mtm.make_tiny_model("qwen2", tmp_path / "fused.gguf", seed=3, qkv_bias=True, fused_qkv=True)
    biases = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(separate).tensors if t.name.endswith("_q.bias")
              or t.name.endswith("_k.bias") or t.name.endswith("_v.bias")}
    assert biases
    out = tmp_path / "fused-separate-biases.gguf"
    # the fused bias has the same values as the three separate ones
    copy_gguf(fused, out, keep=lambda name: not name.endswith("attn_qkv.bias"), extra_tensors=biases)
    return separate, out


def test_fused_qkv_with_separate_biases_fills_as_the_separate_layout(tmp_path, prompt):
    """The fill's K/V path adds separate biases to a fused QKV projection as build_qkv does: the
    same plan on the two layouts gives the same logits, filled K/V rows and value scales."""
    separate, fused = _fused_with_separate_biases(tmp_path)
    assert rel(stock_logits(fused, prompt), stock_logits(separate, prompt)) < 1e-5  # llama.cpp: one model
    rf = RidgeFill.identity(3, tail=TAIL, exact_fraction=0.1, min_prompt=0)
    out = []
    for path in (separate, fused):
        llm = Llama(str(path), ridgefill=rf, **ctx_kwargs())
        try:
            llm.eval(prompt)
            assert llm.ridgefill_stats["n_filled"] > 0
            kv = [llm.read_kv(il, list(range(len(prompt)))) for il in range(3, 6)]
            out.append((last_logits(llm), kv, np.array(llm.ridgefill_value_scales())))
        finally:
            llm.close()
    (la, kva, sa), (lb, kvb, sb) = out
    assert rel(lb, la) < 1e-5
    for (ka, va), (kb, vb) in zip(kva, kvb):
        assert rel(kb, ka) < 1e-5 and rel(vb, va) < 1e-5
    np.testing.assert_allclose(sb, sa, rtol=1e-5)


def test_stock_class_is_untouched(tiny_models, prompt):
    """ridgefill=None is llama-cpp-python's class: same logits and no RidgeFill attached."""
    path = str(tiny_models["llama"])
    a = llama_cpp.Llama(path, **ctx_kwargs())
    b = Llama(path, **ctx_kwargs())
    try:
        a.eval(prompt)
        b.eval(prompt)
        assert np.array_equal(last_logits(a), last_logits(b))
        assert b.ridgefill is None and b.ridgefill_stats == {}
        assert N.llama_ridgefill_begin(b._ctx.ctx, 0, 0, 10) == -1
        assert "no RidgeFill attached" in N.llama_ridgefill_last_error().decode()
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------------------------
# bad input: a clear error, and the context stays usable


def _usable(llm, path, tokens) -> None:
    """After an error: a fresh prompt on the same object gives stock logits (RidgeFill off for it)."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    expect = stock_logits(path, tokens)
    llama_cpp.Llama.eval(llm, tokens)  # stock decode calls (no plan)
    assert np.array_equal(last_logits(llm), expect)


def test_refusals_at_construction(tiny_models, map_files, prompt, tmp_path):
    llama, qwen3 = tiny_models["llama"], tiny_models["qwen3"]
    with pytest.raises(ValueError, match=r"split 9 outside 1\.\.6"):
        Llama(str(llama), ridgefill=RidgeFill.identity(9), **ctx_kwargs())
    with pytest.raises(ValueError, match="split 0 must be >= 1"):
        RidgeFill.identity(0)
    with pytest.raises(ValueError, match="at least the last prompt row must be exact"):
        RidgeFill(map_files["llama"], tail=0)
    with pytest.raises(ValueError, match=r"exact_fraction 1\.5 outside \[0, 1\]"):
        RidgeFill(map_files["llama"], exact_fraction=1.5)
    with pytest.raises(ValueError, match="selector 'probing'"):
        RidgeFill(map_files["llama"], selector="probing")
    with pytest.raises(ValueError, match="the maps were fitted for split 3, not the requested split 2"):
        Llama(str(llama), ridgefill=RidgeFill(map_files["llama"], split=2), **ctx_kwargs())
    with pytest.raises(ValueError, match="logits_all=True is not supported"):
        Llama(str(llama), ridgefill=map_files["llama"], logits_all=True, **ctx_kwargs())
    # maps of another model: the loader names what does not match
    from ridgefill_cpp.maps.mapfile import MapFileError
    with pytest.raises(MapFileError, match="architecture"):
        Llama(str(qwen3), ridgefill=map_files["llama"], **ctx_kwargs())
    other = mtm.make_tiny_model("llama", tmp_path / "other-seed.gguf", seed=1)
    with pytest.raises(MapFileError, match="another checkpoint"):
        Llama(str(other), ridgefill=map_files["llama"], **ctx_kwargs())
    # gemma3 with a sliding-window cache smaller than the context works (tests/test_window.py)
    Llama(str(tiny_models["gemma3"]), ridgefill=RidgeFill.identity(4), swa_full=False, **ctx_kwargs(n_ctx=1024)).close()


def test_refusals_during_prefill(tiny_models, map_files, prompt):
    path = tiny_models["llama"]
    llm = Llama(str(path), ridgefill=RidgeFill(map_files["llama"], tail=TAIL, min_prompt=0, selector=[5, 150]),
                **ctx_kwargs())
    try:
        # an explicit exact position in the tail
        with pytest.raises(ValueError, match=r"exact position 150 outside the prompt's prefix \[0, 144\)"):
            llm.eval(prompt)
        _usable(llm, path, prompt[:50])

        # a prompt longer than the context: llama.cpp's own check, nothing planned
        ctx = llm._ctx.ctx
        # prompts that run stock prefill say why (llama_ridgefill_stock_reason); a plan or an error clears it
        llm.reset()
        llm._ctx.kv_cache_clear()
        assert N.llama_ridgefill_begin(ctx, 0, 0, TAIL) == 0
        assert N.llama_ridgefill_stock_reason(ctx).decode() == f"{TAIL} new prompt rows, no more than the tail ({TAIL})"
        assert N.llama_ridgefill_begin(ctx, 0, 0, 300) == -1
        assert N.llama_ridgefill_stock_reason(ctx).decode() == ""
        assert "more than the context size 256" in N.llama_ridgefill_last_error().decode()
        # a batch with rows outside the plan: decode fails, the plan is dropped, its rows removed
        llm.reset()
        llm._ctx.kv_cache_clear()
        assert N.llama_ridgefill_begin(ctx, 0, 0, 100) == 1
        assert N.llama_ridgefill_begin(ctx, 0, 0, 100) == -1
        assert "a planned prompt is in progress" in N.llama_ridgefill_last_error().decode()
        with pytest.raises(RuntimeError):
            llama_cpp.Llama.eval(llm, prompt[:120])
        assert "outside the planned prompt [0, 100)" in N.llama_ridgefill_last_error().decode()
        _usable(llm, path, prompt[:60])
        # cancel: the planned rows are removed, the next prompt is unaffected
        llm.reset()
        llm._ctx.kv_cache_clear()
        assert N.llama_ridgefill_begin(ctx, 0, 0, 100) == 1
        llama_cpp.Llama.eval(llm, prompt[:40])
        N.llama_ridgefill_cancel(ctx)
        _usable(llm, path, prompt[:70])
    finally:
        llm.close()


def test_detach_and_close(tiny_models, map_files, prompt):
    llm = Llama(str(tiny_models["llama"]), ridgefill=map_files["llama"], **ctx_kwargs())
    assert llm.ridgefill.maps == map_files["llama"] and llm.ridgefill.min_prompt == 1024
    llm.eval(prompt)  # shorter than min_prompt: stock
    assert llm.ridgefill_stats == {}
    llm.close()
    llm.close()
    assert ridgefill_cpp.Llama is Llama


def _run_python(code: str, timeout: float = 120):
    """``code`` in a fresh interpreter with this package importable: a crash or a hang fails the
    test instead of the suite."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(ridgefill_cpp.__file__).resolve().parent.parent))
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=timeout, capture_output=True, text=True)


def test_use_after_close_raises_instead_of_crashing(tiny_models, map_files):
    """After close(), prefill, eval, tokenize, __call__, set_ridgefill and the rest of the methods
    that need the model raise ValueError (before: SIGSEGV; set_ridgefill said "model and path are
    required"), with and without RidgeFill."""
    calls = ["prefill([1, 2, 3])", "eval([1, 2, 3])", "tokenize(b'hello')", "detokenize([1, 2])", "__call__('hi', max_tokens=1)",
             "create_completion('hi', max_tokens=1)", "set_ridgefill(None)", f"set_ridgefill({str(map_files['llama'])!r})",
             "n_vocab()", "token_bos()", "save_state()", "read_kv(1, [0])", "layer_devices()",
             "create_chat_completion([{'role': 'user', 'content': 'hi'}], max_tokens=1)"]
    code = ("import ridgefill_cpp\nfrom ridgefill_cpp import Llama, RidgeFill\n"
            f"for rf in (None, RidgeFill.identity(split=3, min_prompt=8, tail=4)):\n"
            f"    llm = Llama({str(tiny_models['llama'])!r}, n_ctx=256, verbose=False, ridgefill=rf)\n"
            "    llm.close(); llm.close()\n"
            "    assert llm.closed\n"
            f"    for call in {calls!r}:\n"
            "        try:\n            eval('llm.' + call)\n            print('accepted', call)\n"
            "        except ValueError as e:\n            print(e)\n")
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 * len(calls), lines
    for line, call in zip(lines, calls * 2):
        name = call.split("(")[0]
        assert line == f"Llama.{name}: this Llama is closed (close() freed its model and context); create a new one", (call, line)


def test_a_model_path_that_is_not_a_regular_file_is_refused(tiny_models, tmp_path):
    """Llama(FIFO) blocked forever in llama.cpp's loader without RidgeFill (with it, the map file's
    checks came first); now a FIFO or a directory is refused by name at once, with or without."""
    import os

    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    code = ("import ridgefill_cpp\nfrom ridgefill_cpp import Llama, RidgeFill\n"
            f"for path in ({str(fifo)!r}, {str(tmp_path)!r}):\n"
            "    for rf in (None, RidgeFill.identity(split=3)):\n"
            "        try:\n            Llama(path, verbose=False, ridgefill=rf)\n            print('accepted')\n"
            "        except ValueError as e:\n            print(e)\n")
    proc = _run_python(code, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [f"{fifo}: the model file is a FIFO, not a regular file"] * 2 + \
        [f"{tmp_path}: the model file is a directory, not a regular file"] * 2


def test_an_empty_prompt_is_a_clear_error(tiny_models, tmp_path):
    """llm("") on a model that adds no BOS token (SmolLM2's tokenizer) gave llama-cpp-python's bare
    AssertionError."""
    from ridgefill_cpp.maps.gguf_copy import copy_gguf

    no_bos = copy_gguf(tiny_models["llama"], tmp_path / "no-bos.gguf", metadata={"tokenizer.ggml.add_bos_token": False})
    for rf in (None, RidgeFill.identity(split=3)):
        llm = Llama(str(no_bos), ridgefill=rf, **ctx_kwargs())
        try:
            assert llm.tokenize(b"", add_bos=True) == []
            with pytest.raises(ValueError, match="the prompt has no tokens"):
                llm("", max_tokens=2)
            assert llm("hello", max_tokens=2)["choices"][0]["text"] is not None  # still usable
        finally:
            llm.close()


def test_backend_sampling_and_embeddings_make_the_plan_step_aside(tiny_models, prompt):
    """Outputs computed inside the graph of a prompt's last ubatch - a backend sampler on the
    sequence (llama_set_sampler), embeddings switched on after attaching - would read the early
    phase's rows before the late layers ran. libllama then runs the prompt stock (no plan, a log
    line), so the backend sampler picks stock's greedy token; without them the prompt is planned."""
    rf = RidgeFill.identity(split=3, tail=16, min_prompt=64, exact_fraction=0.1)
    want = int(np.argmax(stock_logits(tiny_models["llama"], prompt)))
    llm = Llama(str(tiny_models["llama"]), ridgefill=rf, **ctx_kwargs())
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    try:
        assert llama_cpp.llama_set_sampler(llm._ctx.ctx, 0, chain)
        with captured_log() as log:
            llm.prefill(prompt)
        assert llm.ridgefill_stats == {}
        assert any("samples on the backend (llama_set_sampler)" in line for line in log), log
        assert llama_cpp.llama_get_sampled_token_ith(llm._ctx.ctx, -1) == want
        llama_cpp.llama_set_sampler(llm._ctx.ctx, 0, None)

        llm.reset()
        llama_cpp.llama_set_embeddings(llm._ctx.ctx, True)
        with captured_log() as log:
            llm.prefill(prompt)
        assert llm.ridgefill_stats == {} and any("computes embeddings" in line for line in log), log
        llama_cpp.llama_set_embeddings(llm._ctx.ctx, False)

        llm.reset()
        llm.prefill(prompt)
        assert llm.ridgefill_stats["n_filled"] > 0  # planned again
    finally:
        llm.close()
        llama_cpp.llama_sampler_free(chain)


@pytest.mark.parametrize("arch", DENSE)
def test_graph_reuse_never_crosses_phases(arch, tiny_models, oracles, prompt, map_files, monkeypatch):
    """Stock decode graphs after a RidgeFill prefill (and RidgeFill graphs after stock ones) are
    built afresh: the same logits with llama.cpp's graph reuse on and off."""
    from ridgefill_cpp.quality.bench import greedy_continuation, last_logits

    def run() -> tuple[list[int], np.ndarray]:
        llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill(map_files[arch], tail=TAIL, min_prompt=100),
                    **ctx_kwargs(n_ubatch=32, n_batch=64))
        try:
            llm.eval(prompt[:60])  # stock (below min_prompt)
            greedy_continuation(llm, last_logits(llm), 3)
            llm.reset()
            llm.eval(prompt)  # RidgeFill
            assert llm.ridgefill_stats
            toks = greedy_continuation(llm, last_logits(llm), 6)
            return toks, last_logits(llm)
        finally:
            llm.close()

    a = run()
    monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")
    b = run()
    assert a[0] == b[0] and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])  # (the tiny llama has a V bias)
def test_value_scale_of_a_vanishing_prediction_is_one(arch, tiny_models, oracles, prompt, map_files, tmp_path):
    """Maps that predict 0: the predicted V of a head without V bias vanishes, its scale is 1 (not
    inf or NaN) and the filled V rows are 0, as in the oracle."""
    from dataclasses import replace

    o = oracles[arch]
    S = _split(arch, o)
    m = read_map_file(map_files[arch])
    zero = replace(m, a={il: np.zeros_like(a) for il, a in m.a.items()}, b={il: np.zeros_like(b) for il, b in m.b.items()})
    path = write_map_file(tmp_path / "zero.gguf", zero, dtype="f32")
    ref = fill_forward(o, prompt, split=S, maps=read_map_file(path), tail=TAIL, exact_positions=[3, 7])
    llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill(path, tail=TAIL, selector=[3, 7], min_prompt=0), **ctx_kwargs())
    try:
        llm.eval(prompt)
        scales = np.array(llm.ridgefill_value_scales())
        assert np.all(np.isfinite(scales)) and np.array_equal(scales[1:], np.ones_like(scales[1:]))
        np.testing.assert_allclose(scales, ref.value_scales.numpy(), rtol=TOL[arch])
        assert rel(last_logits(llm), ref.last_logits.numpy()) < TOL[arch]
        _, v = llm.read_kv(S + 1, [10, 20])
        assert not v.any()
    finally:
        llm.close()


@pytest.mark.parametrize("arch", DENSE)
def test_logits_of_every_tail_row(arch, tiny_models, oracles, prompt, map_files):
    """Tail rows that ask for logits in the call that ends the prompt get them (docs/design.md §4.5); a
    planned row before the tail, or a tail row of an earlier call, gets NaN."""
    o = oracles[arch]
    S = _split(arch, o)
    exact = [2, 40, 90]
    ref = fill_forward(o, prompt, split=S, maps=read_map_file(map_files[arch]), tail=TAIL, exact_positions=exact,
                       tail_logits=True)
    llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill(map_files[arch], tail=TAIL, selector=exact, min_prompt=0),
                **ctx_kwargs(n_batch=128, n_ubatch=32))
    try:
        ctx = llm._ctx.ctx
        assert N.llama_ridgefill_begin(ctx, 0, 0, N_TOKENS) == 1
        N.llama_ridgefill_set_exact(ctx, (ctypes.c_int32 * 3)(*exact), 3)
        split = N_TOKENS - TAIL - 4  # the last call brings 4 prefix rows and the whole tail
        llama_cpp.Llama.eval(llm, prompt[:split])
        llm._batch.set_batch(batch=prompt[split:], n_past=split, logits_all=True)
        llm._ctx.decode(llm._batch)
        n_vocab = llm.n_vocab()
        rows = [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                for i in range(N_TOKENS - split)]
        assert all(np.isnan(r).all() for r in rows[:4])
        got = np.stack(rows[4:])
        assert rel(got, ref.logits.numpy()) < TOL[arch]
    finally:
        llm.close()


@pytest.mark.parametrize("arch", DENSE)
def test_compute_buffers_are_reserved_for_both_phases(arch, tiny_models, oracles, prompt, map_files):
    """Attaching reserves the scheduler's buffers for the early phase (with the selector) and the
    late phase (a chunk of exact rows, fill steps): a prefill never grows them, so llama.cpp's own
    check at context teardown finds the expected sizes."""
    with captured_log() as logs:
        llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill(map_files[arch], tail=TAIL, min_prompt=0),
                    **ctx_kwargs(n_batch=256, n_ubatch=64))
        llm.eval(prompt)
        assert llm.ridgefill_stats["n_filled"] > 64  # several fill steps
        # a setting that makes llama.cpp rebuild its scheduler (toggling a layer-input capture): the
        # new scheduler gets the RidgeFill reservation too
        N.llama_ridgefill_capture_layer_input(llm._ctx.ctx, 1, True)
        llm.reset()
        # (a capture needs every layer of every row: a planned prompt is refused while it is on)
        with pytest.raises(RuntimeError, match="layer-input capture is enabled"):
            llm.eval(prompt)
        llm.eval(prompt[:8])  # a short prompt runs stock, rebuilding the scheduler
        N.llama_ridgefill_capture_layer_input(llm._ctx.ctx, 1, False)
        llm.reset()
        llm.eval(prompt)
        assert llm.ridgefill_stats["n_filled"] > 64
        llm.close()
    text = "".join(logs)
    assert "RidgeFill attached" in text and "compute buffer size" in text
    assert "does not match expectation" not in text


def test_llama_cpp_python_surface_keeps_working(tiny_models, map_files, prompt):
    """Completion, chat, streaming, generate, save/load state and reset on a RidgeFill Llama."""
    path = str(tiny_models["llama"])
    llm = Llama(path, ridgefill=RidgeFill(map_files["llama"], tail=8, min_prompt=64), **ctx_kwargs(n_ctx=512))
    stock = Llama(path, **ctx_kwargs(n_ctx=512))
    try:
        text = llm.detokenize(prompt[1:120]).decode(errors="replace")
        out = llm.create_completion(text, max_tokens=5, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1 and llm.ridgefill_stats["n_prompt"] >= 64
        assert llm.ridgefill_stats["n_filled"] > 0
        chunks = list(llm(text + " more", max_tokens=4, temperature=0.0, stream=True))
        assert chunks and "text" in chunks[0]["choices"][0]
        chat = llm.create_chat_completion([{"role": "user", "content": text}], max_tokens=3, temperature=0.0)
        assert chat["choices"][0]["message"]["role"] == "assistant"

        # generate: the first token comes from the RidgeFill prefill, later ones from exact decoding
        llm.reset()
        gen = llm.generate(prompt[:100], temp=0.0)
        toks = [next(gen) for _ in range(3)]
        assert llm.ridgefill_stats["n_prompt"] == 100 and len(toks) == 3

        # save / load state round-trips the (partly filled) cache
        llm.reset()
        llm.eval(prompt[:100])
        state = llm.save_state()
        a = last_logits(llm)
        llm.reset()
        llm.eval(prompt[100:140])  # something else in between
        llm.load_state(state)
        llm.eval(prompt[100:101])
        b = last_logits(llm)
        llm.load_state(state)
        llm.eval(prompt[100:101])
        assert np.array_equal(b, last_logits(llm)) and a.shape == b.shape

        # short prompts stay stock: identical to llama-cpp-python
        llm.reset()
        stock.reset()
        llm.eval(prompt[:40])
        stock.eval(prompt[:40])
        assert llm.ridgefill_stats == {} and np.array_equal(last_logits(llm), last_logits(stock))
    finally:
        llm.close()
        stock.close()


@pytest.mark.parametrize("arch", DENSE)
def test_splice_keeps_the_exact_k_or_v_of_filled_rows(arch, tiny_models, oracles, prompt, map_files):
    """The splice test's mechanism: after an exact prefill, the cells forgotten but their data kept,
    a RidgeFill prefill with splice K (V) leaves the filled rows' exact K (V) in place; with both,
    the exact rows see the exact cache everywhere and the logits are stock's."""
    from ridgefill_cpp.quality.evaluate import EvalOptions, open_context, timed_prefill

    o = oracles[arch]
    S = _split(arch, o)
    opts = EvalOptions(tail=TAIL, n_threads=1, n_batch=64)
    llm = open_context(tiny_models[arch], 256, opts.n_batch, opts.n_threads, opts.ridgefill(map_files[arch], S))
    try:
        positions = list(range(N_TOKENS))
        stock, _ = timed_prefill(llm, None, prompt, 1)
        exact_kv = {il: llm.read_kv(il, positions) for il in range(S, o.n_layer)}
        for mode in (1, 2, 3):
            timed_prefill(llm, None, prompt, 1)
            llm.forget_cells()
            rf = opts.ridgefill(map_files[arch], S, splice={1: "K", 2: "V", 3: "KV"}[mode])
            logits, _ = timed_prefill(llm, rf, prompt, 1)
            st = N.llama_ridgefill_stats()
            N.llama_ridgefill_get_stats(llm._ctx.ctx, ctypes.byref(st))
            assert st.active and st.n_filled > 0
            exact = set(llm.ridgefill_stats.get("exact_positions", []))
            n_ex = N.llama_ridgefill_get_exact(llm._ctx.ctx, None, 0)
            buf = (ctypes.c_int32 * n_ex)()
            N.llama_ridgefill_get_exact(llm._ctx.ctx, buf, n_ex)
            filled = [p for p in range(N_TOKENS - TAIL) if p not in set(buf[:n_ex]) | exact]
            for il in range(S + 1, o.n_layer):
                k, v = llm.read_kv(il, filled)
                ek, ev = exact_kv[il][0][filled], exact_kv[il][1][filled]
                assert np.array_equal(k, ek) == bool(mode & 1), (mode, il)
                assert np.array_equal(v, ev) == bool(mode & 2), (mode, il)
            if mode == 3:
                assert rel(logits[-1], stock[-1]) < 1e-3
    finally:
        llm.close()


@pytest.mark.slow
def test_quantized_kv_cache_on_a_real_model(smollm2_path):
    """A Q8_0 K/V cache (flash attention; llama.cpp rotates quantized K/V): all rows exact is
    bit-identical to stock, and the filled rows' K/V land where the F16-cache run puts them: the
    Q8_0 and F16 fills differ by about what the Q8_0 cache costs stock prefill (its noise floor).
    Measured on SmolLM2 (1,200 tokens, S = 20): floor 0.005, fills 0.007; filled K left unrotated
    gives 2.7, filled V left unrotated 0.13, so the bound of 4x the floor separates them on any
    CPU (the fill-vs-stock KL of 0.03 that an earlier bound leaned on varies with the kernels)."""
    from ridgefill_cpp.quality.bench import kl_divergence, prompt_tokens

    def run(rf, cache_type):
        llm = Llama(str(smollm2_path), ridgefill=rf, n_ctx=1280, n_batch=512, n_ubatch=512, verbose=False,
                    flash_attn=True, type_k=cache_type, type_v=cache_type, n_threads=2)
        try:
            llm.eval(prompt_tokens(llm, 1200))
            return last_logits(llm), llm.ridgefill_stats
        finally:
            llm.close()

    q8, f16 = 8, 1
    stock, _ = run(None, q8)
    stock_f16, _ = run(None, f16)
    exact, st = run(RidgeFill.identity(20, exact_fraction=1.0, value_rescale=0, min_prompt=0), q8)
    assert st["n_filled"] == 0 and np.array_equal(exact, stock)
    fill_q8, st = run(RidgeFill.identity(20, min_prompt=0), q8)
    fill_f16, _ = run(RidgeFill.identity(20, min_prompt=0), f16)
    assert st["n_filled"] > 900
    floor = kl_divergence(stock_f16, stock)
    assert 0 < floor and kl_divergence(fill_f16, fill_q8) < 4 * floor


@pytest.mark.parametrize("arch", DENSE)
def test_key_rescale_matches_the_oracle(arch, tiny_models, oracles, prompt, map_files):
    """The key scale (issue #8): measured like the value scale on the first min(c_K, T) tail rows,
    applied to the filled K; logits, K rows and the scales as the oracle has them."""
    o = oracles[arch]
    S = _split(arch, o)
    exact = [4, 33, 77]
    ref = fill_forward(o, prompt, split=S, maps=read_map_file(map_files[arch]), tail=TAIL, exact_positions=exact,
                       value_rescale=512, key_rescale=8)
    llm = Llama(str(tiny_models[arch]), ridgefill=RidgeFill(map_files[arch], tail=TAIL, selector=exact, key_rescale=8,
                                                          min_prompt=0), **ctx_kwargs(n_ubatch=32))
    try:
        llm.eval(prompt)
        assert rel(last_logits(llm), ref.last_logits.numpy()) < TOL[arch]
        ks = np.array(llm.ridgefill_key_scales())
        np.testing.assert_allclose(ks, ref.key_scales.numpy(), rtol=TOL[arch])
        assert np.abs(ks[1:] - 1).max() > 1e-3
        for il in range(S, o.n_layer):
            k, _ = llm.read_kv(il, list(range(N_TOKENS)))
            assert rel(k, ref.keys[il].reshape(N_TOKENS, -1).numpy()) < TOL[arch]
        with pytest.raises(ValueError, match="key_rescale -1 must be >= 0"):
            RidgeFill(map_files[arch], key_rescale=-1)
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# issue #8: the probe and protected selectors, map placement


@pytest.mark.parametrize("n_ubatch", [8, 64])
@pytest.mark.parametrize("arch", DENSE)
def test_probe_selector_matches_the_oracle(arch, n_ubatch, tiny_models, oracles, prompt, map_files):
    """Probe pass (all prefix rows filled, the tail scores them at every full-attention late layer),
    then the selected rows and the tail again: scores, selection, logits, K/V rows, value scales
    and the ceiling (T probe rows counted) as the oracle's probe_fill_forward."""
    o = oracles[arch]
    S, L = _split(arch, o), o.n_layer
    maps = read_map_file(map_files[arch])
    ref = probe_fill_forward(o, prompt, split=S, maps=maps, tail=TAIL, fraction=0.10, n_queries=64)
    rf = RidgeFill(map_files[arch], tail=TAIL, selector="probe", min_prompt=0)
    llm = Llama(str(tiny_models[arch]), ridgefill=rf, **ctx_kwargs(n_ubatch=n_ubatch, n_batch=64))
    try:
        llm.eval(prompt)
        st = llm.ridgefill_stats
        tol = TOL[arch]
        scores = np.array(llm.ridgefill_scores())
        ref_scores = ref.probe_scores.numpy()
        # min(64, T) query rows at each full-attention late layer, one unit of probability per head
        n_full = sum(1 for il in range(S, L) if is_full_attention(o, il))
        _assert_score_total(o, scores, ref_scores, o.n_head * TAIL * n_full)
        np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=tol * ref_scores.max())
        want = ref.exact_rows.numpy()[:-TAIL].tolist()
        assert st["exact_positions"] == want and len(want) == math.ceil(0.1 * (N_TOKENS - TAIL))
        assert st["probe_rows"] == TAIL and st["selector_layer"] == S
        assert st["ceiling"] == pytest.approx(1 / ref.compute_ratio, rel=1e-6)
        assert rel(last_logits(llm), ref.last_logits.numpy()) < tol
        np.testing.assert_allclose(np.array(llm.ridgefill_value_scales()), ref.value_scales.numpy(), rtol=tol)
        for il in range(S, L):
            k, v = llm.read_kv(il, list(range(N_TOKENS)))
            assert rel(k, ref.keys[il].reshape(N_TOKENS, -1).numpy()) < tol, il
            assert rel(v, ref.values[il].reshape(N_TOKENS, -1).numpy()) < tol, il
    finally:
        llm.close()


def test_probe_without_selected_rows_is_the_probe_pass(tiny_models, oracles, prompt, map_files):
    """exact_fraction 0: no rows to select, the probe pass alone (its tail logits) is the result."""
    o = oracles["llama"]
    S = _split("llama", o)
    maps = read_map_file(map_files["llama"])
    ref = fill_forward(o, prompt, split=S, maps=maps, tail=TAIL)
    llm = Llama(str(tiny_models["llama"]), ridgefill=RidgeFill(map_files["llama"], tail=TAIL, selector="probe",
                                                                exact_fraction=0.0, min_prompt=0), **ctx_kwargs())
    try:
        llm.eval(prompt)
        st = llm.ridgefill_stats
        assert st["n_exact"] == 0 and st["probe_rows"] == 0
        assert st["ceiling"] == pytest.approx(1 / ref.compute_ratio, rel=1e-6)
        assert rel(last_logits(llm), ref.last_logits.numpy()) < TOL["llama"]
    finally:
        llm.close()


def _vocab(path):
    from ridgefill_cpp.core.gguf_model import read_metadata

    md = read_metadata(path, skip_arrays_longer_than=10**7)
    texts = piece_texts(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.model"])
    control = [t == 3 for t in md["tokenizer.ggml.token_type"]]
    return texts, control


@pytest.mark.parametrize("classes", [("digits",), ("rare",), ("line_start",), ("digits", "rare"),
                                     ("digits", "rare", "line_start"), ("sink",), ("sink", "digits")])
def test_protected_selector_matches_the_oracle(classes, tiny_models, oracles, prompt, map_files):
    """The protected rows (token classes from the GGUF vocabulary, capped at the exact fraction)
    are the oracle's; the prefill then matches fill_forward with those rows exact."""
    from ridgefill_cpp.runtime.prefill import protected_mask

    o = oracles["llama"]
    S = _split("llama", o)
    texts, control = _vocab(tiny_models["llama"])
    llm = Llama(str(tiny_models["llama"]), ridgefill=RidgeFill(map_files["llama"], tail=TAIL, selector="protected",
                                                                protected=classes, exact_fraction=0.15, min_prompt=0),
                **ctx_kwargs())
    try:
        extra = llm.tokenize(b"\nroom 42 at 7:30\nthe code is 90210.\n", add_bos=False)
        tokens = prompt[:N_TOKENS - len(extra) - 40] + extra + prompt[N_TOKENS - 40:N_TOKENS]
        want = select_protected_rows(tokens, texts, control, len(tokens) - TAIL, 0.15, protected_mask(classes))
        assert want, "the prompt has rows of the class"
        llm.eval(tokens)
        st = llm.ridgefill_stats
        assert st["exact_positions"] == want
        assert len(want) <= math.ceil(0.15 * (len(tokens) - TAIL))
        ref = fill_forward(o, tokens, split=S, maps=read_map_file(map_files["llama"]), tail=TAIL, exact_positions=want)
        assert rel(last_logits(llm), ref.last_logits.numpy()) < TOL["llama"]
        if "digits" in classes:
            digit_rows = [j for j in range(len(tokens) - TAIL) if any(c.isdigit() for c in texts[tokens[j]])]
            assert set(digit_rows) <= set(want)  # digits first, and few enough to all fit
    finally:
        llm.close()


def test_protected_selector_on_a_bpe_vocabulary(smollm2_path):
    """SmolLM2's byte-level BPE vocabulary: llama.cpp's token texts and the oracle's decoding of the
    GGUF tokens agree on the classes (digits, line starts)."""
    texts, control = _vocab(smollm2_path)
    rf = RidgeFill.identity(20, tail=64, selector="protected", protected=("digits", "line_start"),
                            exact_fraction=0.2, min_prompt=0)
    llm = Llama(str(smollm2_path), ridgefill=rf, n_ctx=512, n_batch=512, n_threads=2, verbose=False)
    try:
        text = "\n".join(f"Item {i}: the value of field {chr(97 + i % 26)} is {i * 37 % 1000}." for i in range(25))
        tokens = llm.tokenize(text.encode(), add_bos=False)[:400]
        want = select_protected_rows(tokens, texts, control, len(tokens) - 64, 0.2, 1 | 4)
        llm.eval(tokens)
        assert llm.ridgefill_stats["exact_positions"] == want and len(want) > 20
    finally:
        llm.close()


def test_host_placement_is_the_same_path_on_cpu(tiny_models, map_files, prompt):
    """placement="host" loads the maps for streaming; on a CPU build the prefill is identical, and the
    statistics say how many bytes the maps take and where they live."""
    out = {}
    for placement in ("resident", "host"):
        rf = RidgeFill(map_files["llama"], tail=TAIL, min_prompt=0, placement=placement)
        llm = Llama(str(tiny_models["llama"]), ridgefill=rf, **ctx_kwargs())
        try:
            llm.eval(prompt)
            st = llm.ridgefill_stats
            out[placement] = last_logits(llm)
            maps = read_map_file(map_files["llama"])
            n_bytes = sum(a.astype(np.float32).nbytes + maps.b[il].astype(np.float32).nbytes for il, a in maps.a.items())
            assert st["maps_bytes"] == n_bytes
            assert st["maps_placement"] == placement and st["maps_buffers"] == ["CPU"]
        finally:
            llm.close()
    np.testing.assert_array_equal(out["resident"], out["host"])
    identity = Llama(str(tiny_models["llama"]), ridgefill=RidgeFill.identity(4, tail=TAIL, min_prompt=0), **ctx_kwargs())
    try:
        assert identity.ridgefill_memory()["maps_bytes"] == 0
    finally:
        identity.close()


def test_selector_and_placement_refusals(tiny_models, map_files):
    for kw, msg in [(dict(selector="probes"), "selector 'probes'"),
                    (dict(selector="protected", protected=()), "protected token classes"),
                    (dict(selector="protected", protected="digits,vowels"), "protected token classes"),
                    (dict(placement="gpu"), "placement 'gpu'")]:
        with pytest.raises(ValueError, match=msg):
            RidgeFill(map_files["llama"], **kw)
    # the C API refuses what the Python class would not build
    llm = Llama(str(tiny_models["llama"]), **ctx_kwargs())
    try:
        p = RidgeFill.identity(4, selector="protected").params()
        p.protected_classes = 0
        assert N.llama_ridgefill_attach(llm._ctx.ctx, None, p) == -1
        assert "protected selector" in N.llama_ridgefill_last_error().decode()
        p.protected_classes = 64
        assert N.llama_ridgefill_attach(llm._ctx.ctx, None, p) == -1
        p.selector = 7
        assert N.llama_ridgefill_attach(llm._ctx.ctx, None, p) == -1
        assert "unknown selector 7" in N.llama_ridgefill_last_error().decode()
    finally:
        llm.close()


@pytest.mark.parametrize("arch", DENSE)
def test_attention_plus_protected_selector(arch, tiny_models, oracles, prompt, map_files):
    """attention+protected: the protected rows (sink and digits), then the attention selector's rows
    up to the fraction; the prefill matches the oracle with those rows exact."""
    o = oracles[arch]
    S = _split(arch, o)
    texts, control = _vocab(tiny_models[arch])
    rf = RidgeFill(map_files[arch], tail=TAIL, selector="attention+protected", min_prompt=0)
    llm = Llama(str(tiny_models[arch]), ridgefill=rf, **ctx_kwargs(n_ubatch=32))
    try:
        extra = llm.tokenize(b"\nroom 42 at 7:30\n", add_bos=False)
        tokens = prompt[:N_TOKENS - len(extra) - 40] + extra + prompt[N_TOKENS - 40:]
        llm.eval(tokens)
        st = llm.ridgefill_stats
        prefix = len(tokens) - TAIL
        prot = select_protected_rows(tokens, texts, control, prefix, 0.10)
        assert prot and set(prot) >= {0, 1, 2, 3}
        # the composition, on libllama's own scores (compared with the oracle's in the attention test)
        want = select_attention_protected_rows(torch.tensor(llm.ridgefill_scores()), tokens, texts, control, prefix)
        assert st["exact_positions"] == want and set(prot) <= set(want)
        assert len(want) == math.ceil(0.1 * prefix) and st["selector_layer"] == default_selector_layer(o, S)
        ref_want = select_attention_protected_rows(attention_scores(o, tokens, default_selector_layer(o, S)), tokens, texts,
                                                   control, prefix)
        assert len(set(want) ^ set(ref_want)) <= 2  # at most one near-tie of the scores swapped
        ref = fill_forward(o, tokens, split=S, maps=read_map_file(map_files[arch]), tail=TAIL, exact_positions=want)
        assert rel(last_logits(llm), ref.last_logits.numpy()) < TOL[arch]
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# settings checked before the C boundary (int32, no truncation, no bools), the state correction
# without gains, a map path that is not a regular file


@pytest.fixture(scope="module")
def synthetic_maps(tiny_models, tmp_path_factory):
    """Synthetic maps with the tiny llama model's fingerprint (no fit: cheap)."""
    from test_mapfile import _maps

    from ridgefill_cpp.maps.fingerprint import model_fingerprint

    root = tmp_path_factory.mktemp("synthetic-maps")
    m = _maps(n_embd=64, split=3, n_layer=6, fingerprint=model_fingerprint(tiny_models["llama"]))
    return write_map_file(root / "tiny-llama.ridgefill.gguf", m, dtype="f32")


@pytest.mark.parametrize("kwargs, message", [
    ({"tail": 2**32 + 64}, r"tail 4294967360 must be <= 2147483647"),
    ({"tail": 1.7}, r"tail 1\.7 must be an integer in 1\.\.2147483647"),
    ({"tail": True}, r"tail True must be an integer"),
    ({"selector": [5, 4294967301]}, r"selector position 4294967301 must be <= 2147483647"),
    ({"selector": [2.5]}, r"selector position 2\.5 must be an integer"),
    ({"selector": [-1]}, r"selector position -1 must be >= 0"),
    ({"exact_fraction": True}, r"exact_fraction True must be a number in \[0, 1\]"),
    ({"exact_fraction": float("nan")}, r"exact_fraction nan outside \[0, 1\]"),
    ({"selector_layer": -5}, r"selector_layer -5 must be >= 0 .*None is the last full-attention layer"),
    ({"value_rescale": 2**32}, r"value_rescale 4294967296 must be <= 2147483647"),
    ({"key_rescale": 2**31}, r"key_rescale 2147483648 must be <= 2147483647"),
    ({"min_prompt": 2**32 + 1}, r"min_prompt 4294967297 must be <= 2147483647"),
    ({"n_queries": 2**32 + 64}, r"n_queries 4294967360 must be <= 2147483647"),
    ({"fill_chunk": 1.5}, r"fill_chunk 1\.5 must be an integer"),
    ({"split": 2**32 + 3}, r"split 4294967299 must be <= 2147483647"),
])
def test_settings_out_of_the_c_range_are_refused(synthetic_maps, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RidgeFill(synthetic_maps, **kwargs)


def test_settings_at_the_edge_of_the_c_range_reach_it_unchanged(synthetic_maps):
    rf = RidgeFill(synthetic_maps, tail=2**31 - 1, selector=[0, 2**31 - 1], min_prompt=2**31 - 1, selector_layer=2,
                   exact_fraction=1)
    p = rf.params()
    assert (p.n_tail, p.min_prompt, p.sel_layer, p.exact_fraction) == (2**31 - 1, 2**31 - 1, 2, 1.0)
    assert rf.positions == (0, 2**31 - 1)
    assert RidgeFill(synthetic_maps, tail=np.int64(8), selector=np.array([3, 1])).positions == (1, 3)


def test_a_tuned_tail_outside_int32_is_refused_naming_the_map_file(synthetic_maps, tmp_path):
    import gguf

    from ridgefill_cpp.maps.mapfile import TUNED_PREFIX, rewrite_map_file

    path = rewrite_map_file(synthetic_maps, tmp_path / "tuned.gguf", add_keys=[
        (TUNED_PREFIX + "tail", 4294967295, gguf.GGUFValueType.UINT32),
        (TUNED_PREFIX + "exact_fraction", 0.1, gguf.GGUFValueType.FLOAT64),
        (TUNED_PREFIX + "selector", "none", gguf.GGUFValueType.STRING)])
    with pytest.raises(ValueError, match=r"tail 4294967295 must be <= 2147483647 .*the map file's tuned value, "
                                         r"ridgefill\.tuned\.tail"):
        RidgeFill(path)
    assert RidgeFill(path, tail=16).tail == 16  # an argument wins over the file's value


def test_state_correction_gain_without_gains_is_refused(tiny_models, synthetic_maps):
    """(libllama refuses it where a late layer is recurrent; a dense model's maps never have gains, and
    there it was silently a no-op)."""
    for rf, what in ((RidgeFill(synthetic_maps, state_correction="gain"), str(synthetic_maps)),
                     (RidgeFill.identity(3, state_correction="gain"), "identity fill")):
        with pytest.raises(ValueError, match=rf"the state correction 'gain' needs maps with state gains .*"
                                             rf"--state-gains\); {what} has none"):
            Llama(str(tiny_models["llama"]), ridgefill=rf, **ctx_kwargs())


def test_a_map_path_that_is_not_a_regular_file_is_refused_before_it_is_opened(tiny_models, synthetic_maps, tmp_path):
    """A FIFO would block the loader: refused by name at once (in a subprocess, so that a regression
    fails on the timeout instead of hanging the suite)."""
    import os
    import subprocess
    import sys

    fifo = tmp_path / "maps.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.gguf"
    link.symlink_to(synthetic_maps)  # a symlink to a regular file is fine
    code = ("import ridgefill_cpp\nfrom ridgefill_cpp import Llama, RidgeFill\n"
            f"for make in (lambda: RidgeFill({str(fifo)!r}), lambda: RidgeFill(maps={str(fifo)!r}, tail=8),\n"
            f"             lambda: Llama({str(tiny_models['llama'])!r}, n_ctx=256, verbose=False, ridgefill={str(fifo)!r}),\n"
            f"             lambda: RidgeFill({str(tmp_path)!r})):\n"
            "    try:\n        make()\n        print('accepted')\n"
            "    except ValueError as e:\n        print(e)\n"
            f"print(RidgeFill({str(link)!r}).split is None)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(ridgefill_cpp.__file__).resolve().parent.parent))
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[:3] == [f"{fifo}: the map file is a FIFO, not a regular file"] * 3, lines
    assert lines[3:] == [f"{tmp_path}: the map file is a directory, not a regular file", "True"], lines


# ------------------------------------------------------------------------------------------------
# nothing silently lost (issue #44): pickling, NUL characters, statistics after close()

def test_a_pickled_llama_keeps_its_ridgefill(tiny_models, synthetic_maps, prompt, tmp_path):
    """``pickle.loads(pickle.dumps(llm))`` gave a Llama whose ``ridgefill`` was None: a long prompt then
    ran stock prefill without a word. The copy now has the same settings, from the same sources
    (an argument stays an argument, a map file's tuned value is read from the file again), and
    prefills the same rows to the same logits."""
    import copy
    import pickle

    import gguf

    from ridgefill_cpp.maps.mapfile import TUNED_PREFIX, rewrite_map_file

    tuned = rewrite_map_file(synthetic_maps, tmp_path / "tuned.gguf", add_keys=[
        (TUNED_PREFIX + "tail", 12, gguf.GGUFValueType.UINT32),
        (TUNED_PREFIX + "exact_fraction", 0.25, gguf.GGUFValueType.FLOAT64),
        (TUNED_PREFIX + "selector", "protected", gguf.GGUFValueType.STRING)])
    for rf in (RidgeFill(synthetic_maps, tail=8, min_prompt=32), RidgeFill(tuned, exact_fraction=0.5, min_prompt=32),
               RidgeFill(synthetic_maps, selector=[3, 40, 7], min_prompt=32),
               RidgeFill.identity(split=2, span=4, placement="host", min_prompt=32)):
        for other in (pickle.loads(pickle.dumps(rf)), copy.deepcopy(rf), copy.copy(rf)):
            assert other == rf and other.origin == rf.origin and other.positions == rf.positions
        llm = Llama(str(tiny_models["llama"]), ridgefill=rf, **ctx_kwargs())
        try:
            copy_ = pickle.loads(pickle.dumps(llm))
            try:
                assert copy_.ridgefill == rf and copy_.ridgefill.origin == rf.origin
                assert (copy_.n_ctx(), copy_.n_batch, copy_.context_params.type_k) == (llm.n_ctx(), llm.n_batch, 0)  # F32 KV
                logits = [m.prefill(prompt, n_logits=1) for m in (llm, copy_)]
                stats = [m.ridgefill_stats for m in (llm, copy_)]
                assert stats[0]["n_filled"] > 0 and stats[0]["exact_positions"] == stats[1]["exact_positions"]
                assert stats[0]["tail"] == stats[1]["tail"] == rf.tail
                np.testing.assert_array_equal(logits[0], logits[1])
            finally:
                copy_.close()
        finally:
            llm.close()
    # the map file's tuned value is the file's: tail 12 from the file, exact_fraction 0.5 the argument
    assert RidgeFill(tuned, exact_fraction=0.5).origin["tail"] == "map file"
    # without RidgeFill it stays without; a closed Llama, whose RidgeFill is gone, is refused
    llm = Llama(str(tiny_models["llama"]), **ctx_kwargs())
    b = pickle.loads(pickle.dumps(llm))
    assert b.ridgefill is None
    b.close()
    llm.close()
    with pytest.raises(ValueError, match=r"Llama\.__getstate__: this Llama is closed"):
        pickle.dumps(llm)


def test_statistics_after_close_raise_like_every_other_member(tiny_models, synthetic_maps, prompt):
    """``ridgefill_stats`` after close() returned the last plan's dict where every other member raised."""
    llm = Llama(str(tiny_models["llama"]), ridgefill=RidgeFill(synthetic_maps, min_prompt=32), **ctx_kwargs())
    llm.eval(prompt)
    assert llm.ridgefill_stats["n_filled"] > 0 and llm.ridgefill.maps == synthetic_maps
    llm.close()
    for member in ("ridgefill_stats", "ridgefill"):
        with pytest.raises(ValueError, match=rf"Llama\.{member}: this Llama is closed \(close\(\) freed its model"):
            getattr(llm, member)
    with pytest.raises(ValueError, match=r"Llama\.ridgefill_memory: this Llama is closed"):
        llm.ridgefill_memory()
    assert llm.closed


def test_a_nul_character_in_a_string_for_c_is_refused_whole(tiny_models, synthetic_maps):
    """C reads a string up to its first NUL: ``"maps.gguf\\0junk"`` would open ``maps.gguf``. Every string
    that crosses into C is checked whole: paths, RPC servers, selector and class names."""
    from ridgefill_cpp.runtime import rpc
    from ridgefill_cpp.runtime.native_maps import NativeMaps
    from ridgefill_cpp.server.serve import server_args

    nul = r"contains a NUL character \(C would read only the part before it\)"
    model = str(tiny_models["llama"])
    for make, message in ((lambda: RidgeFill(str(synthetic_maps) + "\0junk"), "maps .*" + nul),
                          (lambda: RidgeFill(Path(str(synthetic_maps) + "\0")), "maps .*" + nul),
                          (lambda: RidgeFill(synthetic_maps, selector="attention\0junk"), r"selector 'attention\\x00junk': use one of"),
                          (lambda: RidgeFill(synthetic_maps, protected=("digits\0",)), r"protected token classes .*: use one or more"),
                          (lambda: RidgeFill(synthetic_maps, protected="sink\0,digits"), r"protected token classes .*: use one or more"),
                          (lambda: Llama(model + "\0junk", verbose=False), "model_path .*" + nul),
                          (lambda: rpc.server_list("127.0.0.1\0evil:50052"), "rpc_servers: server .*" + nul),
                          (lambda: server_args(model + "\0", None), "model .*" + nul),
                          (lambda: server_args(model, None, extra=["--alias", "a\0b"]), "llama-server argument .*" + nul)):
        with pytest.raises(ValueError, match=message):
            make()
    llm = Llama(model, **ctx_kwargs())
    try:
        with pytest.raises(ValueError, match="map file .*" + nul):
            NativeMaps(llm._model.model, str(synthetic_maps) + "\0junk")
        with pytest.raises(ValueError, match="model file .*" + nul):
            NativeMaps(llm._model.model, synthetic_maps, model_path=model + "\0")
    finally:
        llm.close()
