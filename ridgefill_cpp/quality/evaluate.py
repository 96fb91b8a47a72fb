"""``ridgefill-gguf eval``: the quality report of docs/design.md §9, on libllama's own prefill paths.

Every figure compares filled-row prefill with exact prefill of the same model and prompt, run in
one context of the patched llama.cpp:

* **ΔNLL on the tail** (the last T prompt rows, whose logits RidgeFill computes exactly): all
  tokens, *novel* tokens (their 8-token run does not occur earlier in the prompt) and *key* tokens
  (exact loss rises by more than 2 nats when the context is cut to the last K tokens, K scaled to
  the model, :func:`metrics.scaled_key_cut`), per document, with bootstrap CIs over documents;
  perplexity ratios ``exp(ΔNLL)``.
* **Splice test**: the same RidgeFill run with the filled rows' late-layer K, or V, replaced by the
  exact ones (an exact prefill first fills the same cells; ``splice`` keeps them), and the share of
  the fill's ΔNLL each removes.
* **Filled-region retrieval**: a fact ("The access code for NAME is 12345.") planted at several
  depths of the prefix, asked for in the tail; greedy answer; exact vs identity vs ridge, with the
  planted row filled (selector none) and with the selector on. With ``codes`` > 1 each prompt holds
  that many facts of different names (the others are distractors spread over the rows before the
  asked-for one), and answers naming a distractor's code are counted apart.
* **Speed of the same runs**: median exact prefill time over median RidgeFill prefill time, with a
  warning where it is above the plan's ceiling 1/r (:func:`bench.timing_warnings`: noise).
* **Split sweep**: with map files for several splits, ΔNLL and speed per split.
* **Map comparison**: other map files for the main split (e.g. fitted on longer windows, other
  text): each is a ridge variant with a paired ΔNLL difference against the main maps and a
  retrieval condition.

Texts: the evaluation split of the default corpus (Python's reference documentation and stdlib
sources, PSF-2.0; disjoint from the calibration split ``fit`` uses) and the licence texts in
``/usr/share/common-licenses`` (English legal prose; verbatim copies permitted), or the caller's
files. The library never prints; ``progress(done, total, what)`` reports runs.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core.machine import measured_on
from ..fitting import capture
from . import metrics
from ..core import settings
from .bench import greedy_continuation, timing_warnings
from ..fitting.corpus import default_documents, default_source_description
from ..fitting.fit import bos_prefix
from ..core.gguf_model import read_model_info
from ..maps.mapfile import MapFileError, fitting_map_metas, map_file_splits
from ..runtime.prefill import Llama, RidgeFill

LICENCE_DIR = Path("/usr/share/common-licenses")
LICENCE_NOTE = ("licence texts in /usr/share/common-licenses (Debian base-files; each licence permits verbatim "
                "copies of its text)")
KINDS = ("documentation", "code", "prose")
NAMES = ("Laura", "Tomas", "Ingrid", "Mateo", "Priya", "Kofi", "Hana", "Oskar", "Amara", "Yusuf", "Elena", "Ravi")


@dataclass
class EvalOptions:
    lengths: list[int] = field(default_factory=lambda: list(settings.EVAL_LENGTHS))
    tail: int = settings.TAIL
    exact_fraction: float = settings.EXACT_FRACTION
    selector: str = settings.SELECTOR
    value_rescale: int = settings.VALUE_RESCALE
    n_docs: int = settings.EVAL_DOCS  # documents per length (spread over the kinds); 0: retrieval only
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    names_per_depth: int = 2         # retrieval prompts per depth
    codes: int = 1                   # facts per retrieval prompt: the one asked for at the depth, the
                                     #   others (other names: distractors) spread over the rows before it
    splice: bool = True
    n_boot: int = 2000
    seed: int = 0
    n_threads: int | None = None
    n_gpu_layers: int = 0            # layers offloaded to a GPU (-1: all), as llama.cpp's -ngl
    n_batch: int = settings.N_BATCH
    min_prompt: int = 0              # fill variants run stock prefill below it (tests: exact vs exact)
    key_rescale: int = settings.KEY_RESCALE  # > 0: also the variant "ridge + key rescale" (c_K rows; issue #8)
    selectors: tuple[str, ...] = ()  # more selector variants of ridge at the first split ("probe",
                                     #   "protected", "protected:digits+rare", ...; settings.parse_selector)
    queries: tuple[int, ...] = ()    # more query-row counts of the attention and probe selectors
                                     #   (n_queries), each a variant of ridge at the first split
    swa_full: bool = True            # sliding-window layers (gemma3, gpt-oss): a full-size KV cache (libllama's
                                     #   default) or a window-sized one (llama-server's default)

    @classmethod
    def quick(cls, **kw) -> "EvalOptions":
        """A smoke run: one length, few documents and prompts (:data:`settings.EVAL_QUICK`)."""
        base = dict(settings.EVAL_QUICK, lengths=list(settings.EVAL_QUICK["lengths"]))
        base.update(kw)
        return cls(**base)

    def check(self) -> None:
        """Every setting that reaches RidgeFill (ValueError naming what is wrong)."""
        for spec in (self.selector, *self.selectors):
            settings.parse_selector(spec)
        for name in ("tail", "exact_fraction", "value_rescale", "key_rescale", "min_prompt"):
            settings.check(name, getattr(self, name))
        if len(set(self.selectors)) != len(self.selectors):
            raise ValueError(f"a selector variant is listed twice: {', '.join(self.selectors)}")
        for q in self.queries:
            settings.check("n_queries", q, label="query rows")
        if len(set(self.queries)) != len(self.queries) or settings.N_QUERIES in self.queries:
            raise ValueError(f"query rows {', '.join(map(str, self.queries))}: each once, and not the "
                             f"default {settings.N_QUERIES} (plain ridge)")
        if not (isinstance(self.n_docs, int) and (self.n_docs == 0 or self.n_docs >= 2)):
            raise ValueError(f"documents per length {self.n_docs!r}: 0 (retrieval only) or an integer >= 2")
        if not self.depths or any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
            raise ValueError(f"retrieval depths {self.depths!r}: one or more shares of the filled region, in [0, 1]")
        if not (isinstance(self.names_per_depth, int) and self.names_per_depth >= 1):
            raise ValueError(f"retrieval prompts per depth {self.names_per_depth!r} must be an integer >= 1")
        if not (isinstance(self.codes, int) and 1 <= self.codes <= len(NAMES)):
            raise ValueError(f"codes {self.codes!r}: facts per retrieval prompt must be an integer in 1..{len(NAMES)}")

    def ridgefill(self, maps: os.PathLike | str | None, split: int, selector: str | None = None,
                  **kw) -> RidgeFill:
        """The RidgeFill of a fill variant: these options' T, fraction, value rescale and min
        prompt, ``selector`` (a spec; default: these options' selector) and ``kw``. No key rescale
        unless ``kw`` gives one (a map file's tuned c_K is the variant "ridge + key rescale")."""
        return RidgeFill(maps, split=split, tail=self.tail, exact_fraction=self.exact_fraction,
                         value_rescale=self.value_rescale, min_prompt=self.min_prompt,
                         **{"key_rescale": 0, **settings.parse_selector(selector or self.selector), **kw})


def lever_name(spec: str) -> str:
    """The variant / retrieval-condition name of ridge with selector ``spec``."""
    return f"ridge, {spec} selector"


def queries_name(n_queries: int) -> str:
    """The variant / retrieval-condition name of ridge whose selector scores ``n_queries`` query rows."""
    return f"ridge, {n_queries} query rows"


@dataclass
class EvalDocument:
    name: str
    kind: str
    tokens: list[int]  # N + 1 tokens: the prompt and the token after it


# ------------------------------------------------------------------------------------------------
# texts


def licence_documents() -> list[tuple[str, str]]:
    """(name, text) of the distinct licence texts on this machine (symlinks resolved)."""
    if not LICENCE_DIR.is_dir():
        return []
    seen, out = set(), []
    for p in sorted(LICENCE_DIR.iterdir()):
        real = p.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        try:
            out.append((f"licence:{real.name}", real.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def default_texts() -> dict[str, list[tuple[str, str]]]:
    """kind -> [(name, text)] of the default evaluation texts, in a fixed order."""
    docs: dict[str, list[tuple[str, str]]] = {k: [] for k in KINDS}
    for d in default_documents("evaluation"):
        docs["documentation" if d.kind == "prose" else "code"].append((d.name, d.text))
    docs["prose"] = licence_documents()
    return {k: v for k, v in docs.items() if v}


def text_sources(texts: dict[str, list[tuple[str, str]]]) -> list[str]:
    out = []
    if "documentation" in texts or "code" in texts:
        out.append(default_source_description("evaluation"))
    if "prose" in texts:
        out.append(LICENCE_NOTE)
    if "text" in texts:
        out.append("the caller's files: " + ", ".join(n for n, _ in texts["text"][:8]))
    return out


def build_documents(tokenize: Callable[[str], list[int]], bos: list[int], texts: dict[str, list[tuple[str, str]]],
                    n_tokens: int, n_docs: int) -> list[EvalDocument]:
    """``n_docs`` documents of ``n_tokens + 1`` tokens, round-robin over the kinds; a text shorter
    than that is continued with the next texts of its kind (joined by a blank line)."""
    kinds = list(texts)
    cursors = {k: 0 for k in kinds}
    out: list[EvalDocument] = []
    exhausted: set[str] = set()
    while len(out) < n_docs and len(exhausted) < len(kinds):
        for kind in kinds:
            if len(out) >= n_docs or kind in exhausted:
                continue
            pool = texts[kind]
            toks = list(bos)
            names = []
            while len(toks) < n_tokens + 1 and cursors[kind] < len(pool):
                name, text = pool[cursors[kind]]
                cursors[kind] += 1
                toks += tokenize(("\n\n" if names else "") + text)
                names.append(name)
            if len(toks) < n_tokens + 1:
                exhausted.add(kind)
                continue
            label = names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else "")
            out.append(EvalDocument(label, kind, toks[: n_tokens + 1]))
    if not out:
        raise ValueError(f"the texts hold no {n_tokens + 1}-token document")
    return out


# ------------------------------------------------------------------------------------------------
# prefill with tail logits


def open_context(model: os.PathLike | str, n_ctx: int, n_batch: int, n_threads: int | None,
                 ridgefill: RidgeFill, swa_full: bool = True, n_gpu_layers: int = 0) -> Llama:
    """The one context ``eval`` and ``tune`` measure every variant in (F16 cache, flash attention,
    ``swa_full``: the sliding-window layers' cache full-size or window-sized), created with
    ``ridgefill`` attached; each run then sets its own settings (:func:`timed_prefill`)."""
    return capture.open_model(model, n_ctx=n_ctx, n_batch=n_batch, kv_f32=False, n_threads=n_threads,
                              n_gpu_layers=n_gpu_layers, ridgefill=ridgefill, swa_full=swa_full)


def timed_prefill(llm: Llama, ridgefill: RidgeFill | None, tokens: Sequence[int],
                  n_logits: int) -> tuple[np.ndarray, float]:
    """Prefill ``tokens`` as a fresh sequence (:meth:`Llama.reset`) with ``ridgefill`` (None: exact
    prefill; set unless it is already the one in use): the logits of the last ``n_logits`` rows
    [n_logits, n_vocab] and the seconds it took."""
    if llm.ridgefill is not ridgefill:
        llm.set_ridgefill(ridgefill)
    llm.reset()
    t0 = time.perf_counter()
    logits = llm.prefill(tokens, n_logits)
    return logits, time.perf_counter() - t0


def text_tokenizer(llm: Llama) -> Callable[[str], list[int]]:
    """Text -> token ids of ``llm``'s vocabulary, no BOS, no special tokens (the documents' pieces)."""
    return lambda text: llm.tokenize(text.encode(), add_bos=False, special=False)


class Ticker:
    """Counts the runs of a measurement and reports each: ``progress(done, total, what)``."""

    def __init__(self, total: int, progress: Callable[[int, int, str], None] | None):
        self.total, self.done, self.progress = total, 0, progress

    def __call__(self, what: str) -> None:
        self.done += 1
        if self.progress:
            self.progress(self.done, self.total, what)


def plan_summary(llm: Llama, split: int) -> dict:
    """The ceiling and exact / filled rows of the last prefill (ceiling 1 when it ran stock)."""
    st = llm.ridgefill_stats
    if not st:
        return {"ceiling": 1.0, "split": split}
    return {"ceiling": float(st["ceiling"]), "n_exact": st["n_exact"], "n_filled": st["n_filled"], "split": split}


# ------------------------------------------------------------------------------------------------
# the evaluation


@dataclass
class EvalResult:
    model: str
    maps: list[str]
    splits: list[int]           # split of each map file
    architecture: str
    n_layer: int
    options: dict
    sources: list[str]
    key_cut: dict               # length -> {"k": K, "note": ...}
    # length -> variant -> list of per-document records {"doc", "kind", "all": [mean, n], "novel": ..., "key": ...}
    docs: dict = field(default_factory=dict)
    # length -> variant -> list of prefill seconds
    times: dict = field(default_factory=dict)
    # length -> variant -> {"all"|"novel"|"key": CI as dict}
    summary: dict = field(default_factory=dict)
    # length -> {"K"|"V": CI of the splice share, per metric}
    splice: dict = field(default_factory=dict)
    # length -> condition -> {"by_depth": {depth: [correct...]}, "accuracy": CI}
    retrieval: dict = field(default_factory=dict)
    # length -> variant -> {"ceiling": ..., "n_exact": ...}
    plans: dict = field(default_factory=dict)
    # length -> lever variant -> {"all"|"novel"|"key": CI of (variant ΔNLL − ridge ΔNLL), paired by document}
    paired: dict = field(default_factory=dict)
    # variant name -> map file of the map comparison (other maps for the first split)
    compared_maps: dict = field(default_factory=dict)
    elapsed_s: float | None = None   # wall time of the whole evaluation
    measured: dict = field(default_factory=dict)  # core.machine.measured_on: date, CPU, threads, versions

    def ttft_ratio(self, n: int, variant: str) -> float:
        return statistics.median(self.times[str(n)]["exact"]) / statistics.median(self.times[str(n)][variant])

    def ceiling(self, n: int | str, variant: str) -> float | None:
        """The plan ceiling 1/r of a variant at one length (a splice variant's is plain ridge's; None
        where no plan was recorded, e.g. exact)."""
        plans = self.plans.get(str(n), {})
        plan = plans.get(variant, plans.get("ridge" if variant.startswith("ridge,") else variant, {}))
        return plan.get("ceiling")

    def timing_warnings(self) -> list[dict]:
        """Speeds above their ceiling (:func:`bench.timing_warnings`), by length. A variant's times
        are of different documents, each timed once, not repeats of one prompt: only the ceiling
        rule applies."""
        return [w for n, times in self.times.items()
                for w in timing_warnings(times, {v: self.ceiling(n, v) for v in times}, base="exact",
                                         n_prompt=int(n), repeats=False, more=None)]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["timing_warnings"] = self.timing_warnings()
        return d


def _variant_name(split: int, first_split: int, kind: str = "ridge") -> str:
    return kind if split == first_split else f"{kind} S={split}"


def maps_variant_names(maps: Sequence[os.PathLike | str], model: os.PathLike | str) -> list[str]:
    """The variant name of each map file of a comparison (all for the split of the first, whose
    variant is plain ``ridge``): ``ridge (LABEL)``, LABEL saying how its calibration differs from
    the first file's (window rows, tokens, text, objective), else its file name. Raises
    :class:`MapFileError` when a file does not fit ``model`` or is for another split."""
    resolved = [Path(m).resolve() for m in maps]
    if len(set(resolved)) != len(resolved):
        raise MapFileError("a map file is listed twice: " + ", ".join(str(m) for m in maps))
    metas = fitting_map_metas(maps, model)
    for m, meta in zip(maps, metas):
        if meta.split_layer != metas[0].split_layer:
            raise MapFileError(f"{m}: maps for S = {meta.split_layer}; a comparison needs maps for the main "
                               f"split (S = {metas[0].split_layer})")
    first, names = metas[0], ["ridge"]
    for m, meta in zip(maps[1:], metas[1:]):
        diff = [f"{meta.calib_windows}-row windows" if meta.calib_windows != first.calib_windows else "",
                f"{meta.calib_n_tokens} tokens" if meta.calib_n_tokens != first.calib_n_tokens else "",
                f"text {meta.calib_source}" if meta.calib_source != first.calib_source else "",
                f"{meta.objective} objective" if meta.objective != first.objective else ""]
        label = ", ".join(d for d in diff if d) or Path(m).name
        name = f"ridge ({label})"
        names.append(name if name not in names else f"ridge ({Path(m).name}, {label})")
    return names


def evaluate(model: os.PathLike | str, maps: Sequence[os.PathLike | str], options: EvalOptions | None = None,
             texts: dict[str, list[tuple[str, str]]] | None = None,
             progress: Callable[[int, int, str], None] | None = None,
             compare_maps: Sequence[os.PathLike | str] = ()) -> EvalResult:
    """Run the evaluation (see the module docstring). ``maps``: one map file, or several (one per
    split: the first is the main setting, the others form the split sweep). ``compare_maps``: other
    map files for the first one's split, each a ridge variant (:func:`maps_variant_names`) with a
    paired ΔNLL difference against the first and a retrieval condition with the attention selector."""
    options = options or EvalOptions()
    if not maps:
        raise ValueError("eval needs a map file (--maps)")
    options.check()  # what reaches the C parameters of every prefill (int32: no silent wrap-around)
    info = read_model_info(model)
    splits = map_file_splits(maps, model)
    compared = dict(zip(maps_variant_names([maps[0], *compare_maps], model)[1:], compare_maps))
    lengths = sorted({int(n) for n in options.lengths})
    if not lengths or lengths[0] < 4 * options.tail:
        raise ValueError(f"prompt lengths must be at least 4 x the tail ({4 * options.tail})")
    if info.context_length and lengths[-1] + 16 > info.context_length:
        raise ValueError(f"a {lengths[-1]}-token prompt (plus the answer) is longer than the model's context "
                         f"({info.context_length})")
    texts = texts if texts is not None else default_texts()
    if not texts:
        raise ValueError("no evaluation text")

    S0 = splits[0]
    res = EvalResult(model=str(model), maps=[str(m) for m in maps], splits=splits, architecture=info.architecture,
                     n_layer=info.n_layer, options=asdict(options), sources=text_sources(texts), key_cut={},
                     compared_maps={name: str(m) for name, m in compared.items()},
                     measured=measured_on(options.n_threads, options.n_gpu_layers))
    T = options.tail
    # hybrids: the late recurrent layers, whose boundary state the splice test also replaces
    rec_layers = [il for il in info.recurrent_layers if il >= S0]
    # the fill variants (name -> RidgeFill), in the order each document runs them
    ridge = options.ridgefill(maps[0], S0)
    fills = {"ridge": ridge, "identity": options.ridgefill(None, S0)}
    fills.update({_variant_name(s, S0): options.ridgefill(m, s) for m, s in zip(maps[1:], splits[1:])})
    fills.update({name: options.ridgefill(m, S0) for name, m in compared.items()})
    if options.key_rescale > 0:
        fills["ridge + key rescale"] = options.ridgefill(maps[0], S0, key_rescale=options.key_rescale)
    fills.update({lever_name(x): options.ridgefill(maps[0], S0, x) for x in options.selectors})
    fills.update({queries_name(q): options.ridgefill(maps[0], S0, n_queries=q) for q in options.queries})
    levers = (list(compared) + (["ridge + key rescale"] if options.key_rescale > 0 else [])
              + [lever_name(x) for x in options.selectors] + [queries_name(q) for q in options.queries])
    splices = {"ridge, exact K": options.ridgefill(maps[0], S0, splice="K"),
               "ridge, exact V": options.ridgefill(maps[0], S0, splice="V")} if options.splice else {}
    variants = list(fills) + list(splices) + (["ridge, exact state"] if options.splice and rec_layers else [])
    # exact, cut, the fills, (exact + splice) x (K, V[, state])
    per_doc_runs = 2 + len(fills) + 2 * (len(variants) - len(fills))
    conditions = _retrieval_conditions(options, maps[0], S0, compared)
    n_retr = len(options.depths) * options.names_per_depth
    tick = Ticker(len(lengths) * (options.n_docs * per_doc_runs + n_retr * len(conditions)), progress)
    llm = open_context(model, lengths[-1] + 16, options.n_batch, options.n_threads, ridge, options.swa_full,
                       options.n_gpu_layers)
    try:
        bos = bos_prefix(llm)
        tokenize = text_tokenizer(llm)

        for n in lengths:
            key = str(n)
            if options.n_docs == 0:  # retrieval only
                res.retrieval[key] = planted_code_retrieval(llm, tokenize, bos, texts, n, options, conditions, tick)
                continue
            docs = build_documents(tokenize, bos, texts, n, options.n_docs)
            kc = metrics.scaled_key_cut(info.context_length or n, n - T)
            res.key_cut[key] = {"k": kc.k, "note": kc.note}
            recs = {v: [] for v in ["exact"] + variants}
            times = {v: [] for v in ["exact"] + variants}
            plans: dict[str, dict] = {}
            for d in docs:
                prompt, targets = d.tokens[:n], d.tokens[n - T + 1:n + 1]
                novel = metrics.novel_token_mask(d.tokens, n - T + 1)
                logits, dt = timed_prefill(llm, None, prompt, T)
                nll_exact = metrics.nll(logits, targets)
                times["exact"].append(dt)
                tick("exact")
                cut_tokens = bos + prompt[n - T - kc.k + 1:] if kc.k < n - T else prompt
                logits, _ = timed_prefill(llm, None, cut_tokens, T)
                nll_cut = metrics.nll(logits, targets)
                keym = metrics.key_token_mask(nll_exact, nll_cut)
                tick("cut context")
                masks = {"all": None, "novel": novel, "key": keym}
                recs["exact"].append({"doc": d.name, "kind": d.kind, "n_novel": int(novel.sum()), "n_key": int(keym.sum()),
                                      "nll_exact": nll_exact.tolist()})

                def scored(variant: str, logits: np.ndarray, dt: float) -> None:
                    nll = metrics.nll(logits, targets)
                    r = {"doc": d.name, "kind": d.kind}
                    for mname, m in masks.items():
                        r[mname] = list(metrics.document_delta(nll, nll_exact, m))
                    recs[variant].append(r)
                    times[variant].append(dt)

                for variant, rf in fills.items():
                    logits, dt = timed_prefill(llm, rf, prompt, T)
                    scored(variant, logits, dt)
                    if variant not in plans:
                        plans[variant] = plan_summary(llm, rf.split)
                    tick(variant)
                for variant, rf in splices.items():
                    timed_prefill(llm, None, prompt, T)  # exact K/V into the cells
                    llm.forget_cells()
                    tick("exact (splice source)")
                    scored(variant, *timed_prefill(llm, rf, prompt, T))
                    tick(variant)
                if splices and rec_layers:
                    # the late recurrent layers' tails start from the exact prefix's states
                    timed_prefill(llm, None, prompt[:n - T], 1)
                    states = {il: llm.read_state(il) for il in rec_layers}
                    tick("exact prefix (splice source)")
                    llm.set_ridgefill(ridge)
                    for il, st in states.items():
                        llm.ridgefill_splice_state(il, st)
                    scored("ridge, exact state", *timed_prefill(llm, ridge, prompt, T))
                    llm.ridgefill_splice_state(None)
                    tick("ridge, exact state")
            res.docs[key] = recs
            res.times[key] = times
            res.plans[key] = plans
            res.summary[key] = _summarise(recs, variants, options)
            res.paired[key] = _paired(recs, levers, options)
            if splices:
                res.splice[key] = _splice_shares(recs, options)
            res.retrieval[key] = planted_code_retrieval(llm, tokenize, bos, texts, n, options, conditions, tick)
    finally:
        llm.close()
    return res


def _summarise(recs: dict, variants: list[str], options: EvalOptions) -> dict:
    out = {}
    for v in variants:
        out[v] = {}
        for m in ("all", "novel", "key"):
            vals, wts = _per_doc(recs, v, m), _per_doc(recs, v, m, weights=True)
            keep = wts > 0
            if not keep.any():
                out[v][m] = None
                continue
            ci = metrics.bootstrap_ci(vals[keep], wts[keep], n_boot=options.n_boot, seed=options.seed)
            ppl = metrics.perplexity_ratio_ci(ci)
            out[v][m] = {"delta": ci._asdict(), "ppl_ratio": ppl._asdict(), "tokens": int(wts.sum())}
    return out


def _per_doc(recs: dict, variant: str, metric: str, weights: bool = False) -> np.ndarray:
    """Per-document ΔNLL means of a variant for one metric (``weights``: their token counts)."""
    return np.array([r[metric][1 if weights else 0] for r in recs[variant]], dtype=np.float64)


def _paired(recs: dict, levers: list[str], options: EvalOptions) -> dict:
    """Each lever's ΔNLL minus the plain ridge fill's, per document (the same tokens), token-weighted,
    with a bootstrap CI over documents: below 0 = the lever helps."""
    out = {}
    for v in levers:
        out[v] = {}
        for m in ("all", "novel", "key"):
            base, lev, wts = _per_doc(recs, "ridge", m), _per_doc(recs, v, m), _per_doc(recs, "ridge", m, weights=True)
            keep = wts > 0
            if not keep.any():
                out[v][m] = None
                continue
            ci = metrics.bootstrap_ci(lev[keep] - base[keep], wts[keep], n_boot=options.n_boot, seed=options.seed)
            out[v][m] = ci._asdict()
    return out


def _splice_shares(recs: dict, options: EvalOptions) -> dict:
    out = {}
    for name, v in (("K", "ridge, exact K"), ("V", "ridge, exact V"), ("state", "ridge, exact state")):
        if v not in recs:
            continue
        out[name] = {}
        for m in ("all", "novel", "key"):
            fill, spl, wts = _per_doc(recs, "ridge", m), _per_doc(recs, v, m), _per_doc(recs, "ridge", m, weights=True)
            keep = wts > 0
            if not keep.any() or not (np.average(fill[keep], weights=wts[keep]) > 0):
                out[name][m] = None
                continue
            ci = metrics.splice_share_ci(fill[keep], spl[keep], wts[keep], n_boot=options.n_boot, seed=options.seed)
            out[name][m] = ci._asdict()
    return out


def _retrieval_conditions(options: EvalOptions, maps_path, split: int,
                          compared: dict[str, os.PathLike | str] | None = None) -> dict[str, RidgeFill | None]:
    """The retrieval conditions (name -> RidgeFill; None: exact prefill): ridge and identity fill
    with the planted row filled (selector none) and with the attention selector (with the span of
    ``options.selector`` when it gives one, e.g. ``attention@1``), ridge with each map file of
    ``compared`` (variant name -> path) and the attention selector, ridge with the key rescale
    (``options.key_rescale`` > 0) and the attention selector, then each lever selector of
    ``options.selectors`` with ridge, then ridge with each query-row count of ``options.queries``."""
    span = settings.parse_selector(options.selector).get("span")
    attention = "attention" if span is None else f"attention@{span}"
    conditions = {"exact": None}
    for which, path in (("ridge", maps_path), ("identity", None)):
        conditions[f"{which}, planted row filled"] = options.ridgefill(path, split, "none")
        conditions[f"{which}, {attention} selector"] = options.ridgefill(path, split, attention)
    for name, path in (compared or {}).items():
        conditions[f"{name}, {attention} selector"] = options.ridgefill(path, split, attention)
    if options.key_rescale > 0:
        conditions[f"ridge + key rescale, {attention} selector"] = options.ridgefill(
            maps_path, split, attention, key_rescale=options.key_rescale)
    for spec in options.selectors:
        conditions.setdefault(lever_name(spec), options.ridgefill(maps_path, split, spec))
    for q in options.queries:
        conditions[queries_name(q)] = options.ridgefill(maps_path, split, n_queries=q)
    return conditions


def distractor_depths(depth: float, codes: int) -> list[float]:
    """Where the ``codes - 1`` distractor facts of a prompt whose asked-for fact is at ``depth`` go:
    evenly spaced before it, from depth 0.02 on. Before and not after: exact prefill itself answers
    with a later fact's code (recency), so distractors after the fact would test the model, not the
    fill (docs/retrieval-codes-smollm2)."""
    lo = min(0.02, depth)
    return [lo + (depth - lo) * i / (codes - 1) for i in range(codes - 1)] if codes > 1 else []


def plant_facts(bos: list[int], filler: Sequence[int], facts: Sequence[tuple[float, list[int]]],
                question: list[int], n: int, tail: int) -> list[int]:
    """An ``n``-token prompt: ``bos``, filler text with each fact (depth in [0, 1], tokens) inserted
    at that depth of the region before the tail, and ``question`` at the end (inside the tail)."""
    if len(question) >= tail:
        raise ValueError(f"the retrieval question ({len(question)} tokens) does not fit the tail ({tail})")
    n_facts = sum(len(f) for _, f in facts)
    body = n - len(bos) - n_facts - len(question)
    region = n - tail - len(bos) - n_facts  # filler rows before the tail
    if body < 0 or region < 0 or len(filler) < body:
        raise ValueError(f"{len(facts)} facts and the question do not fit a {n}-token prompt")
    toks, at = list(bos), 0
    for depth, fact in sorted(facts, key=lambda f: f[0]):
        cut = max(at, min(int(round(depth * region)), region))
        toks += list(filler[at:cut]) + list(fact)
        at = cut
    toks += list(filler[at:body]) + list(question)
    assert len(toks) == n
    return toks


def retrieval_question(name: str) -> str:
    """The retrieval prompt's question about ``name``'s code, at the end of the prompt (in the tail)."""
    return f"\n\nQuestion: What is the access code for {name}?\nAnswer: The access code for {name} is"


def check_retrieval_tail(tokenize, tail: int) -> None:
    """ValueError unless every retrieval question fits a tail of ``tail`` rows."""
    longest = max(len(tokenize(retrieval_question(name))) for name in NAMES)
    if longest >= tail:
        raise ValueError(f"the retrieval question ({longest} tokens) does not fit a tail of {tail} rows: use a tail "
                         f"of at least {longest + 1}")


def planted_code_retrieval(llm: Llama, tokenize, bos, texts, n: int, options: EvalOptions,
               conditions: dict[str, RidgeFill | None], tick: Ticker) -> dict:
    """Planted-fact prompts: the fact in the filled region at each depth, the question in the tail
    (with ``options.codes`` > 1, the facts of other names elsewhere in the filled region)."""
    rng = np.random.default_rng(options.seed + n)
    kind = "documentation" if "documentation" in texts else next(iter(texts))
    filler_docs = build_documents(tokenize, [], {kind: texts[kind]}, n, 1)
    filler = filler_docs[0].tokens
    prompts, answers, others, depths = [], [], [], []
    names = list(NAMES)
    for depth in options.depths:
        for j in range(options.names_per_depth):
            who = [names[(len(prompts) + i) % len(names)] for i in range(options.codes)]
            codes: list[str] = []  # distinct; with one code, the draws of the single-fact test
            while len(codes) < options.codes:
                code = f"{int(rng.integers(10000, 100000))}"
                codes += [code] if code not in codes else []
            facts = [(d, tokenize(f" The access code for {name} is {code}. "))
                     for d, name, code in zip([depth, *distractor_depths(depth, options.codes)], who, codes)]
            question = tokenize(retrieval_question(who[0]))
            prompts.append(plant_facts(bos, filler, facts, question, n, options.tail))
            answers.append(codes[0])
            others.append(codes[1:])
            depths.append(depth)
    out = {}
    for cond, rf in conditions.items():
        preds = []
        for toks in prompts:
            logits, _ = timed_prefill(llm, rf, toks, 1)
            preds.append(llm.detokenize(greedy_continuation(llm, logits[-1], 8)).decode(errors="replace"))
            tick(f"retrieval ({cond})")
        correct = metrics.retrieval_correct(preds, answers)
        if rf is None:  # exact prefill, the first condition: what the others are kept against
            exact = correct
        # a wrong answer that names another planted code: the model read the wrong fact
        confused = [not c and any(o in p for o in other) for p, c, other in zip(preds, correct, others)]
        by_depth: dict[str, list[bool]] = {}
        for dep, c in zip(depths, correct):
            by_depth.setdefault(f"{dep:g}", []).append(bool(c))
        acc = metrics.bootstrap_ci(correct.astype(np.float64), n_boot=options.n_boot, seed=options.seed)
        out[cond] = {"by_depth": by_depth, "accuracy": acc._asdict(), "predictions": preds, "answers": answers,
                     "codes": options.codes, "distractor_answers": int(sum(confused)), "correct": correct.tolist(),
                     # of the prompts exact prefill answers, those this condition answers too
                     "kept": [int((correct & exact).sum()), int(exact.sum())]}
    return out

