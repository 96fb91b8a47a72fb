"""A model with sliding-window layers (Gemma 3, gpt-oss) through llama-server: RidgeFill on the
window-sized sliding-window cache (llama-server's default) against stock and against RidgeFill on
the full-size cache (``--swa-full``): memory, TTFT and planted-code retrieval.

1. Memory: four servers in turn, ``-c CTX`` and nothing else but the threads (stock, RidgeFill,
   stock ``--swa-full``, RidgeFill ``--swa-full``): llama.cpp's memory breakdown (model, context,
   compute; the log of ``-v``), RidgeFill's maps and window scratch (its statistics), and the peak
   resident memory of the process (VmHWM) after a prompt of the longest length.
2. TTFT: the RidgeFill server on each cache at once, one prompt of each length sent alternately as
   exact (``"ridgefill": false``: stock prefill on that cache) and RidgeFill, ``cache_prompt`` off;
   medians, speedups against stock on the window-sized cache, the ceiling 1/r.
3. Retrieval (``--retrieval-length`` > 0): ``ridgefill-gguf eval``'s planted-code prompts
   (``--codes 2``, 5 depths x ``--retrieval-prompts``), exact prefill and ridge fill with the
   attention selector, in the library on a window-sized cache (``swa_full=False``; the server's
   path): "kept" is of the prompts exact prefill answers, those ridge fill answers too.

    python tools/measure/serve_window.py MODEL --maps MAPS [--ctx 32768] [--lengths 8192,16384] [--repeats 3]
        [--retrieval-length 16384] [--retrieval-prompts 2] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ridgefill_cpp import Llama, RidgeFill  # noqa: E402  (the patched libraries first)
from ridgefill_cpp.core import settings  # noqa: E402
from ridgefill_cpp.fitting.fit import bos_prefix  # noqa: E402
from ridgefill_cpp.maps.mapfile import map_file_splits  # noqa: E402
from ridgefill_cpp.quality.bench import prompt_tokens  # noqa: E402
from ridgefill_cpp.quality.evaluate import (EvalOptions, Ticker, default_texts, open_context,  # noqa: E402
                                            planted_code_retrieval, text_tokenizer)
from ridgefill_cpp.server.serve import Server  # noqa: E402
from serve_smollm2 import ttft  # noqa: E402

SERVERS = {  # name -> (RidgeFill attached, more llama-server arguments)
    "stock": (False, []),
    "RidgeFill": (True, []),
    "stock, --swa-full": (False, ["--swa-full"]),
    "RidgeFill, --swa-full": (True, ["--swa-full"]),
}
BREAKDOWN = re.compile(r"memory breakdown.*\n.*- Host\s*\|\s*(\d+) =\s*(\d+) \+\s*(\d+) \+\s*(\d+)")
KV_SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory(model: Path, rf: RidgeFill, args: list[str], prompt: list[int]) -> dict:
    """Each server of :data:`SERVERS` in turn: its memory after one prompt."""
    out, logs = {}, Path(tempfile.mkdtemp(prefix="serve_window_"))
    for i, (name, (with_rf, more)) in enumerate(SERVERS.items()):
        with Server(model, rf if with_rf else None, extra_args=[*args, *more, "-v"], log_path=logs / f"{i}.log",
                    startup_timeout=300) as srv:
            _, stats = ttft(srv.url, prompt, with_rf)
            rss = peak_rss_mib(srv.process.pid)
        log, stats = srv.log(), stats or {}
        m = list(BREAKDOWN.finditer(log))[-1]  # the one printed at exit
        kv = [{"mib": float(a), "cells": int(b), "layers": int(c)} for a, b, c in KV_SIZE.findall(log)]
        out[name] = {"host_mib": int(m.group(1)), "model_mib": int(m.group(2)), "context_mib": int(m.group(3)),
                     "compute_mib": int(m.group(4)), "kv": kv, "peak_rss_mib": rss,
                     "ridgefill_maps_mib": stats.get("maps_bytes", 0) / 2**20,
                     "ridgefill_scratch_mib": stats.get("window", {}).get("scratch_bytes", 0) / 2**20,
                     "applied": bool(stats.get("applied"))}
    return out


def ttfts(model: Path, rf: RidgeFill, args: list[str], prompts: dict[int, list[int]], repeats: int) -> dict:
    """The RidgeFill server on each cache, at once: TTFT of each length, exact and RidgeFill alternated."""
    # each variant of SERVERS as a request: the server of its cache, "ridgefill" true or false
    variants = {name: ("full" if more else "window", with_rf) for name, (with_rf, more) in SERVERS.items()}
    with Server(model, rf, extra_args=args, startup_timeout=300) as win, \
            Server(model, rf, extra_args=[*args, "--swa-full"], startup_timeout=300) as full:
        srv = {"window": win, "full": full}
        for s in srv.values():
            ttft(s.url, prompts[min(prompts)][:256], False)  # warm-up
        out = {}
        for n, prompt in prompts.items():
            times: dict[str, list[float]] = {v: [] for v in variants}
            stats = {}
            for _ in range(repeats):
                for v, (cache, value) in variants.items():
                    t, st = ttft(srv[cache].url, prompt, value)
                    times[v].append(t)
                    stats[v] = st
            med = {v: statistics.median(ts) for v, ts in times.items()}
            st = stats["RidgeFill"] or {}
            out[str(n)] = {"ttft_s": times, "median_s": med,
                           "speedup": {v: med["stock"] / med[v] for v in variants},
                           "ceiling": st.get("ceiling"), "applied": {v: bool(s and s.get("applied")) for v, s in stats.items()},
                           "ridgefill_stats": st, "ridgefill_stats_full": stats["RidgeFill, --swa-full"]}
    return out


def retrieval(model: Path, maps: Path, split: int, n: int, prompts_per_depth: int, threads: int) -> dict:
    """eval's planted-code retrieval (2 codes), exact and ridge fill, on a window-sized cache."""
    options = EvalOptions(codes=2, names_per_depth=prompts_per_depth, n_threads=threads, swa_full=False)
    conditions = {"exact": None, "ridge, attention selector": options.ridgefill(maps, split)}
    tick = Ticker(len(options.depths) * prompts_per_depth * len(conditions),
                  lambda d, t, what: print(f"  retrieval {d}/{t} ({what})", file=sys.stderr, flush=True))
    llm = open_context(model, n + 16, options.n_batch, threads, conditions["ridge, attention selector"], swa_full=False)
    try:
        res = planted_code_retrieval(llm, text_tokenizer(llm), bos_prefix(llm), default_texts(), n, options,
                                     conditions, tick)
        window = dict(llm.ridgefill_stats).get("window")
    finally:
        llm.close()
    return {"length": n, "conditions": {k: {"kept": v["kept"], "correct": v["correct"]} for k, v in res.items()},
            "window": window}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--maps", type=Path, help="the map file (default: identity fill at --split)")
    ap.add_argument("--split", type=int, help="identity fill at this split (without --maps)")
    ap.add_argument("--ctx", type=int, default=32768, help="the server's -c")
    ap.add_argument("--lengths", default="8192,16384", help="prompt lengths of the TTFT runs, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-length", type=int, help="the prompt each memory server answers (default: the longest length)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--retrieval-length", type=int, default=16384, help="0: no retrieval run")
    ap.add_argument("--retrieval-prompts", type=int, default=2, help="retrieval prompts per depth")
    ap.add_argument("--min-prompt", type=int, default=settings.MIN_PROMPT, help="RidgeFill's minimum prompt (rows)")
    ap.add_argument("--extra", default="", help="more llama-server arguments, space-separated")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    rf = (RidgeFill(a.maps, min_prompt=a.min_prompt) if a.maps
          else RidgeFill.identity(split=a.split, min_prompt=a.min_prompt))
    lengths = sorted(int(x) for x in a.lengths.split(","))
    split = map_file_splits([a.maps], a.model)[0] if a.maps else a.split
    llm = Llama(str(a.model), vocab_only=True, verbose=False)
    try:
        toks = prompt_tokens(llm, max(lengths[-1], a.memory_length or 0))
    finally:
        llm.close()
    prompts = {n: toks[:n] for n in lengths}
    args = ["-c", str(a.ctx), "--threads", str(a.threads), *a.extra.split()]
    res: dict = {"model": str(a.model), "maps": str(a.maps) if a.maps else None, "split": split, "ctx": a.ctx,
                 "repeats": a.repeats, "threads": a.threads, "server_args": args}
    t0 = time.perf_counter()
    res["memory"] = memory(a.model, rf, args, toks[: a.memory_length or lengths[-1]])
    res["ttft"] = ttfts(a.model, rf, args, prompts, a.repeats)
    if a.retrieval_length > 0:
        if a.maps is None:
            ap.error("retrieval needs --maps")
        res["retrieval"] = retrieval(a.model, a.maps, split, a.retrieval_length, a.retrieval_prompts, a.threads)
    res["seconds"] = time.perf_counter() - t0

    print(f"{a.model.name}, llama-server -c {a.ctx} --threads {a.threads}, RidgeFill S = {split}")
    print(f"{'server':24} {'host MiB':>9} {'KV+ctx':>7} {'compute':>8} {'RF maps':>8} {'RF scratch':>10} {'peak RSS':>9}")
    for name, m in res["memory"].items():
        print(f"{name:24} {m['host_mib']:9d} {m['context_mib']:7d} {m['compute_mib']:8d} {m['ridgefill_maps_mib']:8.1f} "
              f"{m['ridgefill_scratch_mib']:10.1f} {m['peak_rss_mib']:9.0f}")
    for n, r in res["ttft"].items():
        print(f"TTFT at {n} rows, median of {a.repeats} (ceiling {r['ceiling'] or 0:.2f}x):")
        for v, t in r["median_s"].items():
            print(f"  {v:24} {t:8.2f} s  {r['speedup'][v]:.2f}x of stock   "
                  f"({', '.join(f'{x:.2f}' for x in r['ttft_s'][v])})")
    if "retrieval" in res:
        r = res["retrieval"]
        kept = r["conditions"]["ridge, attention selector"]["kept"]
        print(f"retrieval at {r['length']} rows, window-sized cache: exact answers {kept[1]} of "
              f"{len(r['conditions']['exact']['correct'])}, ridge fill keeps {kept[0]}/{kept[1]}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
