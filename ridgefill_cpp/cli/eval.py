"""``ridgefill-gguf eval``: what filling costs in quality against exact prefill."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

import typer
from rich.table import Table

from ..core import settings
from ..core.limits import MAX_THREADS
from .app import (SELECTOR_NAMES, app, check_output_dir, check_prefill_args, csv, device_option, err, fail,
                  given_options, gpu_layers_option, number_list, out, parse_gpu_layers, print_timing_warnings,
                  read_text_option, resolve_operating_point, tuned_help, with_devices)

T = TypeVar("T")


@app.command("eval")
@with_devices
def eval_cmd(
    model: Path = typer.Argument(..., help="The model GGUF (never modified)."),
    maps: list[Path] = typer.Option(..., "--maps", "-m", help="Map file of `fit`; repeat for a split sweep (the first is the main setting)."),
    compare_maps: Optional[list[Path]] = typer.Option(None, "--compare-maps", help="Another map file for the first one's split (e.g. `fit --ctx 4096`, other text); repeat for more. Each is a ridge variant with a paired ΔNLL difference against the first file and a retrieval condition with the attention selector; with --ruler, a condition paired with the first file's."),
    text: Optional[list[Path]] = typer.Option(None, "--text", help="Evaluation text files or directories (default: the evaluation split of the default corpus and the licence texts of /usr/share/common-licenses)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", "-l", help="Prompt lengths in tokens, comma-separated "
                                          f"(default {csv(settings.EVAL_LENGTHS)}; --quick: {csv(settings.EVAL_QUICK['lengths'])}; "
                                          f"--ruler: {csv(settings.RULER_LENGTHS)}, prompt plus answer)."),
    tail: Optional[int] = typer.Option(None, "--tail", min=1, help=tuned_help("T: the last prompt rows, exact; their next-token losses are scored", "tail", first=True)),
    exact_fraction: Optional[float] = typer.Option(None, "--exact-fraction", min=0.0, max=1.0, help=tuned_help("Share of the prefix rows the selector keeps exact", "exact_fraction", first=True)),
    selector: Optional[str] = typer.Option(None, "--selector", help=tuned_help(f"Exact-row selector of the fill variants: {SELECTOR_NAMES} (protected and attention+protected optionally :CLASS+CLASS of {', '.join(settings.TOKEN_CLASSES)})", "selector", first=True)),
    selectors: str = typer.Option("", "--selectors", help="More selector variants of ridge fill to compare, comma-separated (e.g. probe,protected:digits,attention@16,attention@1); each also gets a retrieval condition and a paired ΔNLL difference against plain ridge."),
    queries: Optional[str] = typer.Option(None, "--queries", help=f"More query-row counts of the attention and probe selectors to compare, comma-separated (e.g. 16,32; the default is the last {settings.N_QUERIES} prompt rows, capped at the tail); each also gets a retrieval condition and a paired ΔNLL difference against plain ridge."),
    value_rescale: Optional[int] = typer.Option(None, "--value-rescale", min=0, help=f"c: tail rows the value scale is measured on (0: off; default {settings.VALUE_RESCALE})."),
    docs: Optional[int] = typer.Option(None, "--docs", min=0, help=f"Documents per length, 0 or at least 2; 0: retrieval only, no ΔNLL (default {settings.EVAL_DOCS}; --quick: {settings.EVAL_QUICK['n_docs']})."),
    key_rescale: Optional[int] = typer.Option(None, "--key-rescale", min=0, help="c_K > 0: also evaluate ridge fill with the key rescale measured on c_K tail rows (default: the first map file's tuned c_K, else no such variant)."),
    splice: bool = typer.Option(True, "--splice/--no-splice", help="Run the splice test (exact K, exact V; hybrids also the exact recurrent state)."),
    codes: int = typer.Option(1, "--codes", min=1, max=12, help="Facts per retrieval prompt: the one asked for at each depth and codes - 1 distractors of other names spread over the rows before it (1: the single-fact test)."),
    depths: Optional[str] = typer.Option(None, "--depths", help="Retrieval: depths of the asked-for fact, comma-separated shares of the filled region (default 0.1,0.3,0.5,0.7,0.9)."),
    retrieval_prompts: Optional[int] = typer.Option(None, "--retrieval-prompts", min=1, help="Retrieval prompts per depth, each with other names and codes (default 2)."),
    quick: bool = typer.Option(False, "--quick", help=f"Smoke run: {csv(settings.EVAL_QUICK['lengths'])}-token prompts, {settings.EVAL_QUICK['n_docs']} documents, {len(settings.EVAL_QUICK['depths']) * settings.EVAL_QUICK['names_per_depth']} retrieval prompts per condition."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads."),
    gpu_layers: Optional[str] = gpu_layers_option(),
    device: Optional[str] = device_option(),
    swa_full: bool = typer.Option(True, "--swa-full/--no-swa-full", help="Models with sliding-window layers (gemma3, gpt-oss): every variant on a full-size KV cache (libllama's default) or on a window-sized one (llama-server's default, with --no-swa-full)."),
    out_dir: Path = typer.Option(Path("ridgefill-report"), "--out", "-o", help="Report directory (report.md, PNG plots, results.json; with --ruler: ruler.md, ruler.png, ruler.json, and ruler.samples.jsonl, each finished prompt as it finishes: run again with the same --out to go on after an interruption or with more --samples, tasks or lengths)."),
    ruler: bool = typer.Option(False, "--ruler", help="Run RULER's synthetic tasks instead (needles, variable tracking, common and frequent words): each prompt with exact prefill and with each --maps file, scored as RULER scores them, paired (docs/ruler)."),
    ruler_tasks: Optional[str] = typer.Option(None, "--ruler-tasks", help="With --ruler: the tasks, comma-separated (default all: "
                                               "niah_single_1,2,3, niah_multikey_1,2,3, niah_multivalue, niah_multiquery, vt, cwe, fwe)."),
    samples: int = typer.Option(settings.RULER_SAMPLES, "--samples", min=1, help="With --ruler: prompts per task and length."),
    ruler_identity: bool = typer.Option(False, "--ruler-identity", help="With --ruler: also identity fill at the first map file's split."),
) -> None:
    """Measure what filling costs in quality, against exact prefill of the same prompts: ΔNLL on all,
    novel and key tail tokens with bootstrap CIs over documents, perplexity ratios, the splice test
    (share of the error in K vs V), planted-fact retrieval from the filled region (exact / identity /
    ridge, with and without the selector), and the speed of the same runs. Writes a Markdown report,
    plots and a JSON file."""
    from ..quality.evaluate import EvalOptions, evaluate
    from ..quality.report import ci_text, write_report

    tail, exact_fraction, selector, key_rescale = resolve_operating_point(maps[0] if maps else None, tail, exact_fraction,
                                                                          selector, key_rescale)
    key_rescale = key_rescale or None  # 0: no such variant
    ns = check_prefill_args(model, lengths, selector)
    check_output_dir(out_dir, "--out")
    n_gpu_layers = parse_gpu_layers(gpu_layers)
    kw = dict(tail=tail, exact_fraction=exact_fraction, selector=selector, splice=splice, n_threads=threads,
              n_gpu_layers=n_gpu_layers, codes=codes,
              swa_full=swa_full, selectors=tuple(x.strip() for x in selectors.split(",") if x.strip()),
              queries=tuple(number_list(queries, "--queries", int)) if queries else (),
              **given_options(lengths=ns, n_docs=docs, value_rescale=value_rescale, key_rescale=key_rescale,
                              depths=depths and tuple(number_list(depths, "--depths", float)),
                              names_per_depth=retrieval_prompts))
    if ruler:
        others = dict(docs=docs, selectors=selectors or None, queries=queries, depths=depths,
                      retrieval_prompts=retrieval_prompts, codes=None if codes == 1 else codes, quick=quick or None,
                      splice=None if splice else False)
        given = [f"--{k.replace('_', '-')}" for k, v in others.items() if v is not None]
        if given:
            fail(f"{', '.join(given)}: only the standard evaluation takes {'these' if len(given) > 1 else 'this'}, not --ruler")
        return eval_ruler(model, maps, ns, text, ruler_tasks, samples, ruler_identity, threads, n_gpu_layers, swa_full,
                          out_dir, compare_maps or [],
                          dict(tail=tail, exact_fraction=exact_fraction, selector=selector, key_rescale=key_rescale or 0,
                               value_rescale=settings.VALUE_RESCALE if value_rescale is None else value_rescale))
    if ruler_tasks is not None or samples != settings.RULER_SAMPLES or ruler_identity:
        fail("--ruler-tasks, --samples and --ruler-identity go with --ruler")
    options = EvalOptions.quick(**kw) if quick else EvalOptions(**kw)
    texts = read_text_option(text, "evaluation text")
    t0 = time.perf_counter()
    res = _measured("evaluating", lambda progress: evaluate(model, maps, options, texts=texts,
                                                            compare_maps=compare_maps or (), progress=progress))
    paths = _written(lambda: write_report(res, out_dir, time.perf_counter() - t0), out_dir)
    for n, s in res.summary.items():
        t = Table(title=f"{Path(res.model).name}, {n}-token prompts: ΔNLL vs exact (nats, 95 % CI, {len(res.docs[n]['exact'])} documents)")
        for col in ("variant", "novel", "key", "all", "speed"):
            t.add_column(col, justify="right" if col != "variant" else "left")
        for v, row in s.items():
            cell = lambda m: ci_text(row.get(m) and row[m]["delta"], bound_fmt="{:+.3f}")  # noqa: E731
            t.add_row(v, cell("novel"), cell("key"), cell("all"), f"{res.ttft_ratio(int(n), v):.2f}x")
        out.print(t)
        print_timing_warnings([w for w in res.timing_warnings() if str(w["n_prompt"]) == n])
    for n, r in res.retrieval.items():
        t = Table(title=f"{Path(res.model).name}, {n}-token prompts: filled-region retrieval ({len(r['exact']['answers'])} prompts)")
        for col in ("condition", "accuracy", "kept (of exact's)"):
            t.add_column(col, justify="right" if col != "condition" else "left")
        for cond, v in r.items():
            t.add_row(cond, f"{v['accuracy']['estimate']:.0%} [{v['accuracy']['low']:.0%}, {v['accuracy']['high']:.0%}]",
                      f"{v['kept'][0]}/{v['kept'][1]}")
        out.print(t)
    out.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)


def eval_ruler(model: Path, maps: list[Path], lengths: Optional[list[int]], text: Optional[list[Path]],
               tasks: Optional[str], samples: int, identity: bool, threads: Optional[int], n_gpu_layers: int,
               swa_full: bool, out_dir: Path, compare_maps: list[Path], point: dict) -> None:
    """``eval --ruler``: RULER's tasks with exact prefill, each map file at its split (and identity
    fill at the first one's; each of ``compare_maps`` at the first one's split, paired with it), one
    operating point; the report into ``out_dir``."""
    from ..maps.mapfile import MapFileError, map_file_splits
    from ..quality.ruler import JOURNAL, RulerOptions, run_ruler
    from ..quality.ruler_report import score_ci, write_ruler_report
    from ..quality.evaluate import default_texts, maps_variant_names, text_sources
    from ..runtime.prefill import RidgeFill

    try:
        splits = map_file_splits(maps, model)
        variants = maps_variant_names([maps[0], *compare_maps], model)[1:] if compare_maps else []
    except MapFileError as e:
        fail(str(e))
    fill = dict(point, min_prompt=0, **settings.parse_selector(point.pop("selector")))
    conditions: dict[str, Optional[RidgeFill]] = {"exact": None}
    compared: dict[str, str] = {}
    try:
        for path, split in zip(maps, splits):
            conditions[f"ridge S={split}"] = RidgeFill(path, split=split, **fill)
        for path, variant in zip(compare_maps, variants):
            # "ridge (LABEL)" -> "ridge S=15 (LABEL)", paired with the first map file's condition
            name = f"ridge S={splits[0]} {variant.removeprefix('ridge ')}"
            conditions[name] = RidgeFill(path, split=splits[0], **fill)
            compared[name] = f"ridge S={splits[0]}"
        if identity:
            conditions[f"identity S={splits[0]}"] = RidgeFill(None, split=splits[0], **fill)
        options = RulerOptions(**given_options(lengths=lengths), samples=samples, n_threads=threads,
                               n_gpu_layers=n_gpu_layers, swa_full=swa_full,
                               **({"tasks": tuple(x.strip() for x in tasks.split(",") if x.strip())} if tasks else {}))
        options.check()
    except ValueError as e:
        fail(str(e))
    given = read_text_option(text, "evaluation text")
    essay_texts = given or default_texts()
    kind = "text" if given else "documentation"
    essay = "\n\n".join(t for _, t in essay_texts[kind])
    source = text_sources({kind: essay_texts[kind]})[0] + " (the essay haystack)"
    journal = out_dir / JOURNAL
    if journal.exists():
        err.print(f"{journal}: taking the prompts an earlier sitting finished from there", highlight=False)
    res = _measured("RULER", lambda progress: run_ruler(model, conditions, options, essay, source, progress=progress,
                                                        journal=journal, compared=compared))
    if res.reused:
        err.print(f"{res.reused} of {len(res.samples)} prompts from {journal}", highlight=False)
    paths = _written(lambda: write_ruler_report(res, out_dir), out_dir)
    for n, summ in res.summary.items():
        t = Table(title=f"{model.name}, RULER at {n} tokens ({options.samples} samples per task; score ×100, 95 % CI)")
        cols = ("condition", "score", "Δ vs exact", *((f"Δ vs {next(iter(compared.values()))}",) if compared else ()), "same answer", "TTFT ratio")
        for col in cols:
            t.add_column(col, justify="right" if col != "condition" else "left")
        for name, a in summ["average"].items():
            vs = ((score_ci(a["vs"], signed=True) if "vs" in a else "—",) if compared else ())
            t.add_row(name, f"{a['score']['estimate']:.1f}", score_ci(a["delta"], signed=True) if name != "exact" else "—",
                      *vs, f"{a['same_answer']:.0%}", f"{res.ttft[n][name]:.2f}x")
        out.print(t)
        print_timing_warnings(res.timing_warnings.get(n, []))
    out.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)


def _measured(label: str, run: Callable[[Callable[[int, int, str], None]], T]) -> T:
    """``run(progress)`` under a progress bar on stderr; a ValueError or MapFileError ends the command
    with its message."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ..maps.mapfile import MapFileError

    with Progress(TextColumn(f"{label}: {{task.description}}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err) as bar:
        task = bar.add_task("", total=None)
        try:
            return run(lambda d, t, what: bar.update(task, completed=d, total=t, description=what))
        except (ValueError, MapFileError) as e:
            fail(str(e))


def _written(write: Callable[[], list[Path]], out_dir: Path) -> list[Path]:
    try:
        return write()
    except OSError as e:
        fail(f"--out {out_dir}: could not write the report: {e.strerror or e}")
