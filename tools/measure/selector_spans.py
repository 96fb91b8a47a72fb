"""Sweep span shapes for the attention selector on planted-fact prompts, before building one in C.

Each prompt is prefilled once with the attention selector (single rows) to get libllama's scores;
each span shape then picks its exact rows from those scores and the prompt is prefilled again with
them as explicit positions (``RidgeFill(selector=[...])``). A shape is (before, after): the rows
r - before .. r + after around each top-scoring row r rank with r's score (what ``span`` does in
csrc/llama-ridgefill-select.cpp for before = (w-1)//2, after = w-1-before). ``--layers 2`` also
sums the scores of the last two layers below S. Correct greedy answers per shape are printed after
every prompt.

    python tools/measure/selector_spans.py MAPS [--model smollm2-135m] [--length 2048]
        [--shapes c8,c16,c32,L16,L32,R12,R16] [--layers 1] [--per-depth 2]

Shapes: cW centred (W rows), LW mostly before the peak (after = W//4), RW mostly after it
(before = W//4).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

import ridgefill_cpp  # noqa: F401  (loads the patched libraries first)
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.core import models
from ridgefill_cpp.core import settings
from ridgefill_cpp.quality.bench import greedy_continuation
from ridgefill_cpp.quality.evaluate import NAMES, build_documents, default_texts, plant_facts, text_tokenizer
from ridgefill_cpp.fitting.fit import bos_prefix


def shape(spec: str) -> tuple[int, int]:
    kind, w = spec[0], int(spec[1:])
    if kind == "c":
        return (w - 1) // 2, w - 1 - (w - 1) // 2
    if kind == "L":
        return w - 1 - w // 4, w // 4
    if kind == "R":
        return w // 4, w - 1 - w // 4
    raise ValueError(f"shape {spec!r}: cW, LW or RW")


def pick(scores: np.ndarray, k: int, before: int, after: int) -> list[int]:
    n = len(scores)
    rank = np.array([scores[max(0, j - after):j + before + 1].max() for j in range(n)])
    return sorted(sorted(range(n), key=lambda j: (-rank[j], -scores[j], j))[:k])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("maps")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--shapes", default="c8,c16,c32,L16,L32,R12,R16")
    ap.add_argument("--layers", type=int, default=1, help="sum the scores of the last this many layers below S")
    ap.add_argument("--per-depth", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    path = models.path(a.model) if a.model in models.MODELS else a.model
    n, tail, frac = a.length, settings.TAIL, settings.EXACT_FRACTION
    rf = lambda **kw: RidgeFill(a.maps, tail=tail, exact_fraction=frac, min_prompt=0, **kw)  # noqa: E731
    llm = Llama(str(path), n_ctx=n + 16, n_batch=512, n_ubatch=512, n_threads=a.threads, verbose=False,
                flash_attn=True, ridgefill=rf(span=1))
    tok, bos = text_tokenizer(llm), bos_prefix(llm)
    filler = build_documents(tok, [], {"documentation": default_texts()["documentation"]}, n, 1)[0].tokens
    rng = np.random.default_rng(n)
    prompts, answers = [], []
    for depth in (0.1, 0.3, 0.5, 0.7, 0.9):
        for _ in range(a.per_depth):
            name, code = NAMES[len(prompts) % len(NAMES)], f"{int(rng.integers(10000, 100000))}"
            fact = tok(f" The access code for {name} is {code}. ")
            q = tok(f"\n\nQuestion: What is the access code for {name}?\nAnswer: The access code for {name} is")
            prompts.append(plant_facts(bos, filler, [(depth, fact)], q, n, tail))
            answers.append(code)

    def answer(p: list[int], r: RidgeFill | None) -> str:
        llm.set_ridgefill(r)
        llm.reset()
        logits = llm.prefill(p, 1)
        return llm.detokenize(greedy_continuation(llm, logits[-1], 8)).decode(errors="replace")

    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    correct = {c: 0 for c in ["exact", "single rows", *shapes]}
    t0 = time.time()
    k = math.ceil(frac * (n - tail) - 1e-9)
    for i, (p, code) in enumerate(zip(prompts, answers)):
        correct["exact"] += code in answer(p, None)
        correct["single rows"] += code in answer(p, rf(span=1))
        scores = np.array(llm.ridgefill_scores()[:n - tail])
        split = llm.ridgefill_stats["split"]
        for d in range(1, a.layers):
            answer(p, rf(span=1, selector_layer=split - 1 - d))
            scores = scores + np.array(llm.ridgefill_scores()[:n - tail])
        for s in shapes:
            correct[s] += code in answer(p, rf(selector=pick(scores, k, *shape(s))))
        print(f"{i + 1}/{len(prompts)} prompts, {time.time() - t0:.0f} s:", correct, flush=True)
    llm.close()


if __name__ == "__main__":
    main()
