"""The operating point `tune` chose, with the figures that confirm it, as one JSON (issue #47,
docs/tune-gemma3/chosen.json): the setting from tune.json, the novel-token ΔNLL and its CI from an
`eval` run with more documents at the same setting, retrieval from `eval` runs (any lengths), and the
speedup and ceiling per prompt length from `bench --json`. `goal` says whether the point reaches a
speedup at a length within the budget by the CI's upper bound with every code exact prefill
retrieves kept.

    python tools/measure/chosen_point.py --tune tune.json --eval eval-2k/results.json \\
        [--retrieval eval-8k/results.json ...] --bench bench.json --budget 0.02 \\
        [--label 'S=8 T=64 f=0.2 w=16'] [--goal-speedup 1.6 --goal-length 8192] -o chosen.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ridge_retrieval(results: dict) -> dict[str, dict]:
    """Per prompt length: planted codes exact prefill retrieved, and of those the ridge fill's
    (attention selector) retrieved."""
    out = {}
    for n, conds in results.get("retrieval", {}).items():
        exact = conds.get("exact")
        ridge = next((v for k, v in conds.items() if k.startswith("ridge") and "selector" in k), None)
        if exact is None or ridge is None:
            continue
        ok_exact = _correct(exact)
        ok_ridge = _correct(ridge)
        kept = sum(1 for e, r in zip(ok_exact, ok_ridge) if e and r)
        out[n] = {"prompts": len(ok_exact), "exact_correct": sum(ok_exact), "kept": kept}
    return out


def _flat(cond: dict) -> list:
    return [x for _, xs in sorted(cond["by_depth"].items()) for x in xs]


def _correct(cond: dict) -> list[bool]:
    return [bool(x) for x in _flat(cond)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", type=Path, required=True)
    ap.add_argument("--eval", type=Path, required=True, help="eval results.json at the chosen setting (ΔNLL)")
    ap.add_argument("--retrieval", type=Path, action="append", default=[], help="more eval results.json (retrieval)")
    ap.add_argument("--bench", type=Path, required=True)
    ap.add_argument("--budget", type=float, required=True)
    ap.add_argument("--label", help="another point of tune.json than the chosen one, e.g. 'S=8 T=64 f=0.2 w=16'")
    ap.add_argument("--goal-speedup", type=float, default=1.6)
    ap.add_argument("--goal-length", type=int, default=8192)
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args(argv)

    tune = json.loads(args.tune.read_text())
    if args.label:
        point = next((p for p in tune["points"] if p["label"] == args.label), None)
        if point is None:
            print(f"chosen_point: no point {args.label!r} in {args.tune}", file=sys.stderr)
            return 1
    else:
        point = tune["points"][tune["chosen"]]
    ev = json.loads(args.eval.read_text())
    o = ev["options"]
    if (o["tail"], o["exact_fraction"]) != (point["tail"], point["exact_fraction"]) or ev["splits"][0] != point["split"]:
        print(f"chosen_point: {args.eval} is not at the chosen setting {point['label']}", file=sys.stderr)
        return 1
    n = str(o["lengths"][0])
    novel = ev["summary"][n]["ridge"]["novel"]["delta"]
    bench = json.loads(args.bench.read_text())
    if bench["split"] != point["split"]:
        print(f"chosen_point: {args.bench} is not at split {point['split']}", file=sys.stderr)
        return 1
    speed = {str(s["n_prompt"]): round(next(v for k, v in s.items() if k.startswith("speedup[")), 3)
             for s in bench["summary"]}
    ceiling = {str(s["n_prompt"]): round(s["ceiling"], 3) for s in bench["summary"]}
    retrieval = {}
    for path in [args.eval, *args.retrieval]:
        retrieval.update(_ridge_retrieval(json.loads(path.read_text())))
    kept_all = all(r["kept"] == r["exact_correct"] for r in retrieval.values())
    goal_speed = speed.get(str(args.goal_length))
    chosen = {
        "model": Path(tune["model"]).name,
        "budget": args.budget,
        "split": point["split"], "tail": point["tail"], "exact_fraction": point["exact_fraction"],
        "selector": point["selector"], "span": point.get("span"),
        "novel_dnll": round(novel["estimate"], 5), "novel_dnll_ci": [round(novel["low"], 5), round(novel["high"], 5)],
        "novel_dnll_docs": novel["n"], "novel_dnll_length": int(n),
        "tune": {"novel_dnll": round(point["novel"]["estimate"], 5),
                 "novel_dnll_ci": [round(point["novel"]["low"], 5), round(point["novel"]["high"], 5)],
                 "docs": point["novel"]["n"], "speedup_2048": round(point["speedup"], 3)},
        "speedup": speed,
        "ceiling": ceiling[str(args.goal_length)] if str(args.goal_length) in ceiling else max(ceiling.values()),
        "ceiling_by_length": ceiling,
        "fraction_of_ceiling": {k: round(speed[k] / ceiling[k], 3) for k in speed},
        "retrieval": retrieval,
        "goal": {"speedup": args.goal_speedup, "length": args.goal_length,
                 "reached": bool(goal_speed is not None and goal_speed >= args.goal_speedup
                                 and novel["high"] <= args.budget and kept_all),
                 "speedup_ok": bool(goal_speed is not None and goal_speed >= args.goal_speedup),
                 "dnll_upper_ok": bool(novel["high"] <= args.budget), "retrieval_kept": kept_all},
    }
    args.out.write_text(json.dumps(chosen, indent=2) + "\n")
    print(json.dumps(chosen, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
