"""One model's key figures as one JSON (docs/qwen25-coder-1.5b/summary.json), gathered from the files the
measuring commands wrote: `fit` under `/usr/bin/time -v` (its printed output), `bench --json` files,
`eval`'s results.json, `eval --ruler`'s ruler.json, tools/measure/serve_smollm2.py's JSON and
llama.cpp's `llama-bench -o json`. A figure whose file is not given is absent, never estimated.

    python tools/measure/model_summary.py --model NAME [--fit fit.txt] [--bench bench-4k.json ...]
        [--eval eval-2k/results.json ...] [--ruler ruler.json] [--serve serve-4k.json]
        [--llama-bench llama-bench.json ...] -o summary.json
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
    ap.add_argument("-o", "--out", type=Path, required=True)
    a = ap.parse_args()

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
        d = json.loads(a.ruler.read_text())
        for n, summ in d["summary"].items():
            avg = summ["average"]
            names = list(avg)
            entry = {"exact": round(avg[names[0]]["score"]["estimate"], 2),
                     "samples_per_task": d["options"]["samples"]}
            for name in names[1:]:
                dd = avg[name]["delta"]
                entry[name] = [round(dd["estimate"], 2), round(dd["low"], 2), round(dd["high"], 2)]
            res[f"ruler_{int(n) // 1024}k"] = entry
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
