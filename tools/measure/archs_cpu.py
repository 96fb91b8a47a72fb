"""Stock against RidgeFill prefill on the CPU for the architectures added with issue #18, on synthetic
models with the real models' width ratios (12 layers, F16 weights, random: speed only).

Each shape keeps a real model's ratios (heads, head size, FFN or expert widths, experts used, window)
at a smaller width, so a 2-core machine runs 8K-row prompts in seconds. RidgeFill runs identity
fill (no maps: the map of ridge fill costs one d x d product per filled row and layer, which these
shapes would make look larger than on the real widths) at the default split S = L - floor(L/3) with
the default tail, exact fraction and attention selector. Stock and RidgeFill prefills alternate,
the median of ``--repeats`` is reported with the speedup and the ceiling 1/r of docs/design.md §4.

    python tools/measure/archs_cpu.py [--lengths 2048,8192] [--repeats 3] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: arch -> (what it mirrors, tiny-model overrides)
SHAPES = {
    "qwen2": ("Qwen2.5-0.5B's layers (d 896, 14/2 heads of 64, FFN 4864, Q/K/V biases)",
              dict(n_embd=896, n_layer=12, n_head=14, n_head_kv=2, head_dim=64, n_ff=4864, qkv_bias=True)),
    "mistral3": ("Ministral-3-3B's ratios at d 1024 (8/2 heads of 128 for 32/8, FFN 3x d)",
                 dict(n_embd=1024, n_layer=12, n_head=8, n_head_kv=2, head_dim=128, n_ff=3072)),
    "qwen3moe": ("Qwen3-30B-A3B's ratios at d 1024 (16/2 heads of 128: query 2x d; 32 experts, 2 used, "
                 "expert FFN 384)",
                 dict(n_embd=1024, n_layer=12, n_head=16, n_head_kv=2, head_dim=128, n_expert=32, n_expert_used=2,
                      n_ff_exp=384)),
    "gpt-oss": ("gpt-oss-20b's ratios at d 720 (16/2 heads of 64, window 128 on every other layer, sinks; "
                "16 experts, 2 used, expert FFN = d)",
                dict(n_embd=720, n_layer=12, n_head=16, n_head_kv=2, head_dim=64, sliding_window=128,
                     n_expert=16, n_expert_used=2, n_ff_exp=720)),
    "qwen35moe": ("a Qwen3.5 MoE hybrid at d 768 (Gated DeltaNet 3 of 4 layers; 6/2 heads of 128; "
                  "32 experts, 2 used, expert FFN 256, shared expert 256)",
                  dict(n_embd=768, n_layer=12, full_attention_interval=4, n_head=6, n_head_kv=2, head_dim=128,
                       n_rot=64, rope_sections=(11, 11, 10, 0), ssm_head_dim=128, ssm_n_k_heads=2, ssm_n_v_heads=6,
                       n_expert=32, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256)),
}


def bench(arch: str, tmp: pathlib.Path, lengths: list[int], repeats: int, threads: int) -> dict:
    from ridgefill_cpp.testing import tiny_models as mtm
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.quality.bench import alternated_ttft, prompt_tokens, warm_up

    what, shape = SHAPES[arch]
    n_ctx = max(lengths) + 16
    model = mtm.make_tiny_model(arch, tmp / f"{arch}.gguf", seed=0, n_ctx=max(n_ctx, 2048), dtype="f16", **shape)
    L = shape["n_layer"]
    split = L - L // 3
    kw = dict(n_ctx=n_ctx, n_batch=2048, n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    stock = Llama(str(model), **kw)
    rf = Llama(str(model), ridgefill=RidgeFill.identity(split, min_prompt=0), **kw)
    prompt = prompt_tokens(stock, max(lengths))
    out = {"arch": arch, "shape": what, "config": shape, "split": split, "rows": []}
    try:
        warm_up((stock, rf), prompt[:256])
        for n in lengths:
            times, _ = alternated_ttft({"stock": stock, "ridgefill": rf}, prompt[:n], repeats)
            st = dict(rf.ridgefill_stats)
            row = {"n": n, "stock_s": statistics.median(times["stock"]), "ridgefill_s": statistics.median(times["ridgefill"]),
                   "ceiling": st.get("ceiling"), "late_ms": st.get("late_ms"), "n_filled": st.get("n_filled")}
            row["speedup"] = row["stock_s"] / row["ridgefill_s"]
            row["of_ceiling"] = row["speedup"] / row["ceiling"] if row["ceiling"] else None
            out["rows"].append(row)
            print(json.dumps({"arch": arch, **row}), flush=True)
    finally:
        stock.close()
        rf.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", action="append", choices=sorted(SHAPES), help="(repeatable; default: all)")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="ridgefill-bench-archs-") as d:
        res = [bench(a, pathlib.Path(d), lengths, args.repeats, args.threads) for a in (args.arch or SHAPES)]
    if args.json:
        from ridgefill_cpp.core.files import write_bytes

        write_bytes(args.json, (json.dumps(res, indent=1) + "\n").encode())
    print(f"\n| model | n | stock s | RidgeFill s | speedup | ceiling 1/r | of ceiling |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in res:
        for row in r["rows"]:
            print(f"| {r['arch']} | {row['n']} | {row['stock_s']:.2f} | {row['ridgefill_s']:.2f} | {row['speedup']:.2f}x "
                  f"| {row['ceiling']:.2f}x | {row['of_ceiling']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
