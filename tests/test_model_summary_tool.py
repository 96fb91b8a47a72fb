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

import pytest

import model_summary  # tools/measure, on sys.path through conftest

ROOT = Path(__file__).resolve().parents[1]


def test_llama_bench_prompt_tests_read_back():
    records = [{"n_prompt": 4096, "n_gen": 0, "avg_ts": 70.04, "stddev_ts": 0.46, "samples_ts": [69.7, 70.4]},
               {"n_prompt": 0, "n_gen": 128, "avg_ts": 20.0, "stddev_ts": 0.1, "samples_ts": [20.0]},
               {"n_prompt": 16384, "n_gen": 0, "avg_ts": 30.55, "stddev_ts": 0.0, "samples_ts": [30.55]}]
    assert model_summary.llama_bench_figures(records) == {"4096": [70.0, 0.5, 2], "16384": [30.6, 0.0, 1]}


@pytest.mark.parametrize("folder", ["qwen25-coder-0.5b", "qwen25-coder-1.5b"])
def test_the_committed_summary_is_what_the_tool_makes(tmp_path, folder):
    """The README's `model_summary.py` command, run on the committed files, writes summary.json as committed."""
    docs = ROOT / "docs" / folder
    readme = (docs / "README.md").read_text()
    m = re.search(r"```sh\npython tools/measure/model_summary.py (.+?)\n```", readme, re.S)
    assert m, f"docs/{folder}/README.md gives no model_summary.py command"
    args = shlex.split(m.group(1).replace("\\\n", " "))
    args[args.index("-o") + 1] = str(tmp_path / "summary.json")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "measure" / "model_summary.py"), *args], cwd=docs,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads((docs / "summary.json").read_text())


def _tune(chosen=1):
    point = {"split": 14, "tail": 64, "exact_fraction": 0.2, "selector": "attention", "span": 16, "speedup": 1.61234,
             "ceiling": 1.9, "novel": {"estimate": 0.012345, "low": 0.001, "high": 0.0234567, "n": 8},
             "retrieval": {"kept": [5, 5]}}
    return {"budget": 0.02, "options": {"length": 2048, "n_docs": 8}, "chosen": chosen,
            "points": [{**point, "split": 19, "speedup": 1.3}, point]}


def _bench(split=14, selector="attention@16"):
    row = {"n_prompt": 8192, "speedup[ridgefill]": 1.55561, "ceiling": 1.91, "median_s[stock]": 160.0,
           "median_s[ridgefill]": 103.0, "tokens_per_s[stock]": 51.2, "spread[stock]": 0.05, "spread[ridgefill]": 0.04}
    return {"split": split, "tail": 64, "exact_fraction": 0.2, "selector": selector, "repeats": 3, "summary": [row]}


def test_the_tuned_point_with_its_bench():
    t = model_summary.tune_figures(_tune(), _bench())
    assert (t["split"], t["exact_fraction"], t["span"], t["novel_dnll"]) == (14, 0.2, 16, [0.01235, 0.001, 0.02346])
    assert (t["speedup_2048"], t["speedup_8192"], t["ceiling_8192"], t["repeats_8192"]) == (1.6123, 1.5556, 1.91, 3)
    assert t["codes_kept"] == [5, 5] and t["settings_searched"] == 2
    assert "speedup_8192" not in model_summary.tune_figures(_tune())


def test_a_bench_of_another_point_or_no_chosen_point_is_refused():
    with pytest.raises(ValueError, match="not the chosen point S=14"):
        model_summary.tune_figures(_tune(), _bench(split=19))
    with pytest.raises(ValueError, match="not the chosen point"):
        model_summary.tune_figures(_tune(), _bench(selector="attention@4"))
    with pytest.raises(ValueError, match="chose no point"):
        model_summary.tune_figures(_tune(chosen=None))


def test_ruler_conditions_are_named_by_role():
    """SmolLM2's committed RULER run (30 layers): S=20 is the ridge condition, S=15 half depth."""
    d = json.loads((ROOT / "docs" / "ruler" / "smollm2-4k" / "ruler.json").read_text())
    avg = d["summary"]["4096"]["average"]
    r = model_summary.ruler_figures(d, n_layer=30)["ruler_4k"]
    assert r["conditions"] == {"exact": "exact", "ridge": "ridge S=20", "half": "ridge S=15",
                               "identity": "identity S=20"}
    assert r["half"][0] == round(avg["ridge S=15"]["delta"]["estimate"], 2)
    assert r["exact"] == round(avg["exact"]["score"]["estimate"], 2) and (r["tasks"], r["samples_per_task"]) == (11, 3)
    assert "half" not in model_summary.ruler_figures(d)["ruler_4k"]  # without the layer count: its own name
