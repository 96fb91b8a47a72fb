#!/usr/bin/env python3
"""Fit maps on a real model with each objective and measure them on held-out *evaluation* text.

Writes a JSON record and prints a Markdown table (per late layer: median relative error of the
predicted layer input, ridge vs identity fill, on the evaluation split of the default corpus,
which shares no document with the calibration split). Used for the README's fit-quality figures.

Usage: measure_fit.py MODEL_NAME_OR_PATH [--split S] [--tokens 100000] [--eval-tokens 20000]
                      [--objective normalized --objective raw] [--out results.json] [--maps-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def measure_overhead(path, split=None, n_windows: int = 40, ctx: int = 512) -> dict:
    """Capture + statistics vs a plain forward pass over the same windows, alternated window by window."""
    import torch

    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.fitting.capture import open_model
    from ridgefill_cpp.fitting.fit import _SplitAccumulator, _WindowCapture, calibration_tokens, objective_space
    from ridgefill_cpp.core.gguf_model import read_model_info

    info = read_model_info(path)
    split = info.default_split if split is None else split
    layers = list(range(split + 1, info.n_layer))
    cap = _WindowCapture(path, [split] + layers, ctx, None)
    plain = open_model(path, n_ctx=ctx, n_batch=ctx)
    try:
        tokens = calibration_tokens(cap.llm, corpus.default_documents("calibration"), n_windows * cap.per_window)
        acc = _SplitAccumulator(split, info.n_layer, info.n_embd)
        t_plain = t_fit = 0.0
        for w in range(len(tokens) // cap.per_window):
            window = tokens[w * cap.per_window:(w + 1) * cap.per_window]
            t0 = time.perf_counter()
            plain.reset()
            plain.eval(cap.bos + window)
            t1 = time.perf_counter()
            states = cap.run(window, 4)
            acc.add(objective_space(states, True, 1e-5), heldout=False, max_heldout=0)  # what the fit does
            t2 = time.perf_counter()
            t_plain += t1 - t0
            t_fit += t2 - t1
    finally:
        cap.close()
        plain.close()
    return {"windows": len(tokens) // cap.per_window, "plain_forward_s": t_plain, "capture_and_statistics_s": t_fit,
            "overhead": t_fit / t_plain - 1.0, "torch_threads": torch.get_num_threads()}


def main(argv=None) -> int:
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.core import models
    from ridgefill_cpp.fitting.fit import FitOptions, evaluate_maps, fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import write_map_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--split", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--eval-tokens", type=int, default=20_000)
    ap.add_argument("--objective", action="append", choices=["normalized", "raw"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--maps-dir", type=Path, default=None)
    ap.add_argument("--overhead-windows", type=int, default=0,
                    help="also time capture+statistics against a plain forward over this many windows")
    args = ap.parse_args(argv)
    path = Path(args.model) if Path(args.model).exists() else models.path(args.model)
    record = {"model": str(path), "runs": []}
    if args.overhead_windows:
        record["overhead"] = oh = measure_overhead(path, args.split, args.overhead_windows)
        print(f"overhead over {oh['windows']} windows of 512 (alternated): plain forward {oh['plain_forward_s']:.1f} s, "
              f"capture + statistics {oh['capture_and_statistics_s']:.1f} s: +{100 * oh['overhead']:.1f}%")
        sys.stdout.flush()
        if not args.objective:
            args.objective = []
    for objective in (["normalized", "raw"] if args.objective is None else args.objective):
        t0 = time.perf_counter()
        res = fit_ridge_maps(path, corpus.default_documents("calibration"),
                             FitOptions(split=args.split, objective=objective, n_tokens=args.tokens),
                             source=corpus.default_source_description("calibration"))
        wall = time.perf_counter() - t0
        ev = evaluate_maps(path, res.maps, corpus.default_documents("evaluation"), n_tokens=args.eval_tokens)
        m, tm = res.maps.meta, res.timings
        run = {"objective": objective, "split": m.split_layer, "calib_tokens": m.calib_n_tokens,
               "fit_wall_s": wall, "forward_s": tm.forward_s, "accumulate_s": tm.accumulate_s,
               "solve_s": tm.solve_s, "lambdas": m.lambdas, "heldout_calib_ridge": m.rel_err_median,
               "heldout_calib_identity": m.identity_rel_err_median, "eval": ev}
        record["runs"].append(run)
        if args.maps_dir:
            args.maps_dir.mkdir(parents=True, exist_ok=True)
            write_map_file(args.maps_dir / f"{path.stem}.S{m.split_layer}.{objective}.ridgefill.gguf", res.maps, overwrite=True)
        print(f"\n## {path.name}, S = {m.split_layer}, objective {objective}: {m.calib_n_tokens} calibration tokens, "
              f"{ev['n_tokens']} evaluation tokens")
        print(f"forward {tm.forward_s:.1f} s, statistics {tm.accumulate_s:.1f} s "
              f"(+{100 * tm.accumulate_s / tm.forward_s:.1f}%), solve {tm.solve_s:.2f} s\n")
        print("| layer | λ | ridge (eval) | identity (eval) | ridge (held-out calib) |")
        print("|---:|---:|---:|---:|---:|")
        for i, il in enumerate(ev["layers"]):
            print(f"| {il} | {m.lambdas[i]:.3g} | {ev['ridge'][i]:.3f} | {ev['identity'][i]:.3f} | {m.rel_err_median[i]:.3f} |")
        sys.stdout.flush()
    if args.out:
        args.out.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
