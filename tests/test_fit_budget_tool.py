"""tools/measure/fit_budget.py (docs/fit-budget): the figures it reads from fit's output, and the rule
that chooses fit's default budget from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fit_budget  # tools/measure, on sys.path through conftest

ROOT = Path(__file__).resolve().parents[1]

FIT_OUTPUT = """estimate: the fit takes about 1 h 2 min (capture of 9,709 tokens at 662 tokens/s: 15 s; solve of 1 split: 0 s); peak memory about 0.7 GiB (0.7 GiB resident now)
┃ layer ┃        λ ┃    R² ┃ ridge rel. err ┃ identity rel. err ┃
│    13 │  0.00156 │ 0.698 │          0.258 │             0.376 │
│    14 │ 0.000495 │ 0.602 │          0.197 │             0.334 │
└───────┴──────────┴───────┴────────────────┴───────────────────┘
maps: Q8_0, full 640×640 matrices, 2.09 MiB
9709 calibration tokens (19 windows of 512), 508 held-out rows; forward 14.4 s,
\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:18.14
\tMaximum resident set size (kbytes): 754632
"""


def test_a_fit_output_read_back():
    e = fit_budget.fit_entry(FIT_OUTPUT)
    assert e == {"seconds": 3738.1, "peak_rss_mib": 736.9, "calibration_tokens": 9709, "maps_mib": 2.09,
                 "estimate_s": 3720, "estimate_peak_mib": 716.8, "r2_mean": 0.65}
    assert [fit_budget.seconds(t) for t in ("45 s", "17 min", "1 h 52 min", "2 h 0 min")] == [45, 1020, 6720, 7200]
    with pytest.raises(ValueError):
        fit_budget.seconds("soon")


def _models(x10, x25, full):
    return {"a": {"10000": {"novel_dnll_2048": x10}, "25000": {"novel_dnll_2048": x25},
                  "100000": {"novel_dnll_2048": full}}}


def test_the_default_is_the_smallest_budget_within_the_full_budgets_ci():
    full = [0.010, 0.000, 0.020]
    at = ("2048",)
    assert fit_budget.choose(_models([0.019, 0.0, 0.04], [0.012, 0.0, 0.03], full), at)[0] == 10000
    assert fit_budget.choose(_models([0.021, 0.0, 0.04], [0.012, 0.0, 0.03], full), at)[0] == 25000
    budget, why = fit_budget.choose(_models([0.05, 0.0, 0.1], [0.03, 0.0, 0.04], full), at)
    assert budget == 100000 and "no smaller budget" in why
    # a length measured at the largest budget but not yet at a smaller one: the choice waits
    waiting = _models([0.019, 0.0, 0.04], [0.012, 0.0, 0.03], full)
    waiting["a"]["100000"]["novel_dnll_8192"] = full
    budget, why = fit_budget.choose(waiting, ("2048", "8192"))
    assert budget == 100000 and why.startswith("pending") and "a 8K at 10K" in why
    # a length not measured on a model at all: that model is judged at the others, and the rule says so
    budget, why = fit_budget.choose(_models([0.019, 0.0, 0.04], [0.012, 0.0, 0.03], full), ("2048", "8192"))
    assert budget == 10000 and why.endswith("a at 2K")
    # every model and length must hold: one model out of the CI rules the budget out
    two = _models([0.015, 0.0, 0.04], [0.012, 0.0, 0.03], full)
    two["b"] = {"10000": {"novel_dnll_8192": [0.09, 0.05, 0.12]}, "25000": {"novel_dnll_8192": [0.02, 0.0, 0.04]},
                "100000": {"novel_dnll_8192": [0.02, 0.01, 0.03]}}
    for m in two.values():
        for t in m:
            m[t].setdefault("novel_dnll_2048", m[t].get("novel_dnll_8192"))
            m[t].setdefault("novel_dnll_8192", m[t]["novel_dnll_2048"])
    assert fit_budget.choose(two)[0] == 25000
    # budgets are judged from the smallest up: one that holds needs no figure of the larger ones,
    # one that fails passes the choice to the next, which then must have every figure
    part = _models([0.015, 0.0, 0.04], [0.012, 0.0, 0.03], full)
    for t, m in part["a"].items():
        m["novel_dnll_8192"] = m["novel_dnll_2048"]
    del part["a"]["25000"]["novel_dnll_8192"]
    assert fit_budget.choose(part)[0] == 10000
    part["a"]["10000"]["novel_dnll_8192"] = [0.05, 0.03, 0.07]
    budget, why = fit_budget.choose(part)
    assert budget == 100000 and why.startswith("pending") and "a 8K at 25K" in why and "10K" not in why


def test_an_eval_run_gives_each_budget_its_figures():
    ci = lambda x, lo, hi: {"estimate": x, "low": lo, "high": hi, "n": 12}  # noqa: E731
    d = {"maps": ["/x/smollm2.100000.ridgefill.gguf"], "options": {"n_docs": 12},
         "compared_maps": {"ridge (9709 tokens)": "/x/smollm2.10000.ridgefill.gguf"},
         "summary": {"2048": {"ridge": {"novel": {"delta": ci(0.01, 0.0, 0.02)}},
                              "ridge (9709 tokens)": {"novel": {"delta": ci(0.03, 0.01, 0.05)}},
                              "identity": {"novel": {"delta": ci(0.2, 0.1, 0.3)}}}},
         "paired": {"2048": {"ridge (9709 tokens)": {"novel": ci(0.02, 0.01, 0.03)}}},
         "retrieval": {"2048": {"ridge, attention selector": {"kept": [9, 10]},
                                "ridge (9709 tokens), attention selector": {"kept": [8, 10]}}}}
    models: dict = {}
    fit_budget.add_eval(models, json.loads(json.dumps(d)))
    assert models == {"smollm2": {"100000": {"novel_dnll_2048": [0.01, 0.0, 0.02], "codes_kept_2048": [9, 10]},
                                  "10000": {"novel_dnll_2048": [0.03, 0.01, 0.05], "vs_100000_2048": [0.02, 0.01, 0.03],
                                            "codes_kept_2048": [8, 10]},
                                  "identity": {"novel_dnll_2048": [0.2, 0.1, 0.3]}, "documents": {"2048": 12}}}


def test_a_length_just_under_a_standard_one_is_filed_under_it_and_recorded():
    """SmolLM2's context is 8,192 tokens, so its "8K" prompts are 8,176 tokens (room for the answer):
    filed under 8192 with the length measured beside; a length far from any stays as it is."""
    ci = lambda x: {"estimate": x, "low": x - 0.01, "high": x + 0.01, "n": 12}  # noqa: E731
    d = {"maps": ["/x/smollm2.100000.ridgefill.gguf"], "options": {"n_docs": 12},
         "compared_maps": {"ridge (9709 tokens)": "/x/smollm2.10000.ridgefill.gguf"},
         "summary": {"8176": {"ridge": {"novel": {"delta": ci(0.01)}}, "ridge (9709 tokens)": {"novel": {"delta": ci(0.02)}}},
                     "3000": {"ridge": {"novel": {"delta": ci(0.03)}}}},
         "paired": {"8176": {"ridge (9709 tokens)": {"novel": ci(0.01)}}}}
    models: dict = {}
    fit_budget.add_eval(models, json.loads(json.dumps(d)))
    m = models["smollm2"]
    assert m["prompt_tokens"] == {"8192": 8176} and m["documents"] == {"8192": 12, "3000": 12}
    assert m["10000"]["novel_dnll_8192"] == [0.02, 0.01, 0.03] and m["10000"]["vs_100000_8192"] == [0.01, 0.0, 0.02]
    assert m["100000"]["novel_dnll_3000"] == [0.03, 0.02, 0.04]
    assert [fit_budget.nominal(n) for n in ("2048", "8192", "8128", "8127", "1984", "1983", "4096")] == \
        ["2048", "8192", "8192", "8127", "2048", "1983", "4096"]


def test_a_ruler_run_gives_each_budget_its_score_differences():
    ci = lambda x: {"estimate": x, "low": x - 5, "high": x + 5, "n": 16}  # noqa: E731
    cond = lambda maps, vs=None: {"kind": "ridge", "maps": maps, "split": 19, "settings": {}, "compared_with": vs}  # noqa: E731
    d = {"conditions": {"exact": {"kind": "exact", "maps": None, "split": None, "settings": None, "compared_with": None},
                        "ridge S=19": cond("/x/qwen15.100000.ridgefill.gguf"),
                        "ridge S=19 (9728 tokens)": cond("/x/qwen15.10000.ridgefill.gguf", "ridge S=19")},
         "options": {"tasks": ["niah_single_1", "niah_multikey_1"], "samples": 8},
         "samples": [{"length": 4096}] * 16,
         "summary": {"4096": {"average": {"exact": {"score": ci(90.0), "delta": ci(0.0)},
                                          "ridge S=19": {"score": ci(85.0), "delta": ci(-5.0)},
                                          "ridge S=19 (9728 tokens)": {"score": ci(80.0), "delta": ci(-10.0), "vs": ci(-5.0)}}}}}
    models: dict = {}
    fit_budget.add_ruler(models, json.loads(json.dumps(d)))
    m = models["qwen15"]
    assert m["100000"] == {"ruler_4096": [-5.0, -10.0, 0.0]}
    assert m["10000"] == {"ruler_4096": [-10.0, -15.0, -5.0], "ruler_vs_100000_4096": [-5.0, -10.0, 0.0]}
    assert m["ruler"] == {"4096": {"tasks": ["niah_single_1", "niah_multikey_1"], "samples_per_task": 8, "prompts": 16,
                                   "exact_score": [90.0, 85.0, 95.0]}}
    rows = fit_budget.ruler_table(models).splitlines()
    assert rows[2] == "| qwen15 | 4K | 16 (2 tasks × 8) | 90.0 | 10,000 | -10.0 [-15.0, -5.0] | -5.0 [-10.0, +0.0] |"
    assert rows[3].startswith("| qwen15 | 4K | 16 (2 tasks × 8) | 90.0 | 100,000 | -5.0 [") and rows[3].endswith("| — |")


def test_the_committed_summary_is_what_the_tool_makes(tmp_path):
    """docs/fit-budget/summary.json is the tool's output from the committed files."""
    docs = ROOT / "docs" / "fit-budget"
    evals = sorted(docs.glob("eval-*/results.json"))
    rulers = sorted(docs.glob("ruler-*/ruler.json"))
    import subprocess
    import sys

    args = [sys.executable, str(ROOT / "tools" / "measure" / "fit_budget.py"), "--fits", str(docs / "fits"),
            "--out", str(tmp_path)] + [x for p in evals for x in ("--eval", str(p))] + \
        [x for p in rulers for x in ("--ruler", str(p))]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads((docs / "summary.json").read_text())


def test_fit_uses_the_budget_the_sweep_chose():
    """fit's default calibration budget is summary.json's default_tokens (the rule's choice)."""
    from ridgefill_cpp.core import settings

    summary = json.loads((ROOT / "docs" / "fit-budget" / "summary.json").read_text())
    assert settings.FIT_TOKENS == summary["default_tokens"], summary["rule"]
