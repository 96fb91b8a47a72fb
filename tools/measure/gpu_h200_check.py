"""RidgeFill on a CUDA GPU: agreement with the float64 oracle and TTFT against stock, in one process.

Run on a machine with an NVIDIA GPU and a CUDA build of the project (``CMAKE_ARGS="-DGGML_CUDA=ON"
make native``, or the libraries of ``tools/check_cuda_build.sh`` pointed to by
``RIDGEFILL_CPP_LIB_DIR``). Every model is synthetic and made here (no download):

1. **Agreement** (tiny models of every supported architecture, every layer offloaded): RidgeFill
   prefill with ridge maps on the GPU against the oracle's ``fill_forward`` with the same exact
   rows (relative error of the last-row logits; qwen35 also its final recurrent states, and the
   terminal-state correction), stock GPU prefill against the oracle's exact forward, and host-placed
   against resident maps; then the window-sized sliding-window cache (gemma3 and gpt-oss at 1,000
   rows, window graphs over the scratch cache) against the oracle and the full-size cache.
2. **Speed** (a Qwen3.5-shaped synthetic hybrid, 12 layers, d = 768, F16): stock and RidgeFill
   prefill alternated, median TTFT, speedup and the ceiling 1/r of docs/design.md §4.

    python tools/measure/gpu_h200_check.py [--out DIR] [--lengths 2048,8192,16384] [--repeats 5]
    python tools/measure/gpu_h200_check.py --skip-agreement --speed-shape 9b-width --fit-tokens 0 --flash-attn
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

F32 = 0  # GGML_TYPE_F32
SPEED_SHAPES = {
    # 12 layers (attention every 4th), d = 768: small enough to fit maps in seconds
    "small": dict(n_ctx=32768, n_embd=768, n_layer=12, full_attention_interval=4, n_head=6, n_head_kv=2, head_dim=128,
                  n_rot=64, rope_sections=(11, 11, 10, 0), ssm_head_dim=128, ssm_n_k_heads=2, ssm_n_v_heads=6,
                  n_ff=2048, dtype="f16"),
    # Qwen3.5-9B's layer shapes (d 4096, 16/4 heads of 256 with 64 rotary dims, 16/32 delta-net heads of
    # 128, FFN 12288), 12 of its 32 layers: 2.6B parameters
    "9b-width": dict(n_ctx=32768, n_embd=4096, n_layer=12, full_attention_interval=4, n_head=16, n_head_kv=4,
                     head_dim=256, n_rot=64, rope_sections=(11, 11, 10, 0), ssm_head_dim=128, ssm_n_k_heads=16,
                     ssm_n_v_heads=32, n_ff=12288, dtype="f16"),
    # a dense llama with Llama-3-8B's layer shapes (d 4096, 32/8 heads of 128, FFN 14336), 12 layers
    "8b-width-llama": dict(arch="llama", n_ctx=32768, n_embd=4096, n_layer=12, n_head=32, n_head_kv=8, head_dim=128,
                           n_ff=14336, qkv_bias=False, rope_freq_base=500000.0, dtype="f16"),
    # the same dense llama at the small shape's width (d 768): long prompts on the CPU in seconds
    "small-llama": dict(arch="llama", n_ctx=32768, n_embd=768, n_layer=12, n_head=6, n_head_kv=2, head_dim=128,
                        n_ff=2048, qkv_bias=False, rope_freq_base=500000.0, dtype="f16"),
}


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def eval_tokens(path, n: int) -> list[int]:
    from ridgefill_cpp import Llama
    from ridgefill_cpp.fitting import corpus

    llm = Llama(str(path), vocab_only=True, verbose=False)
    text = "\n".join(d.text for _, d in zip(range(4), corpus.default_documents("evaluation")))
    ids = llm.tokenize(text.encode(), add_bos=True)[:n]
    llm.close()
    return ids


def agreement(tmp: pathlib.Path, n_gpu_layers: int) -> dict:
    import torch

    from ridgefill_cpp.testing import tiny_models as mtm
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.quality.bench import last_logits
    from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import read_map_file, write_map_file
    from ridgefill_cpp.oracle import load_oracle
    from ridgefill_cpp.oracle.fill import attention_scores, default_selector_layer, fill_forward, select_exact_rows
    from ridgefill_cpp.fitting.state_gains import add_state_gains

    out = {}
    n, tail = 200, 16
    kw = dict(n_ctx=256, n_batch=256, n_ubatch=64, verbose=False, flash_attn=False, type_k=F32, type_v=F32,
              n_gpu_layers=n_gpu_layers)
    for arch in ("llama", "qwen3", "gemma3", "qwen35"):
        r = out[arch] = {}
        try:
            # CUDA's gated_delta_net kernel takes state heads of 16, 32, 64 or 128 (the tiny default is 8)
            extra = dict(ssm_head_dim=16) if arch == "qwen35" else {}
            model = mtm.make_tiny_model(arch, tmp / f"tiny-{arch}.gguf", seed=0, **extra)
            o = load_oracle(model, dtype=torch.float64)
            S = o.n_layer // 2
            maps_path = write_map_file(tmp / f"{arch}.maps.gguf", fit_ridge_maps(
                model, corpus.default_documents("calibration"), FitOptions(n_tokens=4000, ctx=128, split=S)).maps,
                dtype="f32")
            maps = read_map_file(maps_path)
            tokens = eval_tokens(model, n)
            exact = select_exact_rows(attention_scores(o, tokens, default_selector_layer(o, S)), n - tail, 0.1)
            ref = fill_forward(o, tokens, split=S, maps=maps, tail=tail, exact_positions=exact)
            ref_exact = fill_forward(o, tokens, split=o.n_layer, tail=tail)

            stock = Llama(str(model), **kw)
            stock.eval(tokens)
            r["stock_vs_oracle"] = rel(last_logits(stock), ref_exact.last_logits.numpy())
            stock.close()
            for placement in ("resident", "host"):
                llm = Llama(str(model), ridgefill=RidgeFill(maps_path, tail=tail, selector=exact, min_prompt=0,
                                                            placement=placement), **kw)
                llm.eval(tokens)
                r[f"ridgefill_{placement}_vs_oracle"] = rel(last_logits(llm), ref.last_logits.numpy())
                r["n_filled"] = llm.ridgefill_stats["n_filled"]
                if arch == "qwen35":
                    r[f"states_{placement}_vs_oracle"] = max(
                        rel(llm.read_state(il), np.concatenate([st.conv.reshape(-1).numpy(), st.ssm.reshape(-1).numpy()]))
                        for il, st in ref.gdn_states.items())
                llm.close()
            if arch == "qwen35":
                gains = {4: np.array([0.7, 0.85, 1.1, 1.3], dtype=np.float32)}
                gpath = add_state_gains(maps_path, gains, tmp / "qwen35.gains.gguf")
                ref_g = fill_forward(o, tokens, split=S, maps=read_map_file(gpath), tail=tail, exact_positions=exact,
                                     state_gains={il: torch.from_numpy(g) for il, g in gains.items()})
                llm = Llama(str(model), ridgefill=RidgeFill(gpath, tail=tail, selector=exact, min_prompt=0,
                                                            state_correction="gain"), **kw)
                llm.eval(tokens)
                r["state_correction_vs_oracle"] = rel(last_logits(llm), ref_g.last_logits.numpy())
                llm.close()
        except Exception as e:  # report and go on with the next architecture
            r["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(arch, json.dumps(r), flush=True)
    return out


def speed_shape_model(shape: str, path: pathlib.Path, **overrides) -> tuple[pathlib.Path, dict]:
    """The synthetic model of a speed shape (seed 0) at `path`, and its tiny-model options (`overrides`
    on top of the shape's; the architecture is the shape's ``arch``, qwen35 by default)."""
    from ridgefill_cpp.testing import tiny_models as mtm

    cfg = {**SPEED_SHAPES[shape], **overrides}
    arch = cfg.pop("arch", "qwen35")
    return mtm.make_tiny_model(arch, path, seed=0, **cfg), cfg


def speed(tmp: pathlib.Path, lengths: list[int], repeats: int, n_gpu_layers: int, fit_tokens: int, shape: str,
          flash_attn: bool) -> dict:
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.quality.bench import alternated_ttft, kl_divergence, prompt_tokens, warm_up
    from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import write_map_file

    t0 = time.perf_counter()
    model, cfg = speed_shape_model(shape, tmp / f"{shape}.gguf")
    out = {"shape": shape, "config": SPEED_SHAPES[shape], "build_s": time.perf_counter() - t0, "flash_attn": flash_attn,
           "rows": []}
    if fit_tokens > 0:
        t0 = time.perf_counter()
        res = fit_ridge_maps(model, corpus.default_documents("calibration"), FitOptions(n_tokens=fit_tokens, ctx=512))
        maps = write_map_file(tmp / f"{shape}.maps.gguf", res.maps, dtype="f16")
        out.update(split=res.maps.meta.split_layer, fit_s=time.perf_counter() - t0, fill="ridge maps")
        setting = RidgeFill(maps, min_prompt=0)
    else:  # identity fill at the default split: no maps to fit (the map costs one d x d product per filled row)
        split = cfg["n_layer"] - cfg["n_layer"] // 3
        out.update(split=split, fill="identity")
        setting = RidgeFill.identity(split, min_prompt=0)
    n_ctx = max(lengths) + 16
    kw = dict(n_ctx=n_ctx, n_batch=2048, n_ubatch=512, verbose=False, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn)
    stock = Llama(str(model), **kw)
    # LLAMA_RIDGEFILL_TIMING=1: the RidgeFill context logs where each prefill's time went
    rf = Llama(str(model), ridgefill=setting, **{**kw, "verbose": bool(os.environ.get("LLAMA_RIDGEFILL_TIMING"))})
    prompt = prompt_tokens(stock, max(lengths))
    warm_up((stock, rf), prompt[:256])
    for n in lengths:
        # TTFT: each time ends with the first token's logits on the host
        times, logits = alternated_ttft({"stock": stock, "ridgefill": rf}, prompt[:n], repeats)
        st = dict(rf.ridgefill_stats)
        row = {"n": n, "stock_s": statistics.median(times["stock"]), "ridgefill_s": statistics.median(times["ridgefill"]),
               "ceiling": st.get("ceiling"), "kl": kl_divergence(logits["stock"], logits["ridgefill"]),
               "late_ms": st.get("late_ms")}
        row["speedup"] = row["stock_s"] / row["ridgefill_s"]
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    stock.close()
    rf.close()
    return out


def window_agreement(tmp: pathlib.Path, n_gpu_layers: int) -> dict:
    """The window-sized sliding-window cache (``swa_full=False``, docs/design.md §6.6) on the device: the
    tiny gemma3 and gpt-oss models at 1,000 rows, where rows leave the 256-cell cache and exact rows run
    in window graphs over the scratch cache. RidgeFill (identity fill, given exact rows: a tenth at
    random and a run of twice the window) against the oracle and against the same plan on a full-size
    cache; stock on the window-sized cache against the oracle's exact forward."""
    import torch

    from ridgefill_cpp.testing import tiny_models as mtm
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.quality.bench import last_logits
    from ridgefill_cpp.oracle import load_oracle
    from ridgefill_cpp.oracle.fill import fill_forward

    out = {}
    n, tail = 1000, 16
    kw = dict(n_ctx=1024, n_batch=64, n_ubatch=16, verbose=False, flash_attn=False, type_k=F32, type_v=F32,
              n_gpu_layers=n_gpu_layers)
    for arch in ("gemma3", "gpt-oss"):
        r = out[arch] = {}
        try:
            model = mtm.make_tiny_model(arch, tmp / f"tiny-{arch}.gguf", seed=0)
            o = load_oracle(model, dtype=torch.float64)
            S = o.n_layer // 2
            tokens = eval_tokens(model, n)
            if len(tokens) != n:
                raise ValueError(f"{len(tokens)} evaluation tokens, not {n}")
            rng = np.random.default_rng(0)
            exact = sorted(set(rng.choice(n - tail, size=(n - tail) // 10, replace=False).tolist())
                           | set(range(n // 3, n // 3 + 32)))
            ref = fill_forward(o, tokens, split=S, maps=None, tail=tail, exact_positions=exact, value_rescale=512)
            ref_exact = fill_forward(o, tokens, split=o.n_layer, tail=tail)
            logits = {}
            for swa_full in (False, True):
                llm = Llama(str(model), ridgefill=RidgeFill.identity(S, tail=tail, selector=exact, min_prompt=0),
                            swa_full=swa_full, **kw)
                llm.eval(tokens)
                logits[swa_full] = last_logits(llm)
                if not swa_full:
                    r["window"] = llm.ridgefill_stats["window"]
                llm.close()
            stock = Llama(str(model), swa_full=False, **kw)
            stock.eval(tokens)
            r["stock_window_vs_oracle"] = rel(last_logits(stock), ref_exact.last_logits.numpy())
            stock.close()
            r["ridgefill_window_vs_oracle"] = rel(logits[False], ref.last_logits.numpy())
            r["ridgefill_full_vs_oracle"] = rel(logits[True], ref.last_logits.numpy())
            r["window_vs_full"] = rel(logits[False], logits[True])
        except Exception as e:  # report and go on with the next architecture
            r["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"{arch} window-sized cache", json.dumps(r), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpu-check"))
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-gpu-layers", type=int, default=-1)
    ap.add_argument("--fit-tokens", type=int, default=20000,
                    help="calibration tokens of the speed model's maps (0: identity fill, no maps)")
    ap.add_argument("--speed-shape", choices=sorted(SPEED_SHAPES), default="small")
    ap.add_argument("--flash-attn", action="store_true", help="flash attention (F16 KV) in the speed runs")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args(argv)

    import ridgefill_cpp.core.native as N

    args.out.mkdir(parents=True, exist_ok=True)
    info = N.build_info()
    print(json.dumps(info), flush=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ridgefill-gpu-"))
    result = {"build": info}
    if not args.skip_agreement:
        result["agreement"] = agreement(tmp, args.n_gpu_layers)
        (args.out / "gpu-check.json").write_text(json.dumps(result, indent=1))
        result["window"] = window_agreement(tmp, args.n_gpu_layers)
    (args.out / "gpu-check.json").write_text(json.dumps(result, indent=1))
    if not args.skip_speed:
        try:
            result["speed"] = speed(tmp, [int(x) for x in args.lengths.split(",")], args.repeats, args.n_gpu_layers,
                                    args.fit_tokens, args.speed_shape, args.flash_attn)
        except Exception as e:
            result["speed"] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        (args.out / "gpu-check.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
