"""Map files loaded by libllama (llama_ridgefill_maps_init): the fill step's x̂ and every refusal."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ridgefill_cpp.fitting import corpus

from ridgefill_cpp.maps import mapfile
from ridgefill_cpp.fitting.capture import open_model
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import MapFileError, read_map_file, write_map_file
from ridgefill_cpp.runtime.native_maps import NativeMaps, UndigestedMapsWarning


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
    from ridgefill_cpp.testing import tiny_models as make_tiny_models
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


# ------------------------------------------------------------------------------------------------
# the model fingerprint in libllama (the loader's own check) against ridgefill_cpp.maps.fingerprint


def _native_fingerprint(path) -> str:
    import ctypes
    import os

    from ridgefill_cpp.core import native as N

    buf = ctypes.create_string_buffer(64)
    n = N.llama_ridgefill_model_fingerprint(os.fsencode(path), buf, len(buf))
    if n < 0:
        raise MapFileError(N.llama_ridgefill_last_error().decode(errors="replace"))
    assert n == len(buf.value)
    return buf.value.decode()


def test_libllama_fingerprint_equals_the_python_one(tiny_models, tmp_path, smollm2_path, gemma3_path):
    import gguf

    from ridgefill_cpp.maps.fingerprint import model_fingerprint

    paths = [*tiny_models.values(), smollm2_path, gemma3_path]
    # what gguf-py can write and llama.cpp's own writer never does: a trailing dimension of 1 (part
    # of the fingerprint: the file's dimension count), an F16 tensor, a tensor too small to fill a
    # sample block, and no tensors at all
    odd = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(odd, "llama")
    w.add_block_count(3)
    w.add_tensor("token_embd.weight", np.arange(64 * 8, dtype=np.float32).reshape(8, 64))
    w.add_tensor("blk.2.ffn_norm.weight", np.ones((1, 64), dtype=np.float32))
    w.add_tensor("blk.1.attn_q.weight", np.full((4, 32), 0.5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    empty = tmp_path / "empty.gguf"
    w = gguf.GGUFWriter(empty, "qwen3")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    for p in [*paths, odd, empty]:
        assert _native_fingerprint(p) == model_fingerprint(p), p
    assert len({_native_fingerprint(p) for p in paths}) == len(paths)


def test_libllama_fingerprint_refuses_what_is_not_a_model(tmp_path, tiny_models):
    import os

    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    with pytest.raises(MapFileError, match="model.fifo: the model is not a regular file"):
        _native_fingerprint(fifo)  # refused, not opened (which would block)
    with pytest.raises(MapFileError, match="model is not a regular file"):
        _native_fingerprint(tmp_path)
    with pytest.raises(MapFileError, match="missing.gguf"):
        _native_fingerprint(tmp_path / "missing.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_models["llama"].read_bytes()[:3000])
    with pytest.raises(MapFileError, match="cut.gguf: truncated"):
        _native_fingerprint(cut)
    text = tmp_path / "text.gguf"
    text.write_text("not a model\n")
    with pytest.raises(MapFileError, match="text.gguf: not a GGUF file"):
        _native_fingerprint(text)


def test_loader_checks_the_fingerprint_and_refuses_fifos(llm, fitted, tiny_models, tmp_path):
    import os

    model_path, f16, _ = fitted["llama"]
    NativeMaps(llm._model.model, f16, model_path=model_path).close()  # its own model: loads
    # the refusal now comes from libllama's loader (the server and C callers get it too)
    other = tiny_models["llama"].parent / "fp-seed2.gguf"
    from ridgefill_cpp.testing import tiny_models as make_tiny_models
    make_tiny_models.make_tiny_model("llama", other, seed=2)
    _expect_refusal(llm, f16, r"fitted on model sha256:[0-9a-f]{32}, .*fp-seed2.gguf is sha256:[0-9a-f]{32} \(another "
                    r"checkpoint\)", model_path=other)
    fifo = tmp_path / "maps.fifo"
    os.mkfifo(fifo)
    _expect_refusal(llm, fifo, "maps.fifo: the map file is not a regular file")
    _expect_refusal(llm, f16, "model.fifo: the model is not a regular file", model_path=_fifo(tmp_path / "model.fifo"))


def _fifo(path):
    import os

    os.mkfifo(path)
    return path


def test_llama_server_refuses_maps_of_another_checkpoint(fitted, tiny_models, tmp_path):
    """The patched llama-server used directly (not through ridgefill-gguf serve) checks the
    fingerprint at start-up: it exits with the message before it listens."""
    import subprocess

    from ridgefill_cpp.testing import tiny_models as make_tiny_models
    import ridgefill_cpp

    _, f16, _ = fitted["llama"]
    other = make_tiny_models.make_tiny_model("llama", tmp_path / "seed3.gguf", seed=3)
    server = ridgefill_cpp.build_info()["llama_server"]
    proc = subprocess.run([server, "-m", str(other), "--ridgefill-maps", str(f16), "--host", "127.0.0.1", "--port", "0",
                           "-c", "256"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "another checkpoint" in log and "seed3.gguf" in log, log[-3000:]


# ------------------------------------------------------------------------------------------------
# content digests and metadata ranges in libllama's loader (#36)


def test_loader_checks_each_tensors_digest(llm, fitted, tmp_path, monkeypatch):
    """Silently corrupted weights (one flipped byte, one flipped exponent bit, a matrix set to 60000:
    all finite) loaded and prefilled without a word; libllama's loader now checks each tensor's
    XXH64 against the file's digest and names the tensor."""
    from prefill_helpers import captured_log
    from test_mapfile import corrupted_copy, flip_byte, flip_exponent_bit, set_to, without_digest

    model_path, f16, f32 = fitted["llama"]
    for f in (f16, f32):
        with NativeMaps(llm._model.model, f, model_path=model_path) as m:
            assert m.digest_checked
    for i, (tensor, edit) in enumerate((("blk.5.ridgefill_a.weight", flip_byte(11)),
                                        ("blk.5.ridgefill_a.weight", flip_exponent_bit),
                                        ("blk.5.ridgefill_a.weight", set_to(60000.0, np.float16)),
                                        ("blk.5.ridgefill_b.bias", flip_byte(0)))):
        bad = corrupted_copy(f16, tmp_path / f"bad{i}.gguf", tensor, edit)
        _expect_refusal(llm, bad, rf"bad{i}\.gguf: tensor {tensor}: its bytes give xxh64 [0-9a-f]{{16}}, the file records "
                        r"[0-9a-f]{16}: the file was corrupted after it was written", model_path=model_path)
    # a file without a digest (written before digests existed, or with the digest's key renamed to hide a
    # flipped byte) loaded silently; it is refused unless LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1
    old = without_digest(f16, tmp_path / "old.gguf")
    renamed = corrupted_copy(f16, tmp_path / "renamed.gguf", "blk.5.ridgefill_a.weight", flip_byte(11))
    data = renamed.read_bytes()
    assert data.count(mapfile.KEY_DIGEST.encode()) == 1
    renamed.write_bytes(data.replace(mapfile.KEY_DIGEST.encode(), mapfile.KEY_DIGEST[:-1].encode() + b"X"))
    for path in (old, renamed):
        _expect_refusal(llm, path, rf"{path.name}: the file has no content digest \(ridgefill\.digest\.xxh64\), so corrupted "
                        r"map weights could not be detected: add one with `ridgefill-gguf digest FILE` if you trust its "
                        r"bytes \(or fit the maps again\), or set LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1 to load it unchecked",
                        model_path=model_path)
    monkeypatch.setenv("LLAMA_RIDGEFILL_ALLOW_UNDIGESTED", "1")
    with captured_log() as log:
        with pytest.warns(UndigestedMapsWarning, match="loaded only because LLAMA_RIDGEFILL_ALLOW_UNDIGESTED is set"), \
                NativeMaps(llm._model.model, old, model_path=model_path) as m:
            assert not m.digest_checked
    assert any("has no content digest (ridgefill.digest.xxh64), loaded unchecked" in line for line in log), log


def test_loader_range_checks_input_norm_eps(llm, fitted, tmp_path):
    """A NaN or negative ridgefill.input_norm_eps loaded and then aborted the process at the first
    planned prompt (GGML_ASSERT(eps >= 0) in ggml_rms_norm); the loader refuses it naming the key."""
    import gguf

    model_path, f16, _ = fitted["llama"]
    for i, eps in enumerate((float("nan"), -1e-6, float("inf"), 0.5)):
        bad = mapfile.rewrite_map_file(f16, tmp_path / f"eps{i}.gguf", drop_key=lambda k: k == mapfile.KEY_INPUT_NORM_EPS,
                                       add_keys=[(mapfile.KEY_INPUT_NORM_EPS, eps, gguf.GGUFValueType.FLOAT32)])
        _expect_refusal(llm, bad, rf"eps{i}\.gguf: metadata key ridgefill\.input_norm_eps = [-a-z0-9.e]+ outside \[0, 0\.01\]",
                        model_path=model_path)


def test_every_entry_point_refuses_corrupted_maps(fitted, tiny_models, tmp_path):
    """Llama(..., ridgefill=...), ridgefill-gguf info and serve, and llama-server started directly:
    a corrupted map file or a NaN input_norm_eps is refused before any prompt runs."""
    import subprocess

    import gguf
    from typer.testing import CliRunner

    import ridgefill_cpp
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.cli import app
    from ridgefill_cpp.server.serve import check_ridgefill
    from test_mapfile import corrupted_copy, flip_byte

    model_path, f16, _ = fitted["llama"]
    corrupt = corrupted_copy(f16, tmp_path / "corrupt.gguf", "blk.5.ridgefill_a.weight", flip_byte(3))
    nan_eps = mapfile.rewrite_map_file(f16, tmp_path / "naneps.gguf", drop_key=lambda k: k == mapfile.KEY_INPUT_NORM_EPS,
                                       add_keys=[(mapfile.KEY_INPUT_NORM_EPS, float("nan"), gguf.GGUFValueType.FLOAT32)])
    why = {corrupt: "tensor blk.5.ridgefill_a.weight: its bytes give xxh64", nan_eps: "ridgefill.input_norm_eps = nan outside"}
    server = ridgefill_cpp.build_info()["llama_server"]
    for bad, message in why.items():
        with pytest.raises(MapFileError, match=message.replace(".", r"\.")):
            Llama(str(model_path), n_ctx=256, verbose=False, ridgefill=RidgeFill(bad, min_prompt=8))
        res = CliRunner().invoke(app, ["info", str(bad)])
        assert res.exit_code == 1 and message in res.output, res.output
        with pytest.raises(MapFileError, match=message.replace(".", r"\.")):
            check_ridgefill(model_path, RidgeFill(bad))
        proc = subprocess.run([server, "-m", str(model_path), "--ridgefill-maps", str(bad), "--host", "127.0.0.1",
                               "--port", "0", "-c", "256"], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


def test_an_undigested_map_file_is_refused_everywhere_until_digest_gives_it_one(fitted, cli, tmp_path, monkeypatch):
    """Map files without a content digest loaded silently (in libllama, Llama and llama-server), so a
    renamed digest key hid a flipped byte. They are refused now, saying how to go on:
    ``ridgefill-gguf digest FILE`` gives a trusted file its digest (after which it loads), or
    LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1 loads it unchecked. ``info`` still describes it."""
    import subprocess

    import ridgefill_cpp
    from ridgefill_cpp import Llama, RidgeFill
    from test_mapfile import corrupted_copy, flip_byte, without_digest

    model_path, f16, _ = fitted["llama"]
    old = without_digest(f16, tmp_path / "old.gguf")
    message = "old.gguf: the file has no content digest (ridgefill.digest.xxh64)"
    with pytest.raises(MapFileError, match=re.escape(message)):
        Llama(str(model_path), n_ctx=256, verbose=False, ridgefill=RidgeFill(old, min_prompt=8))
    server = ridgefill_cpp.build_info()["llama_server"]
    proc = subprocess.run([server, "-m", str(model_path), "--ridgefill-maps", str(old), "--host", "127.0.0.1",
                           "--port", "0", "-c", "256"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    res = cli("info", old)
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "libllama refuses the file; `ridgefill-gguf digest FILE` adds one" in said, res.output

    # the command: to another file, then in place; a file that has one is checked and left alone
    before = old.read_bytes()
    res = cli("digest", old, "-o", tmp_path / "new.gguf")
    assert res.exit_code == 0 and "wrote" in res.output and old.read_bytes() == before, res.output
    assert (tmp_path / "new.gguf").read_bytes() == f16.read_bytes()
    res = cli("digest", old)
    assert res.exit_code == 0 and "wrote" in res.output and read_map_file(old).meta.digest == "xxh64"
    res = cli("digest", old)
    assert res.exit_code == 0 and "already has a content digest: checked" in " ".join(res.output.split())
    llm = Llama(str(model_path), n_ctx=256, verbose=False, ridgefill=RidgeFill(old, min_prompt=8))
    llm.close()
    for bad, why in ((corrupted_copy(f16, tmp_path / "bad.gguf", "blk.5.ridgefill_a.weight", flip_byte(3)),
                      "its bytes give xxh64"), (model_path, "not a RidgeFill map file")):
        before = bad.read_bytes()
        res = cli("digest", bad)
        assert res.exit_code == 1 and why in res.output and isinstance(res.exception, SystemExit), res.output
        assert bad.read_bytes() == before

    # the opt-in: loads unchecked, the model's own output unchanged by the choice
    old2 = without_digest(f16, tmp_path / "old2.gguf")
    monkeypatch.setenv("LLAMA_RIDGEFILL_ALLOW_UNDIGESTED", "1")
    with pytest.warns(UndigestedMapsWarning, match="no content digest"):
        llm = Llama(str(model_path), n_ctx=256, verbose=False, ridgefill=RidgeFill(old2, min_prompt=8))
    assert llm._rf_maps.digest_checked is False
    llm.close()
