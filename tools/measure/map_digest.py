#!/usr/bin/env python3
"""What the map files' content digest costs: load time with and without it, per GB of maps.

    .venv/bin/python tools/measure/map_digest.py --shape 70b --out docs/map-digest

Builds a synthetic model whose width and depth are those of a real model (``--shape``: 8b is 4,096
wide with 32 layers and S = 22; 32b is 5,120 wide with 64 layers and S = 43; 70b is 8,192 wide
with 80 layers and S = 53) but whose attention and MLP are one tiny head (the maps depend only
on the width and the number of late layers), and a map file of random F16 maps for it: the same
bytes per late layer as the real model's maps. Then, alternately and ``--repeats`` times each:

- libllama's loader (``llama_ridgefill_maps_init``, resident on the CPU) on the file, and on a copy
  without the digest (as files written before digests existed);
- the loader's own figure for the digest pass (its log line, ``content digest checked in ... ms``);
- the Python reader's digest check (:func:`ridgefill_cpp.maps.mapfile.check_digests`, what ``info``,
  ``eval``, ``tune`` and ``serve`` run).

Writes ``OUT/digest-cost-<shape>.json`` and prints a markdown table. The first load of each file
reads it from disk; the medians are of warm page-cache loads, the cost of hashing, not of the disk.
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

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

SHAPES = {  # n_embd, n_layer, split: the real models' widths and depths (Llama 3 8B, Qwen2.5 32B, Llama 3 70B)
    "tiny": (256, 8, 4),
    "8b": (4096, 32, 22),
    "32b": (5120, 64, 43),
    "70b": (8192, 80, 53),
}


def build(shape: str, root: Path) -> tuple[Path, Path, Path]:
    from ridgefill_cpp.testing import tiny_models as make_tiny_models
    n_embd, n_layer, split = SHAPES[shape]
    model = make_tiny_models.make_tiny_model("llama", root / f"{shape}-model.gguf", seed=0, n_embd=n_embd,
                                             n_layer=n_layer, n_head=1, n_head_kv=1, head_dim=64, n_ff=64, dtype="f16")
    from ridgefill_cpp.testing.synthetic_maps import without_digest, write_synthetic_maps

    path = write_synthetic_maps(model, root / f"{shape}.ridgefill.gguf", split)
    return model, path, without_digest(path, root / f"{shape}-nodigest.ridgefill.gguf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON (default: print only)")
    ap.add_argument("--tmp", type=Path, default=None, help="where the model and map files go (default: a temporary folder)")
    args = ap.parse_args(argv)

    import ctypes

    import ridgefill_cpp  # first: llama_cpp then loads the patched libraries
    import llama_cpp
    from ridgefill_cpp import Llama
    from ridgefill_cpp.maps import mapfile
    from ridgefill_cpp.core.log import install as restore_log
    from ridgefill_cpp.runtime.native_maps import NativeMaps

    tmp = tempfile.TemporaryDirectory(dir=args.tmp)
    root = Path(tmp.name)
    t0 = time.perf_counter()
    model, maps, old = build(args.shape, root)
    t_build = time.perf_counter() - t0
    n_bytes = mapfile.map_tensor_bytes(maps)
    gb = n_bytes / 1e9
    llm = Llama(str(model), n_ctx=64, n_batch=64, verbose=False)
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    def load(path: Path) -> tuple[float, float | None]:
        lines.clear()
        llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
        try:
            t = time.perf_counter()
            with NativeMaps(llm._model.model, path, model_path=model) as m:
                dt = time.perf_counter() - t
                checked = m.digest_checked
        finally:
            restore_log()
        hit = next((re.search(r"content digest checked in ([0-9.]+) ms", ln) for ln in lines if "content digest" in ln), None)
        assert checked == (hit is not None), lines
        return dt, float(hit.group(1)) / 1e3 if hit else None

    load(maps), load(old)  # from disk once: the timed loads below read the page cache
    rows = {"with digest": [], "without digest": [], "digest pass (loader)": [], "Python check_digests": []}
    for _ in range(args.repeats):
        dt, dd = load(maps)
        rows["with digest"].append(dt)
        rows["digest pass (loader)"].append(dd)
        rows["without digest"].append(load(old)[0])
        t = time.perf_counter()
        assert mapfile.check_digests(maps) == "xxh64"
        rows["Python check_digests"].append(time.perf_counter() - t)
    llm.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {"shape": args.shape, "n_embd_n_layer_split": SHAPES[args.shape], "maps_bytes": n_bytes,
              "repeats": args.repeats, "seconds": rows, "median_s": med,
              "per_gb_s": {k: v / gb for k, v in med.items()},
              "load_overhead": med["with digest"] / med["without digest"] - 1.0,
              "build_s": t_build, "ridgefill_cpp": ridgefill_cpp.__version__}
    n_embd, n_layer, split = SHAPES[args.shape]
    print(f"| {args.shape}-shaped maps ({n_layer - split - 1} late layers of {n_embd}², F16) | {n_bytes / 1e9:.2f} GB |")
    print("| | median s | s per GB |\n|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {v / gb:.3f} |")
    print(f"load with digest / without: {med['with digest'] / med['without digest']:.3f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"digest-cost-{args.shape}.json").write_text(json.dumps(result, indent=2) + "\n")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
