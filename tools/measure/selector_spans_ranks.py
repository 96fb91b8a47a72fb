"""Where a planted fact's rows rank under the attention selector, with single rows and with spans.

For each depth, one retrieval prompt as ``ridgefill-gguf eval`` builds them (" The access code for
NAME is 12345. " planted in the filled region of the documentation filler, the question in the
tail) is prefilled with RidgeFill (the attention selector at its default layer below S); the scores
libllama measured are then ranked with the selector's rule (ridgefill_cpp.oracle.fill.rows_by_score)
for each span, and the rank of every row of the fact is printed next to k, the rows the selector
keeps (a row is exact when its rank is below k).

    python tools/measure/selector_spans_ranks.py MAPS [--model smollm2-135m] [--length 2048] [--spans 1,16]
        [--depths 0.1,0.3,0.5,0.7,0.9] [--json out.json]

The split is the map file's.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch

import ridgefill_cpp  # noqa: F401  (loads the patched libraries first)
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.core import models
from ridgefill_cpp.core import settings
from ridgefill_cpp.quality.evaluate import NAMES, build_documents, default_texts, plant_facts, text_tokenizer
from ridgefill_cpp.fitting.fit import bos_prefix
from ridgefill_cpp.oracle.fill import rows_by_score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("maps", help="map file of ridgefill-gguf fit (its split is used)")
    ap.add_argument("--model", default="smollm2-135m", help="a default model's name (ridgefill-gguf models) or a GGUF path")
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--spans", default="1,16", help="spans to rank with, comma-separated")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="depths of the fact, shares of the filled region")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the ranks here")
    a = ap.parse_args()
    path = models.path(a.model) if a.model in models.MODELS else a.model
    n, tail = a.length, settings.TAIL
    spans = [int(s) for s in a.spans.split(",")]
    llm = Llama(str(path), n_ctx=n + 16, n_batch=512, n_ubatch=512, n_threads=a.threads, verbose=False,
                flash_attn=True, ridgefill=RidgeFill(a.maps, tail=tail, selector="attention", span=1, min_prompt=0))
    tok, bos = text_tokenizer(llm), bos_prefix(llm)
    filler = build_documents(tok, [], {"documentation": default_texts()["documentation"]}, n, 1)[0].tokens
    rng = np.random.default_rng(n)
    k = math.ceil(settings.EXACT_FRACTION * (n - tail) - 1e-9)
    out = []
    for i, depth in enumerate(float(d) for d in a.depths.split(",")):
        name, code = NAMES[i % len(NAMES)], f"{int(rng.integers(10000, 100000))}"
        fact = tok(f" The access code for {name} is {code}. ")
        question = tok(f"\n\nQuestion: What is the access code for {name}?\nAnswer: The access code for {name} is")
        prompt = plant_facts(bos, filler, [(depth, fact)], question, n, tail)
        llm.reset()
        llm.prefill(prompt, 1)
        scores = torch.tensor(llm.ridgefill_scores()[:n - tail])
        at = next(j for j in range(n) if prompt[j:j + len(fact)] == fact)
        pieces = [llm.detokenize([t]).decode(errors="replace") for t in fact]
        for span in spans:
            rank = {r: i for i, r in enumerate(rows_by_score(scores, n - tail, span))}
            ranks = [rank[at + m] for m in range(len(fact))]
            out.append({"depth": depth, "span": span, "k": k, "row": at, "pieces": pieces, "ranks": ranks})
            print(f"depth {depth:g}, span {span}: k = {k}; " + " ".join(f"{p!r}:{r}" for p, r in zip(pieces, ranks)),
                  flush=True)
    llm.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": str(path), "maps": a.maps, "length": n, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
