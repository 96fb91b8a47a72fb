"""The torch oracle (ridgefill_cpp.oracle) against llama.cpp itself, on the tiny dense models.

For each architecture and a 100-token prompt (longer than gemma3's 16-token window), the oracle's
layer inputs and last-row logits must agree with what llama.cpp computes, in two ways:

* free-running: the oracle's own forward pass from the tokens (errors accumulate over layers);
* layer by layer: each oracle layer fed llama.cpp's input of that layer, compared with llama.cpp's
  input of the next (and the embedding, and the logits from the last layer) - a sharp check of
  every layer on its own.

llama.cpp runs with an F32 KV cache and flash attention OFF: with flash attention on, llama.cpp
casts F32 K/V to F16 before ``ggml_flash_attn_ext`` (src/llama-graph.cpp, build_attn_mha) and the
CPU kernel then works in F16, which costs ~2e-4 relative and would hide real mistakes.

Measured on this machine's CPU backend (float64 oracle; relative error = max|Δ| / max|ref| per
layer, "fro" = ‖Δ‖/‖ref‖; the worst over 3 seeds × 6 random prompts):

    free-running    layer inputs        fro        logits
      llama           6e-7             4e-7        5e-7
      qwen3           5e-7             4e-7        4e-7
      gemma3          2.2e-4           8e-5        1.6e-4
    layer by layer
      llama           3e-7             2e-7
      gemma3          6.5e-5           9e-6        (exact GELU instead of the table: 2e-4 / 1.3e-4)

gemma3 is looser because llama.cpp's CPU GELU reads an fp16 table (GGML_GELU_FP16 in
ggml-cpu/vec.h; the oracle reproduces it): float32 rounding noise moves some gate values across an
fp16 rounding boundary, a one-ulp (~1e-3) jump of that element. Feeding 1e-7 relative noise into the
oracle's own gate inputs reproduces the same error sizes; with the exact GELU the same noise costs
1e-7. The tolerances below sit 2-5x above the worst measured figures.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import TINY_PROMPT, tokenize
from ridgefill_cpp.testing import tiny_models as mtm

from ridgefill_cpp.fitting.capture import capture_layer_inputs
from ridgefill_cpp.oracle import SUPPORTED_ARCHITECTURES, DenseOracle, load_oracle
from ridgefill_cpp.oracle.common import ROPE_NEOX, ROPE_NORM

DENSE = ("llama", "qwen3", "gemma3")

#: free-running: (layer inputs max rel, layer inputs fro rel, last-row logits max rel)
TOL_FREE = {
    "llama": (3e-6, 3e-6, 3e-6),
    "qwen3": (3e-6, 3e-6, 3e-6),
    "gemma3": (5e-4, 2e-4, 4e-4),
}
#: layer by layer: (next layer input max rel, fro rel, logits max rel)
TOL_STEP = {
    "llama": (2e-6, 2e-6, 2e-6),
    "qwen3": (2e-6, 2e-6, 2e-6),
    "gemma3": (2e-4, 3e-5, 1e-4),
}

PROMPT = TINY_PROMPT
N_TOKENS = 100


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompt_tokens(tiny_models) -> list[int]:
    """~100 tokens of PROMPT, tokenized by llama.cpp with the tiny vocabulary (BOS first)."""
    return tokenize(tiny_models["llama"], PROMPT, N_TOKENS)


@pytest.fixture(scope="module")
def captured(tiny_models, prompt_tokens):
    """arch -> llama.cpp's layer inputs and last-row logits for the prompt (F32 KV, no flash attn)."""
    return {arch: capture_layer_inputs(tiny_models[arch], prompt_tokens, n_ctx=256, flash_attn=False)
            for arch in DENSE}


def _rel(ours: torch.Tensor, ref: np.ndarray) -> tuple[float, float]:
    """(max|Δ| / max|ref|, ‖Δ‖ / ‖ref‖)."""
    a = ours.detach().double().numpy()
    b = np.asarray(ref, dtype=np.float64)
    assert a.shape == b.shape
    d = a - b
    return float(np.abs(d).max() / np.abs(b).max()), float(np.linalg.norm(d) / np.linalg.norm(b))


def free_running_errors(oracle: DenseOracle, tokens, cap) -> dict:
    """The oracle's own forward pass vs llama.cpp: per-layer input errors and last-row logits."""
    out = oracle.forward(tokens, last_only=True)
    per_layer = [_rel(out.layer_inputs[il], cap.layer_inputs[il]) for il in range(oracle.n_layer)]
    return {
        "layer_max_rel": [m for m, _ in per_layer],
        "layer_fro_rel": [f for _, f in per_layer],
        "layer_max_abs": float(np.abs(out.layer_inputs.double().numpy() - cap.layer_inputs).max()),
        "logits_max_rel": _rel(out.logits[-1], cap.logits)[0],
        "logits_max_abs": float(np.abs(out.logits[-1].double().numpy() - cap.logits).max()),
        "same_argmax": int(out.logits[-1].argmax()) == int(np.argmax(cap.logits)),
    }


def layer_by_layer_errors(oracle: DenseOracle, tokens, cap) -> dict:
    """Each piece on llama.cpp's own inputs: the embedding vs layer 0's input, layer l on
    llama.cpp's x_l vs its x_{l+1}, and the output head on layer L-1's output vs the logits."""
    positions = torch.arange(len(tokens))
    errs = [_rel(oracle.embed(tokens), cap.layer_inputs[0])]
    for il in range(oracle.n_layer):
        x_in = torch.from_numpy(cap.layer_inputs[il]).to(oracle.dtype)
        x_out, _, _ = oracle.layer_forward(il, x_in, positions)
        if il + 1 < oracle.n_layer:
            errs.append(_rel(x_out, cap.layer_inputs[il + 1]))
    logits = oracle.logits(x_out[-1:])[0]
    return {
        "layer_max_rel": [m for m, _ in errs],  # [0]: the embedding, [l]: layer l-1's output
        "layer_fro_rel": [f for _, f in errs],
        "logits_max_rel": _rel(logits, cap.logits)[0],
    }


def _within(err: dict, tol: tuple[float, float, float]) -> bool:
    t_max, t_fro, t_logits = tol
    return (max(err["layer_max_rel"]) <= t_max and max(err["layer_fro_rel"]) <= t_fro
            and err["logits_max_rel"] <= t_logits)


def _fmt(err: dict) -> str:
    return (f"layer max rel [{' '.join(f'{e:.1e}' for e in err['layer_max_rel'])}]"
            f" fro max {max(err['layer_fro_rel']):.1e} | logits rel {err['logits_max_rel']:.1e}")


def assert_kv_path_gives_the_cache(oracle, out, kv_shape: tuple[int, int, int]) -> None:
    """kv_path on each layer's whole input (forward output `out`) gives exactly the K/V rows, of
    shape `kv_shape`, the full layer wrote."""
    positions = torch.arange(len(out.layer_inputs[0]))
    for il in range(oracle.n_layer):
        k, v = oracle.kv_path(il, out.layer_inputs[il], positions)
        assert k.shape == v.shape == kv_shape
        assert torch.equal(k, out.keys[il]) and torch.equal(v, out.values[il])


def assert_kv_path_rows_are_independent(oracle, out, layers, rows=(0, 17, 63, 99)) -> None:
    """kv_path on a subset of a layer's input rows, at their positions, gives the same K/V rows."""
    rows = torch.tensor(rows)
    for il in layers:
        k, v = oracle.kv_path(il, out.layer_inputs[il][rows], rows)
        torch.testing.assert_close(k, out.keys[il][rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, out.values[il][rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", DENSE)
def test_oracle_matches_llama_cpp(arch, tiny_models, prompt_tokens, captured, record_property):
    oracle = load_oracle(tiny_models[arch], dtype=torch.float64)
    out = oracle.forward(prompt_tokens)
    n_layer = mtm.tiny_config(arch).n_layer
    assert out.layer_inputs.shape == (n_layer, N_TOKENS, 64)
    assert out.logits.shape == (N_TOKENS, len(mtm.tokenizer_vocab()[0]))
    assert len(out.keys) == len(out.values) == n_layer

    err = free_running_errors(oracle, prompt_tokens, captured[arch])
    record_property("free_running", err)
    print(f"\n{arch} free-running: {_fmt(err)} | layer max abs {err['layer_max_abs']:.1e}"
          f" logits max abs {err['logits_max_abs']:.1e}")
    assert err["layer_max_rel"][0] == 0.0  # the embedding (gemma3: times sqrt(n_embd)) is exact
    t_max, t_fro, t_logits = TOL_FREE[arch]
    assert max(err["layer_max_rel"]) <= t_max, err
    assert max(err["layer_fro_rel"]) <= t_fro, err
    assert err["logits_max_rel"] <= t_logits, err
    assert err["same_argmax"]


@pytest.mark.parametrize("arch", DENSE)
def test_each_layer_matches_llama_cpp(arch, tiny_models, prompt_tokens, captured, record_property):
    oracle = load_oracle(tiny_models[arch], dtype=torch.float64)
    err = layer_by_layer_errors(oracle, prompt_tokens, captured[arch])
    record_property("layer_by_layer", err)
    print(f"\n{arch} layer by layer: {_fmt(err)}")
    t_max, t_fro, t_logits = TOL_STEP[arch]
    assert max(err["layer_max_rel"]) <= t_max, err
    assert max(err["layer_fro_rel"]) <= t_fro, err
    assert err["logits_max_rel"] <= t_logits, err


@pytest.mark.parametrize("arch", DENSE)
def test_float32_oracle_close_to_float64(arch, tiny_models, prompt_tokens, captured):
    o32 = load_oracle(tiny_models[arch], dtype=torch.float32)
    a = o32.forward(prompt_tokens)
    b = load_oracle(tiny_models[arch], dtype=torch.float64).forward(prompt_tokens)
    assert a.logits.dtype == torch.float32 and b.logits.dtype == torch.float64
    # the float32 oracle is itself within the tolerances
    assert _within(free_running_errors(o32, prompt_tokens, captured[arch]), TOL_FREE[arch])
    if arch != "gemma3":  # (gemma3's GELU table makes the two differ like llama.cpp does)
        assert _rel(a.layer_inputs, b.layer_inputs.numpy())[0] < 3e-6
        assert _rel(a.logits, b.logits.numpy())[0] < 3e-6


@pytest.mark.parametrize("arch", DENSE)
def test_kv_path_reproduces_the_cache_rows(arch, tiny_models, prompt_tokens):
    """kv_path on a layer's input gives exactly the K/V the full layer wrote (the entry point the
    filled-row checks will call on predicted inputs)."""
    oracle = load_oracle(tiny_models[arch], dtype=torch.float64)
    out = oracle.forward(prompt_tokens)
    assert_kv_path_gives_the_cache(oracle, out, (N_TOKENS, 2, 16))
    # rows are independent: a subset of rows at their positions gives the same rows
    assert_kv_path_rows_are_independent(oracle, out, [oracle.n_layer - 1])


# ------------------------------------------------------------------------------------------------
# the comparison is sharp: getting any convention wrong fails it


def set_hp(**changes):
    """A mutation: the oracle's hyperparameters with `changes`."""
    return lambda o: setattr(o, "hp", dataclasses.replace(o.hp, **changes))


def each_layer(f):
    """A mutation: ``f(oracle, layer_weights)`` on every layer."""
    def mutate(o):
        for layer in o.layers:
            f(o, layer)
    return mutate


def _mutations(arch: str) -> dict:
    hp = set_hp

    def drop(attr):
        return each_layer(lambda o, layer: setattr(layer, attr, None))

    if arch == "llama":
        return {"rope NEOX instead of NORM": hp(rope_mode=ROPE_NEOX), "no K bias": drop("bk"),
                "no V bias": drop("bv"), "attention scale 1/head_dim": hp(attn_scale=1 / 16)}
    if arch == "qwen3":
        return {"rope NORM instead of NEOX": hp(rope_mode=ROPE_NORM), "no q-norm": drop("q_norm"),
                "no k-norm": drop("k_norm"), "RoPE base 10000": hp(rope_base=(10000.0,) * 6)}
    n = mtm.tiny_config("gemma3").n_layer
    return {
        "no sliding window": hp(window=(0,) * n),
        "window one row too wide": lambda o: setattr(o, "hp", dataclasses.replace(
            o.hp, window=tuple(w + 1 if w else 0 for w in o.hp.window))),
        "full-attention RoPE base on every layer": lambda o: setattr(o, "hp", dataclasses.replace(
            o.hp, rope_base=(o.hp.rope_base[3],) * n)),
        "no embedding scale": hp(embd_scale=1.0),
        "no final softcap": hp(final_logit_softcap=0.0),
        "no attn post-norm": drop("attn_post_norm"),
        "no ffn post-norm": drop("ffn_post_norm"),
        "exact GELU instead of the CPU table": lambda o: setattr(o, "gelu_fp16_table", False),
    }


@pytest.mark.parametrize("arch", DENSE)
def test_wrong_conventions_are_detected(arch, tiny_models, prompt_tokens, captured):
    cap = captured[arch]
    assert _within(layer_by_layer_errors(load_oracle(tiny_models[arch], dtype=torch.float64),
                                         prompt_tokens, cap), TOL_STEP[arch])
    for name, mutate in _mutations(arch).items():
        oracle = load_oracle(tiny_models[arch], dtype=torch.float64)
        mutate(oracle)
        err = layer_by_layer_errors(oracle, prompt_tokens, cap)
        assert not _within(err, TOL_STEP[arch]), f"{arch}: '{name}' went unnoticed: {_fmt(err)}"


# ------------------------------------------------------------------------------------------------
# dispatch


def test_load_oracle_dispatch_and_unsupported_arch(tmp_path, tiny_models):
    assert isinstance(load_oracle(tiny_models["gemma3"]), DenseOracle)
    assert SUPPORTED_ARCHITECTURES == ("llama", "qwen3", "gemma3", "qwen35", "qwen2", "mistral3", "qwen3moe", "qwen35moe",
                                       "gpt-oss")
    assert set(SUPPORTED_ARCHITECTURES) == set(mtm.ARCHS)  # a tiny model for every architecture the oracle has
    writer = mtm.new_writer(tmp_path / "gpt2.gguf", "gpt2")
    path = mtm.write_and_close(writer, tmp_path / "gpt2.gguf")
    with pytest.raises(ValueError, match=r"'gpt2'.*supported architectures: llama, qwen3, gemma3, qwen35, qwen2, mistral3, qwen3moe, "
                                         r"qwen35moe, gpt-oss"):
        load_oracle(path)
    with pytest.raises(ValueError, match="float32 or torch.float64"):
        load_oracle(tiny_models["llama"], dtype=torch.float16)
