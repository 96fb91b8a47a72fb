"""Filled-row prefill on real weights: Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, d 896, no QK norm),
libllama against the reference of docs/design.md §4 (``ridgefill_cpp.oracle.fill``), as test_prefill.py
does on the tiny random-weight models.

Both sides see the same weights: libllama runs an F32 copy of the Q4_K_M file (every tensor
dequantized), the float64 oracle dequantizes the Q4_K_M file itself; the context keeps F32 K/V
without flash attention. A 1,000-row prompt in two ubatches of 512, split at the default S = 16,
tail 64, a fixed set of exact prefix rows, once with ridge maps fitted on the model (a small fit:
2,000 calibration tokens) and once with identity fill: the last row's logits, the value scales and
every layer's K/V of every row agree to the tiny models' tolerance for qwen2 (2e-5 relative; measured
on this model: logits 3e-7 to 5e-7, K/V at most 3.2e-6). The degenerate settings of §4.6 on the
Q4_K_M file itself are bit-identical to stock prefill.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import evaluation_tokens
from prefill_helpers import assert_degenerate_plans_are_stock, ctx_kwargs, last_logits, rel
from ridgefill_cpp import Llama, RidgeFill  # first: llama_cpp then loads the patched libraries
from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import read_map_file, write_map_file
from ridgefill_cpp.oracle import load_oracle
from ridgefill_cpp.oracle.fill import fill_forward

pytestmark = pytest.mark.slow

N, S, TAIL = 1000, 16, 64
#: test_prefill.py's tolerance for qwen2 (float32 rounding against the float64 oracle)
TOL = 2e-5
#: exact prefix rows: every 47th from row 5 (the selector itself is tested on the tiny models)
EXACT = list(range(5, N - TAIL, 47))
THREADS = dict(n_threads=2, n_threads_batch=2)


@pytest.fixture(scope="module")
def qwen_f32(qwen05_path, tmp_path_factory):
    from ridgefill_cpp.maps.gguf_copy import dequantize_gguf

    dst = dequantize_gguf(qwen05_path, tmp_path_factory.mktemp("qwen-f32") / "qwen2.5-coder-0.5b-f32.gguf")
    yield dst
    dst.unlink()


@pytest.fixture(scope="module")
def qwen_maps(qwen_f32, tmp_path_factory):
    """Ridge maps at S = 16 fitted on the F32 copy (a small fit: 2,000 tokens of the calibration text)."""
    res = fit_ridge_maps(qwen_f32, corpus.default_documents("calibration"),
                         FitOptions(n_tokens=2000, ctx=128, split=S, n_threads=2))
    return write_map_file(tmp_path_factory.mktemp("qwen-maps") / "qwen.ridgefill.gguf", res.maps, dtype="f32")


@pytest.fixture(scope="module")
def qwen_oracle(qwen05_path):
    return load_oracle(qwen05_path, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["ridge", "identity"])
def test_prefill_matches_the_oracle_on_real_weights(kind, qwen05_path, qwen_f32, qwen_maps, qwen_oracle):
    o = qwen_oracle
    assert (o.n_layer, S) == (24, o.n_layer - o.n_layer // 3)  # the default split
    tokens = evaluation_tokens(qwen05_path, N)
    maps = read_map_file(qwen_maps) if kind == "ridge" else None
    ref = fill_forward(o, tokens, split=S, maps=maps, tail=TAIL, exact_positions=EXACT)

    rf = RidgeFill(qwen_maps if kind == "ridge" else None, split=S, tail=TAIL, selector=EXACT, min_prompt=0)
    llm = Llama(str(qwen_f32), ridgefill=rf, **ctx_kwargs(n_ctx=1024, n_batch=512, n_ubatch=512, **THREADS))
    try:
        llm.eval(tokens)
        st = llm.ridgefill_stats
        assert (st["n_prompt"], st["split"], st["tail"]) == (N, S, TAIL)
        assert st["exact_positions"] == EXACT and st["n_filled"] == N - TAIL - len(EXACT)
        assert st["ceiling"] == pytest.approx(1 / ref.compute_ratio, rel=1e-6)

        figures = {"logits": rel(last_logits(llm), ref.last_logits.numpy())}
        scales = np.array(llm.ridgefill_value_scales())
        assert scales.shape == (o.n_layer - S, o.n_head_kv)
        np.testing.assert_allclose(scales, ref.value_scales.numpy(), rtol=TOL, atol=0)
        positions = list(range(N))
        for il in range(o.n_layer):
            k, v = llm.read_kv(il, positions)
            figures[f"k{il}"] = rel(k, ref.keys[il].reshape(N, -1).numpy())
            figures[f"v{il}"] = rel(v, ref.values[il].reshape(N, -1).numpy())
        print(f"\nqwen2.5-coder-0.5b {kind}: logits {figures['logits']:.2e}, K/V max {max(figures.values()):.2e}")
        assert max(figures.values()) < TOL, {k: f for k, f in figures.items() if f >= TOL}
    finally:
        llm.close()


def test_degenerate_plans_are_stock_on_real_weights(qwen05_path):
    """S = L, N <= T and N < min_prompt run stock prefill on the Q4_K_M file, bit for bit."""
    tokens = evaluation_tokens(qwen05_path, 200)
    assert_degenerate_plans_are_stock(qwen05_path, tokens, n_layer=24, split=S, tail=TAIL)
