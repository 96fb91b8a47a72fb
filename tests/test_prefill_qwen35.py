"""Filled-row prefill of the Gated DeltaNet hybrids (``qwen35``, and ``qwen35moe``: the same layers
with mixture-of-experts FFNs) in libllama against the reference of docs/design.md §4 item 4
(``ridgefill_cpp.oracle.fill``) on the same GGUF weights; every test runs on both.

There is no real hybrid GGUF in the package registry: the tiny random-weight models of
``ridgefill_cpp/testing/tiny_qwen35.py`` (6 layers: Gated DeltaNet 0, 1, 3, 4 and gated full attention 2, 5) is the
test bed. At split 3 the late layers are GDN 3 (fills from x_S), GDN 4 (fills from the map's x̂) and
attention 5. A late GDN layer runs every prompt row in position order, in chunks of n_ubatch that
start anew at the tail: filled rows feed only the state update, exact rows the whole layer.

The model stores F32 weights and the contexts keep an F32 KV cache without flash attention, so
llama.cpp and the float64 oracle agree to float32 rounding (~1e-6).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from conftest import evaluation_tokens

import ridgefill_cpp  # noqa: F401  (first: llama_cpp then loads the patched libraries)
import llama_cpp  # noqa: E402
from prefill_helpers import assert_degenerate_plans_are_stock, captured_log, ctx_kwargs, last_logits, late_graph_count, rel
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.core import native as N
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import read_map_file, write_map_file
from ridgefill_cpp.oracle import load_oracle
from ridgefill_cpp.oracle.fill import (attention_scores, default_selector_layer, fill_forward, is_full_attention,
                                      probe_fill_forward, select_exact_rows)

HYBRIDS = ("qwen35", "qwen35moe")
S = 3
N_TOKENS = 200
TAIL = 16
TOL = 2e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=HYBRIDS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(tiny_models, arch):
    return tiny_models[arch]


@pytest.fixture(scope="module")
def oracle(model):
    return load_oracle(model, dtype=torch.float64)


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    return evaluation_tokens(model, N_TOKENS)


@pytest.fixture(scope="module")
def map_file(model, tmp_path_factory):
    """F32 ridge maps at S = 3, fitted on llama.cpp's hidden states of calibration text."""
    res = fit_ridge_maps(model, corpus.default_documents("calibration"),
                         FitOptions(n_tokens=4000, ctx=128, split=S, n_threads=1))
    return write_map_file(tmp_path_factory.mktemp("qwen35-maps") / "qwen35.ridgefill.gguf", res.maps, dtype="f32")


def _state(st) -> np.ndarray:
    """An oracle GDNState in llama.cpp's layout (conv state, then ssm state)."""
    return np.concatenate([st.conv.reshape(-1).numpy(), st.ssm.reshape(-1).numpy()])


def _check_against(llm, ref, oracle, n: int) -> None:
    """Last-row logits, every layer's final recurrent state and every attention layer's K/V rows."""
    assert rel(last_logits(llm), ref.last_logits.numpy()) < TOL
    for il in range(oracle.n_layer):
        if oracle.is_recurrent(il):
            assert rel(llm.read_state(il), _state(ref.gdn_states[il])) < TOL, il
        else:
            k, v = llm.read_kv(il, list(range(n)))
            assert rel(k, ref.keys[il].reshape(n, -1).numpy()) < TOL, il
            assert rel(v, ref.values[il].reshape(n, -1).numpy()) < TOL, il


def _same_as_stock(llm, stock) -> None:
    """Logits and every recurrent state equal to stock prefill's within float noise."""
    assert rel(last_logits(llm), last_logits(stock)) < 1e-5
    for il in (0, 1, 3, 4):
        assert rel(llm.read_state(il), stock.read_state(il)) < 1e-5, il


# ------------------------------------------------------------------------------------------------
# agreement with the oracle


CASES = [
    # maps, value_rescale, n_prompt, tail, n_ubatch, n_batch, exact fraction
    ("ridge", 512, N_TOKENS, TAIL, 64, 256, 0.10),
    ("ridge", 0, N_TOKENS, TAIL, 16, 48, 0.10),
    ("identity", 512, N_TOKENS, TAIL, 64, 40, 0.25),
    ("ridge", 5, 97, 7, 32, 97, 0.0),   # selector none: chunks of filled rows only
    ("identity", 0, 97, 40, 8, 16, 0.05),  # the tail spans five chunks
    ("ridge", 512, 130, 64, 64, 256, 0.10),  # prefix and tail one chunk each
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_prefill_matches_the_oracle(case, model, oracle, prompt, map_file):
    kind, c, n, tail, n_ubatch, n_batch, fraction = case
    L = oracle.n_layer
    tokens = prompt[:n]
    exact = select_exact_rows(attention_scores(oracle, tokens, default_selector_layer(oracle, S)), n - tail, fraction)
    maps = read_map_file(map_file) if kind == "ridge" else None
    ref = fill_forward(oracle, tokens, split=S, maps=maps, tail=tail, exact_positions=exact, value_rescale=c)

    rf = RidgeFill(map_file if kind == "ridge" else None, split=S, tail=tail, selector=exact, value_rescale=c,
                   min_prompt=0)
    llm = Llama(str(model), ridgefill=rf, **ctx_kwargs(n_ubatch=n_ubatch, n_batch=n_batch))
    try:
        llm.ridgefill_record_boundary_states()
        llm.eval(tokens)
        st = llm.ridgefill_stats
        assert st["n_prompt"] == n and st["split"] == S and st["tail"] == tail
        assert st["exact_positions"] == exact
        assert st["n_filled"] == n - tail - len(exact) > 0
        assert st["ceiling"] == pytest.approx(1 / ref.compute_ratio, rel=1e-6)
        _check_against(llm, ref, oracle, n)

        # value scales: measured at the attention layer, 1 at the GDN layers
        scales = np.array(llm.ridgefill_value_scales())
        assert scales.shape == (L - S, oracle.n_head_kv)
        np.testing.assert_allclose(scales, ref.value_scales.numpy(), rtol=TOL, atol=0)
        assert np.all(scales[[il - S for il in range(S, L) if oracle.is_recurrent(il)]] == 1.0)
        if c:
            assert np.abs(scales[L - 1 - S] - 1).max() > 1e-3  # the scale did something at layer 5

        # each late GDN layer's state after the last prefix row (what the state correction scales)
        for il in range(S, L):
            got = llm.ridgefill_boundary_state(il)
            if oracle.is_recurrent(il):
                assert rel(got, _state(ref.boundary_states[il])) < TOL, il
            else:
                assert got is None

        # another prompt in the same context, from position 0: the late GDN layers' states (left by
        # the first prompt in the recurrent cells; the early phase never touches them) start from zero
        other = prompt[N_TOKENS - n:][::-1]
        exact = select_exact_rows(attention_scores(oracle, other, default_selector_layer(oracle, S)), n - tail, fraction)
        ref = fill_forward(oracle, other, split=S, maps=maps, tail=tail, exact_positions=exact, value_rescale=c)
        llm.n_tokens = 0  # not reset(): that clears the memory's data too
        assert llm._ctx.kv_cache_seq_rm(0, 0, -1)  # frees the cells, keeps their data
        ctx = llm._ctx.ctx
        assert N.llama_ridgefill_begin(ctx, 0, 0, n) == 1
        pos = (ctypes.c_int32 * max(len(exact), 1))(*exact)
        assert N.llama_ridgefill_set_exact(ctx, pos, len(exact)) == 0
        llama_cpp.Llama.eval(llm, other)
        _check_against(llm, ref, oracle, n)
    finally:
        llm.close()


@pytest.mark.parametrize("fraction", [0.0, 0.1])
def test_a_recurrent_last_layer(fraction, arch, prompt, tmp_path):
    """A hybrid whose last layer is a GDN layer (Qwen3.5's last layer is attention; the code reads the
    pattern from the model): chunks of filled rows only have no outputs, the tail's chunk gives the
    logits; identity fill at S = 3 (layers 3, 4, 5 recurrent late layers) against the oracle."""
    from ridgefill_cpp.testing import tiny_models as mtm

    model = mtm.make_tiny_model(arch, tmp_path / "last-recurrent.gguf", seed=0,
                                recurrent_layers=(True, True, False, True, False, True))
    o = load_oracle(model, dtype=torch.float64)
    assert o.is_recurrent(5) and not o.is_recurrent(4)
    exact = select_exact_rows(attention_scores(o, prompt, default_selector_layer(o, S)), N_TOKENS - TAIL, fraction)
    ref = fill_forward(o, prompt, split=S, tail=TAIL, exact_positions=exact)
    llm = Llama(str(model), ridgefill=RidgeFill.identity(S, tail=TAIL, selector=exact, min_prompt=0),
                **ctx_kwargs(n_ubatch=32, n_batch=64))
    try:
        llm.eval(prompt)
        assert llm.ridgefill_stats["n_filled"] == N_TOKENS - TAIL - len(exact)
        _check_against(llm, ref, o, N_TOKENS)
    finally:
        llm.close()


def test_filled_rows_change_the_state(model, oracle, prompt, map_file):
    """The filled rows really feed the late recurrence with x̂: the final state of GDN layer 4 differs
    from the exact prefill's by about as much as the oracle says, and identity differs from ridge."""
    exact_ref = fill_forward(oracle, prompt, split=oracle.n_layer, tail=TAIL)  # S = L: the exact forward
    ridge = fill_forward(oracle, prompt, split=S, maps=read_map_file(map_file), tail=TAIL, exact_positions=[])
    ident = fill_forward(oracle, prompt, split=S, tail=TAIL, exact_positions=[])
    ref_gap = rel(_state(ridge.gdn_states[4]), _state(exact_ref.gdn_states[4]))
    assert ref_gap > 1e-2
    assert rel(_state(ident.gdn_states[4]), _state(ridge.gdn_states[4])) > 1e-2
    llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=TAIL, selector="none", min_prompt=0), **ctx_kwargs())
    try:
        llm.eval(prompt)
        got = llm.read_state(4)
        assert rel(got, _state(ridge.gdn_states[4])) < TOL
        assert rel(got, _state(exact_ref.gdn_states[4])) == pytest.approx(ref_gap, rel=1e-3)
    finally:
        llm.close()


@pytest.mark.parametrize("n_ubatch", [8, 64])
def test_state_correction_matches_the_oracle(n_ubatch, model, oracle, prompt, map_file, tmp_path):
    """state_correction="gain": the first tail chunk of each mapped GDN layer starts from its boundary
    state times the map file's per-head gains, as the oracle's fill_forward(state_gains=)."""
    from ridgefill_cpp.fitting.state_gains import add_state_gains

    gains = {4: np.array([0.7, 0.85, 1.1, 1.3], dtype=np.float32)}
    path = add_state_gains(map_file, gains, tmp_path / "gains.ridgefill.gguf")
    maps = read_map_file(path)
    exact = [0, 5, 60, 120]
    plain = fill_forward(oracle, prompt, split=S, maps=maps, tail=TAIL, exact_positions=exact)
    ref = fill_forward(oracle, prompt, split=S, maps=maps, tail=TAIL, exact_positions=exact,
                       state_gains={il: torch.from_numpy(g) for il, g in gains.items()})
    assert rel(ref.last_logits.numpy(), plain.last_logits.numpy()) > 1e-3  # the gains matter
    rf = RidgeFill(path, tail=TAIL, selector=exact, min_prompt=0, state_correction="gain")
    llm = Llama(str(model), ridgefill=rf, **ctx_kwargs(n_ubatch=n_ubatch, n_batch=64))
    try:
        llm.ridgefill_record_boundary_states()
        llm.eval(prompt)
        _check_against(llm, ref, oracle, N_TOKENS)
        # the recorded boundary state is the one before the correction
        assert rel(llm.ridgefill_boundary_state(4), _state(ref.boundary_states[4])) < TOL
    finally:
        llm.close()


def test_state_splice_matches_the_oracle(model, oracle, prompt, map_file):
    """The splice test for recurrent state: the tail of each late GDN layer starts from the exact
    boundary state (read after a stock prefill of the prefix) instead of the filled one, as the
    oracle's fill_forward(boundary_override=) with its own exact states; the result is closer to
    stock than the plain fill."""
    maps = read_map_file(map_file)
    exact = [0, 5, 60, 120]
    n_prefix = N_TOKENS - TAIL
    stock = Llama(str(model), **ctx_kwargs())
    llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=TAIL, selector=exact, min_prompt=0), **ctx_kwargs())
    try:
        stock.eval(prompt[:n_prefix])
        states = {il: stock.read_state(il) for il in (3, 4)}
        stock.eval(prompt[n_prefix:])
        exact_ref = fill_forward(oracle, prompt, split=S, maps=maps, tail=TAIL, exact_positions=range(n_prefix))
        ref = fill_forward(oracle, prompt, split=S, maps=maps, tail=TAIL, exact_positions=exact,
                           boundary_override={il: exact_ref.boundary_states[il] for il in (3, 4)})
        plain = fill_forward(oracle, prompt, split=S, maps=maps, tail=TAIL, exact_positions=exact)
        for il, st in states.items():
            assert rel(st, _state(exact_ref.boundary_states[il])) < TOL  # stock's prefix state is the exact one
            llm.ridgefill_splice_state(il, st)
        llm.eval(prompt)
        _check_against(llm, ref, oracle, N_TOKENS)
        assert rel(last_logits(llm), last_logits(stock)) < rel(plain.last_logits.numpy(), last_logits(stock))
        llm.ridgefill_splice_state(None)  # off again: the plain fill
        llm.reset()
        llm.eval(prompt)
        _check_against(llm, plain, oracle, N_TOKENS)
        with pytest.raises(ValueError, match="layer 5 is not a late recurrent layer"):
            llm.ridgefill_splice_state(5, states[4])
        with pytest.raises(ValueError, match="not 3"):
            llm.ridgefill_splice_state(4, states[4][:3])
    finally:
        llm.close()
        stock.close()


def test_attention_selector_matches_the_oracle(model, oracle, prompt, map_file):
    """The selector scores at the last full-attention layer below S (layer 2; GDN layers have no
    attention), then the plan matches the oracle with the oracle's own selection."""
    layer = default_selector_layer(oracle, S)
    assert layer == 2
    ref_scores = attention_scores(oracle, prompt, layer).numpy()
    llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=TAIL, min_prompt=0), **ctx_kwargs(n_ubatch=32, n_batch=64))
    try:
        llm.eval(prompt)
        st = llm.ridgefill_stats
        assert st["selector_layer"] == layer
        scores = np.array(llm.ridgefill_scores())
        assert scores.sum() == pytest.approx(oracle.n_head * 64, rel=1e-4)
        np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=TOL * ref_scores.max())
        chosen = st["exact_positions"]
        assert len(chosen) == math.ceil(0.1 * (N_TOKENS - TAIL))
        ref = fill_forward(oracle, prompt, split=S, maps=read_map_file(map_file), tail=TAIL, exact_positions=chosen)
        _check_against(llm, ref, oracle, N_TOKENS)
    finally:
        llm.close()


@pytest.mark.parametrize("n_ubatch", [8, 64])
def test_probe_selector_matches_the_oracle(n_ubatch, model, oracle, prompt, map_file):
    """The probe pass runs the late GDN layers over every row too; the second pass starts their
    recurrence again from the state before the plan."""
    L = oracle.n_layer
    ref = probe_fill_forward(oracle, prompt, split=S, maps=read_map_file(map_file), tail=TAIL, fraction=0.10, n_queries=64)
    llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=TAIL, selector="probe", min_prompt=0),
                **ctx_kwargs(n_ubatch=n_ubatch, n_batch=64))
    try:
        llm.eval(prompt)
        st = llm.ridgefill_stats
        n_full = sum(1 for il in range(S, L) if is_full_attention(oracle, il))
        scores = np.array(llm.ridgefill_scores())
        assert n_full == 1 and scores.sum() == pytest.approx(oracle.n_head * TAIL * n_full, rel=1e-4)
        np.testing.assert_allclose(scores, ref.probe_scores.numpy(), rtol=0, atol=TOL * ref.probe_scores.max().item())
        assert st["exact_positions"] == ref.exact_rows.numpy()[:-TAIL].tolist()
        assert st["probe_rows"] == TAIL
        _check_against(llm, ref, oracle, N_TOKENS)
    finally:
        llm.close()


def test_plan_spanning_several_eval_calls(model, oracle, prompt, map_file):
    """One plan brought by three ``eval`` calls of several ubatches each (the hybrid memory splits
    them with split_equal)."""
    exact = [0, 3, 50, 101]
    ref = fill_forward(oracle, prompt, split=S, maps=read_map_file(map_file), tail=TAIL, exact_positions=exact)
    llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=TAIL, selector=exact, min_prompt=0),
                **ctx_kwargs(n_batch=32, n_ubatch=16))
    try:
        ctx = llm._ctx.ctx
        assert N.llama_ridgefill_begin(ctx, 0, 0, N_TOKENS) == 1
        pos = (ctypes.c_int32 * len(exact))(*exact)
        assert N.llama_ridgefill_set_exact(ctx, pos, len(exact)) == 0
        for part in (prompt[:70], prompt[70:121], prompt[121:]):
            llama_cpp.Llama.eval(llm, part)
        _check_against(llm, ref, oracle, N_TOKENS)
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# degenerate cases (docs/design.md §4.6) and a cached prefix


def test_degenerate_plans_are_bit_identical_to_stock(model, oracle, prompt):
    assert_degenerate_plans_are_stock(model, prompt, n_layer=oracle.n_layer, split=S, tail=TAIL)


@pytest.mark.parametrize("n_ubatch,flash_attn", [(16, False), (64, False), (64, True)])
def test_all_rows_exact_equals_stock(n_ubatch, flash_attn, model, prompt, map_file):
    """exact_fraction 1.0, value rescale off: the late phase recomputes every late layer exactly,
    the GDN layers over every row from a zero state; logits and final states equal stock (also with
    flash attention and an F16 cache)."""
    kw = dict(n_ubatch=n_ubatch, flash_attn=flash_attn, **(dict(type_k=1, type_v=1) if flash_attn else {}))
    stock = Llama(str(model), **ctx_kwargs(**kw))
    llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=TAIL, exact_fraction=1.0, value_rescale=0, min_prompt=0),
                **ctx_kwargs(**kw))
    try:
        stock.eval(prompt)
        llm.eval(prompt)
        assert llm.ridgefill_stats["n_filled"] == 0
        _same_as_stock(llm, stock)
    finally:
        llm.close()
        stock.close()


def test_cached_prefix_continues_the_recurrent_states(model, prompt, map_file):
    """A second prompt after a cached first one (p0 > 0): the late GDN layers continue from the state
    the first plan left. With every row exact both plans together equal one stock prefill; with rows
    filled, generation afterwards runs every layer."""
    stock = Llama(str(model), **ctx_kwargs())
    rf = RidgeFill(map_file, tail=8, exact_fraction=1.0, value_rescale=0, min_prompt=20)
    llm = Llama(str(model), ridgefill=rf, **ctx_kwargs(n_batch=64, n_ubatch=32))
    try:
        stock.eval(prompt)
        llm.eval(prompt[:120])
        assert llm.ridgefill_stats["pos0"] == 0
        llm.eval(prompt[120:])  # 80 new rows, planned from position 120
        st = llm.ridgefill_stats
        assert st["pos0"] == 120 and st["n_prompt"] == N_TOKENS - 120 and st["n_filled"] == 0
        _same_as_stock(llm, stock)
    finally:
        llm.close()
        stock.close()

    llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=8, min_prompt=20), **ctx_kwargs(n_batch=64, n_ubatch=32))
    try:
        llm.eval(prompt[:120])
        llm.eval(prompt[120:])
        st = llm.ridgefill_stats
        assert st["pos0"] == 120 and st["n_filled"] > 0
        assert all(120 <= p < N_TOKENS - 8 for p in st["exact_positions"])
        llm.eval(prompt[:1])  # a generated token: every layer, stats untouched
        assert llm.ridgefill_stats == st
        assert np.isfinite(last_logits(llm)).all()
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# settings, buffers, refusals


def test_compute_buffers_are_reserved_for_the_recurrent_late_layers(model, prompt, map_file):
    """Attaching reserves the scheduler's buffers for the late GDN chunks too: a prefill never grows
    them (llama.cpp's own check at context teardown finds the expected sizes)."""
    with captured_log() as logs:
        llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=TAIL, min_prompt=0), **ctx_kwargs(n_ubatch=64))
        llm.eval(prompt)
        assert llm.ridgefill_stats["n_filled"] > 64
        llm.close()
    text = "".join(logs)
    assert "RidgeFill attached" in text and "compute buffer size" in text
    assert "does not match expectation" not in text


@pytest.mark.parametrize("n_ctx", [256, 1024])
@pytest.mark.parametrize("selector", ["attention", "probe"])
def test_plan_accounting_of_the_recurrent_late_layers(selector, n_ctx, model, oracle, prompt, map_file):
    """The late GDN layers 3 and 4 share one graph per chunk of every row, the attention layer 5 one
    graph for the exact rows. A chunk of GDN rows holds up to 8 n_ubatch rows (at most n_ubatch exact)
    where the compute buffers reserved for the other graphs hold them: the larger n_ctx makes the
    attention graphs' buffers larger, so chunks grow (200 rows at n_ubatch 32: with chunks of 256 rows,
    2 + ceil(|X| / 32) late graphs, where one graph per layer and chunk of n_ubatch took 2 x 7 + 2).
    The probe selector runs two passes."""
    recurrent = [oracle.is_recurrent(il) for il in range(oracle.n_layer)]
    assert recurrent[S:] == [True, True, False]
    llm = Llama(str(model), ridgefill=RidgeFill(map_file, tail=TAIL, selector=selector, min_prompt=0),
                **ctx_kwargs(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=32))
    try:
        llm.eval(prompt)
        st = llm.ridgefill_stats
        rows = st["late_rows"]
        assert rows["attention"] == 32 and rows["recurrent"] in (32, 64, 128, 256)
        kw = dict(recurrent=recurrent, split=S, n_prompt=N_TOKENS, tail=TAIL, n_ubatch=32,
                  recurrent_rows=rows["recurrent"])
        late = late_graph_count(exact=st["exact_positions"], fills=selector == "attention", **kw)
        if selector == "probe":  # its first pass fills every prefix row
            late += late_graph_count(exact=[], **kw)
        assert st["graphs"]["late_built"] == late and st["graphs"]["late_reused"] == 0
        if n_ctx == 1024:
            assert rows["recurrent"] > 32
        if selector == "attention" and rows["recurrent"] >= N_TOKENS - TAIL:
            # one graph for the prefix and one for the tail (layers 3 and 4 each), the attention layer's
            n_x = st["tail"] + st["n_exact"]
            assert late == 2 + math.ceil(n_x / 32)
    finally:
        llm.close()


def test_state_correction_needs_gains(model, map_file):
    with pytest.raises(ValueError, match="state correction 'gain' needs maps with state gains"):
        Llama(str(model), ridgefill=RidgeFill(map_file, state_correction="gain"), **ctx_kwargs())
    with pytest.raises(ValueError, match="state correction 'gain' needs maps with state gains"):
        Llama(str(model), ridgefill=RidgeFill.identity(S, state_correction="gain"), **ctx_kwargs())
    with pytest.raises(ValueError, match="state_correction 'scale'"):
        RidgeFill(map_file, state_correction="scale")


def test_embedding_rows_with_mrope_positions_are_refused(model, prompt):
    """A planned prompt brought as embeddings on an M-RoPE model (positions would not be text
    positions): decode fails with a message, the plan is dropped, and the context stays usable."""
    llm = Llama(str(model), ridgefill=RidgeFill.identity(S, tail=TAIL, min_prompt=0), **ctx_kwargs())
    try:
        ctx = llm._ctx.ctx
        n, n_embd = 40, llm.n_embd()
        assert N.llama_ridgefill_begin(ctx, 0, 0, n) == 1
        batch = llama_cpp.llama_batch_init(n, n_embd, 1)
        try:
            batch.n_tokens = n
            for i in range(n):
                for k in range(n_embd):
                    batch.embd[i * n_embd + k] = 0.01 * ((i + k) % 7)
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == n - 1
            assert llama_cpp.llama_decode(ctx, batch) != 0
        finally:
            llama_cpp.llama_batch_free(batch)
        assert "embeddings with multi-section positions (M-RoPE)" in N.llama_ridgefill_last_error().decode()
        llm.reset()
        llm.eval(prompt)  # a planned text prompt afterwards is served
        assert llm.ridgefill_stats["n_prompt"] == N_TOKENS
    finally:
        llm.close()


def test_state_readout_refusals(model, prompt):
    llm = Llama(str(model), **ctx_kwargs())
    try:
        llm.eval(prompt[:10])
        with pytest.raises(ValueError, match="layer 2 has no recurrent state"):
            llm.read_state(2)
        assert llm.read_state(0).shape == llm.read_state(4).shape
    finally:
        llm.close()
