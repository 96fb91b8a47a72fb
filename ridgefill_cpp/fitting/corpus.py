"""Calibration and evaluation text found on the machine itself, with provenance and licence.

The default corpus is the running Python's own standard library, which every set-up has:

- prose: the language and library reference topics shipped as ``pydoc_data.topics`` (the text of
  the Python documentation that ``help()`` shows);
- code: the standard library's ``.py`` sources (tests, site-packages and generated tables left out).

Both are under the Python Software Foundation License (PSF-2.0). Each document is assigned to
exactly one split by a hash of its name: 80 % calibration, 20 % evaluation, so calibration and
evaluation text are disjoint by construction and the assignment is stable across machines.

User text (``fit model.gguf my.txt docs/``) is read from files and directories instead.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal

Split = Literal["calibration", "evaluation"]

LICENCE = "PSF-2.0 (Python Software Foundation License)"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".hpp", ".js", ".ts", ".json", ".toml", ".yaml",
                 ".yml", ".html", ".xml", ".csv", ".tex", ".sh", ".ini", ".cfg", ".rs", ".go", ".java", ""}
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo", "encodings",
              "ensurepip", "config-3.11-x86_64-linux-gnu"}
_MAX_CODE_FILE = 200_000  # bytes: huge generated modules (unicode tables ...) say little


@dataclass(frozen=True)
class Document:
    name: str  # e.g. "pydoc:assignment", "stdlib:json/decoder.py", or a file path
    kind: str  # "prose" | "code" | "text"
    text: str


def split_of(name: str) -> Split:
    """The split a default-corpus document belongs to (stable: a hash of its name)."""
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") % 10
    return "evaluation" if bucket >= 8 else "calibration"


def _prose_documents() -> list[Document]:
    from pydoc_data.topics import topics  # here: a 700 KB module of text, read only for the default corpus

    return [Document(f"pydoc:{k}", "prose", v) for k, v in sorted(topics.items())]


def _code_documents() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if p.suffix != ".py" or p.stat().st_size > _MAX_CODE_FILE:
                continue
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            docs.append(Document(f"stdlib:{p.relative_to(root).as_posix()}", "code", text))
    return docs


def default_documents(split: Split) -> Iterator[Document]:
    """Documents of the default corpus in ``split``: prose and code interleaved, deterministic order."""
    prose = [d for d in _prose_documents() if split_of(d.name) == split]
    code = [d for d in _code_documents() if split_of(d.name) == split]
    # order each kind by hash too, so a token budget takes a spread of topics and modules
    key = lambda d: hashlib.sha256(d.name.encode()).digest()  # noqa: E731
    prose.sort(key=key)
    code.sort(key=key)
    for i in range(max(len(prose), len(code))):
        if i < len(prose):
            yield prose[i]
        if i < len(code):
            yield code[i]


def default_source_description(split: Split = "calibration") -> str:
    v = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    return (f"Python {v} standard library ({split} split): pydoc_data.topics reference text and stdlib .py "
            f"sources; {LICENCE}")


def read_documents(paths: Iterable[os.PathLike | str], what: str = "calibration text") -> list[Document]:
    """Text documents from files and directories (recursively; text-like suffixes, UTF-8).

    Raises ``FileNotFoundError`` for a path that does not exist and ``ValueError`` when nothing
    readable was found, naming the text as ``what`` (its use: ``"calibration text"``, ``"evaluation text"``).
    """
    docs: list[Document] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or directory")
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in TEXT_SUFFIXES)
        for f in files:
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                if f == p:
                    raise ValueError(f"{f}: not UTF-8 text") from None
                continue
            if text.strip():
                docs.append(Document(str(f), "text", text))
    if not docs:
        raise ValueError(f"no {what} found in " + ", ".join(str(p) for p in paths) + " (all empty?)")
    return docs
