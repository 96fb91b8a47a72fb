#!/usr/bin/env python3
"""The calibration budget of `fit`, chosen by data (docs/fit-budget): for each model and budget, what the
fit took and what its maps cost in quality, gathered from the files the measuring commands wrote.

    # per model M and budget B (tokens), fit's defaults otherwise:
    /usr/bin/time -v ridgefill-gguf fit MODEL --tokens B -o M.B.ridgefill.gguf -t 2 > fits/M.B.fit.txt 2>&1
    # per model and prompt length, every budget's maps on the same documents (paired), 100K first:
    ridgefill-gguf eval MODEL --maps M.100000.ridgefill.gguf --compare-maps M.10000.ridgefill.gguf ... \\
        --lengths 2048 --no-splice -t 2 --out eval-M-2k
    python tools/measure/fit_budget.py --fits fits --eval eval-M-2k/results.json ... --out docs/fit-budget

Writes ``summary.json`` (``{"default_tokens", "rule", "models": {MODEL: {TOKENS: {"seconds",
"peak_rss_mib", "estimate_s", "estimate_peak_mib", "r2_mean", "novel_dnll_2048": [x, lo, hi],
"novel_dnll_8192": [...], "vs_full_2048": [d, lo, hi], ...}}}}``; a figure whose file is not given is
absent) and ``fit-budget.png`` (novel-token ΔNLL against tokens, one line a model), and prints the
Markdown table. The default is the smallest budget whose novel ΔNLL lies within the 95 % CI of the
largest budget's on every model and length measured (at or below its upper bound); with none, the
largest, and the summary says so (and which lengths each model was judged at).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_summary import ci, fit_figures  # noqa: E402

FIT_FILE = re.compile(r"^(?P<model>[\w.-]+?)\.(?P<tokens>\d+)\.fit\.txt$")
MAP_FILE = re.compile(r"^(?P<model>[\w.-]+?)\.(?P<tokens>\d+)\.ridgefill\.gguf$")
ESTIMATE = re.compile(r"estimate: the fit takes about (?P<t>.+?) \(.*?peak memory about (?P<peak>[\d.]+) GiB")
#: the prompt lengths every model and budget is measured at before the default is chosen
LENGTHS = ("2048", "8192")
R2_ROW = re.compile(r"^│\s+\d+\s+│\s+\S+\s+│\s+(?P<r2>-?[\d.]+)\s+│", re.M)


def seconds(text: str) -> float:
    """A duration as fit's estimate prints it ("45 s", "17 min", "1 h 52 min") in seconds."""
    m = re.fullmatch(r"(?:(\d+) h )?(?:(\d+) min)?(?:(\d+) s)?", text.strip())
    if not m or not any(m.groups()):
        raise ValueError(f"not a duration: {text!r}")
    h, mi, s = (int(g or 0) for g in m.groups())
    return 3600 * h + 60 * mi + s


def fit_entry(text: str) -> dict:
    """One fit's figures from its output under /usr/bin/time -v."""
    f = fit_figures(text)
    out = {"seconds": round(f["seconds"], 1), "peak_rss_mib": round(f["peak_rss_mib"], 1),
           "calibration_tokens": f.get("calibration_tokens")}
    if "maps_mib" in f:
        out["maps_mib"] = f["maps_mib"]
    est = ESTIMATE.search(text)
    if est:
        out["estimate_s"] = seconds(est.group("t"))
        out["estimate_peak_mib"] = round(float(est.group("peak")) * 1024, 1)
    r2 = [float(x) for x in R2_ROW.findall(text)]
    if r2:
        out["r2_mean"] = round(sum(r2) / len(r2), 4)
    return out


def budget_of(path: str) -> int:
    m = MAP_FILE.match(Path(path).name)
    if not m:
        raise ValueError(f"{path}: not a MODEL.TOKENS.ridgefill.gguf map file of the sweep")
    return int(m.group("tokens"))


def nominal(n: str) -> str:
    """The length of LENGTHS a measured prompt length is filed under: itself, or the one it is at most
    64 tokens short of (a model whose context is that length leaves room for the answer: SmolLM2's
    8,192-token context takes prompts of at most 8,176 tokens)."""
    return next((length for length in LENGTHS if int(length) - 64 <= int(n) <= int(length)), n)


def add_eval(models: dict, d: dict) -> None:
    """An eval run's novel-token ΔNLL of every budget's maps (the main file and --compare-maps) and each
    one's paired difference against the main file's; a length filed under another (:func:`nominal`)
    is recorded in the model's ``prompt_tokens``."""
    main = Path(d["maps"][0]).name
    model = MAP_FILE.match(main).group("model")
    variants = {"ridge": budget_of(main), **{v: budget_of(p) for v, p in d["compared_maps"].items()}}
    for measured, summ in d["summary"].items():
        n = nominal(measured)
        if n != measured:
            models.setdefault(model, {}).setdefault("prompt_tokens", {})[n] = int(measured)
        for v, tokens in variants.items():
            entry = models.setdefault(model, {}).setdefault(str(tokens), {})
            if v in summ and summ[v].get("novel"):
                entry[f"novel_dnll_{n}"] = ci(summ[v]["novel"]["delta"])
            pair = d.get("paired", {}).get(measured, {}).get(v, {}).get("novel")
            if pair:
                entry[f"vs_{variants['ridge']}_{n}"] = ci(pair)
            kept = d.get("retrieval", {}).get(measured, {}).get(f"{v}, attention selector", {}).get("kept")
            if kept:
                entry[f"codes_kept_{n}"] = kept
        ident = summ.get("identity", {}).get("novel")
        if ident:
            models[model].setdefault("identity", {})[f"novel_dnll_{n}"] = ci(ident["delta"])
        models[model].setdefault("documents", {})[n] = d["options"]["n_docs"]


def add_ruler(models: dict, d: dict) -> None:
    """An ``eval --ruler`` run's figures for each budget's maps (the main file and --compare-maps): the
    all-task score difference from exact (points, paired) and, for a compared file, from the main
    file's maps; the tasks, samples and exact's score beside, under the model's ``ruler``."""
    conds = {n: c for n, c in d["conditions"].items() if c.get("maps")}
    main = next(n for n, c in conds.items() if not c.get("compared_with"))
    model = MAP_FILE.match(Path(conds[main]["maps"]).name).group("model")
    full = budget_of(conds[main]["maps"])
    for n, summ in d["summary"].items():
        avg = summ["average"]
        for name, c in conds.items():
            entry = models.setdefault(model, {}).setdefault(str(budget_of(c["maps"])), {})
            entry[f"ruler_{n}"] = ci(avg[name]["delta"])
            if "vs" in avg[name]:
                entry[f"ruler_vs_{full}_{n}"] = ci(avg[name]["vs"])
        models[model].setdefault("ruler", {})[n] = {
            "tasks": list(d["options"]["tasks"]), "samples_per_task": d["options"]["samples"],
            "prompts": sum(1 for r in d["samples"] if str(r["length"]) == n),
            "exact_score": ci(avg["exact"]["score"])}


def choose(models: dict, lengths: tuple[str, ...] = LENGTHS) -> tuple[int, str]:
    """(default tokens, why): the smallest budget whose novel ΔNLL is at or below the upper bound of the
    largest budget's CI on every model and length. Each model is judged at the lengths of ``lengths``
    its largest budget was measured at (a model not measured at a length at all is judged without it,
    and ``why`` names the lengths each model was judged at). Budgets are judged from the smallest up;
    one that lacks a figure the largest budget has cannot be judged, and the choice waits for it (the
    largest budget until then)."""
    budgets = sorted({int(t) for m in models.values() for t in m if t.isdigit()})
    full = budgets[-1]
    at = {name: [n for n in lengths if f"novel_dnll_{n}" in m.get(str(full), {})] for name, m in models.items()}
    if not any(at.values()):
        return full, f"pending (the largest budget until then): no novel ΔNLL yet of {full:,} tokens' maps"
    judged = "; ".join(f"{name} at {' and '.join(f'{int(n) // 1024}K' for n in ns) or 'no length'}"
                       for name, ns in at.items())
    for b in budgets[:-1]:
        missing = sorted({f"{name} {int(n) // 1024}K at {b // 1000}K" for name, m in models.items()
                          for n in at[name] if f"novel_dnll_{n}" not in m.get(str(b), {})})
        if missing:
            return full, f"pending (the largest budget until then): no novel ΔNLL yet for {', '.join(missing)}"
        if all(models[name][str(b)][f"novel_dnll_{n}"][0] <= models[name][str(full)][f"novel_dnll_{n}"][2]
               for name, ns in at.items() for n in ns):
            return b, (f"the smallest budget whose novel-token ΔNLL is within the 95 % CI of {full:,} tokens' "
                       f"(at or below its upper bound) on every model and length measured: {judged}")
    return full, f"no smaller budget stays within the CI of {full:,} tokens' on every model and length measured: {judged}"


def plot(models: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({k.rsplit("_", 1)[1] for m in models.values() for e in m.values() if isinstance(e, dict)
                      for k in e if k.startswith("novel_dnll_")}, key=int)
    if not lengths:
        return
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths), 4), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for i, (name, m) in enumerate(models.items()):
            pts = sorted((int(t), e[f"novel_dnll_{n}"]) for t, e in m.items() if t.isdigit() and f"novel_dnll_{n}" in e)
            if not pts:
                continue
            xs = [t * 1.06 ** (i - (len(models) - 1) / 2) for t, _ in pts]  # side by side: the CIs overlap
            ys = [v[0] for _, v in pts]
            err = [[v[0] - v[1] for _, v in pts], [v[2] - v[0] for _, v in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        budgets = sorted({int(t) for m in models.values() for t in m if t.isdigit()})
        ax.set_xticks(budgets, [f"{b // 1000}K" for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("calibration tokens (fit --tokens)")
        ax.set_ylabel("novel-token ΔNLL vs exact (nats)")
        ax.set_title(f"{int(n):,}-token prompts (95 % CI over documents)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(models: dict) -> str:
    lengths = sorted({k.rsplit("_", 1)[1] for m in models.values() for e in m.values() if isinstance(e, dict)
                      for k in e if k.startswith("novel_dnll_")}, key=int)
    head = (["model", "tokens", "fit", "peak RSS", "estimate", "mean R²"]
            + [f"{what} {int(n) // 1024}K" for n in lengths for what in ("novel ΔNLL", "vs 100K, paired", "codes kept")])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in models.items():
        for t in sorted((t for t in m if t.isdigit()), key=int):
            e = m[t]
            cells = [name, f"{int(t):,}", f"{e['seconds']:.0f} s" if "seconds" in e else "—",
                     f"{e['peak_rss_mib']:,.0f} MiB" if "peak_rss_mib" in e else "—",
                     (f"{e['estimate_s']:.0f} s, {e['estimate_peak_mib']:,.0f} MiB" if "estimate_s" in e else "—"),
                     f"{e['r2_mean']:.3f}" if "r2_mean" in e else "—"]
            for n in lengths:
                v, d, k = e.get(f"novel_dnll_{n}"), e.get(f"vs_100000_{n}"), e.get(f"codes_kept_{n}")
                cells += [f"{v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]" if v else "—",
                          f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]" if d else "—", f"{k[0]}/{k[1]}" if k else "—"]
            rows.append("| " + " | ".join(cells) + " |")
        ident = m.get("identity", {})
        if ident:
            cells = [name, "identity fill", "", "", "", ""]
            for n in lengths:
                v = ident.get(f"novel_dnll_{n}")
                cells += [f"{v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]" if v else "—", "", ""]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def ruler_table(models: dict) -> str:
    """The RULER subset's figures, a row per model and budget (points, 95 % CI over prompts)."""
    rows = []
    for name, m in models.items():
        for n, r in (m.get("ruler") or {}).items():
            budgets = sorted((t for t in m if t.isdigit() and f"ruler_{n}" in m[t]), key=int)
            full = int(budgets[-1])
            for t in budgets:
                e = m[t]
                d, vs = e[f"ruler_{n}"], e.get(f"ruler_vs_{full}_{n}")
                rows.append(f"| {name} | {int(n) // 1024}K | {r['prompts']} ({len(r['tasks'])} tasks × {r['samples_per_task']}) "
                            f"| {r['exact_score'][0]:.1f} | {int(t):,} | {d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}] | "
                            + (f"{vs[0]:+.1f} [{vs[1]:+.1f}, {vs[2]:+.1f}]" if vs else "—") + " |")
    if not rows:
        return ""
    return ("| model | length | prompts | exact's score | tokens | Δ vs exact (points) | vs 100K, paired |\n"
            "|---|---|---|---:|---:|---|---|\n" + "\n".join(rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fits", type=Path, required=True, help="folder of MODEL.TOKENS.fit.txt files")
    ap.add_argument("--eval", type=Path, action="append", default=[], help="an eval run's results.json (repeat)")
    ap.add_argument("--ruler", type=Path, action="append", default=[],
                    help="an eval --ruler run's ruler.json with the budgets' maps (--maps, --compare-maps; repeat)")
    ap.add_argument("--out", type=Path, required=True, help="folder for summary.json and fit-budget.png")
    a = ap.parse_args()

    models: dict = {}
    for p in sorted(a.fits.glob("*.fit.txt")):
        m = FIT_FILE.match(p.name)
        if m:
            models.setdefault(m.group("model"), {})[m.group("tokens")] = fit_entry(p.read_text())
    for p in a.eval:
        add_eval(models, json.loads(p.read_text()))
    for p in a.ruler:
        add_ruler(models, json.loads(p.read_text()))
    default, rule = choose(models)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps({"default_tokens": default, "rule": rule, "models": models},
                                                   indent=1) + "\n")
    plot(models, a.out / "fit-budget.png")
    print(table(models))
    rt = ruler_table(models)
    if rt:
        print("\n" + rt)
    print(f"\ndefault_tokens {default}: {rule}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
