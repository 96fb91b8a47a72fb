"""The reference of filled-row prefill (ridgefill_cpp.oracle.fill, docs/design.md §4) and the attention
selector (§5), on the tiny models of every architecture.

Everything runs on the float64 torch oracle, so "equal up to rounding" means ~1e-12 relative.
Ridge maps are fitted by llama.cpp (``fit_ridge_maps``, a few thousand calibration tokens, one
thread) at S = L/2, so that several late layers have maps (gemma3: S = 4, layers 5..7, selector
at global layer 3; qwen35: S = 3, late layers 3, 4 (GDN) and 5 (gated attention)).
"""

from __future__ import annotations

import math

import pytest
import torch

from ridgefill_cpp.testing import tiny_models as mtm
from conftest import evaluation_tokens

from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.oracle import load_oracle
from ridgefill_cpp.oracle.common import rms_norm
from ridgefill_cpp.oracle.fill import (
    RECENCY_MAX_SLOPE,
    ROLE_EXACT,
    ROLE_FILLED,
    ROLE_TAIL,
    attention_scores,
    default_selector_layer,
    fill_forward,
    key_scale,
    n_selected,
    recency_corrected,
    select_attention_rows,
    select_exact_rows,
)

ARCHS = mtm.ARCHS
N_TOKENS = 160  # ten gemma3 windows (16)
TAIL = 16
TOL = 1e-10  # float64: max|Δ| / max|ref|


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def oracles(tiny_models):
    return {arch: load_oracle(tiny_models[arch], dtype=torch.float64) for arch in ARCHS}


@pytest.fixture(scope="module")
def prompt(tiny_models) -> list[int]:
    """N_TOKENS tokens of evaluation text (BOS first), tokenized by llama.cpp (shared vocabulary)."""
    return evaluation_tokens(tiny_models["llama"], N_TOKENS)


@pytest.fixture(scope="module")
def exact(oracles, prompt):
    return {arch: o.forward(prompt, last_only=True) for arch, o in oracles.items()}


def _split(oracle) -> int:
    return oracle.n_layer // 2


@pytest.fixture(scope="module")
def maps(tiny_models, oracles):
    """arch -> ridge maps at S = L/2 (llama.cpp hidden states, 4000 tokens: well under a second)."""
    out = {}
    for arch in ARCHS:
        res = fit_ridge_maps(tiny_models[arch], corpus.default_documents("calibration"),
                             FitOptions(n_tokens=4000, ctx=128, split=_split(oracles[arch]), n_threads=1))
        out[arch] = res.maps
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p ‖ q) of two logit rows, in nats."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((lp.exp() * (lp - lq)).sum())


def _v_projection(oracle, il: int, x: torch.Tensor) -> torch.Tensor:
    """Layer il's V projection [n, n_head_kv, head_dim], written from the weights directly."""
    if oracle.arch in ("qwen35", "qwen35moe"):
        lw = oracle.layers[il]
        v = rms_norm(x, lw["attn_norm.weight"], oracle.cfg.rms_eps) @ lw["attn_v.weight"].T
        return v.reshape(x.shape[0], oracle.cfg.n_head_kv, oracle.cfg.head_dim)
    w = oracle.layers[il]
    v = rms_norm(x, w.attn_norm, oracle.hp.rms_eps) @ w.wv.T
    if w.bv is not None:
        v = v + w.bv
    return v.reshape(x.shape[0], oracle.hp.n_head_kv, oracle.hp.head_dim)


def _attention_layers(oracle, layers) -> list[int]:
    return [il for il in layers if not oracle.is_recurrent(il)]


# ------------------------------------------------------------------------------------------------
# degenerate cases (docs/design.md §4.6)


@pytest.mark.parametrize("arch", ARCHS)
def test_inactive_plans_are_bit_identical_to_the_exact_forward(arch, oracles, prompt, exact):
    o, ref = oracles[arch], exact[arch]
    L = o.n_layer
    for kw in (dict(split=L, tail=TAIL),  # S = L: no late layer
               dict(split=_split(o), tail=N_TOKENS),  # N ≤ T
               dict(split=_split(o), tail=N_TOKENS + 7)):
        out = fill_forward(o, prompt, **kw)
        assert not out.active and out.compute_ratio == 1.0
        assert torch.equal(out.logits, ref.logits), kw
        assert torch.equal(out.layer_inputs, ref.layer_inputs)
        for il in range(L):
            assert (out.keys[il] is None) == (ref.keys[il] is None)
            if ref.keys[il] is not None:
                assert torch.equal(out.keys[il], ref.keys[il]) and torch.equal(out.values[il], ref.values[il])
        assert torch.equal(out.value_scales, torch.ones(L - kw["split"], o.n_head_kv, dtype=torch.float64))
    out = fill_forward(o, prompt, split=_split(o), tail=N_TOKENS + 7)
    assert out.tail == N_TOKENS and bool((out.roles == ROLE_TAIL).all())


@pytest.mark.parametrize("rescale", [0, 512])
@pytest.mark.parametrize("arch", ARCHS)
def test_all_rows_exact_equals_the_exact_forward(arch, rescale, oracles, prompt, exact, maps):
    """Selector fraction 1.0: the late-layer machinery runs, but no row is filled."""
    o, ref = oracles[arch], exact[arch]
    out = fill_forward(o, prompt, split=_split(o), maps=maps[arch], tail=TAIL,
                       exact_positions=range(N_TOKENS - TAIL), value_rescale=rescale)
    assert out.active and not bool((out.roles == ROLE_FILLED).any())
    assert _rel(out.last_logits, ref.logits[-1]) < TOL
    assert _rel(out.layer_inputs, ref.layer_inputs) < TOL
    for il in _attention_layers(o, range(o.n_layer)):
        assert _rel(out.keys[il], ref.keys[il]) < TOL and _rel(out.values[il], ref.values[il]) < TOL
    if arch == "qwen35":
        assert set(out.gdn_states) == set(ref.gdn_states)
        for il, st in ref.gdn_states.items():
            assert _rel(out.gdn_states[il].ssm, st.ssm) < TOL and _rel(out.gdn_states[il].conv, st.conv) < TOL
    if rescale == 0:
        assert torch.equal(out.value_scales, torch.ones_like(out.value_scales))


@pytest.mark.parametrize("arch", ARCHS)
def test_split_at_the_last_layer_fills_from_the_exact_input(arch, oracles, prompt, exact):
    """S = L-1 (no maps exist): the only late layer fills from x_S, its exact input, so even with
    every prefix row filled the output is the exact forward's up to rounding."""
    o, ref = oracles[arch], exact[arch]
    out = fill_forward(o, prompt, split=o.n_layer - 1, tail=1)
    assert int((out.roles == ROLE_FILLED).sum()) == N_TOKENS - 1
    assert _rel(out.last_logits, ref.logits[-1]) < TOL
    assert torch.allclose(out.value_scales, torch.ones_like(out.value_scales), rtol=0, atol=1e-12)


def test_bad_arguments(oracles, prompt, maps):
    o = oracles["llama"]
    L = o.n_layer
    with pytest.raises(ValueError, match="split 0 outside 1..6"):
        fill_forward(o, prompt, split=0, tail=4)
    with pytest.raises(ValueError, match="split 7 outside"):
        fill_forward(o, prompt, split=L + 1, tail=4)
    with pytest.raises(ValueError, match="tail 0"):
        fill_forward(o, prompt, split=3, tail=0)
    with pytest.raises(ValueError, match="value_rescale"):
        fill_forward(o, prompt, split=3, tail=4, value_rescale=-1)
    with pytest.raises(ValueError, match="exact position 160 outside"):
        fill_forward(o, prompt, split=3, tail=4, exact_positions=[3, 160])
    with pytest.raises(ValueError, match="empty"):
        fill_forward(o, [], split=3, tail=4)
    with pytest.raises(ValueError, match=r"split 3 \(requested: 4\)"):
        fill_forward(o, prompt, split=4, tail=4, maps=maps["llama"])
    with pytest.raises(ValueError, match="architecture 'qwen3'"):
        fill_forward(o, prompt, split=3, tail=4, maps=maps["qwen3"])


# ------------------------------------------------------------------------------------------------
# the cache rows


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_rows(arch, oracles, prompt, exact, maps):
    o, ref, m = oracles[arch], exact[arch], maps[arch]
    S, L = _split(o), o.n_layer
    chosen = select_attention_rows(o, prompt, split=S, tail=TAIL)
    out = fill_forward(o, prompt, split=S, maps=m, tail=TAIL, exact_positions=chosen)
    filled, ex = out.filled_rows, out.exact_rows
    assert len(chosen) == math.ceil(0.1 * (N_TOKENS - TAIL))
    assert out.exact_rows.tolist() == sorted(set(chosen) | set(range(N_TOKENS - TAIL, N_TOKENS)))
    assert bool((out.roles[chosen] == ROLE_EXACT).all()) and bool((out.roles[-TAIL:] == ROLE_TAIL).all())
    assert len(filled) + len(ex) == N_TOKENS and len(filled) > 0
    pos = out.positions

    # below S every row is exact: the same cache as the exact forward, bit for bit
    for il in range(S):
        assert torch.equal(out.layer_inputs[il], ref.layer_inputs[il])
        if not o.is_recurrent(il):
            assert torch.equal(out.keys[il], ref.keys[il]) and torch.equal(out.values[il], ref.values[il])
    x_split = ref.layer_inputs[S]

    # at S the filled rows' input is x_S itself: K and V are the exact ones (s = 1), and so the
    # exact rows' inputs at S+1 are still exact
    if o.is_recurrent(S):
        assert _rel(out.gdn_states[S].ssm, ref.gdn_states[S].ssm) < TOL
    else:
        assert torch.allclose(out.value_scale(S), torch.ones(o.n_head_kv, dtype=torch.float64), rtol=0, atol=1e-12)
        assert _rel(out.keys[S], ref.keys[S]) < TOL and _rel(out.values[S], ref.values[S]) < TOL
    assert _rel(out.layer_inputs[S + 1][ex], ref.layer_inputs[S + 1][ex]) < TOL
    if not o.is_recurrent(S + 1):
        assert _rel(out.keys[S + 1][ex], ref.keys[S + 1][ex]) < TOL
        assert _rel(out.values[S + 1][ex], ref.values[S + 1][ex]) < TOL

    for il in range(S, L):
        # filled rows' inputs are the predictions from x_S; exact rows carry their own state
        pred = x_split[filled] if il == S else torch.from_numpy(m.predict(il, x_split[filled].numpy()))
        assert _rel(out.layer_inputs[il][filled], pred) < TOL
        if o.is_recurrent(il):
            continue
        # filled rows: the layer's own K/V path on the prediction, V times the head's scale
        k, v = o.kv_path(il, pred, pos[filled])
        assert _rel(out.keys[il][filled], k) < TOL
        assert _rel(out.values[il][filled], v * out.value_scale(il)[None, :, None]) < TOL
        # exact rows: the same path on their (carried) input, no scale
        k, v = o.kv_path(il, out.layer_inputs[il][ex], pos[ex])
        assert _rel(out.keys[il][ex], k) < TOL and _rel(out.values[il][ex], v) < TOL

    # the fill changed something downstream (on the last layer's exact rows)
    assert _rel(out.layer_inputs[L - 1][ex], ref.layer_inputs[L - 1][ex]) > 1e-6


# ------------------------------------------------------------------------------------------------
# value rescale


@pytest.mark.parametrize("c", [5, 512])
@pytest.mark.parametrize("arch", ARCHS)
def test_value_scale_matches_a_direct_computation(arch, c, oracles, prompt, exact):
    o = oracles[arch]
    S, L, T = _split(o), o.n_layer, 12
    out = fill_forward(o, prompt, split=S, tail=T, value_rescale=c)  # identity fill, no exact prefix rows
    n_rows = min(c, T)
    assert out.n_scale_rows == n_rows and out.value_scales.shape == (L - S, o.n_head_kv)
    rows = torch.arange(N_TOKENS - T, N_TOKENS - T + n_rows)
    x_split = exact[arch].layer_inputs[S][rows]
    for il in range(S, L):
        s = out.value_scale(il)
        if o.is_recurrent(il):
            assert torch.equal(s, torch.ones_like(s))  # no V cache, no scale
            continue
        v_exact = _v_projection(o, il, out.layer_inputs[il][rows])  # the tail rows' exact inputs
        v_pred = _v_projection(o, il, x_split)  # identity fill: x̂_l = x_S
        want = v_exact.norm(dim=-1).mean(0) / v_pred.norm(dim=-1).mean(0)
        assert _rel(s, want) < TOL, (il, s, want)
        if il == S:
            assert torch.allclose(s, torch.ones_like(s), rtol=0, atol=1e-12)
    late_attn = _attention_layers(o, range(S + 1, L))
    assert any(not torch.allclose(out.value_scale(il), torch.ones(o.n_head_kv, dtype=torch.float64))
               for il in late_attn)
    off = fill_forward(o, prompt, split=S, tail=T, value_rescale=0)
    assert off.n_scale_rows == 0 and torch.equal(off.value_scales, torch.ones_like(off.value_scales))


# ------------------------------------------------------------------------------------------------
# ridge maps vs identity fill


@pytest.mark.parametrize("arch", ARCHS)
def test_ridge_and_identity_fill_kl_to_exact(arch, oracles, prompt, exact, maps, record_property):
    """Both run; the last-row KL to the exact forward is printed. On the dense tiny models ridge
    fill beat identity fill on every prompt tried (3 model seeds × 5 evaluation prompts each, KL
    4-9x lower on llama/qwen3, 2-4x on gemma3), so that is asserted; on qwen35 it did not hold
    robustly (8/15), so nothing is claimed there."""
    o, ref = oracles[arch], exact[arch]
    S = _split(o)
    chosen = select_attention_rows(o, prompt, split=S, tail=TAIL)
    kl = {}
    for sel_name, sel in (("none", ()), ("attention10", chosen)):
        for fill_name, m in (("identity", None), ("ridge", maps[arch])):
            out = fill_forward(o, prompt, split=S, maps=m, tail=TAIL, exact_positions=sel)
            kl[f"{fill_name}/{sel_name}"] = _kl(ref.logits[-1], out.last_logits)
    record_property("kl_to_exact", kl)
    print(f"\n{arch} S={S}/{o.n_layer} N={N_TOKENS} T={TAIL} last-row KL to exact (nats): "
          + ", ".join(f"{k} {v:.2e}" for k, v in kl.items()))
    assert all(math.isfinite(v) and v >= 0 for v in kl.values())
    assert kl["identity/none"] != kl["ridge/none"]
    if arch != "qwen35":
        assert kl["ridge/none"] < kl["identity/none"]


# ------------------------------------------------------------------------------------------------
# the attention selector


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_scores_sum_to_heads_times_queries(arch, oracles, prompt):
    o = oracles[arch]
    layer = default_selector_layer(o, _split(o))
    # gpt-oss: each softmax gives its attention sink a share that goes to no row (the exact share is
    # checked in test_oracle_gpt_oss.py)
    sinks = getattr(o.layers[layer], "sinks", None) is not None
    for n_queries, n in ((64, N_TOKENS), (64, 40), (1, N_TOKENS)):
        scores = attention_scores(o, prompt[:n], layer, n_queries=n_queries)
        assert scores.shape == (n,) and bool((scores >= 0).all())
        total = o.n_head * min(n_queries, n)
        assert 0 < total - float(scores.sum()) < total if sinks else abs(float(scores.sum()) - total) < 1e-9
    # rows before the query rows receive attention too (full-attention layer)
    scores = attention_scores(o, prompt, layer, n_queries=64)
    assert float(scores[: N_TOKENS - 64].min()) > 0
    # per query row and head the probabilities over the keys sum to 1
    x = o.forward(prompt).layer_inputs[layer]
    pos = torch.arange(N_TOKENS)
    k, _ = o.kv_path(layer, x, pos)
    probs = o.attention_weights(layer, x[-64:], pos[-64:], k, pos)
    assert probs.shape == (o.n_head, 64, N_TOKENS)
    if sinks:
        assert bool((probs.sum(-1) < 1).all()) and bool((probs.sum(-1) > 0).all())
    else:
        assert torch.allclose(probs.sum(-1), torch.ones(o.n_head, 64, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(probs.sum(dim=(0, 1)), scores, rtol=0, atol=1e-12)


def test_default_selector_layer(oracles):
    llama, gemma3, qwen35 = oracles["llama"], oracles["gemma3"], oracles["qwen35"]
    assert default_selector_layer(llama, 4) == 3 and default_selector_layer(oracles["qwen3"], 1) == 0
    # gemma3 (tiny: window 16, layers 3 and 7 global): the last global layer below S
    for split in range(4, 8):
        il = default_selector_layer(gemma3, split)
        assert il == 3 and gemma3.attention_window(il) == 0
    assert default_selector_layer(gemma3, 8) == 7
    assert all(gemma3.attention_window(il) > 0 for il in (4, 5, 6))
    with pytest.raises(ValueError, match="no full-attention layer below split 3"):
        default_selector_layer(gemma3, 3)
    # qwen35 (tiny: attention at 2 and 5): GDN layers have no attention
    assert default_selector_layer(qwen35, 3) == 2 and default_selector_layer(qwen35, 5) == 2
    assert default_selector_layer(qwen35, 6) == 5
    with pytest.raises(ValueError, match="no full-attention layer below split 2"):
        default_selector_layer(qwen35, 2)
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        attention_scores(qwen35, [1, 5, 6], layer=1)


def test_sliding_window_layers_cannot_select_far_rows(oracles, prompt):
    """Why gemma3's selector avoids window layers: at one, rows more than window-1 before the
    first query row get no attention at all; at the global layer they do."""
    g = oracles["gemma3"]
    window, n_q = g.attention_window(4), 64
    far = N_TOKENS - n_q - (window - 1)  # rows 0..far-1 are out of every query's window
    at_swa = attention_scores(g, prompt, 4, n_queries=n_q)
    at_global = attention_scores(g, prompt, default_selector_layer(g, 6), n_queries=n_q)
    assert float(at_swa[:far].abs().max()) == 0.0 and float(at_swa[far:].min()) > 0
    assert float(at_global[:far].min()) > 0


def test_recency_correction_removes_a_power_law():
    """recency_corrected divides out the power law the scores follow in distance from the end of the
    prefix: a prompt whose scores are exactly c·d^-1.5 comes out flat, a peak stays c times its
    trend, the sinks are no part of the fit, slopes are clamped to [-RECENCY_MAX_SLOPE, 0]."""
    n = 200
    d = torch.arange(n, 0, -1, dtype=torch.float64)  # prefix_len - j
    flat = recency_corrected((5.0 * d**-1.5).float(), n)
    assert float(flat.max() / flat.min() - 1) < 1e-5 and abs(float(flat.mean()) - 5.0) < 1e-4
    sc = 5.0 * d**-1.5
    sc[:4] = 1e3  # sinks: not in the fit
    assert torch.allclose(recency_corrected(sc, n)[4:], torch.full((n - 4,), 5.0, dtype=torch.float64))
    assert float(recency_corrected(sc, n)[0]) == pytest.approx(1e3 * 200**1.5)
    assert RECENCY_MAX_SLOPE == 2.0
    steep = recency_corrected(d**-3, n)  # steeper than d^-2: only d^-2 of it is removed
    assert torch.allclose(steep, d**-1)
    rising = d**0.5  # scores that do not fall with distance are left as they are
    assert torch.equal(recency_corrected(rising, n), rising)
    zeros = torch.zeros(n, dtype=torch.float64)  # no scores to fit: unchanged
    assert torch.equal(recency_corrected(zeros, n), zeros)
    with_tail = torch.cat([5.0 * d**-1.5, torch.full((7,), 9.0, dtype=torch.float64)])  # tail rows: not scored
    assert recency_corrected(with_tail, n).shape == (n,)


def test_select_exact_rows_rounding_and_ties():
    assert [n_selected(p, 0.1) for p in (0, 1, 5, 10, 30, 31, 144)] == [0, 1, 1, 1, 3, 4, 15]
    assert n_selected(10, 0.0) == 0 and n_selected(10, 1.0) == 10 and n_selected(7, 0.5) == 4
    with pytest.raises(ValueError, match="fraction"):
        n_selected(10, 1.5)
    scores = torch.tensor([1.0, 3.0, 2.0, 3.0, 0.5, 3.0, 9.0, 9.0])  # the last two: tail rows
    assert select_exact_rows(scores, prefix_len=6, fraction=0.5, span=1) == [1, 3, 5]
    assert select_exact_rows(scores, prefix_len=6, fraction=0.3, span=1) == [1, 3]  # tie: earlier rows
    assert select_exact_rows(scores, prefix_len=6, fraction=0.1, span=1) == [1]
    assert select_exact_rows(scores, prefix_len=6, fraction=0.0, span=1) == []
    assert select_exact_rows(scores, prefix_len=6, fraction=1.0, span=1) == [0, 1, 2, 3, 4, 5]
    assert select_exact_rows(scores, prefix_len=0) == []


@pytest.mark.parametrize("arch", ARCHS)
def test_select_attention_rows_is_the_top_of_the_scores(arch, oracles, prompt):
    o = oracles[arch]
    S = _split(o)
    chosen = select_attention_rows(o, prompt, split=S, tail=TAIL, span=1)
    scores = attention_scores(o, prompt, default_selector_layer(o, S))
    prefix = scores[: N_TOKENS - TAIL]
    assert len(chosen) == n_selected(N_TOKENS - TAIL) == 15
    rest = sorted(set(range(N_TOKENS - TAIL)) - set(chosen))
    assert float(prefix[chosen].min()) >= float(prefix[rest].max())
    assert select_attention_rows(o, prompt[:TAIL], split=S, tail=TAIL) == []


# ------------------------------------------------------------------------------------------------
# qwen35: Gated DeltaNet late layers (docs/design.md §4.4)


def test_qwen35_filled_rows_feed_only_the_state_update(oracles, prompt, exact, maps):
    from ridgefill_cpp.oracle.qwen35 import GDNState, gdn_output, gdn_state_update

    o, ref = oracles["qwen35"], exact["qwen35"]
    S = _split(o)
    late_gdn = [il for il in range(S, o.n_layer) if o.is_recurrent(il)]
    assert late_gdn == [3, 4]
    out = fill_forward(o, prompt, split=S, maps=maps["qwen35"], tail=TAIL,
                       exact_positions=select_attention_rows(o, prompt, split=S, tail=TAIL))
    assert set(out.gdn_states) == {il for il in range(o.n_layer) if o.is_recurrent(il)}
    filled, ex = out.filled_rows, out.exact_rows
    for il in late_gdn:
        lw, cfg = o.layers[il], o.cfg
        # the recurrence runs over every row in position order, on the row's exact or predicted input
        u = rms_norm(out.layer_inputs[il], lw["attn_norm.weight"], cfg.rms_eps)
        upd = gdn_state_update(lw, cfg, u, GDNState.zeros(cfg, torch.float64))
        assert _rel(out.gdn_states[il].ssm, upd.state.ssm) < TOL
        assert _rel(out.gdn_states[il].conv, upd.state.conv) < TOL
        # exact rows read the shared state out; filled rows produce nothing past the update
        x_next = o.ffn_block(il, out.layer_inputs[il][ex] + gdn_output(lw, cfg, u, upd, ex))
        assert _rel(out.layer_inputs[il + 1][ex], x_next) < TOL
        # the filled rows do contribute: a recurrence over the exact rows alone ends elsewhere
        alone = gdn_state_update(lw, cfg, u[ex], GDNState.zeros(cfg, torch.float64)).state
        assert _rel(alone.ssm, upd.state.ssm) > 1e-3
    # layer S's inputs are exact for every row, so its final state is the exact one; the next is not
    assert _rel(out.gdn_states[S].ssm, ref.gdn_states[S].ssm) < TOL
    assert _rel(out.gdn_states[S + 1].ssm, ref.gdn_states[S + 1].ssm) > 1e-6
    # early GDN layers are untouched
    for il in range(S):
        if o.is_recurrent(il):
            assert torch.equal(out.gdn_states[il].ssm, ref.gdn_states[il].ssm)
    # the late gated-attention layer behaves as in the dense case (scale on V only)
    assert out.keys[5] is not None and out.keys[3] is None and out.keys[4] is None
    assert torch.equal(out.value_scale(3), torch.ones(o.n_head_kv, dtype=torch.float64))
    assert len(filled) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_key_scale_is_the_same_before_and_after_rope(arch, oracles, exact):
    """Issue #8 asks whether to measure the key scale before or after RoPE: RoPE rotates pairs of
    dimensions, so each head's key norm - and the scale - is the same either way (position 0 is no
    rotation). Measured on a late layer's exact and perturbed inputs at their real positions."""
    o = oracles[arch]
    il = o.n_layer - 1
    x = exact[arch].layer_inputs[il][-24:]
    x_pred = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype) * x.std()
    pos = torch.arange(100, 124)
    after = key_scale(o, il, x, x_pred, pos)
    before = key_scale(o, il, x, x_pred, torch.zeros_like(pos))
    assert torch.allclose(after, before, rtol=1e-12, atol=0)
    assert (after - 1).abs().max() > 1e-3  # the perturbation changed the key norms


# ------------------------------------------------------------------------------------------------
# qwen35: terminal-state correction groundwork (issue #5, oracle only; no libllama path yet)


def test_qwen35_state_gains_boundary_split_and_least_squares(oracles, prompt, exact, maps, tiny_models):
    from ridgefill_cpp.fitting.fit import calibration_tokens
    from ridgefill_cpp.oracle.state_correction import (boundary_pair, evaluate_correction, fit_state_gains,
                                                       gains_from_pairs, late_gdn_layers)
    from ridgefill_cpp.runtime.prefill import Llama

    o = oracles["qwen35"]
    S = _split(o)
    assert late_gdn_layers(o, S) == [3, 4]
    kw = dict(split=S, maps=maps["qwen35"], tail=TAIL, exact_positions=select_attention_rows(o, prompt, split=S, tail=TAIL))
    plain = fill_forward(o, prompt, **kw)
    # the recurrence in two pieces (prefix, tail) is the one-piece recurrence: gains of 1 change nothing
    ones = {il: torch.ones(o.cfg.n_v_heads, dtype=torch.float64) for il in (3, 4)}
    same = fill_forward(o, prompt, **kw, state_gains=ones)
    assert torch.equal(same.logits, plain.logits)
    from ridgefill_cpp.oracle.qwen35 import GDNState, gdn_state_update
    for il in (3, 4):
        lw, cfg = o.layers[il], o.cfg
        u = rms_norm(plain.layer_inputs[il], lw["attn_norm.weight"], cfg.rms_eps)
        whole = gdn_state_update(lw, cfg, u, GDNState.zeros(cfg, torch.float64))
        assert _rel(plain.gdn_states[il].ssm, whole.state.ssm) < TOL
        assert _rel(plain.boundary_states[il].ssm, whole.row_states[N_TOKENS - TAIL - 1]) < TOL
    # a gain of 0 at layer 4 empties the state the tail starts from: the tail rows see no prefix there
    zero = fill_forward(o, prompt, **kw, state_gains={4: torch.zeros(o.cfg.n_v_heads, dtype=torch.float64)})
    assert _rel(zero.logits, plain.logits) > 1e-6

    # fitted on calibration windows: the least-squares gain per head (layer S fills from x_S, its exact
    # input, so its boundary state is exact and its gain 1)
    llm = Llama(str(tiny_models["qwen35"]), vocab_only=True, verbose=False)
    try:
        cal = calibration_tokens(llm, corpus.default_documents("calibration"), 6 * (N_TOKENS - 1))
        bos = llm.token_bos()
    finally:
        llm.close()
    windows = [[bos] + cal[i * (N_TOKENS - 1):(i + 1) * (N_TOKENS - 1)] for i in range(6)]
    pairs = [boundary_pair(o, w, split=S, maps=maps["qwen35"], tail=TAIL) for w in windows]
    gains = gains_from_pairs(pairs)
    fitted = fit_state_gains(o, windows, split=S, maps=maps["qwen35"], tail=TAIL)
    assert set(fitted) == {3, 4} and all(torch.equal(fitted[il], gains[il]) for il in (3, 4))
    assert torch.allclose(gains[3], torch.ones_like(gains[3]), atol=1e-9)

    def sq_error(il, g):
        return sum(float(((p.filled[il] * g[:, None, None] - p.exact[il]) ** 2).sum()) for p in pairs)

    for il in (3, 4):
        best = sq_error(il, gains[il])
        for h in range(o.cfg.n_v_heads):
            for d in (-1e-3, 1e-3):
                g = gains[il].clone()
                g[h] += d
                assert sq_error(il, g) > best
    # held out (the test prompt): the corrected boundary state is nearer the exact one
    rep = evaluate_correction(o, prompt, gains, split=S, maps=maps["qwen35"], tail=TAIL)
    assert rep.boundary_without[3] < 1e-9 and rep.boundary_with[3] < 1e-9
    assert rep.boundary_with[4] < rep.boundary_without[4]
