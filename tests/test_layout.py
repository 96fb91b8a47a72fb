"""The package's layout: each part imports only the parts below it (no circle), and the command line
is thin. The order, lowest first: core, maps, testing (the tiny models and synthetic maps), runtime, fitting, quality, server, then the command line
(``cli.py``) and the package root; the oracle stands beside them and imports none of the code it
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


def test_the_parts_are_folders_and_the_root_holds_only_the_entry_points():
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "cli.py"]
    for part in LAYERS[:-2] + ["oracle"]:
        assert (PKG / part / "__init__.py").is_file(), part
