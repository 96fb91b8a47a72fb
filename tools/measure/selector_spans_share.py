"""Sweep the exact-row rule: the span share and the recency share.

The attention selector with ``span`` > 1 takes ceil(SPAN_SHARE · k) of its k exact rows as whole
spans, then the top-scoring single rows; of those spans, the first ceil(RECENCY_SHARE · k) rows come
by the recency-corrected score (csrc/llama-ridgefill-select.cpp). This tool measures other shares
without rebuilding: each prompt is prefilled once with single rows to get libllama's selector
scores, each variant then picks its rows from those scores (the oracle's ``ranked_rows`` and
``recency_corrected``) and the prompt is prefilled again with them as explicit positions
(``RidgeFill(selector=[...])``). Share 1 is every row in spans, share 0 single rows alone. A check
on every prompt: the library's own rule picks the rows of share ``settings.SPAN_SHARE`` with
recency ``1@settings.RECENCY_SHARE``.

    python tools/measure/selector_spans_share.py nll MODEL MAPS [--length 2048] [--docs 12] [--shares 0,0.5,0.75,1]
        [--recency 0,1@0.25]
    python tools/measure/selector_spans_share.py retrieval MODEL MAPS [--length 2048] [--shares 0,0.5,0.75,1] [--recency ...]
    python tools/measure/selector_spans_share.py slopes MODEL MAPS [--length 2048] [--docs 3]

``nll``: novel-token ΔNLL against exact prefill on the tail of ``eval``'s documents (the same
documents and metric as ``ridgefill-gguf eval``), token-weighted over documents, and each variant's
paired difference against the largest share with the first recency, with a bootstrap CI over
documents. ``retrieval``: ``eval --codes 2``'s planted-code prompts (5 depths x 2), greedy answers,
and "kept": of the prompts exact prefill answers, those the variant answers too. ``slopes``: per
document, the slope of log score on log distance that the recency correction removes (rows after
the sinks with a score > 0) and the mean score by eighth of the prefix.

Until commit "recency share" (docs/selector-spans), "1@f" meant spans by corrected score for
ceil(f · k) rows and then ceil(share · k) more by the measured score: the logs' "share 0.5 recency
1@0.25" is today's "share 0.75 recency 1@0.25", the library's rule."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import ridgefill_cpp  # noqa: F401  (loads the patched libraries first)
from ridgefill_cpp import RidgeFill
from ridgefill_cpp.quality import metrics
from ridgefill_cpp.core import models
from ridgefill_cpp.core import settings
from ridgefill_cpp.quality.bench import greedy_continuation
from ridgefill_cpp.quality.evaluate import (NAMES, EvalOptions, build_documents, default_texts, distractor_depths,
                                    open_context, plant_facts, retrieval_question, text_tokenizer, timed_prefill)
from ridgefill_cpp.fitting.fit import bos_prefix
from ridgefill_cpp.oracle import fill as F


def pick(scores: np.ndarray, k: int, share: float, span: int, recency: str = "0") -> list[int]:
    """k rows by the oracle's ranked_rows: spans (with ``span`` > 1) add up to ceil(share · k), single
    rows by score the rest. ``recency`` "0": on the scores as they are; "s": on the scores with
    strength s of their recency trend removed (recency_corrected); "1@f": first ceil(f · k) rows as
    spans by the corrected scores, part of the share, then the rule on the scores as they are (the
    library's rule with f = RECENCY_SHARE)."""
    sc, n = torch.from_numpy(scores), len(scores)
    strength, at, first = recency.partition("@")
    if at:
        if float(strength) != 1:
            raise ValueError(f"recency {recency!r}: the library's rule corrects with strength 1")
        return sorted(F.ranked_rows(sc, n, k, span, share=share, recency=float(first)))
    if float(strength):
        sc = F.recency_corrected(sc, n, float(strength))
    return sorted(F.ranked_rows(sc, n, k, span, share=share))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["nll", "retrieval", "slopes"])
    ap.add_argument("model", help="a model GGUF or a name of `ridgefill-gguf models`")
    ap.add_argument("maps")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=settings.EVAL_DOCS)
    ap.add_argument("--shares", default="0,0.5,0.75,1")
    ap.add_argument("--recency", default="0", help="recency corrections to sweep with each share (pick's `recency`), "
                    "the first the paired baseline")
    ap.add_argument("--span", type=int, default=settings.SPAN)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    path = models.path(a.model) if a.model in models.MODELS else a.model
    n, T, frac = a.length, settings.TAIL, settings.EXACT_FRACTION
    shares = [float(x) for x in a.shares.split(",")]
    variants = [(s, r) for s in shares for r in a.recency.split(",")]
    base_variant = (max(shares), a.recency.split(",")[0])
    label = lambda v: f"share {v[0]:g}" + (f" recency {v[1]}" if len(variants) > len(shares) else "")  # noqa: E731
    rf = lambda **kw: RidgeFill(a.maps, tail=T, exact_fraction=frac, min_prompt=0, key_rescale=0, **kw)  # noqa: E731
    llm = open_context(path, n + 16, settings.N_BATCH, a.threads, rf(span=1))
    bos, tok = bos_prefix(llm), text_tokenizer(llm)
    N = n - T
    k = F.n_selected(N, frac)

    def scores_then_check(prompt: list[int]) -> np.ndarray:
        """libllama's scores (a single-row prefill), and the check of the library's span rule."""
        timed_prefill(llm, rf(span=1), prompt, 1)
        sc = np.array(llm.ridgefill_scores()[:N])
        timed_prefill(llm, rf(span=a.span), prompt, 1)
        assert llm.ridgefill_stats["exact_positions"] == pick(sc, k, settings.SPAN_SHARE, a.span,
                                                              f"1@{settings.RECENCY_SHARE}"), \
            "the library's rule is not this tool's share SPAN_SHARE with recency 1@RECENCY_SHARE"
        return sc

    t0 = time.time()
    if a.what == "slopes":
        for d in build_documents(tok, bos, default_texts(), n, a.docs):
            timed_prefill(llm, rf(span=1), d.tokens[:n], 1)
            sc = np.array(llm.ridgefill_scores()[:N], dtype=np.float64)
            b = F.recency_slope(torch.from_numpy(sc), N)
            eighths = " ".join(f"{sc[lo:lo + N // 8].mean():.3g}" for lo in range(0, N, N // 8))
            print(f"{d.name}: slope {b:+.3f}; mean score by eighth of the prefix: {eighths}", flush=True)
    elif a.what == "nll":
        deltas: dict[tuple[float, str], list[tuple[float, int]]] = {v: [] for v in variants}
        for i, d in enumerate(build_documents(tok, bos, default_texts(), n, a.docs)):
            prompt, targets = d.tokens[:n], d.tokens[n - T + 1:n + 1]
            novel = metrics.novel_token_mask(d.tokens, n - T + 1)
            exact = metrics.nll(timed_prefill(llm, None, prompt, T)[0], targets)
            sc = scores_then_check(prompt)
            for v in variants:
                logits = timed_prefill(llm, rf(selector=pick(sc, k, v[0], a.span, v[1])), prompt, T)[0]
                deltas[v].append(metrics.document_delta(metrics.nll(logits, targets), exact, novel))
            print(f"document {i + 1}, {time.time() - t0:.0f} s:",
                  {label(v): round(x[-1][0], 4) for v, x in deltas.items()}, flush=True)
        base = np.array([x[0] for x in deltas[base_variant]])
        rng = np.random.default_rng(0)
        for var, v in deltas.items():
            vals, w = np.array([x[0] for x in v]), np.array([x[1] for x in v])
            diff = vals - base
            boots = [diff[rng.integers(0, len(diff), len(diff))].mean() for _ in range(2000)]
            print(f"{label(var)}: novel ΔNLL {(vals * w).sum() / w.sum():+.4f}; paired vs {label(base_variant)} "
                  f"{diff.mean():+.4f} [{np.percentile(boots, 2.5):+.4f}, {np.percentile(boots, 97.5):+.4f}]")
    else:
        o = EvalOptions(lengths=[n], codes=2)
        filler = build_documents(tok, [], {"documentation": default_texts()["documentation"]}, n, 1)[0].tokens
        rng = np.random.default_rng(o.seed + n)  # eval's prompts: the same draws as planted_code_retrieval
        ok: dict[str, list[bool]] = {"exact": [], **{label(v): [] for v in variants}}
        for depth in o.depths:
            for _ in range(o.names_per_depth):
                who = [NAMES[(len(ok["exact"]) + i) % len(NAMES)] for i in range(o.codes)]
                codes: list[str] = []
                while len(codes) < o.codes:
                    code = f"{int(rng.integers(10000, 100000))}"
                    codes += [code] if code not in codes else []
                facts = [(dd, tok(f" The access code for {name} is {code}. "))
                         for dd, name, code in zip([depth, *distractor_depths(depth, o.codes)], who, codes)]
                prompt = plant_facts(bos, filler, facts, tok(retrieval_question(who[0])), n, T)

                def answer(r: RidgeFill | None) -> bool:
                    logits = timed_prefill(llm, r, prompt, 1)[0]
                    return codes[0] in llm.detokenize(greedy_continuation(llm, logits[-1], 8)).decode(errors="replace")

                ok["exact"].append(answer(None))
                sc = scores_then_check(prompt)
                for v in variants:
                    ok[label(v)].append(answer(rf(selector=pick(sc, k, v[0], a.span, v[1]))))
                print(f"prompt {len(ok['exact'])}, {time.time() - t0:.0f} s:", {c: int(v[-1]) for c, v in ok.items()},
                      flush=True)
        exact = np.array(ok["exact"])
        for c, v in ok.items():
            x = np.array(v)
            print(f"{c}: correct {x.sum()}/{len(x)}, kept {(x & exact).sum()}/{exact.sum()}")
    llm.close()


if __name__ == "__main__":
    main()
