"""Prefill timing, side by side (docs/design.md §10): several variants of one prompt, alternated, repeated.

Absolute times on a shared machine are noise; the figure is the ratio of medians measured in one
run, with the same build, threads, context and batch sizes for every variant. Each repetition
opens fresh contexts and visits the variants in a rotated order, so that drift (thermal, other
load) and the placement of a context's buffers are spread evenly.

Variants:

- ``stock``: the model, exact prefill;
- ``ridgefill``: filled-row prefill with the ridge maps of a map file (when one is given);
- ``identity``: filled-row prefill with identity fill at the same S, T, selector and value rescale;
- ``first S layers`` (optional): the same file cut to its first S layers
  (:func:`gguf_copy.first_layers_gguf`), i.e. prefill as if layers S..L-1 cost nothing: the
  *physical* ceiling of any late-layer skipping on this machine.

Next to the time, each fill variant's quality on the same prompt: the KL divergence of its last-row
next-token distribution from stock's, and how many of a short greedy continuation's tokens agree
with stock's (in order, up to the first difference).

A figure that cannot be trusted is said so (:func:`timing_warnings`, also used by ``eval`` and
``tune``): a speedup above its ceiling, which no prefill reaches, or repeats of one variant that
differ by more than 10 % (max / min > :data:`SPREAD_LIMIT`) are noise, e.g. another job on the machine.

The library never prints; ``progress(done, total)`` reports evaluations.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import llama_cpp
import numpy as np

from ..core.machine import measured_on
from ..fitting import capture
from ..core import settings
from ..fitting.corpus import default_documents
from ..fitting.fit import bos_prefix, calibration_tokens
from ..maps.gguf_copy import first_layers_gguf
from ..core.gguf_model import read_model_info
from ..maps.mapfile import map_file_splits
from ..core.models import cache_dir
from ..runtime.prefill import RidgeFill

STOCK = "stock"
RIDGEFILL = "ridgefill"
IDENTITY = "identity"

#: repeats of one variant whose slowest is more than this times its fastest make its median noisy
SPREAD_LIMIT = 1.10
#: what to say when a variant was timed once: its spread is unknown
SINGLE_REPEAT_NOTE = ("one repeat: the spread of the times is unknown (a single repeat cannot show noise); "
                      "use --repeats 3 or more to see it")
QUIET = "on a quieter machine (nothing else running)"


def spread(times: Sequence[float]) -> float | None:
    """How far a variant's repeats lie apart: max / min − 1 (0.05: the slowest took 5 % longer than
    the fastest); None with fewer than two, whose spread is unknown."""
    ts = [float(t) for t in times]
    if len(ts) < 2:
        return None
    return max(ts) / min(ts) - 1.0 if min(ts) > 0 else float("inf")


def timing_warnings(times: Mapping[str, Sequence[float]], ceilings: Mapping[str, float | None], *,
                    base: str = STOCK, n_prompt: int | None = None, repeats: bool = True,
                    more: str | None = "--repeats") -> list[dict]:
    """Whether the speedups of one measurement can be trusted (pure: the same numbers, the same
    answer). ``times``: variant -> the seconds of each timing, ``base`` among them (the speedup of a
    variant is the median of ``base``'s over the median of its own, as reported); ``ceilings``:
    variant -> the most its speedup can be (the plan's 1/r, or L/S for the first S layers; a variant
    left out or None has none).

    Two rules, each a warning: a speedup above its ceiling (compared as printed, to two decimals),
    which no prefill reaches, and, when the timings are ``repeats`` of one prompt, a variant whose
    slowest repeat took more than :data:`SPREAD_LIMIT` times its fastest. A single repeat gives no
    spread warning (its spread is unknown: :data:`SINGLE_REPEAT_NOTE`). Either means the machine
    was not quiet (another job, a frequency change) and the ratio is noise. ``more``: the option that
    adds timings, named in the advice (None: none).

    Returns one dict per warning, in the order of ``times``: ``n_prompt``, ``variant``, ``kind``
    (``"above ceiling"`` or ``"spread"``), the figures (``speedup`` and ``ceiling``, or ``spread`` and
    ``min_s``, ``max_s``, ``repeats``) and a ``message`` that says it all."""
    where = f"{n_prompt} tokens, " if n_prompt is not None else ""
    advice = f"Run again with more {more}, {QUIET}." if more else f"Run again {QUIET}."
    out: list[dict] = []
    base_median = statistics.median(times[base]) if times.get(base) else None
    for v, ts in times.items():
        ceiling = ceilings.get(v)
        if v != base and ceiling is not None and base_median is not None and ts:
            speedup = base_median / statistics.median(ts)
            if round(speedup, 2) > round(float(ceiling), 2):
                out.append({"n_prompt": n_prompt, "variant": v, "kind": "above ceiling", "speedup": speedup,
                            "ceiling": float(ceiling),
                            "message": f"{where}{v}: the speedup {speedup:.2f}x is above its ceiling {ceiling:.2f}x, "
                                       f"which no prefill reaches: the timing is noise, not a speedup. {advice}"})
        s = spread(ts) if repeats else None
        if s is not None and s + 1.0 > SPREAD_LIMIT:
            out.append({"n_prompt": n_prompt, "variant": v, "kind": "spread", "spread": s, "min_s": min(ts),
                        "max_s": max(ts), "repeats": len(ts),
                        "message": f"{where}{v}: its {len(ts)} repeats differ by {100 * s:.0f} % "
                                   f"({_seconds(min(ts))} to {_seconds(max(ts))}; more than "
                                   f"{100 * (SPREAD_LIMIT - 1):.0f} %): its median is noisy. {advice}"})
    return out


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


@dataclass
class BenchResult:
    model: str
    n_layer: int
    split: int
    tail: int
    exact_fraction: float
    selector: str
    min_prompt: int
    maps: str | None
    threads: int | None
    n_batch: int
    repeats: int
    lengths: list[int]
    # variant -> length -> seconds of every repetition
    times: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    # length -> the ceiling 1/r of the plan (docs/design.md §4; 1.0 when the prompt ran stock)
    ceiling: dict[int, float] = field(default_factory=dict)
    # fill variant -> length -> KL(stock || variant) of the last row, nats
    kl: dict[str, dict[int, float]] = field(default_factory=dict)
    # fill variant -> length -> greedy tokens equal to stock's before the first difference
    greedy_agree: dict[str, dict[int, int]] = field(default_factory=dict)
    greedy_tokens: int = 0
    key_rescale: int = 0              # c_K of the fill variants (0: off)
    measured: dict = field(default_factory=dict)  # core.machine.measured_on: date, CPU, threads, versions

    def median(self, variant: str, n: int) -> float:
        return statistics.median(self.times[variant][n])

    def speedup(self, variant: str, n: int, base: str = STOCK) -> float:
        return self.median(base, n) / self.median(variant, n)

    def tokens_per_s(self, n: int, variant: str = STOCK) -> float:
        """Prompt tokens per second of a variant's median prefill (stock's: what this machine does)."""
        return n / self.median(variant, n)

    def spread(self, variant: str, n: int) -> float | None:
        """max / min − 1 of a variant's repeats at one length (None with one repeat)."""
        return spread(self.times[variant][n])

    def ceiling_of(self, variant: str, n: int) -> float | None:
        """The most ``variant``'s speedup can be: a fill's plan ceiling 1/r, the compute ceiling L/S
        of the first S layers (late layers free, early ones everything); stock has none."""
        if variant == STOCK:
            return None
        if variant in self.kl:
            return self.ceiling.get(n, self.compute_ceiling)
        return self.compute_ceiling

    def timing_warnings(self) -> list[dict]:
        """The warnings of :func:`timing_warnings` for every length, by length."""
        return [w for n in self.lengths
                for w in timing_warnings({v: self.times[v][n] for v in self.times},
                                         {v: self.ceiling_of(v, n) for v in self.times}, n_prompt=n)]

    @property
    def compute_ceiling(self) -> float:
        """L/S: the speedup if late layers cost nothing and early ones everything."""
        return self.n_layer / self.split

    @property
    def variants(self) -> list[str]:
        return list(self.times)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["times"] = {v: {str(n): ts for n, ts in by_n.items()} for v, by_n in self.times.items()}
        for k in ("kl", "greedy_agree"):
            d[k] = {v: {str(n): x for n, x in by_n.items()} for v, by_n in getattr(self, k).items()}
        d["ceiling"] = {str(n): c for n, c in self.ceiling.items()}
        d["summary"] = [
            {"n_prompt": n, **{f"median_s[{v}]": self.median(v, n) for v in self.times},
             **{f"speedup[{v}]": self.speedup(v, n) for v in self.times if v != STOCK},
             "ceiling": self.ceiling.get(n, self.compute_ceiling), "compute_ceiling L/S": self.compute_ceiling,
             f"tokens_per_s[{STOCK}]": self.tokens_per_s(n),
             **{f"spread[{v}]": self.spread(v, n) for v in self.times},
             **{f"kl[{v}]": self.kl[v][n] for v in self.kl if n in self.kl[v]},
             **{f"greedy_agree[{v}]": self.greedy_agree[v][n] for v in self.greedy_agree if n in self.greedy_agree[v]}}
            for n in self.lengths
        ]
        # the figures that cannot be trusted (spread[v]: max / min − 1 of the repeats, None with one)
        d["timing_warnings"] = self.timing_warnings()
        d["timing_notes"] = [SINGLE_REPEAT_NOTE] if self.repeats < 2 else []
        return d


def last_logits(llm) -> np.ndarray:
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of two logit rows, nats."""
    lp = p_logits.astype(np.float64) - p_logits.max()
    lp -= np.log(np.exp(lp).sum())
    lq = q_logits.astype(np.float64) - q_logits.max()
    lq -= np.log(np.exp(lq).sum())
    return float((np.exp(lp) * (lp - lq)).sum())


def greedy_continuation(llm, first_logits: np.ndarray, n: int) -> list[int]:
    """n greedy tokens continuing the prompt just evaluated (every generated token runs every layer)."""
    out, logits = [], first_logits
    for _ in range(max(n, 0)):
        tok = int(np.argmax(logits))
        out.append(tok)
        if len(out) == n or tok == llm.token_eos():
            break
        llm.eval([tok])
        logits = last_logits(llm)
    return out


def prompt_tokens(llm, n: int) -> list[int]:
    """``n`` prompt tokens of the evaluation split of the default corpus (BOS first when the model uses one)."""
    bos = bos_prefix(llm)
    body = calibration_tokens(llm, default_documents("evaluation"), n - len(bos))
    if len(body) < n - len(bos):
        raise ValueError(f"the evaluation text has only {len(body)} tokens, {n} were asked for")
    return bos + body


def warm_up(llms: Iterable[Any], tokens: Sequence[int]) -> None:
    """One prefill of `tokens` in each open context (first-call allocations are not prefill)."""
    for llm in llms:
        llm.reset()
        llm.eval(tokens)


def alternated_ttft(variants: Mapping[str, Any], tokens: Sequence[int], repeats: int
                    ) -> tuple[dict[str, list[float]], dict[str, np.ndarray]]:
    """Time to first token of `tokens` in each open context of `variants` (name -> Llama), `repeats`
    times: even repetitions visit them in the given order, odd ones in reverse (so that none always
    goes first). A time runs from the context's reset through the prefill to the last row's logits
    on the host. Returns the times (name -> seconds of each repetition) and each variant's logits
    of its last run. (The tools' side-by-side loop, tools/measure/archs_cpu.py and tools/measure/gpu_h200_check.py;
    :func:`benchmark_prefill` opens fresh contexts every repetition instead.)"""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    logits: dict[str, np.ndarray] = {}
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            llm = variants[name]
            llm.reset()
            t = time.perf_counter()
            llm.eval(tokens)
            logits[name] = last_logits(llm)
            times[name].append(time.perf_counter() - t)
    return times, logits


def derived_first_layers(model: os.PathLike | str, split: int) -> Path:
    """The model cut to its first ``split`` layers, cached next to the other derived files."""
    src = Path(model)
    out = cache_dir().parent / "derived" / f"{src.name.removesuffix('.gguf')}.first{split}.gguf"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        first_layers_gguf(src, out, split)
    return out


def benchmark_prefill(
    model: os.PathLike | str,
    *,
    lengths: Sequence[int] = settings.BENCH_LENGTHS,
    maps: os.PathLike | str | None = None,
    split: int | None = None,
    tail: int = settings.TAIL,
    exact_fraction: float = settings.EXACT_FRACTION,
    selector: str = settings.SELECTOR,
    value_rescale: int = settings.VALUE_RESCALE,
    key_rescale: int | None = None,
    min_prompt: int = settings.MIN_PROMPT,
    identity: bool = True,
    first_layers: bool = False,
    greedy_tokens: int = settings.BENCH_GREEDY_TOKENS,
    repeats: int = settings.BENCH_REPEATS,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    n_batch: int = settings.N_BATCH,
    progress: Callable[[int, int], None] | None = None,
) -> BenchResult:
    """Median prefill time of each variant for prompts of each length, measured side by side, and
    the fill variants' quality against stock on the same prompts. ``selector``: a selector spec
    (:func:`ridgefill_cpp.core.settings.parse_selector`, e.g. ``protected:digits+rare``)."""
    info = read_model_info(model)
    if maps is not None:
        (file_split,) = map_file_splits([maps], model)  # a map file fitted on this model (as eval, tune, serve)
        if split is not None and split != file_split:
            raise ValueError(f"--split {split}, but the maps were fitted for split {file_split}")
        split = file_split
    split = info.default_split if split is None else int(split)
    if not 1 <= split <= info.n_layer - 1:
        raise ValueError(f"split {split} outside 1..{info.n_layer - 1}")
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < 2:
        raise ValueError("prompt lengths must be at least 2 tokens")
    if info.context_length and lengths[-1] > info.context_length:
        raise ValueError(f"a {lengths[-1]}-token prompt is longer than the model's context ({info.context_length})")
    n_ctx = lengths[-1] + max(greedy_tokens, 0)
    if info.context_length:
        n_ctx = min(n_ctx, info.context_length)  # the longest prompt's continuation may be shorter

    plan = dict(split=split, tail=tail, exact_fraction=exact_fraction, value_rescale=value_rescale,
                key_rescale=key_rescale, min_prompt=min_prompt, **settings.parse_selector(selector))
    variants: dict[str, dict] = {STOCK: {}}
    if maps is not None:
        variants[RIDGEFILL] = {"ridgefill": RidgeFill(maps, **plan)}
        plan["key_rescale"] = variants[RIDGEFILL]["ridgefill"].key_rescale  # None: the map file's tuned c_K
    if identity:
        variants[IDENTITY] = {"ridgefill": RidgeFill(None, **plan)}
    if first_layers:
        variants[f"first {split} layers"] = {"path": derived_first_layers(model, split)}
    if len(variants) == 1:
        raise ValueError("nothing to compare with stock: give maps, or keep identity fill or first layers")

    fills = [v for v, kw in variants.items() if "ridgefill" in kw]
    res = BenchResult(model=str(model), n_layer=info.n_layer, split=split, tail=tail, exact_fraction=exact_fraction,
                      selector=selector, min_prompt=min_prompt, maps=str(maps) if maps else None, threads=n_threads,
                      n_batch=n_batch, repeats=repeats, lengths=lengths, greedy_tokens=greedy_tokens,
                      key_rescale=int(plan["key_rescale"] or 0), measured=measured_on(n_threads, n_gpu_layers),
                      times={v: {n: [] for n in lengths} for v in variants},
                      kl={v: {} for v in fills}, greedy_agree={v: {} for v in fills})
    reference: dict[int, tuple[np.ndarray, list[int]]] = {}
    names = list(variants)
    total, done = repeats * len(lengths) * len(names), 0
    prompts: dict[int, list[int]] = {}
    for r in range(repeats):
        # fresh contexts every repetition: where a context's buffers land in memory biases its speed
        # for its whole life (by up to ~10 % on this machine), so each repetition draws anew
        order = names[r % len(names):] + names[: r % len(names)]
        llms = {}
        try:
            for v in order:
                kw = variants[v]
                llms[v] = capture.open_model(kw.get("path", model), n_ctx=n_ctx, n_batch=n_batch, kv_f32=False,
                                     n_threads=n_threads, n_gpu_layers=n_gpu_layers, ridgefill=kw.get("ridgefill"))
            if not prompts:
                prompts = {n: prompt_tokens(llms[STOCK], n) for n in lengths}
            warm_up(llms.values(), prompts[lengths[0]][: min(64, lengths[0])])
            for n in lengths:
                if r == 0:  # stock first on the first round: the quality reference
                    order_n = [STOCK] + [v for v in order if v != STOCK]
                else:
                    order_n = order
                for v in order_n:
                    llm = llms[v]
                    llm.reset()
                    t0 = time.perf_counter()
                    llm.eval(prompts[n])
                    res.times[v][n].append(time.perf_counter() - t0)
                    if r == 0 and (v == STOCK or v in fills):
                        logits = last_logits(llm)
                        cont = greedy_continuation(llm, logits, min(greedy_tokens, n_ctx - n))
                        if v == STOCK:
                            reference[n] = (logits, cont)
                        else:
                            ref_logits, ref_cont = reference[n]
                            res.kl[v][n] = kl_divergence(ref_logits, logits)
                            agree = 0
                            while agree < min(len(cont), len(ref_cont)) and cont[agree] == ref_cont[agree]:
                                agree += 1
                            res.greedy_agree[v][n] = agree
                            if v == fills[0]:
                                st = llm.ridgefill_stats
                                res.ceiling[n] = float(st["ceiling"]) if st else 1.0
                    done += 1
                    if progress:
                        progress(done, total)
        finally:
            for llm in llms.values():
                llm.close()
    return res
