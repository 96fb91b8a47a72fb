"""llama.cpp's web UI in a RidgeFill llama-server, in a real browser (headless Chromium driven by
selenium; tools/measure/web_ui.py): the page at "/" is the chat UI, a long message typed into it and
sent gets an answer, and the answer's statistics show what RidgeFill did - rows filled and exact of the
prompt, the split, prefill time and the ceiling (patches/0010-ui-ridgefill.patch) - with the same
numbers as the server's own /metrics counters; the same message again reuses the cached rows, and the
line says how many of them RidgeFill filled. An answer is shown when the page rendered it (elements
of its markdown): SmolLM2's greedy answer with identity fill is '****' rules, which have no text.
Answers are greedy (Custom JSON {"temperature": 0}) so that what the page shows does not depend on
chance. The UI's Custom JSON setting turns RidgeFill off
({"ridgefill": false}) and the line then says so; a server without RidgeFill shows no RidgeFill line.

Without Chromium, chromedriver or selenium, or with a llama-server built without the UI (no node and
npm at set-up), the tests are skipped with the reason; RIDGEFILL_REQUIRE_UI=1 (set by .ci/run) makes
that a failure, so CI always runs them.
"""

from __future__ import annotations

import os
import re

import pytest

from ridgefill_cpp import RidgeFill
from ridgefill_cpp.server.serve import Server
from test_serve import no_proxy  # noqa: F401  (autouse: loopback requests never go through a proxy)
from test_serve_ridgefill import _metrics
from web_ui import browser, document_prompt, find_browser, page_kind, send, set_custom_json

pytestmark = pytest.mark.slow

#: greedy answers, set through the UI's Custom JSON as a user would
GREEDY = {"temperature": 0}

#: one slot, a short answer, the RidgeFill statistics in /metrics
ARGS = ["-c", "4096", "-np", "1", "-n", "16", "--threads", "2", "-ngl", "0", "--metrics", "--no-warmup"]


def _unavailable(why: str) -> None:
    if os.environ.get("RIDGEFILL_REQUIRE_UI") == "1":
        pytest.fail(f"{why} (RIDGEFILL_REQUIRE_UI=1: this machine must run the web UI tests)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def drv():
    _, _, why = find_browser()
    if why:
        _unavailable(why)
    with browser() as d:
        yield d


@pytest.fixture(scope="module")
def message(smollm2_path) -> str:
    return document_prompt(smollm2_path, 1600)


def _ui_url(srv: Server) -> str:
    kind = page_kind(srv.url)
    if kind == "no-ui":
        _unavailable("this llama-server was built without llama.cpp's web UI (set-up found no node >= 20.19 and npm)")
    assert kind == "ui", f"{srv.url}/ answers {kind}, not a page"
    return srv.url


def _number(s: str) -> int:
    return int(s.replace(",", ""))


@pytest.fixture
def server_log_on_failure():
    """Print the end of the servers' logs when the test fails (the browser only sees a page)."""
    servers: list[Server] = []
    yield servers.append
    for srv in servers:
        print(f"--- {srv.log_path}: its last lines\n" + "\n".join(srv.log().splitlines()[-40:]))


def test_the_chat_page_shows_what_ridgefill_did_for_each_answer(smollm2_path, drv, message, tmp_path,
                                                                 server_log_on_failure):
    rf = RidgeFill.identity(split=20)
    with Server(smollm2_path, rf, extra_args=ARGS, log_path=tmp_path / "rf.log", startup_timeout=120) as srv:
        server_log_on_failure(srv)
        url = _ui_url(srv)
        set_custom_json(drv, url, GREEDY)
        planned = send(drv, url, message)
        assert planned.blocks and "t/s" in planned.stats
        assert planned.ridgefill_state == "applied", planned
        m = re.search(r"([\d,]+) of ([\d,]+) rows filled, ([\d,]+) exact", planned.ridgefill)
        assert m, planned.ridgefill
        filled, n_prompt, exact = (_number(g) for g in m.groups())
        assert n_prompt >= 1500 and filled > 0 and filled + exact == n_prompt
        assert "split 20/30" in planned.ridgefill and re.search(r"ceiling \d\.\d\dx", planned.ridgefill)
        # the page's numbers are the server's: its counters saw exactly this one plan
        after = _metrics(srv)
        assert after["ridgefill_prefills_total"] == 1
        assert (after["ridgefill_rows_filled_total"], after["ridgefill_rows_exact_total"]) == (filled, exact)

        # the same message again: the server reuses the cached rows of the planned prompt, and the line says
        # so with how many of them were filled, instead of calling the answer's prompt stock prefill
        repeated = send(drv, url, message)
        assert repeated.blocks and repeated.ridgefill_state == "stock", repeated
        m = re.search(r"([\d,]+) new rows after ([\d,]+) cached rows, ([\d,]+) of them filled by RidgeFill",
                      repeated.ridgefill)
        assert m, repeated.ridgefill
        assert _number(m.group(2)) == n_prompt - _number(m.group(1)) and _number(m.group(3)) == filled
        assert _metrics(srv)["ridgefill_prefills_total"] == 1

        # Settings > Developer > Custom JSON {"ridgefill": false}: exact prefill, and the line says why
        set_custom_json(drv, url, {**GREEDY, "ridgefill": False})
        exact_answer = send(drv, url, message)
        assert exact_answer.blocks and exact_answer.ridgefill_state == "stock", exact_answer
        assert "exact prefill requested" in exact_answer.ridgefill
        assert _metrics(srv)["ridgefill_prefills_total"] == 1


def test_a_server_without_ridgefill_shows_no_ridgefill_line(smollm2_path, drv, message, tmp_path,
                                                            server_log_on_failure):
    with Server(smollm2_path, None, extra_args=ARGS, log_path=tmp_path / "stock.log", startup_timeout=120) as srv:
        server_log_on_failure(srv)
        url = _ui_url(srv)
        set_custom_json(drv, url, GREEDY)
        answer = send(drv, url, message)
    assert answer.blocks and "t/s" in answer.stats
    assert answer.ridgefill is None and answer.ridgefill_state is None
