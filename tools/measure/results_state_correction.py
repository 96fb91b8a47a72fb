"""Measure the terminal-state correction (RidgeFill(state_correction="gain"), issue #5) with llama.cpp.

On the tiny synthetic qwen35 (the only hybrid this project has: no real Qwen3.5 GGUF is in the
package registry) at split S: fit ridge maps and state gains as `ridgefill-gguf fit` does, then on
held-out evaluation windows of N tokens (tail T) report, per late Gated DeltaNet layer, the relative
error of the boundary state (after the last prefix row) against the exact one, without and with the
gains; the relative error of the final state; and the last-row KL to stock prefill.

    python tools/measure/results_state_correction.py [--windows 8] [--ctx 512] [--tail 64] [--json out.json]

Every figure comes from llama.cpp (the C++ path is checked against the float64 oracle by the tests).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8, help="held-out evaluation windows")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (N)")
    ap.add_argument("--tail", type=int, default=64, help="T")
    ap.add_argument("--split", type=int, default=3)
    ap.add_argument("--calib-tokens", type=int, default=40_000)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)

    from ridgefill_cpp.testing import tiny_models as mtm

    import ridgefill_cpp  # noqa: F401
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.quality.bench import kl_divergence, last_logits
    from ridgefill_cpp.fitting.capture import open_model
    from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import write_map_file
    from ridgefill_cpp.runtime.prefill import RidgeFill
    from ridgefill_cpp.fitting.state_gains import (_ssm_part, add_state_gains, boundary_states, calibration_windows,
                                           fit_state_gains, ssm_shape)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ridgefill-statecorr-"))
    model = mtm.make_tiny_model("qwen35", tmp / "tiny-qwen35.gguf", seed=0)
    S, T, N = args.split, args.tail, args.ctx
    res = fit_ridge_maps(model, corpus.default_documents("calibration"),
                         FitOptions(n_tokens=args.calib_tokens, ctx=N, split=S, n_threads=2))
    maps = write_map_file(tmp / "maps.gguf", res.maps, dtype="f32")
    calib = calibration_windows(model, corpus.default_documents("calibration"), n_tokens=args.calib_tokens, ctx=N,
                                max_windows=16)
    gains = fit_state_gains(model, maps, calib, tail=T)
    with_gains = add_state_gains(maps, gains, tmp / "maps-gains.gguf")

    # held-out windows of the evaluation split
    llm = open_model(model, n_ctx=N, n_batch=N, vocab_only=True)
    text = "\n".join(d.text for d in corpus.default_documents("evaluation"))
    ids = llm.tokenize(text.encode(), add_bos=False)
    llm.close()
    bos = [1]
    windows = [bos + ids[i * (N - 1):(i + 1) * (N - 1)] for i in range(args.windows)]
    assert all(len(w) == N for w in windows)

    # boundary states: exact (stock prefill of the prefix) and filled (before any correction)
    n_v, s_v = ssm_shape(model)
    bnd: dict[int, dict[str, list[float]]] = {}

    def on_pair(_i, exact, filled):
        for il in filled:
            d = bnd.setdefault(il, {"without": [], "with": []})
            d["without"].append(rel(filled[il], exact[il]))
            d["with"].append(rel(gains[il][:, None, None] * filled[il], exact[il]))

    layers = boundary_states(model, maps, windows, tail=T, on_pair=on_pair)

    # final states and last-row KL against stock prefill of the whole window
    final: dict[str, dict[int, list[float]]] = {"without": {}, "with": {}}
    kl: dict[str, list[float]] = {"without": [], "with": []}
    stock = open_model(model, n_ctx=N, n_batch=N, n_threads=2)
    ref = []
    for w in windows:
        stock.reset()
        stock.eval(w)
        ref.append((last_logits(stock), {il: _ssm_part(stock.read_state(il), n_v, s_v, "stock") for il in layers}))
    stock.close()
    for name, path, corr in (("without", maps, None), ("with", with_gains, "gain")):
        llm = open_model(model, n_ctx=N, n_batch=N, n_threads=2,
                         ridgefill=RidgeFill(str(path), tail=T, min_prompt=0, state_correction=corr))
        for w, (logits, states) in zip(windows, ref):
            llm.reset()
            llm.eval(w)
            kl[name].append(kl_divergence(logits, last_logits(llm)))
            for il in layers:
                final[name].setdefault(il, []).append(rel(_ssm_part(llm.read_state(il), n_v, s_v, "rf"), states[il]))
        llm.close()

    out = {
        "model": "tiny qwen35 (ridgefill_cpp/testing/tiny_qwen35.py, seed 0)", "split": S, "tail": T, "n_tokens": N,
        "windows": len(windows), "gains": {il: g.tolist() for il, g in gains.items()},
        "boundary_rel_error": bnd, "final_rel_error": final, "kl_last_row": kl,
    }
    print(f"tiny qwen35, S = {S}, N = {N}, T = {T}, {len(windows)} held-out windows; gains fitted on {len(calib)} "
          f"calibration windows")
    for il in layers:
        g = gains[il]
        print(f"layer {il}: gains {', '.join(f'{x:.3f}' for x in g)}")
        for what, d in (("boundary state", bnd[il]), ("final state", {k: final[k][il] for k in final})):
            a, b = np.mean(d["without"]), np.mean(d["with"])
            print(f"  {what:15s} relative error, mean: without {a:.4f}  with {b:.4f}  "
                  f"(lower with gains in {sum(x < y for x, y in zip(d['with'], d['without']))}/{len(d['with'])})")
    a, b = np.mean(kl["without"]), np.mean(kl["with"])
    print(f"last-row KL to stock, mean: without {a:.3e}  with {b:.3e}  "
          f"(lower with gains in {sum(x < y for x, y in zip(kl['with'], kl['without']))}/{len(kl['with'])})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
