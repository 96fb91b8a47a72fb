"""The oracle of qwen2, mistral3 and qwen3moe (ridgefill_cpp.oracle.dense_more) against llama.cpp itself,
on their tiny models (ridgefill_cpp/testing/tiny_dense_more.py), and the tiny models themselves.

For each architecture, seeds 0, 1, 2 and the 100-token prompt, llama.cpp (F32 KV cache, flash
attention OFF, as in test_oracle.py) gives its layer inputs (the layer-input tap), the last row's
logits and, from a logits_all context, every row's logits. The oracle must agree:

* free-running: the oracle's own forward from the tokens, every layer input and the logits;
* every row's logits (all 100, not only the last);
* layer by layer: each oracle layer fed llama.cpp's input of that layer, against llama.cpp's input
  of the next, and the output head on llama.cpp's last hidden state;

on the default tiny models and on variants that switch on the optional paths: qwen2 with a tied
head and ``output.bias``; qwen2 with one fused ``attn_qkv`` weight and bias; mistral3 with YaRN (factor 4, original context 32, so the ramp and the
magnitude factor act) and the attention temperature (τ = 0.1, floor scale 32: the query scale
steps at rows 32, 64 and 96); mistral3 with YaRN as Ministral 3 sets it (``yarn_log_multiplier``
1: the magnitude factor cancels to 1; factor 8, original context 48); mistral3's MoE branch with ``attn_output.bias``; mistral3 with MLP
biases and an untied head.

Measured on this machine's CPU backend (float64 oracle; relative error = max|Δ| / max|ref|, "fro" =
‖Δ‖/‖ref‖; the worst over 3 seeds × 6 prompts: the text prompt and 5 of random tokens):

    free-running        layer inputs   fro       last-row logits   all-row logits
      qwen2               5.2e-7       3.9e-7       6.8e-7            7.5e-7
      mistral3            6.5e-7       3.9e-7       5.0e-7            6.7e-7
      qwen3moe            6.9e-7       4.7e-7       8.6e-7            8.2e-7
      qwen2 tied+bias     5.2e-7       4.0e-7       5.3e-7            6.6e-7
      qwen2 fused qkv     (the qwen2 figures: the same weights in one attn_qkv tensor)
      mistral3 yarn+temp  8.7e-7       5.4e-7       1.0e-6            1.3e-6
      mistral3 yarn+lmul  5.7e-7       4.0e-7       6.4e-7            7.3e-7
      mistral3 moe        5.6e-7       4.4e-7       1.1e-6            9.9e-7
      mistral3 biases     4.7e-7       4.0e-7       5.3e-7            7.4e-7
    layer by layer      next input     fro       logits
      all variants        ≤ 4.1e-7     ≤ 2.5e-7     ≤ 2.2e-7
    float32 oracle: all-row logits ≤ 2.3e-6 (float64 vs float32 oracle ≤ 1.6e-6)
    F16 weights (llama.cpp's CPU backend rounds the activations to f16 for f16 matrices), 3 seeds
    × 6 prompts: last-row logits ≤ 2.7e-4 / 5.1e-4 / 7.4e-4 (qwen2 / mistral3 / qwen3moe), all-row
    logits ≤ 2.7e-4 / 7.1e-4 and, for qwen3moe, 1.4e-2: at f16 precision some rows of a random
    prompt are routed to another expert (the router margins are far above float32 noise, not f16's)

The routing is decisive: the smallest gap between the 2nd and 3rd expert's router probability over
every row and layer of those prompts is 3.3e-6 (qwen3moe) and 1.0e-5 (mistral3 moe), against float32
rounding of ~1e-7 on probabilities of ~0.3, so the oracle and llama.cpp choose the same experts. The
tolerances below sit 2-5x above the worst figures; the mutation test shows that each convention of
the oracle (RoPE mode, biases, factors, YaRN's ramp and magnitude, the temperature, QK-norm, the
expert count and weight renormalisation) is visible at them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest
import torch

from ridgefill_cpp.testing import tiny_models as mtm
from ridgefill_cpp.testing import tiny_dense_more as tdm
from conftest import TINY_PROMPT, tokenize
from test_oracle import _fmt, _rel, _within, free_running_errors, layer_by_layer_errors
from test_oracle import assert_kv_path_gives_the_cache, assert_kv_path_rows_are_independent

from ridgefill_cpp.fitting.capture import capture_layer_inputs, open_model
from ridgefill_cpp.core.gguf_model import read_metadata, read_tensors
from ridgefill_cpp.oracle import SUPPORTED_ARCHITECTURES, MoreDenseOracle, load_oracle, oracle_class
from ridgefill_cpp.oracle.common import ROPE_NEOX, ROPE_NORM, rms_norm
from ridgefill_cpp.oracle.fill import ROLE_FILLED, fill_forward, select_attention_rows

ARCHS = tdm.ARCHS
SEEDS = (0, 1, 2)
N_TOKENS = 100

#: name -> (architecture, tiny-model overrides)
VARIANTS = {
    "qwen2": ("qwen2", {}),
    "mistral3": ("mistral3", {}),
    "qwen3moe": ("qwen3moe", {}),
    "qwen2-tied-outbias": ("qwen2", dict(tied_embeddings=True, output_bias=True)),
    "qwen2-fused-qkv": ("qwen2", dict(fused_qkv=True)),
    "mistral3-yarn-temp": ("mistral3", dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_orig_ctx=32,
                                            yarn_beta_fast=32.0, yarn_beta_slow=1.0, attn_temp_scale=0.1)),
    "mistral3-yarn-logmul": ("mistral3", dict(rope_scaling="yarn", rope_scaling_factor=8.0, rope_orig_ctx=48,
                                              yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_log_mul=1.0)),
    "mistral3-moe": ("mistral3", dict(n_expert=4, n_expert_used=2, n_ff=32, attn_out_bias=True)),
    "mistral3-biases": ("mistral3", dict(ffn_bias=True, attn_out_bias=True, tied_embeddings=False)),
}
CASES = [(name, seed) for name in VARIANTS for seed in SEEDS]

#: free-running: (layer inputs max rel, layer inputs fro rel, last-row logits max rel, all-row logits max rel)
TOL_FREE = (3e-6, 2e-6, 3e-6, 4e-6)
#: layer by layer: (next layer input max rel, fro rel, logits max rel)
TOL_STEP = (1.5e-6, 1e-6, 1e-6)
#: the float32 oracle: (all-row logits vs llama.cpp, vs the float64 oracle)
TOL_F32 = (6e-6, 5e-6)
#: F16 matrices: logits (llama.cpp rounds the activations to f16); qwen3moe: the last row only
TOL_F16 = 2e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _case_id(case) -> str:
    return f"{case[0]}-s{case[1]}"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, int], object]:
    root = tmp_path_factory.mktemp("tiny-more")
    return {(name, seed): mtm.make_tiny_model(arch, root / f"{name}-{seed}.gguf", seed=seed, **over)
            for name, (arch, over) in VARIANTS.items() for seed in SEEDS}


@pytest.fixture(scope="module")
def prompt_tokens(models) -> list[int]:
    """~100 tokens of TINY_PROMPT, tokenized by llama.cpp with the shared tiny vocabulary (BOS first)."""
    return tokenize(models[("qwen2", 0)], TINY_PROMPT, N_TOKENS)


def _all_logits(path, tokens) -> np.ndarray:
    llm = open_model(path, n_ctx=256, n_batch=128, flash_attn=False, logits_all=True)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def reference(models, prompt_tokens):
    """(name, seed) -> (llama.cpp's layer inputs and last-row logits, every row's logits)."""
    return {case: (capture_layer_inputs(path, prompt_tokens, n_ctx=256, flash_attn=False),
                   _all_logits(path, prompt_tokens))
            for case, path in models.items()}


@pytest.fixture(scope="module")
def oracles(models) -> dict:
    return {case: load_oracle(path, dtype=torch.float64) for case, path in models.items()}


# ------------------------------------------------------------------------------------------------
# the oracle against llama.cpp


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_oracle_matches_llama_cpp(case, oracles, prompt_tokens, reference, record_property):
    oracle = oracles[case]
    assert isinstance(oracle, MoreDenseOracle) and oracle.arch == VARIANTS[case[0]][0]
    cap, every = reference[case]
    err = free_running_errors(oracle, prompt_tokens, cap)
    err["all_logits_max_rel"] = _rel(oracle.forward(prompt_tokens).logits, every)[0]
    record_property("free_running", err)
    print(f"\n{_case_id(case)} free-running: {_fmt(err)} | all rows {err['all_logits_max_rel']:.1e}")
    assert err["layer_max_rel"][0] == 0.0  # the embedding rows are exact
    t_max, t_fro, t_logits, t_all = TOL_FREE
    assert max(err["layer_max_rel"]) <= t_max, err
    assert max(err["layer_fro_rel"]) <= t_fro, err
    assert err["logits_max_rel"] <= t_logits, err
    assert err["all_logits_max_rel"] <= t_all, err
    assert err["same_argmax"]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_layer_matches_llama_cpp(case, oracles, prompt_tokens, reference, record_property):
    err = layer_by_layer_errors(oracles[case], prompt_tokens, reference[case][0])
    record_property("layer_by_layer", err)
    print(f"\n{_case_id(case)} layer by layer: {_fmt(err)}")
    assert _within(err, TOL_STEP), err


@pytest.mark.parametrize("name", list(VARIANTS))
def test_float32_oracle(name, models, prompt_tokens, reference, oracles):
    case = (name, 0)
    o32 = load_oracle(models[case], dtype=torch.float32)
    a = o32.forward(prompt_tokens).logits
    b = oracles[case].forward(prompt_tokens).logits
    assert a.dtype == torch.float32 and b.dtype == torch.float64
    assert _rel(a, reference[case][1])[0] <= TOL_F32[0]
    assert _rel(a, b.numpy())[0] <= TOL_F32[1]


def test_yarn_betas_of_a_llama_cpp_python_context(tmp_path, prompt_tokens):
    """llama-cpp-python's Llama passes yarn_beta_fast = 32 and yarn_beta_slow = 1 explicitly, which
    override mistral3's rope.scaling.yarn_beta_* keys (llama_context takes a value >= 0 over the
    model's): with betas 8 / 2 in the file, the oracle matches llama.cpp only with yarn_beta=(32, 1)."""
    path = mtm.make_tiny_model("mistral3", tmp_path / "m.gguf", rope_scaling="yarn", rope_scaling_factor=4.0,
                               rope_orig_ctx=32, yarn_beta_fast=8.0, yarn_beta_slow=2.0)
    ref = _all_logits(path, prompt_tokens)
    own = load_oracle(path, dtype=torch.float64)
    forced = load_oracle(path, dtype=torch.float64, yarn_beta=(32.0, 1.0))
    assert own.hp.yarn_corr_dims == (0.0, 1.0) and forced.hp.yarn_corr_dims == (0.0, 2.0)
    assert _rel(forced.forward(prompt_tokens).logits, ref)[0] <= TOL_FREE[3]
    assert _rel(own.forward(prompt_tokens).logits, ref)[0] > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_f16_weights(arch, tmp_path, prompt_tokens):
    path = mtm.make_tiny_model(arch, tmp_path / f"{arch}-f16.gguf", seed=0, dtype="f16")
    ours = load_oracle(path, dtype=torch.float64).forward(prompt_tokens).logits
    ref = _all_logits(path, prompt_tokens)
    assert 1e-5 < _rel(ours[-1], ref[-1])[0] <= TOL_F16  # f16 rounding shows, and nothing else
    if arch != "qwen3moe":  # (f16 noise may route some row of an MoE model to another expert)
        assert _rel(ours, ref)[0] <= TOL_F16


def _routing(oracle, tokens, ref):
    """Per MoE layer: the oracle's routing of llama.cpp's own post-attention rows of that layer."""
    positions = torch.arange(len(tokens))
    out = {}
    for il in range(oracle.n_layer):
        if oracle.experts[il] is None:
            continue
        x = torch.from_numpy(ref[0].layer_inputs[il]).to(oracle.dtype)
        k, v = oracle.kv_path(il, x, positions)
        h = rms_norm(x, oracle.layers[il].attn_norm, oracle.hp.rms_eps)
        x_mid = x + oracle.attend(il, oracle.q_path(il, h, positions), positions, k, v, positions)
        out[il] = oracle.route(il, rms_norm(x_mid, oracle.layers[il].ffn_norm, oracle.hp.rms_eps))
    return out


@pytest.mark.parametrize("name", ["qwen3moe", "mistral3-moe"])
def test_routing_is_decisive_and_normalised(name, oracles, prompt_tokens, reference):
    """Top-2 of 4 experts with weights renormalised to 1; no row is within float noise of another
    choice (else llama.cpp and the oracle could route it differently), and routing varies over rows."""
    for seed in SEEDS:
        oracle = oracles[(name, seed)]
        routes = _routing(oracle, prompt_tokens, reference[(name, seed)])
        assert len(routes) == oracle.n_layer
        for r in routes.values():
            assert r.experts.shape == (N_TOKENS, 2)
            assert bool((r.experts[:, 0] != r.experts[:, 1]).all())
            torch.testing.assert_close(r.weights.sum(-1), torch.ones(N_TOKENS, dtype=torch.float64))
            assert bool((r.weights[:, 0] >= r.weights[:, 1]).all())  # ggml's order: largest first
            assert float(r.margin.min()) > 1e-6
            assert len(torch.unique(r.experts)) == 4  # every expert serves some row


# ------------------------------------------------------------------------------------------------
# the comparison is sharp: getting any convention wrong fails it


#: name -> {what: (how, ...)}: ("hp", field, value) replaces a hyperparameter, ("layers", attr) drops a
#: weight of every layer, ("oracle", attr) drops one of the oracle's, ("corr+1",) moves YaRN's ramp
MUTATIONS = {
    "qwen2": {"rope NORM instead of NEOX": ("hp", "rope_mode", ROPE_NORM), "no Q bias": ("layers", "bq"),
              "no K bias": ("layers", "bk"), "no V bias": ("layers", "bv"),
              "RoPE base 10000": ("hp", "rope_base", (1e4,) * 6)},
    "qwen2-tied-outbias": {"no output bias": ("oracle", "output_b")},
    "qwen2-fused-qkv": {"no K bias": ("layers", "bk"), "no V bias": ("layers", "bv")},
    "mistral3": {"rope NEOX instead of NORM": ("hp", "rope_mode", ROPE_NEOX),
                 "no rope factors": ("layers", "rope_freqs"),
                 "attention scale 1/head_dim": ("hp", "attn_scale", 1 / 24)},
    "mistral3-yarn-temp": {"no YaRN ramp (plain linear scaling)": ("hp", "ext_factor", 0.0),
                           "no YaRN magnitude factor": ("hp", "rope_mscale", 1.0),
                           "YaRN correction dims one pair later": ("corr+1",),
                           "no attention temperature": ("hp", "attn_temp_scale", 0.0)},
    "mistral3-yarn-logmul": {"YaRN magnitude not cancelled by the log multiplier": ("hp", "rope_mscale", 1.2079),
                             "no YaRN ramp (plain linear scaling)": ("hp", "ext_factor", 0.0)},
    "mistral3-moe": {"no expert weight renormalisation": ("hp", "expert_weights_norm", False),
                     "top-1 routing": ("hp", "n_expert_used", 1), "no attn output bias": ("layers", "bo")},
    "mistral3-biases": {"no FFN up bias": ("layers", "ffn_up_b"), "no FFN down bias": ("layers", "ffn_down_b"),
                        "no attn output bias": ("layers", "bo")},
    "qwen3moe": {"no q-norm": ("layers", "q_norm"), "no k-norm": ("layers", "k_norm"),
                 "rope NORM instead of NEOX": ("hp", "rope_mode", ROPE_NORM),
                 "no expert weight renormalisation": ("hp", "expert_weights_norm", False),
                 "top-3 routing": ("hp", "n_expert_used", 3)},
}


def _mutated(path, how: tuple) -> MoreDenseOracle:
    o = load_oracle(path, dtype=torch.float64)
    if how[0] == "hp":
        o.hp = dataclasses.replace(o.hp, **{how[1]: how[2]})
    elif how[0] == "corr+1":
        o.hp = dataclasses.replace(o.hp, yarn_corr_dims=tuple(c + 1 for c in o.hp.yarn_corr_dims))
    else:
        for target in (o.layers if how[0] == "layers" else [o]):
            setattr(target, how[1], None)
    return o


@pytest.mark.parametrize("name", list(VARIANTS))
def test_wrong_conventions_are_detected(name, models, prompt_tokens, reference):
    case = (name, 0)
    cap = reference[case][0]
    assert _within(layer_by_layer_errors(load_oracle(models[case], dtype=torch.float64), prompt_tokens, cap), TOL_STEP)
    for what, how in MUTATIONS[name].items():
        err = layer_by_layer_errors(_mutated(models[case], how), prompt_tokens, cap)
        assert not _within(err, TOL_STEP), f"{name}: '{what}' went unnoticed: {_fmt(err)}"


# ------------------------------------------------------------------------------------------------
# the pieces RidgeFill's fill uses


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kv_path_reproduces_the_cache_rows(name, oracles, prompt_tokens):
    oracle = oracles[(name, 0)]
    out = oracle.forward(prompt_tokens)
    assert_kv_path_gives_the_cache(oracle, out, (N_TOKENS, oracle.n_head_kv, oracle.hp.head_dim))
    assert_kv_path_rows_are_independent(oracle, out, [oracle.n_layer - 1])  # rows are independent of each other


@pytest.mark.parametrize("name", list(VARIANTS))
def test_filled_rows_never_reach_the_ffn_or_the_experts(name, oracles, prompt_tokens, monkeypatch):
    """fill_forward on these oracles: below S every row runs the FFN (or the router and the experts);
    at a late layer only the exact rows do; a filled row gets the attention norm and the K/V
    projections only (its K/V are kv_path of its predicted input)."""
    oracle = oracles[(name, 0)]
    S, T, L = 3, 8, oracle.n_layer
    chosen = select_attention_rows(oracle, prompt_tokens, split=S, tail=T, fraction=0.1)
    seen: list[tuple[int, int]] = []
    real_ffn = oracle.ffn
    monkeypatch.setattr(oracle, "ffn", lambda il, x: (seen.append((il, x.shape[0])), real_ffn(il, x))[1])
    out = fill_forward(oracle, prompt_tokens, split=S, tail=T, exact_positions=chosen)
    n_exact = int((out.roles != ROLE_FILLED).sum())
    assert 0 < n_exact < N_TOKENS and n_exact == T + math.ceil(0.1 * (N_TOKENS - T))
    assert seen == [(il, N_TOKENS) for il in range(S)] + [(il, n_exact) for il in range(S, L)]
    filled = out.filled_rows
    for il in range(S, L):
        k, v = oracle.kv_path(il, out.layer_inputs[il][filled], out.positions[filled])
        assert torch.equal(out.keys[il][filled], k)
        torch.testing.assert_close(out.values[il][filled], v * out.value_scale(il)[None, :, None], rtol=1e-12, atol=0)
    # the degenerate plans of docs/design.md §4.6: S = L is the exact forward, bit for bit; all rows
    # exact runs the late machinery and equals it up to rounding
    monkeypatch.setattr(oracle, "ffn", real_ffn)
    exact = oracle.forward(prompt_tokens, last_only=True)
    assert torch.equal(fill_forward(oracle, prompt_tokens, split=L, tail=T).logits, exact.logits)
    every = fill_forward(oracle, prompt_tokens, split=S, tail=T, exact_positions=range(N_TOKENS - T), value_rescale=0)
    assert _rel(every.logits, exact.logits.numpy())[0] < 1e-12


# ------------------------------------------------------------------------------------------------
# the tiny models


def _sha(p) -> str:
    return hashlib.sha256(open(p, "rb").read()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_are_deterministic(arch, tmp_path):
    a = mtm.make_tiny_model(arch, tmp_path / "a" / "m.gguf", seed=5)
    b = tdm.build_dense_more(arch, tmp_path / "b.gguf", seed=5)  # content independent of the path
    c = mtm.make_tiny_model(arch, tmp_path / "c.gguf", seed=6)
    assert _sha(a) == _sha(b) != _sha(c)


def test_tiny_model_contents(models):
    import gguf

    md = {arch: read_metadata(models[(arch, 0)]) for arch in ARCHS}
    t = {arch: read_tensors(models[(arch, 0)]) for arch in ARCHS}
    n_vocab = len(mtm.tokenizer_vocab()[0])
    for arch in ARCHS:
        assert md[arch]["general.architecture"] == arch
        assert (md[arch][f"{arch}.attention.head_count"], md[arch][f"{arch}.attention.head_count_kv"]) == (4, 2)
        assert md[arch][f"{arch}.block_count"] == 6 and md[arch][f"{arch}.embedding_length"] == 64
        assert t[arch]["token_embd.weight"].shape == (n_vocab, 64)
    # qwen2: Q/K/V biases, no QK-norm, untied, query width n_embd
    q2 = t["qwen2"]
    assert q2["blk.0.attn_q.bias"].shape == (64,) and q2["blk.0.attn_k.bias"].shape == (32,)
    assert "blk.0.attn_q_norm.weight" not in q2 and "output.weight" in q2 and "output.bias" not in q2
    fused = read_tensors(models[("qwen2-fused-qkv", 0)])
    assert "blk.0.attn_q.weight" not in fused and fused["blk.0.attn_qkv.bias"].shape == (128,)
    assert np.array_equal(fused["blk.0.attn_qkv.weight"][64:96], q2["blk.0.attn_k.weight"])  # same values
    # mistral3: rope factors, query width 96, tied, dense FFN, no YaRN / temperature / experts keys
    m3, m3md = t["mistral3"], md["mistral3"]
    assert m3["rope_freqs.weight"].shape == (12,) and m3["rope_freqs.weight"][0] == 1.0
    assert m3["blk.0.attn_q.weight"].shape == (96, 64) and m3["blk.0.attn_output.weight"].shape == (64, 96)
    assert "output.weight" not in m3 and "blk.0.ffn_gate.weight" in m3 and "blk.0.attn_output.bias" not in m3
    assert not any(k.startswith(("mistral3.rope.scaling", "mistral3.attention.temperature", "mistral3.expert"))
                   for k in m3md)
    # qwen3moe: QK-norm, 4 experts of width 32, 2 used, query width 128
    qm, qmmd = t["qwen3moe"], md["qwen3moe"]
    assert (qmmd["qwen3moe.expert_count"], qmmd["qwen3moe.expert_used_count"],
            qmmd["qwen3moe.expert_feed_forward_length"]) == (4, 2, 32)
    assert qm["blk.0.attn_q.weight"].shape == (128, 64) and qm["blk.0.attn_k_norm.weight"].shape == (32,)
    assert qm["blk.0.ffn_gate_inp.weight"].shape == (4, 64)
    assert qm["blk.0.ffn_gate_exps.weight"].shape == qm["blk.0.ffn_up_exps.weight"].shape == (4, 32, 64)
    assert qm["blk.0.ffn_down_exps.weight"].shape == (4, 64, 32) and "blk.0.ffn_gate.weight" not in qm
    # the variants' keys
    ym = read_metadata(models[("mistral3-yarn-temp", 0)])
    assert ym["mistral3.rope.scaling.type"] == "yarn" and ym["mistral3.rope.scaling.original_context_length"] == 32
    assert math.isclose(ym["mistral3.attention.temperature_scale"], 0.1, rel_tol=1e-6)
    r = gguf.GGUFReader(models[("qwen3moe", 0)])
    assert {x.name: x.tensor_type for x in r.tensors}["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.F32


def test_f16_storage(tmp_path):
    import gguf

    p = mtm.make_tiny_model("qwen3moe", tmp_path / "q.gguf", dtype="f16", n_layer=2)
    types = {x.name: x.tensor_type for x in gguf.GGUFReader(p).tensors}
    F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    assert types["blk.1.ffn_down_exps.weight"] == types["blk.1.attn_q.weight"] == F16
    assert types["blk.1.ffn_gate_inp.weight"] == types["blk.1.attn_k_norm.weight"] == F32  # the router stays F32
    assert "blk.2.attn_q.weight" not in types


def test_bad_tiny_model_options(tmp_path):
    with pytest.raises(TypeError, match="n_layers"):
        mtm.make_tiny_model("qwen2", tmp_path / "x.gguf", n_layers=3)
    with pytest.raises(ValueError, match="mistral3 has no output_bias"):
        mtm.make_tiny_model("mistral3", tmp_path / "x.gguf", output_bias=True)
    with pytest.raises(ValueError, match="qwen2 has no rope_freqs, attn_temp_scale"):
        mtm.make_tiny_model("qwen2", tmp_path / "x.gguf", rope_freqs=True, attn_temp_scale=0.1)
    with pytest.raises(ValueError, match="qwen3moe needs n_expert > 0"):
        mtm.make_tiny_model("qwen3moe", tmp_path / "x.gguf", n_expert=0, n_expert_used=0)
    with pytest.raises(ValueError, match="query width is n_embd"):
        mtm.make_tiny_model("qwen2", tmp_path / "x.gguf", head_dim=32)
    with pytest.raises(ValueError, match="rope_scaling must be one of"):
        mtm.make_tiny_model("mistral3", tmp_path / "x.gguf", rope_scaling="longrope")
    with pytest.raises(ValueError, match="n_expert_used"):
        mtm.make_tiny_model("mistral3", tmp_path / "x.gguf", n_expert=2, n_expert_used=3)
    assert list(tmp_path.iterdir()) == []


def test_dispatch(models):
    assert {"qwen2", "mistral3", "qwen3moe"} <= set(SUPPORTED_ARCHITECTURES)
    assert all(oracle_class(arch) is MoreDenseOracle for arch in ARCHS)
    assert all(a in mtm.ARCHS for a in ARCHS)
    with pytest.raises(ValueError, match="implements qwen2, mistral3, qwen3moe, not 'llama'"):
        MoreDenseOracle.from_gguf(mtm.make_tiny_model("llama", models[("qwen2", 0)].parent / "llama.gguf"))
