"""The README's results table is generated from the measurement files (tools/measure/results_table.py):
the committed README and docs/results.md agree with those files, and the check fails when a figure in
the README is edited by hand or a measurement file changes under it."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "measure" / "results_table.py"


def _tool():
    spec = importlib.util.spec_from_file_location("results_table", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def check(root: Path | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, str(TOOL), "--check"] + (["--root", str(root)] if root else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy(tmp_path) -> Path:
    """The README, docs/results.md and every measurement file the table reads, in a scratch tree."""
    for rel in ["README.md", "docs/results.md"] + [s.path for s in _tool().SOURCES.values()]:
        if (REPO / rel).is_file():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / rel, tmp_path / rel)
    return tmp_path


def test_the_committed_tables_are_what_the_files_say():
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_row_names_its_files_and_every_file_its_cpu_threads_and_date():
    table = _tool().render()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| |")]
    assert len(rows) >= 8
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert all(c == "not measured" or c.endswith("]") for c in cells), row
    legend = [line for line in table.splitlines() if line.startswith("[")]
    assert legend
    for line in legend:
        assert " threads, 20" in line and "None" not in line, line


def test_a_figure_edited_by_hand_fails_the_check(copy):
    assert check(copy).returncode == 0
    readme = copy / "README.md"
    text = readme.read_text()
    edited = text.replace("10/10 [", "9/10 [", 1)
    assert edited != text
    readme.write_text(edited)
    r = check(copy)
    assert r.returncode == 1 and "README.md" in r.stderr and "-| planted codes" in r.stdout


def test_a_changed_measurement_file_fails_the_check(copy):
    path = copy / "docs/fit-budget/summary.json"
    d = json.loads(path.read_text())
    d["models"]["gemma3"][str(d["default_tokens"])]["novel_dnll_2048"][0] = 0.5
    path.write_text(json.dumps(d))
    r = check(copy)
    assert r.returncode == 1 and "+0.5000 [" in r.stdout
    assert "README.md" in r.stderr and "docs/results.md" in r.stderr
