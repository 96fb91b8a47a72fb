"""Derived model copies (first S layers, F32) and the side-by-side prefill benchmark."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from ridgefill_cpp.bench import benchmark_prefill
from ridgefill_cpp.capture import capture_layer_inputs
from ridgefill_cpp.gguf_copy import first_layers_gguf
from ridgefill_cpp.gguf_model import read_model_info


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen35"])
def test_first_layers_copy_computes_the_same_early_layers(tiny_models, tmp_path, arch):
    src = tiny_models[arch]
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    full = read_model_info(src)
    n = full.n_layer - 2
    cut = first_layers_gguf(src, tmp_path / "cut.gguf", n)
    info = read_model_info(cut)
    assert info.n_layer == n and info.n_embd == full.n_embd
    assert info.swa_layers == tuple(il for il in full.swa_layers if il < n)
    assert info.recurrent_layers == tuple(il for il in full.recurrent_layers if il < n)
    tokens = list(range(1, 80))
    a = capture_layer_inputs(src, tokens, layers=list(range(n)), flash_attn=False)
    b = capture_layer_inputs(cut, tokens, layers=list(range(n)), flash_attn=False)
    assert np.array_equal(a.layer_inputs, b.layer_inputs)  # same kernels, same numbers
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest  # the source is only read


def test_first_layers_range(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="outside 1..6"):
        first_layers_gguf(tiny_models["llama"], tmp_path / "x.gguf", 7)
    assert not (tmp_path / "x.gguf").exists()


def test_benchmark_runs_side_by_side(tiny_models, cli, tmp_path):
    res = benchmark_prefill(tiny_models["llama"], lengths=[96, 32], split=3, repeats=2, n_threads=1)
    assert res.lengths == [32, 96] and res.compute_ceiling == 2.0
    assert set(res.times) == {"stock", "first 3 layers"}
    for v in res.times:
        for n in res.lengths:
            assert len(res.times[v][n]) == 2 and all(t > 0 for t in res.times[v][n])
    out = tmp_path / "bench.json"
    r = cli("bench", tiny_models["llama"], "--lengths", "40,80", "--repeats", 1, "--threads", 1, "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert [row["n_prompt"] for row in d["summary"]] == [40, 80]
    assert "ceiling L/S" in r.output and "first 4 layers" in r.output


def test_benchmark_bad_input(cli, tiny_models):
    r = cli("bench", tiny_models["llama"], "--lengths", "4096")
    assert r.exit_code == 1 and "longer than the model's context (2048)" in r.output
    r = cli("bench", tiny_models["llama"], "--lengths", "a,b")
    assert r.exit_code == 1 and "comma-separated integers" in r.output
    r = cli("bench", tiny_models["llama"], "--split", 6)
    assert r.exit_code == 1 and "split 6 outside 1..5" in r.output
