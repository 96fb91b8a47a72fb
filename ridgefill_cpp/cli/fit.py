"""``ridgefill-gguf fit``: ridge maps from llama.cpp's hidden states on calibration text."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.table import Table

from ..core import settings
from ..core.limits import MAX_THREADS
from .app import (app, check_output_file, device_option, err, fail, gpu_layers_option,
                  number_list, out, parse_gpu_layers, with_devices)
from .show import quality_table


#: the plan the state gains of ``fit`` are measured with: RidgeFill's built-in defaults
@app.command()
@with_devices
def fit(
    model: Path = typer.Argument(..., help="The model GGUF to fit maps for (never modified)."),
    calibration: Optional[list[Path]] = typer.Argument(
        None, help="Calibration text: files and/or directories (read recursively). Default: the calibration "
                   "split of the Python standard library's documentation and sources."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Map file to write (default: <model stem>.ridgefill.gguf next to the model; "
                                     "with several splits <model stem>.S{split}.ridgefill.gguf, and -o must contain {split})."),
    split: Optional[str] = typer.Option(
        None, "--split", "-s", help="Split layer S (default L - floor(L/3)); maps are fitted for layers S+1..L-1. "
                                    "Several, comma-separated (e.g. 16,20,24), are fitted from one capture pass."),
    tokens: Optional[int] = typer.Option(None, "--tokens", "-n", min=1,
                                         help=f"Calibration token budget (default {settings.FIT_TOKENS:,})."),
    ctx: Optional[str] = typer.Option(None, "--ctx", help="Rows per calibration window (each a fresh sequence; default "
                                                          f"{settings.FIT_CTX}). Several, comma-separated (e.g. 512,4096): "
                                                          "mixed-length windows, each length an equal share of the tokens."),
    objective: str = typer.Option("normalized", "--objective", help="normalized: fit RMS-normalised states (what the layer's norm sees); raw: fit the states as they are."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help=f"Storage type of the map matrices: f16, f32, or a ggml block type that mul_mat multiplies as "
                              f"stored on every backend: q8_0 (0.53x the bytes of f16), q4_0 or q4_k (0.28x; q4_k needs "
                              f"n_embd a multiple of 256), quantized by llama.cpp's quantizer weighted by the calibration "
                              f"inputs' second moments. The quality table then shows the maps as stored. Default "
                              f"{settings.FIT_DTYPE} (as good as f16 on both real models, docs/compact-maps; f16 where "
                              f"n_embd is not a multiple of 32)."),
    rank: Optional[int] = typer.Option(
        None, "--rank", min=1, help="Low-rank maps of this rank for every layer (see --rank-form), applied as two thin "
                                    "products: 2·r·n_embd values per layer instead of n_embd². With a quantized --dtype, "
                                    "a multiple of the type's block (32; 256 for q4_k)."),
    rank_share: Optional[float] = typer.Option(
        None, "--rank-share", min=0.0, max=1.0,
        help="Low-rank maps whose rank is chosen per layer: the smallest that keeps this share (e.g. 0.95) of the full "
             "map's held-out gain over the form's baseline (identity fill for --rank-form identity, the mean for plain)."),
    rank_form: str = typer.Option(
        "identity", "--rank-form", help="With --rank or --rank-share: identity (A = I + U Vᵀ, a low-rank correction of "
                                        "identity fill) or plain (A = U Vᵀ)."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads for llama.cpp."),
    gpu_layers: Optional[str] = gpu_layers_option(),
    device: Optional[str] = device_option(),
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite an existing output file."),
    state_gains: Optional[bool] = typer.Option(
        None, "--state-gains/--no-state-gains",
        help="Hybrid models (Gated DeltaNet layers, qwen35): after the maps, fit the closed-form per-head gains of "
             "the terminal-state correction (the least-squares gain from the filled to the exact recurrent state "
             "at the prefix/tail boundary, measured by llama.cpp on calibration windows with the default plan: "
             f"T = {settings.TAIL}, {settings.EXACT_FRACTION:.0%} exact rows, {settings.SELECTOR} selector) and store "
             "them in the map file, for "
             "RidgeFill(state_correction=\"gain\"). Default: on when the model has recurrent layers above the split; "
             "ignored, with a note, otherwise."),
    state_gain_windows: int = typer.Option(
        settings.FIT_STATE_GAIN_WINDOWS, "--state-gain-windows", min=1, help="At most this many calibration windows (of --ctx rows, the longest of "
                                                "several) for the state gains."),
) -> None:
    """Fit one closed-form ridge map per late layer from llama.cpp's own hidden states on calibration
    text, and write them as a GGUF side file (docs/design.md §7). For hybrid models, also the terminal-state
    gains (--state-gains). After the first windows it says how long the fit will take and the memory it
    will need."""
    run_fit(model, calibration, output=output, split=split, tokens=tokens, ctx=ctx, objective=objective, dtype=dtype,
            rank=rank, rank_share=rank_share, rank_form=rank_form, threads=threads,
            n_gpu_layers=parse_gpu_layers(gpu_layers), force=force,
            state_gains=state_gains, state_gain_windows=state_gain_windows)


def run_fit(model: Path, calibration: Optional[list[Path]], *, output: Optional[Path] = None, split: Optional[str] = None,
            tokens: Optional[int] = None, ctx: Optional[str] = None, objective: str = "normalized",
            dtype: Optional[str] = None, rank: Optional[int] = None, rank_share: Optional[float] = None,
            rank_form: str = "identity", threads: Optional[int] = None, n_gpu_layers: int = 0,
            force: bool = False, state_gains: Optional[bool] = None,
            state_gain_windows: int = settings.FIT_STATE_GAIN_WINDOWS,
            later: Optional[Callable[[float], tuple[str, float]]] = None) -> None:
    """``fit`` with its options (None: the default); also ``tune --fit``'s fit. ``later(tokens_per_s)``
    adds the work that follows the fit to the estimate: (what it is, its seconds at the capture's
    speed)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from ..fitting import corpus
    from ..fitting.fit import FitError, FitOptions, compact_result, fit_ridge_maps_for_splits
    from ..core.gguf_model import GGUFFileError, read_model_info
    from ..maps.mapfile import MapFileError, describe_form, map_tensor_bytes, write_map_file

    tokens = settings.FIT_TOKENS if tokens is None else tokens
    lengths = [settings.FIT_CTX] if ctx is None else number_list(ctx, "--ctx", int)
    if min(lengths) < 8 or len(set(lengths)) != len(lengths):
        fail(f"--ctx must be distinct window lengths of at least 8 rows, not {ctx!r}")
    ctx = max(lengths)  # the state gains' windows
    from ..maps.compact import BLOCK, DTYPES, QUANTIZED

    dtype_given = dtype is not None
    dtype = settings.FIT_DTYPE if dtype is None else dtype
    if dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if rank is not None and rank_share is not None:
        fail("give --rank or --rank-share, not both")
    if rank_form not in ("identity", "plain"):
        fail(f"--rank-form must be identity or plain, not {rank_form!r}")
    form = "full" if rank is None and rank_share is None else (
        "identity_low_rank" if rank_form == "identity" else "low_rank")
    if objective not in ("normalized", "raw"):
        fail(f"--objective must be normalized or raw, not {objective!r}")
    try:
        info = read_model_info(model)
    except GGUFFileError as e:
        fail(str(e))
    try:
        splits = [info.default_split] if split is None else [int(x) for x in split.split(",") if x.strip()]
    except ValueError:
        fail(f"--split must be a layer number or comma-separated layer numbers, not {split!r}")
    if not dtype_given and info.n_embd % BLOCK[dtype]:
        out.print(f"note: n_embd {info.n_embd} is not a multiple of {dtype}'s {BLOCK[dtype]}-element blocks: "
                  "the maps are stored as f16", highlight=False)
        dtype = "f16"
    try:  # before the capture: a type or rank the maps cannot take
        from ..maps.compact import CompactError, check_dtype

        if rank is not None and not rank < info.n_embd:
            raise CompactError(f"--rank {rank} must be below n_embd ({info.n_embd})")
        check_dtype(dtype, [info.n_embd] + ([rank] if rank else []),
                    f"the maps of {info.name or model.name} (n_embd {info.n_embd}" + (f", rank {rank})" if rank else ")"))
    except CompactError as e:
        fail(str(e))
    if len(splits) > 1 and output is not None and "{split}" not in str(output):
        fail("with several splits, --output must contain {split} (e.g. maps.S{split}.gguf)")
    template = str(output) if output is not None else maps_path_template(model, several=len(splits) > 1)
    outputs = [Path(template.replace("{split}", str(s))) for s in splits]
    for path in outputs:
        if path.resolve() == model.resolve():
            fail("the output path is the model file itself")
        check_output_file(path, force=force, map_file=True)
    # state gains per split: on for the splits with recurrent layers above them (unless --no-state-gains)
    gain_splits = [] if state_gains is False else [s for s in splits if any(il > s for il in info.recurrent_layers)]
    if state_gains and not gain_splits:
        out.print(f"note: --state-gains ignored: {info.architecture} has no recurrent (Gated DeltaNet) layer above "
                  f"the split", highlight=False)
    if gain_splits and ctx <= settings.TAIL:
        fail(f"--ctx {ctx}: the state gains need calibration windows longer than the tail ({settings.TAIL}); "
             f"use a larger --ctx or --no-state-gains")
    if calibration:
        try:
            docs = corpus.read_documents(calibration)
        except (FileNotFoundError, ValueError) as e:
            fail(str(e))
        source = "user text: " + ", ".join(str(p) for p in calibration)
        documents = lambda: docs  # noqa: E731
    else:
        docs = corpus.default_documents("calibration")
        source = corpus.default_source_description("calibration")
        documents = lambda: corpus.default_documents("calibration")  # noqa: E731
    opts = FitOptions(objective=objective, n_tokens=tokens, ctx=lengths[0] if len(lengths) == 1 else tuple(lengths),
                      n_threads=threads, n_gpu_layers=n_gpu_layers)
    with Progress(TextColumn("capturing hidden states"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.completed:>8.0f} tokens  {task.fields[rate]}"), TimeRemainingColumn(),
                  console=err, transient=False) as bar:
        task = bar.add_task("fit", total=None, rate="")
        t_start = time.perf_counter()

        def progress(done: int, total: int) -> None:
            rate = done / max(time.perf_counter() - t_start, 1e-9)
            bar.update(task, completed=done, total=total, rate=f"{rate:,.0f} tok/s")

        def estimate(est) -> None:
            bar.console.print(estimate_text(est, len(splits), later), highlight=False, soft_wrap=True)

        try:
            results = fit_ridge_maps_for_splits(model, docs, splits, opts, source=source, progress=progress,
                                                on_estimate=estimate)
        except FitError as e:
            fail(str(e))
    for res, path in zip(results, outputs):
        try:
            if form != "full" or dtype in QUANTIZED:
                res = compact_result(res, dtype=dtype, form=form, rank=rank, rank_share=rank_share)
            write_map_file(path, res.maps, dtype=dtype, overwrite=force)
        except (FitError, MapFileError) as e:
            fail(str(e))
        m, tm = res.maps.meta, res.timings
        m.dtype = dtype
        out.print(quality_table(m, f"ridge maps, S = {m.split_layer}, objective {m.objective}: held-out quality"
                                    + (f" of the maps as stored ({describe_form(m)})" if res.dtype else "")))
        out.print(f"maps: {describe_form(m)}, {map_tensor_bytes(path) / 2**20:.2f} MiB", highlight=False)
        out.print(
            f"{m.calib_n_tokens} calibration tokens ({res.n_windows} windows of {m.calib_windows}), {m.heldout_n_rows} held-out rows; "
            f"forward {tm.forward_s:.1f} s, statistics {tm.accumulate_s:.1f} s "
            f"({100 * tm.accumulate_s / max(tm.forward_s, 1e-9):.1f}% of the forward), solve {tm.solve_s:.1f} s",
            highlight=False,
        )
        out.print(f"wrote {path}", highlight=False)
        if m.split_layer in gain_splits:
            _fit_state_gains_into(model, path, documents(), tokens=tokens, ctx=ctx, max_windows=state_gain_windows,
                                  threads=threads, n_gpu_layers=n_gpu_layers)


def maps_path_template(model: Path, several: bool = True) -> str:
    """Where `fit` writes maps by default: beside the model, <stem>.ridgefill.gguf for one split and
    <stem>.S{split}.ridgefill.gguf (a template) for several."""
    stem = model.name.removesuffix(".gguf")
    return str(model.with_name(f"{stem}.S{{split}}.ridgefill.gguf" if several else f"{stem}.ridgefill.gguf"))


def estimate_text(est, n_splits: int, later: Optional[Callable[[float], tuple[str, float]]] = None) -> str:
    """The estimate ``fit`` prints after its first windows (a :class:`ridgefill_cpp.fitting.fit.FitEstimate`),
    with ``later``'s work after it; a warning beyond an hour, with what would shorten it."""
    what, later_s = later(est.tokens_per_s) if later else ("", 0.0)
    total = est.total_s + later_s
    text = (f"estimate: the fit takes about {duration(est.total_s)} (capture of {est.tokens:,} tokens at "
            f"{est.tokens_per_s:,.0f} tokens/s: {duration(est.capture_s)}; solve of {n_splits} split"
            f"{'s' if n_splits > 1 else ''}: {duration(est.solve_s)})"
            + (f", then {what}: about {duration(later_s)}, {duration(total)} in all" if later else "")
            + f"; peak memory about {est.peak_bytes / 2**30:.1f} GiB ({est.rss_bytes / 2**30:.1f} GiB resident now)")
    if total > 3600:
        short = max(10_000, int(round(est.tokens / 4, -3)))  # a quarter of the budget
        cut = est.capture_s * (1 - short / est.tokens) if est.tokens > short else 0
        advice = (f"a smaller calibration budget (--{'fit-' if later else ''}tokens {short:,} saves about "
                  f"{duration(cut)})" if cut > 0 else "")
        if later:
            advice += ((" or " if advice else "") + "a smaller grid (fewer splits in --fit; fewer --tails, --fractions, "
                       "--spans or --key-rescales; fewer --docs)")
        text += ("\n[bold yellow]warning:[/] more than an hour on this machine"
                 + (f": {advice} would shorten it" if advice else ""))
    return text


def duration(seconds: float) -> str:
    """A duration for a person: "45 s", "17 min", "1 h 52 min"."""
    s = int(round(seconds))
    if s < 90:
        return f"{s} s"
    if s < 5400:
        return f"{round(s / 60)} min"
    return f"{s // 3600} h {round(s % 3600 / 60)} min"


def _fit_state_gains_into(model: Path, path: Path, documents, *, tokens: int, ctx: int, max_windows: int,
                          threads: Optional[int], n_gpu_layers: int = 0) -> None:
    """fit --state-gains (:func:`ridgefill_cpp.fitting.state_gains.fit_state_gains_into`), with a progress bar and a table."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ..fitting.fit import FitError
    from ..fitting.state_gains import fit_state_gains_into

    with Progress(TextColumn("fitting state gains"), BarColumn(), MofNCompleteColumn(), TextColumn("prefills"),
                  TimeRemainingColumn(), console=err, transient=False) as bar:
        task = bar.add_task("gains", total=None)
        try:
            gains, plan = fit_state_gains_into(model, path, documents, n_tokens=tokens, ctx=ctx, max_windows=max_windows,
                                               n_threads=threads, n_gpu_layers=n_gpu_layers,
                                               progress=lambda done, total: bar.update(task, completed=done, total=total))
        except FitError as e:
            fail(f"state gains: {e} (the maps in {path} are written, without gains)")
    t = Table(title=f"terminal-state gains ({plan['windows']} windows of {ctx}; T = {plan['tail']}, "
                    f"{plan['exact_fraction']:.0%} exact rows, {plan['selector']} selector)")
    for col in ("layer", "heads", "min", "mean", "max"):
        t.add_column(col, justify="right")
    for il, g in sorted(gains.items()):
        t.add_row(str(il), str(g.size), f"{g.min():.4f}", f"{g.mean():.4f}", f"{g.max():.4f}")
    out.print(t)
    out.print(f"wrote the state gains into {path} (use them with RidgeFill(state_correction=\"gain\"))", highlight=False)
