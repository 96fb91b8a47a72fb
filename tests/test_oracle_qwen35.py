"""The qwen35 (Gated DeltaNet hybrid) torch oracle against llama.cpp, on the tiny qwen35 model.

The tiny model (ridgefill_cpp/testing/tiny_qwen35.py): 6 layers, GDN at 0, 1, 3, 4 and gated full attention at 2
and 5; 2 key / 4 value GDN heads (so the key-head broadcast is exercised), IMROPE sections.

Checked on a ~100-token prompt, with llama.cpp on an F32 KV cache and flash attention OFF:
every layer's input and the last row's logits; the final recurrent state of every GDN layer
(conv and delta-net state, read back from llama.cpp's sequence state in its memory layout);
the same when the prompt is decoded in several calls and small ubatches (the hybrid memory
splits ubatches with split_equal and carries the recurrent state across them, and a 1-row
ubatch takes the autoregressive GDN path); and a second model variant that reaches the IMROPE
"e" section (unrotated pair), an explicit recurrent-layer pattern starting with attention, and
a 2-to-6 key-to-value head broadcast.

Measured on this machine's CPU backend (max|Δ| / max|ref| per layer, float64 oracle):

    layer inputs   ≤ 1.3e-6 (one call), ≤ 1.8e-6 (decode in 1-row calls)
    logits (last)  ≤ 6.3e-7 relative (≤ 1.9e-6 absolute; logits std ≈ 1)
    final states   conv ≤ 6.8e-7, ssm ≤ 1.7e-6 relative
    variant model  layer inputs ≤ 9.5e-7, logits ≤ 7.1e-7
    float32 oracle layer inputs ≤ 5.6e-6, logits ≤ 1.4e-6 (its own float32 rounding)

With flash attention ON llama.cpp casts the F32 cache to F16 before ggml_flash_attn_ext, and the
CPU kernel's per-row path (ubatches shorter than its Q tile) also rounds Q to F16 and accumulates
V in F16: ≈ 2e-5 relative in one 100-row ubatch, ≈ 3e-4 with split ubatches, against the oracle
with K/V rounded to F16 (``kv_f16=True``). That case has its own, looser tolerance below.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_PROMPT, tiny_model_fixture, tokenize
from test_oracle import assert_kv_path_rows_are_independent
from ridgefill_cpp.testing import tiny_models as mtm
from ridgefill_cpp.testing import tiny_qwen35
from ridgefill_cpp.fitting.capture import capture_layer_inputs, open_model
from ridgefill_cpp.core.gguf_model import read_metadata, read_tensors
from ridgefill_cpp.oracle import load_oracle
from ridgefill_cpp.oracle.qwen35 import (
    GDNState,
    Qwen35Oracle,
    gdn_output,
    gdn_state_update,
    imrope_angles,
)

#: max relative error of any layer input / relative Frobenius / last-row logits (FA off). Float32
#: rounding, which depends on the CPU's kernels: up to 4.8e-6 with AVX2, 6.1e-6 with AVX-512 (layer
#: 5, prompt decoded one row per ubatch, on a Xeon with AMX)
TOL_LAYER_MAX, TOL_LAYER_FRO, TOL_LOGITS = 1e-5, 5e-6, 5e-6
#: the same with the float32 oracle (its own rounding adds to llama.cpp's)
TOL_FLOAT32 = 2e-5
#: final recurrent states, max|Δ| / max|ref| per layer
TOL_STATE = 5e-6
#: flash attention on (K/V and, on the per-row kernel path, Q and the V sum in F16)
TOL_FA = 1.5e-3

PROMPT = TINY_PROMPT
N_TOKENS = 100

#: (decode call size, n_ubatch): several calls, ubatches that do not divide them, 1-row steps
SPLITS = [(100, 16), (37, 8), (10, 3), (1, 1)]

#: a variant reaching the other code paths (see the module docstring)
VARIANT = dict(rope_sections=(1, 1, 1, 1), recurrent_layers=(False, True, True, False, True, True),
               ssm_n_k_heads=2, ssm_n_v_heads=6, n_layer=6)


# ------------------------------------------------------------------------------------------------
# fixtures and helpers


model = tiny_model_fixture(tiny_qwen35.build_qwen35, "tiny-qwen35", seed=0)
variant = tiny_model_fixture(tiny_qwen35.build_qwen35, "tiny-qwen35-variant", seed=1, **VARIANT)


@pytest.fixture(scope="module")
def tokens(model) -> list[int]:
    """~100 tokens of PROMPT, tokenized by llama.cpp with the tiny vocabulary (BOS first)."""
    return tokenize(model, PROMPT, N_TOKENS)


@pytest.fixture(scope="module")
def oracle64(model) -> Qwen35Oracle:
    return Qwen35Oracle(model, torch.float64)


@pytest.fixture(scope="module")
def ref64(oracle64, tokens):
    return oracle64.forward(tokens)


def _errors(layer_inputs: torch.Tensor, logits_last: torch.Tensor, cap) -> dict:
    ours = layer_inputs.double().numpy()
    ref = cap.layer_inputs.astype(np.float64)
    assert ours.shape == ref.shape
    lo, lr = logits_last.double().numpy(), cap.logits.astype(np.float64)
    assert lo.shape == lr.shape
    return {
        "layer_max_rel": [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, ref)],
        "layer_fro_rel": [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(ours, ref)],
        "layer_max_abs": [float(np.abs(a - b).max()) for a, b in zip(ours, ref)],
        "logits_max_abs": float(np.abs(lo - lr).max()),
        "logits_max_rel": float(np.abs(lo - lr).max() / np.abs(lr).max()),
        "same_argmax": int(lo.argmax()) == int(lr.argmax()),
    }


def _print(tag: str, err: dict) -> None:
    print(f"\n{tag}: layer max rel {' '.join(f'{e:.1e}' for e in err['layer_max_rel'])}"
          f" | max abs {' '.join(f'{e:.1e}' for e in err['layer_max_abs'])}"
          f" | logits abs {err['logits_max_abs']:.1e} rel {err['logits_max_rel']:.1e}")


def _assert_close(err: dict, t_max: float, t_fro: float, t_logits: float) -> None:
    assert err["layer_max_rel"][0] == 0.0, err  # the embedding rows are copied exactly
    assert max(err["layer_max_rel"]) <= t_max, err
    assert max(err["layer_fro_rel"]) <= t_fro, err
    assert err["logits_max_rel"] <= t_logits, err
    assert err["same_argmax"], err


LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1  # hybrid memory: the recurrent part only


def llama_recurrent_states(model_path: Path, tokens: list[int], recurrent_layers: list[int], *,
                           chunk: int, n_ubatch: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Decode ``tokens`` with llama.cpp and read back each GDN layer's (conv row, ssm row).

    Parses ``llama_state_seq_get_data_ext(..., PARTIAL_ONLY)`` of sequence 0: magic, seq id,
    cell count, per cell (pos, n_seq_id), then llama_memory_recurrent::state_write_data: s_trans,
    n_layer, for each recurrent layer (type, row size, r_l row), then the same for s_l.
    """
    from llama_cpp import llama_cpp as C

    llm = open_model(model_path, n_ctx=256, n_batch=chunk, n_ubatch=n_ubatch, flash_attn=False)
    try:
        for s in range(0, len(tokens), chunk):
            llm.eval(tokens[s:s + chunk])
        ctx = llm._ctx.ctx
        size = C.llama_state_seq_get_size_ext(ctx, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        buf = (ctypes.c_uint8 * size)()
        n = C.llama_state_seq_get_data_ext(ctx, buf, size, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        assert n == size > 0
    finally:
        llm.close()
    data = bytes(buf)
    off = 0

    def read(fmt: str):
        nonlocal off
        vals = struct.unpack_from(fmt, data, off)
        off += struct.calcsize(fmt)
        return vals

    magic, seq_id, cells = read("<IiI")
    assert (magic, seq_id, cells) == (0xAF143CD8, 0, 1)
    pos, n_seq = read("<iI")
    assert (pos, n_seq) == (len(tokens) - 1, 0)
    s_trans, _n_layer = read("<II")
    assert s_trans == 0
    rows: dict[str, dict[int, np.ndarray]] = {"r": {}, "s": {}}
    for kind in ("r", "s"):
        for il in recurrent_layers:
            gtype, row_size = read("<iQ")
            assert gtype == 0  # GGML_TYPE_F32
            rows[kind][il] = np.frombuffer(data, np.float32, row_size // 4, off).copy()
            off += row_size
    assert off == len(data)
    return {il: (rows["r"][il], rows["s"][il]) for il in recurrent_layers}


# ------------------------------------------------------------------------------------------------
# the tiny model itself


def test_tiny_qwen35_file(model):
    md = read_metadata(model)
    t = read_tensors(model)
    cfg = tiny_qwen35.qwen35_config()
    assert md["general.architecture"] == "qwen35"
    assert md["qwen35.full_attention_interval"] == 3
    assert md["qwen35.rope.dimension_sections"] == [2, 1, 1, 0]
    assert (md["qwen35.ssm.group_count"], md["qwen35.ssm.time_step_rank"], md["qwen35.ssm.state_size"],
            md["qwen35.ssm.inner_size"], md["qwen35.ssm.conv_kernel"]) == (2, 4, 8, 32, 4)
    attn = [il for il in range(6) if not cfg.is_recurrent(il)]
    assert attn == [2, 5]
    for il in range(6):
        assert ("blk.%d.attn_qkv.weight" % il in t) == (il not in attn)
        assert ("blk.%d.attn_q.weight" % il in t) == (il in attn)
    assert t["blk.2.attn_q.weight"].shape == (2 * 16 * 4, 64)  # Q and gate
    assert t["blk.0.attn_qkv.weight"].shape == (2 * 16 + 32, 64)
    assert t["blk.0.ssm_conv1d.weight"].shape == (64, 4)
    assert (t["blk.0.ssm_a"] < 0).all()  # -exp(A_log)
    assert "output.weight" in t


def test_tiny_qwen35_deterministic_and_validated(tmp_path):
    a = tiny_qwen35.build_qwen35(tmp_path / "a.gguf", seed=5)
    b = tiny_qwen35.build_qwen35(tmp_path / "b.gguf", seed=5)
    c = tiny_qwen35.build_qwen35(tmp_path / "c.gguf", seed=6)
    ta, tb, tc = read_tensors(a), read_tensors(b), read_tensors(c)
    assert all(np.array_equal(ta[k], tb[k]) for k in ta)
    assert not np.array_equal(ta["blk.0.attn_qkv.weight"], tc["blk.0.attn_qkv.weight"])
    # through tiny_models, the same content
    d = mtm.make_tiny_model("qwen35", tmp_path / "d.gguf", seed=5)
    assert all(np.array_equal(ta[k], v) for k, v in read_tensors(d).items())
    with pytest.raises(TypeError, match="unknown tiny-model option"):
        tiny_qwen35.build_qwen35(tmp_path / "x.gguf", n_lyer=4)
    with pytest.raises(ValueError, match="multiple of ssm_n_k_heads"):
        tiny_qwen35.build_qwen35(tmp_path / "x.gguf", ssm_n_v_heads=3)
    assert not (tmp_path / "x.gguf").exists()


def test_recurrence_is_not_trivial(oracle64, ref64, tokens):
    """Decays spread over heads, some remembering tens of tokens; the final state depends on
    the second token (so a broken recurrence could not pass by forgetting everything)."""
    decays = []
    for il, st in ref64.gdn_states.items():
        upd = oracle64.gdn_update(il, ref64.layer_inputs[il])
        decays.append(torch.exp(upd.g).mean(0))
        assert st.ssm.abs().max() > 0.5
    decays = torch.cat(decays)
    assert decays.max() > 0.97 and decays.min() < 0.95
    other = list(tokens)
    other[1] = tokens[1] + 1
    out2 = oracle64.forward(other)
    for il, st in ref64.gdn_states.items():
        assert (st.ssm - out2.gdn_states[il].ssm).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------
# oracle vs llama.cpp


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_oracle_matches_llama_cpp(model, tokens, dtype, record_property):
    cap = capture_layer_inputs(model, tokens, n_ctx=256, flash_attn=False)
    oracle = load_oracle(model, dtype=dtype)  # dispatches on general.architecture
    assert isinstance(oracle, Qwen35Oracle)
    out = oracle.forward(tokens)
    assert out.layer_inputs.shape == (6, N_TOKENS, 64) and out.layer_inputs.dtype == dtype
    assert out.logits.shape == (N_TOKENS, len(mtm.tokenizer_vocab()[0]))
    err = _errors(out.layer_inputs, out.logits[-1], cap)
    record_property("agreement", err)
    _print(f"qwen35 {dtype}", err)
    if dtype == torch.float64:
        _assert_close(err, TOL_LAYER_MAX, TOL_LAYER_FRO, TOL_LOGITS)
    else:
        _assert_close(err, TOL_FLOAT32, TOL_FLOAT32, TOL_FLOAT32)


@pytest.mark.parametrize("chunk,n_ubatch", SPLITS, ids=[f"calls{c}-ubatch{u}" for c, u in SPLITS])
def test_split_decoding_matches_oracle(model, tokens, ref64, chunk, n_ubatch):
    cap = capture_layer_inputs(model, tokens, n_ctx=256, chunk=chunk, n_ubatch=n_ubatch, flash_attn=False)
    err = _errors(ref64.layer_inputs, ref64.logits[-1], cap)
    _print(f"qwen35 calls of {chunk}, ubatch {n_ubatch}", err)
    _assert_close(err, TOL_LAYER_MAX, TOL_LAYER_FRO, TOL_LOGITS)


@pytest.mark.parametrize("chunk,n_ubatch", [(100, 100), (37, 8), (1, 1)], ids=["one-call", "calls37-ubatch8", "rows"])
def test_final_recurrent_states_match(model, tokens, ref64, chunk, n_ubatch):
    """The conv and delta-net states llama.cpp holds after the prompt equal the oracle's,
    compared in llama.cpp's memory layout (GDNState documents it)."""
    rec = sorted(ref64.gdn_states)
    assert rec == [0, 1, 3, 4]
    got = llama_recurrent_states(model, tokens, rec, chunk=chunk, n_ubatch=n_ubatch)
    for il in rec:
        st = ref64.gdn_states[il]
        assert st.conv.shape == (64, 3) and st.ssm.shape == (4, 8, 8)
        conv, ssm = got[il]
        want_conv, want_ssm = st.conv.numpy().reshape(-1), st.ssm.numpy().reshape(-1)
        e_conv = np.abs(conv - want_conv).max() / np.abs(want_conv).max()
        e_ssm = np.abs(ssm - want_ssm).max() / np.abs(want_ssm).max()
        print(f"\nlayer {il}: conv state rel {e_conv:.1e}, ssm state rel {e_ssm:.1e}")
        assert e_conv <= TOL_STATE and e_ssm <= TOL_STATE


@pytest.mark.parametrize("chunk,n_ubatch", [(100, 100), (37, 8)], ids=["one-ubatch", "calls37-ubatch8"])
def test_flash_attention_against_f16_kv_oracle(model, tokens, chunk, n_ubatch):
    cap = capture_layer_inputs(model, tokens, n_ctx=256, chunk=chunk, n_ubatch=n_ubatch, flash_attn=True)
    out = Qwen35Oracle(model, torch.float64, kv_f16=True).forward(tokens)
    err = _errors(out.layer_inputs, out.logits[-1], cap)
    _print(f"qwen35 flash attention, calls of {chunk}, ubatch {n_ubatch}", err)
    _assert_close(err, TOL_FA, TOL_FA, TOL_FA)


def test_variant_model_matches_llama_cpp(variant, tokens):
    """IMROPE sections (1, 1, 1, 1): pair 3 falls in the 4th ("e") section, whose position is 0
    for text, so it is not rotated; an attention layer first; 6 value heads on 2 key heads."""
    md = read_metadata(variant)
    assert md["qwen35.attention.recurrent_layers"] == [False, True, True, False, True, True]
    angles = imrope_angles(np.array([5]), Qwen35Oracle(variant).cfg)
    assert angles[0, 3] == 0.0 and angles[0, 0] == 5.0
    oracle = Qwen35Oracle(variant, torch.float64)
    out = oracle.forward(tokens)
    cap = capture_layer_inputs(variant, tokens, n_ctx=256, chunk=37, n_ubatch=8, flash_attn=False)
    err = _errors(out.layer_inputs, out.logits[-1], cap)
    _print("qwen35 variant", err)
    _assert_close(err, TOL_LAYER_MAX, TOL_LAYER_FRO, TOL_LOGITS)
    rec = [1, 2, 4, 5]
    got = llama_recurrent_states(variant, tokens, rec, chunk=37, n_ubatch=8)
    for il in rec:
        st = out.gdn_states[il]
        assert st.ssm.shape == (6, 8, 8)
        for mine, theirs in ((st.conv, got[il][0]), (st.ssm, got[il][1])):
            want = mine.numpy().reshape(-1)
            assert np.abs(theirs - want).max() <= TOL_STATE * np.abs(want).max()


# ------------------------------------------------------------------------------------------------
# the oracle's GDN pieces (what RidgeFill's filled rows will be checked against)


def test_gdn_update_then_output_is_the_layer(oracle64, ref64):
    """gdn_state_update (the part a filled row runs) + gdn_output reproduce the layer; running
    the update over the rows in pieces, chaining the state, gives the same states."""
    c = oracle64.cfg
    for il in (0, 3):
        lw, x = oracle64.layers[il], ref64.layer_inputs[il]
        u = oracle64.attn_norm(il, x)
        upd = gdn_state_update(lw, c, u, GDNState.zeros(c, torch.float64))
        nxt = oracle64.ffn_block(il, x + gdn_output(lw, c, u, upd))
        torch.testing.assert_close(nxt, ref64.layer_inputs[il + 1], rtol=0, atol=1e-12)
        torch.testing.assert_close(upd.state.ssm, ref64.gdn_states[il].ssm, rtol=0, atol=1e-12)

        # chained in pieces of 1, 7 and the rest (update only), then outputs for some rows
        st = GDNState.zeros(c, torch.float64)
        for a, b in ((0, 1), (1, 8), (8, N_TOKENS)):
            st = gdn_state_update(lw, c, u[a:b], st, keep_row_states=False).state
        torch.testing.assert_close(st.ssm, upd.state.ssm, rtol=0, atol=1e-12)
        torch.testing.assert_close(st.conv, upd.state.conv, rtol=0, atol=0)
        rows = [3, 50, 99]
        torch.testing.assert_close(gdn_output(lw, c, u, upd, rows), gdn_output(lw, c, u, upd)[rows],
                                   rtol=0, atol=1e-12)
        # the conv state is the last d_conv-1 inputs W_qkv u, channel-major, oldest first
        qkv = u @ lw["attn_qkv.weight"].T
        torch.testing.assert_close(upd.state.conv, qkv[-(c.d_conv - 1):].T, rtol=0, atol=1e-12)


def test_kv_path_reproduces_the_cache_rows(oracle64, ref64):
    assert_kv_path_rows_are_independent(oracle64, ref64, (2, 5))
    assert ref64.keys[0] is None and ref64.values[0] is None
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        oracle64.kv_path(0, ref64.layer_inputs[0], torch.arange(N_TOKENS))
    with pytest.raises(ValueError, match="full-attention"):
        oracle64.gdn_update(2, ref64.layer_inputs[2])


def test_oracle_rejects_other_architectures(tmp_path):
    p = mtm.make_tiny_model("qwen3", tmp_path / "q3.gguf", seed=0)
    with pytest.raises(ValueError, match="qwen35"):
        Qwen35Oracle(p)
