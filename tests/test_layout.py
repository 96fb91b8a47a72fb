"""The package's layout: each part imports only the parts below it (no circle), and the command line
is thin. The order, lowest first: core, maps, testing (the tiny models and synthetic maps), runtime, fitting, quality, server, then the command line
(the ``cli`` folder, a module per command) and the package root; the oracle stands beside them and imports none of the code it
checks except the GGUF reader (``core.gguf_model``) and, for its types, the map file's data class."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ridgefill_cpp"
LAYERS = ["core", "maps", "testing", "runtime", "fitting", "quality", "server", "cli", "__init__"]
#: what the oracle may import of the package
ORACLE_MAY = {"oracle", "core", "maps"}


def _part(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    """The parts of the package a module imports (at any depth of its code: lazy imports count)."""
    tree = ast.parse(path.read_text())
    here = path.relative_to(PKG).parts[:-1]  # the module's package, relative to the root
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[:len(here) - (node.level - 1)]) if node.level - 1 <= len(here) else []
                target = base + (node.module.split(".") if node.module else [])
                if not target:  # from . import a, b  at the root
                    out.update(a.name for a in node.names)
                    continue
            elif node.module and node.module.split(".")[0] == "ridgefill_cpp":
                target = node.module.split(".")[1:]
                if not target:
                    out.update(a.name for a in node.names)
                    continue
            else:
                continue
            out.add(target[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "ridgefill_cpp" and len(parts) > 1:
                    out.add(parts[1])
    return out


def test_every_part_imports_only_the_parts_below_it():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG).parts[0] in ("lib", "bin"):
            continue
        part = _part(path)
        for target in _imports(path) - {part, "__version__"}:
            if part == "oracle":
                ok = target in ORACLE_MAY
            else:
                ok = target in LAYERS and part in LAYERS and LAYERS.index(target) < LAYERS.index(part)
            if not ok:
                wrong.append(f"{path.relative_to(PKG)} ({part}) imports {target}")
    assert wrong == []


def test_the_parts_are_folders_and_the_root_holds_only_the_entry_point():
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py"]
    for part in LAYERS[:-1] + ["oracle"]:
        assert (PKG / part / "__init__.py").is_file(), part


def test_the_command_line_is_a_module_per_command_none_over_300_lines():
    """``ridgefill_cpp/cli/``: the app and its shared helpers, the tables several commands print, and
    one module per command (its options, its help, the call into the library)."""
    from ridgefill_cpp.cli import COMMANDS

    cli = PKG / "cli"
    assert sorted(p.stem for p in cli.glob("*.py")) == sorted(["__init__", "app", "show", *COMMANDS])
    sizes = {p.name: len(p.read_text().splitlines()) for p in cli.glob("*.py")}
    assert max(sizes.values()) <= 300, sizes


CSRC = PKG.parent / "csrc"


def _c_functions(path: Path) -> list[tuple[str, int]]:
    """(first line, length in lines) of each function defined at the top level of a C++ file, in
    llama.cpp's style: a definition starting in column 0 whose body closes with a '}' in column 0."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line and not line[0].isspace() and "(" in line and not line.startswith(("//", "#", "}", "struct ", "static const")):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith("{") and not lines[j].rstrip().endswith(";"):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{"):
                k = lines.index("}", j)
                out.append((line.strip(), k - i + 1))
                i = k
        i += 1
    return out


def test_no_csrc_file_over_900_lines_and_no_function_over_150():
    """One room at a time: a C++ unit a reader can hold (the late phase, the window graphs and the
    reservation of compute buffers are units of their own), functions of named steps."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in CSRC.rglob("*.cpp")}
    assert max(sizes.values()) <= 900, sizes
    long = [(p.name, name, n) for p in CSRC.rglob("*.cpp") for name, n in _c_functions(p) if n > 150]
    assert long == []
    finish = dict(_c_functions(CSRC / "llama-ridgefill-late.cpp"))
    assert finish["int llama_ridgefill_context::finish() {"] <= 50
