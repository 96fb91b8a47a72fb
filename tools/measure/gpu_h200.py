#!/usr/bin/env python3
"""The GPU speed run of one device lease: stock vs RidgeFill vs the first S layers, with a per-ubatch timeline.

    python tools/measure/gpu_h200.py --out $OUT                 # on the device (tools/gpu_device.sh sets it up)
    python tools/measure/gpu_h200.py --dry-run --out /tmp/x     # on the CPU, tiny sizes: what the test suite runs

Every model is synthetic and made here, speed only (random F16 weights; a layer's matrices are
drawn once and reused by every layer, so that the random draws of a 32-layer 8B-wide model take
seconds; its file is still about 15 GB, written and loaded on the device):

- ``8b-dense-32``: Llama-3-8B's shapes at its real depth (d 4,096, 32 layers, 32/8 heads of 128,
  FFN 14,336), split S = 22 (the default split of a 32-layer model), at 4K, 16K and 32K rows;
- ``8b-dense-12``: the same layers, 12 of them, S = 8, at 4K, 16K and 32K (the earlier H200 runs'
  shape, docs/gpu-h200/);
- ``9b-hybrid-12``: Qwen3.5-9B's shapes (Gated DeltaNet every 3 of 4 layers), 12 layers, S = 8, at
  4K and 16K.

For each shape, in one process, alternated and repeated (medians):

1. **TTFT** of stock, RidgeFill (identity fill at S, T = 64, the attention selector at 10 %, span
   16) and the model cut to its first S layers (the physical ceiling of skipping the late layers),
   flash attention on, F16 KV; the speedup, the ceiling 1/r and RidgeFill's ``ridgefill_stats``
   ``graphs`` and ``times_ms``;
2. the same RidgeFill with ``LLAMA_RIDGEFILL_EARLY_GRAPHS=4`` (the fixed early extent: four early
   graphs per plan, which CUDA graphs can then reuse), and with ``LLAMA_RIDGEFILL_GRAPH_MASK=0``
   (llama.cpp's host-built KQ masks instead of masks computed in the graphs, the default on a GPU),
   each attached again to the same context and alternated with stock;
3. a **per-ubatch timeline** at the middle length: the prompt decoded one ubatch per
   ``llama_decode`` call with ``llama_synchronize`` after each, for RidgeFill (its early phase; the
   last call also runs the late phase) and for the first-S-layers model (stock's first S layers of
   the same ubatches): where the early phase costs more than stock's first S layers, which ubatches;
4. on ``8b-dense-32`` only: **map placement**, random F16 ridge maps of the real size (9 late layers
   of 4,096²) resident with their layers or in host memory (streamed): VRAM taken (free device
   memory before and after loading, through torch) and TTFT at the middle length;
5. after the first two shapes, with time left: **``fit`` on the GPU** (``--n-gpu-layers``), on ``8b-dense-12`` with
   :data:`FIT_TOKENS` calibration tokens: the capture's tokens/s against the same model's plain
   prefill of 512-row windows (``llama-bench -p 512``'s measure, on the same context settings), the
   statistics and the solve on the host, and the fit's own estimate after its first windows.

Writes ``OUT/gpu-run.json`` after every section and ``OUT/gpu-run.md`` (the tables) at the end;
``--budget-s`` skips what would start after that many seconds (a device lease is 15 minutes, the
run should take under 8). Exits 0 when something was measured.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LLAMA_8B = dict(arch="llama", n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336, qkv_bias=False,
                rope_freq_base=500000.0, dtype="f16")
QWEN35_9B = dict(arch="qwen35", n_embd=4096, full_attention_interval=4, n_head=16, n_head_kv=4, head_dim=256, n_rot=64,
                 rope_sections=(11, 11, 10, 0), ssm_head_dim=128, ssm_n_k_heads=16, ssm_n_v_heads=32, n_ff=12288,
                 dtype="f16")
#: name -> (model options, split, lengths)
SHAPES = {  # in the order of the targets: what a lease that runs out of time skips comes last
    "8b-dense-32": (dict(LLAMA_8B, n_layer=32), 22, (4096, 16384, 32768)),
    "9b-hybrid-12": (dict(QWEN35_9B, n_layer=12), 8, (4096, 16384)),
    "8b-dense-12": (dict(LLAMA_8B, n_layer=12), 8, (4096, 16384, 32768)),
}
#: the same structure at sizes the CPU runs in seconds (--dry-run)
DRY = {
    "8b-dense-32": (dict(LLAMA_8B, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_layer=8), 5, (256, 512)),
    "9b-hybrid-12": (dict(QWEN35_9B, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_rot=8, rope_sections=(2, 1, 1, 0),
                          ssm_head_dim=16, ssm_n_k_heads=2, ssm_n_v_heads=4, n_ff=128, n_layer=8), 4, (256, 512)),
    "8b-dense-12": (dict(LLAMA_8B, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_layer=6), 4, (256, 512)),
}
TAIL, FRACTION, SPAN = 64, 0.10, 16
#: the fit on the GPU (section 5): its shape, calibration tokens (n_embd + 1 training rows and a
#: held-out window at the least) and the seconds it needs of the budget to start
FIT_SHAPE, FIT_TOKENS, FIT_NEEDS_S = "8b-dense-12", 6000, 90
FIT_AFTER_SHAPES = 2  # the fit runs after the first two shapes (before 8b-dense-12, which earlier leases measured)
EARLY_STEPS = 4
#: RidgeFill attached again with these settings (read when attaching), each alternated with stock: the
#: fixed early extent (k early graphs per plan, which CUDA graphs can replay), and llama.cpp's host-built
#: KQ masks instead of masks computed in the graphs (the default where the KV cache is on the GPU)
VARIANTS = {f"ridgefill, early graphs {EARLY_STEPS}": {"LLAMA_RIDGEFILL_EARLY_GRAPHS": str(EARLY_STEPS)},
            "ridgefill, host masks": {"LLAMA_RIDGEFILL_GRAPH_MASK": "0"}}


def variant_env(variant: str | None) -> None:
    """The environment of a VARIANTS entry (None: none of their settings), for the next attach."""
    for env in VARIANTS.values():
        for key in env:
            os.environ.pop(key, None)
    os.environ.update(VARIANTS.get(variant, {}))


class ReusedWeights:
    """A stand-in for ``tiny_gguf.WeightFactory`` whose random tensors are drawn once per shape and
    reused: speed runs need the shapes, not the values."""

    def __init__(self, factory):
        self.factory = factory
        self.cache: dict = {}

    def __getattr__(self, name):
        fn = getattr(self.factory, name)
        if not callable(fn):
            return fn

        def reused(*args, **kwargs):
            key = (name, args, tuple(sorted(kwargs.items())))
            if key not in self.cache:
                self.cache[key] = fn(*args, **kwargs)
            return self.cache[key]
        return reused


def make_model(path: pathlib.Path, opts: dict, n_layer: int | None = None) -> pathlib.Path:
    """The synthetic model of `opts` (with `n_layer` layers when given: the first-S-layers model has
    the same layers as the full one), its weights reused across layers."""
    from ridgefill_cpp.testing import tiny_models as mtm
    from ridgefill_cpp.testing import tiny_gguf
    cfg = dict(opts)
    arch = cfg.pop("arch")
    if n_layer is not None:
        cfg["n_layer"] = n_layer
    real = tiny_gguf.WeightFactory
    tiny_gguf.WeightFactory = lambda seed, dtype="f32": ReusedWeights(real(seed, dtype))
    patched = []
    for mod in list(sys.modules.values()):  # the builders imported the name
        if getattr(mod, "WeightFactory", None) is real and mod is not tiny_gguf:
            mod.WeightFactory = tiny_gguf.WeightFactory
            patched.append(mod)
    try:
        return mtm.make_tiny_model(arch, path, seed=0, n_ctx=65536, **cfg)
    finally:
        tiny_gguf.WeightFactory = real
        for mod in patched:
            mod.WeightFactory = real


def free_device_bytes() -> int | None:
    """Free memory of the first CUDA device (cudaMemGetInfo through torch), None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0])
    except Exception:
        return None


def prompt(llm, n: int) -> list[int]:
    """``n`` tokens: the evaluation text, repeated when the tiny vocabulary runs out of it."""
    from ridgefill_cpp.quality.bench import prompt_tokens

    try:
        return prompt_tokens(llm, n)
    except ValueError:
        base = prompt_tokens(llm, 4096)
        return (base * (n // len(base) + 1))[:n]


def ubatch_timeline(llm, tokens: list[int], n_ubatch: int) -> tuple[list[float], list[float]]:
    """Milliseconds of each ubatch, split in two: the ``llama_decode`` call (on the host: the graph built
    or reused, its inputs set, among them the KQ mask, and its kernels launched; the device is idle
    when it starts) and the wait for the device after it (``llama_synchronize``: what the device still
    had to compute). The prompt is decoded one ubatch per call, synchronized after each (a planned
    prompt stays planned across the calls; its last call runs the late phase). On the CPU backend the
    call computes the graph and the wait is ~0."""
    import llama_cpp

    from ridgefill_cpp.core import native as N

    llm.reset()
    ctx = llm._ctx.ctx
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), -1, 0, -1)
    planned = llm.ridgefill is not None and N.llama_ridgefill_begin(ctx, 0, 0, len(tokens)) == 1
    calls, waits = [], []
    batch = llama_cpp.llama_batch_init(n_ubatch, 0, 1)
    try:
        for start in range(0, len(tokens), n_ubatch):
            chunk = tokens[start:start + n_ubatch]
            batch.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = start + i == len(tokens) - 1
            t0 = time.perf_counter()
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed in the timeline run")
            t1 = time.perf_counter()
            llama_cpp.llama_synchronize(ctx)
            calls.append((t1 - t0) * 1e3)
            waits.append((time.perf_counter() - t1) * 1e3)
    finally:
        llama_cpp.llama_batch_free(batch)
        if planned:
            N.llama_ridgefill_cancel(ctx)
        llm.reset()
    return calls, waits


def run_shape(name: str, opts: dict, split: int, lengths, tmp: pathlib.Path, args, deadline: float) -> dict:
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.quality.bench import alternated_ttft, kl_divergence, warm_up

    res: dict = {"shape": name, "options": opts, "split": split, "lengths": list(lengths), "rows": []}
    t0 = time.perf_counter()
    model = make_model(tmp / f"{name}.gguf", opts)
    first = make_model(tmp / f"{name}-first{split}.gguf", opts, n_layer=split)
    res["build_s"] = time.perf_counter() - t0
    n_ubatch = 512 if not args.dry_run else 64
    kw = dict(n_ctx=max(lengths) + 16, n_batch=2048 if not args.dry_run else 128, n_ubatch=n_ubatch, verbose=False,
              n_gpu_layers=args.n_gpu_layers, flash_attn=True)
    rf_setting = RidgeFill.identity(split, tail=TAIL, exact_fraction=FRACTION, selector="attention", span=SPAN,
                                    min_prompt=0)

    def attach(llm, variant: str | None) -> None:
        """Attach RidgeFill again with the settings of a VARIANTS entry (None: the defaults)."""
        variant_env(variant)
        llm.set_ridgefill(rf_setting)

    def plan_stats(llm) -> dict:
        st = llm.ridgefill_stats
        return {k: st.get(k) for k in ("ceiling", "n_filled", "n_exact", "graphs", "times_ms", "late_ms", "prefill_ms",
                                       "kq_mask")}

    t0 = time.perf_counter()
    variant_env(None)
    # one context per model file (the RidgeFill one is attached again for the variants' runs): an
    # 8B-wide model at 32 layers takes 15 GB of device memory per copy
    llms = {"stock": Llama(str(model), **kw), "ridgefill": Llama(str(model), ridgefill=rf_setting, **kw),
            f"first {split} layers": Llama(str(first), **kw)}
    res["load_s"] = time.perf_counter() - t0
    try:
        tokens = prompt(llms["stock"], max(lengths))
        warm_up(llms.values(), tokens[:1024])
        for n in lengths:
            if time.perf_counter() > deadline:
                res.setdefault("skipped", []).append(f"{n} rows: over the time budget")
                continue
            times, logits = alternated_ttft(llms, tokens[:n], args.repeats)
            row = {"n": n, "ridgefill": plan_stats(llms["ridgefill"])}
            # each variant: RidgeFill attached again with it, against stock in the same alternation
            for variant in VARIANTS:
                attach(llms["ridgefill"], variant)
                try:
                    t_var, _ = alternated_ttft({"stock": llms["stock"], "ridgefill": llms["ridgefill"]}, tokens[:n],
                                               args.repeats)
                    row[variant] = plan_stats(llms["ridgefill"])
                finally:
                    attach(llms["ridgefill"], None)
                times[variant], times[f"stock ({variant} runs)"] = t_var["ridgefill"], t_var["stock"]
            med = {k: statistics.median(v) for k, v in times.items()}
            row.update({"median_s": med, "times_s": times,
                        "speedup": med["stock"] / med["ridgefill"],
                        "variant_speedups": {v: med[f"stock ({v} runs)"] / med[v] for v in VARIANTS},
                        "first_layers_speedup": med["stock"] / med[f"first {split} layers"],
                        "kl_vs_stock": kl_divergence(logits["stock"], logits["ridgefill"])})
            row["ceiling"] = row["ridgefill"]["ceiling"]
            row["fraction_of_ceiling"] = row["speedup"] / row["ceiling"] if row["ceiling"] else None
            res["rows"].append(row)
            print(json.dumps({"shape": name, "n": n, "speedup": row["speedup"], "ceiling": row["ceiling"],
                              "first_layers_speedup": row["first_layers_speedup"], "median_s": med}), flush=True)
        # the per-ubatch timeline at the middle length: RidgeFill's early phase against stock's first S layers
        n = lengths[len(lengths) // 2]
        if time.perf_counter() < deadline:
            tl = {"n": n, "n_ubatch": n_ubatch, "split": split}
            for variant in ("ridgefill", *VARIANTS, f"first {split} layers", "stock"):
                llm = llms["ridgefill" if variant in VARIANTS else variant]
                if variant in VARIANTS:
                    attach(llm, variant)
                try:
                    ubatch_timeline(llm, tokens[:n], n_ubatch)  # warm
                    calls, waits = ubatch_timeline(llm, tokens[:n], n_ubatch)
                    tl[variant] = [a + b for a, b in zip(calls, waits)]
                    tl.setdefault("host_ms", {})[variant] = calls
                    tl.setdefault("device_wait_ms", {})[variant] = waits
                finally:
                    if variant in VARIANTS:
                        attach(llm, None)
            rf, fs = tl["ridgefill"], tl[f"first {split} layers"]
            tl["early_ms"] = sum(rf[:-1])
            tl["first_layers_ms"] = sum(fs[:-1])
            tl["stock_ms"] = sum(tl["stock"])
            tl["early_over_first_layers"] = tl["early_ms"] / tl["first_layers_ms"]
            tl["early_over_s_over_l_of_stock"] = tl["early_ms"] / (sum(tl["stock"][:-1]) * split / opts["n_layer"])
            tl["ubatches_over_5pct"] = [i for i, (a, b) in enumerate(zip(rf[:-1], fs[:-1])) if a > 1.05 * b]
            tl["last_ubatch_ms"] = {"ridgefill (early + late phase)": rf[-1], "first layers": fs[-1]}
            # host-bound ubatches: the call (graph, inputs, launch) took longer than the device's work after it.
            # Without the synchronization the next call's host work overlaps this one's device work, so a
            # prefill whose ubatches are host-bound runs at the host's pace, whatever the device does
            tl["host_bound_ubatches"] = {v: sum(1 for a, b in zip(tl["host_ms"][v][:-1], tl["device_wait_ms"][v][:-1]) if a > b)
                                         for v in tl["host_ms"]}
            tl["host_ms_per_ubatch"] = {v: statistics.median(c[:-1]) if len(c) > 1 else c[0] for v, c in tl["host_ms"].items()}
            res["timeline"] = tl
    finally:
        for llm in llms.values():
            llm.close()
    return res


def placement(name: str, opts: dict, split: int, n: int, tmp: pathlib.Path, args) -> dict:
    """Resident vs host-placed maps of the real size: VRAM they take and TTFT."""
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.quality.bench import alternated_ttft, warm_up

    model = tmp / f"{name}.gguf"
    from ridgefill_cpp.testing.synthetic_maps import write_synthetic_maps

    maps = write_synthetic_maps(model, tmp / f"{name}.maps.gguf", split, reuse=True)
    from ridgefill_cpp.maps.mapfile import map_tensor_bytes

    out = {"shape": name, "n": n, "maps_bytes": map_tensor_bytes(maps)}
    kw = dict(n_ctx=n + 16, n_batch=2048 if not args.dry_run else 128, n_ubatch=512 if not args.dry_run else 64,
              verbose=False, n_gpu_layers=args.n_gpu_layers, flash_attn=True)
    llms = {}
    try:
        for where in ("resident", "host"):
            before = free_device_bytes()
            llms[where] = Llama(str(model), ridgefill=RidgeFill(maps, tail=TAIL, exact_fraction=FRACTION, span=SPAN,
                                                                min_prompt=0, placement=where), **kw)
            after = free_device_bytes()
            out[f"{where}_device_bytes_taken"] = None if before is None or after is None else before - after
            out[f"{where}_buffers"] = llms[where].ridgefill_memory()["maps_buffers"]
        tokens = prompt(llms["resident"], n)
        warm_up(llms.values(), tokens[:1024])
        times, _ = alternated_ttft(llms, tokens, args.repeats)
        out["median_s"] = {k: statistics.median(v) for k, v in times.items()}
        if out.get("resident_device_bytes_taken") is not None:
            out["vram_saved_bytes"] = out["resident_device_bytes_taken"] - out["host_device_bytes_taken"]
    finally:
        for llm in llms.values():
            llm.close()
    return out


def fit_on_device(name: str, opts: dict, split: int, tmp: pathlib.Path, args) -> dict:
    """Section 5: ``fit``'s capture with ``--n-gpu-layers`` against the plain prefill of the same 512-row
    windows (median of 3, after a warm-up), the fit's timings, and its estimate after the first windows."""
    from ridgefill_cpp.fitting import capture, corpus
    from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps_for_splits

    ctx = 512
    model = make_model(tmp / f"{name}-fit.gguf", opts)
    llm = capture.open_model(model, n_ctx=ctx, n_batch=ctx, n_gpu_layers=args.n_gpu_layers)
    try:
        tokens = prompt(llm, ctx)
        llm.eval(tokens[:32])
        times = []
        for _ in range(3):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(tokens)
            times.append(time.perf_counter() - t0)
        layer_devices = sorted(set(llm.layer_devices()))
    finally:
        llm.close()
    estimates = []
    t0 = time.perf_counter()
    (res,) = fit_ridge_maps_for_splits(model, corpus.default_documents("calibration"), [split],
                                       FitOptions(n_tokens=FIT_TOKENS, ctx=ctx, n_gpu_layers=args.n_gpu_layers),
                                       on_estimate=estimates.append)
    wall = time.perf_counter() - t0
    tm, m = res.timings, res.maps.meta
    est = estimates[0] if estimates else None
    return {"shape": name, "split": split, "n_gpu_layers": args.n_gpu_layers, "layer_devices": layer_devices,
            "ctx": ctx, "tokens": m.calib_n_tokens, "windows": res.n_windows,
            "prefill_tok_s": ctx / statistics.median(times), "capture_tok_s": m.calib_n_tokens / tm.forward_s,
            "forward_s": tm.forward_s, "statistics_s": tm.accumulate_s, "solve_s": tm.solve_s, "wall_s": wall,
            "r2": m.r2, "estimate": None if est is None else {
                "seconds": est.total_s, "capture_s": est.capture_s, "solve_s": est.solve_s,
                "tokens_per_s": est.tokens_per_s, "peak_bytes": est.peak_bytes, "rss_bytes": est.rss_bytes}}


def markdown(result: dict) -> str:
    lines = [f"# GPU run ({result.get('device') or 'no device'}; {'dry run' if result['dry_run'] else 'full sizes'})", ""]
    for sh in result["shapes"]:
        if "error" in sh:
            lines += [f"**{sh['shape']}**: {sh['error']}", ""]
            continue
        s = sh["split"]
        masks = {r["ridgefill"].get("kq_mask") for r in sh["rows"]}
        lines += [f"## {sh['shape']} (S = {s} of {sh['options']['n_layer']}; RidgeFill's KQ masks: {', '.join(map(str, masks))})", "",
                  "| rows | stock | RidgeFill | speedup | ceiling | of ceiling | "
                  + " | ".join(v.replace("ridgefill, ", "") for v in VARIANTS) + f" | first {s} layers "
                  "| early / late ms | late build / alloc / set_input / compute / wait / other ms | graphs (early b/r, late b) |",
                  "|---|---|---|---|---|---|" + "---|" * len(VARIANTS) + "---|---|---|---|"]
        for r in sh["rows"]:
            m, st = r["median_s"], r["ridgefill"]
            t, g = st.get("times_ms") or {}, st.get("graphs") or {}
            lines.append(
                f"| {r['n']} | {m['stock'] * 1e3:.0f} ms | {m['ridgefill'] * 1e3:.0f} ms | {r['speedup']:.2f}x | "
                f"{r['ceiling']:.2f} | {r['fraction_of_ceiling']:.2f} | "
                + "".join(f"{r['variant_speedups'][v]:.2f}x | " for v in VARIANTS) +
                f"{r['first_layers_speedup']:.2f}x | {t.get('early', 0):.0f} / {t.get('late', 0):.0f} | "
                + " / ".join(f"{t.get(k, 0):.0f}" for k in ("build", "alloc", "set_input", "compute", "wait", "other"))
                + f" | {g.get('early_built')}/{g.get('early_reused')}, {g.get('late_built')} |")
        tl = sh.get("timeline")
        if tl:
            lines += ["", f"Timeline at {tl['n']} rows, one ubatch of {tl['n_ubatch']} per call: RidgeFill's early phase "
                      f"{tl['early_ms']:.0f} ms against {tl['first_layers_ms']:.0f} ms for stock's first {s} layers "
                      f"({tl['early_over_first_layers']:.2f}x; {tl['early_over_s_over_l_of_stock']:.2f}x of S/L of stock's "
                      f"{tl['stock_ms']:.0f} ms); ubatches more than 5 % slower: {tl['ubatches_over_5pct'] or 'none'}; "
                      f"last call {tl['last_ubatch_ms']['ridgefill (early + late phase)']:.0f} ms (early + late phase) "
                      f"against {tl['last_ubatch_ms']['first layers']:.0f} ms.", "",
                      "| variant | ms per ubatch (median) | of it on the host (call) | host-bound ubatches |", "|---|---|---|---|"]
            for v, calls in tl["host_ms"].items():
                tot = tl[v]  # call + wait of each ubatch
                lines.append(f"| {v} | {statistics.median(tot[:-1] or tot):.1f} | {tl['host_ms_per_ubatch'][v]:.1f} | "
                             f"{tl['host_bound_ubatches'][v]} of {len(calls) - 1} |")
        lines.append("")
    p = result.get("placement")
    if p and "error" not in p:
        gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
        lines += [f"## Map placement ({p['shape']}, {p['n']} rows, maps {p['maps_bytes'] / 2**30:.2f} GiB)", "",
                  "| placement | device memory taken | TTFT |", "|---|---|---|"]
        for where in ("resident", "host"):
            lines.append(f"| {where} ({', '.join(p[f'{where}_buffers'])}) | {gib(p.get(f'{where}_device_bytes_taken'))} | "
                         f"{p['median_s'][where] * 1e3:.0f} ms |")
        lines.append("")
    elif p:
        lines += [f"Map placement: {p['error']}", ""]
    f = result.get("fit")
    if f and "error" not in f:
        e = f["estimate"] or {}
        lines += [f"## fit on the device ({f['shape']}, S = {f['split']}, --n-gpu-layers {f['n_gpu_layers']}: "
                  f"{', '.join(f['layer_devices'])})", "",
                  "| tokens | capture tokens/s | plain prefill of 512 rows, tokens/s | capture / prefill | "
                  "forward / statistics / solve s | estimate after the first windows |", "|---|---|---|---|---|---|",
                  f"| {f['tokens']:,} | {f['capture_tok_s']:,.0f} | {f['prefill_tok_s']:,.0f} | "
                  f"{f['capture_tok_s'] / f['prefill_tok_s']:.2f} | {f['forward_s']:.1f} / {f['statistics_s']:.1f} / "
                  f"{f['solve_s']:.1f} | " + (f"{e['seconds']:.0f} s (wall {f['wall_s']:.0f} s)" if e else "none") + " |", ""]
    elif f:
        lines += [f"fit on the device: {f['error']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU backend: checks the script, measures nothing")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-gpu-layers", type=int, default=-1)
    ap.add_argument("--budget-s", type=float, default=420.0, help="start nothing new after this many seconds")
    ap.add_argument("--no-placement", action="store_true")
    ap.add_argument("--no-fit", action="store_true", help="skip section 5, fit on the device")
    args = ap.parse_args(argv)

    import ridgefill_cpp
    from ridgefill_cpp.core import native as N

    start = time.perf_counter()
    deadline = start + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = DRY if args.dry_run else SHAPES
    info = N.build_info()
    device = None
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        pass
    result = {"build": info, "device": device, "dry_run": args.dry_run, "ridgefill_cpp": ridgefill_cpp.__version__,
              "settings": {"tail": TAIL, "exact_fraction": FRACTION, "selector": "attention", "span": SPAN,
                           "fill": "identity", "flash_attn": True, "kv": "F16", "weights": "F16, random"},
              "shapes": []}
    print(json.dumps({"build": info.get("backends"), "device": device}), flush=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ridgefill-gpu-run-"))
    print(f"gpu-run: model files in {tmp}", flush=True)

    def save():
        result["elapsed_s"] = time.perf_counter() - start
        (args.out / "gpu-run.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    def fit_section():
        if time.perf_counter() > deadline - FIT_NEEDS_S:
            result["fit"] = {"error": "skipped: over the time budget"}
        else:
            try:
                opts, split, _ = shapes[FIT_SHAPE]
                result["fit"] = fit_on_device(FIT_SHAPE, opts, split, tmp, args)
            except Exception as e:
                traceback.print_exc()
                result["fit"] = {"error": f"{type(e).__name__}: {e}"}
            for f in tmp.glob(f"{FIT_SHAPE}-fit*"):
                f.unlink()
        save()

    names = args.shapes.split(",")
    for k, name in enumerate(names):
        if k == FIT_AFTER_SHAPES and not args.no_fit:
            fit_section()  # before the shapes the earlier leases measured already
        if time.perf_counter() > deadline:
            result["shapes"].append({"shape": name, "error": "skipped: over the time budget"})
            continue
        opts, split, lengths = shapes[name]
        try:
            result["shapes"].append(run_shape(name, opts, split, lengths, tmp, args, deadline))
        except Exception as e:
            traceback.print_exc()
            result["shapes"].append({"shape": name, "error": f"{type(e).__name__}: {e}"})
        save()
        if name == "8b-dense-32" and not args.no_placement:
            if time.perf_counter() > deadline:
                result["placement"] = {"error": "skipped: over the time budget"}
            else:
                try:
                    result["placement"] = placement(name, opts, split, lengths[len(lengths) // 2], tmp, args)
                except Exception as e:
                    traceback.print_exc()
                    result["placement"] = {"error": f"{type(e).__name__}: {e}"}
            save()
        # the shape's model and map files (up to 26 GB): the device's disk holds 64 GiB
        files = list(tmp.glob(f"{name}*"))
        size = sum(f.stat().st_size for f in files)
        for f in files:
            f.unlink()
        print(f"gpu-run: {name}: {len(files)} model files removed ({size / 1e9:.1f} GB)", flush=True)
    if len(names) <= FIT_AFTER_SHAPES and not args.no_fit:
        fit_section()
    shutil.rmtree(tmp, ignore_errors=True)
    save()
    (args.out / "gpu-run.md").write_text(markdown(result))
    print(markdown(result), flush=True)
    return 0 if any("rows" in s and s["rows"] for s in result["shapes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
