"""TTFT through the patched llama-server, RidgeFill on and off side by side in one server.

One server (``ridgefill-gguf serve`` settings: the map file, or identity fill at a split) answers
the same long prompt with ``"ridgefill": false`` and ``true`` alternately (``cache_prompt`` off, so
every request prefills the whole prompt); TTFT is the time from sending the request to the first
streamed token at the client. Then ``--clients`` different long prompts are sent at once, all exact
and all RidgeFill (wall time until every first token, each client's TTFT), and one client streams
tokens while another's long prompt is prefilled (the longest pause between its tokens), as the
concurrency figures (``--clients 0``: none). The server's own prompt speed of each request
(``timings.prompt_per_second``: llama.cpp's count) is kept beside the client's TTFT, so stock's tokens/s
can be checked against ``bench``'s. Prints a table and writes JSON (``--json``, with where and when it
ran). Ratios are the figure on a shared machine.

    python tools/measure/serve_smollm2.py MODEL --maps MAPS [--n-prompt 4096] [--repeats 5] [--clients 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ridgefill_cpp import Llama, RidgeFill  # noqa: E402  (the patched libraries first)
from ridgefill_cpp.core.machine import measured_on  # noqa: E402
from ridgefill_cpp.quality.bench import prompt_tokens  # noqa: E402
from ridgefill_cpp.server.serve import Server  # noqa: E402


def ttft(url: str, prompt: list[int], ridgefill, timeout: float = 600.0, timings: list | None = None) -> tuple[float, dict | None]:
    """Seconds to the first streamed token, and the RidgeFill statistics of the final event (its
    ``timings``, the server's own, appended to ``timings`` when given)."""
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "cache_prompt": False, "stream": True,
            "ridgefill": ridgefill}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, stats = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("content") is not None and not ev.get("stop"):
                first = time.perf_counter() - t0
            if ev.get("stop"):
                stats = ev.get("ridgefill")
                if timings is not None:
                    timings.append(ev.get("timings"))
    return (first if first is not None else time.perf_counter() - t0), stats


def concurrent(url: str, prompts: list[list[int]], ridgefill) -> dict:
    out: dict[int, float] = {}
    t0 = time.perf_counter()

    def run(i, p):
        out[i] = ttft(url, p, ridgefill)[0]

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": time.perf_counter() - t0, "ttft_s": [out[i] for i in range(len(prompts))]}


def generation_gaps(url: str, long_prompt: list[int], short_prompt: list[int], ridgefill) -> dict:
    """One client streams 160 tokens; 1 s in, another sends the long prompt. The longest pause between
    two streamed tokens of the first client, and the long prompt's TTFT."""
    stamps: list[float] = []

    def stream():
        body = {"prompt": short_prompt, "n_predict": 160, "temperature": 0, "cache_prompt": False, "stream": True,
                "ignore_eos": True, "ridgefill": False}
        req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: "):
                    stamps.append(time.perf_counter())

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    long_ttft, stats = ttft(url, long_prompt, ridgefill)
    t.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps), "long_ttft_s": long_ttft,
            "applied": bool(stats and stats.get("applied"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--maps", type=Path)
    ap.add_argument("--split", type=int, help="identity fill at this split (without --maps)")
    ap.add_argument("--n-prompt", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clients", type=int, default=4, help="clients of the concurrency figures (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-prompt", type=int, default=1024, help="RidgeFill's minimum prompt (rows)")
    ap.add_argument("--extra", default="", help="more llama-server arguments, space-separated")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    rf = RidgeFill(a.maps, min_prompt=a.min_prompt) if a.maps else RidgeFill.identity(split=a.split, min_prompt=a.min_prompt)
    llm = Llama(str(a.model), vocab_only=True, verbose=False)
    try:
        toks = prompt_tokens(llm, a.n_prompt + 64 * a.clients)
    finally:
        llm.close()
    prompt = toks[: a.n_prompt]
    others = [toks[:1] + toks[1 + 64 * i: a.n_prompt + 64 * i] for i in range(a.clients)]
    slots = max(a.clients, 1)
    n_ctx = a.n_prompt * slots + 256
    extra = ["-c", str(n_ctx), "-np", str(slots), "--threads", str(a.threads), "-ngl", "0", "--no-warmup",
             *a.extra.split()]
    res: dict = {"model": str(a.model), "maps": str(a.maps) if a.maps else None, "split": a.split,
                 "n_prompt": a.n_prompt, "repeats": a.repeats, "clients": a.clients, "threads": a.threads,
                 "measured": measured_on(a.threads)}
    with Server(a.model, rf, extra_args=extra, startup_timeout=300) as srv:
        ttft(srv.url, prompt[:256], False)  # warm-up
        times = {"exact": [], "ridgefill": []}
        server = {"exact": [], "ridgefill": []}
        stats = None
        for _ in range(a.repeats):
            for name, value in (("exact", False), ("ridgefill", True)):
                t, st = ttft(srv.url, prompt, value, timings=server[name])
                times[name].append(t)
                stats = st if value else stats
        res["ttft_s"] = times
        res["median_s"] = {k: statistics.median(v) for k, v in times.items()}
        res["speedup"] = res["median_s"]["exact"] / res["median_s"]["ridgefill"]
        res["server_timings"] = server
        res["server_prompt_tok_s"] = {k: statistics.median(t["prompt_per_second"] for t in v if t)
                                      for k, v in server.items() if any(v)}
        res["ridgefill_stats"] = stats
        if a.clients:
            res["concurrent"] = {"exact": concurrent(srv.url, others, False),
                                 "ridgefill": concurrent(srv.url, others, True)}
            res["generation_during_prefill"] = {"exact": generation_gaps(srv.url, prompt, prompt[:64], False),
                                                "ridgefill": generation_gaps(srv.url, prompt, prompt[:64], True)}
    m = res["median_s"]
    print(f"TTFT, {a.model.name}, {a.n_prompt}-token prompt, median of {a.repeats} (alternating), one server:")
    print(f"  exact     {m['exact'] * 1e3:8.0f} ms   {', '.join(f'{t * 1e3:.0f}' for t in times['exact'])}")
    print(f"  RidgeFill {m['ridgefill'] * 1e3:8.0f} ms   {', '.join(f'{t * 1e3:.0f}' for t in times['ridgefill'])}")
    if stats and stats.get("applied"):
        print(f"  speedup {res['speedup']:.2f}x, ceiling {stats['ceiling']:.2f}x (S = {stats['split']}, "
              f"{stats['n_filled']} rows filled, {stats['n_exact']} + {stats['tail']} exact)")
    else:
        print(f"  speedup {res['speedup']:.2f}x; RidgeFill not applied: {(stats or {}).get('reason')}")
    for name, tok_s in res["server_prompt_tok_s"].items():
        print(f"  the server's own prompt speed, {name}: {tok_s:.1f} tokens/s (median of its timings.prompt_per_second)")
    for name, c in res.get("concurrent", {}).items():
        print(f"  {a.clients} clients at once, {name}: all first tokens after {c['wall_s']:.1f} s; "
              f"TTFT {', '.join(f'{t:.1f}' for t in sorted(c['ttft_s']))} s")
    for name, g in res.get("generation_during_prefill", {}).items():
        print(f"  a client streaming while another's prompt is prefilled ({name}): longest pause between tokens "
              f"{g['max_gap_s']:.1f} s (median {g['median_gap_s'] * 1e3:.0f} ms); the prompt's TTFT {g['long_ttft_s']:.1f} s")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
