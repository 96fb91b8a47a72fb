"""Map files loaded by libllama (llama_ridgefill_maps_init): the fill step's x̂ and every refusal."""

from __future__ import annotations

import numpy as np
import pytest

from ridgefill_cpp import corpus, mapfile
from ridgefill_cpp.capture import open_model
from ridgefill_cpp.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.mapfile import MapFileError, read_map_file, write_map_file
from ridgefill_cpp.native_maps import NativeMaps


@pytest.fixture(scope="module")
def fitted(tiny_models, tmp_path_factory):
    """arch -> (model path, F16 map file, F32 map file), maps fitted on the tiny model itself."""
    root = tmp_path_factory.mktemp("maps")
    out = {}
    for arch, path in tiny_models.items():
        res = fit_ridge_maps(path, corpus.default_documents("calibration"),
                             FitOptions(n_tokens=3000, ctx=128, n_threads=1))
        out[arch] = (path, write_map_file(root / f"{arch}.f16.gguf", res.maps, dtype="f16"),
                     write_map_file(root / f"{arch}.f32.gguf", res.maps, dtype="f32"))
    return out


@pytest.fixture
def llm(tiny_models):
    model = open_model(tiny_models["llama"], n_ctx=64, n_batch=64)
    yield model
    model.close()


def _last_logits(llm, tokens):
    from llama_cpp import llama_cpp as C

    llm.reset()
    llm.eval(tokens)
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(llm._model.model))
    return np.ctypeslib.as_array(C.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen35"])
def test_predict_matches_the_map_file(fitted, arch):
    path, f16, f32 = fitted[arch]
    m = open_model(path, n_ctx=64, n_batch=64)
    try:
        xs = np.random.default_rng(0).standard_normal((7, m.n_embd())).astype(np.float32) * 4
        for file, rtol in ((f32, 1e-5), (f16, 2e-3)):  # F16 maps: ggml multiplies in F16
            ref = read_map_file(file)
            with NativeMaps(m._model.model, file, model_path=path) as native:
                S = native.split_layer
                assert S == ref.meta.split_layer
                assert np.array_equal(native.predict(S, xs), xs)  # l = S: x_S itself
                for il in ref.meta.layers:
                    want = ref.predict(il, xs)
                    got = native.predict(il, xs)
                    assert np.abs(got - want).max() <= rtol * np.abs(want).max(), (il, np.abs(got - want).max())
                per_layer = m.n_embd() * m.n_embd() * (2 if file == f16 else 4) + 4 * m.n_embd()
                assert native.n_bytes >= len(ref.meta.layers) * per_layer
    finally:
        m.close()


def _expect_refusal(llm, path, message, **kw):
    tokens = list(range(1, 20))
    before = _last_logits(llm, tokens)
    with pytest.raises(MapFileError, match=message):
        NativeMaps(llm._model.model, path, **kw)
    assert np.array_equal(_last_logits(llm, tokens), before)  # the context is still usable, unchanged


def test_refusals(llm, fitted, tiny_models, tmp_path, monkeypatch):
    import make_tiny_models

    model_path, f16, _ = fitted["llama"]
    _expect_refusal(llm, fitted["qwen3"][1], "maps are for architecture qwen3, the model is llama")
    _expect_refusal(llm, f16, "fitted for split 4, not the requested split 3", split=3)
    _expect_refusal(llm, tiny_models["llama"], "not a RidgeFill map file")
    _expect_refusal(llm, tmp_path / "missing.gguf", "not a readable GGUF file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f16.read_bytes()[:-100])
    _expect_refusal(llm, cut, "not a readable GGUF file|runs past the end")
    other = make_tiny_models.make_tiny_model("llama", tmp_path / "seed1.gguf", seed=1)
    _expect_refusal(llm, f16, "another checkpoint", model_path=other)
    # the same maps for a model of another width
    wide = read_map_file(f16)
    wide.meta.n_embd = 32
    wide.a = {il: a[:32, :32] for il, a in wide.a.items()}
    wide.b = {il: b[:32] for il, b in wide.b.items()}
    _expect_refusal(llm, write_map_file(tmp_path / "wide.gguf", wide), "n_embd 32, the model has 6 layers and n_embd 64")
    # newer format, NaN values: written past the Python-side checks on purpose
    monkeypatch.setattr(mapfile, "check_maps", lambda maps: None)
    newer = read_map_file(f16)
    newer.meta.format_version = 2
    _expect_refusal(llm, write_map_file(tmp_path / "v2.gguf", newer), "format version 2")
    bad = read_map_file(f16)
    bad.a[5][3, 1] = np.nan
    _expect_refusal(llm, write_map_file(tmp_path / "nan.gguf", bad), "blk.5.ridgefill_a.weight has a non-finite value")
    short = read_map_file(f16)
    short.meta.layers = []  # no maps at all (gguf-py then leaves the empty layer list out)
    _expect_refusal(llm, write_map_file(tmp_path / "short.gguf", short), "missing metadata key ridgefill.layers")


def test_load_is_repeatable_and_frees(llm, fitted):
    _, f16, _ = fitted["llama"]
    handles = [NativeMaps(llm._model.model, f16) for _ in range(3)]
    assert len({m.fingerprint for m in handles}) == 1
    for m in handles:
        m.close()
        m.close()  # idempotent
    with pytest.raises(ValueError, match="freed"):
        handles[0].split_layer
