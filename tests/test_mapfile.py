"""The map file: gguf-py round trip, atomic writes, every bad-input case, and the fit/info CLI."""

from __future__ import annotations

import json

import copy
import hashlib
import os
import re
from pathlib import Path

import numpy as np
import pytest

from ridgefill_cpp.maps import mapfile
from ridgefill_cpp.maps.fingerprint import model_fingerprint
from ridgefill_cpp.maps.mapfile import MapFileError, MapFileMeta, RidgeMaps, read_map_file, write_map_file
from ridgefill_cpp.testing.synthetic_maps import without_digest  # tools/: a map file as written before content digests existed


def _maps(n_embd=16, split=3, n_layer=6, seed=0, arch="llama", fingerprint="sha256:x") -> RidgeMaps:
    rng = np.random.default_rng(seed)
    layers = list(range(split + 1, n_layer))
    meta = MapFileMeta(
        architecture=arch, split_layer=split, n_layer=n_layer, n_embd=n_embd, objective="normalized",
        input_norm_eps=1e-5, layers=layers, lambdas=[0.1 * (i + 1) for i in range(len(layers))],
        calib_n_tokens=1000, calib_n_rows=900, calib_source="unit test", calib_ctx=128, calib_skip_rows=4,
        heldout_n_rows=100, r2=[0.9] * len(layers), rel_err_median=[0.2] * len(layers),
        identity_rel_err_median=[0.5] * len(layers), fingerprint=fingerprint, model_name="m", tool_version="t",
    )
    return RidgeMaps(meta, {il: rng.standard_normal((n_embd, n_embd)).astype(np.float32) for il in layers},
                     {il: rng.standard_normal(n_embd).astype(np.float32) for il in layers})


def test_round_trip_through_gguf_py(tmp_path):
    import gguf

    maps = _maps()
    p = write_map_file(tmp_path / "m.ridgefill.gguf", maps, dtype="f16")
    r = gguf.GGUFReader(p)
    kv = {k: f.contents() for k, f in r.fields.items()}
    assert kv["general.type"] == "adapter" and kv["adapter.type"] == "ridgefill"
    assert kv["general.architecture"] == "llama"
    assert kv[mapfile.KEY_SPLIT] == 3 and kv[mapfile.KEY_N_LAYER] == 6 and kv[mapfile.KEY_N_EMBD] == 16
    assert kv[mapfile.KEY_INPUT_NORM] == "rms" and kv[mapfile.KEY_OBJECTIVE] == "normalized"
    assert kv[mapfile.KEY_LAYERS] == [4, 5]
    assert kv[mapfile.KEY_LAMBDA] == pytest.approx([0.1, 0.2])
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == {"blk.4.ridgefill_a.weight", "blk.4.ridgefill_b.bias", "blk.5.ridgefill_a.weight", "blk.5.ridgefill_b.bias"}
    a = tensors["blk.4.ridgefill_a.weight"]
    assert a.tensor_type == gguf.GGMLQuantizationType.F16 and list(a.shape) == [16, 16]
    assert tensors["blk.4.ridgefill_b.bias"].tensor_type == gguf.GGMLQuantizationType.F32
    # numpy [out, in] == ggml ne [in, out]: row o of A is what output o reads
    assert np.array_equal(np.asarray(a.data).reshape(16, 16), maps.a[4].astype(np.float16))
    back = read_map_file(p)
    _assert_same_meta(back.meta, maps.meta)
    np.testing.assert_allclose(back.a[5], maps.a[5], rtol=1e-3, atol=1e-3)
    assert np.array_equal(back.b[5], maps.b[5])


def _assert_same_meta(got: MapFileMeta, want: MapFileMeta) -> None:
    """Equal, with float metadata compared at float32 precision (how GGUF stores it)."""
    from dataclasses import asdict

    for k, v in asdict(want).items():
        if k in ("digest", "dtype"):  # what the reader found (checked digest, stored type), not a recorded value
            continue
        g = getattr(got, k)
        if isinstance(v, float) or (isinstance(v, list) and v and isinstance(v[0], float)):
            assert g == pytest.approx(v, rel=1e-6), k
        else:
            assert g == v, k


def test_predict_applies_the_recorded_input_norm():
    maps = _maps()
    x = np.random.default_rng(1).standard_normal((3, 16)) * 50
    phi = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(maps.predict(4, x), phi @ maps.a[4].T.astype(np.float64) + maps.b[4], rtol=1e-6)
    maps.meta.objective = "raw"
    np.testing.assert_allclose(maps.predict(4, x), x @ maps.a[4].T.astype(np.float64) + maps.b[4], rtol=1e-6)


def test_write_refuses_existing_output_unless_overwrite(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="--force"):
        write_map_file(p, _maps())
    assert p.read_bytes() == b"precious"
    write_map_file(p, _maps(), overwrite=True)
    assert read_map_file(p).meta.split_layer == 3


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    import gguf

    def boom(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(KeyboardInterrupt):
        write_map_file(tmp_path / "m.gguf", _maps())
    assert list(tmp_path.iterdir()) == []


def test_nan_maps_are_refused_on_write_and_on_read(tmp_path, monkeypatch):
    bad = _maps()
    bad.a[5][2, 3] = np.nan
    with pytest.raises(MapFileError, match="layer 5: the map has NaN or Inf"):
        write_map_file(tmp_path / "m.gguf", bad)
    assert not (tmp_path / "m.gguf").exists()
    monkeypatch.setattr(mapfile, "check_maps", lambda maps: None)  # write it anyway, to test the reader
    p = write_map_file(tmp_path / "m.gguf", bad, dtype="f32")
    monkeypatch.undo()
    with pytest.raises(MapFileError, match="NaN or Inf"):
        read_map_file(p)


def test_corrupt_and_foreign_files(tmp_path, tiny_models):
    good = write_map_file(tmp_path / "good.gguf", _maps())
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(MapFileError, match="truncated"):
        read_map_file(cut)
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(MapFileError, match="not a GGUF file"):
        read_map_file(text)
    with pytest.raises(MapFileError, match="not a RidgeFill map file"):
        read_map_file(tiny_models["llama"])  # a model, not maps


def test_wrong_version_and_missing_tensor(tmp_path, monkeypatch):
    maps = _maps()
    maps.meta.format_version = 99
    p = write_map_file(tmp_path / "v99.gguf", maps)
    with pytest.raises(MapFileError, match="format version 99"):
        read_map_file(p)
    maps = _maps()
    maps.meta.layers = [4]  # a file that lacks layer 5's map
    monkeypatch.setattr(mapfile, "check_maps", lambda maps: None)
    p = write_map_file(tmp_path / "short.gguf", maps)
    monkeypatch.undo()
    with pytest.raises(MapFileError, match=r"maps for layers \[4\], expected \[4, 5\]"):
        read_map_file(p)


def test_compatibility_with_models(tiny_models, tmp_path):
    from ridgefill_cpp.testing import tiny_models as make_tiny_models
    llama = tiny_models["llama"]
    fp = model_fingerprint(llama)
    maps = _maps(n_embd=64, split=3, n_layer=6, fingerprint=fp)
    assert mapfile.compatibility_problems(maps.meta, llama) == []
    other_seed = make_tiny_models.make_tiny_model("llama", tmp_path / "llama-seed1.gguf", seed=1)
    assert model_fingerprint(other_seed) != fp
    (problem,) = mapfile.compatibility_problems(maps.meta, other_seed)
    assert problem.startswith("fingerprint:") and "another checkpoint" in problem
    problems = mapfile.compatibility_problems(maps.meta, tiny_models["gemma3"])
    assert any(p.startswith("architecture: maps are for llama, the model is gemma3") for p in problems)
    assert any(p.startswith("layers:") for p in problems)


# -- the CLI ----------------------------------------------------------------------------------


def _sha(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def test_cli_fit_then_info(cli, tiny_models, tmp_path):
    import shutil

    model = tmp_path / "tiny.gguf"
    shutil.copy(tiny_models["qwen3"], model)
    before = _sha(model)
    res = cli("fit", model, "--tokens", 3000, "--ctx", 128)
    assert res.exit_code == 0, res.output
    out = tmp_path / "tiny.ridgefill.gguf"
    assert out.is_file() and "wrote" in res.output and "identity rel. err" in res.output
    assert _sha(model) == before
    res = cli("info", out, "--model", model)
    assert res.exit_code == 0, res.output
    assert "the maps fit" in res.output and "split S" in res.output
    res = cli("info", out, "--model", tiny_models["llama"])
    assert res.exit_code == 1 and "do not fit" in res.output and "architecture" in res.output
    assert "MiB of maps" in res.output and "placement" in res.output
    res = cli("info", "--json", out)
    assert res.exit_code == 0 and '"split_layer": 4' in res.output
    maps = read_map_file(out)
    # Q8_0 A (the default dtype: 34 bytes per 32 values) and F32 b per mapped layer
    assert maps.meta.dtype == "q8_0"
    assert json.loads(res.output)["maps_bytes"] == sum(a.size // 32 * 34 + maps.b[il].size * 4 for il, a in maps.a.items())
    # the output exists now: refused without --force, and left as it was
    digest = _sha(out)
    res = cli("fit", model, "--tokens", 3000, "--ctx", 128)
    assert res.exit_code == 1 and "--force" in res.output
    assert _sha(out) == digest
    res = cli("fit", model, "--tokens", 3000, "--ctx", 128, "--split", 3, "--force", "--objective", "raw")
    assert res.exit_code == 0, res.output
    assert _sha(out) != digest


def test_cli_fit_bad_inputs(cli, tiny_models, tmp_path, unsupported_model):
    model = tiny_models["llama"]
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    cases = [
        ((tmp_path / "nope.gguf",), "no such file"),
        ((empty,), "not a GGUF file"),
        ((model, tmp_path / "missing.txt", "-o", tmp_path / "o.gguf"), "no such file or directory"),
        ((model, empty, "-o", tmp_path / "o.gguf"), "no calibration text found"),
        ((model, "--split", 9, "-o", tmp_path / "o.gguf"), "split 9 outside 1..5"),
        ((model, "--objective", "cosine", "-o", tmp_path / "o.gguf"), "--objective must be"),
        ((model, "-o", tmp_path / "no-such-dir" / "o.gguf"), "not a writable directory"),
        ((model, "-o", model), "the model file itself"),
    ]
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    cases.append(((model, short, "-o", tmp_path / "o.gguf"), "too little calibration text"))
    cases.append(((unsupported_model, "-o", tmp_path / "o.gguf"), "architecture 'gpt2' is not supported"))
    for args, message in cases:
        res = cli("fit", *args)
        assert res.exit_code == 1, (args, res.output)
        assert message in res.output, (args, res.output)
    assert not (tmp_path / "o.gguf").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") or ".ridgefill-tmp-" in p.name] == []  # no temporary leftovers


def test_cli_fit_output_parent_is_not_a_directory(cli, tiny_models, tmp_path):
    parent = tmp_path / "a-file"
    parent.write_text("x")
    res = cli("fit", tiny_models["llama"], "-o", parent / "o.gguf")
    assert res.exit_code == 1 and "not a writable directory" in res.output
    assert parent.read_text() == "x"


def test_cli_fit_several_splits(cli, tiny_models, tmp_path):
    import shutil

    model = tmp_path / "m.gguf"
    shutil.copy(tiny_models["llama"], model)
    res = cli("fit", model, "--tokens", 3000, "--ctx", 128, "--split", "2,4")
    assert res.exit_code == 0, res.output
    for s in (2, 4):
        assert read_map_file(tmp_path / f"m.S{s}.ridgefill.gguf").meta.split_layer == s
    res = cli("fit", model, "--tokens", 3000, "--ctx", 128, "--split", "2,3", "-o", tmp_path / "x.gguf")
    assert res.exit_code == 1 and "must contain {split}" in res.output
    res = cli("fit", model, "--split", "two")
    assert res.exit_code == 1 and "--split must be" in res.output


# ------------------------------------------------------------------------------------------------
# output files (ridgefill_cpp.core.files): regular files only, the umask's mode, recognisable temporaries


def test_cli_fit_refuses_to_replace_a_symlink_fifo_or_directory(cli, tiny_models, tmp_path):
    """-o X --force writes only regular files: a symlink (here to /dev/null: the link would be
    replaced, never /dev/null), a FIFO or a directory at X is refused by name before any work."""
    import stat

    from ridgefill_cpp.core.files import OutputPathError, check_output

    precious = tmp_path / "precious.txt"
    precious.write_text("precious")
    link = tmp_path / "link.gguf"
    link.symlink_to(precious)
    devnull_link = tmp_path / "devnull.gguf"
    devnull_link.symlink_to(os.devnull)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    folder = tmp_path / "dir.gguf"
    folder.mkdir()
    for out, kind in ((link, "a symbolic link"), (devnull_link, "a symbolic link"), (fifo, "a FIFO"),
                      (folder, "a directory")):
        res = cli("fit", tiny_models["llama"], "--tokens", 2000, "--ctx", 128, "-o", out, "--force")
        text = " ".join(res.output.split())
        assert res.exit_code == 1 and f"{out} is {kind}, not a regular file: refusing to replace it" in text, text
        assert "capturing" not in text  # refused before the fit
    assert link.is_symlink() and precious.read_text() == "precious"
    assert devnull_link.is_symlink() and os.readlink(devnull_link) == os.devnull
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and folder.is_dir() and list(folder.iterdir()) == []
    # the API refuses the same (and a device node, checked without writing anything)
    with pytest.raises(OutputPathError, match="a symbolic link"):
        write_map_file(link, _maps(), overwrite=True)
    with pytest.raises(OutputPathError, match="a FIFO"):
        write_map_file(fifo, _maps(), overwrite=True)
    with pytest.raises(OutputPathError, match="a character device"):
        check_output(os.devnull)
    assert precious.read_text() == "precious"


def test_written_files_get_the_umask_mode_and_replaced_files_keep_theirs(tmp_path, tiny_models):
    """A new file gets 0666 & ~umask (what open() gives), in every atomic writer of the package; a
    file replaced with --force keeps its permission bits."""
    import stat

    from ridgefill_cpp.core.files import write_bytes
    from ridgefill_cpp.maps.gguf_copy import first_layers_gguf
    from ridgefill_cpp.maps.mapfile import write_tuned_defaults

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    old = os.umask(0o027)
    try:
        assert mode(write_map_file(tmp_path / "a.gguf", _maps())) == 0o640
        assert mode(write_bytes(tmp_path / "r.json", b"{}")) == 0o640  # reports, bench --json
        assert mode(first_layers_gguf(tiny_models["llama"], tmp_path / "cut.gguf", 2)) == 0o640  # model copies
        os.umask(0o022)
        assert mode(write_map_file(tmp_path / "b.gguf", _maps())) == 0o644
        for bits in (0o644, 0o600, 0o664):
            os.chmod(tmp_path / "b.gguf", bits)
            write_map_file(tmp_path / "b.gguf", _maps(seed=bits), overwrite=True)
            assert mode(tmp_path / "b.gguf") == bits
            write_tuned_defaults(tmp_path / "b.gguf", {"tail": 8, "exact_fraction": 0.0, "selector": "none"})
            assert mode(tmp_path / "b.gguf") == bits
    finally:
        os.umask(old)


def test_a_killed_write_leaves_a_recognisable_temporary_file_that_the_next_write_removes(tmp_path):
    import signal
    import subprocess
    import sys

    import ridgefill_cpp
    from ridgefill_cpp.core.files import TMP_MARK

    target = tmp_path / "m.ridgefill.gguf"
    code = (f"import os, signal\nfrom ridgefill_cpp.core.files import atomic_path\n"
            f"with atomic_path({str(target)!r}) as tmp:\n"
            f"    open(tmp, 'wb').write(b'half a map file')\n"
            f"    os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(ridgefill_cpp.__file__).resolve().parent.parent))
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(f"m.ridgefill.gguf{TMP_MARK}") and not left.name.startswith(".")
    assert not target.exists()
    # the next write to the target removes it; a live process's temporary file (ours) is kept
    live = tmp_path / f"m.ridgefill.gguf{TMP_MARK}{os.getpid()}-0123abcd"
    live.write_bytes(b"")
    other = tmp_path / f"other.gguf{TMP_MARK}1-0123abcd"  # another target's: not this write's business
    other.write_bytes(b"")
    write_map_file(target, _maps())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other.name])
    assert read_map_file(target).meta.split_layer == 3


# ------------------------------------------------------------------------------------------------
# content digests and metadata ranges (#36)


def corrupted_copy(src: Path, dst: Path, tensor: str, edit) -> Path:
    """A byte-for-byte copy of the map file ``src`` whose tensor ``tensor`` has had ``edit`` (bytearray
    -> None) applied to its data in place: what a bad copy or a flipped bit leaves."""
    import gguf

    r = gguf.GGUFReader(src)
    t = next(t for t in r.tensors if t.name == tensor)
    offset, n = int(t.data_offset), int(t.n_bytes)
    del r
    data = bytearray(src.read_bytes())
    chunk = bytearray(data[offset:offset + n])
    edit(chunk)
    assert len(chunk) == n
    data[offset:offset + n] = chunk
    dst.write_bytes(bytes(data))
    return dst


def flip_byte(offset: int):
    def edit(chunk: bytearray) -> None:
        chunk[offset] ^= 0xFF
    return edit


def flip_exponent_bit(chunk: bytearray) -> None:
    chunk[2 * 7 + 1] ^= 0x10  # element 7 of an F16 tensor: the high byte holds the exponent


def set_to(value: float, dtype):
    def edit(chunk: bytearray) -> None:
        chunk[:] = np.full(len(chunk) // np.dtype(dtype).itemsize, value, dtype=dtype).tobytes()
    return edit


def test_every_tensor_has_a_digest_that_gguf_hash_would_print(tmp_path):
    """``ridgefill.digest.xxh64``: one "NAME HEX" per tensor, XXH64 (seed 0) of the tensor's bytes
    as stored (llama.cpp's ``llama-gguf-hash --xxh64`` prints the same per tensor)."""
    import gguf
    import xxhash

    p = write_map_file(tmp_path / "m.gguf", _maps(), dtype="f16")
    r = gguf.GGUFReader(p)
    entries = r.fields[mapfile.KEY_DIGEST].contents()
    want = {t.name: xxhash.xxh64(bytes(np.asarray(t.data).tobytes()), seed=0).hexdigest() for t in r.tensors}
    assert dict(e.split(" ") for e in entries) == want and len(entries) == len(r.tensors) == 4
    assert read_map_file(p).meta.digest == "xxh64"


@pytest.mark.parametrize("edit, what", [(flip_byte(5), "one flipped byte"), (flip_exponent_bit, "one flipped exponent bit"),
                                        (set_to(60000.0, np.float16), "the whole matrix set to 60000 (finite)")])
def test_silently_corrupted_weights_are_refused_naming_the_tensor(tmp_path, edit, what):
    good = write_map_file(tmp_path / "good.gguf", _maps(), dtype="f16")
    bad = corrupted_copy(good, tmp_path / "bad.gguf", "blk.5.ridgefill_a.weight", edit)
    with pytest.raises(MapFileError, match=r"bad\.gguf: tensor blk\.5\.ridgefill_a\.weight: its bytes give xxh64 [0-9a-f]{16}, "
                                           r"the file records [0-9a-f]{16}: the file was corrupted"):
        read_map_file(bad)


def test_a_file_without_digests_reads_but_only_add_digest_gives_it_one(tmp_path):
    """A file without a digest can be inspected (``info`` says it has none), but a rewrite (``tune``'s
    tuned defaults) no longer gives it a fresh digest on the way: only :func:`add_digest`
    (``ridgefill-gguf digest``) does, on purpose; a file that has one is only checked."""
    good = write_map_file(tmp_path / "m.gguf", _maps())
    old = without_digest(good, tmp_path / "old.gguf")
    assert read_map_file(old).meta.digest == ""
    before = old.read_bytes()
    with pytest.raises(MapFileError, match=r"old\.gguf: the file has no content digest \(ridgefill\.digest\.xxh64\), so "
                                           r"corrupted weights could not be detected and would be given a fresh digest "
                                           r"here: add one with `ridgefill-gguf digest FILE`"):
        mapfile.write_tuned_defaults(old, {"tail": 32, "exact_fraction": 0.1, "selector": "attention"})
    assert old.read_bytes() == before
    out, written = mapfile.add_digest(old, tmp_path / "digested.gguf")
    assert written and read_map_file(out).meta.digest == "xxh64" and old.read_bytes() == before
    assert out.read_bytes() == good.read_bytes()  # the digest the writer gives: the same file as written by fit
    assert mapfile.add_digest(out) == (out, False)  # has one: checked, not written
    with pytest.raises(MapFileError, match="already has a content digest"):
        mapfile.add_digest(out, tmp_path / "again.gguf")
    assert mapfile.add_digest(old) == (old.resolve(), True) and read_map_file(old).meta.digest == "xxh64"
    bad = corrupted_copy(good, tmp_path / "bad.gguf", "blk.4.ridgefill_b.bias", flip_byte(0))
    with pytest.raises(MapFileError, match=r"tensor blk\.4\.ridgefill_b\.bias: its bytes give"):
        mapfile.add_digest(bad)


def test_a_rewrite_refuses_a_corrupted_source_instead_of_giving_it_a_fresh_digest(tmp_path):
    good = write_map_file(tmp_path / "good.gguf", _maps())
    bad = corrupted_copy(good, tmp_path / "bad.gguf", "blk.4.ridgefill_b.bias", flip_byte(0))
    before = bad.read_bytes()
    with pytest.raises(MapFileError, match=r"tensor blk\.4\.ridgefill_b\.bias: its bytes give"):
        mapfile.write_tuned_defaults(bad, {"tail": 32, "exact_fraction": 0.1, "selector": "attention"})
    assert bad.read_bytes() == before
    tuned = mapfile.write_tuned_defaults(good, {"tail": 32, "exact_fraction": 0.1, "selector": "attention"})
    assert read_map_file(tuned).meta.digest == "xxh64"  # tune's rewrite carries a digest of what it wrote


# ------------------------------------------------------------------------------------------------
# ridgefill-gguf digest: what it may overwrite (#56 item 2), what it may vouch for (#56 item 3)


def _undigested(tmp_path: Path, name: str = "old.gguf", maps: RidgeMaps | None = None) -> Path:
    """A map file as written before content digests existed."""
    return without_digest(write_map_file(tmp_path / f"fitted-{name}", maps or _maps()), tmp_path / name)


def _low_rank_maps(rank: int = 4) -> RidgeMaps:
    """:func:`_maps` as identity + low-rank maps (A = I + U Vᵀ)."""
    from ridgefill_cpp.maps.compact import dense_map

    maps = _maps()
    rng = np.random.default_rng(7)
    maps.meta.map_form = "identity_low_rank"
    for il in maps.meta.layers:
        up = rng.standard_normal((maps.meta.n_embd, rank)).astype(np.float32)
        down = rng.standard_normal((rank, maps.meta.n_embd)).astype(np.float32)
        maps.factors[il] = (up, down)
        maps.a[il] = dense_map(up, down, maps.meta.map_form).astype(np.float32)
    return maps


def _no_temporaries(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if ".ridgefill-tmp-" in p.name]


def test_cli_digest_output_needs_force_to_replace_a_file_and_never_replaces_a_model(cli, tmp_path, tiny_models,
                                                                                   unsupported_model):
    """``digest maps.gguf -o model.gguf`` replaced a model with the map file and said "wrote". An
    existing output other than MAPS itself is now refused unless --force (as ``fit -o``), and a GGUF
    that is not a RidgeFill map file (a model, with or without general.type) is never replaced, not
    even with --force; nothing is written either way."""
    import shutil

    old = _undigested(tmp_path)
    before = old.read_bytes()
    model = tmp_path / "model.gguf"
    shutil.copy(tiny_models["llama"], model)
    for m, kind in ((model, "general.type='model'"), (unsupported_model, "general.type=None")):
        kept = m.read_bytes()
        for force in ((), ("--force",)):
            res = cli("digest", old, "-o", m, *force)
            text = " ".join(res.output.split())
            assert res.exit_code == 1 and isinstance(res.exception, SystemExit), text
            assert (f"{m} is a GGUF model ({kind}), not a RidgeFill map file: refusing to replace it, even with "
                    "--force" in text), text
            assert "wrote" not in text and m.read_bytes() == kept and old.read_bytes() == before
    # any other existing file: refused without --force, replaced with it
    other = tmp_path / "notes.gguf"
    other.write_bytes(b"notes")
    older = _undigested(tmp_path, "older.gguf", _maps(seed=1))  # another map file
    for target in (other, older):
        kept = target.read_bytes()
        res = cli("digest", old, "-o", target)
        text = " ".join(res.output.split())
        assert res.exit_code == 1 and f"{target} exists (use --force to overwrite it)" in text, text
        assert target.read_bytes() == kept
        res = cli("digest", old, "-o", target, "--force")
        assert res.exit_code == 0 and "wrote" in res.output, res.output
        assert read_map_file(target).meta.digest == "xxh64" and target.read_bytes() == (tmp_path / "fitted-old.gguf").read_bytes()
    assert old.read_bytes() == before
    # -o naming MAPS itself is the in-place digest: no --force needed
    res = cli("digest", old, "-o", old)
    assert res.exit_code == 0 and "wrote" in res.output and read_map_file(old).meta.digest == "xxh64", res.output
    # the library refuses the same
    old2 = _undigested(tmp_path, "old2.gguf")
    with pytest.raises(MapFileError, match=r"is a GGUF model \(general\.type='model'\), not a RidgeFill map file"):
        mapfile.add_digest(old2, model, overwrite=True)
    with pytest.raises(FileExistsError, match=r"notes\.gguf exists"):
        other.write_bytes(b"notes")
        mapfile.add_digest(old2, other)
    assert model.read_bytes() == Path(tiny_models["llama"]).read_bytes() and other.read_bytes() == b"notes"
    assert _no_temporaries(tmp_path)


_ZERO_F16, _NAN_F32, _INF_F16 = set_to(0.0, np.float16), set_to(float("nan"), np.float32), set_to(float("inf"), np.float16)


@pytest.mark.parametrize("maps, tensor, edit, why", [
    (_maps, "blk.5.ridgefill_a.weight", _ZERO_F16, "tensor blk.5.ridgefill_a.weight is all zeros"),
    (_low_rank_maps, "blk.4.ridgefill_a_down.weight", _ZERO_F16, "tensor blk.4.ridgefill_a_down.weight is all zeros"),
    (_low_rank_maps, "blk.5.ridgefill_a_up.weight", _ZERO_F16, "tensor blk.5.ridgefill_a_up.weight is all zeros"),
    (_maps, "blk.4.ridgefill_b.bias", _NAN_F32, "layer 4: the map has NaN or Inf values"),
    (_maps, "blk.5.ridgefill_a.weight", _INF_F16, "layer 5: the map has NaN or Inf values"),
    (_low_rank_maps, "blk.4.ridgefill_a_up.weight", _INF_F16, "layer 4: the map has NaN or Inf values"),
], ids=["zero-matrix", "zero-down-factor", "zero-up-factor", "nan-bias", "inf-matrix", "inf-factor"])
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # I + U Vᵀ of an Inf factor
def test_digest_refuses_a_map_file_that_is_not_finished(cli, tmp_path, maps, tensor, edit, why):
    """A writer that preallocates a file and fills it in chunks, digested mid-copy: its all-zero
    layers got a valid digest (and then loaded as RidgeFill on), and so did NaN biases. ``digest``
    now refuses what no finished map file holds (a map matrix or factor all zeros) and every value
    the readers refuse, saying why, and writes nothing."""
    old = _undigested(tmp_path, maps=maps())
    bad = corrupted_copy(old, tmp_path / "bad.gguf", tensor, edit)
    before = bad.read_bytes()
    with pytest.raises(MapFileError, match=rf"bad\.gguf: {re.escape(why)}.*not given a digest"):
        mapfile.add_digest(bad)
    res = cli("digest", bad, "-o", tmp_path / "out.gguf")
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and why in text and "not given a digest" in text and "wrote" not in text, text
    res = cli("digest", bad)
    assert res.exit_code == 1 and why in " ".join(res.output.split()), res.output
    assert bad.read_bytes() == before and not (tmp_path / "out.gguf").exists() and _no_temporaries(tmp_path)
    assert mapfile.add_digest(old) == (old.resolve(), True)  # the same file, finished: given one


def _append(path: Path) -> None:
    """A writer still appending to the file."""
    with open(path, "ab") as f:
        f.write(b"\x01" * 4096)


def _fill_in(path: Path) -> None:
    """A writer filling in a preallocated file: same size, new bytes, a later modification time
    (set explicitly: the clock may not have ticked)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(-32, os.SEEK_END)
        f.write(b"\x01" * 32)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _replace(path: Path) -> None:
    """A writer that renames its finished file over the one being read: same bytes, size and
    modification time, another inode."""
    import shutil

    fresh = path.with_name(path.name + ".new")
    shutil.copy2(path, fresh)
    os.replace(fresh, path)


@pytest.mark.parametrize("writer, what", [(_append, "its size went from"), (_fill_in, "it was modified"),
                                          (_replace, "it was replaced by another file")],
                         ids=["appended", "filled-in", "replaced"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "to-output"])
def test_digest_refuses_a_map_file_that_changes_while_it_is_read(cli, tmp_path, monkeypatch, writer, what, in_place):
    """``digest`` in place writes a new file and renames it over the old one: a writer still writing
    to the old file would lose its later bytes, and the digest would vouch for a half-written file.
    A file whose size, modification time or inode differ before and after it is read is refused.
    Deterministic: the writer runs right after ``digest`` has read and checked the maps."""
    old = _undigested(tmp_path)
    real = mapfile.read_map_file
    left = []  # what the writer left, each time it ran

    def read_then_write(path):
        maps = real(path)
        writer(Path(path))
        left.append(Path(path).read_bytes())
        return maps

    monkeypatch.setattr(mapfile, "read_map_file", read_then_write)
    out = tmp_path / "out.gguf"
    res = cli("digest", old, *(() if in_place else ("-o", out)))
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), text
    assert f"{old.resolve()} changed while it was being read ({what}" in text and "not given a digest" in text, text
    assert "wrote" not in text and len(left) == 1
    with pytest.raises(MapFileError, match=rf"old\.gguf changed while it was being read \({what}"):
        mapfile.add_digest(old, None if in_place else out)
    # what the writer left is there, not replaced by the copy digest made of it; nothing else written
    assert len(left) == 2 and old.read_bytes() == left[-1]
    assert not out.exists() and _no_temporaries(tmp_path)


def _with_key(src: Path, dst: Path, key: str, value, kind) -> Path:
    return mapfile.rewrite_map_file(src, dst, drop_key=lambda k: k == key, add_keys=[(key, value, kind)])


def test_every_metadata_number_is_range_checked_naming_its_key(tmp_path):
    """A NaN or negative ``input_norm_eps`` passed every check and then aborted libllama at the first
    planned prompt (GGML_ASSERT(eps >= 0)); every number a map file records is now range-checked on
    read, the error naming the key."""
    import gguf

    F32, U32, F64 = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT64
    good = write_map_file(tmp_path / "good.gguf", _maps())
    arr = gguf.GGUFValueType.ARRAY
    cases = [
        (mapfile.KEY_INPUT_NORM_EPS, float("nan"), F32, "ridgefill.input_norm_eps = nan outside"),
        (mapfile.KEY_INPUT_NORM_EPS, -1e-6, F32, "ridgefill.input_norm_eps = -1e-06 outside"),
        (mapfile.KEY_INPUT_NORM_EPS, float("inf"), F32, "ridgefill.input_norm_eps = inf outside"),
        (mapfile.KEY_INPUT_NORM_EPS, "1e-6", gguf.GGUFValueType.STRING, "ridgefill.input_norm_eps = '1e-6' is not a number"),
        (mapfile.KEY_SPLIT, 5, U32, "ridgefill.split_layer = 5 outside 1..4"),
        (mapfile.KEY_N_EMBD, 0, U32, "ridgefill.n_embd = 0 outside"),
        (mapfile.KEY_CALIB_TOKENS, "many", gguf.GGUFValueType.STRING, "ridgefill.calibration.n_tokens = 'many' is not a non-negative integer"),
        (mapfile.KEY_LAMBDA, [float("nan"), 0.1], arr, "ridgefill.lambda has nan"),
        (mapfile.KEY_R2, [0.5, 2.0], arr, "ridgefill.quality.r2 has 2, outside [-inf, 1]"),
        (mapfile.KEY_REL_ERR, [-1.0, 0.1], arr, "ridgefill.quality.rel_err_median has -1, outside [0, inf]"),
        ("ridgefill.tuned.speedup", float("nan"), F64, "ridgefill.tuned.speedup = nan is not a finite number"),
        ("ridgefill.tuned.budget", float("inf"), F64, "ridgefill.tuned.budget = inf is not a finite number"),
    ]
    for i, (key, value, kind, message) in enumerate(cases):
        if key.startswith(mapfile.TUNED_PREFIX):  # the other tuned keys a tuned file has
            src = mapfile.write_tuned_defaults(write_map_file(tmp_path / f"t{i}.gguf", _maps()),
                                               {"tail": 32, "exact_fraction": 0.1, "selector": "attention"})
        else:
            src = good
        bad = _with_key(src, tmp_path / f"bad{i}.gguf", key, value, kind)
        with pytest.raises(MapFileError, match=f"bad{i}.gguf: .*{__import__('re').escape(message)}"):
            if key.startswith(mapfile.TUNED_PREFIX):
                mapfile.read_tuned_defaults(bad)
            else:
                read_map_file(bad)


def test_a_tuned_setting_out_of_range_is_refused_where_it_applies(tmp_path):
    """A tuned tail or fraction that is no usable setting is refused by RidgeFill(path), naming the
    key; an explicit argument still wins over it."""
    import gguf

    from ridgefill_cpp import RidgeFill

    src = mapfile.write_tuned_defaults(write_map_file(tmp_path / "t.gguf", _maps()),
                                       {"tail": 32, "exact_fraction": 0.1, "selector": "attention"})
    for key, value, kind, message in (("tail", 0, gguf.GGUFValueType.UINT32, "tail 0 must be >= 1"),
                                      ("exact_fraction", 1.5, gguf.GGUFValueType.FLOAT64, "exact_fraction 1.5")):
        bad = _with_key(src, tmp_path / f"bad-{key}.gguf", mapfile.TUNED_PREFIX + key, value, kind)
        with pytest.raises(ValueError, match=f"{message}.*the map file's tuned value, ridgefill\\.tuned\\.{key}"):
            RidgeFill(bad)
        assert getattr(RidgeFill(bad, **{key: 0.2 if key == "exact_fraction" else 16}), key) in (0.2, 16)
