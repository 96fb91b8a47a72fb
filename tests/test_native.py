"""The native build: patched libraries loaded by llama-cpp-python, build info, llama-server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import fetch_llama_cpp

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


def test_cli_models_lists_the_default_models(cli, smollm2_path, gemma3_path):
    res = cli("models")
    assert res.exit_code == 0, res.output
    for text in ("smollm2-135m", "gemma3-270m", "Apache-2.0", "Gemma Terms"):
        assert text in res.output, text
    assert "not installed" not in res.output
