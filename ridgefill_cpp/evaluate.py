"""``ridgefill-gguf eval``: the quality report of docs/method.md §9, on libllama's own prefill paths.

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
  planted row filled (selector none) and with the selector on.
* **Speed of the same runs**: median exact prefill time over median RidgeFill prefill time.
* **Split sweep**: with map files for several splits, ΔNLL and speed per split.

Texts: the evaluation split of the default corpus (Python's reference documentation and stdlib
sources, PSF-2.0; disjoint from the calibration split ``fit`` uses) and the licence texts in
``/usr/share/common-licenses`` (English legal prose; verbatim copies permitted), or the caller's
files. The library never prints; ``progress(done, total, what)`` reports runs.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import metrics
from .fit import bos_prefix

LICENCE_DIR = Path("/usr/share/common-licenses")
LICENCE_NOTE = ("licence texts in /usr/share/common-licenses (Debian base-files; each licence permits verbatim "
                "copies of its text)")
KINDS = ("documentation", "code", "prose")
NAMES = ("Laura", "Tomas", "Ingrid", "Mateo", "Priya", "Kofi", "Hana", "Oskar", "Amara", "Yusuf", "Elena", "Ravi")


@dataclass
class EvalOptions:
    lengths: list[int] = field(default_factory=lambda: [2048])
    tail: int = 64
    exact_fraction: float = 0.10
    selector: str = "attention"
    value_rescale: int = 512
    n_docs: int = 12                 # documents per length (spread over the kinds)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7)
    names_per_depth: int = 2         # retrieval prompts per depth
    splice: bool = True
    n_boot: int = 2000
    seed: int = 0
    n_threads: int | None = None
    n_batch: int = 512
    min_prompt: int = 0              # fill variants run stock prefill below it (tests: exact vs exact)
    key_rescale: int = 0             # > 0: also the variant "ridge + key rescale" (c_K rows; issue #8)
    selectors: tuple[str, ...] = ()  # more selector variants of ridge at the first split ("probe",
                                     #   "protected", "protected:digits+rare", ...; see parse_selector)

    @classmethod
    def quick(cls, **kw) -> "EvalOptions":
        """A smoke run: one length, few documents and prompts (a few minutes on SmolLM2)."""
        base = dict(lengths=[1024], n_docs=4, depths=(0.2, 0.6), names_per_depth=1, n_boot=500)
        base.update(kw)
        return cls(**base)


def parse_selector(spec: str) -> tuple[int, int | None]:
    """A selector spec -> (C selector, protected classes or None): ``attention``, ``probe``, ``none``,
    ``protected`` / ``attention+protected`` (the default classes) or with ``:CLASS+CLASS`` (sink,
    digits, rare, line_start)."""
    from .prefill import DEFAULT_PROTECTED, SELECTORS, protected_mask

    name, _, classes = spec.partition(":")
    uses_classes = name in ("protected", "attention+protected")
    if name not in SELECTORS or (classes and not uses_classes):
        raise ValueError(f"selector {spec!r}: use one of {', '.join(SELECTORS)}, or protected:CLASS+CLASS")
    if not uses_classes:
        return SELECTORS[name], None
    return SELECTORS[name], protected_mask(classes.split("+") if classes else DEFAULT_PROTECTED)


def lever_name(spec: str) -> str:
    """The variant / retrieval-condition name of ridge with selector ``spec``."""
    return f"ridge, {spec} selector"


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
    from .corpus import default_documents

    docs: dict[str, list[tuple[str, str]]] = {k: [] for k in KINDS}
    for d in default_documents("evaluation"):
        docs["documentation" if d.kind == "prose" else "code"].append((d.name, d.text))
    docs["prose"] = licence_documents()
    return {k: v for k, v in docs.items() if v}


def text_sources(texts: dict[str, list[tuple[str, str]]]) -> list[str]:
    out = []
    if "documentation" in texts or "code" in texts:
        from .corpus import default_source_description

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


class _Runner:
    """One context of the model; RidgeFill attached and detached per run through the C API."""

    def __init__(self, model: os.PathLike | str, info, n_ctx: int, options: EvalOptions):
        from . import _native as N
        from .prefill import Llama

        self.N = N
        self.info = info
        self.llm = Llama(str(model), n_ctx=n_ctx, n_batch=options.n_batch, n_ubatch=options.n_batch,
                         n_threads=options.n_threads, n_threads_batch=options.n_threads, verbose=False,
                         flash_attn=True, swa_full=True if self.info.architecture == "gemma3" else None)
        self.ctx = self.llm._ctx.ctx
        self.n_vocab = self.llm.n_vocab()
        self.maps: dict[str, object] = {}

    def close(self) -> None:
        self.N.llama_ridgefill_detach(self.ctx)
        for m in self.maps.values():
            m.close()
        self.llm.close()

    def native_maps(self, path):
        from .native_maps import NativeMaps

        key = str(path)
        if key not in self.maps:
            self.maps[key] = NativeMaps(self.llm._model.model, path, model_path=self.info.path)
        return self.maps[key]

    def attach(self, maps_path, split: int, options: EvalOptions, selector: str | None = None, splice: int = 0,
               key_rescale: int = 0) -> None:
        N = self.N
        p = N.llama_ridgefill_default_params()
        p.split_layer = split
        p.n_tail = options.tail
        p.exact_fraction = options.exact_fraction
        p.selector, classes = parse_selector(selector or options.selector)
        if classes is not None:
            p.protected_classes = classes
        p.n_rescale = options.value_rescale
        p.min_prompt = options.min_prompt
        p.splice = splice
        p.n_key_rescale = key_rescale
        maps = self.native_maps(maps_path).handle if maps_path is not None else None
        if N.llama_ridgefill_attach(self.ctx, maps, p) != 0:
            raise ValueError(N.llama_ridgefill_last_error().decode(errors="replace"))

    def detach(self) -> None:
        self.N.llama_ridgefill_detach(self.ctx)

    def clear_cells(self) -> None:
        """Forget the cache's cells but keep their data (the splice test's exact K/V)."""
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), False)
        self.llm.reset()

    def prefill(self, tokens: Sequence[int], n_logits: int, plan: bool) -> tuple[np.ndarray, float]:
        """Prefill ``tokens`` (a fresh sequence) and return the logits of the last ``n_logits`` rows
        [n_logits, n_vocab] and the prefill time. ``plan``: through RidgeFill (attached)."""
        import llama_cpp

        llm, n = self.llm, len(tokens)
        cut = n - n_logits
        llm.reset()
        t0 = time.perf_counter()
        if plan:
            rc = self.N.llama_ridgefill_begin(self.ctx, 0, 0, n)
            if rc < 0:
                raise RuntimeError(self.N.llama_ridgefill_last_error().decode(errors="replace"))
        if cut > 0:
            llama_cpp.Llama.eval(llm, list(tokens[:cut]))
        llm._batch.set_batch(batch=list(tokens[cut:]), n_past=cut, logits_all=True)
        llm._ctx.decode(llm._batch)
        dt = time.perf_counter() - t0
        llm.input_ids[cut:n] = tokens[cut:]
        llm.n_tokens = n
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=(n_logits, self.n_vocab)).copy()
        return logits, dt

    def greedy(self, first_logits: np.ndarray, n: int) -> str:
        from .bench import greedy_continuation

        toks = greedy_continuation(self.llm, first_logits, n)
        return self.llm.detokenize(toks).decode(errors="replace")


def _nll(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x).sum(axis=1))
    return lse - x[np.arange(len(targets)), np.asarray(targets)]


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
    elapsed_s: float | None = None   # wall time of the whole evaluation

    def ttft_ratio(self, n: int, variant: str) -> float:
        return statistics.median(self.times[str(n)]["exact"]) / statistics.median(self.times[str(n)][variant])

    def as_dict(self) -> dict:
        return asdict(self)


def _variant_name(split: int, first_split: int, kind: str = "ridge") -> str:
    return kind if split == first_split else f"{kind} S={split}"


def evaluate(model: os.PathLike | str, maps: Sequence[os.PathLike | str], options: EvalOptions | None = None,
             texts: dict[str, list[tuple[str, str]]] | None = None,
             progress: Callable[[int, int, str], None] | None = None) -> EvalResult:
    """Run the evaluation (see the module docstring). ``maps``: one map file, or several (one per
    split: the first is the main setting, the others form the split sweep)."""
    from ._limits import check_fraction, check_int
    from .gguf_model import read_model_info
    from .mapfile import map_file_splits

    options = options or EvalOptions()
    if not maps:
        raise ValueError("eval needs a map file (--maps)")
    for spec in (options.selector, *options.selectors):
        parse_selector(spec)
    # what reaches the C parameters of every attach (int32: no silent wrap-around)
    check_int("tail", options.tail, 1)
    check_fraction("exact_fraction", options.exact_fraction)
    check_int("value_rescale", options.value_rescale, 0, hint="; 0 is off")
    check_int("key_rescale", options.key_rescale, 0, hint="; 0 is off")
    check_int("min_prompt", options.min_prompt, 0)
    if len(set(options.selectors)) != len(options.selectors):
        raise ValueError(f"a selector variant is listed twice: {', '.join(options.selectors)}")
    info = read_model_info(model)
    splits = map_file_splits(maps, model)
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
                     n_layer=info.n_layer, options=asdict(options), sources=text_sources(texts), key_cut={})
    T = options.tail
    # hybrids: the late recurrent layers, whose boundary state the splice test also replaces
    rec_layers = [il for il in info.recurrent_layers if il >= S0]
    n_splice = (2 + bool(rec_layers)) if options.splice else 0
    # exact, cut, ridge, identity, sweep, key rescale, (exact + splice) x (K, V[, state])
    per_doc_runs = 4 + len(splits) - 1 + (options.key_rescale > 0) + len(options.selectors) + 2 * n_splice
    conditions = ["exact", "ridge, planted row filled", "ridge, attention selector", "identity, planted row filled",
                  "identity, attention selector"]
    conditions += [lever_name(spec) for spec in options.selectors if lever_name(spec) not in conditions]
    n_retr = len(options.depths) * options.names_per_depth
    total = len(lengths) * (options.n_docs * per_doc_runs + n_retr * len(conditions))
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total, what)

    run = _Runner(model, info, lengths[-1] + 16, options)
    try:
        bos = bos_prefix(run.llm)

        def tokenize(text: str) -> list[int]:
            return run.llm.tokenize(text.encode(), add_bos=False, special=False)

        for n in lengths:
            key = str(n)
            docs = build_documents(tokenize, bos, texts, n, options.n_docs)
            kc = metrics.scaled_key_cut(info.context_length or n, n - T)
            res.key_cut[key] = {"k": kc.k, "note": kc.note}
            variants = ["ridge", "identity"] + [_variant_name(s, S0) for s in splits[1:]]
            if options.key_rescale > 0:
                variants.append("ridge + key rescale")
            levers = (["ridge + key rescale"] if options.key_rescale > 0 else []) + [lever_name(x) for x in options.selectors]
            variants += [lever_name(x) for x in options.selectors]
            if options.splice:
                variants += ["ridge, exact K", "ridge, exact V"] + (["ridge, exact state"] if rec_layers else [])
            recs = {v: [] for v in ["exact"] + variants}
            times = {v: [] for v in ["exact"] + variants}
            plans: dict[str, dict] = {}
            for d in docs:
                prompt, targets = d.tokens[:n], d.tokens[n - T + 1:n + 1]
                novel = metrics.novel_token_mask(d.tokens, n - T + 1)
                run.detach()
                logits, dt = run.prefill(prompt, T, plan=False)
                nll_exact = _nll(logits, targets)
                times["exact"].append(dt)
                tick("exact")
                cut_tokens = bos + prompt[n - T - kc.k + 1:] if kc.k < n - T else prompt
                logits, _ = run.prefill(cut_tokens, T, plan=False)
                nll_cut = _nll(logits, targets)
                keym = metrics.key_token_mask(nll_exact, nll_cut)
                tick("cut context")
                masks = {"all": None, "novel": novel, "key": keym}
                recs["exact"].append({"doc": d.name, "kind": d.kind, "n_novel": int(novel.sum()), "n_key": int(keym.sum()),
                                      "nll_exact": nll_exact.tolist()})

                def scored(variant: str, nll: np.ndarray, dt: float) -> None:
                    r = {"doc": d.name, "kind": d.kind}
                    for mname, m in masks.items():
                        r[mname] = list(metrics.document_delta(nll, nll_exact, m))
                    recs[variant].append(r)
                    times[variant].append(dt)

                fills = [("ridge", maps[0], S0, 0, None), ("identity", None, S0, 0, None)]
                fills += [(_variant_name(s, S0), m, s, 0, None) for m, s in zip(maps[1:], splits[1:])]
                if options.key_rescale > 0:
                    fills.append(("ridge + key rescale", maps[0], S0, options.key_rescale, None))
                fills += [(lever_name(x), maps[0], S0, 0, x) for x in options.selectors]
                for variant, mp, s, krs, sel in fills:
                    run.attach(mp, s, options, selector=sel, key_rescale=krs)
                    logits, dt = run.prefill(prompt, T, plan=True)
                    scored(variant, _nll(logits, targets), dt)
                    if variant not in plans:
                        st = run.N.llama_ridgefill_stats()
                        run.N.llama_ridgefill_get_stats(run.ctx, ctypes.byref(st))
                        plans[variant] = ({"ceiling": float(st.ceiling), "n_exact": st.n_exact, "n_filled": st.n_filled,
                                           "split": s} if st.active else {"ceiling": 1.0, "split": s})
                    tick(variant)
                if options.splice:
                    for variant, mode in (("ridge, exact K", 1), ("ridge, exact V", 2)):
                        run.detach()
                        run.prefill(prompt, T, plan=False)  # exact K/V into the cells
                        run.clear_cells()
                        tick("exact (splice source)")
                        run.attach(maps[0], S0, options, splice=mode)
                        logits, dt = run.prefill(prompt, T, plan=True)
                        scored(variant, _nll(logits, targets), dt)
                        tick(variant)
                    if rec_layers:
                        # the late recurrent layers' tails start from the exact prefix's states
                        run.detach()
                        run.prefill(prompt[:n - T], 1, plan=False)
                        states = {il: run.llm.read_state(il) for il in rec_layers}
                        tick("exact prefix (splice source)")
                        run.attach(maps[0], S0, options)
                        for il, st in states.items():
                            run.llm.ridgefill_splice_state(il, st)
                        logits, dt = run.prefill(prompt, T, plan=True)
                        run.llm.ridgefill_splice_state(None)
                        scored("ridge, exact state", _nll(logits, targets), dt)
                        tick("ridge, exact state")
                run.detach()
            res.docs[key] = recs
            res.times[key] = times
            res.plans[key] = plans
            res.summary[key] = _summarise(recs, variants, options)
            res.paired[key] = _paired(recs, levers, options)
            if options.splice:
                res.splice[key] = _splice_shares(recs, options)
            res.retrieval[key] = _retrieval(run, tokenize, bos, texts, n, options, S0, maps[0], conditions, tick)
    finally:
        run.close()
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


def _retrieval(run: _Runner, tokenize, bos, texts, n: int, options: EvalOptions, split: int, maps_path,
               conditions: list[str], tick) -> dict:
    """Planted-fact prompts: the fact in the filled region at each depth, the question in the tail."""
    rng = np.random.default_rng(options.seed + n)
    kind = "documentation" if "documentation" in texts else next(iter(texts))
    filler_docs = build_documents(tokenize, [], {kind: texts[kind]}, n, 1)
    filler = filler_docs[0].tokens
    prompts, answers, depths = [], [], []
    names = list(NAMES)
    for depth in options.depths:
        for j in range(options.names_per_depth):
            name = names[(len(prompts)) % len(names)]
            code = f"{int(rng.integers(10000, 100000))}"
            fact = tokenize(f" The access code for {name} is {code}. ")
            question = tokenize(f"\n\nQuestion: What is the access code for {name}?\nAnswer: The access code for {name} is")
            if len(question) >= options.tail:
                raise ValueError(f"the retrieval question ({len(question)} tokens) does not fit the tail ({options.tail})")
            body = n - len(bos) - len(fact) - len(question)
            at = int(round(depth * (n - options.tail - len(bos) - len(fact))))
            toks = bos + filler[:at] + fact + filler[at:body] + question
            assert len(toks) == n
            prompts.append(toks)
            answers.append(code)
            depths.append(depth)
    out = {}
    for cond in conditions:
        preds = []
        for toks in prompts:
            if cond == "exact":
                run.detach()
                logits, _ = run.prefill(toks, 1, plan=False)
            else:
                which, sel = cond.split(", ")
                spec = "none" if sel == "planted row filled" else sel.removesuffix(" selector")
                run.attach(maps_path if which == "ridge" else None, split, options, selector=spec)
                logits, _ = run.prefill(toks, 1, plan=True)
            preds.append(run.greedy(logits[-1], 8))
            tick(f"retrieval ({cond})")
        run.detach()
        correct = metrics.retrieval_correct(preds, answers)
        by_depth: dict[str, list[bool]] = {}
        for dep, c in zip(depths, correct):
            by_depth.setdefault(f"{dep:g}", []).append(bool(c))
        acc = metrics.bootstrap_ci(correct.astype(np.float64), n_boot=options.n_boot, seed=options.seed)
        out[cond] = {"by_depth": by_depth, "accuracy": acc._asdict(), "predictions": preds, "answers": answers}
    return out

