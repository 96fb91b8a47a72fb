"""``ridgefill-gguf demo``: the default model end to end."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..core import settings
from ..core.limits import MAX_THREADS
from .app import (app, device_option, err, gpu_layers_option, out, parse_gpu_layers, with_devices)
from .show import model_table, quality_table


@app.command()
@with_devices
def demo(
    model: Optional[Path] = typer.Option(None, help="Model GGUF (default: SmolLM2-135M-Instruct Q4_1 from PyPI)."),
    fit_tokens: int = typer.Option(20_000, "--fit-tokens", min=1000, help="Calibration tokens for the demo's fit."),
    refit: bool = typer.Option(False, "--refit", help="Fit again even if the demo's map file exists and fits the model."),
    prompt: str = typer.Option("The three primary colours are", help="Prompt for the short generation run."),
    max_tokens: int = typer.Option(24, min=1, help="Tokens to generate."),
    long_tokens: int = typer.Option(3072, "--long-tokens", min=1100, help="Length of the long prompt prefilled stock and with RidgeFill."),
    threads: Optional[int] = typer.Option(None, min=1, max=MAX_THREADS, help="CPU threads (default: llama.cpp's choice)."),
    gpu_layers: Optional[str] = gpu_layers_option(),
    device: Optional[str] = device_option(),
) -> None:
    """Run the main job on the default model: the native build and the model summary, a ridge-map fit
    on the default calibration text (kept in the cache directory), a long prompt prefilled stock and
    with RidgeFill side by side (time to first token, last-token KL, greedy continuations), and a
    short generation."""
    import ridgefill_cpp
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from ..fitting import corpus
    from ..core import models
    from ..fitting.fit import FitOptions, fit_ridge_maps
    from ..core.gguf_model import read_model_info
    from ..maps.mapfile import compatibility_problems, read_map_file, write_map_file

    n_gpu_layers = parse_gpu_layers(gpu_layers)
    if model is None:
        with err.status("locating the default model (installing it from the package registry if needed)"):
            model = models.path(models.DEFAULT_MODEL)
    bi = ridgefill_cpp.build_info()
    out.rule("native build")
    out.print(f"llama.cpp {bi['llama_cpp_commit']}, patch set {bi['patchset']}, backends {', '.join(bi['backends'])}")
    out.rule("model")
    out.print(model_table(read_model_info(model)))

    out.rule("ridge maps")
    maps_path = models.cache_dir().parent / "maps" / (model.name.removesuffix(".gguf") + ".ridgefill.gguf")
    maps = None
    if maps_path.is_file() and not refit:
        try:
            maps = read_map_file(maps_path)
            if compatibility_problems(maps.meta, model):
                maps = None
        except Exception:
            maps = None
    if maps is None:
        maps_path.parent.mkdir(parents=True, exist_ok=True)
        with Progress(TextColumn("fitting: capturing hidden states"), BarColumn(), TaskProgressColumn(),
                      TimeRemainingColumn(), console=err) as bar:
            task = bar.add_task("fit", total=None)
            res = fit_ridge_maps(model, corpus.default_documents("calibration"),
                                 FitOptions(n_tokens=fit_tokens, n_threads=threads, n_gpu_layers=n_gpu_layers),
                                 source=corpus.default_source_description("calibration"),
                                 progress=lambda done, total: bar.update(task, completed=done, total=total))
        write_map_file(maps_path, res.maps, overwrite=True)
        maps = res.maps
        out.print(f"fitted on {maps.meta.calib_n_tokens} tokens in {res.timings.forward_s + res.timings.solve_s:.0f} s: {maps_path}",
                  highlight=False)
    else:
        out.print(f"reusing {maps_path} (fits the model; --refit to fit again)", highlight=False)
    out.print(quality_table(maps.meta, f"S = {maps.meta.split_layer}: held-out relative error of the predicted layer input"))

    _demo_long_prompt(model, maps_path, maps.meta.split_layer, long_tokens, threads, n_gpu_layers)

    out.rule("generation (stock prefill through the patched library)")
    t0 = time.perf_counter()
    llm = ridgefill_cpp.Llama(str(model), n_ctx=2048, n_threads=threads, n_gpu_layers=n_gpu_layers, verbose=False,
                              flash_attn=True)
    t_load = time.perf_counter() - t0
    try:
        n_prompt = len(llm.tokenize(prompt.encode()))
        t0 = time.perf_counter()
        res = llm(prompt, max_tokens=max_tokens, temperature=0.0)
        t_gen = time.perf_counter() - t0
        text = res["choices"][0]["text"]
        n_gen = res["usage"]["completion_tokens"]
        out.print(f"[bold]{prompt}[/]{text}", highlight=False)
        out.print(
            f"load {t_load:.2f} s; {n_prompt} prompt tokens + {n_gen} generated in {t_gen:.2f} s",
            highlight=False,
        )
    finally:
        llm.close()


def _demo_long_prompt(model: Path, maps_path: Path, split: int, n: int, threads: Optional[int], n_gpu_layers: int) -> None:
    """Stock prefill and RidgeFill prefill of one long prompt of evaluation text, side by side."""
    import ridgefill_cpp

    from ..quality.bench import greedy_continuation, kl_divergence, last_logits, prompt_tokens
    from ..runtime.prefill import RidgeFill

    out.rule(f"a {n}-token prompt: stock prefill and RidgeFill (S = {split}, T = {settings.TAIL}, {settings.SELECTOR} "
             f"selector {settings.EXACT_FRACTION:.0%})")
    n_gen = 16
    kw = dict(n_ctx=n + n_gen, n_batch=settings.N_BATCH, n_threads=threads, n_threads_batch=threads,
              n_gpu_layers=n_gpu_layers, verbose=False, flash_attn=True)
    llms = {"stock": ridgefill_cpp.Llama(str(model), **kw),
            "RidgeFill": ridgefill_cpp.Llama(str(model), ridgefill=RidgeFill(maps_path), **kw)}
    try:
        tokens = prompt_tokens(llms["stock"], n)
        rows = {}
        with err.status("prefilling (each variant twice, alternated; the faster run counts)"):
            for llm in llms.values():  # warm-up
                llm.eval(tokens[:32])
            for _ in range(2):
                for name, llm in llms.items():
                    llm.reset()
                    t0 = time.perf_counter()
                    llm.eval(tokens)
                    dt = time.perf_counter() - t0
                    if name not in rows or dt < rows[name]["t"]:
                        logits = last_logits(llm)
                        rows[name] = {"t": dt, "logits": logits, "stats": dict(llm.ridgefill_stats),
                                      "cont": greedy_continuation(llm, logits, n_gen)}
        t = Table()
        for col in ("prefill", "time to first token", "speedup", "ceiling 1/r", "KL to stock", "greedy continuation"):
            t.add_column(col, justify="left" if col == "greedy continuation" else "right", overflow="fold")
        ref = rows["stock"]
        for name, r in rows.items():
            st = r["stats"]
            text = llms[name].detokenize(r["cont"]).decode(errors="replace").replace("\n", "⏎")
            t.add_row(name, f"{r['t']:.2f} s", f"{ref['t'] / r['t']:.2f}x", f"{st['ceiling']:.2f}x" if st else "",
                      f"{kl_divergence(ref['logits'], r['logits']):.4f}", text)
        out.print(t)
        st = rows["RidgeFill"]["stats"]
        if st:
            out.print(f"RidgeFill: {st['n_filled']} rows filled, {st['n_exact']} selected + {st['tail']} tail rows exact; "
                      f"late layers {st['late_ms']:.0f} ms of {st['prefill_ms']:.0f} ms", highlight=False)
    finally:
        for llm in llms.values():
            llm.close()
