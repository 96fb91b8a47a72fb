"""Compact maps (docs/design.md §7.1): quantized (Q8_0, Q4_0, Q4_K) and low-rank map tensors.

Checked against what they stand for: the quantizers against gguf-py's independent dequantizers, the
reduced-rank factors against a direct computation, libllama's fill step (``llama_ridgefill_maps_predict``
and the whole planned prefill) against the reference of docs/design.md §4 applying the same stored map
(dequantized, with the activation rounding ggml's CPU backend applies: then they agree to float32
rounding); and every refusal: a type or rank the maps cannot take, a mixed or unsupported type, a NaN in
a quantized block, ranks that do not match the factors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ridgefill_cpp.testing import tiny_models as mtm
from conftest import evaluation_tokens

import ridgefill_cpp  # noqa: F401  (first: llama_cpp then loads the patched libraries)
from prefill_helpers import ctx_kwargs, last_logits, rel
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.maps import compact
from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.maps import mapfile
from ridgefill_cpp.fitting.capture import open_model
from ridgefill_cpp.fitting.fit import FitError, FitOptions, compact_result, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import MapFileError, read_map_file, write_map_file
from ridgefill_cpp.runtime.native_maps import NativeMaps
from ridgefill_cpp.oracle import load_oracle
from ridgefill_cpp.oracle.fill import attention_scores, default_selector_layer, fill_forward, select_exact_rows

#: (name, dtype, form, rank) of the compact kinds a 64-wide tiny model takes (Q4_K needs 256: see below)
KINDS = [("q8_0", "q8_0", "full", None), ("q4_0", "q4_0", "full", None),
         ("f32-identity-r16", "f32", "identity_low_rank", 16), ("f32-plain-r24", "f32", "low_rank", 24),
         ("f16-identity-r8", "f16", "identity_low_rank", 8), ("q8_0-identity-r32", "q8_0", "identity_low_rank", 32)]


@pytest.fixture(scope="module")
def fits(tiny_models):
    """arch -> a fresh fit result (maps at S = L/2 with their calibration statistics)."""
    out = {}
    for arch in ("llama", "qwen3"):
        L = 6
        out[arch] = fit_ridge_maps(tiny_models[arch], corpus.default_documents("calibration"),
                                   FitOptions(n_tokens=4000, ctx=128, split=L // 2, n_threads=1))
    return out


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A 256-wide tiny llama (Q4_K's blocks are 256 long) and its fit."""
    path = mtm.make_tiny_model("llama", tmp_path_factory.mktemp("wide") / "wide.gguf", seed=2, n_embd=256)
    return path, fit_ridge_maps(path, corpus.default_documents("calibration"),
                                FitOptions(n_tokens=4000, ctx=128, split=3, n_threads=1))


@pytest.fixture(scope="module")
def files(fits, tmp_path_factory):
    """(arch, kind name) -> map file."""
    root = tmp_path_factory.mktemp("compact")
    out = {}
    for arch, res in fits.items():
        for name, dtype, form, rank in KINDS:
            c = compact_result(res, dtype=dtype, form=form, rank=rank)
            out[arch, name] = write_map_file(root / f"{arch}.{name}.gguf", c.maps, dtype=dtype)
    return out


# ------------------------------------------------------------------------------------------------
# the pieces


def test_quantizers_round_trip_through_gguf_py():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    for dtype, bound in (("f32", 0), ("f16", 1e-3), ("q8_0", 0.01), ("q4_0", 0.2), ("q4_k", 0.2)):
        q = compact.quantize(x, dtype)
        assert q.nbytes == 8 * compact.row_bytes(dtype, 512)
        y = compact.dequantize(q, dtype, 512)
        assert y.shape == x.shape and np.abs(y - x).max() <= bound * np.abs(x).max(), dtype
        if dtype in compact.QUANTIZED:
            assert not np.array_equal(y, x)
    # the importance matrix moves the error to where the inputs are small
    imp = np.where(np.arange(512) % 2 == 0, 100.0, 0.01).astype(np.float32)
    for dtype in ("q4_0", "q4_k"):
        plain = ((compact.round_trip(x, dtype) - x) ** 2 * imp).sum()
        weighted = ((compact.round_trip(x, dtype, imp) - x) ** 2 * imp).sum()
        assert weighted < plain, dtype


def test_rows_that_do_not_fill_a_block_are_refused_naming_what_fits():
    with pytest.raises(compact.CompactError, match=r"q4_k stores rows in blocks of 256 elements; the maps have rows of 576: use q8_0 or q4_0"):
        compact.check_dtype("q4_k", [576], "the maps")
    with pytest.raises(compact.CompactError, match="rows of 24"):
        compact.check_dtype("q8_0", [64, 24])
    with pytest.raises(compact.CompactError, match="dtype must be one of"):
        compact.check_dtype("q5_1", [64])


def test_map_bytes_is_what_a_file_holds(fits, files):
    res = fits["llama"]
    n, layers = res.maps.meta.n_embd, res.maps.meta.layers
    for name, dtype, form, rank in KINDS:
        assert mapfile.map_tensor_bytes(files["llama", name]) == compact.map_bytes(n, len(layers), dtype, rank), name
    # arithmetic for the shapes users run: 8,192-wide, 27 late layers (a 70B)
    assert compact.map_bytes(8192, 27, "f16") == 27 * (8192 * 8192 * 2 + 4 * 8192)
    assert compact.map_bytes(8192, 27, "q4_k") == 27 * (8192 * 8192 // 256 * 144 + 4 * 8192)


def test_cpu_activation_rounding_is_ggmls_q8():
    """Q8_0 of gguf-py (ggml's reference quantizer) and Q8_K by its definition."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 256)) * rng.uniform(0.1, 10, (5, 1))).astype(np.float32)
    q8 = dequantize(quantize(x, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(compact.cpu_activation_round(x, "q8_0"), q8.astype(np.float64))
    k = compact.cpu_activation_round(x, "q4_k")
    for row, got in zip(x, k):
        m = row[np.abs(row).argmax()]
        step = abs(m) / 127
        assert np.all(np.abs(got - row) <= 0.5 * step * (1 + 1e-6))
        assert np.allclose(got / step, np.round(got / step), atol=1e-4)  # on the grid of 127 steps of |max|
    assert np.array_equal(compact.cpu_activation_round(x, "f32"), x.astype(np.float64))


def test_low_rank_factors_are_the_reduced_rank_solution():
    rng = np.random.default_rng(2)
    d, n = 24, 4000
    mix = rng.standard_normal((d, d))
    x = rng.standard_normal((n, d)) @ mix
    a = np.eye(d) + rng.standard_normal((d, 3)) @ rng.standard_normal((3, d)) + 0.01 * rng.standard_normal((d, d))
    b = rng.standard_normal(d)
    y = x @ a.T + b
    mx, cxx = x.mean(0), np.cov(x.T, bias=True)
    lr = compact.low_rank_basis(a, b, mx, cxx, "identity_low_rank")
    u, vt, b_r = lr.factors(d)
    np.testing.assert_allclose(np.eye(d) + u @ vt, a, atol=1e-9)  # full rank: the map itself
    np.testing.assert_allclose(b_r, b, atol=1e-9)
    u3, vt3, b3 = lr.factors(3)
    assert np.abs(np.eye(d) + u3 @ vt3 - a).max() < 0.1  # the planted rank-3 correction
    errors = compact.held_out_errors(lr, x[:500], y[:500], range(d + 1))
    for r in (0, 3, 7, d):  # the O(d²) formula against the direct residual
        ur, vtr, br = lr.factors(r)
        pred = x[:500] @ (lr.dense_of(ur, vtr)).T + br
        assert errors[r] == pytest.approx(((y[:500] - pred) ** 2).sum(1).mean(), rel=1e-9, abs=1e-12 * errors[0]), r
    assert errors[3] < 0.02 * errors[0] and errors[d] < 1e-20 + errors[3]
    assert compact.rank_for_share(errors, 0.9, d) <= 3
    assert errors[compact.rank_for_share(errors, 1.0, d)] <= errors[d] + 1e-12 * errors[0]
    with pytest.raises(compact.CompactError, match="share"):
        compact.rank_for_share(errors, 1.5, d)


def test_compact_result_checks_and_measures_the_stored_maps(fits, wide):
    res = fits["llama"]
    with pytest.raises(FitError, match="rank 64 outside 1..63"):
        compact_result(res, form="identity_low_rank", rank=64)
    with pytest.raises(FitError, match="needs a rank or a share"):
        compact_result(res, form="low_rank")
    with pytest.raises(FitError, match="low-rank forms only"):
        compact_result(res, rank=8)
    with pytest.raises(FitError, match="q4_k stores rows in blocks of 256"):
        compact_result(res, dtype="q4_k")
    with pytest.raises(FitError, match="rows of 8"):
        compact_result(res, dtype="q8_0", form="identity_low_rank", rank=8)  # U's rows are r long
    q8 = compact_result(res, dtype="q8_0")
    assert q8.maps.meta.rel_err_median != res.maps.meta.rel_err_median  # measured on the stored maps
    assert q8.maps.meta.rel_err_median == pytest.approx(res.maps.meta.rel_err_median, abs=0.01)
    assert res.maps.meta.map_form == "full" and not res.maps.factors  # the fit's own result is unchanged
    shared = compact_result(res, form="identity_low_rank", rank_share=0.9)
    assert all(1 <= r < 64 and r % 8 == 0 for r in shared.maps.meta.ranks)
    low = compact_result(res, form="identity_low_rank", rank=8)
    assert all(lo > full for lo, full in zip(low.maps.meta.rel_err_median, res.maps.meta.rel_err_median))
    _, wres = wide
    q4k = compact_result(wres, dtype="q4_k")
    assert q4k.maps.meta.rel_err_median == pytest.approx(wres.maps.meta.rel_err_median, abs=0.05)


# ------------------------------------------------------------------------------------------------
# libllama against the reference


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fill_step_matches_the_map_file(arch, tiny_models, files):
    m = open_model(tiny_models[arch], n_ctx=64, n_batch=64)
    try:
        xs = np.random.default_rng(0).standard_normal((7, m.n_embd())).astype(np.float32) * 4
        for name, dtype, form, rank in KINDS:
            ref = read_map_file(files[arch, name])
            assert (ref.meta.dtype, ref.meta.map_form) == (dtype, form)
            assert ref.meta.ranks == ([rank] * len(ref.meta.layers) if rank else [])
            with NativeMaps(m._model.model, files[arch, name], model_path=tiny_models[arch]) as native:
                assert (native.type, native.form) == (dtype, form)
                assert native.n_bytes >= mapfile.map_tensor_bytes(files[arch, name])
                for il in ref.meta.layers:
                    got = native.predict(il, xs)
                    exact = ref.predict(il, xs)  # the stored map, exact products
                    ref.activation_rounding = True
                    rounded = ref.predict(il, xs)  # ... with ggml's CPU activation rounding
                    ref.activation_rounding = False
                    scale = np.abs(exact).max()
                    assert np.abs(got - rounded).max() <= 2e-5 * scale, (name, il, np.abs(got - rounded).max() / scale)
                    if dtype in compact.QUANTIZED:  # the rounding is what separates them
                        assert np.abs(got - exact).max() > 20 * np.abs(got - rounded).max(), name
    finally:
        m.close()


def test_q4_k_fill_step_on_a_wide_model(wide, tmp_path):
    path, res = wide
    c = compact_result(res, dtype="q4_k")
    f = write_map_file(tmp_path / "q4k.gguf", c.maps, dtype="q4_k")
    ref = read_map_file(f)
    assert ref.meta.dtype == "q4_k"
    ref.activation_rounding = True
    m = open_model(path, n_ctx=64, n_batch=64)
    try:
        xs = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
        with NativeMaps(m._model.model, f, model_path=path) as native:
            assert native.type == "q4_k"
            for il in ref.meta.layers:
                want = ref.predict(il, xs)
                assert np.abs(native.predict(il, xs) - want).max() <= 2e-5 * np.abs(want).max()
    finally:
        m.close()


N_TOKENS = 200


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "f32-identity-r16", "f32-plain-r24", "q8_0-identity-r32"])
def test_planned_prefill_matches_the_oracle(name, tiny_models, files):
    """The whole plan (filled K/V of every late layer, value scales, last logits) with a compact map
    file, against the oracle applying the same stored map."""
    arch = "llama"
    o = load_oracle(tiny_models[arch], dtype=torch.float64)
    S, L, tail = o.n_layer // 2, o.n_layer, 32
    tokens = evaluation_tokens(tiny_models[arch], N_TOKENS)
    exact = select_exact_rows(attention_scores(o, tokens, default_selector_layer(o, S)), N_TOKENS - tail, 0.1)
    maps = read_map_file(files[arch, name])
    maps.activation_rounding = True
    ref = fill_forward(o, tokens, split=S, maps=maps, tail=tail, exact_positions=exact, value_rescale=64)
    rf = RidgeFill(files[arch, name], split=S, tail=tail, selector=exact, value_rescale=64, min_prompt=0)
    llm = Llama(str(tiny_models[arch]), ridgefill=rf, **ctx_kwargs(n_ubatch=64, n_batch=256))
    try:
        llm.eval(tokens)
        st = llm.ridgefill_stats
        assert st["n_filled"] == N_TOKENS - tail - len(exact) > 0
        assert st["maps_type"] == maps.meta.dtype + ("" if maps.meta.map_form == "full" else f" {maps.meta.map_form}")
        tol = 2e-5  # test_prefill.py's for llama
        assert rel(last_logits(llm), ref.last_logits.numpy()) < tol
        np.testing.assert_allclose(np.array(llm.ridgefill_value_scales()), ref.value_scales.numpy(), rtol=tol, atol=0)
        positions = list(range(N_TOKENS))
        for il in range(S + 1, L):
            k, v = llm.read_kv(il, positions)
            assert rel(k, ref.keys[il].reshape(N_TOKENS, -1).numpy()) < tol, il
            assert rel(v, ref.values[il].reshape(N_TOKENS, -1).numpy()) < tol, il
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# refusals


def _raw_matrix(dtype: str, x: np.ndarray):
    import gguf

    q = compact.quantize(x, dtype)
    return q, gguf.GGMLQuantizationType(compact.GGML_TYPES[dtype])


def _rewrite(src, dst, tensor: str, data: np.ndarray, raw_dtype):
    """``src`` with ``tensor`` replaced by the raw ``data`` of type ``raw_dtype``, with a fresh content
    digest (so that only the check under test fails)."""
    return mapfile.rewrite_map_file(src, dst, drop_tensor=lambda n: n == tensor, add_tensors=[(tensor, data, raw_dtype)])


@pytest.fixture
def llama_model(tiny_models):
    """The tiny llama, loaded (the refusal tests hand its llama_model to libllama's map loader)."""
    m = open_model(tiny_models["llama"], n_ctx=64, n_batch=64)
    yield m._model.model
    m.close()


def _refused(llm_model, path, model_path, message):
    with pytest.raises(MapFileError, match=message):
        read_map_file(path)
    with pytest.raises(MapFileError, match=message):
        NativeMaps(llm_model, path, model_path=model_path)


def test_mixed_unsupported_and_non_finite_types_are_refused_naming_the_tensor(llama_model, tiny_models, files, tmp_path):
    model = tiny_models["llama"]
    q8 = files["llama", "q8_0"]
    layers = read_map_file(q8).meta.layers
    first, last = layers[0], layers[-1]
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    # one layer's A in another supported type: mixed
    mixed = _rewrite(q8, tmp_path / "mixed.gguf", mapfile.tensor_name_a(last), *_raw_matrix("q4_0", x))
    _refused(llama_model, mixed, model,
             rf"blk\.{last}\.ridgefill_a\.weight is (Q4_0|q4_0), blk\.{first}\.ridgefill_a\.weight is (Q8_0|q8_0): every map matrix of a file has one type")
    # a type the runtime does not take
    import gguf
    from gguf.quants import quantize

    q51 = quantize(x, gguf.GGMLQuantizationType.Q5_1)
    odd = _rewrite(files["llama", "q4_0"], tmp_path / "q51.gguf", mapfile.tensor_name_a(first), q51,
                   gguf.GGMLQuantizationType.Q5_1)
    _refused(llama_model, odd, model, rf"blk\.{first}\.ridgefill_a\.weight is (Q5_1|q5_1)")
    # a NaN block scale in a quantized matrix (the first two bytes of a Q8_0 block are its F16 scale)
    raw, kind = _raw_matrix("q8_0", x)
    raw = raw.copy()
    raw[3, 34:36] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
    nan = _rewrite(q8, tmp_path / "nan.gguf", mapfile.tensor_name_a(first), raw, kind)
    with pytest.raises(MapFileError, match="NaN or Inf"):
        read_map_file(nan)
    with pytest.raises(MapFileError, match=rf"blk\.{first}\.ridgefill_a\.weight has a non-finite value \(nan\) at element {3 * 64 + 32}"):
        NativeMaps(llama_model, nan, model_path=model)


def test_low_rank_files_whose_ranks_or_factors_do_not_match_are_refused(llama_model, tiny_models, files, tmp_path):
    import gguf

    model = tiny_models["llama"]
    src = files["llama", "f32-identity-r16"]
    layers = read_map_file(src).meta.layers
    ranks = mapfile.rewrite_map_file(src, tmp_path / "ranks.gguf", drop_key=lambda n: n == mapfile.KEY_MAP_RANKS,
                                     add_keys=[(mapfile.KEY_MAP_RANKS, [12] * len(layers), gguf.GGUFValueType.ARRAY)])
    with pytest.raises(MapFileError, match=r"ridgefill.map_ranks = \[12(, 12)*\], the factors have ranks \[16"):
        read_map_file(ranks)
    with pytest.raises(MapFileError, match=rf"tensor blk\.{layers[0]}\.ridgefill_a_down\.weight is f32 \[64, 16\], expected "):
        NativeMaps(llama_model, ranks, model_path=model)
    form = mapfile.rewrite_map_file(src, tmp_path / "form.gguf", drop_key=lambda n: n == mapfile.KEY_MAP_FORM,
                                    add_keys=[(mapfile.KEY_MAP_FORM, "sparse", gguf.GGUFValueType.STRING)])
    _refused(llama_model, form, model, "ridgefill.map_form = '?sparse'?")
    full = mapfile.rewrite_map_file(src, tmp_path / "full.gguf", drop_key=lambda n: n in (mapfile.KEY_MAP_FORM, mapfile.KEY_MAP_RANKS))
    _refused(llama_model, full, model, rf"ridgefill_a_(down|up)\.weight|{3 * len(layers)} tensors, expected {2 * len(layers)} \(A and b")


# ------------------------------------------------------------------------------------------------
# the tools: fit, info, tune, the server


def _flat(text: str) -> str:
    """``text`` without whitespace: rich folds long table cells at the terminal's width."""
    return "".join(text.split())


def test_cli_fit_and_info_with_compact_maps(cli, tiny_models, tmp_path):
    model = tiny_models["llama"]
    out = tmp_path / "q8.gguf"
    r = cli("fit", model, "--tokens", "3000", "--ctx", "128", "-o", out, "--threads", "1")  # q8_0: the default
    assert r.exit_code == 0, r.output
    assert _flat("as stored (Q8_0, full 64×64 matrices)") in _flat(r.output) and "maps: Q8_0" in r.output
    r = cli("info", out, "--model", model)
    assert r.exit_code == 0, r.output
    ratio = compact.map_bytes(64, 2, "q8_0") / compact.map_bytes(64, 2, "f16")  # 0.55: the F32 biases weigh at 64 wide
    for text in ("Q8_0, full 64×64 matrices", f"{ratio:.2f}x of full F16 maps", "the maps fit"):
        assert _flat(text) in _flat(r.output), text
    d = json.loads(cli("info", out, "--json").output)
    assert d["dtype"] == "q8_0" and d["map_form"] == "full" and d["ranks"] == []
    assert d["maps_bytes"] == sum(d["maps_bytes_per_layer"].values()) == mapfile.map_tensor_bytes(out)
    low = tmp_path / "low.gguf"
    r = cli("fit", model, "--tokens", "3000", "--ctx", "128", "--rank-share", "0.9", "--dtype", "f16", "-o", low, "--threads", "1")
    assert r.exit_code == 0, r.output
    d = json.loads(cli("info", low, "--json").output)
    assert d["map_form"] == "identity_low_rank" and d["dtype"] == "f16" and len(d["ranks"]) == len(d["layers"])
    assert d["maps_bytes"] < d["maps_bytes_full_f16"]
    assert _flat("I + U Vᵀ of rank") in _flat(cli("info", low).output)
    for args, message in ((["--dtype", "q4_k"], "q4_k stores rows in blocks of 256 elements; the maps of .* have rows of 64: use q8_0 or q4_0"),
                          (["--rank", "64"], "--rank 64 must be below n_embd"),
                          (["--rank", "8", "--dtype", "q8_0"], "rows of 8"),
                          (["--rank", "8", "--rank-share", "0.5"], "not both"),
                          (["--rank", "8", "--rank-form", "diagonal"], "identity or plain"),
                          (["--dtype", "bf16"], "--dtype must be one of")):
        r = cli("fit", model, "--tokens", "3000", "--ctx", "128", "-o", tmp_path / "x.gguf", *args)
        assert r.exit_code != 0 and not (tmp_path / "x.gguf").exists()
        import re

        assert re.search(message, " ".join(r.output.split())), (args, r.output)


def test_tune_keeps_the_stored_type_and_the_server_uses_it(tiny_models, files, tmp_path):
    import shutil
    import urllib.request

    from ridgefill_cpp.server.serve import Server

    model = tiny_models["llama"]
    path = shutil.copy(files["llama", "q8_0-identity-r32"], tmp_path / "tuned.gguf")
    before = read_map_file(path)
    mapfile.write_tuned_defaults(path, {"tail": 16, "exact_fraction": 0.2, "selector": "attention"})
    after = read_map_file(path)
    assert after.meta.digest == "xxh64" and (after.meta.dtype, after.meta.map_form, after.meta.ranks) == (
        before.meta.dtype, before.meta.map_form, before.meta.ranks)
    for il in before.meta.layers:  # the quantized bytes were copied, not re-quantized
        assert np.array_equal(after.factors[il][0], before.factors[il][0])
    tokens = evaluation_tokens(model, 300)
    rf = RidgeFill(path, min_prompt=64)
    llm = Llama(str(model), ridgefill=rf, **ctx_kwargs(n_ctx=512, n_ubatch=64, n_batch=256))
    try:
        llm.eval(tokens)
        lib = last_logits(llm)
        st = llm.ridgefill_stats
        assert st["tail"] == 16 and st["maps_type"] == "q8_0 identity_low_rank" and st["n_filled"] > 0
    finally:
        llm.close()
    args = ["-c", "1024", "-np", "1", "-b", "256", "-ub", "64", "--threads", "1", "-ngl", "0", "-fa", "off",
            "-ctk", "f32", "-ctv", "f32", "--no-warmup"]
    with Server(model, RidgeFill(path, min_prompt=64), extra_args=args, log_path=tmp_path / "s.log", startup_timeout=60) as s:
        body = json.dumps({"prompt": tokens, "n_predict": 1, "temperature": 0, "cache_prompt": False,
                           "return_tokens": True}).encode()
        req = urllib.request.Request(s.url + "/completion", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            res = json.loads(r.read())
    assert res["ridgefill"]["applied"] and res["ridgefill"]["tail"] == 16 and res["ridgefill"]["n_filled"] > 0
    assert res["tokens"] == [int(np.argmax(lib))]  # the library's greedy token
