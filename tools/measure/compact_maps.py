#!/usr/bin/env python3
"""Compact maps on a real model (docs/compact-maps, issue #35): one fit, every storage type and rank.

Fits the default maps of MODEL once, then writes the same maps as F16, Q8_0, Q4_0, Q4_K (where
n_embd allows) and as low-rank maps I + U Vᵀ of the given ranks, and measures for each: the bytes,
the held-out relative error of every late layer (the fit's held-out windows, in the direction the
layer's norm sees) and, with ``--ttft``, RidgeFill's prefill time with each map file against F16
maps, alternated in one process (median of ``--repeats``). More variants (plain U Vᵀ, Q4_0 without
the importance matrix) are measured on the held-out rows only. ΔNLL and retrieval come from
``ridgefill-gguf eval`` on the map files it writes (the command is printed).

Usage: measure_compact_maps.py MODEL_NAME_OR_PATH [--tokens 100000] [--ranks 64,128]
           [--maps-dir DIR] [--out docs/compact-maps/NAME] [--ttft 2048,8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def variants(n_embd: int, ranks: list[int]) -> list[dict]:
    """name, dtype, form, rank, importance (bool), written (a map file for eval / ttft)."""
    out = [dict(name="f16", dtype="f16", form="full", rank=None, written=True),
           dict(name="q8_0", dtype="q8_0", form="full", rank=None, written=True),
           dict(name="q4_0", dtype="q4_0", form="full", rank=None, written=True)]
    if n_embd % 256 == 0:
        out.append(dict(name="q4_k", dtype="q4_k", form="full", rank=None, written=True))
    out.append(dict(name="q4_0-no-imatrix", dtype="q4_0", form="full", rank=None, written=False, importance=False))
    for r in ranks:
        out.append(dict(name=f"f16-r{r}", dtype="f16", form="identity_low_rank", rank=r, written=True))
    for r in ranks:
        out.append(dict(name=f"f16-plain-r{r}", dtype="f16", form="low_rank", rank=r, written=False))
        out.append(dict(name=f"q8_0-r{r}", dtype="q8_0", form="identity_low_rank", rank=r, written=False))
    return out


def ttft(model: Path, files: dict[str, Path], lengths: list[int], repeats: int, threads: int | None) -> dict:
    """RidgeFill prefill seconds per map file and length, alternated in one process: {name: {n: median}}."""
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.quality.evaluate import text_tokenizer

    llm = Llama(str(model), n_ctx=max(lengths) + 64, n_batch=512, n_ubatch=512, n_threads=threads, verbose=False)
    tokenize = text_tokenizer(llm)
    text = "\n\n".join(d.text for d in corpus.default_documents("evaluation"))
    ids = tokenize(text)
    bos = [llm.token_bos()] if llm._model.add_bos_token() else []
    rfs = {name: RidgeFill(str(p)) for name, p in files.items()}
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in files}
    try:
        for n in lengths:
            tokens = bos + ids[:n - len(bos)]
            for rep in range(repeats + 1):  # the first round warms up and is not counted
                order = list(files)[rep % len(files):] + list(files)[:rep % len(files)]
                for name in order:
                    llm.set_ridgefill(rfs[name])
                    llm.reset()
                    t0 = time.perf_counter()
                    llm.prefill(tokens, 1)
                    dt = time.perf_counter() - t0
                    if rep:
                        times[name][n].append(dt)
    finally:
        llm.close()
    return {name: {n: statistics.median(v) for n, v in per.items()} for name, per in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=None, help="calibration tokens (default: fit's)")
    ap.add_argument("--ranks", default="64,128")
    ap.add_argument("--maps-dir", type=Path, default=Path.home() / ".cache" / "ridgefill-cpp" / "derived" / "compact")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--ttft", default="", help="prompt lengths for the prefill-time comparison (empty: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    import numpy as np

    from ridgefill_cpp.maps import compact

    from ridgefill_cpp.fitting import corpus

    from ridgefill_cpp.core import models

    from ridgefill_cpp.core import settings
    from ridgefill_cpp.fitting.fit import FitOptions, compact_result, fit_ridge_maps
    from ridgefill_cpp.core.gguf_model import read_model_info
    from ridgefill_cpp.maps.mapfile import map_tensor_bytes, write_map_file

    path = models.path(args.model, install=False) if not Path(args.model).is_file() else Path(args.model)
    info = read_model_info(path)
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    args.maps_dir.mkdir(parents=True, exist_ok=True)
    stem = path.name.removesuffix(".gguf")
    t0 = time.perf_counter()
    res = fit_ridge_maps(path, corpus.default_documents("calibration"),
                         FitOptions(n_tokens=args.tokens or settings.FIT_TOKENS, n_threads=args.threads),
                         source=corpus.default_source_description("calibration"))
    fit_s = time.perf_counter() - t0
    meta = res.maps.meta
    print(f"fitted S = {meta.split_layer} in {fit_s:.0f} s", file=sys.stderr)
    rows, files = [], {}
    full_f16 = compact.map_bytes(meta.n_embd, len(meta.layers), "f16")
    for v in variants(meta.n_embd, ranks):
        base = res
        if v.get("importance") is False:
            from dataclasses import replace

            base = replace(res, maps=replace(res.maps, importance=None))
        c = compact_result(base, dtype=v["dtype"], form=v["form"], rank=v["rank"])
        file = args.maps_dir / f"{stem}.S{meta.split_layer}.{v['name']}.ridgefill.gguf"
        n_bytes = compact.map_bytes(meta.n_embd, len(meta.layers), v["dtype"], v["rank"])
        if v["written"]:
            write_map_file(file, c.maps, dtype=v["dtype"], overwrite=True)
            n_bytes = map_tensor_bytes(file)
            files[v["name"]] = file
        errs = c.maps.meta.rel_err_median
        rows.append(dict(name=v["name"], dtype=v["dtype"], form=v["form"], rank=v["rank"], bytes=n_bytes,
                         bytes_ratio=n_bytes / full_f16, rel_err=errs, rel_err_mean=float(np.mean(errs)),
                         r2=c.maps.meta.r2, file=str(file) if v["written"] else None))
        print(f"{v['name']:>18}: {n_bytes / 2**20:6.2f} MiB ({n_bytes / full_f16:.2f}x), mean held-out rel. err "
              f"{np.mean(errs):.4f}", file=sys.stderr)
    record = dict(model=str(path), model_name=info.name, n_embd=meta.n_embd, n_layer=meta.n_layer,
                  split=meta.split_layer, layers=meta.layers, calib_tokens=meta.calib_n_tokens, fit_s=fit_s,
                  identity_rel_err=meta.identity_rel_err_median, variants=rows)
    lengths = [int(n) for n in args.ttft.split(",") if n.strip()]
    if lengths:
        t = ttft(path, files, lengths, args.repeats, args.threads)
        record["ttft"] = {name: {str(n): s for n, s in per.items()} for name, per in t.items()}
        record["ttft_repeats"] = args.repeats
    md = [f"{info.name or path.name}, S = {meta.split_layer} of {meta.n_layer}, n_embd {meta.n_embd}; "
          f"{meta.calib_n_tokens:,} calibration tokens",
          "",
          "| maps | bytes | of F16 | mean held-out rel. err | " + " | ".join(f"layer {il}" for il in meta.layers) + " |"
          + "".join(f" prefill {n} vs F16 |" for n in lengths),
          "|---|---:|---:|---:|" + "---:|" * len(meta.layers) + "---:|" * len(lengths)]
    for r in rows:
        cells = [r["name"], f"{r['bytes'] / 2**20:.2f} MiB", f"{r['bytes_ratio']:.2f}x", f"{r['rel_err_mean']:.4f}",
                 *[f"{e:.3f}" for e in r["rel_err"]]]
        for n in lengths:
            tt = record.get("ttft", {}).get(r["name"], {}).get(str(n))
            cells.append(f"{tt * 1e3:.0f} ms ({record['ttft']['f16'][str(n)] / tt:.3f}x)" if tt else "-")
        md.append("| " + " | ".join(cells) + " |")
    md.append("| identity fill | 0 | 0 | " + f"{np.mean(meta.identity_rel_err_median):.4f} | "
              + " | ".join(f"{e:.3f}" for e in meta.identity_rel_err_median) + " |" + " - |" * len(lengths))
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)
    written = [files[n] for n in files]
    print("eval: ridgefill-gguf eval " + str(path) + " --maps " + str(written[0]) + "".join(
        f" --compare-maps {f}" for f in written[1:]) + " --lengths 2048 --codes 2 --no-splice --threads 2", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
