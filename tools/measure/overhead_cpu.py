"""Where a RidgeFill prefill's graphs and milliseconds go (``ridgefill_stats["graphs"]`` and
``["times_ms"]``), beside a stock prefill of the same prompt in the same run, on the synthetic speed
shapes of tools/measure/gpu_h200_check.py: the accounting of issue #20 (graph reuse in the early phase, few late
graphs). Identity fill at the default split, one prefill per length and variant after a warm-up;
any backend the build has (the CPU here). Stock's graphs are its ubatches, built or reused
(llama.cpp's own count, ``llama_perf_context``).

    python tools/measure/overhead_cpu.py [--shape small] [--lengths 1024,8192] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

N_BATCH, N_UBATCH = 2048, 512


def _timed_eval(llm, tokens) -> float:
    llm.reset()
    t = time.perf_counter()
    llm.eval(tokens)
    return (time.perf_counter() - t) * 1000.0


def _stock_graphs(llm, tokens) -> tuple[dict, float]:
    """A stock prefill's graphs (its ubatches: built, reused) and wall time (ms)."""
    import llama_cpp

    before = llama_cpp.llama_perf_context(llm.ctx).n_reused
    wall = _timed_eval(llm, tokens)
    reused = llama_cpp.llama_perf_context(llm.ctx).n_reused - before
    n = len(tokens)
    ubatches = sum(math.ceil(min(N_BATCH, n - i) / N_UBATCH) for i in range(0, n, N_BATCH))
    return {"built": ubatches - reused, "reused": reused}, wall


def measure(shape: str, lengths: list[int], threads: int, n_gpu_layers: int, stock_too: bool = True) -> list[dict]:
    from gpu_h200_check import SPEED_SHAPES, speed_shape_model
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.quality.bench import prompt_tokens, warm_up

    n_ctx = max(SPEED_SHAPES[shape].get("n_ctx", 0), max(lengths) + 16)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ridgefill-accounting-") as d:
        model, cfg = speed_shape_model(shape, pathlib.Path(d) / f"{shape}.gguf", n_ctx=n_ctx)
        arch = SPEED_SHAPES[shape].get("arch", "qwen35")
        L = cfg["n_layer"]
        split = L - L // 3
        kw = dict(n_ctx=max(lengths) + 16, n_batch=N_BATCH, n_ubatch=N_UBATCH, n_threads=threads,
                  n_threads_batch=threads, n_gpu_layers=n_gpu_layers, verbose=False)
        llm = Llama(str(model), ridgefill=RidgeFill.identity(split, min_prompt=0), **kw)
        stock = Llama(str(model), **kw) if stock_too else None
        try:
            prompt = prompt_tokens(llm, max(lengths))
            warm_up([m for m in (llm, stock) if m is not None], prompt[:600])
            for n in lengths:
                stock_graphs, stock_ms = _stock_graphs(stock, prompt[:n]) if stock else ({}, float("nan"))
                wall = _timed_eval(llm, prompt[:n])
                st = dict(llm.ridgefill_stats)
                tm = st["times_ms"]
                row = {"shape": shape, "arch": arch, "n": n, "n_layer": L, "split": split, "graphs": st["graphs"],
                       "late_rows": st.get("late_rows"), "times_ms": tm, "prefill_ms": wall,
                       "late_outside_compute_ms": tm["late"] - tm["compute"], "ceiling": st["ceiling"],
                       "stock": {"graphs": stock_graphs, "prefill_ms": stock_ms}}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            llm.close()
            if stock:
                stock.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    from gpu_h200_check import SPEED_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=sorted(SPEED_SHAPES), help="(repeatable; default: small)")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--no-stock", action="store_true", help="RidgeFill only (no stock prefill beside it)")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = [r for s in (args.shape or ["small"])
            for r in measure(s, lengths, args.threads, args.n_gpu_layers, stock_too=not args.no_stock)]
    if args.json:
        from ridgefill_cpp.core.files import write_bytes

        write_bytes(args.json, (json.dumps(rows, indent=1) + "\n").encode())
    print("\n| shape | rows | stock graphs | stock ms | early graphs | late graphs | early ms | late ms | late: build "
          "| alloc | set_input | compute | wait | other | RidgeFill ms | speedup | ceiling |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g, t, sg = r["graphs"], r["times_ms"], r["stock"]["graphs"]
        stock = f"{sg['built']} (+{sg['reused']} reused)" if sg else "-"
        print(f"| {r['shape']} | {r['n']} | {stock} | {r['stock']['prefill_ms']:.1f} "
              f"| {g['early_built']} (+{g['early_reused']} reused) | {g['late_built']} (+{g['late_reused']}) "
              f"| {t['early']:.1f} | {t['late']:.1f} | {t['build']:.1f} | {t['alloc']:.1f} | {t['set_input']:.1f} "
              f"| {t['compute']:.1f} | {t['wait']:.1f} | {t['other']:.1f} | {r['prefill_ms']:.1f} "
              f"| {r['stock']['prefill_ms'] / r['prefill_ms']:.2f}x | {r['ceiling']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
