"""``ridgefill-gguf bench``: stock and RidgeFill prefill timed side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..core import settings
from ..core.limits import MAX_THREADS
from ..core.machine import measured_text
from .app import (CLASS_NAMES, SELECTOR_NAMES, app, check_output_file, check_prefill_args, csv, device_option, err,
                  fail, given_options, gpu_layers_option, out, parse_gpu_layers, print_timing_warnings,
                  resolve_operating_point, tuned_help, with_devices)


@app.command("bench")
@with_devices
def bench(
    model: Path = typer.Argument(..., help="The model GGUF to time (never modified)."),
    maps: Optional[Path] = typer.Option(None, "--maps", "-m", help="Map file of `fit`: times RidgeFill with ridge maps (its split is used)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", "-l", help="Prompt lengths in tokens, comma-separated "
                                                                        f"(default {csv(settings.BENCH_LENGTHS)})."),
    split: Optional[int] = typer.Option(None, "--split", "-s", help="Split layer S without maps (default L - floor(L/3); with maps: the file's)."),
    tail: Optional[int] = typer.Option(None, "--tail", min=1, help=tuned_help("T: the last prompt rows, always exact", "tail")),
    exact_fraction: Optional[float] = typer.Option(None, "--exact-fraction", min=0.0, max=1.0, help=tuned_help("Share of the prefix rows the selector keeps exact", "exact_fraction")),
    selector: Optional[str] = typer.Option(None, "--selector", help=tuned_help(f"Exact-row selector: {SELECTOR_NAMES} (attention+protected: the protected rows, then attention; probe: the late-layer attention of the tail, one extra pass; protected: row classes, protected:{CLASS_NAMES} names them; @SPAN, e.g. attention@16: the SPAN rows around each top-scoring row stay exact together)", "selector")),
    value_rescale: Optional[int] = typer.Option(None, "--value-rescale", min=0, help=f"c: tail rows the value scale is measured on (0: off; default {settings.VALUE_RESCALE})."),
    key_rescale: Optional[int] = typer.Option(None, "--key-rescale", min=0, help=tuned_help("c_K: tail rows the key scale is measured on (0: off)", "key_rescale")),
    min_prompt: Optional[int] = typer.Option(None, "--min-prompt", min=0, help=f"Shorter prompts run stock prefill (time them to see the overhead of an attached RidgeFill; default {settings.MIN_PROMPT})."),
    identity: bool = typer.Option(True, "--identity/--no-identity", help="Also time identity fill at the same settings."),
    first_layers: bool = typer.Option(False, "--first-layers", help="Also time the model cut to its first S layers: the physical ceiling of skipping late layers."),
    greedy_tokens: Optional[int] = typer.Option(None, "--greedy-tokens", min=0, help=f"Greedy continuation length compared with stock's (0: none; default {settings.BENCH_GREEDY_TOKENS})."),
    repeats: Optional[int] = typer.Option(None, "--repeats", "-r", min=1, help=f"Timed prefills per variant and length (median reported; default {settings.BENCH_REPEATS})."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads (the same for every variant)."),
    gpu_layers: Optional[str] = gpu_layers_option(),
    device: Optional[str] = device_option(),
    n_batch: Optional[int] = typer.Option(None, "--n-batch", min=1, help=f"llama.cpp batch (and ubatch) size (default {settings.N_BATCH})."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write every timing and quality figure to this JSON file."),
) -> None:
    """Time prefill side by side in one process, alternated and repeated: stock against RidgeFill with
    the ridge maps (--maps) and with identity fill at the same S, T and selector. Prints per prompt
    length the median times (with how far the repeats lie apart), stock's tokens/s, the speedup, the
    ceiling 1/r of docs/design.md §4 and speedup / ceiling, then the quality of each fill against
    stock on the same prompt (last-token KL, greedy agreement). Ratios are the figure; absolute times
    on a shared machine are noise. A warning says when a figure is noise: a speedup above its
    ceiling, or a variant's repeats more than 10 % apart."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from ..quality.bench import RIDGEFILL, SINGLE_REPEAT_NOTE, STOCK, benchmark_prefill
    from ..maps.mapfile import MapFileError

    tail, exact_fraction, selector, key_rescale = resolve_operating_point(maps, tail, exact_fraction, selector, key_rescale)
    ns = check_prefill_args(model, lengths, selector)
    n_gpu_layers = parse_gpu_layers(gpu_layers)
    if json_out is not None:
        check_output_file(json_out)
    with Progress(TextColumn("timing prefill"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(), console=err) as bar:
        task = bar.add_task("bench", total=None)
        try:
            res = benchmark_prefill(model, maps=maps, split=split, tail=tail, exact_fraction=exact_fraction,
                                    selector=selector, key_rescale=key_rescale, identity=identity,
                                    first_layers=first_layers, n_threads=threads, n_gpu_layers=n_gpu_layers,
                                    progress=lambda d, t: bar.update(task, completed=d, total=t),
                                    **given_options(lengths=ns, value_rescale=value_rescale, min_prompt=min_prompt,
                                                    greedy_tokens=greedy_tokens, repeats=repeats, n_batch=n_batch))
        except (ValueError, MapFileError) as e:
            fail(str(e))
    others = [v for v in res.variants if v != STOCK]
    main = RIDGEFILL if RIDGEFILL in res.times else others[0]
    fills = list(res.kl)
    t = Table(title=f"prefill, {Path(res.model).name}: L = {res.n_layer}, S = {res.split}, T = {res.tail}, "
                    f"exact {res.exact_fraction:g} ({res.selector})"
                    + (f", key rescale c_K = {res.key_rescale}" if res.key_rescale else "") + f", median of {res.repeats}",
              caption=("(n %): how far a variant's repeats lie apart, slowest / fastest − 1" if res.repeats > 1 else None))
    t.add_column("prompt", justify="right")
    for v in res.variants:
        t.add_column(v, justify="right")
        if v == STOCK:
            t.add_column("stock tokens/s", justify="right")
    for v in others:
        t.add_column(f"speedup {v}", justify="right")
    t.add_column("ceiling 1/r", justify="right")
    t.add_column(f"{main} / ceiling", justify="right")

    def timed(v: str, n: int) -> str:
        s = res.spread(v, n)
        return f"{res.median(v, n) * 1e3:.0f} ms" + ("" if s is None else f" ({100 * s:.0f} %)")

    for n in res.lengths:
        ceiling = res.ceiling.get(n, res.compute_ceiling)
        cells = []
        for v in res.variants:
            cells.append(timed(v, n))
            if v == STOCK:
                cells.append(f"{res.tokens_per_s(n):.0f}")
        t.add_row(str(n), *cells, *[f"{res.speedup(v, n):.2f}x" for v in others], f"{ceiling:.2f}x",
                  f"{res.speedup(main, n) / ceiling:.2f}")
    out.print(t)
    print_timing_warnings(res.timing_warnings())
    if res.repeats < 2:
        out.print(SINGLE_REPEAT_NOTE, highlight=False)
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
    out.print(f"measured: {measured_text(res.measured)}", highlight=False)
    if json_out:
        from ..core.files import write_bytes

        try:
            write_bytes(json_out, json.dumps(res.as_dict(), indent=2).encode())
        except OSError as e:
            fail(f"--json {json_out}: could not write it: {e.strerror or e}")
        out.print(f"wrote {json_out}", highlight=False)
