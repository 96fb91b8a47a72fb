#!/usr/bin/env python3
"""Answer NLL of planted-code prompts under exact, identity-fill and ridge-fill prefill, on the oracle.

A check of the maps' downstream value before the C++ prefill exists: the torch oracle runs the
reference semantics of docs/design.md §4 (``oracle.fill.fill_forward``) on the model's weights. Each prompt
is evaluation-split text with a code planted early (inside the filled region), then the question
and the answer as the tail; the figure is the mean NLL of the answer's tokens. Prints a Markdown
table (mean over prompts) with and without the attention selector.

Usage: oracle_planted_nll.py MODEL --maps normalized.gguf [--maps raw.gguf ...] [--prompts 6] [--len 1024]
"""

from __future__ import annotations

import argparse
import random
import sys

import torch


def main(argv=None) -> int:
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.core import models
    from ridgefill_cpp.quality.bench import prompt_tokens  # noqa: F401 (same tokenizer path)
    from ridgefill_cpp.fitting.capture import open_model
    from ridgefill_cpp.fitting.fit import calibration_tokens
    from ridgefill_cpp.maps.mapfile import read_map_file
    from ridgefill_cpp.oracle import load_oracle
    from ridgefill_cpp.oracle.fill import fill_forward, select_attention_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--maps", action="append", default=[])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = models.path(args.model) if args.model in models.MODELS else args.model
    maps = {m: read_map_file(m) for m in args.maps}
    split = next(iter(maps.values())).meta.split_layer if maps else None
    llm = open_model(path, n_ctx=args.len + 64, n_batch=64)
    oracle = load_oracle(path)
    rng = random.Random(args.seed)
    filler = calibration_tokens(llm, corpus.default_documents("evaluation"), args.prompts * args.len)
    names = ["Alder", "Birch", "Cedar", "Dogwood", "Elm", "Fir", "Ginkgo", "Hazel"]
    rows = {}
    for k in range(args.prompts):
        name, code = names[k % len(names)], f"{rng.randrange(10**5, 10**6)}"
        fact = llm.tokenize(f"\nThe secret code of {name} is {code}.\n".encode(), add_bos=False)
        question = llm.tokenize(f"\nQuestion: what is the secret code of {name}?\nAnswer: The secret code of {name} is".encode(), add_bos=False)
        answer = llm.tokenize(f" {code}.".encode(), add_bos=False)
        body_len = args.len - 1 - len(fact) - len(question) - len(answer)
        body = filler[k * args.len:k * args.len + body_len]
        at = body_len // 5  # early: deep inside the filled region
        tokens = [llm.token_bos()] + body[:at] + fact + body[at:] + question + answer
        tail = len(question) + len(answer)
        ans_pos = range(len(tokens) - len(answer), len(tokens))

        def answer_nll(out_logits):  # logits of the tail rows: row i predicts token i+1
            lp = torch.log_softmax(out_logits.to(torch.float64), -1)
            first = len(tokens) - tail
            return -sum(float(lp[p - 1 - first, tokens[p]]) for p in ans_pos) / len(answer)

        exact = fill_forward(oracle, tokens, split=oracle.n_layer, tail=tail, tail_logits=True)
        rows.setdefault("exact", []).append(answer_nll(exact.logits))
        sel = select_attention_rows(oracle, tokens, split=split, tail=tail)
        for label, m in [("identity", None)] + [(f"ridge {maps[p].meta.objective}", maps[p]) for p in maps]:
            for selector, exact_rows in (("none", ()), ("attention 10%", sel)):
                out = fill_forward(oracle, tokens, split=split, maps=m, tail=tail, exact_positions=exact_rows,
                                   tail_logits=True)
                rows.setdefault(f"{label}, selector {selector}", []).append(answer_nll(out.logits))
        print(f"prompt {k}: " + ", ".join(f"{key} {v[-1]:.3f}" for key, v in rows.items()), file=sys.stderr, flush=True)
    llm.close()
    print(f"\n{path.name if hasattr(path, 'name') else path}, S = {split}, {args.prompts} prompts of {args.len} tokens: "
          "mean answer NLL (nats)\n")
    print("| prefill | answer NLL |\n|---|---:|")
    for key, v in rows.items():
        print(f"| {key} | {sum(v) / len(v):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
