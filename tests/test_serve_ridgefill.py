"""RidgeFill inside the patched llama-server (patch 0007, csrc/server/): a real server on a loopback
port, driven by raw HTTP and the official ``openai`` client.

The oracle of the server path is the library path (``ridgefill_cpp.Llama(..., ridgefill=...)``,
itself checked against the independent reference in test_prefill.py): the same GGUF, the same
settings (F32 KV, flash attention off, the same batch sizes) give the same first-token
probabilities (1e-4) and the same greedy tokens; ``"ridgefill": false`` gives stock prefill's. The
statistics next to ``timings`` and the ``/metrics`` counters are checked against the plan (rows
filled = N - T - |E|), malformed values against HTTP 400 with a server that stays up, the prompt
cache against its rule (an exact request never reuses the approximate rows of a RidgeFill prompt),
and ``-np 4`` against each request served alone, also while another slot generates.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import evaluation_tokens
from ridgefill_cpp import Llama, RidgeFill  # before llama_cpp: the patched libraries
from ridgefill_cpp.server.serve import Server
from test_serve import no_proxy  # noqa: F401  (autouse: loopback requests never go through a proxy)

HTTP_TIMEOUT = 120
F32 = 0  # GGML_TYPE_F32
#: the tiny llama (6 layers): identity fill at S = 3, short prompts count as long
TINY_RF = dict(split=3, tail=16, exact_fraction=0.1, selector="attention", min_prompt=64)
#: the same numerics as the library below: F32 KV, no flash attention, 256-row batches of 64-row ubatches
TINY_ARGS = ["-c", "4096", "-np", "4", "-b", "256", "-ub", "64", "--threads", "1", "-ngl", "0",
             "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--metrics", "--no-warmup"]


def _post(url: str, body: dict, timeout: float = HTTP_TIMEOUT) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _get(url: str, timeout: float = HTTP_TIMEOUT) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def _complete(srv: Server, prompt: list[int], n: int = 6, **kw) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 5, "return_tokens": True,
            "cache_prompt": False, **kw}
    status, res = _post(srv.url + "/completion", body)
    assert status == 200, res
    return res


def _first_probs(res: dict) -> dict[int, float]:
    # llama-server reports a token's probabilities with its text: none for a token that is an
    # incomplete UTF-8 piece (a byte token), so the first entry would belong to a later token
    first = res["completion_probabilities"][0]
    assert first["id"] == res["tokens"][0], (
        f"llama-server reported no probabilities for the first token {res['tokens'][0]} (an incomplete UTF-8 "
        f"piece): use another prompt")
    top = first["top_logprobs"]
    return {t["id"]: float(np.exp(t["logprob"])) for t in top}


def _library(model: Path, prompt: list[int], rf: RidgeFill | None, n: int = 6, swa_full: bool = True,
             cuts: tuple[int, ...] = ()) -> tuple[dict[int, float], list[int], dict]:
    """First-token top-5 probabilities, greedy tokens and statistics of the library path; ``cuts``: where
    the prompt is split into separate ``eval`` calls (batch boundaries the server chose)."""
    from ridgefill_cpp.quality.bench import greedy_continuation, last_logits

    llm = Llama(str(model), n_ctx=2048, n_batch=256, n_ubatch=64, n_threads=1, n_threads_batch=1, flash_attn=False,
                type_k=F32, type_v=F32, verbose=False, ridgefill=rf, swa_full=swa_full)
    try:
        for a, b in zip((0, *cuts), (*cuts, len(prompt))):
            llm.eval(prompt[a:b])
        logits = last_logits(llm).astype(np.float64)
        stats = dict(llm.ridgefill_stats) if rf is not None else {}
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:5]
        return {int(t): float(p[t]) for t in top}, greedy_continuation(llm, last_logits(llm), n), stats
    finally:
        llm.close()


def _assert_same(res: dict, lib: tuple) -> None:
    probs, tokens, _ = lib
    got = _first_probs(res)
    assert set(got) == set(probs), (got, probs)
    for t, p in probs.items():
        assert abs(got[t] - p) < 1e-4, (t, got[t], p)
    assert res["tokens"] == tokens[: len(res["tokens"])] and len(res["tokens"]) >= 1


def _assert_same_first_token(res: dict, ref: dict) -> None:
    """The same first token, and first-token distributions close (KL over their common top-5 tokens,
    renormalised, below 0.1 nats): for one request served with its rows in other KV cells."""
    got, want = _first_probs(res), _first_probs(ref)
    assert max(got, key=got.get) == max(want, key=want.get) == res["tokens"][0] == ref["tokens"][0]
    common = sorted(set(got) & set(want))
    pg, pw = np.array([got[t] for t in common]), np.array([want[t] for t in common])
    pg, pw = pg / pg.sum(), pw / pw.sum()
    assert float((pw * np.log(pw / pg)).sum()) < 0.1, (got, want)


def _prompt(model: Path, n: int, shift: int = 0) -> list[int]:
    """n tokens of the evaluation text (BOS, then the text from token ``shift`` on)."""
    toks = evaluation_tokens(model, n + shift) if n + shift <= 1000 else _long_tokens(model, n + shift)
    return toks[:1] + toks[1 + shift:]


def _long_tokens(model: Path, n: int) -> list[int]:
    from ridgefill_cpp.quality.bench import prompt_tokens

    llm = Llama(str(model), vocab_only=True, verbose=False)
    try:
        return prompt_tokens(llm, n)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-rf") / "server.log"
    rf = RidgeFill.identity(**TINY_RF)
    with Server(tiny_models["llama"], rf, extra_args=TINY_ARGS, log_path=log, startup_timeout=60) as s:
        yield s


def test_ridgefill_prompt_matches_the_library_and_reports_its_plan(tiny, tiny_models):
    model = tiny_models["llama"]
    prompt = _prompt(model, 400)
    res = _complete(tiny, prompt)
    lib = _library(model, prompt, RidgeFill.identity(**TINY_RF))
    _assert_same(res, lib)
    st = res["ridgefill"]
    assert st["requested"] and st["applied"]
    assert (st["n_prompt"], st["split"], st["n_layer"], st["tail"]) == (400, 3, 6, 16)
    assert st["n_exact"] == lib[2]["n_exact"] == int(np.ceil(0.1 * (400 - 16)))
    assert st["n_filled"] == 400 - 16 - st["n_exact"]
    assert st["selector"] == "attention" and st["exact_fraction"] == pytest.approx(0.1) and st["span"] == 16
    r = 3 / 6 + (1 - 3 / 6) * (16 + st["n_exact"]) / 400
    assert st["ceiling"] == pytest.approx(1 / r, rel=1e-5)
    assert 0 < st["late_ms"] <= st["prefill_ms"]
    assert st["prefill_ms"] == pytest.approx(res["timings"]["prompt_ms"], rel=0.05)
    # the plan's accounting, as Llama.ridgefill_stats has it
    assert set(st["graphs"]) == set(lib[2]["graphs"]) and st["graphs"]["late_built"] == lib[2]["graphs"]["late_built"] > 0
    assert set(st["times_ms"]) == set(lib[2]["times_ms"]) and st["times_ms"]["late"] == st["late_ms"]
    assert st["late_rows"] == lib[2]["late_rows"] and st["late_rows"]["attention"] > 0
    assert st["window"] == lib[2]["window"] == {"scratch_cells": 0, "scratch_bytes": 0, "graphs": 0}  # no SWA layer
    assert st["maps_bytes"] == lib[2]["maps_bytes"] == 0  # identity fill
    # GET /props tells clients the server's settings
    props = json.loads(_get(tiny.url + "/props")[1])["ridgefill"]
    assert props == {"maps": "", "split": 3, "tail": 16, "exact_fraction": 0.1, "selector": "attention", "span": 16,
                     "key_rescale": 0, "min_prompt": 64}
    assert "key_rescale" in st and st["key_rescale"] == 0


def test_exact_request_is_stock_prefill(tiny, tiny_models):
    model = tiny_models["llama"]
    prompt = _prompt(model, 400)
    res = _complete(tiny, prompt, ridgefill=False)
    _assert_same(res, _library(model, prompt, None))
    assert res["ridgefill"] == {"requested": False, "applied": False, "n_prompt": 400, "reason": "exact prefill requested"}
    # a prompt shorter than the minimum runs stock too, and says so
    short = _prompt(model, 40)
    res = _complete(tiny, short)
    _assert_same(res, _library(model, short, None))
    assert res["ridgefill"]["applied"] is False and "min-prompt" in res["ridgefill"]["reason"]


def test_per_request_settings_override_the_servers(tiny, tiny_models):
    model = tiny_models["llama"]
    prompt = _prompt(model, 300, shift=7)
    for over in ({"tail": 32, "exact_fraction": 0.0, "selector": "none"}, {"selector": "protected", "exact_fraction": 0.2},
                 {"tail": 8}, {"span": 1}, {"selector": "probe", "span": 5}):
        res = _complete(tiny, prompt, ridgefill=over)
        kw = dict(TINY_RF)
        kw.update(over)
        _assert_same(res, _library(model, prompt, RidgeFill.identity(**kw)))
        st = res["ridgefill"]
        assert st["applied"] and st["tail"] == kw["tail"] and st["selector"] == kw["selector"]
        assert st["span"] == kw.get("span", 16)
        assert st["n_filled"] == 300 - kw["tail"] - st["n_exact"]
    # back to the server's settings
    res = _complete(tiny, prompt, ridgefill=True)
    assert res["ridgefill"]["tail"] == 16 and res["ridgefill"]["selector"] == "attention" and res["ridgefill"]["span"] == 16


BAD = [("yes", "must be false"), (1, "must be false"), ([], "must be false"), ({"tail": 0}, '"tail"'),
       ({"tail": 1.5}, '"tail"'), ({"exact_fraction": 2}, '"exact_fraction"'), ({"exact_fraction": "a"}, '"exact_fraction"'),
       ({"selector": "foo"}, '"selector"'), ({"selector": 1}, '"selector"'), ({"tails": 3}, 'unknown member "tails"'),
       ({"span": 0}, '"span"'), ({"span": 4097}, '"span"'), ({"span": 2.5}, '"span"'),
       # a NUL inside the name: C would read "attention" (it ran attention with 200)
       ({"selector": "attention\u0000garbage"}, '"selector" must be one of'), ({"selector": "\u0000"}, '"selector"'),
       ({"tail\u0000": 3}, "unknown member")]


@pytest.mark.parametrize("endpoint", ["/completion", "/v1/completions", "/v1/chat/completions"])
def test_malformed_values_are_http_400_naming_the_field(tiny, endpoint):
    body = {"messages": [{"role": "user", "content": "hello"}]} if "chat" in endpoint else {"prompt": "hello"}
    for value, what in BAD:
        status, res = _post(tiny.url + endpoint, {**body, "max_tokens": 2, "ridgefill": value})
        assert status == 400, (value, res)
        msg = res["error"]["message"]
        assert "'ridgefill'" in msg and what in msg, (value, msg)
    assert _get(tiny.url + "/health")[0] == 200
    # null means the server's default
    status, res = _post(tiny.url + endpoint, {**body, "max_tokens": 2, "ridgefill": None})
    assert status == 200 and tiny.process.poll() is None


def test_openai_client_extra_body_and_statistics(tiny, tiny_models):
    model = tiny_models["llama"]
    client = openai.OpenAI(base_url=tiny.base_url, api_key="unused", timeout=HTTP_TIMEOUT, max_retries=0)
    prompt = _prompt(model, 300)
    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ridgefill": {"tail": 24}, "cache_prompt": False})
    st = c.model_extra["ridgefill"]
    assert st["applied"] and st["tail"] == 24 and "timings" in c.model_extra
    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ridgefill": False, "cache_prompt": False})
    assert c.model_extra["ridgefill"]["applied"] is False
    # chat: the template makes the prompt; a long user message is planned
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)
    ch = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4,
                                        temperature=0, extra_body={"ridgefill": True, "cache_prompt": False})
    assert ch.model_extra["ridgefill"]["applied"] and ch.model_extra["ridgefill"]["n_prompt"] > 64
    with pytest.raises(openai.BadRequestError, match="ridgefill"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"ridgefill": {"tail": -1}})
    # streaming: the statistics arrive with the last chunk
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                 max_tokens=3, temperature=0, stream=True,
                                                 extra_body={"cache_prompt": False}))
    assert chunks[-1].model_extra["ridgefill"]["applied"]


def test_several_prompts_get_one_statistics_object_per_choice(tiny, tiny_models):
    """/v1/completions with several prompts answered one top-level ``ridgefill`` object for all of
    them; each choice now carries its own (the top-level one stays, for the first choice, as the
    ``timings`` next to it), and /completion's array has one per element."""
    model = tiny_models["llama"]
    # (shifts no other test uses: these prompts stay in the server's prompt cache, where a later test's
    # prompt must not find a prefix of its own)
    prompts = [_prompt(model, 300, shift=43), _prompt(model, 40, shift=47), _prompt(model, 200, shift=53)]
    body = {"prompt": prompts, "max_tokens": 2, "temperature": 0, "cache_prompt": False}
    status, res = _post(tiny.url + "/v1/completions", body)
    assert status == 200, res
    choices = sorted(res["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    stats = [c["ridgefill"] for c in choices]
    assert [s["n_prompt"] for s in stats] == [300, 40, 200]
    assert [s["applied"] for s in stats] == [True, False, True]  # 40 rows: below --ridgefill-min-prompt
    assert stats[1]["reason"] == "fewer new prompt rows than --ridgefill-min-prompt"
    for p, s in zip((prompts[0], prompts[2]), (stats[0], stats[2])):
        assert s["n_filled"] == len(p) - s["tail"] - s["n_exact"] > 0
    assert res["ridgefill"] == next(c["ridgefill"] for c in res["choices"] if c["index"] == 0)
    status, arr = _post(tiny.url + "/completion", {**body, "n_predict": 2})
    assert status == 200 and [a["ridgefill"]["n_prompt"] for a in arr] == [300, 40, 200]
    # chat: one choice, the same object in it and at the top
    client = openai.OpenAI(base_url=tiny.base_url, api_key="unused", timeout=HTTP_TIMEOUT, max_retries=0)
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)
    ch = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2,
                                        temperature=0, extra_body={"cache_prompt": False})
    assert ch.choices[0].model_extra["ridgefill"] == ch.model_extra["ridgefill"] and ch.model_extra["ridgefill"]["applied"]


def _metrics(srv: Server) -> dict[str, float]:
    out = {}
    for line in _get(srv.url + "/metrics")[1].splitlines():
        if line.startswith("llamacpp:ridgefill_"):
            k, v = line.split()
            out[k.split(":")[1]] = float(v)
    return out


def test_metrics_count_ridgefill_prefills_and_rows(tiny, tiny_models):
    model = tiny_models["llama"]
    before = _metrics(tiny)
    assert set(before) == {"ridgefill_prefills_total", "ridgefill_rows_filled_total", "ridgefill_rows_exact_total"}
    stats = [_complete(tiny, _prompt(model, n), n=2)["ridgefill"] for n in (200, 260)]
    _complete(tiny, _prompt(model, 200), n=2, ridgefill=False)
    after = _metrics(tiny)
    assert after["ridgefill_prefills_total"] - before["ridgefill_prefills_total"] == 2
    assert after["ridgefill_rows_filled_total"] - before["ridgefill_rows_filled_total"] == sum(s["n_filled"] for s in stats)
    assert after["ridgefill_rows_exact_total"] - before["ridgefill_rows_exact_total"] == \
        sum(s["n_exact"] + s["tail"] for s in stats)


def test_prompt_cache_never_serves_approximate_rows_to_an_exact_request(tiny, tiny_models):
    model = tiny_models["llama"]
    a = _prompt(model, 700, shift=3)
    slot = {"id_slot": 2, "cache_prompt": True}
    # the slot starts from an exact prompt sharing only the BOS row (whatever earlier tests left in it:
    # with a KV stream per slot, a BOS row an earlier planned prompt filled would stay approximate)
    _complete(tiny, _prompt(model, 20, shift=600), ridgefill=False, **slot)
    # a RidgeFill prompt: its rows from the first new one on are approximate at the late layers
    res = _complete(tiny, a[:420], **slot)
    assert res["ridgefill"]["applied"]
    n_exact = res["timings"]["cache_n"]  # the rows before the plan (at most the BOS row in common)
    assert n_exact <= 1
    # an exact request with the same prefix reuses the exact rows only, and equals stock prefill
    res = _complete(tiny, a[:380], ridgefill=False, **slot)
    assert res["timings"]["cache_n"] == n_exact and res["ridgefill"]["applied"] is False
    _assert_same(res, _library(model, a[:380], None))
    # that request left an exact cache: the next exact request reuses all of it
    res = _complete(tiny, a[:400], ridgefill=False, **slot)
    assert res["timings"]["cache_n"] == 380
    # a RidgeFill request over an exact prefix plans only its new rows [400, 600)
    res = _complete(tiny, a[:600], **slot)
    assert res["timings"]["cache_n"] == 400 and res["ridgefill"]["applied"] and res["ridgefill"]["n_prompt"] == 200
    # a RidgeFill request reuses the approximate rows (it accepted the approximation) ...
    res = _complete(tiny, a[:610], **slot)
    assert res["timings"]["cache_n"] == 600 and res["ridgefill"]["applied"] is False  # 10 new rows: stock
    # a planned prompt over approximate rows keeps them approximate: rows 400.. stay so, 610.. are filled
    res = _complete(tiny, a[:690], **slot)
    assert res["timings"]["cache_n"] == 610 and res["ridgefill"]["applied"] and res["ridgefill"]["n_prompt"] == 80
    # ... an exact one stops at the first approximate row, and still equals stock prefill
    res = _complete(tiny, a[:650], ridgefill=False, **slot)
    assert res["timings"]["cache_n"] == 400
    _assert_same(res, _library(model, a[:650], None))
    res = _complete(tiny, a[:700], ridgefill=False, **slot)
    assert res["timings"]["cache_n"] == 650


def test_host_memory_prompt_cache_keeps_the_approximate_mark(tiny_models, tmp_path):
    """One slot and llama-server's host-memory prompt cache (--cache-ram): a RidgeFill prompt saved there
    when another prompt takes the slot, and loaded back for a request with its prefix, is still known to
    be approximate: an exact request reuses only its exact rows (and equals stock), a RidgeFill request
    reuses all of it."""
    model = tiny_models["llama"]
    args = [a if a != "4" else "1" for a in TINY_ARGS] + ["--cache-ram", "64"]  # -np 1
    a, b = _prompt(model, 400, shift=31), _prompt(model, 300, shift=500)
    with Server(model, RidgeFill.identity(**TINY_RF), extra_args=args, log_path=tmp_path / "s.log", startup_timeout=60) as s:
        res = _complete(s, a, cache_prompt=True)
        assert res["ridgefill"]["applied"] and res["timings"]["cache_n"] == 0
        res = _complete(s, b, cache_prompt=True, ridgefill=False)  # takes the slot: a goes to the host cache
        assert res["timings"]["cache_n"] <= 1
        # an exact request with a's prefix: a comes back from the host cache, only its exact rows count
        res = _complete(s, a[:380], cache_prompt=True, ridgefill=False)
        assert res["timings"]["cache_n"] == 0
        _assert_same(res, _library(model, a[:380], None))
        # (that exact prompt is cached now; a RidgeFill request after a's approximate version again)
        _complete(s, a, cache_prompt=True)  # approximate again, in the slot
        _complete(s, b, cache_prompt=True, ridgefill=False)  # a to the host cache
        # RidgeFill: reuses the approximate rows - which only the host cache can have brought back, so
        # the exact request above (cache_n 0, not 380) read a's mark from there too
        res = _complete(s, a[:390] + [7, 8], cache_prompt=True)
        assert res["timings"]["cache_n"] == 390


def _concurrent_equal_alone(srv: Server, model: Path) -> None:
    """Three RidgeFill prompts and one 48-token generation at once on four slots: each equals the same
    request served alone (tokens, plan, first-token probabilities)."""
    prompts = [_prompt(model, 300 + 20 * i, shift=11 * i) for i in range(3)]
    gen_prompt = _prompt(model, 30, shift=5)

    def run(p, n, **kw):
        return _complete(srv, p, n=n, **kw)

    alone = [run(p, 6) for p in prompts]
    gen_alone = run(gen_prompt, 48, ridgefill=False)
    results: dict[int, dict] = {}

    def worker(i, p, n, **kw):
        results[i] = run(p, n, **kw)

    threads = [threading.Thread(target=worker, args=(-1, gen_prompt, 48), kwargs={"ridgefill": False})]
    threads += [threading.Thread(target=worker, args=(i, p, 6)) for i, p in enumerate(prompts)]
    threads[0].start()
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=HTTP_TIMEOUT)
        assert not t.is_alive()
    assert results[-1]["tokens"] == gen_alone["tokens"] and len(gen_alone["tokens"]) == 48
    for i, a in enumerate(alone):
        r = results[i]
        assert r["ridgefill"]["applied"] and r["tokens"] == a["tokens"]
        assert r["ridgefill"]["n_filled"] == a["ridgefill"]["n_filled"]
        # (a token that ends inside a UTF-8 character has no probabilities in llama-server's response)
        assert [e["id"] for e in r.get("completion_probabilities", [])] == [e["id"] for e in a.get("completion_probabilities", [])]
        for er, ea in zip(r.get("completion_probabilities", []), a.get("completion_probabilities", [])):
            assert {t["id"]: t["logprob"] for t in er["top_logprobs"]} == pytest.approx(
                {t["id"]: t["logprob"] for t in ea["top_logprobs"]}, abs=1e-3)
    slots = {r["id_slot"] for r in results.values()}
    assert len(slots) == 4  # four slots served them at once


def test_four_slots_concurrent_equal_alone_also_while_one_generates(tiny, tiny_models):
    _concurrent_equal_alone(tiny, tiny_models["llama"])


def test_a_planned_prompt_is_prefilled_alone_whatever_its_company(tiny_models, tmp_path):
    """Issue #44, item 5: with llama-server's default numerics (F16 KV, flash attention auto, 2
    threads) the same request can answer differently alone and next to others, on stock llama-server
    as well: the CPU flash-attention kernel takes another summation order for one query row (its
    split-KV path) than for the rows of several slots decoded in one call
    (docs/company-smollm2). What RidgeFill adds must not depend on the company: a planned prompt's
    rows are decoded alone, so its first token's distribution - the prefill's output - is the same
    bit for bit alone and next to three requests with other overrides (the issue's probe/span 1
    among them), and its plan is the same."""
    model = tiny_models["llama"]
    overrides = [False, {"tail": 32}, {"exact_fraction": 0.3}, {"selector": "probe", "span": 1}]
    prompts = [_prompt(model, 600, shift=17 + 13 * i) for i in range(4)]
    args = ["-c", "4096", "-np", "4", "--threads", "2", "-ngl", "0", "--no-warmup"]
    with Server(model, RidgeFill.identity(**TINY_RF), extra_args=args, log_path=tmp_path / "server.log",
                startup_timeout=60) as srv:
        def run(i):
            return _complete(srv, prompts[i], n=4, ridgefill=overrides[i])

        alone = [run(i) for i in range(4)]
        together = dict(enumerate(_concurrently_run(run, 4)))
    for i in range(1, 4):
        a, t = alone[i], together[i]
        assert a["ridgefill"]["applied"] and t["ridgefill"]["applied"]
        for key in ("n_filled", "n_exact", "tail", "selector", "span", "probe_rows"):
            assert a["ridgefill"][key] == t["ridgefill"][key], (overrides[i], key)
        assert a["completion_probabilities"][0]["top_logprobs"] == t["completion_probabilities"][0]["top_logprobs"]
        assert a["tokens"][0] == t["tokens"][0]


def _concurrently_run(run, n: int) -> list[dict]:
    out: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, run(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HTTP_TIMEOUT)
        assert not t.is_alive()
    return [out[i] for i in range(n)]


def test_qwen35_four_slots_concurrent_equal_alone(tiny_models, tmp_path):
    """The hybrid with four slots: planned prompts take turns with a generating slot, each slot's
    recurrent cell continues only its own sequence (the late phase addresses the cell by sequence)."""
    rf = RidgeFill.identity(**TINY_RF)
    with Server(tiny_models["qwen35"], rf, extra_args=TINY_ARGS, log_path=tmp_path / "s.log", startup_timeout=60) as s:
        _concurrent_equal_alone(s, tiny_models["qwen35"])


def test_generation_takes_turns_with_the_chunks_of_a_planned_prompt(tiny_models, tmp_path):
    """A planned prompt of several n_batch chunks while another slot generates: between two chunks the
    generating slot gets a decode call of its own (the server's debug log says so), and both outputs
    equal the same requests served alone."""
    model = tiny_models["llama"]
    args = [a if a != "256" else "64" for a in TINY_ARGS] + ["-v"]  # -b 64: a 400-row prompt is 7 chunks
    prompt, gen_prompt = _prompt(model, 400, shift=21), _prompt(model, 30, shift=9)
    with Server(model, RidgeFill.identity(**TINY_RF), extra_args=args, log_path=tmp_path / "s.log", startup_timeout=60) as s:
        alone = _complete(s, prompt, n=4)
        gen_alone = _complete(s, gen_prompt, n=600, ridgefill=False, ignore_eos=True)
        n_turns = s.log().count("while the other slots take a turn")
        assert n_turns == 0
        done: dict[str, dict] = {}
        gen = threading.Thread(target=lambda: done.__setitem__(
            "gen", _complete(s, gen_prompt, n=600, ridgefill=False, ignore_eos=True)))
        n_decoded = s.log().count("slot decode token")
        gen.start()
        while s.log().count("slot decode token") == n_decoded and gen.is_alive():
            time.sleep(0.005)  # until the generating slot runs
        res = _complete(s, prompt, n=4)
        overlapped = gen.is_alive()  # it generated during the whole planned prompt
        gen.join(timeout=HTTP_TIMEOUT)
        assert not gen.is_alive()
        turns = s.log().count("while the other slots take a turn")
    assert res["tokens"] == alone["tokens"] and res["ridgefill"]["n_filled"] == alone["ridgefill"]["n_filled"]
    assert done["gen"]["tokens"] == gen_alone["tokens"] and len(gen_alone["tokens"]) == 600
    assert overlapped, "the 600-token generation ended before the 400-row prompt was served"
    assert turns - n_turns >= 6  # a turn after each of the first six chunks of seven


def test_a_server_without_ridgefill_accepts_only_false(tiny_models, tmp_path):
    args = [a for a in TINY_ARGS if a != "--metrics"]
    with Server(tiny_models["llama"], None, extra_args=args, log_path=tmp_path / "s.log", startup_timeout=60) as s:
        status, res = _post(s.url + "/completion", {"prompt": "hello", "n_predict": 2, "ridgefill": True})
        assert status == 400 and "without RidgeFill" in res["error"]["message"]
        status, res = _post(s.url + "/completion", {"prompt": "hello", "n_predict": 2, "ridgefill": False})
        assert status == 200 and "ridgefill" not in res
        status, res = _post(s.url + "/completion", {"prompt": "hello", "n_predict": 2})
        assert status == 200 and "ridgefill" not in res
        assert "ridgefill" not in json.loads(_get(s.url + "/props")[1])


def test_bad_maps_or_settings_stop_the_server_with_a_message(tiny_models, tmp_path):
    from ridgefill_cpp.server.serve import ServerError

    # a map file of another model: the Python side refuses before starting; the binary itself too
    import subprocess

    from ridgefill_cpp.server.serve import server_binary

    other = tiny_models["qwen3"]
    proc = subprocess.run([str(server_binary()), "-m", str(tiny_models["llama"]), "--host", "127.0.0.1", "--port", "0",
                           "--ridgefill-split", "3", "--ridgefill-selector", "nearest"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--ridgefill-selector nearest" in proc.stdout + proc.stderr
    proc = subprocess.run([str(server_binary()), "-m", str(tiny_models["llama"]), "--host", "127.0.0.1", "--port", "0",
                           "--ridgefill-split", "9"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "split 9 outside 1..6" in proc.stdout + proc.stderr
    proc = subprocess.run([str(server_binary()), "-m", str(tiny_models["llama"]), "--host", "127.0.0.1", "--port", "0",
                           "--ridgefill-maps", str(other)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--ridgefill-maps" in proc.stdout + proc.stderr
    # an empty map path (a shell variable that was not set) is refused, not a server that silently runs stock
    proc = subprocess.run([str(server_binary()), "-m", str(tiny_models["llama"]), "--host", "127.0.0.1", "--port", "0",
                           "--ridgefill-maps", ""], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--ridgefill-maps" in proc.stdout + proc.stderr and "an empty path" in proc.stdout + proc.stderr
    del ServerError


def test_gemma3_ridge_maps_sliding_window_layers_and_no_checkpoints(tiny_models, tmp_path):
    """gemma3 (sliding-window layers) with ridge maps fitted on its own hidden states, on the window-sized
    sliding-window cache llama-server creates by default (no --swa-full forced): the server equals the
    library; no context checkpoint is taken inside a planned prompt."""
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import write_map_file

    model = tiny_models["gemma3"]
    fit = fit_ridge_maps(model, corpus.default_documents("calibration"), FitOptions(n_tokens=3000, ctx=128, split=4, n_threads=1))
    maps = write_map_file(tmp_path / "gemma3.ridgefill.gguf", fit.maps, dtype="f32")
    rf = RidgeFill(maps, tail=16, exact_fraction=0.1, min_prompt=64)
    with Server(model, rf, extra_args=[*TINY_ARGS, "-v"], log_path=tmp_path / "s.log", startup_timeout=60) as s:
        for n in (200, 333):
            prompt = _prompt(model, n)
            res = _complete(s, prompt)
            lib = _library(model, prompt, rf, swa_full=False)
            _assert_same(res, lib)
            st = res["ridgefill"]
            assert st["applied"] and st["split"] == 4
            # the late sliding-window layers' scratch and the maps, as Llama.ridgefill_stats has them
            assert st["window"] == lib[2]["window"] and st["window"]["scratch_cells"] == 256
            assert st["window"]["scratch_bytes"] > 0
            assert (st["window"]["graphs"] > 0) == (n > 256)  # window graphs once the cache has dropped rows
            assert st["maps_bytes"] == lib[2]["maps_bytes"] > 0
        log = s.log()
    assert "--swa-full" not in log and "created context checkpoint" not in log
    assert "SWA KV cache, size = 256 cells" in log  # n_swa + n_ubatch, padded, per slot


def test_qwen35_hybrid_through_the_server_equals_the_library(tiny_models, tmp_path):
    """The Gated DeltaNet hybrid (tiny qwen35) with ridge maps, one slot: RidgeFill requests equal the
    library path and exact requests equal stock, prompt after prompt in the same recurrent cell.
    (Prompts whose first generated token is a complete character: see _first_probs.)"""
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import write_map_file

    model = tiny_models["qwen35"]
    fit = fit_ridge_maps(model, corpus.default_documents("calibration"), FitOptions(n_tokens=3000, ctx=128, split=3, n_threads=1))
    maps = write_map_file(tmp_path / "qwen35.ridgefill.gguf", fit.maps, dtype="f32")
    rf = RidgeFill(maps, tail=16, exact_fraction=0.1, min_prompt=64)
    with Server(model, rf, extra_args=[*TINY_ARGS, "-np", "1"], log_path=tmp_path / "s.log", startup_timeout=60) as s:
        for n in (200, 230, 210):
            prompt = _prompt(model, n)
            _assert_same(_complete(s, prompt, ridgefill=False), _library(model, prompt, None))
            res = _complete(s, prompt)
            lib = _library(model, prompt, rf)
            _assert_same(res, lib)
            st = res["ridgefill"]
            assert st["applied"] and st["split"] == 3 and st["n_filled"] == lib[2]["n_filled"] > 0


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M: long prompts, stock server vs RidgeFill off, four clients at once

SMOL_ARGS = ["-c", "8192", "-np", "4", "--threads", "2", "-ngl", "0", "--no-warmup"]


@pytest.mark.slow
def test_smollm2_long_prompts_on_off_and_four_clients(smollm2_path, tmp_path):
    prompts = [_prompt(smollm2_path, 1400 + 100 * i, shift=200 * i) for i in range(4)]
    with Server(smollm2_path, None, extra_args=SMOL_ARGS, log_path=tmp_path / "stock.log", startup_timeout=120) as s:
        stock = [_complete(s, p, n=8) for p in prompts[:2]]
    rf = RidgeFill.identity(split=20)
    with Server(smollm2_path, rf, extra_args=SMOL_ARGS, log_path=tmp_path / "rf.log", startup_timeout=120) as s:
        off = [_complete(s, p, n=8, ridgefill=False) for p in prompts[:2]]
        for a, b in zip(off, stock):
            assert a["tokens"] == b["tokens"] and _first_probs(a) == pytest.approx(_first_probs(b), abs=1e-5)
            assert a["ridgefill"]["applied"] is False
        alone = [_complete(s, p, n=8) for p in prompts]
        results: dict[int, dict] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(i, _complete(s, p, n=8)))
                   for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
            assert not t.is_alive()
        for i, a in enumerate(alone):
            r = results[i]
            assert a["ridgefill"]["applied"] and r["ridgefill"]["applied"] and a["ridgefill"]["split"] == 20
            assert (r["ridgefill"]["n_filled"], r["ridgefill"]["n_exact"]) == (a["ridgefill"]["n_filled"], a["ridgefill"]["n_exact"])
            # Served at once, a prompt's rows sit in other KV cells than served alone, and the masked
            # cells change the order of float sums: on this model that moves the first-token
            # probabilities by up to 0.025 in stock llama-server ("ridgefill": false, also with F32
            # KV and flash attention off) and by up to 0.055 with RidgeFill (measured), and can change
            # a later greedy token. The tiny-model test above holds concurrency to 1e-4; here the
            # first token and the distribution (KL over the top 5) must agree.
            _assert_same_first_token(r, a)
        assert len({r["id_slot"] for r in results.values()}) == 4


def test_cli_serve_with_identity_split_reaches_the_server(tiny_models, tmp_path):
    """`ridgefill-gguf serve MODEL --identity-split 3 ...`: the flags reach llama-server, a long prompt
    is planned with them, SIGTERM stops everything."""
    from test_serve import _assert_stopped_cleanly, _cmdline, _end, _server_child, _start_cli, _wait_for

    out = tmp_path / "cli.out"
    model = tiny_models["llama"]
    proc = _start_cli([model, "--identity-split", "3", "--tail", "12", "--min-prompt", "64", "--port", "0", "--",
                       *TINY_ARGS], out)
    try:
        url = _wait_for(proc, out, r"OpenAI base URL: (http://127\.0\.0\.1:\d+)/v1").group(1)
        server = _server_child(proc.pid)
        cmd = _cmdline(server)
        assert cmd[cmd.index("--ridgefill-split") + 1] == "3" and cmd[cmd.index("--ridgefill-tail") + 1] == "12"
        status, res = _post(url + "/completion", {"prompt": _prompt(model, 150), "n_predict": 2, "cache_prompt": False})
        assert status == 200 and res["ridgefill"]["applied"]
        assert (res["ridgefill"]["split"], res["ridgefill"]["tail"]) == (3, 12)
        proc.send_signal(__import__("signal").SIGTERM)
        assert proc.wait(timeout=20) == 0
        _assert_stopped_cleanly(server)
    finally:
        _end(proc)


@pytest.mark.slow
def test_smollm2_client_gone_during_a_planned_prompt(smollm2_path, tmp_path):
    """A client that disconnects while its 4K prompt is being prefilled (the first of two chunks): the
    plan is dropped with the slot's cache, and the next RidgeFill request is served as on a fresh
    server."""
    import socket

    prompt = _prompt(smollm2_path, 4000, shift=50)
    rf = RidgeFill.identity(split=20)
    # one KV pool for all slots (--kv-unified): a 4K prompt on one of the four slots of an 8K cache
    with Server(smollm2_path, rf, extra_args=[*SMOL_ARGS, "--kv-unified", "-v"], log_path=tmp_path / "s.log",
                startup_timeout=120) as s:
        fresh = _complete(s, prompt[:1500], n=4)
        host, port = s.url.rsplit("/", 1)[1].split(":")
        body = json.dumps({"prompt": prompt, "n_predict": 4, "cache_prompt": False, "id_slot": 1}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 60
            while "RidgeFill: planned prompt rows [0, 4000)" not in s.log() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "RidgeFill: planned prompt rows [0, 4000)" in s.log()
        # the connection is gone mid-plan; the server notices it at the next chunk
        deadline = time.monotonic() + 120
        while "stop processing" not in s.log().split("planned prompt rows [0, 4000)")[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _get(s.url + "/health")[0] == 200
        again = _complete(s, prompt[:1500], n=4)
        assert again["ridgefill"]["applied"] and again["ridgefill"]["n_filled"] == fresh["ridgefill"]["n_filled"]
        _assert_same_first_token(again, fresh)  # (other KV cells: see the four-clients test)
        log = s.log().split("planned prompt rows [0, 4000)")[1]
    # the cancelled request never got a response (it stopped before its first token)
    assert "stop processing" in log and "prompt eval time" not in log.split("stop processing")[0]


@pytest.mark.slow
def test_gemma3_270m_through_the_server_equals_the_library(gemma3_path, tmp_path):
    """The real Gemma 3 270M (sliding-window layers, Q4_K_M) on the server's window-sized SWA cache: RidgeFill and
    exact prefill through the server against the library with the same settings (F32 KV, flash attention off,
    256/64 batches, swa_full off).

    On a window-sized cache, where a row lands in the ring of cells depends on the batch boundaries, and on a
    Q4_K_M model that alone moves the first-token probabilities by up to 0.04 (measured: full-size against
    window-sized 0.0095, the server's boundaries against one ``eval`` 0.039). So the exact request is compared
    with a library run cut where the server cuts a prompt for its context checkpoints (``n_ubatch + 4`` and 4
    rows before the end); the planned request is one pass in both."""
    rf = RidgeFill.identity(split=10)
    prompt = _prompt(gemma3_path, 1200)
    n_ubatch = 64
    args = ["-c", "4096", "-np", "2", "-b", "256", "-ub", str(n_ubatch), "--threads", "2", "-ngl", "0", "-fa", "off",
            "-ctk", "f32", "-ctv", "f32", "--no-warmup"]
    checkpoint_cuts = (len(prompt) - n_ubatch - 4, len(prompt) - 4)
    with Server(gemma3_path, rf, extra_args=args, log_path=tmp_path / "s.log", startup_timeout=120) as s:
        assert "--swa-full" not in (tmp_path / "s.log").read_text()
        for value, lib_rf, cuts in ((True, rf, ()), (False, None, checkpoint_cuts)):
            res = _complete(s, prompt, n=6, ridgefill=value)
            probs, tokens, _ = _library(gemma3_path, prompt, lib_rf, n=6, swa_full=False, cuts=cuts)
            got = _first_probs(res)
            assert max(abs(got[t] - p) for t, p in probs.items() if t in got) < 5e-4, (value, got, probs)
            assert res["tokens"] == tokens[: len(res["tokens"])] and res["ridgefill"]["applied"] is value


def test_measure_server_tool_runs_end_to_end(tiny_models, tmp_path):
    """tools/measure/serve_smollm2.py (the TTFT figures of the README) on the tiny model: both variants timed
    in one server, the plan applied, the concurrency and streaming figures present."""
    import subprocess
    import sys

    tool = Path(__file__).resolve().parents[1] / "tools" / "measure" / "serve_smollm2.py"
    out = tmp_path / "server.json"
    run = subprocess.run([sys.executable, str(tool), str(tiny_models["llama"]), "--split", "3", "--n-prompt", "300",
                          "--repeats", "2", "--clients", "2", "--threads", "1", "--min-prompt", "64",
                          "--extra", "-b 64 -ub 64", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    d = json.loads(out.read_text())
    assert len(d["ttft_s"]["exact"]) == len(d["ttft_s"]["ridgefill"]) == 2 and d["speedup"] > 0
    st = d["ridgefill_stats"]
    assert st["applied"] and st["n_prompt"] == 300 and st["split"] == 3
    for name in ("exact", "ridgefill"):
        assert len(d["concurrent"][name]["ttft_s"]) == 2
        g = d["generation_during_prefill"][name]
        assert 0 < g["median_gap_s"] <= g["max_gap_s"]
    assert d["generation_during_prefill"]["ridgefill"]["applied"] and not d["generation_during_prefill"]["exact"]["applied"]
    assert "speedup" in run.stdout and "ceiling" in run.stdout
    # the server's own count of each timed request: all 300 prompt rows, at a speed
    for name in ("exact", "ridgefill"):
        assert [t["prompt_n"] for t in d["server_timings"][name]] == [300, 300]
        assert d["server_prompt_tok_s"][name] > 0
    assert d["measured"]["threads"] == 1 and d["measured"]["cpu"]


def test_measure_window_tool_runs_end_to_end(tiny_models, tmp_path):
    """tools/measure/serve_window.py (memory, TTFT and retrieval on the window-sized and the full-size
    sliding-window cache) on tiny gemma3 with its own maps: every server measured, the RidgeFill server's
    scratch reported and bounded by the window, not by -c; the full-size servers' KV larger."""
    import subprocess
    import sys

    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import write_map_file

    model = tiny_models["gemma3"]
    fit = fit_ridge_maps(model, corpus.default_documents("calibration"), FitOptions(n_tokens=3000, ctx=128, split=4, n_threads=1))
    maps = write_map_file(tmp_path / "gemma3.ridgefill.gguf", fit.maps, dtype="f32")
    tool = Path(__file__).resolve().parents[1] / "tools" / "measure" / "serve_window.py"
    out = tmp_path / "window.json"
    run = subprocess.run([sys.executable, str(tool), str(model), "--maps", str(maps), "--ctx", "2048",
                          "--lengths", "300,600", "--repeats", "1", "--threads", "1", "--min-prompt", "64",
                          "--retrieval-length", "1024", "--retrieval-prompts", "1", "--extra", "-b 64 -ub 64",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    d = json.loads(out.read_text())
    mem = d["memory"]
    assert set(mem) == {"stock", "RidgeFill", "stock, --swa-full", "RidgeFill, --swa-full"}
    assert mem["RidgeFill"]["applied"] and not mem["stock"]["applied"]
    assert mem["RidgeFill"]["context_mib"] == mem["stock"]["context_mib"] < mem["stock, --swa-full"]["context_mib"]
    assert 0 < mem["RidgeFill"]["ridgefill_scratch_mib"] and mem["RidgeFill, --swa-full"]["ridgefill_scratch_mib"] == 0
    assert mem["RidgeFill"]["ridgefill_maps_mib"] > 0 and all(m["peak_rss_mib"] > 0 for m in mem.values())
    for n in ("300", "600"):
        t = d["ttft"][n]
        assert t["applied"] == {"stock": False, "RidgeFill": True, "RidgeFill, --swa-full": True, "stock, --swa-full": False}
        assert t["speedup"]["stock"] == 1.0 and t["ceiling"] > 1
        assert t["ridgefill_stats"]["window"]["graphs"] > 0 and t["ridgefill_stats_full"]["window"]["graphs"] == 0
    r = d["retrieval"]
    assert r["length"] == 1024 and set(r["conditions"]) == {"exact", "ridge, attention selector"}
    assert len(r["conditions"]["exact"]["correct"]) == 5 and r["window"]["scratch_cells"] > 0
    assert "TTFT at 600 rows" in run.stdout and "retrieval at 1024 rows" in run.stdout


# ------------------------------------------------------------------------------------------------
# several slots on one KV cache; huge and malformed requests


def _post_raw(url: str, data: bytes, timeout: float = HTTP_TIMEOUT) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _concurrently(srv: Server, prompts: list[list[int]], n: int) -> list[tuple[int, dict]]:
    out: list = [None] * len(prompts)

    def one(i):
        out[i] = _post(srv.url + "/completion", {"prompt": prompts[i], "n_predict": n, "temperature": 0,
                                                 "cache_prompt": False})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * HTTP_TIMEOUT)
    assert all(r is not None for r in out), out
    return out


SHARE_ARGS = ["-c", "512", "-np", "2", "-b", "256", "-ub", "64", "--threads", "1", "-ngl", "0", "--no-warmup"]


def test_slots_have_their_own_kv_streams_as_on_stock(tiny_models, tmp_path):
    """Each slot has its own KV stream of the cells it has on a stock server with the same flags
    (-c 512 -np 2: 256 each; no --kv-unified forced): prompts that exceed the share are refused at once
    with stock's 400, prompts that fit are served, also when the two together would not fit one slot's
    share; never a 500 after compute."""
    model = tiny_models["llama"]
    too_long = [_prompt(model, 300, shift=3), _prompt(model, 300, shift=40)]
    fitting = [_prompt(model, 200, shift=5 + 30 * i) for i in range(2)]
    seen = {}
    for name, rf in (("stock", None), ("ridgefill", RidgeFill.identity(**TINY_RF))):
        with Server(model, rf, extra_args=SHARE_ARGS, log_path=tmp_path / f"{name}.log", startup_timeout=60) as s:
            slots = json.loads(_get(s.url + "/slots")[1])
            seen[name] = {"n_ctx": [sl["n_ctx"] for sl in slots]}
            res = _concurrently(s, too_long, n=4)
            seen[name]["too_long"] = [(st, r["error"]["type"]) for st, r in res]
            for _ in range(2):
                res = _concurrently(s, fitting, n=40)
                assert [st for st, _ in res] == [200, 200], res
                if rf is not None:
                    assert all(r["ridgefill"]["applied"] for _, r in res), res
            assert s.process.poll() is None and _get(s.url + "/health")[0] == 200
            if rf is not None:
                assert "--kv-unified" not in s.log()
    assert seen["ridgefill"] == seen["stock"], seen
    assert seen["stock"]["n_ctx"] == [256, 256]
    assert seen["stock"]["too_long"] == [(400, "exceed_context_size_error")] * 2


def test_a_pinned_slot_keeps_its_cache_while_another_slot_runs_a_planned_prompt(tiny_models, tmp_path):
    """A client pinned to slot 0 keeps its cached prompt while slot 1 runs a planned prompt: its
    follow-up processes only its new tokens, as on stock (before, with the unified cache the server
    forced, slot 1's prompt could take slot 0's cells and the follow-up reprocessed everything)."""
    model = tiny_models["llama"]
    first, other = _prompt(model, 200, shift=11), _prompt(model, 300, shift=70)
    follow = first + _prompt(model, 41, shift=400)[1:]
    args = ["-c", "1024", "-np", "2", "-b", "256", "-ub", "64", "--threads", "1", "-ngl", "0", "--no-warmup"]
    seen = {}
    for name, rf in (("stock", None), ("ridgefill", RidgeFill.identity(**TINY_RF))):
        with Server(model, rf, extra_args=args, log_path=tmp_path / f"{name}.log", startup_timeout=60) as s:
            res = [_complete(s, first, n=1, id_slot=0, cache_prompt=True),
                   _complete(s, other, n=1, id_slot=1, cache_prompt=True),
                   _complete(s, follow, n=1, id_slot=0, cache_prompt=True)]
            seen[name] = [(r["timings"]["prompt_n"], r["timings"]["cache_n"]) for r in res]
            if rf is not None:
                assert res[0]["ridgefill"]["applied"] and res[1]["ridgefill"]["applied"]
                slots = {sl["id"]: sl for sl in json.loads(_get(s.url + "/slots")[1])}
                assert slots[0]["n_ctx"] == slots[1]["n_ctx"] == 512
    assert seen["ridgefill"] == seen["stock"], seen
    assert seen["stock"][2][1] >= len(first) - 1 and seen["stock"][2][0] <= len(follow) - len(first) + 1, seen


def test_a_shared_pool_admits_prompts_when_their_rows_fit(tiny_models, tmp_path):
    """With --kv-unified the slots share all -c cells: two 600-row prompts on a 1024-cell cache each
    fit alone but not together. The second waits until the first is done, and both are planned and
    served (before: 'Context size has been exceeded', HTTP 500, after compute)."""
    model = tiny_models["llama"]
    args = ["-c", "1024", "-np", "2", "-b", "256", "-ub", "64", "--threads", "1", "-ngl", "0", "--no-warmup",
            "--kv-unified"]
    prompts = [_prompt(model, 600, shift=7), _prompt(model, 600, shift=90)]
    with Server(model, RidgeFill.identity(**TINY_RF), extra_args=[*args, "-v"], log_path=tmp_path / "s.log",
                startup_timeout=60) as s:
        for _ in range(2):
            res = _concurrently(s, prompts, n=8)
            assert [st for st, _ in res] == [200, 200], res
            assert all(r["ridgefill"]["applied"] and r["ridgefill"]["n_prompt"] == 600 for _, r in res), res
        assert "waits for room in the shared KV cache" in s.log()
        assert "Context size has been exceeded" not in s.log() and "Compute error" not in s.log()


#: the numerics of TINY_ARGS without its slot count and cache size
NP_ARGS = ["-c", "4096", "-b", "256", "-ub", "64", "--threads", "1", "-ngl", "0", "-fa", "off", "-ctk", "f32",
           "-ctv", "f32", "--no-warmup"]


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "kv-unified"])
def test_every_slot_count_starts_and_serves_a_planned_prompt(tiny_models, tmp_path, unified):
    """-np 1 to 8, with one KV stream per slot and with --kv-unified: the server starts and serves a
    planned prompt as the library computes it. (-np 3, 5, 6 and 7 used to abort at start-up: RidgeFill
    reserved its graphs over every stream of the cache, and llama.cpp cuts a ubatch into one part per
    stream, which 64 rows into 3 cannot be.)"""
    model = tiny_models["llama"]
    rf = RidgeFill.identity(**TINY_RF)
    prompt = _prompt(model, 400)  # whose first token is a whole UTF-8 piece (reported with its probabilities)
    lib = _library(model, prompt, rf)
    for n_parallel in range(1, 9):
        args = [*NP_ARGS, "-np", str(n_parallel), *(["--kv-unified"] if unified else [])]
        with Server(model, rf, extra_args=args, log_path=tmp_path / f"np{n_parallel}.log", startup_timeout=60) as s:
            res = _complete(s, prompt)
            assert res["ridgefill"]["applied"] and res["ridgefill"]["n_filled"] > 0, (n_parallel, res["ridgefill"])
            _assert_same(res, lib)
            slots = json.loads(_get(s.url + "/slots")[1])
            assert len(slots) == n_parallel


def test_gemma3_window_sized_cache_with_three_slots(tiny_models, tmp_path):
    """The late sliding-window layers' scratch is reserved over one stream too: gemma3 on the window-sized
    cache llama-server creates by default, -np 3, a prompt longer than the cache's window."""
    model = tiny_models["gemma3"]
    rf = RidgeFill.identity(**{**TINY_RF, "split": 4, "selector": "protected"})
    prompt = _prompt(model, 333)
    lib = _library(model, prompt, rf, swa_full=False)
    with Server(model, rf, extra_args=[*NP_ARGS, "-np", "3"], log_path=tmp_path / "s.log", startup_timeout=60) as s:
        res = _complete(s, prompt)
        assert res["ridgefill"]["applied"] and res["ridgefill"]["window"]["graphs"] > 0, res["ridgefill"]
        _assert_same(res, lib)


def test_a_shared_pool_lets_prompts_it_will_not_plan_start_as_on_stock(tiny_models, tmp_path):
    """llama.cpp's own test_completion_unified case: -c 256 -np 4 --kv-unified, a one-token prompt (too short
    to plan), n_predict 90/90/40/75 sent together - more rows than the pool if none finished, which stock
    llama-server starts at once. Only a prompt RidgeFill plans (or any prompt while a plan is in progress)
    waits for room; these start as on stock and are all served in full (before, the last one waited for the
    first to finish, which changed the company its tokens were sampled in)."""
    model = tiny_models["llama"]
    args = ["-c", "256", "-np", "4", "-b", "32", "--threads", "1", "-ngl", "0", "--no-warmup", "--kv-unified", "-v"]
    n_predict = [90, 90, 40, 75]
    with Server(model, RidgeFill.identity(**TINY_RF), extra_args=args, log_path=tmp_path / "s.log",
                startup_timeout=60) as s:
        results = [None] * 4

        def one(i: int) -> None:
            results[i] = _post(s.url + "/completion", {"prompt": _prompt(model, 1), "n_predict": n_predict[i],
                                                       "temperature": 0, "ignore_eos": True})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (status, res), n in zip(results, n_predict):
            assert status == 200 and res["timings"]["predicted_n"] == n, (status, res)
            assert not res["ridgefill"]["applied"]
        assert "waits for room in the shared KV cache" not in s.log()


def test_huge_and_malformed_requests_get_short_400s(tiny):
    huge = "x" * 1_000_000
    status, body = _post_raw(tiny.url + "/completion",
                             json.dumps({"prompt": "hello", "n_predict": 2, "ridgefill": {"selector": huge}}).encode())
    assert status == 400 and len(body) < 2000, (status, len(body))
    msg = json.loads(body)["error"]["message"]
    assert '"selector" must be one of' in msg and "(a string of 1000000 bytes)" in msg, msg
    status, body = _post_raw(tiny.url + "/completion",
                             json.dumps({"prompt": "hello", "ridgefill": {huge: 1}}).encode())
    assert status == 400 and len(body) < 2000 and "unknown member" in json.loads(body)["error"]["message"]
    for raw in (b'{"prompt": "hello",', b"not json at all", b""):
        status, body = _post_raw(tiny.url + "/completion", raw)
        err = json.loads(body)["error"]
        assert status == 400 and err["type"] == "invalid_request_error", (raw, status, err)
        assert "invalid JSON in the request" in err["message"], err
    assert _get(tiny.url + "/health")[0] == 200 and tiny.process.poll() is None


def test_key_rescale_in_the_server_matches_the_library(tiny_models, tmp_path):
    """--ridgefill-key-rescale (a map file's tuned c_K reaches the server this way): the server's
    first-token probabilities and greedy tokens are the library's with the same key rescale, and
    differ from those without it; /props and the statistics report it."""
    model = tiny_models["llama"]
    rf = RidgeFill.identity(**TINY_RF, key_rescale=8)
    prompt = _prompt(model, 400)
    with Server(model, rf, extra_args=TINY_ARGS, log_path=tmp_path / "server.log", startup_timeout=60) as s:
        assert "--ridgefill-key-rescale" in s.args
        res = _complete(s, prompt)
        props = json.loads(_get(s.url + "/props")[1])["ridgefill"]
    lib = _library(model, prompt, rf)
    _assert_same(res, lib)
    assert res["ridgefill"]["applied"] and res["ridgefill"]["key_rescale"] == props["key_rescale"] == 8
    without = _library(model, prompt, RidgeFill.identity(**TINY_RF))
    assert max(abs(without[0].get(t, 0.0) - p) for t, p in lib[0].items()) > 1e-4  # the scales changed the answer


# ------------------------------------------------------------------------------------------------
# hostile values, and what llama.cpp's own server tests found (#36)

ENDPOINTS = ("/completion", "/v1/completions", "/v1/chat/completions")


def _body(endpoint: str, ridgefill_json: str, n_predict: int = 1) -> bytes:
    """A request to ``endpoint`` whose "ridgefill" member is the raw JSON text ``ridgefill_json``."""
    if endpoint == "/v1/chat/completions":
        head = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %d, "ridgefill": ' % n_predict
    elif endpoint == "/v1/completions":
        head = '{"prompt": "hi", "max_tokens": %d, "ridgefill": ' % n_predict
    else:
        head = '{"prompt": "hi", "n_predict": %d, "ridgefill": ' % n_predict
    return (head + ridgefill_json + "}").encode()


def _hostile_values() -> list[str]:
    """Deeply nested, long and wrong-typed values of the "ridgefill" member (raw JSON)."""
    deep = 100_000
    return [
        "[" * deep + "]" * deep,                                   # the value that crashed the server
        '{"a":' * deep + "1" + "}" * deep,                         # nested objects
        '{"tail":' + "[" * deep + "]" * deep + "}",                # nested inside a known member
        '{"selector":' + '{"x":' * 20_000 + "0" + "}" * 20_000 + "}",
        "[" + ",".join(['[1,2,{"s":"' + "y" * 50 + '"}]'] * 20_000) + "]",  # long and wide
        '"' + "z" * 500_000 + '"',
        '{"' + "k" * 200_000 + '": 1}',
        "1e400", "-0", "null", "3.5", '"true"', "[false]", '{"span": 1e30}', '{"tail": -9223372036854775808}',
        '{"exact_fraction": "0.5"}', '{"selector": ["attention"]}', '{"tail": 1, "tail": 2, "span": null}',
    ]


def test_deeply_nested_ridgefill_values_get_a_400_and_the_server_stays_up(tiny_models, tmp_path):
    """A "ridgefill" value nested 100,000 deep crashed llama-server (SIGSEGV: the error message
    dumped the whole value, recursing once per level); now every hostile value gets a short 400 on
    all three endpoints, on a server with RidgeFill and on one without, which keeps serving."""
    model = tiny_models["llama"]
    args = [a for a in TINY_ARGS if a != "--metrics"]
    for rf in (RidgeFill.identity(**TINY_RF), None):
        with Server(model, rf, extra_args=args, log_path=tmp_path / f"{rf is None}.log", startup_timeout=60) as s:
            for endpoint in ENDPOINTS:
                status, body = _post_raw(s.url + endpoint, _body(endpoint, "[" * 100_000 + "]" * 100_000))
                assert status == 400 and len(body) < 2000, (endpoint, status, body[:200])
                msg = json.loads(body)["error"]["message"]
                assert "an array of 1 element)" in msg or "without RidgeFill" in msg, msg
                assert s.process.poll() is None, f"the server died on a nested value at {endpoint}"
            status, res = _post(s.url + "/completion", {"prompt": "hello", "n_predict": 2})
            assert status == 200 and res["content"] is not None


def test_bounded_fuzz_of_ridgefill_values_on_all_endpoints(tiny):
    """A bounded fuzz (loopback only): 18 hostile values and 60 random ones, each sent to the three
    endpoints; every answer is a 200 or a short 400, and the server stays up."""
    rng = np.random.default_rng(36)
    atoms = ['0', '1', '-1', '64', '1e9', '0.5', '2.5', 'true', 'false', 'null', '"attention"', '"probe"', '"x"',
             '""', '[]', '{}']
    keys = ["tail", "exact_fraction", "selector", "span", "key_rescale", "", "TAIL"]

    def random_value(depth: int = 0) -> str:
        r = rng.random()
        if depth > 3 or r < 0.4:
            return atoms[rng.integers(len(atoms))]
        if r < 0.7:
            n = int(rng.integers(0, 4))
            return "{" + ",".join(f'"{keys[rng.integers(len(keys))]}": {random_value(depth + 1)}' for _ in range(n)) + "}"
        return "[" + ",".join(random_value(depth + 1) for _ in range(int(rng.integers(0, 3)))) + "]"

    values = _hostile_values() + [random_value() for _ in range(60)]
    t0 = time.monotonic()
    seen = {}
    for v in values:
        for endpoint in ENDPOINTS:
            status, body = _post_raw(tiny.url + endpoint, _body(endpoint, v), timeout=60)
            assert status in (200, 400) and (status == 200 or len(body) < 2000), (endpoint, v[:80], status, body[:200])
            seen[status] = seen.get(status, 0) + 1
            assert tiny.process.poll() is None, f"the server died on {v[:80]!r} at {endpoint}"
    assert seen.get(400, 0) >= 3 * len(_hostile_values()) - 3 and seen.get(200, 0) > 0, seen
    assert time.monotonic() - t0 < 300
    assert _get(tiny.url + "/health")[0] == 200


def test_embedding_and_reranking_servers_run_stock_with_one_log_line(tiny_models, tmp_path):
    """--embedding (or --reranking) with a RidgeFill flag: the server starts and serves embeddings
    equal to a stock server's, saying once in its log that RidgeFill is off and why (before: it
    exited at start, "embeddings contexts are not supported")."""
    model = tiny_models["llama"]
    args = ["-c", "1024", "-np", "1", "-b", "512", "-ub", "512", "--threads", "1", "-ngl", "0", "--no-warmup", "--embedding",
            "--pooling", "mean"]
    prompt = _prompt(model, 300)
    got = {}
    for name, rf in (("stock", None), ("ridgefill", RidgeFill.identity(**TINY_RF))):
        with Server(model, rf, extra_args=args, log_path=tmp_path / f"{name}.log", startup_timeout=60) as s:
            status, res = _post(s.url + "/embedding", {"content": prompt})
            assert status == 200, res
            got[name] = np.array(res[0]["embedding"], dtype=np.float64).ravel()
            if rf is not None:
                assert s.log().count("RidgeFill: off for this server: embeddings and reranking") == 1, s.log()
                assert "ridgefill" not in json.loads(_get(s.url + "/props")[1])
    assert got["ridgefill"].shape == got["stock"].shape and np.allclose(got["ridgefill"], got["stock"], atol=1e-5)


def test_backend_sampling_requests_run_stock_prefill_and_sample_the_greedy_token(tiny_models, tmp_path):
    """A request with backend sampling ("backend_sampling": true, post-sampling probabilities) on a
    planned prompt sampled inside the early phase's graph, before the late layers ran: token 0 or
    unrelated tokens with probability 0 (llama.cpp's test_n_probs_post_backend_sampling). It now runs
    stock prefill (the response says why, the log too) and answers stock's greedy tokens; the same
    request without backend sampling is planned."""
    model = tiny_models["llama"]
    prompt = _prompt(model, 300)
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "n_probs": 1, "post_sampling_probs": True,
            "backend_sampling": True, "cache_prompt": False, "return_tokens": True}
    res = {}
    for name, rf in (("stock", None), ("ridgefill", RidgeFill.identity(**TINY_RF))):
        with Server(model, rf, extra_args=[*TINY_ARGS, "--backend-sampling"], log_path=tmp_path / f"{name}.log",
                    startup_timeout=60) as s:
            for np_ in ("backend", "host"):
                status, r = _post(s.url + "/completion", {**body, "backend_sampling": np_ == "backend"})
                assert status == 200, r
                res[name, np_] = r
            if rf is not None:
                assert "the request samples on the backend" in s.log()
    for where in ("backend", "host"):
        assert res["stock", where]["tokens"] == res["stock", "host"]["tokens"]
    rb = res["ridgefill", "backend"]
    assert rb["tokens"] == res["stock", "host"]["tokens"], (rb["tokens"], res["stock", "host"]["tokens"])
    assert not rb["ridgefill"]["applied"] and "backend sampling" in rb["ridgefill"]["reason"]
    assert all(p["prob"] > 0.0 for t in rb["completion_probabilities"] for p in t["top_probs"]), rb
    assert res["ridgefill", "host"]["ridgefill"]["applied"]


def test_one_map_file_runs_one_operating_point_everywhere(tiny_models, tmp_path):
    """A tuned map file runs at its tuned point (ridgefill.tuned.*) in all four places, resolved once, in
    libllama: ``Llama(..., ridgefill=path)``, ``serve`` (whose command line holds ``--ridgefill-maps``
    alone: what a user starting llama-server by hand with the map file types), and a C caller that
    attaches ``llama_ridgefill_default_params()`` and reads back ``llama_ridgefill_get_params``."""
    import ctypes
    import os

    import llama_cpp

    import ridgefill_cpp.core.native as N
    from ridgefill_cpp.maps.fingerprint import model_fingerprint
    from ridgefill_cpp.maps.mapfile import write_map_file, write_tuned_defaults
    from test_mapfile import _maps

    model = tiny_models["llama"]
    path = write_map_file(tmp_path / "tuned.ridgefill.gguf",
                          _maps(n_embd=64, split=3, n_layer=6, fingerprint=model_fingerprint(model)), dtype="f32")
    point = {"tail": 12, "exact_fraction": 0.25, "selector": "probe", "span": 4, "key_rescale": 8}
    write_tuned_defaults(path, dict(point, budget=0.02))
    n = 300
    prompt = _prompt(model, n)

    # 1. the library
    rf = RidgeFill(path, min_prompt=64)
    assert {k: getattr(rf, k) for k in point} == point and set(rf.origin.values()) == {"map file"}
    llm = Llama(str(model), ridgefill=rf, n_ctx=1024, n_batch=256, n_ubatch=64, n_threads=1, verbose=False)
    try:
        p = N.llama_ridgefill_params()
        assert N.llama_ridgefill_get_params(llm._ctx.ctx, ctypes.byref(p)) == 31  # all five from the map file
        library = (p.n_tail, p.exact_fraction, settings_name(p.selector), p.span, p.n_key_rescale)
        llm.eval(prompt)
        lib_stats = llm.ridgefill_stats
    finally:
        llm.close()

    # 2. a C caller: libllama's own defaults, nothing set
    stock = llama_cpp.Llama(str(model), n_ctx=1024, n_batch=256, n_ubatch=64, n_threads=1, verbose=False)
    try:
        mp = N.llama_ridgefill_maps_default_params()
        mp.model_path = os.fsencode(model)
        maps = N.llama_ridgefill_maps_init(stock._model.model, os.fsencode(path), mp)
        assert maps, N.llama_ridgefill_last_error()
        try:
            assert N.llama_ridgefill_attach(stock._ctx.ctx, maps, N.llama_ridgefill_default_params()) == 0
            p = N.llama_ridgefill_params()
            assert N.llama_ridgefill_get_params(stock._ctx.ctx, ctypes.byref(p)) == 31
            c_caller = (p.n_tail, p.exact_fraction, settings_name(p.selector), p.span, p.n_key_rescale)
            N.llama_ridgefill_detach(stock._ctx.ctx)
        finally:
            N.llama_ridgefill_maps_free(maps)
    finally:
        stock.close()

    # 3. serve, and llama-server with the map file alone: it resolves the same point itself
    args = ["-c", "1024", "-np", "1", "-b", "256", "-ub", "64", "--threads", "1", "-ngl", "0", "--no-warmup"]
    with Server(model, RidgeFill(path, min_prompt=64), extra_args=args, log_path=tmp_path / "s.log",
                startup_timeout=60) as s:
        assert not [a for a in s.args if a.startswith("--ridgefill-") and a not in ("--ridgefill-maps",
                                                                                  "--ridgefill-min-prompt")]
        props = json.loads(_get(s.url + "/props")[1])["ridgefill"]
        res = _complete(s, prompt, n=1)
    st = res["ridgefill"]
    server = (st["tail"], st["exact_fraction"], st["selector"], st["span"], st["key_rescale"])
    via_props = tuple(props[k] for k in point)

    want = tuple(point.values())
    assert library == c_caller == server == via_props == want, (library, c_caller, server, via_props)
    assert st["applied"] and lib_stats["tail"] == st["tail"] == 12
    assert (lib_stats["n_exact"], lib_stats["n_filled"]) == (st["n_exact"], st["n_filled"])


def test_props_reports_the_settings_in_force_whatever_happens_to_the_file(tiny_models, tmp_path):
    """GET /props reports the settings requests run with, resolved once at load from the maps in memory,
    the split included: a map file retuned under the running server, or moved away, changes neither the
    requests nor /props (before: /props re-read the file, showing the new tuned values while requests ran
    the old ones, -1 / "?" once the file was gone, and split -1 always)."""
    from ridgefill_cpp.maps.fingerprint import model_fingerprint
    from ridgefill_cpp.maps.mapfile import write_map_file, write_tuned_defaults
    from test_mapfile import _maps

    model = tiny_models["llama"]
    path = write_map_file(tmp_path / "tuned.ridgefill.gguf",
                          _maps(n_embd=64, split=3, n_layer=6, fingerprint=model_fingerprint(model)), dtype="f32")
    write_tuned_defaults(path, {"tail": 12, "exact_fraction": 0.25, "selector": "attention", "span": 4,
                                "key_rescale": 0, "budget": 0.02})
    want = {"maps": str(path), "split": 3, "tail": 12, "exact_fraction": 0.25, "selector": "attention", "span": 4,
            "key_rescale": 0, "min_prompt": 64}
    prompt = _prompt(model, 300)
    args = ["-c", "1024", "-np", "1", "-b", "256", "-ub", "64", "--threads", "1", "-ngl", "0", "--no-warmup"]

    def running(s: Server) -> dict:
        st = _complete(s, prompt, n=1)["ridgefill"]
        assert st["applied"]
        return {k: st[k] for k in ("split", "tail", "exact_fraction", "selector", "span", "key_rescale")}

    with Server(model, RidgeFill(path, min_prompt=64), extra_args=args, log_path=tmp_path / "s.log",
                startup_timeout=60) as s:
        props = lambda: json.loads(_get(s.url + "/props")[1])["ridgefill"]  # noqa: E731
        assert props() == want
        in_force = running(s)
        assert in_force == {k: want[k] for k in in_force}
        # retuned under the running server: the server keeps the maps and settings it loaded
        write_tuned_defaults(path, {"tail": 32, "exact_fraction": 0.2, "selector": "attention", "span": 16,
                                    "key_rescale": 0, "budget": 0.02})
        assert props() == want and running(s) == in_force
        # moved away
        path.rename(tmp_path / "moved.ridgefill.gguf")
        assert props() == want and running(s) == in_force


def test_a_prompt_that_reuses_cached_rows_says_how_many_were_filled(tiny_models, tmp_path):
    """A request whose prompt reuses a slot's cached rows reports them (n_cached) and how many of them an
    earlier plan filled (n_cached_filled): the same prompt again, and a prompt sharing its first 200 rows,
    then new rows too few to plan. Its reason says why the new rows ran stock prefill (before: only "no
    more new prompt rows than the tail", as if the answer came from stock prefill)."""
    model = tiny_models["llama"]
    rf = RidgeFill.identity(**TINY_RF)
    prompt = _prompt(model, 400)
    other = prompt[:200] + _prompt(model, 11, shift=500)[1:]  # 200 cached rows, then 10 new ones
    lib = _library(model, prompt, rf)[2]
    selected = lib["exact_positions"]
    with Server(model, rf, extra_args=TINY_ARGS, log_path=tmp_path / "s.log", startup_timeout=60) as s:
        first = _complete(s, prompt, n=1, cache_prompt=True, id_slot=0)["ridgefill"]
        assert first["applied"] and "n_cached" not in first and first["n_filled"] == lib["n_filled"]
        again = _complete(s, prompt, n=1, cache_prompt=True, id_slot=0)
        st = again["ridgefill"]
        assert not st["applied"] and st["n_cached"] == again["timings"]["cache_n"] == 399
        assert st["n_cached_filled"] == first["n_filled"]  # every filled row lies before the tail
        assert st["n_prompt"] == 1 and st["reason"] == "no more new prompt rows than the tail"
        part = _complete(s, other, n=1, cache_prompt=True, id_slot=0)
        st = part["ridgefill"]
        assert st["n_cached"] == part["timings"]["cache_n"] == 200 and st["n_prompt"] == 10
        assert st["n_cached_filled"] == 200 - sum(p < 200 for p in selected)
        assert "min-prompt" in st["reason"] or "tail" in st["reason"]
        # an exact request drops the approximate rows before it looks for a common prefix: none reused
        exact = _complete(s, prompt, n=1, cache_prompt=True, id_slot=0, ridgefill=False)
        assert exact["timings"]["cache_n"] == 0 and "n_cached" not in exact["ridgefill"]


def settings_name(selector: int) -> str:
    from ridgefill_cpp.core import settings

    return settings.selector_name(selector)
