"""Does a request's answer depend on the company it keeps? The same greedy request served alone and
next to three others on a ``-np 4`` llama-server, stock and RidgeFill side by side (issue #44, item 5).

1. Server. Two servers in turn on the same model and numerics (llama-server's defaults: F16 KV
   cache, flash attention auto, ``--threads``): stock llama-server, and the RidgeFill server with
   ``--maps``. Each round sends four different long prompts, first one at a time (twice: is a
   request deterministic alone?), then all four at once. On the RidgeFill server the four carry
   different ``ridgefill`` overrides (``false``, ``tail``, ``exact_fraction``, ``probe`` with span 1:
   the case the issue saw), so a planned prompt's settings change between neighbours. Per request:
   whether the greedy tokens in company equal those alone, where they first differ, the largest
   difference of the first token's top log-probabilities (the prefill's own output, before any
   generated token was decoded next to others), and the top-1/top-2 margin alone where they differ.
2. Mechanism, in the library (no server): one prompt prefilled as sequence 0 of a two-sequence
   context, then one generated token decoded for it alone, and the same token decoded in one
   ``llama_decode`` call next to another sequence's token (what llama-server's batch does while
   several slots generate). The largest difference of sequence 0's logits between the two, for
   the default numerics and for F32 KV without flash attention.

    python tools/measure/serve_company.py MODEL --maps MAPS [--length 1300] [--rounds 3] [--n-predict 24]
        [--threads 2] [--json out.json] [--md out.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from ridgefill_cpp import Llama, RidgeFill  # noqa: E402  (the patched libraries first)
from ridgefill_cpp.quality.bench import prompt_tokens  # noqa: E402
from ridgefill_cpp.server.serve import Server  # noqa: E402

#: the RidgeFill server's four requests: different overrides, one of them the issue's probe/span 1
OVERRIDES = [False, {"tail": 32}, {"exact_fraction": 0.3}, {"selector": "probe", "span": 1}]
N_PROBS = 3
#: the library experiment's numerics
MECHANISM = {"llama-server's default: F16 KV, flash attention auto": {},
             "F16 KV, flash attention on": {"flash_attn": True}, "F16 KV, flash attention off": {"flash_attn": False},
             "F32 KV, flash attention on": {"kv_f32": True, "flash_attn": True},
             "F32 KV, flash attention off": {"kv_f32": True, "flash_attn": False}}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.load(r)


def _top(entry: dict) -> dict[int, float]:
    return {t["id"]: t["logprob"] for t in entry["top_logprobs"]}


def compare(alone: dict, alone2: dict, company: dict) -> dict:
    """One request: alone (twice) against in company."""
    a, c = alone["tokens"], company["tokens"]
    first = next((i for i, (x, y) in enumerate(zip(a, c)) if x != y), None)
    pa, pc = alone.get("completion_probabilities", []), company.get("completion_probabilities", [])
    d0 = None
    if pa and pc and pa[0]["id"] == pc[0]["id"]:
        ta, tc = _top(pa[0]), _top(pc[0])
        d0 = max(abs(ta[t] - tc[t]) for t in set(ta) & set(tc))
    margin = None
    if first is not None and first < len(pa) and len(pa[first]["top_logprobs"]) >= 2:
        lp = sorted((t["logprob"] for t in pa[first]["top_logprobs"]), reverse=True)
        margin = lp[0] - lp[1]
    st = company.get("ridgefill") or {}
    return {"deterministic_alone": a == alone2["tokens"], "same_in_company": a == c, "first_difference": first,
            "first_token_max_abs_dlogprob": d0, "margin_alone_at_difference": margin,
            "planned": bool(st.get("applied")), "n_filled": st.get("n_filled"), "slot": company.get("id_slot")}


def serve_round(srv: Server, prompts: list[list[int]], overrides: list | None, n_predict: int) -> list[dict]:
    def run(i: int) -> dict:
        body = {"prompt": prompts[i], "n_predict": n_predict, "temperature": 0, "n_probs": N_PROBS,
                "cache_prompt": False, "return_tokens": True}
        if overrides is not None:
            body["ridgefill"] = overrides[i]
        return _post(srv.url + "/completion", body)

    alone = [run(i) for i in range(len(prompts))]
    alone2 = [run(i) for i in range(len(prompts))]
    company: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: company.__setitem__(i, run(i))) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [compare(alone[i], alone2[i], company[i]) | {"request": "stock" if overrides is None else
                                                        json.dumps(overrides[i])} for i in range(len(prompts))]


def mechanism(model: Path, prompt: list[int], threads: int, kv_f32: bool = False, flash_attn: bool | None = None) -> float:
    """max |logit difference| of sequence 0's next token decoded alone vs next to sequence 1's, in a
    context of two sequences with a KV stream each (llama-server's layout)."""
    import llama_cpp

    llm = Llama(str(model), n_ctx=64, verbose=False)  # the model; the context below is ours
    p = llama_cpp.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = 4 * (len(prompt) + 64), 512, 512, 2, False
    p.n_threads = p.n_threads_batch = threads
    if kv_f32:
        p.type_k = p.type_v = 0  # GGML_TYPE_F32
    if flash_attn is not None:
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = llama_cpp.llama_init_from_model(llm._model.model, p)
    try:
        n_vocab, mem = llm.n_vocab(), llama_cpp.llama_get_memory(ctx)

        def decode(rows: list[tuple[int, int, int]]) -> np.ndarray:  # (token, pos, seq) -> logits of row 0
            batch = llama_cpp.llama_batch_init(len(rows), 0, 1)
            try:
                for i, (tok, pos, seq) in enumerate(rows):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, i == 0
                batch.n_tokens = len(rows)
                assert llama_cpp.llama_decode(ctx, batch) == 0
                return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, 0), shape=(n_vocab,)).copy()
            finally:
                llama_cpp.llama_batch_free(batch)

        other = prompt[:1] + prompt[len(prompt) // 2:]
        for seq, toks in ((0, prompt), (1, other)):
            for s in range(0, len(toks), 512):
                decode([(t, s + j, seq) for j, t in enumerate(toks[s:s + 512])])
        nxt = int(prompt[-1])
        alone = decode([(nxt, len(prompt), 0)])
        llama_cpp.llama_memory_seq_rm(mem, 0, len(prompt), -1)
        together = decode([(nxt, len(prompt), 0), (nxt, len(other), 1)])
        return float(np.abs(alone - together).max())
    finally:
        llama_cpp.llama_free(ctx)
        llm.close()


def summarize(rows: list[dict]) -> dict:
    differ = [r for r in rows if not r["same_in_company"]]
    d0 = [r["first_token_max_abs_dlogprob"] for r in rows if r["first_token_max_abs_dlogprob"] is not None]
    margins = [r["margin_alone_at_difference"] for r in differ if r["margin_alone_at_difference"] is not None]
    return {"requests": len(rows), "deterministic_alone": sum(r["deterministic_alone"] for r in rows),
            "differ_in_company": len(differ),
            "first_difference_median": statistics.median(r["first_difference"] for r in differ) if differ else None,
            "first_token_identical": sum(1 for x in d0 if x == 0.0),
            "first_token_max_abs_dlogprob": max(d0) if d0 else None,
            "margin_at_difference_median": statistics.median(margins) if margins else None}


def markdown(res: dict) -> str:
    a = res["args"]
    L = [f"# The same request alone and in company: {Path(a['model']).name}", "",
         f"`{res['command']}`", "",
         f"{a['rounds']} rounds x 4 different {a['length']}-token prompts, {a['n_predict']} greedy tokens, "
         f"`-np 4 --threads {a['threads']}`, llama-server's default numerics (F16 KV cache, flash attention auto). "
         "Each request alone twice, then the four at once. RidgeFill server: the four carry the overrides "
         + ", ".join(f"`{json.dumps(o)}`" for o in OVERRIDES) + ".", "",
         "| server | requests | deterministic alone | differ in company | first difference (median token) | "
         "first token identical | first token max abs. Δ log-prob | top-1/top-2 margin alone where they differ (median) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
    for name, s in res["summary"].items():
        L.append(f"| {name} | {s['requests']} | {s['deterministic_alone']} | {s['differ_in_company']} | "
                 f"{fmt(s['first_difference_median'], 'g')} | {s['first_token_identical']} | "
                 f"{fmt(s['first_token_max_abs_dlogprob'], '.2e')} | {fmt(s['margin_at_difference_median'], '.3f')} |")
    L += ["", "Per request (RidgeFill server):", "", "| round | request | planned | filled | same in company | "
          "first difference | first token max abs. Δ log-prob |", "|---:|---|---|---:|---|---:|---:|"]
    for r in res["rows"]["RidgeFill"]:
        L.append(f"| {r['round']} | `{r['request']}` | {'yes' if r['planned'] else 'no'} | {r['n_filled'] or '—'} | "
                 f"{'yes' if r['same_in_company'] else 'no'} | {fmt(r['first_difference'], 'g')} | "
                 f"{fmt(r['first_token_max_abs_dlogprob'], '.2e')} |")
    L += ["", "Mechanism, in the library (no server, no RidgeFill): the largest logit difference of one sequence's next "
          "token decoded alone and in one `llama_decode` call next to another sequence's token:", "",
          "| numerics | max abs. logit difference |", "|---|---:|"]
    for name, v in res["mechanism"].items():
        L.append(f"| {name} | {v:.3e} |")
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--maps", type=Path, required=True)
    ap.add_argument("--length", type=int, default=1300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()

    vocab = Llama(str(args.model), vocab_only=True, verbose=False)
    toks = prompt_tokens(vocab, args.length * 2 + 200)
    vocab.close()
    n = args.length

    def prompts(r: int) -> list[list[int]]:
        return [toks[:1] + toks[1 + 97 * (4 * r + i): 97 * (4 * r + i) + n] for i in range(4)]

    extra = ["-c", str(4 * (n + args.n_predict + 64)), "-np", "4", "--threads", str(args.threads), "-ngl", "0",
             "--no-warmup"]
    rows: dict[str, list[dict]] = {}
    for name, rf, overrides in (("stock", None, None), ("RidgeFill", RidgeFill(args.maps, min_prompt=256), OVERRIDES)):
        rows[name] = []
        with Server(args.model, rf, extra_args=extra, startup_timeout=120) as srv:
            for r in range(args.rounds):
                for row in serve_round(srv, prompts(r), overrides, args.n_predict):
                    rows[name].append(row | {"round": r})
                    print(name, r, row, flush=True)
    mech = {name: mechanism(args.model, prompts(0)[0], args.threads, **kw) for name, kw in MECHANISM.items()}
    res = {"command": " ".join(["python", "tools/measure/serve_company.py", *sys.argv[1:]]),
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "summary": {k: summarize(v) for k, v in rows.items()}, "rows": rows, "mechanism": mech}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    if args.md:
        args.md.write_text(md)
    print(md)


if __name__ == "__main__":
    main()
