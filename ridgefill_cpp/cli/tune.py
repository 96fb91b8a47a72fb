"""``ridgefill-gguf tune``: the fastest operating point within a quality budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..core import settings
from ..core.limits import MAX_THREADS
from .app import (SELECTOR_NAMES, app, check_output_dir, csv, device_option, err, fail, gpu_layers_option,
                  given_options, number_list, out, parse_gpu_layers, print_timing_warnings, read_text_option,
                  with_devices)


@app.command("tune")
@with_devices
def tune_cmd(
    model: Path = typer.Argument(..., help="The model GGUF (never modified)."),
    maps: Optional[list[Path]] = typer.Option(None, "--maps", "-m", help="Map file of `fit`, one per split to search; repeat for several splits. The chosen one gets the tuned defaults."),
    budget: float = typer.Option(..., "--budget", "-b", help="Largest acceptable novel-token ΔNLL against exact prefill, in nats (e.g. 0.02)."),
    fit_splits: Optional[str] = typer.Option(None, "--fit", help="Fit the map files first: splits, comma-separated, or \"half\" (every split from half depth ⌊L/2⌋ to the default split L − ⌊L/3⌋). One capture pass with `fit`'s defaults, each split's maps written beside the model as <model stem>.S{split}.ridgefill.gguf; a file there that holds this model's maps for that split is used as it is. Then tune over them (and any --maps)."),
    fit_tokens: Optional[int] = typer.Option(None, "--fit-tokens", min=1, help=f"Calibration tokens of --fit (default {settings.FIT_TOKENS})."),
    tails: Optional[str] = typer.Option(None, "--tails", help=f"Tails T to search, comma-separated (default {csv(settings.TUNE_TAILS)}; each below --length / 4)."),
    fractions: Optional[str] = typer.Option(None, "--fractions", help=f"Exact fractions to search, comma-separated, each in [0, 1] (default {csv(settings.TUNE_FRACTIONS)})."),
    selector: Optional[str] = typer.Option(None, "--selector", help=f"Exact-row selector of every setting: {SELECTOR_NAMES} (protected: {' + '.join(settings.PROTECTED)}; default {settings.SELECTOR}); written into the map file with the chosen setting."),
    spans: Optional[str] = typer.Option(None, "--spans", help=f"Spans to search, comma-separated, each in 1..{settings.MAX_SPAN}: the rows kept exact together around each top-scoring row ({' and '.join(settings.SPAN_SELECTORS)} selectors; 1: single rows; default {csv(settings.TUNE_SPANS)})."),
    key_rescales: Optional[str] = typer.Option(None, "--key-rescales", help=f"Key rescales c_K to search, comma-separated: the tail rows a per-head scale of the filled keys is measured on (0: off; e.g. 0,512; default {csv(settings.TUNE_KEY_RESCALES)})."),
    retrieval_prompts: Optional[int] = typer.Option(None, "--retrieval-prompts", min=0, help=f"Planted-code retrieval prompts every setting must answer wherever exact prefill does, at depths spread over the filled region (0: no retrieval check; default {settings.TUNE_RETRIEVAL_PROMPTS})."),
    codes: Optional[int] = typer.Option(None, "--codes", min=1, max=12, help=f"Codes of different names planted per retrieval prompt: the one asked for and distractors before it (default {settings.TUNE_RETRIEVAL_CODES})."),
    length: Optional[int] = typer.Option(None, "--length", "-l", min=8, help=f"Prompt length of the held-out documents, in tokens (default {settings.TUNE_LENGTH}). Speedups are measured at this length only, and a point with more exact rows gains less at longer prompts: tune at the length you serve."),
    docs: Optional[int] = typer.Option(None, "--docs", min=2, help=f"Held-out documents (the CIs are bootstrapped over them; default {settings.TUNE_DOCS})."),
    value_rescale: Optional[int] = typer.Option(None, "--value-rescale", min=0, help=f"c: tail rows the value scale is measured on (0: off), the same for every setting (default {settings.VALUE_RESCALE})."),
    text: Optional[list[Path]] = typer.Option(None, "--text", help="Held-out text files or directories (default: the evaluation split of the default corpus and the licence texts of /usr/share/common-licenses)."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads."),
    gpu_layers: Optional[str] = gpu_layers_option(),
    device: Optional[str] = device_option(),
    strict: bool = typer.Option(False, "--strict", help="Feasible only when the 95 % CI's upper bound (not the point estimate) is within the budget."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Measure and choose, but write no map file: nothing into the chosen one, and with --fit no fitted one (it says which it would fit, and tunes over the map files already there)."),
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

    from ..core.gguf_model import GGUFFileError
    from ..maps.mapfile import MapFileError
    from ..core.files import OutputPathError
    from ..quality.tune import NoFeasibleSetting, TuneOptions, check_writable_maps, tune, write_chosen

    ts = None if tails is None else number_list(tails, "--tails", int)
    fs = None if fractions is None else number_list(fractions, "--fractions", float)
    ws = None if spans is None else number_list(spans, "--spans", int)
    cs = None if key_rescales is None else number_list(key_rescales, "--key-rescales", int)
    if not budget > 0:
        fail(f"--budget must be a positive number of nats, not {budget:g}")
    if selector is not None and selector not in settings.SELECTORS:
        fail(f"--selector must be one of {settings.names(settings.SELECTORS)}, not {selector!r}")
    if not maps and fit_splits is None:
        fail("give the map files to tune (--maps, from `fit`) or the splits to fit first (--fit)")
    if out_dir is not None:
        check_output_dir(out_dir, "--out")
    n_gpu_layers = parse_gpu_layers(gpu_layers)
    options = TuneOptions(n_threads=threads, n_gpu_layers=n_gpu_layers, strict=strict,
                          **given_options(tails=ts and tuple(ts), fractions=fs and tuple(fs), spans=ws and tuple(ws),
                                          key_rescales=cs and tuple(cs),
                                          selector=selector, length=length, n_docs=docs, value_rescale=value_rescale,
                                          retrieval_prompts=retrieval_prompts, codes=codes))
    maps = list(maps or []) + ([] if fit_splits is None else
                               _fit_first(model, fit_splits, fit_tokens, threads, maps or [], dry_run, options))
    if not maps:  # a dry run of --fit with none of its map files there yet
        out.print("dry run: no map file to tune over until they are fitted (run without --dry-run to fit them); "
                  "nothing was written", highlight=False, soft_wrap=True)
        return
    if not dry_run:  # the chosen map file gets the tuned defaults at the end: checked now, not after the work
        try:
            check_writable_maps(maps)
        except OutputPathError as e:
            fail(f"--maps: {e}")
    texts = read_text_option(text, "held-out text")
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
            fail(str(e))
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
            fail(f"could not write the tuned defaults into {res.best.maps}: {e} (the file is as it was)")
    if as_json:
        d = res.as_dict()
        d["error"] = failure
        print_timing_warnings(d["timing_warnings"], err)  # on stderr: stdout is the JSON
        print(json.dumps(d, indent=2, allow_nan=False))
    if failure:
        if paths and not as_json:
            err.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)
        fail(failure)
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
        out.print(f"dry run: the tuned defaults would go into {best.maps}; it was not modified", highlight=False,
                  soft_wrap=True)
    if paths:
        out.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)


def _fit_first(model: Path, spec: str, tokens: Optional[int], threads: Optional[int], given: list[Path],
               dry_run: bool, options) -> list[Path]:
    """tune --fit: the map files of the splits in spec, beside the model; the missing ones fitted now
    (``fit``, one capture pass, whose estimate adds the tune over every map file, ``options``), the
    ones there checked and used. Everything is checked before anything is said or done; a dry run
    fits nothing, says which files it would fit and returns only the ones there."""
    from ..core.gguf_model import GGUFFileError, read_model_info
    from ..fitting.fit import FitError, check_split
    from ..maps.mapfile import MapFileError, fitting_map_metas
    from .fit import maps_path_template, run_fit

    try:
        info = read_model_info(model)
    except GGUFFileError as e:
        fail(str(e))
    splits = (list(range(info.n_layer // 2, info.default_split + 1)) if spec.strip() == "half"
              else number_list(spec, "--fit", int))
    if len(set(splits)) != len(splits):
        fail(f"--fit: splits must be distinct, not {spec!r}")
    for s in splits:
        try:
            check_split(s, info.n_layer)
        except FitError as e:
            fail(f"--fit: {e}")
    template = maps_path_template(model)
    paths = [Path(template.replace("{split}", str(s))) for s in splits]
    todo, there = [], []
    for s, path in zip(splits, paths):
        if any(path.resolve() == g.resolve() for g in given):
            fail(f"--fit: {path} is also given with --maps")
        if not path.exists():
            todo.append((s, path))
            continue
        try:
            meta = fitting_map_metas([path], model)[0]
        except MapFileError as e:
            fail(f"--fit: {path} is there but cannot be used ({e}); move it away to fit S = {s} again")
        if meta.split_layer != s:
            fail(f"--fit: {path} holds maps for S = {meta.split_layer}, not {s}; move it away to fit S = {s}")
        there.append((s, path))
    for s, path in there:
        out.print(f"--fit: using {path} (this model's maps for S = {s}; delete it to fit again)", highlight=False,
                  soft_wrap=True)
    if todo and dry_run:
        out.print(f"--fit: dry run: would fit maps for S = {', '.join(str(s) for s, _ in todo)} (one capture pass) "
                  f"into {', '.join(str(p) for _, p in todo)}: a dry run fits none and writes no map file"
                  + ("; it tunes over the other map files only" if there or given else ""),
                  highlight=False, soft_wrap=True)
        return [p for _, p in there]
    if todo:
        out.print(f"--fit: fitting maps for S = {', '.join(str(s) for s, _ in todo)} (one capture pass)", highlight=False)
        n_maps = len(paths) + len(given)
        tuned = options.prefill_tokens(n_maps)
        grid = f"the tune over {options.n_points(n_maps)} settings ({tuned:,} prompt tokens at the capture's speed)"
        run_fit(model, None, output=Path(template), split=",".join(str(s) for s, _ in todo), tokens=tokens,
                threads=threads, n_gpu_layers=options.n_gpu_layers,
                later=lambda tokens_per_s: (grid, tuned / tokens_per_s))
    return paths


def _write_tune_report(res, out_dir: Path) -> list[Path]:
    from ..quality.tune import write_tune_report

    try:
        return write_tune_report(res, out_dir)
    except OSError as e:
        fail(f"--out {out_dir}: could not write the report: {e.strerror or e} "
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

    from ..quality.report import ci_text

    for i, p in enumerate(res.points):
        t.add_row(str(p.split), str(p.tail), f"{p.exact_fraction:g}", *([str(p.span)] if spans else []),
                  *([str(p.key_rescale)] if keys else []),
                  ci_text(p.novel, bound_fmt="{:+.3f}"),
                  f"{p.all['estimate']:+.4f}" if p.all else "—", f"{p.speedup:.2f}x", f"{p.ceiling:.2f}x",
                  *([f"{p.retrieval['kept'][0]}/{p.retrieval['kept'][1]}"] if retr else []),
                  "yes" if p.feasible else "no", "●" if p.on_front else "",
                  style="bold green" if i == res.chosen else None)
    out.print(t)
    print_timing_warnings(res.timing_warnings())
