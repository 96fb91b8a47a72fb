"""The overview of docs/ruler: one row per (model, length, condition) from the ``ruler.json`` files that
``ridgefill-gguf eval --ruler`` wrote; with --rewrite, each report's statistics (seeded, so the same CIs),
ruler.md and ruler.png made again from its samples with the current code (so a fix to the summary or
the writer reaches committed reports without rerunning the models).

    python tools/measure/ruler_summary.py docs/ruler/gemma3-4k docs/ruler/smollm2-4k ... [--rewrite]

The table's columns: the score over all tasks, the paired difference from exact with its 95 % bootstrap
CI, the CI's half-width (the difference the run resolves: a true loss of more than that would put the
CI below zero), the share of answers word for word equal to exact's, the task where the condition
loses most on average, the median TTFT ratio and the mean ceiling 1/r of the prompts.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from ridgefill_cpp.quality.ruler import RulerResult, summarise
from ridgefill_cpp.quality.ruler_report import mean_plan, score_ci, write_ruler_report


def load(d: pathlib.Path) -> RulerResult:
    return RulerResult(**json.loads((d / "ruler.json").read_text()))


def rows(res: RulerResult) -> list[str]:
    names = list(res.conditions)
    out = []
    model = pathlib.Path(res.model).name
    for length, summ in res.summary.items():
        recs = [r for r in res.samples if str(r["length"]) == length]
        tasks = [t for t in summ if t != "average"]
        for n in names:
            a = summ["average"][n]
            if n == names[0]:
                paired = "— | — | — | —"
            else:
                d = a["delta"]
                worst = min(tasks, key=lambda t: summ[t][n]["delta"]["estimate"])
                w = summ[worst][n]["delta"]["estimate"]
                paired = (f"{score_ci(d, True)} | ±{(d['high'] - d['low']) / 2:.1f} | {a['same_answer']:.0%} | "
                          f"{f'{worst} ({w:+.1f})' if w < 0 else 'none'}")
            out.append(f"| {model} | {length} | {n} | {res.options['samples']} × {len(tasks)} | {score_ci(a['score'])} | "
                       f"{paired} | {res.ttft[length][n]:.2f}x | {mean_plan(recs, n, 'ceiling'):.2f}x |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=pathlib.Path, help="report directories with a ruler.json")
    ap.add_argument("--rewrite", action="store_true", help="write each ruler.md and ruler.png again from its JSON")
    args = ap.parse_args()
    print("| model | length | condition | samples × tasks | score, all tasks | Δ vs exact | CI half-width | "
          "same answer | task it loses most in (Δ) | TTFT ratio | ceiling |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for d in args.reports:
        res = load(d)
        if args.rewrite:
            summarise(res, res.options["n_boot"], res.options["seed"])   # seeded: the same CIs, current rules
            write_ruler_report(res, d)
        print("\n".join(rows(res)))


if __name__ == "__main__":
    main()
