"""One model's key figures as one JSON (docs/qwen25-coder-1.5b/summary.json), gathered from the files the
measuring commands wrote: `fit` under `/usr/bin/time -v` (its printed output), `bench --json` files,
`eval`'s results.json, `eval --ruler`'s ruler.json, tools/measure/serve_smollm2.py's JSON,
llama.cpp's `llama-bench -o json` and `tune --out`'s tune.json with a `bench --json` of the point it
chose. A figure whose file is not given is absent, never estimated.

    python tools/measure/model_summary.py --model NAME [--fit fit.txt] [--bench bench-4k.json ...]
        [--eval eval-2k/results.json ...] [--ruler ruler.json] [--serve serve-4k.json]
        [--llama-bench llama-bench.json ...] [--tune tune.json [--tune-bench bench.json]] -o summary.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def fit_figures(text: str) -> dict:
    """What `/usr/bin/time -v ridgefill-gguf fit` printed: ``seconds`` and ``peak_rss_mib`` (unrounded),
    and where fit's own summary is there, ``calibration_tokens``, ``maps_mib`` and ``maps_dtype``.
    Raises ValueError without the time figures."""
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    toks = re.search(r"^(\d+) calibration tokens", text, re.M)
    maps = re.search(r"^maps: (\S+), .*?, ([\d.]+) MiB", text, re.M)
    if not (wall and rss):
        raise ValueError("no /usr/bin/time -v figures in the fit output")
    parts = [float(x) for x in wall.group(1).split(":")]
    out = {"seconds": sum(p * 60 ** i for i, p in enumerate(reversed(parts))), "peak_rss_mib": int(rss.group(1)) / 1024}
    if toks:
        out["calibration_tokens"] = int(toks.group(1))
    if maps:
        out["maps_mib"], out["maps_dtype"] = float(maps.group(2)), maps.group(1)
    return out


def bench_figures(d: dict) -> dict:
    out = {}
    for s in d["summary"]:
        out[str(s["n_prompt"])] = {
            "ridge": round(s["speedup[ridgefill]"], 4), "ceiling": round(s["ceiling"], 4),
            "stock_s": round(s["median_s[stock]"], 2), "ridge_s": round(s["median_s[ridgefill]"], 2),
            "stock_tok_s": round(s["tokens_per_s[stock]"], 1), "repeats": d["repeats"],
            "spread_stock": round(s["spread[stock]"], 3), "spread_ridge": round(s["spread[ridgefill]"], 3),
            **({"identity": round(s["speedup[identity]"], 4)} if "speedup[identity]" in s else {}),
            **({"kl_ridge": round(s["kl[ridgefill]"], 5)} if "kl[ridgefill]" in s else {}),
        }
    return out


def llama_bench_figures(records: list[dict]) -> dict:
    """llama-bench's prompt-processing tests (``-n 0``): prompt length -> [mean tokens/s, its standard
    deviation, repetitions]."""
    return {str(r["n_prompt"]): [round(r["avg_ts"], 1), round(r["stddev_ts"], 1), len(r["samples_ts"])]
            for r in records if r.get("n_gen") == 0 and r.get("n_prompt")}


def tune_figures(tune: dict, bench: dict | None = None) -> dict:
    """The point `tune` chose (tune.json): its split and settings, its novel-token ΔNLL [estimate, low,
    high] over the tune's documents, its speedup at the tune's prompt length and the planted codes it
    kept; with ``bench`` (`bench --json` of that point), ``speedup_<n>`` and ``ceiling_<n>`` at each of
    the bench's lengths. Raises ValueError when the tune chose nothing or the bench ran another setting."""
    if tune.get("chosen") is None:
        raise ValueError("the tune chose no point (none within its budget)")
    p = tune["points"][tune["chosen"]]
    length = tune["options"]["length"]
    out = {"budget": tune["budget"], "split": p["split"], "tail": p["tail"], "exact_fraction": p["exact_fraction"],
           "selector": p["selector"], "span": p.get("span"), "novel_dnll": ci(p["novel"]),
           "docs": tune["options"]["n_docs"], f"speedup_{length}": round(p["speedup"], 4),
           f"ceiling_{length}": round(p["ceiling"], 4), "settings_searched": len(tune["points"])}
    if p.get("retrieval"):
        out["codes_kept"] = p["retrieval"]["kept"]
    if bench is not None:
        ran = {k: bench.get(k) for k in ("split", "tail", "exact_fraction")}
        selector, _, span = str(bench.get("selector")).partition("@")
        if (ran != {k: p[k] for k in ran} or selector != p["selector"]
                or (span and p.get("span") is not None and int(span) != p["span"])):
            raise ValueError(f"the bench ran S={ran['split']} T={ran['tail']} f={ran['exact_fraction']} "
                             f"{bench.get('selector')}, not the chosen point S={p['split']} T={p['tail']} "
                             f"f={p['exact_fraction']} {p['selector']}@{p.get('span')}")
        for n, b in bench_figures(bench).items():
            out[f"speedup_{n}"], out[f"ceiling_{n}"] = b["ridge"], b["ceiling"]
            out[f"stock_s_{n}"], out[f"ridge_s_{n}"], out[f"repeats_{n}"] = b["stock_s"], b["ridge_s"], b["repeats"]
    return out


def ruler_figures(d: dict, n_layer: int | None = None) -> dict:
    """`eval --ruler`'s ruler.json as ``ruler_<n>k`` per prompt length: exact prefill's average score
    over all tasks, and each other condition's paired difference from it [estimate, low, high], under
    ``ridge`` (the first map file), ``identity``, ``half`` (maps at half depth, split ⌊n_layer/2⌋) or
    its own name; ``conditions`` gives each key's condition, ``tasks`` and ``samples_per_task`` the size."""
    names: dict[str, str] = {}
    for name, c in d["conditions"].items():
        key = name
        if c["kind"] == "exact":
            key = "exact"
        elif c["kind"] == "identity" and "identity" not in names:
            key = "identity"
        elif c["kind"] == "ridge" and not c.get("compared_with"):
            if "ridge" not in names:
                key = "ridge"
            elif n_layer and c["split"] == n_layer // 2 and "half" not in names:
                key = "half"
        names[key] = name
    out = {}
    for n, summ in d["summary"].items():
        avg = summ["average"]
        entry: dict = {"exact": round(avg[names["exact"]]["score"]["estimate"], 2)}
        for key, name in names.items():
            if key != "exact":
                dd = avg[name]["delta"]
                entry[key] = [round(dd["estimate"], 2), round(dd["low"], 2), round(dd["high"], 2)]
        entry.update(conditions=names, tasks=len(d["options"]["tasks"]), samples_per_task=d["options"]["samples"])
        out[f"ruler_{int(n) // 1024}k"] = entry
    return out


def ci(d: dict) -> list[float]:
    return [round(d["estimate"], 5), round(d["low"], 5), round(d["high"], 5)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the model's name, as the summary gives it")
    ap.add_argument("--cpu", help="the CPU (default: from the first file with a 'measured' block)")
    ap.add_argument("--fit", type=Path)
    ap.add_argument("--bench", type=Path, action="append", default=[])
    ap.add_argument("--eval", type=Path, action="append", default=[])
    ap.add_argument("--ruler", type=Path)
    ap.add_argument("--serve", type=Path)
    ap.add_argument("--llama-bench", type=Path, action="append", default=[],
                    help="llama-bench -o json output; its prompt tests go beside bench's at the same lengths")
    ap.add_argument("--tune", type=Path, help="tune --out's tune.json: the point it chose")
    ap.add_argument("--tune-bench", type=Path, help="bench --json of the chosen point (its map file, which holds it)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    a = ap.parse_args()
    if a.tune_bench and not a.tune:
        ap.error("--tune-bench needs --tune")

    res: dict = {"model": a.model}
    loaded = [json.loads(p.read_text()) for p in [*a.bench, *a.eval, *([a.serve] if a.serve else [])]]
    measured = next((d["measured"] for d in loaded if d.get("measured")), None)
    if a.cpu or measured:
        res["cpu"] = a.cpu or f"{measured['cpu']}, {measured['cores']} cores, {measured['threads']} threads"
    if a.fit:
        try:
            fit = fit_figures(a.fit.read_text())
        except ValueError as e:
            raise SystemExit(f"--fit {a.fit}: {e}") from None
        res["fit"] = {**fit, "seconds": round(fit["seconds"], 1), "peak_rss_mib": round(fit["peak_rss_mib"], 1)}
    if a.bench:
        res["speedup"] = {}
        for p in a.bench:
            res["speedup"].update(bench_figures(json.loads(p.read_text())))
    if a.serve:
        s = json.loads(a.serve.read_text())
        n = str(s["n_prompt"])
        res["server"] = {n: {"ridge": round(s["speedup"], 4), "stock_s": round(s["median_s"]["exact"], 2),
                             "ridge_s": round(s["median_s"]["ridgefill"], 2), "repeats": s["repeats"],
                             "ceiling": round((s.get("ridgefill_stats") or {}).get("ceiling", float("nan")), 4)}}
        tok_s = (s.get("server_prompt_tok_s") or {}).get("exact")
        if tok_s and n in res.get("speedup", {}):
            res["speedup"][n]["stock_tok_s_llama_server"] = round(tok_s, 1)
    for p in a.llama_bench:
        for n, (tok_s, sd, reps) in llama_bench_figures(json.loads(p.read_text())).items():
            if n in res.get("speedup", {}):
                res["speedup"][n].update(stock_tok_s_llama_bench=tok_s, stock_tok_s_llama_bench_sd=sd,
                                         llama_bench_repeats=reps)
    for p in a.eval:
        d = json.loads(p.read_text())
        for n, summ in d["summary"].items():
            for metric in ("novel", "key"):
                for variant, key in (("ridge", f"{metric}_dnll"), ("identity", f"{metric}_dnll_identity")):
                    if variant in summ and summ[variant].get(metric):
                        res.setdefault(key, {})[n] = ci(summ[variant][metric]["delta"])
            res.setdefault("eval_documents", {})[n] = d["options"]["n_docs"]
        for n, r in d.get("retrieval", {}).items():
            res.setdefault("codes_kept", {})[n] = {c: r[c]["kept"] for c in ("ridge, attention selector",
                                                                             "identity, attention selector") if c in r}
    if a.ruler:
        n_layer = next((d["n_layer"] for d in loaded if d.get("n_layer")), None)
        res.update(ruler_figures(json.loads(a.ruler.read_text()), n_layer))
    if a.tune:
        try:
            res["tune"] = tune_figures(json.loads(a.tune.read_text()),
                                       json.loads(a.tune_bench.read_text()) if a.tune_bench else None)
        except ValueError as e:
            raise SystemExit(f"--tune {a.tune}: {e}") from None
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
