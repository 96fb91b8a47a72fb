"""The qwen35moe (Qwen3.5 MoE hybrid) torch oracle against llama.cpp, on the tiny qwen35moe model.

The tiny model (ridgefill_cpp/testing/tiny_qwen35.py, ``build_qwen35moe``): qwen35's 6 layers (GDN at 0, 1, 3, 4,
gated full attention at 2 and 5; 2 key / 4 value GDN heads; IMROPE sections) with the MoE FFN in
every layer: 4 routed experts of width 32, 2 used, softmax routing with renormalised weights, and
a shared expert of width 48 behind a sigmoid gate; no dense FFN, no feed_forward_length key.

Checked on a ~100-token prompt, with llama.cpp on an F32 KV cache and flash attention OFF: every
layer's input and the last row's logits, also decoded in several calls and small ubatches; the
final recurrent state of every GDN layer (read back from llama.cpp's sequence state, as
test_oracle_qwen35.py does); two variants: llama.cpp's other tensor layouts (full-attention
layers with one fused ``attn_qkv``, experts with one merged ``ffn_gate_up_exps``; 6 experts, 3
used; an attention layer first; 6 value heads on 2 key heads) and top-1 routing (3 experts, 1
used: the weight renormalises to exactly 1). Three wrong MoE details (no renormalisation, an
shared-expert gate fixed at 1/2, top-(k+1)) are each caught. The RidgeFill reference
(:func:`~ridgefill_cpp.oracle.fill.fill_forward`) runs on the oracle and no filled row reaches
the router.

Measured on this machine's CPU backend (max|Δ| / max|ref| per layer, float64 oracle):

    layer inputs   ≤ 8.6e-6 (one call), ≤ 9.3e-6 (decode in 1-row calls); Frobenius ≤ 1.8e-6
    logits (last)  ≤ 9.8e-7 relative
    final states   conv ≤ 1.2e-6, ssm ≤ 2.8e-6 relative
    variants       layer inputs ≤ 2.2e-6 (layouts), ≤ 1.1e-6 (top-1); logits ≤ 1.2e-6
    float32 oracle layer inputs ≤ 9.2e-6 (Frobenius 1.9e-6), logits ≤ 9.2e-7
    flash attention (against the F16 K/V oracle) ≤ 3.3e-4
    wrong details  layer inputs off by ≥ 0.49 (the worst layer), ≥ 0.1 already after layer 0

The layer errors are larger than qwen35's (≤ 1.3e-6) in the last layers: the worst rows are the
first few (row 0: 4e-5 absolute at layer 4), not rows near a routing tie. The router's margin (the
gap between the k-th and the (k+1)-th expert probability, over every row and layer) is ≥ 6.1e-5
(default model), ≥ 1.2e-4 (variants); float32 rounding moves those probabilities by ≤ 2.2e-6
(float32 against float64 oracle), so llama.cpp routes every row as the oracle does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_model_fixture
from test_oracle import assert_kv_path_rows_are_independent
from test_oracle_qwen35 import _assert_close, _errors, _print, llama_recurrent_states
from test_oracle_qwen35 import ref64, tokens  # noqa: F401  (fixtures: TINY_PROMPT's tokens, on this module's model and oracle64)
from ridgefill_cpp.testing import tiny_models as mtm
from ridgefill_cpp.testing import tiny_qwen35
from ridgefill_cpp.core import gguf_model
from ridgefill_cpp.fitting.capture import capture_layer_inputs
from ridgefill_cpp.core.gguf_model import read_metadata, read_model_info, read_tensors
from ridgefill_cpp.oracle import load_oracle, oracle_class
from ridgefill_cpp.oracle.fill import ROLE_FILLED, fill_forward, select_attention_rows
from ridgefill_cpp.oracle.qwen35 import Qwen35Oracle
from ridgefill_cpp.oracle.qwen35moe import Qwen35MoeOracle, Routing
from ridgefill_cpp.oracle.state_correction import fit_state_gains

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: max relative error of any layer input / relative Frobenius / last-row logits (FA off)
TOL_LAYER_MAX, TOL_LAYER_FRO, TOL_LOGITS = 3e-5, 5e-6, 4e-6
#: the float32 oracle (its own rounding adds to llama.cpp's)
TOL_FLOAT32 = 3e-5
#: final recurrent states, max|Δ| / max|ref| per layer
TOL_STATE = 1e-5
#: flash attention on (K/V and, on the per-row kernel path, Q and the V sum in F16)
TOL_FA = 1e-3
#: the least router margin the models must keep (float32 rounding moves the router's
#: probabilities by ≤ 2.2e-6: the float32 against the float64 oracle)
MIN_MARGIN = 2e-5

N_TOKENS = 100  # as many as the tokens fixture (test_oracle_qwen35's) has
SPLITS = [(100, 16), (37, 8), (10, 3), (1, 1)]
REC = [0, 1, 3, 4]

#: llama.cpp's other tensor layouts and more experts (see the module docstring)
LAYOUTS = dict(attn_qkv_fused=True, gate_up_merged=True, n_expert=6, n_expert_used=3,
               recurrent_layers=(False, True, True, False, True, True), ssm_n_v_heads=6)
TOP1 = dict(n_expert=3, n_expert_used=1)


# ------------------------------------------------------------------------------------------------
# fixtures and helpers


model = tiny_model_fixture(tiny_qwen35.build_qwen35moe, "tiny-qwen35moe", seed=0)


@pytest.fixture(scope="module")
def oracle64(model) -> Qwen35MoeOracle:
    return Qwen35MoeOracle(model, torch.float64)


def _record_routing(oracle: Qwen35MoeOracle) -> dict[int, list[tuple[torch.Tensor, Routing]]]:
    """Wrap the oracle's router: layer -> the (FFN input, routing) pairs it saw, in call order."""
    seen: dict[int, list[tuple[torch.Tensor, Routing]]] = {}
    route = oracle.route

    def recording(il, y):
        r = route(il, y)
        seen.setdefault(il, []).append((y, r))
        return r

    oracle.route = recording  # type: ignore[method-assign]
    return seen


def _margin(r: Routing, k: int) -> float:
    top = torch.topk(r.probs, k + 1, dim=-1).values
    return float((top[:, k - 1] - top[:, k]).min())


# ------------------------------------------------------------------------------------------------
# the tiny model itself


def test_tiny_qwen35moe_file(model, tmp_path):
    import gguf

    md = read_metadata(model)
    t = read_tensors(model)
    a = "qwen35moe"
    assert md["general.architecture"] == a
    assert (md[f"{a}.expert_count"], md[f"{a}.expert_used_count"], md[f"{a}.expert_feed_forward_length"],
            md[f"{a}.expert_shared_feed_forward_length"]) == (4, 2, 32, 48)
    assert f"{a}.feed_forward_length" not in md
    assert md[f"{a}.full_attention_interval"] == 3 and md[f"{a}.rope.dimension_sections"] == [2, 1, 1, 0]
    assert (md[f"{a}.ssm.group_count"], md[f"{a}.ssm.time_step_rank"], md[f"{a}.ssm.state_size"]) == (2, 4, 8)
    for il in range(6):
        p = f"blk.{il}."
        assert p + "ffn_gate.weight" not in t and p + "ffn_gate_up_exps.weight" not in t
        assert t[p + "ffn_gate_inp.weight"].shape == (4, 64)
        assert t[p + "ffn_gate_exps.weight"].shape == t[p + "ffn_up_exps.weight"].shape == (4, 32, 64)
        assert t[p + "ffn_down_exps.weight"].shape == (4, 64, 32)
        assert t[p + "ffn_gate_inp_shexp.weight"].shape == (64,)
        assert t[p + "ffn_up_shexp.weight"].shape == (48, 64) and t[p + "ffn_down_shexp.weight"].shape == (64, 48)
        assert (p + "attn_q.weight" in t) == (il in (2, 5))
    # f16: the matrices in F16, the router and the shared expert's gate in F32 (as the converter)
    f16 = tiny_qwen35.build_qwen35moe(tmp_path / "f16.gguf", dtype="f16")
    types = {x.name: x.tensor_type for x in gguf.GGUFReader(f16).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.F16
    f32 = gguf.GGMLQuantizationType.F32
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.ffn_gate_inp_shexp.weight"] == f32


def test_tiny_qwen35moe_deterministic_and_validated(model, tmp_path):
    a = tiny_qwen35.build_qwen35moe(tmp_path / "a.gguf", seed=0)
    assert a.read_bytes() == Path(model).read_bytes()
    b = mtm.make_tiny_model("qwen35moe", tmp_path / "b.gguf", seed=0)  # registered with the other archs
    assert b.read_bytes() == a.read_bytes()
    c = tiny_qwen35.build_qwen35moe(tmp_path / "c.gguf", seed=1)
    assert not np.array_equal(read_tensors(a)["blk.0.ffn_up_exps.weight"], read_tensors(c)["blk.0.ffn_up_exps.weight"])
    with pytest.raises(ValueError, match="n_expert_used"):
        tiny_qwen35.build_qwen35moe(tmp_path / "x.gguf", n_expert_used=5)
    with pytest.raises(ValueError, match="build_qwen35moe"):
        tiny_qwen35.build_qwen35(tmp_path / "x.gguf", n_expert=4, n_expert_used=2, n_ff_exp=8, n_ff_shexp=8)
    with pytest.raises(ValueError, match="build_qwen35"):
        tiny_qwen35.build_qwen35moe(tmp_path / "x.gguf", n_expert=0)
    with pytest.raises(ValueError, match="gate_up_merged"):
        tiny_qwen35.build_qwen35(tmp_path / "x.gguf", gate_up_merged=True)
    assert not (tmp_path / "x.gguf").exists()


def test_routing_is_not_trivial(oracle64, tokens):
    """Every expert serves some rows in every layer, the weights are not uniform, the shared
    expert's gate is spread and matters, and no row is near a routing tie (module docstring)."""
    seen = _record_routing(oracle64)
    try:
        out = oracle64.forward(tokens)
    finally:
        del oracle64.route  # the class's router again
    assert sorted(seen) == list(range(6))
    for il, ((y, r),) in seen.items():
        assert r.experts.shape == r.weights.shape == (N_TOKENS, 2) and r.probs.shape == (N_TOKENS, 4)
        assert torch.unique(r.experts).tolist() == [0, 1, 2, 3]
        assert (r.experts[:, 0] != r.experts[:, 1]).all()
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(N_TOKENS, dtype=torch.float64))
        assert (r.weights[:, 0] >= r.weights[:, 1]).all()
        assert r.weights[:, 0].max() > 0.8 and r.weights[:, 0].min() < 0.6  # confident and split rows
        assert _margin(r, 2) > MIN_MARGIN, (il, _margin(r, 2))
        gate = torch.sigmoid(y @ oracle64.layers[il]["ffn_gate_inp_shexp.weight"])
        assert gate.min() < 0.3 and gate.max() > 0.7
    assert torch.isfinite(out.logits).all()
    print("\nrouter margins: " + " ".join(f"{_margin(r, 2):.1e}" for ((_, r),) in seen.values()))


# ------------------------------------------------------------------------------------------------
# oracle vs llama.cpp


#: (oracle dtype, decode call size, n_ubatch): one call, then several calls, ubatches that do not
#: divide them, 1-row steps (the autoregressive GDN path)
AGREEMENT = [(torch.float64, 100, 100), (torch.float32, 100, 100),
             *((torch.float64, chunk, n_ubatch) for chunk, n_ubatch in SPLITS)]


@pytest.mark.parametrize("dtype,chunk,n_ubatch", AGREEMENT,
                         ids=[f"{str(d)[6:]}-calls{c}-ubatch{u}" for d, c, u in AGREEMENT])
def test_oracle_matches_llama_cpp(model, tokens, ref64, dtype, chunk, n_ubatch, record_property):
    cap = capture_layer_inputs(model, tokens, n_ctx=256, chunk=chunk, n_ubatch=n_ubatch, flash_attn=False)
    if dtype == torch.float64:
        out = ref64
    else:
        oracle = load_oracle(model, dtype=dtype)  # dispatches on general.architecture
        assert type(oracle) is Qwen35MoeOracle
        out = oracle.forward(tokens)
    assert out.layer_inputs.shape == (6, N_TOKENS, 64) and out.layer_inputs.dtype == dtype
    err = _errors(out.layer_inputs, out.logits[-1], cap)
    record_property("agreement", err)
    _print(f"qwen35moe {dtype}, calls of {chunk}, ubatch {n_ubatch}", err)
    _assert_close(err, TOL_LAYER_MAX if dtype == torch.float64 else TOL_FLOAT32, TOL_LAYER_FRO, TOL_LOGITS)


def _assert_states_match(got: dict[int, tuple[np.ndarray, np.ndarray]], out, n_v_heads: int) -> None:
    """llama.cpp's final (conv, ssm) rows of each GDN layer against the oracle's, in its layout."""
    for il, (conv, ssm) in got.items():
        st = out.gdn_states[il]
        assert st.conv.shape == (2 * 16 + 8 * n_v_heads, 3) and st.ssm.shape == (n_v_heads, 8, 8)
        for name, mine, theirs in (("conv", st.conv, conv), ("ssm", st.ssm, ssm)):
            want = mine.numpy().reshape(-1)
            e = np.abs(theirs - want).max() / np.abs(want).max()
            print(f"\nlayer {il}: {name} state rel {e:.1e}")
            assert e <= TOL_STATE, (il, name, e)


@pytest.mark.parametrize("chunk,n_ubatch", [(100, 100), (37, 8), (1, 1)], ids=["one-call", "calls37-ubatch8", "rows"])
def test_final_recurrent_states_match(model, tokens, ref64, chunk, n_ubatch):
    assert sorted(ref64.gdn_states) == REC
    _assert_states_match(llama_recurrent_states(model, tokens, REC, chunk=chunk, n_ubatch=n_ubatch), ref64, 4)


def test_flash_attention_against_f16_kv_oracle(model, tokens):
    cap = capture_layer_inputs(model, tokens, n_ctx=256, chunk=37, n_ubatch=8, flash_attn=True)
    out = Qwen35MoeOracle(model, torch.float64, kv_f16=True).forward(tokens)
    err = _errors(out.layer_inputs, out.logits[-1], cap)
    _print("qwen35moe flash attention, calls of 37, ubatch 8", err)
    _assert_close(err, TOL_FA, TOL_FA, TOL_FA)


@pytest.mark.parametrize("options,seed", [(LAYOUTS, 6), (TOP1, 1)], ids=["fused-qkv-merged-gate-up", "top1"])
def test_variant_models_match_llama_cpp(tmp_path, tokens, options, seed):
    """llama.cpp's fused/merged tensor layouts (read as the same rows of the split tensors, so the
    same seed gives the same oracle weights as the split layout), and top-1 routing."""
    path = tiny_qwen35.build_qwen35moe(tmp_path / "variant.gguf", seed=seed, **options)
    t = read_tensors(path)
    oracle = Qwen35MoeOracle(path, torch.float64)
    rec = [il for il in range(6) if oracle.is_recurrent(il)]
    if options is LAYOUTS:
        assert rec == [1, 2, 4, 5] and "blk.0.attn_q.weight" not in t
        assert t["blk.0.attn_qkv.weight"].shape == t["blk.3.attn_qkv.weight"].shape == (2 * 64 + 2 * 32, 64)
        assert t["blk.1.attn_qkv.weight"].shape == (2 * 16 + 48, 64)  # a GDN layer's conv input
        assert t["blk.1.ffn_gate_up_exps.weight"].shape == (6, 64, 64) and "blk.1.ffn_up_exps.weight" not in t
        split = tiny_qwen35.build_qwen35moe(tmp_path / "split.gguf", seed=seed,
                                            **{**options, "attn_qkv_fused": False, "gate_up_merged": False})
        plain = Qwen35MoeOracle(split, torch.float64)
        for il in range(6):
            assert plain.layers[il].keys() == oracle.layers[il].keys()
            for name, w in plain.layers[il].items():
                assert torch.equal(w, oracle.layers[il][name]), (il, name)
    else:
        assert rec == REC
    out = oracle.forward(tokens)
    cap = capture_layer_inputs(path, tokens, n_ctx=256, chunk=37, n_ubatch=8, flash_attn=False)
    err = _errors(out.layer_inputs, out.logits[-1], cap)
    _print(f"qwen35moe variant {options}", err)
    _assert_close(err, TOL_LAYER_MAX, TOL_LAYER_FRO, TOL_LOGITS)
    _assert_states_match(llama_recurrent_states(path, tokens, rec, chunk=37, n_ubatch=8), out,
                         options.get("ssm_n_v_heads", 4))
    k = oracle.cfg.n_expert_used
    seen = _record_routing(oracle)
    oracle.forward(tokens)
    assert min(_margin(r, k) for ((_, r),) in seen.values()) > MIN_MARGIN
    if k == 1:
        assert all(torch.equal(r.weights, torch.ones_like(r.weights)) for ((_, r),) in seen.values())


def _no_renorm(self, il, y):
    r = Qwen35MoeOracle.route(self, il, y)
    return Routing(r.experts, torch.gather(r.probs, 1, r.experts), r.probs)


def _one_more_expert(self, il, y):
    self.cfg = replace(self.cfg, n_expert_used=self.cfg.n_expert_used + 1)
    try:
        return Qwen35MoeOracle.route(self, il, y)
    finally:
        self.cfg = replace(self.cfg, n_expert_used=self.cfg.n_expert_used - 1)


def _ungated_shared_expert(self, il, y):
    lw = self.layers[il]
    w = lw["ffn_gate_inp_shexp.weight"]
    lw["ffn_gate_inp_shexp.weight"] = torch.full_like(w, 0.0)  # sigmoid(0) = 1/2 for every row
    try:
        return Qwen35MoeOracle.moe_ffn(self, il, y)
    finally:
        lw["ffn_gate_inp_shexp.weight"] = w


@pytest.mark.parametrize("name,method,mutant", [("no renormalisation", "route", _no_renorm),
                                                ("top-(k+1)", "route", _one_more_expert),
                                                ("shared gate 1/2", "moe_ffn", _ungated_shared_expert)],
                         ids=["no-renorm", "top-k+1", "shared-gate-half"])
def test_wrong_moe_details_are_caught(model, tokens, name, method, mutant):
    """The comparison is sensitive to each MoE detail: an oracle with one of them wrong fails it."""
    cap = capture_layer_inputs(model, tokens, n_ctx=256, flash_attn=False)
    oracle = Qwen35MoeOracle(model, torch.float64)
    setattr(oracle, method, mutant.__get__(oracle))
    out = oracle.forward(tokens)
    err = _errors(out.layer_inputs, out.logits[-1], cap)
    _print(f"qwen35moe with {name}", err)
    assert max(err["layer_max_rel"]) > 100 * TOL_LAYER_MAX, err


# ------------------------------------------------------------------------------------------------
# the oracle's pieces and RidgeFill's reference on it


def test_dispatch_and_refusals(model, tmp_path):
    assert oracle_class("qwen35moe") is Qwen35MoeOracle
    dense = mtm.make_tiny_model("qwen35", tmp_path / "q35.gguf", seed=0)
    with pytest.raises(ValueError, match="implements qwen35moe, not 'qwen35'"):
        Qwen35MoeOracle(dense)
    with pytest.raises(ValueError, match="implements qwen35, not 'qwen35moe'"):
        Qwen35Oracle(model)
    t, md = read_tensors(model), read_metadata(model)
    with pytest.raises(ValueError, match="attention biases"):
        Qwen35MoeOracle({**t, "blk.2.attn_k.bias": np.zeros(32, np.float32)}, md)
    with pytest.raises(ValueError, match="grouped expert routing"):
        Qwen35MoeOracle(t, {**md, "qwen35moe.expert_group_count": 2})
    with pytest.raises(ValueError, match="expert_used_count"):
        Qwen35MoeOracle(t, {**md, "qwen35moe.expert_used_count": 5})
    with pytest.raises(ValueError, match=r"ffn_gate_exps.weight has shape"):
        Qwen35MoeOracle(t, {**md, "qwen35moe.expert_feed_forward_length": 16})
    # without expert_feed_forward_length llama.cpp falls back to feed_forward_length / n_expert_used
    md2 = {k: v for k, v in md.items() if k != "qwen35moe.expert_feed_forward_length"}
    assert Qwen35MoeOracle(t, {**md2, "qwen35moe.feed_forward_length": 64}).cfg.n_ff_exp == 32


def test_kv_path_and_ffn_block_are_the_layer(oracle64, ref64):
    assert_kv_path_rows_are_independent(oracle64, ref64, (2, 5))
    # the FFN of a row does not depend on the other rows (routing is per row)
    il, x = 3, ref64.layer_inputs[3]
    upd = oracle64.gdn_update(il, x, keep_row_states=True)
    full = oracle64.gdn_layer_output(il, x, upd)
    torch.testing.assert_close(full, ref64.layer_inputs[4], rtol=0, atol=1e-12)
    torch.testing.assert_close(oracle64.gdn_layer_output(il, x, upd, [5, 60]), full[[5, 60]], rtol=0, atol=1e-12)


def test_fill_reference_runs_and_filled_rows_skip_the_experts(model, tokens, ref64):
    """fill_forward, the attention selector and the state-correction fit run on the oracle;
    at a late layer only the exact rows are routed (a filled row never reaches the experts)."""
    oracle = Qwen35MoeOracle(model, torch.float64)
    split, tail = 3, 16
    chosen = select_attention_rows(oracle, tokens, split=split, tail=tail, fraction=0.1)
    assert len(chosen) == 9
    seen = _record_routing(oracle)
    out = fill_forward(oracle, tokens, split=split, tail=tail, exact_positions=chosen)
    n_exact = int((out.roles != ROLE_FILLED).sum())
    assert n_exact == tail + len(chosen)
    rows = {il: sum(r.experts.shape[0] for _, r in rs) for il, rs in seen.items()}
    assert rows == {0: N_TOKENS, 1: N_TOKENS, 2: N_TOKENS, 3: n_exact, 4: n_exact, 5: n_exact}, rows
    assert torch.isfinite(out.logits).all()
    # every row exact: the late-layer machinery equals the exact forward up to rounding
    del oracle.route
    every = fill_forward(oracle, tokens, split=split, tail=tail, exact_positions=range(N_TOKENS - tail))
    assert float((every.logits[-1] - ref64.logits[-1]).abs().max()) < 1e-10
    gains = fit_state_gains(oracle, [tokens[:60], tokens[40:]], split=split, tail=tail)
    assert sorted(gains) == [3, 4] and all(g.shape == (4,) and torch.isfinite(g).all() for g in gains.values())


def test_read_model_info_finds_the_recurrent_layers(model, oracle64, monkeypatch):
    """gguf_model.read_model_info reads qwen35moe's keys (the layer pattern from
    full_attention_interval or attention.recurrent_layers) once libllama's table lists qwen35moe
    as hybrid (the list comes from there; the monkeypatch stands in for that entry)."""
    monkeypatch.setattr(gguf_model, "HYBRID_ARCHITECTURES", tuple({*gguf_model.HYBRID_ARCHITECTURES, "qwen35moe"}))
    info = read_model_info(model)
    assert (info.architecture, info.n_layer, info.n_embd, info.n_head, info.n_head_kv, info.head_dim) == \
        ("qwen35moe", 6, 64, 4, 2, 16)
    assert info.qk_norm
    assert info.recurrent_layers == tuple(il for il in range(6) if oracle64.is_recurrent(il)) == tuple(REC)
    assert info.n_params == sum(int(np.prod(v.shape)) for v in read_tensors(model).values())
