"""Sweep the span share: how many of the exact rows come as whole spans, the rest as single rows.

The attention selector with ``span`` > 1 takes ceil(SPAN_SHARE · k) of its k exact rows as the spans
around the top-scoring rows, then the top-scoring single rows (csrc/llama-ridgefill-select.cpp). This
tool measures other shares without rebuilding: each prompt is prefilled once with single rows to get
libllama's selector scores, each share then picks its rows from those scores (the same rule, the
oracle's ``ranked_rows``) and the prompt is prefilled again with them as explicit positions
(``RidgeFill(selector=[...])``). Share 1 is every row in spans, share 0 single rows alone. A check
on every prompt: the library's own span rule picks the rows of share ``settings.SPAN_SHARE``.

    python tools/sweep_span_share.py nll MODEL MAPS [--length 2048] [--docs 12] [--shares 0,0.5,0.75,1]
    python tools/sweep_span_share.py retrieval MODEL MAPS [--length 2048] [--shares 0,0.5,0.75,1]

``nll``: novel-token ΔNLL against exact prefill on the tail of ``eval``'s documents (the same
documents and metric as ``ridgefill-gguf eval``), token-weighted over documents, and each share's
paired difference against share 1 with a bootstrap CI over documents. ``retrieval``: ``eval --codes
2``'s planted-code prompts (5 depths x 2), greedy answers, and "kept": of the prompts exact prefill
answers, those the share answers too.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import ridgefill_cpp  # noqa: F401  (loads the patched libraries first)
from ridgefill_cpp import RidgeFill, metrics, models, settings
from ridgefill_cpp.bench import greedy_continuation
from ridgefill_cpp.evaluate import (NAMES, EvalOptions, build_documents, default_texts, distractor_depths,
                                    open_context, plant_facts, retrieval_question, text_tokenizer, timed_prefill)
from ridgefill_cpp.fit import bos_prefix
from ridgefill_cpp.oracle import fill as F


def pick(scores: np.ndarray, k: int, share: float, span: int) -> list[int]:
    """k rows: spans add at most ceil(share · k), single rows by score the rest (the oracle's rule)."""
    return sorted(F.ranked_rows(torch.from_numpy(scores), len(scores), k, span, share=share))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["nll", "retrieval"])
    ap.add_argument("model", help="a model GGUF or a name of `ridgefill-gguf models`")
    ap.add_argument("maps")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=settings.EVAL_DOCS)
    ap.add_argument("--shares", default="0,0.5,0.75,1")
    ap.add_argument("--span", type=int, default=settings.SPAN)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    path = models.path(a.model) if a.model in models.MODELS else a.model
    n, T, frac = a.length, settings.TAIL, settings.EXACT_FRACTION
    shares = [float(x) for x in a.shares.split(",")]
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
        assert llm.ridgefill_stats["exact_positions"] == pick(sc, k, settings.SPAN_SHARE, a.span), \
            "the library's span rule is not share SPAN_SHARE of this tool"
        return sc

    t0 = time.time()
    if a.what == "nll":
        deltas: dict[float, list[tuple[float, int]]] = {s: [] for s in shares}
        for i, d in enumerate(build_documents(tok, bos, default_texts(), n, a.docs)):
            prompt, targets = d.tokens[:n], d.tokens[n - T + 1:n + 1]
            novel = metrics.novel_token_mask(d.tokens, n - T + 1)
            exact = metrics.nll(timed_prefill(llm, None, prompt, T)[0], targets)
            sc = scores_then_check(prompt)
            for s in shares:
                logits = timed_prefill(llm, rf(selector=pick(sc, k, s, a.span)), prompt, T)[0]
                deltas[s].append(metrics.document_delta(metrics.nll(logits, targets), exact, novel))
            print(f"document {i + 1}, {time.time() - t0:.0f} s:", {s: round(v[-1][0], 4) for s, v in deltas.items()},
                  flush=True)
        base = np.array([x[0] for x in deltas[max(shares)]])
        rng = np.random.default_rng(0)
        for s, v in deltas.items():
            vals, w = np.array([x[0] for x in v]), np.array([x[1] for x in v])
            diff = vals - base
            boots = [diff[rng.integers(0, len(diff), len(diff))].mean() for _ in range(2000)]
            print(f"share {s:g}: novel ΔNLL {(vals * w).sum() / w.sum():+.4f}; paired vs share {max(shares):g} "
                  f"{diff.mean():+.4f} [{np.percentile(boots, 2.5):+.4f}, {np.percentile(boots, 97.5):+.4f}]")
    else:
        o = EvalOptions(lengths=[n], codes=2)
        filler = build_documents(tok, [], {"documentation": default_texts()["documentation"]}, n, 1)[0].tokens
        rng = np.random.default_rng(o.seed + n)  # eval's prompts: the same draws as planted_code_retrieval
        ok: dict[str, list[bool]] = {"exact": [], **{f"share {s:g}": [] for s in shares}}
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
                for s in shares:
                    ok[f"share {s:g}"].append(answer(rf(selector=pick(sc, k, s, a.span))))
                print(f"prompt {len(ok['exact'])}, {time.time() - t0:.0f} s:", {c: int(v[-1]) for c, v in ok.items()},
                      flush=True)
        exact = np.array(ok["exact"])
        for c, v in ok.items():
            x = np.array(v)
            print(f"{c}: correct {x.sum()}/{len(x)}, kept {(x & exact).sum()}/{exact.sum()}")
    llm.close()


if __name__ == "__main__":
    main()
