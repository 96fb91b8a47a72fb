"""``ridgefill-gguf tune``: an automatic operating point (issue #8, item 4).

Searches split (one map file per split), tail T, exact fraction, the selector's span and the key
rescale c_K for the **fastest** setting whose novel-token ΔNLL on held-out text stays within a budget (nats) and that
keeps every planted code exact prefill retrieves, and writes the chosen defaults into that map
file's metadata (``ridgefill.tuned.*``, :func:`mapfile.write_tuned_defaults`),
where ``RidgeFill(path)`` and ``Llama(..., ridgefill=path)`` pick them up.

How it measures (one context of the patched llama.cpp, as ``eval`` does):

* **Documents**: ``n_docs`` documents of ``length + 1`` tokens of held-out text (the evaluation split
  of the default corpus and the licence texts: disjoint from ``fit``'s calibration text).
* Per document, one **exact prefill** (shared by every setting), then one **RidgeFill prefill per
  setting** (map file x T x fraction), documents in the outer loop so that slow drifts of the
  machine fall on every setting alike.
* **ΔNLL on the same positions for every setting**: the next-token losses of the last
  ``min(tails)`` prompt rows, which are tail rows (exact-path logits) for every T of the grid; all
  tokens and *novel* tokens (their 8-token run does not occur earlier in the prompt), per document,
  token-weighted mean with a percentile-bootstrap CI over documents.
* **Speed**: median exact prefill time / median RidgeFill prefill time over the documents, next to
  the plan's compute ceiling 1/r (docs/design.md §4); a speedup above it is noise, and is warned of
  (:func:`bench.timing_warnings`).
* **Retrieval** (``retrieval_prompts`` > 0): ``eval``'s planted-code prompts of the same length
  (``RETRIEVAL_ANSWER`` tokens shorter, so that the greedy answer fits the documents' context;
  ``codes`` facts of different names each; the asked-for one at depths spread over 0.1-0.9 of the
  region before the smallest tail, the question in that tail), greedy answers; exact prefill
  first, then every setting.

A setting is *feasible* when its novel ΔNLL point estimate is within the budget (``strict``: the
CI's upper bound) and it answers every retrieval prompt exact prefill answers. The chosen setting
is the feasible one with the highest measured speedup (ties: higher ceiling, then lower ΔNLL). The Pareto front (:func:`pareto_front`) is over (speedup, novel
ΔNLL). The library never prints; ``progress(done, total, what)`` reports runs.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core.machine import measured_on, measured_text
from .. import __version__
from . import metrics
from ..core import settings
from .evaluate import (EvalOptions, Ticker, build_documents, check_retrieval_tail, default_texts, open_context,
                       plan_summary, planted_code_retrieval, text_sources, text_tokenizer, timed_prefill)
from ..core.files import check_output, write_bytes
from ..fitting.fit import bos_prefix
from ..core.gguf_model import read_model_info
from ..maps.mapfile import map_file_splits, write_tuned_defaults
from ..runtime.prefill import RidgeFill
from .bench import timing_warnings
from .report import agg_pyplot, ci_text, save_figure, timing_warning_lines


#: the retrieval prompts are this many tokens shorter than the documents: room for the answer
RETRIEVAL_ANSWER = 16


@dataclass
class TuneOptions:
    tails: tuple[int, ...] = settings.TUNE_TAILS
    fractions: tuple[float, ...] = settings.TUNE_FRACTIONS
    selector: str = settings.SELECTOR     # a name of settings.SELECTORS, the same for every setting
    spans: tuple[int, ...] = settings.TUNE_SPANS  # searched with the span selectors (attention, probe)
    key_rescales: tuple[int, ...] = settings.TUNE_KEY_RESCALES  # c_K: 0 is off
    retrieval_prompts: int = settings.TUNE_RETRIEVAL_PROMPTS  # 0: no retrieval check
    codes: int = settings.TUNE_RETRIEVAL_CODES  # planted facts per retrieval prompt
    length: int = settings.TUNE_LENGTH    # prompt length of the held-out documents (tokens)
    n_docs: int = settings.TUNE_DOCS
    value_rescale: int = settings.VALUE_RESCALE
    n_threads: int | None = None
    n_gpu_layers: int = 0             # layers offloaded to a GPU (-1: all), as llama.cpp's -ngl
    n_boot: int = 2000
    seed: int = 0
    strict: bool = False              # feasible: the CI's upper bound (not the estimate) within the budget
    n_batch: int = settings.N_BATCH

    def n_points(self, n_maps: int) -> int:
        """The settings of the grid over ``n_maps`` map files."""
        return n_maps * len(set(self.tails)) * len(set(self.fractions)) * len(set(self.spans)) * len(set(self.key_rescales))

    def prefill_tokens(self, n_maps: int) -> int:
        """The prompt tokens a tune over ``n_maps`` map files prefills: every held-out document and
        retrieval prompt exactly and at each setting (what its time is estimated from)."""
        return self.length * (self.n_docs + self.retrieval_prompts) * (1 + self.n_points(n_maps))


@dataclass
class TunePoint:
    """One setting of the grid and what it measured."""

    maps: str
    split: int
    tail: int
    exact_fraction: float
    selector: str
    span: int = settings.SPAN
    key_rescale: int = settings.KEY_RESCALE
    novel: dict | None = None         # CI of the novel-token ΔNLL as a dict (estimate, low, high, n)
    all: dict | None = None           # CI of the ΔNLL over all scored tokens
    novel_tokens: int = 0
    tokens: int = 0
    times: list[float] = field(default_factory=list)   # prefill seconds per document
    speedup: float = float("nan")     # median exact time / median time of this setting
    ceiling: float = 1.0              # the plan's 1/r (median over documents)
    n_exact: float = 0.0              # selected exact prefix rows (median over documents)
    docs: list[dict] = field(default_factory=list)     # per document: {"all": [mean, n], "novel": [mean, n]}
    #: the retrieval check: {"correct": [bool per prompt], "predictions": [...], "kept": [kept, exact's]};
    #: None when it was not run
    retrieval: dict | None = None
    feasible: bool = False
    on_front: bool = False

    @property
    def label(self) -> str:
        span = f" w={self.span}" if self.selector in settings.SPAN_SELECTORS else ""
        key = f" cK={self.key_rescale}" if self.key_rescale else ""
        return f"S={self.split} T={self.tail} f={self.exact_fraction:g}{span}{key}"

    @property
    def keeps_retrieval(self) -> bool:
        """Every retrieval prompt exact prefill answers, this setting answers too (True when the
        check was not run)."""
        return self.retrieval is None or self.retrieval["kept"][0] == self.retrieval["kept"][1]

    @property
    def delta(self) -> float:
        """The novel-token ΔNLL point estimate (NaN when no novel token was scored)."""
        return self.novel["estimate"] if self.novel else float("nan")


@dataclass
class TuneResult:
    model: str
    maps: list[str]
    splits: list[int]
    architecture: str
    n_layer: int
    budget: float
    options: dict
    sources: list[str]
    scored_rows: int                  # the last min(tails) prompt rows
    #: the retrieval check's prompts: {"depths", "answers", "exact": exact prefill's predictions,
    #: "exact_correct"}; None when it was not run
    retrieval: dict | None = None
    documents: list[dict] = field(default_factory=list)   # name, kind, novel tokens
    exact_times: list[float] = field(default_factory=list)
    points: list[TunePoint] = field(default_factory=list)
    front: list[int] = field(default_factory=list)        # indices into points, by increasing ΔNLL
    chosen: int | None = None                             # index into points
    written: str | None = None                            # the map file the defaults went into
    defaults: dict | None = None                          # what was (or would be) written
    elapsed_s: float | None = None
    measured: dict = field(default_factory=dict)  # core.machine.measured_on: date, CPU, threads, versions

    @property
    def best(self) -> TunePoint | None:
        return self.points[self.chosen] if self.chosen is not None else None

    def timing_warnings(self) -> list[dict]:
        """The settings whose speedup is above their ceiling (:func:`bench.timing_warnings`; each
        document is timed once per setting, so only the ceiling rule applies)."""
        return [w for p in self.points
                for w in timing_warnings({"exact": self.exact_times, p.label: p.times}, {p.label: p.ceiling},
                                         base="exact", n_prompt=self.options.get("length"), repeats=False, more=None)]

    def as_dict(self) -> dict:
        """Plain JSON-able data (NaN and infinities as None)."""
        d = asdict(self)
        for p, dp in zip(self.points, d["points"]):
            dp["label"] = p.label
        d["timing_warnings"] = self.timing_warnings()
        return _finite(d)


def _finite(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


class NoFeasibleSetting(ValueError):
    """No setting of the grid stays within the budget; ``result`` holds what was measured."""

    def __init__(self, msg: str, result: TuneResult):
        super().__init__(msg)
        self.result = result


# ------------------------------------------------------------------------------------------------
# selection


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (speedup, ΔNLL) on the Pareto front, by increasing ΔNLL (then
    decreasing speedup). Faster is better, lower ΔNLL is better: a point is on the front when no
    other point is at least as fast *and* at least as good with one of the two strictly better.
    Equal points do not dominate each other (both are on the front); points with a NaN coordinate
    are never on it."""
    pts = [(float(s), float(d)) for s, d in points]
    ok = [i for i, (s, d) in enumerate(pts) if not (math.isnan(s) or math.isnan(d))]
    front = []
    for i in ok:
        si, di = pts[i]
        if not any(pts[j][0] >= si and pts[j][1] <= di and (pts[j][0] > si or pts[j][1] < di) for j in ok if j != i):
            front.append(i)
    return sorted(front, key=lambda i: (pts[i][1], -pts[i][0], i))


def is_feasible(point: TunePoint, budget: float, strict: bool = False) -> bool:
    """Within the budget: the novel ΔNLL point estimate (``strict``: the CI's upper bound) <= budget,
    and the setting keeps retrieval (:attr:`TunePoint.keeps_retrieval`). A setting with no novel
    token scored, or no interval under ``strict``, is not feasible."""
    if not point.novel or not point.keeps_retrieval:
        return False
    value = point.novel["high"] if strict else point.novel["estimate"]
    return value == value and value <= budget


def choose(points: Sequence[TunePoint]) -> int | None:
    """The feasible point with the highest measured speedup (ties: higher ceiling, then lower
    novel ΔNLL, then grid order); None when none is feasible."""
    cand = [i for i, p in enumerate(points) if p.feasible and p.speedup == p.speedup]
    if not cand:
        return None
    return min(cand, key=lambda i: (-points[i].speedup, -points[i].ceiling, points[i].delta, i))


# ------------------------------------------------------------------------------------------------
# checks


def check_spans(spans: Sequence[int], selector: str) -> tuple[int, ...]:
    """The sorted, de-duplicated spans to search with ``selector`` (ValueError says what is wrong):
    one or more spans in 1..MAX_SPAN; selectors without a span (protected, none) search one."""
    spans = list(spans)
    if not spans:
        raise ValueError("no spans to search (give at least one)")
    for w in spans:
        settings.check("span", w)
    spans = sorted({int(w) for w in spans})
    if len(spans) > 1 and selector not in settings.SPAN_SELECTORS:
        raise ValueError(f"spans {', '.join(map(str, spans))}: only {settings.names(settings.SPAN_SELECTORS)} take a "
                         f"span, not the {selector} selector")
    return tuple(spans)


def check_key_rescales(key_rescales: Sequence[int]) -> tuple[int, ...]:
    """The sorted, de-duplicated key rescales c_K to search (0: off; ValueError says what is wrong)."""
    key_rescales = list(key_rescales)
    if not key_rescales:
        raise ValueError("no key rescales to search (give at least one c_K; 0 is off)")
    for c in key_rescales:
        settings.check("key_rescale", c, label="key rescale")
    return tuple(sorted({int(c) for c in key_rescales}))


def check_grid(tails: Sequence[int], fractions: Sequence[float], length: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Sorted, de-duplicated grid values, after checking them (ValueError says what is wrong)."""
    tails = list(tails)
    fractions = list(fractions)
    if not tails:
        raise ValueError("no tails to search (give at least one T)")
    if not fractions:
        raise ValueError("no exact fractions to search (give at least one)")
    for t in tails:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 1:
            raise ValueError(f"tail {t!r}: tails must be integers >= 1")
    for f in fractions:
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"exact fraction {f!r} outside [0, 1]")
    if length < 8:
        raise ValueError(f"length {length}: the documents need at least 8 tokens")
    too_long = [t for t in tails if 4 * t >= length]
    if too_long:
        raise ValueError(f"tail {max(too_long)} is not below length/4 ({length}/4 = {length / 4:g}): "
                         "use shorter tails or longer documents")
    return tuple(sorted({int(t) for t in tails})), tuple(sorted({float(f) for f in fractions}))


# ------------------------------------------------------------------------------------------------
# the search


def tune(model: os.PathLike | str, maps: Sequence[os.PathLike | str], budget: float,
         options: TuneOptions | None = None, texts: dict[str, list[tuple[str, str]]] | None = None,
         progress: Callable[[int, int, str], None] | None = None, *, write: bool = True) -> TuneResult:
    """Measure every (map file, tail, fraction, span, key rescale) and choose the fastest setting within ``budget``
    (novel-token ΔNLL, nats) that keeps retrieval; write it into that map file's metadata unless
    ``write`` is False.
    Raises :class:`NoFeasibleSetting` (a ValueError, nothing written) when no setting is within the
    budget, ValueError / MapFileError for bad input. The model file is only read."""
    options = options or TuneOptions()
    t_start = time.perf_counter()
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget {budget!r}: the ΔNLL budget must be a positive number of nats")
    if not maps:
        raise ValueError("tune needs at least one map file (--maps)")
    if write:  # the chosen map file is rewritten at the end: say now, not after the work, if it cannot be
        check_writable_maps(maps)
    tails, fractions = check_grid(options.tails, options.fractions, options.length)
    if options.selector not in settings.SELECTORS:
        raise ValueError(f"selector {options.selector!r}: tune measures one of {settings.names(settings.SELECTORS)}")
    spans = check_spans(options.spans, options.selector)
    key_rescales = check_key_rescales(options.key_rescales)
    if options.n_docs < 2:
        raise ValueError(f"n_docs {options.n_docs}: a confidence interval needs at least 2 documents")
    if isinstance(options.retrieval_prompts, bool) or not isinstance(options.retrieval_prompts, int) \
            or options.retrieval_prompts < 0:
        raise ValueError(f"retrieval prompts {options.retrieval_prompts!r}: an integer >= 0 (0: no retrieval check)")
    depths = np.linspace(0.1, 0.9, options.retrieval_prompts) if options.retrieval_prompts > 1 else (0.5,)
    retrieval = EvalOptions(tail=tails[0], codes=options.codes, names_per_depth=1, n_boot=options.n_boot,
                            seed=options.seed, depths=tuple(round(float(d), 6) for d in depths))
    retrieval.check()
    settings.check("value_rescale", options.value_rescale)  # an int32 in the C parameters
    info = read_model_info(model)
    if info.context_length and options.length > info.context_length:
        raise ValueError(f"a {options.length}-token prompt is longer than the model's context ({info.context_length})")
    splits = map_file_splits(maps, model)
    texts = texts if texts is not None else default_texts()
    if not texts:
        raise ValueError("no held-out text")

    n, k = options.length, tails[0]
    res = TuneResult(model=str(model), maps=[str(m) for m in maps], splits=splits, architecture=info.architecture,
                     n_layer=info.n_layer, budget=float(budget), options=asdict(options), sources=text_sources(texts),
                     scored_rows=k, measured=measured_on(options.n_threads, options.n_gpu_layers))
    res.options.update(tails=list(tails), fractions=list(fractions), spans=list(spans), key_rescales=list(key_rescales))
    res.points = [TunePoint(str(m), s, t, f, options.selector, w, c) for m, s in zip(maps, splits) for t in tails
                  for f in fractions for w in spans for c in key_rescales]
    n_retr = options.retrieval_prompts * (1 + len(res.points))
    tick = Ticker(1 + options.n_docs * (1 + len(res.points)) + n_retr, progress)

    # every setting, measured with min_prompt 0 (the documents are the prompts)
    fills = [RidgeFill(p.maps, split=p.split, tail=p.tail, exact_fraction=p.exact_fraction, selector=p.selector,
                       span=p.span, value_rescale=options.value_rescale, key_rescale=p.key_rescale, min_prompt=0)
             for p in res.points]
    ceilings: list[list[float]] = [[] for _ in res.points]
    n_exacts: list[list[float]] = [[] for _ in res.points]
    llm = open_context(model, n, options.n_batch, options.n_threads, fills[0], n_gpu_layers=options.n_gpu_layers)
    try:
        if options.retrieval_prompts:  # before any measurement: the questions go into the smallest tail
            check_retrieval_tail(text_tokenizer(llm), tails[0])
        docs = build_documents(text_tokenizer(llm), bos_prefix(llm), texts, n, options.n_docs)
        if len(docs) < 2:
            raise ValueError(f"the held-out text holds only {len(docs)} document of {n + 1} tokens: "
                             "a confidence interval needs at least 2")
        tick.total = 1 + len(docs) * (1 + len(res.points)) + n_retr
        # warm-up, not timed: the context's first exact and first RidgeFill prefill allocate buffers
        timed_prefill(llm, None, docs[0].tokens[:n], k)
        timed_prefill(llm, fills[0], docs[0].tokens[:n], k)
        tick("warm-up")
        for d in docs:
            prompt, targets = d.tokens[:n], d.tokens[n - k + 1:n + 1]
            novel = metrics.novel_token_mask(d.tokens, n - k + 1)
            res.documents.append({"doc": d.name, "kind": d.kind, "novel_tokens": int(novel.sum())})
            logits, dt = timed_prefill(llm, None, prompt, k)
            nll_exact = metrics.nll(logits, targets)
            res.exact_times.append(dt)
            tick("exact")
            for i, (p, rf) in enumerate(zip(res.points, fills)):
                logits, dt = timed_prefill(llm, rf, prompt, k)
                nll = metrics.nll(logits, targets)
                plan = plan_summary(llm, p.split)
                ceilings[i].append(plan["ceiling"])
                n_exacts[i].append(float(plan.get("n_exact", 0.0)))
                p.times.append(dt)
                p.docs.append({"doc": d.name, "all": list(metrics.document_delta(nll, nll_exact)),
                               "novel": list(metrics.document_delta(nll, nll_exact, novel))})
                tick(p.label)
        if options.retrieval_prompts:
            conds = {"exact": None, **{str(i): rf for i, rf in enumerate(fills)}}
            # prompts RETRIEVAL_ANSWER rows shorter than the documents: the greedy answer fits the context
            r = planted_code_retrieval(llm, text_tokenizer(llm), bos_prefix(llm), texts, n - RETRIEVAL_ANSWER, retrieval,
                                       conds, tick)
            res.retrieval = {"depths": list(retrieval.depths), "codes": options.codes, "answers": r["exact"]["answers"],
                             "exact": r["exact"]["predictions"], "exact_correct": r["exact"]["correct"]}
            for i, p in enumerate(res.points):
                p.retrieval = {k: r[str(i)][k] for k in ("correct", "predictions", "kept")}
    finally:
        llm.close()

    t_exact = statistics.median(res.exact_times)
    for i, p in enumerate(res.points):
        p.speedup = t_exact / statistics.median(p.times)
        p.ceiling = statistics.median(ceilings[i])
        p.n_exact = statistics.median(n_exacts[i])
        for m in ("all", "novel"):
            vals = np.array([r[m][0] for r in p.docs], dtype=np.float64)
            wts = np.array([r[m][1] for r in p.docs], dtype=np.float64)
            keep = wts > 0
            if keep.any():
                ci = metrics.bootstrap_ci(vals[keep], wts[keep], n_boot=options.n_boot, seed=options.seed)
                setattr(p, m, ci._asdict())
        p.novel_tokens = int(sum(r["novel"][1] for r in p.docs))
        p.tokens = int(sum(r["all"][1] for r in p.docs))
        p.feasible = is_feasible(p, budget, options.strict)
    res.front = pareto_front([(p.speedup, p.delta) for p in res.points])
    for i in res.front:
        res.points[i].on_front = True
    res.chosen = choose(res.points)
    res.elapsed_s = time.perf_counter() - t_start
    if res.chosen is None:
        scored = [p for p in res.points if p.novel]
        if not scored:
            raise NoFeasibleSetting("no novel token was scored in any document: ΔNLL on novel tokens cannot be "
                                    "measured (use longer or more varied text)", res)
        def key(p: TunePoint) -> float:
            v = p.novel["high"] if options.strict else p.delta
            return v if v == v else math.inf  # no interval (one document with novel tokens): never the best

        best = min(scored, key=key)
        what = "CI upper bound" if options.strict else "estimate"
        lost = [p for p in scored
                if not p.keeps_retrieval and is_feasible(dataclasses.replace(p, retrieval=None), budget, options.strict)]
        if lost:
            fastest = max(lost, key=lambda p: p.speedup)
            kept, of = fastest.retrieval["kept"]
            raise NoFeasibleSetting(
                f"no setting is within the budget of {budget:g} nats and keeps retrieval: {len(lost)} within the "
                f"budget lose planted codes exact prefill retrieves (the fastest, {fastest.label}, keeps {kept} of "
                f"{of}); add larger exact fractions, spans, tails or key rescales, or a later split's map file (nothing was written)",
                res)
        raise NoFeasibleSetting(
            f"no setting is within the budget of {budget:g} nats: the best novel-token ΔNLL {what} reached is "
            f"{key(best):+.4f} ({best.label}); raise the budget, add larger exact fractions or tails, or a later "
            "split's map file (nothing was written)", res)

    p = res.best
    res.defaults = {
        "tail": p.tail, "exact_fraction": p.exact_fraction, "selector": p.selector,
        "span": p.span if p.selector in settings.SPAN_SELECTORS else None, "key_rescale": p.key_rescale,
        "budget": float(budget),
        "criterion": "upper" if options.strict else "estimate",
        "delta_nll_novel": p.novel["estimate"],
        "delta_nll_novel_low": p.novel["low"] if p.novel["low"] == p.novel["low"] else None,
        "delta_nll_novel_high": p.novel["high"] if p.novel["high"] == p.novel["high"] else None,
        "delta_nll_all": p.all["estimate"] if p.all else None,
        "speedup": p.speedup, "ceiling": p.ceiling, "value_rescale": options.value_rescale,
        "n_docs": len(res.documents), "length": n, "scored_rows": k,
        **({"retrieval_prompts": len(p.retrieval["correct"]), "retrieval_exact": p.retrieval["kept"][1],
            "retrieval_kept": p.retrieval["kept"][0]} if p.retrieval is not None else {}),
        "source": "; ".join(res.sources) or "unspecified",
        "tool_version": __version__,
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    }
    if write:
        write_chosen(res)
    return res


def check_writable_maps(maps: Sequence[os.PathLike | str]) -> None:
    """That each map file could be rewritten with tuned defaults (a regular file in a directory where
    its atomic replacement can be created); raises ``OutputPathError`` (a ValueError) naming it."""
    for m in maps:
        check_output(Path(m).resolve())


def write_chosen(res: TuneResult) -> Path:
    """Write the chosen setting's defaults (``res.defaults``) into its map file, atomically
    (:func:`ridgefill_cpp.maps.mapfile.write_tuned_defaults`), and record it in ``res.written``."""
    if res.best is None or res.defaults is None:
        raise ValueError("no setting was chosen: nothing to write")
    path = write_tuned_defaults(res.best.maps, res.defaults)
    res.written = str(path)
    return path


# ------------------------------------------------------------------------------------------------
# the files of --out


def write_tune_report(res: TuneResult, out_dir: os.PathLike | str) -> list[Path]:
    """Write ``pareto.png``, ``tune.json`` and ``tune.md`` into ``out_dir`` (each atomically); return
    the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_pareto(res, out / "pareto.png")
    j = out / "tune.json"
    write_bytes(j, json.dumps(res.as_dict(), indent=1, allow_nan=False).encode())
    md = out / "tune.md"
    write_bytes(md, tune_markdown(res, png.name).encode())
    return [png, j, md]


def plot_pareto(res: TuneResult, path: Path) -> Path:
    """Speedup against novel-token ΔNLL (95 % CI error bars) for every setting, the Pareto front
    joined by a line, the budget as a vertical line, the chosen setting highlighted and labelled."""
    plt = agg_pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, split in enumerate(res.splits):
        for feasible in (True, False):
            pts = [p for p in res.points if p.split == split and p.novel and p.feasible == feasible]
            if not pts:
                continue
            xs = [p.delta for p in pts]
            lo = [p.delta - p.novel["low"] if p.novel["low"] == p.novel["low"] else 0.0 for p in pts]
            hi = [p.novel["high"] - p.delta if p.novel["high"] == p.novel["high"] else 0.0 for p in pts]
            ax.errorbar(xs, [p.speedup for p in pts], xerr=[lo, hi], fmt="o" if feasible else "x", capsize=2,
                        color=colours[j % len(colours)], alpha=0.85 if feasible else 0.5, ms=5,
                        label=f"S = {split}" + ("" if feasible else " (over budget)"))
    front = [res.points[i] for i in res.front]
    if front:
        ax.plot([p.delta for p in front], [p.speedup for p in front], "-", marker="o", ms=11, mfc="none",
                color="black", lw=1, alpha=0.7, label="Pareto front", zorder=1)
    ax.axvline(res.budget, color="red", ls="--", lw=1, label=f"budget {res.budget:g} nats")
    best = res.best
    if best is not None:
        ax.plot([best.delta], [best.speedup], "*", ms=16, color="gold", markeredgecolor="black", zorder=5,
                label="chosen")
        ax.annotate(best.label, (best.delta, best.speedup), textcoords="offset points", xytext=(8, 8), fontsize=9,
                    fontweight="bold")
    ax.axvline(0, color="gray", lw=0.6)
    ax.margins(x=0.06, y=0.15)  # room for the chosen setting's label
    ax.set_xlabel(f"ΔNLL on novel tokens vs exact (nats, 95 % CI; last {res.scored_rows} prompt rows)")
    ax.set_ylabel("measured prefill speedup vs exact (x)")
    ax.set_title(f"{Path(res.model).name}: operating points, {res.options['length']}-token prompts, "
                 f"{len(res.documents)} documents", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def tune_markdown(res: TuneResult, png: str | None = "pareto.png") -> str:
    o = res.options
    L = [f"# RidgeFill operating point: {Path(res.model).name}\n"]
    L.append(f"- model: `{Path(res.model).name}` ({res.architecture}, {res.n_layer} layers)")
    L.append("- map files: " + ", ".join(f"`{Path(m).name}` (S = {s})" for m, s in zip(res.maps, res.splits)))
    spans = o["selector"] in settings.SPAN_SELECTORS
    keys = any(p.key_rescale for p in res.points)
    L.append(f"- grid: T in {{{', '.join(str(t) for t in o['tails'])}}}, exact fraction in "
             f"{{{', '.join(f'{f:g}' for f in o['fractions'])}}}, selector {o['selector']}"
             + (f", span in {{{', '.join(str(w) for w in o['spans'])}}}" if spans else "")
             + (f", key rescale c_K in {{{', '.join(str(c) for c in o['key_rescales'])}}} (0: off)" if keys else "")
             + f", value rescale c = {o['value_rescale']}")
    r = res.retrieval
    if r is not None:
        L.append(f"- retrieval check: {len(r['answers'])} prompts of {o['length'] - RETRIEVAL_ANSWER} tokens, {r['codes']} planted codes "
                 f"each (the asked-for one at depths {', '.join(f'{d:g}' for d in r['depths'])} of the region before "
                 f"the smallest tail, distractors of other names before it); exact prefill retrieves "
                 f"{sum(r['exact_correct'])}; a setting must retrieve every one of those")
    L.append(f"- {len(res.documents)} held-out documents of {o['length']} tokens; texts (disjoint from the calibration "
             "text of `fit`): " + "; ".join(res.sources))
    crit = "the CI's upper bound" if o["strict"] else "the point estimate"
    L.append(f"- budget: novel-token ΔNLL <= {res.budget:g} nats ({crit})"
             + (" and every planted code exact prefill retrieves kept" if r is not None else ""))
    if res.elapsed_s is not None:
        L.append(f"- run time: {res.elapsed_s:.0f} s" if res.elapsed_s < 120 else f"- run time: {res.elapsed_s / 60:.1f} min")
    L.append(f"- measured: {measured_text(res.measured)}")
    L.append("")
    L.append(f"ΔNLL = NLL with RidgeFill − NLL of exact prefill on the same tokens (nats): the next-token losses of "
             f"the last {res.scored_rows} prompt rows (the smallest tail of the grid, so every setting's logits "
             "there are exact-path tail logits), token-weighted mean over documents with a 95 % percentile-bootstrap "
             f"CI over documents ({o['n_boot']} resamples). Novel: the token's 8-token run does not occur earlier in "
             "the prompt. Speedup: median exact prefill time / median RidgeFill prefill time over the documents, "
             "same context, documents in the outer loop. Ceiling: the plan's 1/r (docs/design.md §4).\n")
    best = res.best
    if best is not None:
        L.append(f"**Chosen: {best.label}** (the fastest setting within the budget): novel ΔNLL "
                 f"{ci_text(best.novel)}, speedup {best.speedup:.2f}x, ceiling {best.ceiling:.2f}x.")
        L.append(f"Written into `{res.written}`." if res.written else
                 f"Not written into the map file (a dry run, or the write failed); it would go into `{best.maps}`.")
        L.append("")
    else:
        L.append("**No setting is within the budget.**\n")
    L.append("| split | T | fraction |" + (" span |" if spans else "") + (" c_K |" if keys else "") + " ΔNLL novel | ΔNLL all | speedup | ceiling 1/r |"
             + (" retrieval kept |" if r is not None else "") + " feasible | on the front |")
    L.append("|---:|---:|---:|" + ("---:|" if spans else "") + ("---:|" if keys else "") + "---|---|---:|---:|" + ("---:|" if r is not None else "")
             + ":-:|:-:|")
    for i, p in enumerate(res.points):
        mark = " **(chosen)**" if i == res.chosen else ""
        L.append(f"| {p.split} | {p.tail} | {p.exact_fraction:g} |" + (f" {p.span} |" if spans else "")
                 + (f" {p.key_rescale} |" if keys else "")
                 + f" {ci_text(p.novel)} | {ci_text(p.all)} | {p.speedup:.2f}x | {p.ceiling:.2f}x |"
                 + (f" {p.retrieval['kept'][0]}/{p.retrieval['kept'][1]} |" if p.retrieval is not None else "")
                 + f" {'yes' if p.feasible else 'no'}{mark} | {'yes' if p.on_front else ''} |")
    L.append("")
    L += timing_warning_lines(res.timing_warnings())
    if png:
        L.append(f"![{png}]({png})\n")
    return "\n".join(L) + "\n"


__all__ = ["TuneOptions", "TunePoint", "TuneResult", "NoFeasibleSetting", "tune", "pareto_front", "choose",
           "is_feasible", "check_grid", "check_spans", "check_key_rescales", "write_tune_report", "plot_pareto", "tune_markdown"]
