"""The files of ``ridgefill-gguf eval``: ``report.md``, PNG plots and ``results.json`` (written
atomically, each). Plots use matplotlib's non-interactive Agg backend (:func:`agg_pyplot`,
:func:`save_figure`, also used by ``tune``'s plot)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from ..core.machine import measured_text
from .evaluate import EvalResult
from ..core.files import write_bytes

METRICS = (("novel", "novel tokens"), ("key", "key tokens"), ("all", "all tail tokens"))


def ci_text(d: dict | None, fmt: str = "{:+.4f}", bound_fmt: str | None = None) -> str:
    """A figure with its CI; the estimate alone, marked, when there is no interval (one document)."""
    if not d:
        return "—"
    if d["low"] != d["low"]:  # NaN: one document, no interval
        return f"{fmt.format(d['estimate'])} (1 document: no CI)"
    b = bound_fmt or fmt
    return f"{fmt.format(d['estimate'])} [{b.format(d['low'])}, {b.format(d['high'])}]"


def _pct(d: dict | None, fill_positive: bool = False) -> str:
    if not d or d["estimate"] != d["estimate"]:
        return "—"
    if d["low"] != d["low"]:  # NaN: some resample had no fill error to apportion
        # the point estimate means something only when the fill's own ΔNLL is clearly above 0
        return f"{100 * d['estimate']:.0f} % (CI undefined)" if fill_positive else "undefined"
    return f"{100 * d['estimate']:.0f} % [{100 * d['low']:.0f}, {100 * d['high']:.0f}]"


def timing_warning_lines(warnings: list[dict]) -> list[str]:
    """Markdown lines of :func:`bench.timing_warnings`'s warnings (none: no lines)."""
    return [f"> **Warning:** {w['message']}\n" for w in warnings]


def write_report(res: EvalResult, out_dir: os.PathLike | str, elapsed_s: float | None = None) -> list[Path]:
    """Write report.md, results.json and the plots into ``out_dir``; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if elapsed_s is not None:
        res.elapsed_s = elapsed_s
    written = []
    plots = _plots(res, out)
    written += plots

    j = out / "results.json"
    write_bytes(j, json.dumps(res.as_dict(), indent=1).encode())
    written.append(j)

    md = out / "report.md"
    write_bytes(md, _markdown(res, [p.name for p in plots], res.elapsed_s).encode())
    written.append(md)
    return written


def _markdown(res: EvalResult, plots: list[str], elapsed_s: float | None) -> str:
    o = res.options
    L = []
    L.append(f"# RidgeFill quality report: {Path(res.model).name}\n")
    L.append(f"- model: `{Path(res.model).name}` ({res.architecture}, {res.n_layer} layers)")
    L.append(f"- maps: " + ", ".join(f"`{Path(m).name}` (S = {s})" for m, s in zip(res.maps, res.splits)))
    compared = getattr(res, "compared_maps", None) or {}
    if compared:
        L.append("- compared maps (the first file's split; paired against it): "
                 + ", ".join(f"`{Path(m).name}` as \"{v}\"" for v, m in compared.items()))
    L.append(f"- settings: T = {o['tail']}, selector {o['selector']} at {o['exact_fraction']:g} of the prefix, "
             f"value rescale c = {o['value_rescale']}; prompts of {', '.join(str(n) for n in o['lengths'])} tokens; "
             + (f"{o['n_docs']} documents per length; 95 % percentile-bootstrap CIs over documents ({o['n_boot']} resamples)"
                if o['n_docs'] else "retrieval only (no documents)"))
    L.append("- texts (disjoint from the calibration text of `fit`): " + "; ".join(res.sources))
    if elapsed_s is not None:
        L.append(f"- run time: {elapsed_s / 60:.1f} min")
    L.append(f"- measured: {measured_text(res.measured)}")
    L.append("")
    L.append("ΔNLL = NLL with fill − NLL of exact prefill on the same tokens (nats; the tail rows' next-token "
             "losses), token-weighted mean over documents. Novel: the token's 8-token run does not occur earlier "
             "in the prompt. Key: exact loss rises by more than 2 nats when the context is cut to the last K tokens "
             "(one cut run per document: the first tail row sees K tokens, the last K + T − 1). "
             "Speed: median exact prefill time / median prefill time of the variant, same context, same runs; "
             "a speed above the variant's ceiling 1/r is noise (another load on the machine) and is flagged.\n")
    for n in sorted(set(res.summary) | set(res.retrieval), key=int):
        L.append(f"## {n}-token prompts\n")
        if n in res.summary:
            L += _nll_sections(res, n)
        if n in res.retrieval:
            L += _retrieval_section(res.retrieval[n])
    for p in plots:
        L.append(f"![{p}]({p})\n")
    return "\n".join(L) + "\n"


def _nll_sections(res: EvalResult, n: str) -> list[str]:
    """The ΔNLL, lever and splice tables of one prompt length."""
    L = []
    s = res.summary[n]
    L.append(f"Key-token cut: K = {res.key_cut[n]['k']} ({res.key_cut[n]['note']})\n")
    nd = len(res.docs[n]["exact"])
    nov = sum(r["n_novel"] for r in res.docs[n]["exact"])
    key = sum(r["n_key"] for r in res.docs[n]["exact"])
    tok = sum(len(r["nll_exact"]) for r in res.docs[n]["exact"])
    kinds = {}
    for r in res.docs[n]["exact"]:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    L.append(f"n = {nd} documents ({', '.join(f'{v} {k}' for k, v in kinds.items())}); {tok} scored tokens, "
             f"{nov} novel, {key} key.\n")
    L.append("| variant | ΔNLL novel | ΔNLL key | ΔNLL all | perplexity ratio (all) | speed vs exact | ceiling 1/r |")
    L.append("|---|---|---|---|---|---|---|")
    for v, row in s.items():
        plan = res.plans[n].get(v, res.plans[n].get("ridge" if v.startswith("ridge,") else v, {}))
        L.append(f"| {v} | {ci_text(row.get('novel') and row['novel']['delta'])} | "
                 f"{ci_text(row.get('key') and row['key']['delta'])} | {ci_text(row.get('all') and row['all']['delta'])} | "
                 f"{ci_text(row.get('all') and row['all']['ppl_ratio'], '{:.4f}')} | {res.ttft_ratio(int(n), v):.2f}x | "
                 f"{plan.get('ceiling', float('nan')):.2f}x |")
    L.append("")
    L += timing_warning_lines([w for w in res.timing_warnings() if str(w["n_prompt"]) == n])
    paired = (getattr(res, "paired", None) or {}).get(n) or {}
    if paired:
        L.append("**Levers** (each lever's ΔNLL minus the plain ridge fill's on the same documents and tokens, "
                 "paired by document; below 0: the lever helps; 95 % bootstrap CI over documents):\n")
        L.append("| lever | novel | key | all | speed vs exact | ceiling 1/r |")
        L.append("|---|---|---|---|---|---|")
        for v, row in paired.items():
            plan = res.plans[n].get(v, {})
            L.append(f"| {v} | " + " | ".join(ci_text(row.get(m)) for m in ("novel", "key", "all")) +
                     f" | {res.ttft_ratio(int(n), v):.2f}x | {plan.get('ceiling', float('nan')):.2f}x |")
        L.append("")
    if n in res.splice:
        L.append("**Splice test** (share of the ridge fill's ΔNLL removed when the filled rows' late-layer K, or V, "
                 "is replaced by the exact one; the exact prefill fills the same cells first; hybrids: \"state\" "
                 "starts every late recurrent layer's tail from the exact prefix's state):\n")
        L.append("(\"undefined\": in some bootstrap resample the fill's pooled ΔNLL is not above 0, so there is "
                 "nothing to apportion; the point estimate is shown when the fill's own ΔNLL CI is above 0. "
                 "\"—\": the fill's ΔNLL is not above 0 at all.)\n")
        L.append("| spliced | novel | key | all |")
        L.append("|---|---|---|---|")
        ridge = s.get("ridge", {})
        pos = {m: bool(ridge.get(m) and ridge[m]["delta"]["low"] > 0) for m in ("novel", "key", "all")}
        for name in res.splice[n]:
            sp = res.splice[n][name]
            L.append(f"| {name} | " + " | ".join(_pct(sp.get(m), pos[m]) for m in ("novel", "key", "all")) + " |")
        L.append("")
    return L


def _retrieval_section(r: dict) -> list[str]:
    """The retrieval table of one prompt length."""
    L = []
    first = next(iter(r.values()))
    depths = list(first["by_depth"])
    codes = first.get("codes", 1)
    many = (f"; {codes} codes of different names per prompt, the others spread over the rows before the asked one, and "
            "answers giving one of theirs counted as distractor answers") if codes > 1 else ""
    L.append("**Filled-region retrieval** (a 5-digit access code planted at a depth of the prefix, asked for "
             f"in the tail, 8 greedy tokens{many}; accuracy with a bootstrap CI over prompts; by depth: correct / "
             "prompts):\n")
    L.append("\"kept\": of the prompts exact prefill answers, those the condition answers too.\n")
    L.append("| condition | accuracy | kept | " + " | ".join(f"depth {d}" for d in depths) +
             (" | distractor answers |" if codes > 1 else " |"))
    L.append("|---|---|---|" + "---|" * (len(depths) + (codes > 1)))
    for cond, v in r.items():
        kept = f"{v['kept'][0]}/{v['kept'][1]}" if "kept" in v else "—"
        L.append(f"| {cond} | {_pct(v['accuracy'])} | {kept} | " +
                 " | ".join(f"{sum(v['by_depth'][d])}/{len(v['by_depth'][d])}" for d in depths) +
                 (f" | {v['distractor_answers']}/{len(v['answers'])} |" if codes > 1 else " |"))
    L.append("")
    return L


def agg_pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib  # here, not at the top: matplotlib takes long to import and only plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay out, write atomically as PNG and close a figure; return its path."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    agg_pyplot().close(fig)
    write_bytes(path, buf.getvalue())
    return path


def _plots(res: EvalResult, out: Path) -> list[Path]:
    plt = agg_pyplot()
    paths = []
    for n, s in sorted(res.summary.items(), key=lambda kv: int(kv[0])):
        variants = [v for v in s if all(s[v].get(m) for m, _ in METRICS)]
        fig, ax = plt.subplots(figsize=(7.5, 3.8))
        width = 0.8 / max(len(variants), 1)
        for i, v in enumerate(variants):
            est = [s[v][m]["delta"]["estimate"] for m, _ in METRICS]
            lo = [s[v][m]["delta"]["estimate"] - s[v][m]["delta"]["low"] for m, _ in METRICS]
            hi = [s[v][m]["delta"]["high"] - s[v][m]["delta"]["estimate"] for m, _ in METRICS]
            xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(METRICS))]
            ax.bar(xs, est, width, yerr=[lo, hi], capsize=3, label=v)
        ax.set_xticks(range(len(METRICS)), [label for _, label in METRICS])
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel("ΔNLL vs exact (nats)")
        ax.set_title(f"{Path(res.model).name}, {n}-token prompts (95 % CI over documents)")
        if variants:  # none when a metric has no tokens for every variant (e.g. no key tokens)
            ax.legend(fontsize=8)
        paths.append(save_figure(fig, out / f"delta_nll_{n}.png"))

    # levers: each one's paired ΔNLL difference against plain ridge (a forest plot), and its speed
    for n, paired in sorted((getattr(res, "paired", None) or {}).items(), key=lambda kv: int(kv[0])):
        rows = [(v, d["novel"]) for v, d in paired.items() if d.get("novel")]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(rows) + 1.6))
        ys = list(range(len(rows)))[::-1]
        est = [r["estimate"] for _, r in rows]
        ax.errorbar(est, ys, xerr=[[r["estimate"] - r["low"] for _, r in rows], [r["high"] - r["estimate"] for _, r in rows]],
                    fmt="o", capsize=4, color="tab:blue")
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(ys, [f"{v}  ({res.ttft_ratio(int(n), v):.2f}x)" for v, _ in rows], fontsize=8)
        ax.set_xlabel("novel-token ΔNLL minus plain ridge's (nats; < 0: the lever helps)")
        ax.set_title(f"levers, {n}-token prompts (paired by document, 95 % CI; speed vs exact)", fontsize=9)
        paths.append(save_figure(fig, out / f"levers_{n}.png"))

    # split sweep: ridge at each split, ΔNLL (novel) and speed
    if len(res.splits) > 1 and res.summary:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        ax2 = ax.twinx()
        for n, s in sorted(res.summary.items(), key=lambda kv: int(kv[0])):
            pts = []
            for split in res.splits:
                v = "ridge" if split == res.splits[0] else f"ridge S={split}"
                if v in s and s[v].get("novel"):
                    pts.append((split, s[v]["novel"]["delta"], res.ttft_ratio(int(n), v)))
            pts.sort()
            xs = [p[0] for p in pts]
            ax.errorbar(xs, [p[1]["estimate"] for p in pts],
                        yerr=[[p[1]["estimate"] - p[1]["low"] for p in pts], [p[1]["high"] - p[1]["estimate"] for p in pts]],
                        marker="o", capsize=3, label=f"ΔNLL novel, {n} tokens")
            ax2.plot(xs, [p[2] for p in pts], "s--", color="gray", label=f"speed, {n} tokens")
        ax.set_xlabel("split S")
        ax.set_ylabel("ΔNLL novel tokens (nats)")
        ax2.set_ylabel("speed vs exact (x)")
        ax.set_title(f"{Path(res.model).name}: choosing the split")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
        paths.append(save_figure(fig, out / "split_sweep.png"))

    # retrieval by depth
    for n, r in sorted(res.retrieval.items(), key=lambda kv: int(kv[0])):
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        for cond, v in r.items():
            depths = sorted(v["by_depth"], key=float)
            ax.plot([float(d) for d in depths], [sum(v["by_depth"][d]) / len(v["by_depth"][d]) for d in depths],
                    marker="o", label=cond)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("depth of the planted fact (fraction of the prefix)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"filled-region retrieval, {n}-token prompts")
        ax.legend(fontsize=7)
        paths.append(save_figure(fig, out / f"retrieval_{n}.png"))
    return paths
