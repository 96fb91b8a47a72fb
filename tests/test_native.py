"""The native build: patched libraries loaded by llama-cpp-python, build info, llama-server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import fetch_llama_cpp
import pytest

import ridgefill_cpp

REPO = Path(__file__).resolve().parent.parent


def test_build_info_reports_the_pinned_tree_and_patch_set():
    info = ridgefill_cpp.build_info()
    pin = json.loads((REPO / "llama_cpp_pin.json").read_text())
    assert info["llama_cpp_commit"] == pin["llama_cpp_commit"]
    assert info["llama_cpp_python"] == pin["version"]
    assert info["patchset"] == fetch_llama_cpp.patchset_hash(fetch_llama_cpp.patch_files())
    assert info["ridgefill_version"] == ridgefill_cpp.__version__
    assert "CPU" in info["backends"]


def test_llama_cpp_loads_the_patched_libraries():
    import llama_cpp
    import llama_cpp._ggml
    from llama_cpp import llama_cpp as C

    lib_dir = Path(ridgefill_cpp.LIB_DIR)
    assert Path(C._lib._name).resolve().parent == lib_dir
    assert Path(llama_cpp._ggml.libggml._name).resolve().parent == lib_dir
    # one libggml in the process: the one next to libllama
    maps = Path("/proc/self/maps").read_text()
    ggml_paths = {line.split()[-1] for line in maps.splitlines() if "libggml.so" in line}
    assert ggml_paths == {str(lib_dir / "libggml.so")}
    # the RidgeFill entry point is exported from libllama itself
    assert hasattr(C._lib, "llama_ridgefill_build_info")


def test_one_architecture_table():
    """libllama's table (csrc/llama-ridgefill-arch.cpp) is the one list of supported architectures:
    Python reads it through the C API, and every entry has an independent oracle."""
    from ridgefill_cpp.core import gguf_model
    from ridgefill_cpp.core.native import llama_ridgefill_supported_arch
    from ridgefill_cpp.oracle import SUPPORTED_ARCHITECTURES as ORACLE_ARCHITECTURES

    names = []
    while (name := llama_ridgefill_supported_arch(len(names), None)) is not None:
        names.append(name.decode())
    assert tuple(names) == gguf_model.supported_architectures() == ORACLE_ARCHITECTURES
    assert gguf_model.HYBRID_ARCHITECTURES == ("qwen35", "qwen35moe")
    assert llama_ridgefill_supported_arch(-1, None) is None


def test_llama_server_binary_runs():
    info = ridgefill_cpp.build_info()
    assert info["llama_server"], "llama-server was not installed with the package"
    proc = subprocess.run([info["llama_server"], "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert info["llama_cpp_commit"] in proc.stdout + proc.stderr


def test_cli_version_shows_the_patched_build(cli):
    res = cli("--version")
    assert res.exit_code == 0, res.output
    info = ridgefill_cpp.build_info()
    assert ridgefill_cpp.__version__ in res.output
    assert info["llama_cpp_commit"] in res.output
    assert info["patchset"] in res.output


def test_capture_hooks_do_not_change_the_numerics(smollm2_path):
    """Stock call path (llama-cpp-python's Llama.eval) and the capture path give bit-identical logits."""
    import numpy as np

    from llama_cpp import llama_cpp as C

    from ridgefill_cpp.fitting.capture import capture_layer_inputs, open_model

    llm = open_model(smollm2_path, n_ctx=256, n_batch=256)
    try:
        tokens = llm.tokenize(b"It was the best of times, it was the worst of times, it was the age of wisdom")
        llm.eval(tokens)
        n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(llm._model.model))
        stock = np.ctypeslib.as_array(C.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
    finally:
        llm.close()
    cap = capture_layer_inputs(smollm2_path, tokens, layers=[0, 7, 29], n_ctx=256)
    assert np.array_equal(cap.logits, stock)


def test_cli_models_lists_the_real_models(cli, smollm2_path, gemma3_path, qwen05_path, monkeypatch):
    """All four, with size, licence and use; the default set (what `make setup` installs) is installed,
    the 1.5B is installed on request only, by name."""
    from ridgefill_cpp.cli.app import out
    from ridgefill_cpp.core import models

    monkeypatch.setattr(out, "width", 400)  # one line a model: no cell folded
    res = cli("models")
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): line for line in res.output.splitlines() if line.count("│") > 2}
    assert set(rows) == set(models.MODELS), res.output
    for name, spec in models.MODELS.items():
        for cell in (spec.description, spec.licence, spec.purpose, f"{spec.size / 1e6:,.0f} MB"):
            assert cell in rows[name], (name, cell)
    assert [n for n, spec in models.MODELS.items() if not spec.default] == ["qwen2.5-coder-1.5b"]
    for name in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"):
        assert str(models.available(name)) in rows[name]
    assert ("not installed (--install qwen2.5-coder-1.5b)" in rows["qwen2.5-coder-1.5b"]) == \
        (models.available("qwen2.5-coder-1.5b") is None)
    # names are for --install, and only known ones
    res = cli("models", "qwen2.5-coder-0.5b")
    assert res.exit_code == 1 and "naming models is for --install" in res.output, res.output
    res = cli("models", "--install", "qwen2.5-coder-3b")
    assert res.exit_code == 1 and "unknown model 'qwen2.5-coder-3b'" in res.output, res.output


def test_installed_models_are_the_recorded_files(smollm2_path, gemma3_path, qwen05_path):
    """Each installed model file has the size and sha256 recorded in its spec; the Qwen parts follow the
    packages' layout (<import name>/data/partNN.bin)."""
    from ridgefill_cpp.core import models

    for name, path in (("smollm2-135m", smollm2_path), ("gemma3-270m", gemma3_path), ("qwen2.5-coder-0.5b", qwen05_path)):
        spec = models.MODELS[name]
        assert path.stat().st_size == spec.size, name
        assert models.verify(name) == path
    for name, n_parts in (("qwen2.5-coder-0.5b", 6), ("qwen2.5-coder-1.5b", 22)):
        spec = models.MODELS[name]
        assert len(spec.parts) == len(spec.distributions) == n_parts
        assert spec.parts[-1][1] == f"data/part{n_parts:02d}.bin"


def test_assembling_parts_is_atomic_and_checked(tmp_path, monkeypatch):
    """Parts are concatenated into the cache atomically: a wrong sha256 leaves nothing behind (an earlier
    good file stays), the right one gives the file."""
    import hashlib

    from ridgefill_cpp.core import models

    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path / "cache"))
    parts = []
    for i, data in enumerate((b"GGUF" + b"a" * 100, b"b" * 50)):
        parts.append(tmp_path / f"part{i + 1:02d}.bin")
        parts[-1].write_bytes(data)
    whole = b"GGUF" + b"a" * 100 + b"b" * 50
    good = models.ModelSpec("x", "x", "x", (), hashlib.sha256(whole).hexdigest(), assembled_name="x.gguf")
    bad = models.ModelSpec("x", "x", "x", (), "0" * 64, assembled_name="x.gguf")
    with pytest.raises(models.ModelUnavailableError, match="assembled file has sha256"):
        models._assemble(bad, parts)
    assert list((tmp_path / "cache" / "models").iterdir()) == []
    target = models._assemble(good, parts)
    assert target.read_bytes() == whole and target == tmp_path / "cache" / "models" / "x.gguf"
    with pytest.raises(models.ModelUnavailableError):
        models._assemble(bad, parts)
    assert target.read_bytes() == whole and sorted(p.name for p in target.parent.iterdir()) == ["x.gguf"]
