#!/usr/bin/env python3
"""TTFT and VRAM of RidgeFill with the maps resident in VRAM or in pinned host memory (issue #8).

Needs a CUDA build (``CMAKE_ARGS="-DGGML_CUDA=ON" make native``) and a GPU; the exact commands are in
``tools/measure/gpu_h200_placement.sh``. For each variant - stock prefill, RidgeFill with
``placement="resident"``, RidgeFill with ``placement="host"`` - a fresh process loads the model with
every layer on the GPU, prefills prompts of each length ``--repeats`` times (a fresh sequence each
time, variants in separate processes so that one's allocations cannot hide another's) and reports:

* TTFT: the prefill of the whole prompt, up to the logits of its last row (median over repeats,
  after one warm-up run);
* VRAM: this process's GPU memory as ``nvidia-smi`` reports it after the longest prompt, which
  includes the CUDA context, weights, KV cache, compute buffers and (resident) the maps;
* where the maps live (``Llama.ridgefill_memory()``: bytes, placement, ggml buffer types).

Prints a table and writes JSON (``--json``). Speed is reported side by side as ratios to stock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("stock", "resident", "host")


def _gpu_mib(pid: int) -> float | None:
    """GPU memory of process ``pid`` in MiB (nvidia-smi), None when it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def worker(args) -> dict:
    from ridgefill_cpp import Llama, RidgeFill  # first: llama_cpp then loads the patched libraries
    import llama_cpp
    from ridgefill_cpp.quality.bench import prompt_tokens

    lengths = [int(x) for x in args.lengths.split(",")]
    rf = None
    if args.variant != "stock":
        rf = RidgeFill(args.maps, tail=args.tail, min_prompt=0, placement=args.variant)
    llm = Llama(args.model, n_ctx=max(lengths) + 16, n_batch=args.n_batch, n_ubatch=args.n_batch, n_gpu_layers=-1,
                flash_attn=True, verbose=False, ridgefill=rf)
    res = {"variant": args.variant, "ttft_s": {}, "stats": {}}
    for n in lengths:
        tokens = prompt_tokens(llm, n)
        times = []
        for rep in range(args.repeats + 1):
            llm.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
            t0 = time.perf_counter()
            llm.eval(tokens)  # returns once the last row's logits are copied to the host
            dt = time.perf_counter() - t0
            if rep > 0:  # the first run warms up
                times.append(dt)
        res["ttft_s"][str(n)] = statistics.median(times)
        if rf is not None:
            st = dict(llm.ridgefill_stats)
            st.pop("exact_positions", None)
            res["stats"][str(n)] = st
    res["vram_mib"] = _gpu_mib(os.getpid())
    res["maps"] = llm.ridgefill_memory() if rf is not None else None
    llm.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model GGUF (Gemma 3 270M Q4_K_M in the issue)")
    ap.add_argument("--maps", required=True, help="map file of `ridgefill-gguf fit` for the model")
    ap.add_argument("--lengths", default="8192,16384", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed prefills per length (after one warm-up)")
    ap.add_argument("--tail", type=int, default=64, help="T")
    ap.add_argument("--n-batch", type=int, default=2048, help="n_batch = n_ubatch")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args()

    if args.variant:
        print(json.dumps(worker(args)))
        return

    results = {}
    for v in VARIANTS:
        cmd = [sys.executable, __file__, "--model", args.model, "--maps", args.maps, "--lengths", args.lengths,
               "--repeats", str(args.repeats), "--tail", str(args.tail), "--n-batch", str(args.n_batch), "--variant", v]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{v}: worker failed\n{out.stderr[-4000:]}")
        results[v] = json.loads(out.stdout.strip().splitlines()[-1])

    lengths = args.lengths.split(",")
    print(f"{'variant':10} {'VRAM MiB':>9} {'maps':>22} " + " ".join(f"{'TTFT ' + n:>14} {'vs stock':>8}" for n in lengths))
    for v in VARIANTS:
        r = results[v]
        m = r["maps"]
        maps = f"{m['maps_bytes'] / 2**20:.1f} MiB {','.join(m['maps_buffers'])}" if m else "-"
        cells = []
        for n in lengths:
            t = r["ttft_s"][n]
            cells.append(f"{t:14.3f} {results['stock']['ttft_s'][n] / t:7.2f}x")
        vram = f"{r['vram_mib']:.0f}" if r["vram_mib"] is not None else "?"
        print(f"{v:10} {vram:>9} {maps:>22} " + " ".join(cells))
    for n in lengths:
        st = results["resident"]["stats"].get(n, {})
        if st:
            print(f"{n} tokens: S = {st['split']}, T = {st['tail']}, {st['n_exact']} exact prefix rows, "
                  f"ceiling {st['ceiling']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
