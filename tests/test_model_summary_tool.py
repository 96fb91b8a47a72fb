"""tools/measure/model_summary.py (docs/qwen25-coder-1.5b/summary.json): llama-bench's figures read
back, and the committed summary is what the tool makes from the committed files with the command its
README gives."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import model_summary  # tools/measure, on sys.path through conftest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "qwen25-coder-1.5b"


def test_llama_bench_prompt_tests_read_back():
    records = [{"n_prompt": 4096, "n_gen": 0, "avg_ts": 70.04, "stddev_ts": 0.46, "samples_ts": [69.7, 70.4]},
               {"n_prompt": 0, "n_gen": 128, "avg_ts": 20.0, "stddev_ts": 0.1, "samples_ts": [20.0]},
               {"n_prompt": 16384, "n_gen": 0, "avg_ts": 30.55, "stddev_ts": 0.0, "samples_ts": [30.55]}]
    assert model_summary.llama_bench_figures(records) == {"4096": [70.0, 0.5, 2], "16384": [30.6, 0.0, 1]}


def test_the_committed_summary_is_what_the_tool_makes(tmp_path):
    """The README's `model_summary.py` command, run on the committed files, writes summary.json as committed."""
    readme = (DOCS / "README.md").read_text()
    m = re.search(r"```sh\npython tools/measure/model_summary.py (.+?)\n```", readme, re.S)
    assert m, "docs/qwen25-coder-1.5b/README.md gives no model_summary.py command"
    args = shlex.split(m.group(1).replace("\\\n", " "))
    args[args.index("-o") + 1] = str(tmp_path / "summary.json")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "measure" / "model_summary.py"), *args], cwd=DOCS,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads((DOCS / "summary.json").read_text())
