"""Where a RidgeFill prefill's graphs and milliseconds go (``ridgefill_stats["graphs"]`` and
``["times_ms"]``), on the synthetic speed shapes of tools/gpu_check.py: the baseline that issue #20's
graph reuse and fewer, larger late graphs are measured against. Identity fill at the default split,
one prefill per length after a warm-up; any backend the build has (the CPU here).

    python tools/plan_accounting.py [--shape small] [--lengths 1024,8192] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def measure(shape: str, lengths: list[int], threads: int, n_gpu_layers: int) -> list[dict]:
    from gpu_check import SPEED_SHAPES, speed_shape_model
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.bench import prompt_tokens, warm_up

    n_ctx = max(SPEED_SHAPES[shape].get("n_ctx", 0), max(lengths) + 16)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ridgefill-accounting-") as d:
        model, cfg = speed_shape_model(shape, pathlib.Path(d) / f"{shape}.gguf", n_ctx=n_ctx)
        arch = SPEED_SHAPES[shape].get("arch", "qwen35")
        L = cfg["n_layer"]
        split = L - L // 3
        llm = Llama(str(model), ridgefill=RidgeFill.identity(split, min_prompt=0), n_ctx=max(lengths) + 16,
                    n_batch=2048, n_ubatch=512, n_threads=threads, n_threads_batch=threads, n_gpu_layers=n_gpu_layers,
                    verbose=False)
        try:
            prompt = prompt_tokens(llm, max(lengths))
            warm_up([llm], prompt[:600])
            for n in lengths:
                llm.reset()
                t = time.perf_counter()
                llm.eval(prompt[:n])
                wall = (time.perf_counter() - t) * 1000.0
                st = dict(llm.ridgefill_stats)
                tm = st["times_ms"]
                row = {"shape": shape, "arch": arch, "n": n, "n_layer": L, "split": split, "graphs": st["graphs"],
                       "times_ms": tm, "prefill_ms": wall,
                       "late_outside_compute_ms": tm["late"] - tm["compute"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            llm.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    from gpu_check import SPEED_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=sorted(SPEED_SHAPES), help="(repeatable; default: small)")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = [r for s in (args.shape or ["small"]) for r in measure(s, lengths, args.threads, args.n_gpu_layers)]
    if args.json:
        from ridgefill_cpp.files import write_bytes

        write_bytes(args.json, (json.dumps(rows, indent=1) + "\n").encode())
    print("\n| shape | rows | early graphs | late graphs | early ms | late ms | late: build | alloc | set_input "
          "| compute | wait | other |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g, t = r["graphs"], r["times_ms"]
        print(f"| {r['shape']} | {r['n']} | {g['early_built']} (+{g['early_reused']} reused) | {g['late_built']} "
              f"(+{g['late_reused']}) | {t['early']:.1f} | {t['late']:.1f} | {t['build']:.1f} | {t['alloc']:.1f} "
              f"| {t['set_input']:.1f} | {t['compute']:.1f} | {t['wait']:.1f} | {t['other']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
