"""The gpt-oss torch oracle (ridgefill_cpp.oracle.gpt_oss) against llama.cpp, on the tiny gpt-oss model.

The tiny model (ridgefill_cpp/testing/tiny_gpt_oss.py): 6 layers, sliding window 16 on layers 0, 2, 4 and full
attention on 1, 3, 5 (llama.cpp's load_swa_pattern(ml, 2)); 8 query / 2 KV heads of dim 16
(n_head · head_dim = 128 ≠ n_embd = 64); Q/K/V and output biases; attention sinks; NEOX RoPE with
YaRN (factor 8 over 256 original positions); 4 experts, 2 used, router and expert biases,
SWIGLU_OAI with its clamps. A variant: an explicit sliding-window pattern that starts with a full
layer and has two window layers in a row, a separate SWA RoPE base (rope.freq_base_swa) and a
``rope.scaling.attn_factor`` of 0.9 (YaRN's magnitude factor on cos and sin becomes
0.9 · (1 + 0.1 ln 8) instead of 1 + 0.1 ln 8); another: linear RoPE scaling (YaRN off).

Attention sinks need no flash attention: llama.cpp's non-FA path applies them in
``ggml_soft_max_add_sinks`` (build_attn_mha), and the CPU soft_max kernel implements them, so the
main comparisons run with an F32 KV cache and flash attention OFF. The flash-attention kernel takes
the sinks too (``ggml_flash_attn_ext_add_sinks``); it is checked against the oracle with K/V rounded
to F16 (``kv_f16=True``), with the looser tolerance F16 attention needs.

Prompts of 100-200 rows, 6 to 12 sliding windows. Measured on this machine's CPU backend
(max|Δ| / max|ref| per layer, "fro" = ‖Δ‖/‖ref‖; float64 oracle; the worst over 3 seeds × 3
model variants × 6 prompts, the tiny prompt and 5 random token sequences):

    free-running    layer inputs ≤ 4.1e-6, fro ≤ 8.4e-7, last-row logits ≤ 1.4e-6
    float32 oracle  layer inputs ≤ 4.8e-6, logits ≤ 2.4e-6
    layer by layer  next input ≤ 5.7e-7, fro ≤ 2.7e-7, logits ≤ 1.9e-7
    split decoding  (calls of 37/10/1 rows, ubatches of 8/3/1) layer inputs ≤ 1.0e-6, logits ≤ 1.2e-6
    flash attention vs the F16-K/V oracle (the tiny prompt): in one ubatch layer inputs ≤ 5.6e-5,
                    fro ≤ 3.1e-5, logits ≤ 2.6e-5 (the exact oracle: 7.2e-4); in ubatches of 8,
                    where the CPU kernel's per-row path also rounds Q and accumulates V in F16,
                    layer inputs ≤ 2.3e-3, fro ≤ 9.6e-4, logits ≤ 3.5e-3 (the exact oracle: 2.0e-3)

The tolerances below sit 2-5x above these figures. Every convention the oracle reproduces (sinks,
YaRN, the window pattern, biases, the router's softmax over the chosen experts, the activation's
clamps, ...) is checked to matter: getting it wrong fails the layer-by-layer comparison.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_PROMPT, tiny_model_fixture, tokenize
from test_oracle import _fmt, _rel, _within, free_running_errors, layer_by_layer_errors
from test_oracle import assert_kv_path_gives_the_cache, assert_kv_path_rows_are_independent, each_layer, set_hp
from ridgefill_cpp.testing import tiny_models as mtm
from ridgefill_cpp.testing import tiny_gpt_oss
from ridgefill_cpp.fitting.capture import capture_layer_inputs
from ridgefill_cpp.core.gguf_model import read_metadata, read_model_info, read_tensors
from ridgefill_cpp.maps.mapfile import MapFileMeta, RidgeMaps
from ridgefill_cpp.oracle import load_oracle
from ridgefill_cpp.oracle.common import ROPE_NORM, rms_norm
from ridgefill_cpp.oracle.dense import DenseOracle
from ridgefill_cpp.oracle.fill import (
    ROLE_FILLED,
    attention_scores,
    default_selector_layer,
    fill_forward,
    select_attention_rows,
)
from ridgefill_cpp.oracle.gpt_oss import (
    GptOssOracle,
    attention_probs_sinks,
    swiglu_oai,
    yarn_corr_dims,
    yarn_mscale,
)

#: free-running, float64 oracle: (layer inputs max rel, fro rel, last-row logits max rel)
TOL_FREE = (1e-5, 3e-6, 5e-6)
#: float32 oracle (its own rounding adds to llama.cpp's)
TOL_FLOAT32 = (1.5e-5, 5e-6, 1e-5)
#: layer by layer: (next layer input max rel, fro rel, logits max rel)
TOL_STEP = (2e-6, 1e-6, 1e-6)
#: flash attention on, against the oracle with F16 K/V: the prompt in one ubatch, and in ubatches
#: of 8 (the CPU kernel's per-row path then also rounds Q and the V sum to F16)
TOL_FA = {"one-ubatch": (2e-4, 1e-4, 1e-4), "calls37-ubatch8": (1e-2, 5e-3, 1e-2)}

N_TOKENS = 100
#: (decode call size, n_ubatch): several calls, ubatches that do not divide them, 1-row steps
SPLITS = [(37, 8), (10, 3), (1, 1)]

VARIANT = dict(swa_pattern=(False, True, True, False, True, False), rope_freq_base_swa=10000.0,
               rope_attn_factor=0.9)
LINEAR = dict(rope_scaling="linear", rope_scaling_factor=4.0)
#: YaRN's magnitude factor for the tiny model's factor 8 (get_mscale)
YARN_MSCALE = 1 + 0.1 * math.log(8)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------------
# fixtures and helpers


model = tiny_model_fixture(tiny_gpt_oss.build_gpt_oss, "tiny-gpt-oss", seed=0)
variant = tiny_model_fixture(tiny_gpt_oss.build_gpt_oss, "tiny-gpt-oss-variant", seed=1, **VARIANT)
linear_model = tiny_model_fixture(tiny_gpt_oss.build_gpt_oss, "tiny-gpt-oss-linear", seed=2, **LINEAR)


def _oracle(path: Path, dtype: torch.dtype = torch.float64, **options) -> GptOssOracle:
    return GptOssOracle(read_tensors(path), read_metadata(path), dtype=dtype, **options)


@pytest.fixture(scope="module")
def tokens(model) -> list[int]:
    """100 tokens of the tiny prompt, tokenized by llama.cpp (BOS first): six 16-row windows."""
    return tokenize(model, TINY_PROMPT, N_TOKENS)


@pytest.fixture(scope="module")
def random_tokens() -> list[list[int]]:
    """Two random token sequences of 160 and 200 rows (BOS first), ten and more windows."""
    rng = np.random.default_rng(7)
    return [[1] + rng.integers(3, 400, size=n - 1).tolist() for n in (160, 200)]


@pytest.fixture(scope="module")
def oracle64(model) -> GptOssOracle:
    return _oracle(model)


@pytest.fixture(scope="module")
def ref64(oracle64, tokens):
    return oracle64.forward(tokens)


@pytest.fixture(scope="module")
def captured(model, tokens):
    return capture_layer_inputs(model, tokens, n_ctx=256, flash_attn=False)


def _assert_close(err: dict, tol: tuple[float, float, float]) -> None:
    assert err["layer_max_rel"][0] == 0.0, _fmt(err)  # the embedding rows are copied exactly
    assert _within(err, tol), _fmt(err)
    assert err.get("same_argmax", True), _fmt(err)


# ------------------------------------------------------------------------------------------------
# the tiny model itself


def test_tiny_gpt_oss_file(model):
    md, t = read_metadata(model), read_tensors(model)
    a = "gpt-oss"
    assert md["general.architecture"] == a and md["tokenizer.ggml.model"] == "llama"
    assert (md[f"{a}.block_count"], md[f"{a}.embedding_length"], md[f"{a}.attention.head_count"],
            md[f"{a}.attention.head_count_kv"], md[f"{a}.attention.key_length"],
            md[f"{a}.rope.dimension_count"]) == (6, 64, 8, 2, 16, 16)
    assert (md[f"{a}.expert_count"], md[f"{a}.expert_used_count"], md[f"{a}.expert_feed_forward_length"]) == (4, 2, 32)
    assert md[f"{a}.attention.sliding_window"] == 16 and f"{a}.attention.sliding_window_pattern" not in md
    assert md[f"{a}.rope.scaling.type"] == "yarn" and md[f"{a}.rope.scaling.factor"] == 8.0
    assert md[f"{a}.rope.scaling.original_context_length"] == 256 and md[f"{a}.context_length"] == 2048
    assert md[f"{a}.rope.freq_base"] == 150000.0 and f"{a}.rope.freq_base_swa" not in md
    for il in range(6):
        p = f"blk.{il}."
        assert t[p + "attn_q.weight"].shape == (128, 64) and t[p + "attn_q.bias"].shape == (128,)
        assert t[p + "attn_k.weight"].shape == t[p + "attn_v.weight"].shape == (32, 64)
        assert t[p + "attn_k.bias"].shape == t[p + "attn_v.bias"].shape == (32,)
        assert t[p + "attn_output.weight"].shape == (64, 128) and t[p + "attn_output.bias"].shape == (64,)
        assert t[p + "attn_sinks.weight"].shape == (8,)
        assert t[p + "post_attention_norm.weight"].shape == (64,)
        assert t[p + "ffn_gate_inp.weight"].shape == (4, 64) and t[p + "ffn_gate_inp.bias"].shape == (4,)
        assert t[p + "ffn_gate_exps.weight"].shape == t[p + "ffn_up_exps.weight"].shape == (4, 32, 64)
        assert t[p + "ffn_down_exps.weight"].shape == (4, 64, 32)
        assert t[p + "ffn_gate_exps.bias"].shape == t[p + "ffn_up_exps.bias"].shape == (4, 32)
        assert t[p + "ffn_down_exps.bias"].shape == (4, 64)
        assert p + "ffn_gate.weight" not in t and p + "attn_q_norm.weight" not in t
    assert "output.weight" in t
    # llama.cpp's layer pattern for gpt-oss, as the package's model summary reads it
    info = read_model_info(model)
    assert info.swa_layers == (0, 2, 4) and info.sliding_window == 16 and info.head_dim == 16


def test_tiny_gpt_oss_deterministic_validated_and_f16(tmp_path):
    a = tiny_gpt_oss.build_gpt_oss(tmp_path / "a.gguf", seed=5)
    b = mtm.make_tiny_model("gpt-oss", tmp_path / "b.gguf", seed=5)  # the same through tiny_models
    c = tiny_gpt_oss.build_gpt_oss(tmp_path / "c.gguf", seed=6)
    sha = [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in (a, b, c)]
    assert sha[0] == sha[1] != sha[2]
    assert "gpt-oss" in mtm.ARCHS
    import gguf

    h = tiny_gpt_oss.build_gpt_oss(tmp_path / "h.gguf", seed=5, dtype="f16", n_layer=2)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(h).tensors}
    F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    assert types["blk.1.attn_q.weight"] == types["blk.1.ffn_gate_exps.weight"] == F16
    assert types["blk.1.ffn_down_exps.weight"] == types["output.weight"] == F16
    assert types["blk.1.attn_sinks.weight"] == types["blk.1.ffn_down_exps.bias"] == F32
    assert types["blk.1.attn_norm.weight"] == types["blk.1.attn_q.bias"] == F32
    assert "blk.2.attn_q.weight" not in types
    v = read_metadata(tiny_gpt_oss.build_gpt_oss(tmp_path / "v.gguf", seed=1, **VARIANT))
    assert v["gpt-oss.attention.sliding_window_pattern"] == list(VARIANT["swa_pattern"])
    assert v["gpt-oss.rope.freq_base_swa"] == 10000.0
    with pytest.raises(TypeError, match="unknown tiny-model option"):
        tiny_gpt_oss.build_gpt_oss(tmp_path / "x.gguf", n_experts=4)
    with pytest.raises(ValueError, match="n_expert_used"):
        tiny_gpt_oss.build_gpt_oss(tmp_path / "x.gguf", n_expert_used=5)
    with pytest.raises(ValueError, match="swa_pattern has 2 entries"):
        tiny_gpt_oss.build_gpt_oss(tmp_path / "x.gguf", swa_pattern=(True, False))
    assert not (tmp_path / "x.gguf").exists()


def test_the_tiny_model_reaches_every_path(oracle64, ref64):
    """Not trivial: the sinks take a real share of attention, YaRN ramps inside the rotary pairs,
    every expert is chosen by some rows and not by others, and the activation's clamps bite."""
    hp = oracle64.hp
    assert hp.window == (16, 0, 16, 0, 16, 0) and hp.rope_mode == "neox"
    assert hp.rope_ext_factor == 1.0 and hp.rope_scale == (0.125,) * 6 and hp.n_ctx_orig == 256
    lo, hi = yarn_corr_dims(hp.n_rot, hp.n_ctx_orig, hp.rope_base[0], 32.0, 1.0)
    assert 0 <= lo < hi < hp.n_rot // 2  # some pairs extrapolate, some interpolate, some mix
    # YaRN's magnitude: llama.cpp's attn_factor cancels ggml's own 1 + 0.1 ln(1/freq_scale) and puts
    # get_mscale(8) = 1 + 0.1 ln 8 in its place: the same number, so cos and sin are scaled by it
    assert abs(yarn_mscale(hp.rope_attn_factor, 0.125, 1.0) - YARN_MSCALE) < 1e-6
    pos = torch.arange(N_TOKENS)
    n_clamped = n_act = 0
    for il in range(hp.n_layer):
        x = ref64.layer_inputs[il]
        probs = oracle64.attention_weights(il, x, pos, ref64.keys[il], pos)
        sink_share = 1 - probs.sum(-1)
        assert 0.02 < float(sink_share.mean()) < 0.6 and float(sink_share.min()) > 0
        x_mid = x + oracle64.attend(il, oracle64.q_path(il, rms_norm(x, oracle64.layers[il].attn_norm, hp.rms_eps), pos),
                                    pos, ref64.keys[il], ref64.values[il], pos)
        ids, w = oracle64.router(il, x_mid)
        counts = torch.bincount(ids.flatten(), minlength=hp.n_expert)
        assert bool((counts > 0).all()) and bool((counts < N_TOKENS).all()), counts
        assert torch.allclose(w.sum(-1), torch.ones(N_TOKENS, dtype=torch.float64), rtol=0, atol=1e-12)
        L = oracle64.layers[il]
        u = rms_norm(x_mid, L.ffn_norm, hp.rms_eps)
        for e in range(hp.n_expert):
            g, up = u @ L.gate_exps[e].T + L.gate_exps_b[e], u @ L.up_exps[e].T + L.up_exps_b[e]
            n_clamped += int((g > 7).sum() + (up.abs() > 7).sum())
            n_act += 2 * g.numel()
    assert 0.005 < n_clamped / n_act < 0.2, n_clamped / n_act


# ------------------------------------------------------------------------------------------------
# the numerics written out


def test_sinks_softmax_and_swiglu_oai_by_hand():
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((3, 4, 8)))
    k = torch.from_numpy(rng.standard_normal((5, 2, 8)))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    allowed = torch.tensor([[True, False, False, False, False], [True, True, False, False, False],
                            [False, True, True, True, True]])
    p = attention_probs_sinks(q, k, allowed, 0.3, sinks)
    for h in range(4):
        for i in range(3):
            s = [float(q[i, h] @ k[j, h // 2]) * 0.3 for j in range(5)]
            z = sum(math.exp(s[j]) for j in range(5) if allowed[i, j]) + math.exp(float(sinks[h]))
            for j in range(5):
                want = math.exp(s[j]) / z if allowed[i, j] else 0.0
                assert abs(float(p[h, i, j]) - want) < 1e-12
    # no sinks: an ordinary softmax
    assert torch.allclose(attention_probs_sinks(q, k, allowed, 0.3, None).sum(-1),
                          torch.ones(4, 3, dtype=torch.float64), rtol=0, atol=1e-12)
    g = torch.tensor([-3.0, 0.5, 6.9, 7.0, 12.0], dtype=torch.float64)
    u = torch.tensor([-9.0, 0.25, 3.0, 8.0, -7.5], dtype=torch.float64)
    want = [min(a, 7.0) / (1 + math.exp(-1.702 * min(a, 7.0))) * (max(-7.0, min(b, 7.0)) + 1)
            for a, b in zip(g.tolist(), u.tolist())]
    assert torch.allclose(swiglu_oai(g, u), torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)


# ------------------------------------------------------------------------------------------------
# oracle vs llama.cpp


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_oracle_matches_llama_cpp(model, tokens, captured, dtype, record_property):
    oracle = _oracle(model, dtype)
    err = free_running_errors(oracle, tokens, captured)
    record_property("agreement", err)
    print(f"\ngpt-oss {dtype}: {_fmt(err)}")
    _assert_close(err, TOL_FREE if dtype == torch.float64 else TOL_FLOAT32)


def test_oracle_matches_llama_cpp_on_long_random_prompts(model, oracle64, random_tokens):
    for toks in random_tokens:
        cap = capture_layer_inputs(model, toks, n_ctx=256, flash_attn=False)
        err = free_running_errors(oracle64, toks, cap)
        print(f"\ngpt-oss {len(toks)} random tokens: {_fmt(err)}")
        _assert_close(err, TOL_FREE)


def test_each_layer_matches_llama_cpp(oracle64, tokens, captured):
    err = layer_by_layer_errors(oracle64, tokens, captured)
    print(f"\ngpt-oss layer by layer: {_fmt(err)}")
    _assert_close(err, TOL_STEP)


@pytest.mark.parametrize("chunk,n_ubatch", SPLITS, ids=[f"calls{c}-ubatch{u}" for c, u in SPLITS])
def test_split_decoding_matches_oracle(model, tokens, oracle64, chunk, n_ubatch):
    """Several decode calls and small ubatches (the sliding-window cache then holds rows of earlier
    ubatches; a 1-row ubatch is the generation path) give the same rows."""
    cap = capture_layer_inputs(model, tokens, n_ctx=256, chunk=chunk, n_ubatch=n_ubatch, flash_attn=False)
    err = free_running_errors(oracle64, tokens, cap)
    print(f"\ngpt-oss calls of {chunk}, ubatch {n_ubatch}: {_fmt(err)}")
    _assert_close(err, TOL_FREE)


@pytest.mark.parametrize("chunk,n_ubatch,case", [(100, 100, "one-ubatch"), (37, 8, "calls37-ubatch8")],
                         ids=["one-ubatch", "calls37-ubatch8"])
def test_flash_attention_against_f16_kv_oracle(model, tokens, chunk, n_ubatch, case):
    """The flash-attention kernel applies the sinks as the soft_max path does: the F16-K/V oracle
    agrees within F16 attention noise, and one without sinks does not."""
    cap = capture_layer_inputs(model, tokens, n_ctx=256, chunk=chunk, n_ubatch=n_ubatch, flash_attn=True)
    oracle = _oracle(model, kv_f16=True)
    err = free_running_errors(oracle, tokens, cap)
    print(f"\ngpt-oss flash attention, calls of {chunk}, ubatch {n_ubatch}: {_fmt(err)}")
    _assert_close(err, TOL_FA[case])
    for layer in oracle.layers:
        layer.sinks = None
    assert not _within(free_running_errors(oracle, tokens, cap), TOL_FA[case])


@pytest.mark.parametrize("which", ["variant", "linear"])
def test_variant_models_match_llama_cpp(which, variant, linear_model, tokens):
    """variant: the explicit window pattern (full first, two window layers in a row), the SWA
    layers' own RoPE base, rope.scaling.attn_factor 0.9; linear: plain linear RoPE scaling."""
    path = variant if which == "variant" else linear_model
    oracle = _oracle(path)
    hp = oracle.hp
    if which == "variant":
        assert hp.window == (0, 16, 16, 0, 16, 0)
        assert hp.rope_base == (150000.0, 10000.0, 10000.0, 150000.0, 10000.0, 150000.0)
        assert abs(yarn_mscale(hp.rope_attn_factor, 0.125, 1.0) - 0.9 * YARN_MSCALE) < 1e-6
    else:
        assert hp.rope_ext_factor == 0.0 and hp.rope_scale == (0.25,) * 6
    cap = capture_layer_inputs(path, tokens, n_ctx=256, chunk=37, n_ubatch=8, flash_attn=False)
    err = free_running_errors(oracle, tokens, cap)
    print(f"\ngpt-oss {which}: {_fmt(err)}")
    _assert_close(err, TOL_FREE)
    _assert_close(layer_by_layer_errors(oracle, tokens, cap), TOL_STEP)


def test_kv_path_reproduces_the_cache_rows(oracle64, ref64):
    assert_kv_path_gives_the_cache(oracle64, ref64, (N_TOKENS, 2, 16))
    assert_kv_path_rows_are_independent(oracle64, ref64, (0, 5))
    # the K/V path, written from the weights: attn_norm, projection + bias, RoPE on K only
    L = oracle64.layers[3]
    h = rms_norm(ref64.layer_inputs[3], L.attn_norm, oracle64.hp.rms_eps)
    v = (h @ L.wv.T + L.bv).reshape(N_TOKENS, 2, 16)
    assert torch.equal(ref64.values[3], v)
    k0 = (h @ L.wk.T + L.bk).reshape(N_TOKENS, 2, 16)
    assert torch.equal(ref64.keys[3][0], k0[0] * yarn_mscale(oracle64.hp.rope_attn_factor, 0.125, 1.0))  # position 0


# ------------------------------------------------------------------------------------------------
# the comparison is sharp: getting any convention wrong fails it


def _mutations(n_layer: int) -> dict:
    hp = set_hp

    def setf(attr, fn):
        return each_layer(lambda o, L: setattr(L, attr, fn(o, getattr(L, attr))))

    def router(kind):
        def mutate(o):
            def route(il, x_mid):
                L, p = o.layers[il], o.hp
                z = rms_norm(x_mid, L.ffn_norm, p.rms_eps) @ L.router.T + (0 if kind == "no bias" else L.router_b)
                if kind == "softmax over all":
                    top, ids = torch.topk(torch.softmax(z, -1), p.n_expert_used, dim=-1)
                    return ids, top
                top, ids = torch.topk(z, p.n_expert_used, dim=-1)
                return ids, torch.softmax(top, -1)
            o.router = route
        return mutate

    def act(f):
        import ridgefill_cpp.oracle.gpt_oss as G

        def mutate(o):
            orig_ffn = type(o).ffn

            def ffn(il, x_mid):
                saved = G.swiglu_oai
                G.swiglu_oai = f
                try:
                    return orig_ffn(o, il, x_mid)
                finally:
                    G.swiglu_oai = saved
            o.ffn = ffn
        return mutate

    return {
        "no attention sinks": setf("sinks", lambda o, s: None),
        "sinks times the attention scale": setf("sinks", lambda o, s: s * o.hp.attn_scale),
        "one sink per KV head": setf("sinks", lambda o, s: s.reshape(2, -1)[:, :1].repeat(1, 4).flatten()),
        "no sliding window": hp(window=(0,) * n_layer),
        "window one row too wide": lambda o: setattr(o, "hp", dataclasses.replace(
            o.hp, window=tuple(w + 1 if w else 0 for w in o.hp.window))),
        "odd layers slide instead": lambda o: setattr(o, "hp", dataclasses.replace(
            o.hp, window=tuple(16 if il % 2 else 0 for il in range(n_layer)))),
        "RoPE NORM instead of NEOX": hp(rope_mode=ROPE_NORM),
        "no YaRN (plain interpolation)": hp(rope_ext_factor=0.0),
        "no RoPE scaling": hp(rope_ext_factor=0.0, rope_scale=(1.0,) * n_layer),
        "YaRN beta_fast 4 (ramp over pairs 1..3, not 0..3)": hp(yarn_beta_fast=4.0),
        "YaRN beta_slow 0.25 (ramp over pairs 0..4)": hp(yarn_beta_slow=0.25),
        "YaRN over the full context": hp(n_ctx_orig=2048),
        "no YaRN magnitude factor": hp(rope_attn_factor=1 / YARN_MSCALE),
        "attention scale 1/sqrt(n_embd/n_head)": hp(attn_scale=1 / math.sqrt(8)),
        "no Q bias": setf("bq", lambda o, b: None),
        "no K bias": setf("bk", lambda o, b: None),
        "no V bias": setf("bv", lambda o, b: None),
        "no output bias": setf("bo", lambda o, b: torch.zeros_like(b)),
        "router without its bias": router("no bias"),
        "expert weights: softmax over all experts": router("softmax over all"),
        "top-1 expert": hp(n_expert_used=1),
        "no expert biases": each_layer(lambda o, L: [setattr(L, n, torch.zeros_like(getattr(L, n)))
                                                     for n in ("gate_exps_b", "up_exps_b", "down_exps_b")]),
        "SwiGLU instead of SWIGLU_OAI": act(lambda g, u: g * torch.sigmoid(g) * u),
        "no clamps": act(lambda g, u: g * torch.sigmoid(1.702 * g) * (u + 1)),
        "up without the +1": act(lambda g, u: (lambda x: x * torch.sigmoid(1.702 * x))(torch.clamp(g, max=7.0))
                                 * torch.clamp(u, -7.0, 7.0)),
    }


def test_wrong_conventions_are_detected(model, oracle64, tokens, captured):
    assert _within(layer_by_layer_errors(oracle64, tokens, captured), TOL_STEP)
    for name, mutate in _mutations(oracle64.n_layer).items():
        oracle = _oracle(model)
        mutate(oracle)
        err = layer_by_layer_errors(oracle, tokens, captured)
        assert not _within(err, TOL_STEP), f"'{name}' went unnoticed: {_fmt(err)}"


def test_variant_conventions_are_detected(variant, tokens):
    cap = capture_layer_inputs(variant, tokens, n_ctx=256, flash_attn=False)
    assert _within(layer_by_layer_errors(_oracle(variant), tokens, cap), TOL_STEP)
    mutations = {
        "the full layers' RoPE base on every layer": lambda o: setattr(o, "hp", dataclasses.replace(
            o.hp, rope_base=(o.hp.rope_base[0],) * o.n_layer)),
        "the default period-2 pattern": lambda o: setattr(o, "hp", dataclasses.replace(
            o.hp, window=tuple(16 if il % 2 == 0 else 0 for il in range(o.n_layer)))),
        "no attn_factor": lambda o: setattr(o, "hp", dataclasses.replace(o.hp, rope_attn_factor=1.0)),
    }
    for name, mutate in mutations.items():
        oracle = _oracle(variant)
        mutate(oracle)
        err = layer_by_layer_errors(oracle, tokens, cap)
        assert not _within(err, TOL_STEP), f"'{name}' went unnoticed: {_fmt(err)}"


# ------------------------------------------------------------------------------------------------
# RidgeFill's fill and selector on gpt-oss (ridgefill_cpp.oracle.fill)


def _oracle_maps(oracle: GptOssOracle, tokens, split: int) -> RidgeMaps:
    """Ridge maps fitted on the oracle's own exact states of `tokens` (normalised inputs; λ = 1e-2):
    stand-ins for `ridgefill-gguf fit`'s, which read llama.cpp's states."""
    out = oracle.forward(tokens)
    xs = out.layer_inputs[split].numpy()
    xn = xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + 1e-6)
    X = np.concatenate([xn, np.ones((len(xn), 1))], axis=1)
    layers = list(range(split + 1, oracle.n_layer))
    a, b = {}, {}
    for il in layers:
        W = np.linalg.solve(X.T @ X + 1e-2 * np.eye(X.shape[1]), X.T @ out.layer_inputs[il].numpy())
        a[il], b[il] = W[:-1].T.astype(np.float32), W[-1].astype(np.float32)
    meta = MapFileMeta(architecture="gpt-oss", split_layer=split, n_layer=oracle.n_layer, n_embd=oracle.hp.n_embd,
                       objective="normalized", input_norm_eps=1e-6, layers=layers)
    return RidgeMaps(meta=meta, a=a, b=b)


def test_default_selector_layer_skips_the_window_layers(oracle64):
    for split, want in ((2, 1), (3, 1), (4, 3), (5, 3), (6, 5)):
        il = default_selector_layer(oracle64, split)
        assert il == want and oracle64.attention_window(il) == 0
    with pytest.raises(ValueError, match="no full-attention layer below split 1"):
        default_selector_layer(oracle64, 1)


def test_attention_scores_carry_the_sinks(oracle64, tokens, ref64):
    """The selector's scores are the probabilities with the sink in the denominator: summed over
    heads and query rows they total n_head · n_q minus the sinks' shares, each share being
    1 / (1 + Σ_j exp(s_j - sink_h)) over the keys j the row sees (written out here)."""
    layer = default_selector_layer(oracle64, 4)
    scores = attention_scores(oracle64, tokens, layer, n_queries=64)
    x, pos = ref64.layer_inputs[layer], torch.arange(N_TOKENS)
    L, hp = oracle64.layers[layer], oracle64.hp
    q = oracle64.q_path(layer, rms_norm(x[-64:], L.attn_norm, hp.rms_eps), pos[-64:])
    k = ref64.keys[layer].repeat_interleave(4, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * hp.attn_scale
    s = s.masked_fill(pos[None, :] > pos[-64:, None], float("-inf"))
    share = 1 / (1 + torch.exp(s - L.sinks[:, None, None]).sum(-1))  # [n_head, 64]
    assert abs(float(scores.sum()) - float((1 - share).sum())) < 1e-9
    assert 0.02 * 8 * 64 < float(share.sum()) < 0.6 * 8 * 64
    want = (torch.exp(s) / (torch.exp(s).sum(-1, keepdim=True) + torch.exp(L.sinks)[:, None, None])).sum((0, 1))
    assert torch.allclose(scores, want, rtol=1e-10, atol=1e-12)
    # a window layer cannot see rows further back than its window: they get nothing there
    at_swa = attention_scores(oracle64, tokens, 2, n_queries=64)
    far = N_TOKENS - 64 - 15
    assert float(at_swa[:far].abs().max()) == 0.0 and float(at_swa[far:].min()) > 0
    assert float(scores[:far].min()) > 0


def test_fill_degenerate_cases(oracle64, tokens):
    L = oracle64.n_layer
    ref64 = oracle64.forward(tokens, last_only=True)
    for kw in (dict(split=L, tail=8), dict(split=3, tail=N_TOKENS)):
        out = fill_forward(oracle64, tokens, **kw)
        assert not out.active
        assert torch.equal(out.logits, ref64.logits) and torch.equal(out.layer_inputs, ref64.layer_inputs)
        for il in range(L):
            assert torch.equal(out.keys[il], ref64.keys[il]) and torch.equal(out.values[il], ref64.values[il])
    out = fill_forward(oracle64, tokens, split=3, tail=8, exact_positions=range(N_TOKENS - 8))
    assert out.active and not bool((out.roles == ROLE_FILLED).any())
    assert _rel(out.last_logits, ref64.logits[-1])[0] < 1e-10
    assert _rel(out.layer_inputs, ref64.layer_inputs)[0] < 1e-10


@pytest.mark.parametrize("split", [2, 3])
def test_fill_with_maps_and_the_selector(oracle64, tokens, ref64, random_tokens, split):
    """A fill over a full-attention (S = 3) or window (S = 2) split layer: filled rows' K/V are the
    layer's own K/V path on the prediction (V rescaled), exact rows' on their carried input, and
    the filled rows never reach the router or the experts."""
    maps = _oracle_maps(oracle64, random_tokens[1], split)
    tail = 12
    chosen = select_attention_rows(oracle64, tokens, split=split, tail=tail, fraction=0.1)
    assert len(chosen) == math.ceil(0.1 * (N_TOKENS - tail))
    seen: list[tuple[int, int]] = []
    orig_router = oracle64.router

    def router(il, x_mid):
        seen.append((il, x_mid.shape[0]))
        return orig_router(il, x_mid)

    oracle64.router = router
    try:
        out = fill_forward(oracle64, tokens, split=split, maps=maps, tail=tail, exact_positions=chosen)
    finally:
        del oracle64.router
    filled, ex = out.filled_rows, out.exact_rows
    assert len(filled) == N_TOKENS - tail - len(chosen) and len(ex) == tail + len(chosen)
    assert seen == [(il, N_TOKENS) for il in range(split)] + [(il, len(ex)) for il in range(split, 6)]
    x_split = ref64.layer_inputs[split]
    for il in range(split, oracle64.n_layer):
        pred = x_split[filled] if il == split else torch.from_numpy(maps.predict(il, x_split[filled].numpy()))
        k, v = oracle64.kv_path(il, pred, out.positions[filled])
        assert _rel(out.keys[il][filled], k)[0] < 1e-10
        assert _rel(out.values[il][filled], v * out.value_scale(il)[None, :, None])[0] < 1e-10
        k, v = oracle64.kv_path(il, out.layer_inputs[il][ex], out.positions[ex])
        assert _rel(out.keys[il][ex], k)[0] < 1e-10 and _rel(out.values[il][ex], v)[0] < 1e-10
    # the fill changed the output, by a little: ridge maps beat identity fill
    kl = {}
    for name, m in (("ridge", maps), ("identity", None)):
        o = fill_forward(oracle64, tokens, split=split, maps=m, tail=tail, exact_positions=chosen)
        lp, lq = torch.log_softmax(ref64.logits[-1], -1), torch.log_softmax(o.last_logits, -1)
        kl[name] = float((lp.exp() * (lp - lq)).sum())
    print(f"\ngpt-oss S={split} last-row KL to exact: {kl}")
    assert 0 < kl["ridge"] < kl["identity"]


# ------------------------------------------------------------------------------------------------
# dispatch


def test_load_oracle_dispatch(model, tmp_path):
    assert type(load_oracle(model)) is GptOssOracle
    with pytest.raises(ValueError, match="DenseOracle implements llama, qwen3, gemma3, not 'gpt-oss'"):
        DenseOracle(read_tensors(model), read_metadata(model))
    q3 = mtm.make_tiny_model("qwen3", tmp_path / "q3.gguf", seed=0)
    with pytest.raises(ValueError, match="GptOssOracle implements gpt-oss, not 'qwen3'"):
        _oracle(q3)
