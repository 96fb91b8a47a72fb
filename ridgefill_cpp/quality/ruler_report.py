"""The report of ``eval --ruler``: ruler.md (RULER's layout, tasks as columns), ruler.json, ruler.png."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..core.files import write_bytes
from ..core.machine import measured_text
from .report import agg_pyplot, save_figure, timing_warning_lines
from .ruler import JOURNAL, RulerResult, compared_conditions


def score_ci(d: dict, signed: bool = False) -> str:
    """A score or difference (points) with its CI; the estimate alone with one sample."""
    f = "{:+.1f}" if signed else "{:.1f}"
    if d["low"] != d["low"]:  # one sample: no interval
        return f.format(d["estimate"])
    return f"{f.format(d['estimate'])} [{f.format(d['low'])}, {f.format(d['high'])}]"


def mean_plan(recs: list[dict], name: str, key: str) -> float:
    """The mean over ``recs`` of one field of condition ``name``'s prefill plan (0 where it has none)."""
    return sum(r["outputs"][name]["plan"].get(key, 0) for r in recs) / len(recs)


def write_ruler_report(res: RulerResult, out_dir: os.PathLike | str) -> list[Path]:
    """Write ruler.md, ruler.json and ruler.png into ``out_dir``; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_plot(res, out / "ruler.png")]
    j = out / "ruler.json"
    write_bytes(j, json.dumps(res.as_dict(), indent=1).encode())
    md = out / "ruler.md"
    write_bytes(md, markdown(res, paths[0].name).encode())
    return paths + [j, md]


def markdown(res: RulerResult, plot: str | None = None) -> str:
    names = list(res.conditions)
    compared = compared_conditions(res)
    o = res.options
    L = [f"# RULER, exact prefill against RidgeFill: {Path(res.model).name}\n",
         f"{len(o['tasks'])} tasks × {o['samples']} samples per length, each prompt run with every condition "
         f"(paired); greedy decoding, RULER's generation budget per task; score: RULER's `string_match_all` "
         f"(share of the expected strings in the answer, ×100). Prompt format: {'the model chat template' if res.template == 'chat' else 'RULER base template (the model has no chat template)'} "
         f"and RULER's answer prefix. 95 % bootstrap CIs over samples; Δ is the paired difference from exact"
         + ("; A − B the paired difference of condition A from condition B (the same prompts)" if compared else "") + ".\n"]
    L.append("| condition | kind | map file | split | settings |\n|---|---|---|---|---|")
    for n, c in res.conditions.items():
        st = c["settings"] or {}
        brief = ", ".join(f"{k} {st[k]}" for k in ("tail", "exact_fraction", "selector", "span") if st.get(k) is not None)
        L.append(f"| {n} | {c['kind']} | {Path(c['maps']).name if c['maps'] else '—'} | {c['split'] or '—'} | {brief or '—'} |")
    L.append("")
    for length, summ in res.summary.items():
        tasks = [t for t in summ if t != "average"]
        recs = [r for r in res.samples if str(r["length"]) == length]
        lo, hi = min(r["n_prompt"] for r in recs), max(r["n_prompt"] for r in recs)
        L.append(f"## {length} tokens (prompts of {lo}–{hi} tokens plus the generation)\n")
        L.append("| | avg | " + " | ".join(tasks) + " |")
        L.append("|---|" + "---:|" * (len(tasks) + 1))
        for n in names:
            L.append(f"| {n} | " + " | ".join(f"{summ[t][n]['score']['estimate']:.1f}" for t in ["average", *tasks]) + " |")
        for n in names[1:]:
            L.append(f"| Δ {n} | " + " | ".join(score_ci(summ[t][n]["delta"], signed=True) for t in ["average", *tasks]) + " |")
        for n, base in compared.items():
            L.append(f"| {n} − {base} | " + " | ".join(score_ci(summ[t][n]["vs"], signed=True) for t in ["average", *tasks]) + " |")
        for n in names[1:]:
            L.append(f"| same answer as exact, {n} | " + " | ".join(f"{summ[t][n]['same_answer']:.0%}"
                                                               for t in ["average", *tasks]) + " |")
        L.append("")
        L.append("| condition | score, all tasks | Δ vs exact | same answer | TTFT ratio (exact / it, median) | filled rows (mean) | ceiling |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for n in names:
            a = summ["average"][n]
            filled, ceil = mean_plan(recs, n, "n_filled"), mean_plan(recs, n, "ceiling")
            L.append(f"| {n} | {score_ci(a['score'])} | {score_ci(a['delta'], True) if n != names[0] else '—'} | "
                     f"{a['same_answer']:.0%} | {res.ttft[length][n]:.2f}x | {filled:.0f} | {ceil:.2f}x |")
        L.append("")
        for n, base in compared.items():
            L.append(f"- {n} against {base}, paired on the same prompts: {score_ci(summ['average'][n]['vs'], True)} "
                     f"points over all tasks")
        if compared:
            L.append("")
        L += timing_warning_lines(res.timing_warnings.get(length, []))
        depth = res.by_depth.get(length) or {}
        if depth:
            L.append("By depth of the answer in the prompt (needle and variable-tracking tasks; share of the prompt's tokens):\n")
            L.append("| depth | samples | " + " | ".join(f"{n}" for n in names) + " | " +
                     " | ".join(f"Δ {n}" for n in names[1:]) + " |")
            L.append("|---|---:|" + "---:|" * (2 * len(names) - 1))
            for b, d in depth.items():
                L.append(f"| {b} | {d[names[0]]['n']} | " + " | ".join(f"{d[n]['score']['estimate']:.1f}" for n in names)
                         + " | " + " | ".join(score_ci(d[n]["delta"], True) for n in names[1:]) + " |")
            L.append("")
        for n, w in (res.worst.get(length) or {}).items():
            where = f"at depth {w['depth']}" if w["depth"] != "all" else "(no depth: all its prompts)"
            L.append(f"- {n}: largest loss against exact in {w['task']} {where}: {w['delta']:+.1f} "
                     f"points ({w['n']} sample{'s' if w['n'] != 1 else ''})" if w["delta"] < 0 else
                     f"- {n}: no (task, depth) cell where it scores below exact")
        L.append("")
    if plot:
        L.append(f"![per-task scores and paired differences]({plot})\n")
    L.append("Texts: " + "; ".join(res.sources) + ".\n")
    L.append("Departures from RULER's reference implementation: " + "; ".join(res.deviations) + ".\n")
    L.append("Every prompt's seed, answer and the outputs of each condition are in ruler.json."
             + (f" Wall time {res.elapsed_s / 60:.1f} min." if res.elapsed_s is not None else "")
             + f" Measured: {measured_text(res.measured)}."
             + (f" {res.reused} of the {len(res.samples)} prompts were run in earlier sittings of the same run "
                f"({JOURNAL}), and their times are those sittings'." if res.reused else ""))
    return "\n".join(L) + "\n"


def _plot(res: RulerResult, path: Path) -> Path:
    plt = agg_pyplot()
    names = list(res.conditions)
    lengths = list(res.summary)
    fig, axes = plt.subplots(2, len(lengths), figsize=(max(7.5, 1.0 + 0.75 * len(res.summary[lengths[0]])) * len(lengths), 6.4),
                             squeeze=False, sharex="col")
    for col, length in enumerate(lengths):
        summ = res.summary[length]
        keys = [t for t in summ if t != "average"] + ["average"]
        width = 0.8 / len(names)
        top, bottom = axes[0][col], axes[1][col]
        for i, n in enumerate(names):
            xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(keys))]
            top.bar(xs, [summ[t][n]["score"]["estimate"] for t in keys], width, label=n)
            if i:
                d = [summ[t][n]["delta"] for t in keys]
                est = [x["estimate"] for x in d]
                err = [[max(0.0, x["estimate"] - x["low"]) if x["low"] == x["low"] else 0 for x in d],
                       [max(0.0, x["high"] - x["estimate"]) if x["high"] == x["high"] else 0 for x in d]]
                bottom.errorbar(xs, est, yerr=err, fmt="o", capsize=3, color=f"C{i}", label=f"Δ {n}")
        top.set_ylabel("score")
        top.set_ylim(0, 100)
        top.set_title(f"{Path(res.model).name}, {length} tokens")
        bottom.axhline(0, color="grey", lw=0.8)
        bottom.set_ylabel("Δ vs exact (points, 95 % CI)")
        bottom.set_xticks(range(len(keys)), keys, rotation=45, ha="right")
        top.legend(fontsize=7)
    return save_figure(fig, path)
