"""llama.cpp's web UI in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
driven by selenium against a running llama-server. Sends one message the way a user does (the text
put into the chat box, the Send button clicked), waits until the answer is complete, and reads what
the page shows: the answer, its statistics line and RidgeFill's line (patches/0010-ui-ridgefill.patch).
Used by tests/test_web_ui.py; as a script it starts a RidgeFill llama-server, sends a long document
and saves the page as a screenshot (docs/web-ui/).

    python tools/measure/web_ui.py MODEL (--maps MAPS | --identity-split S) [--tokens 1600]
        [--n-predict 48] [--exact-too] --screenshot page.png [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

#: headless, no sandbox (CI runs as root), nothing that reaches the network or a GPU
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-extensions", "--disable-default-apps", "--no-first-run", "--mute-audio")
#: the text of llama-server's page when it was built without the UI (csrc/server/server-ridgefill.cpp)
NO_UI_MARKER = "built without llama.cpp's web UI"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def find_browser() -> tuple[str | None, str | None, str]:
    """(chromium, chromedriver, '') or (None, None, why not). RIDGEFILL_CHROMIUM and RIDGEFILL_CHROMEDRIVER
    name other binaries."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None, None, "selenium is not installed (it is a test dependency: pip install selenium)"
    chromium = os.environ.get("RIDGEFILL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get("RIDGEFILL_CHROMEDRIVER") or shutil.which("chromedriver")
    if not chromium or not driver:
        missing = " and ".join(n for n, p in (("chromium", chromium), ("chromedriver", driver)) if not p)
        return None, None, f"{missing} not found (Debian: apt install chromium chromium-driver)"
    return chromium, driver, ""


def page_kind(url: str, timeout: float = 30) -> str:
    """What llama-server answers at "/": "ui" (llama.cpp's chat page), "no-ui" (the page saying how to
    get it) or "other: <status/type>"."""
    req = urllib.request.Request(url + "/", headers={"Accept-Encoding": "gzip"})
    try:
        with _NO_PROXY.open(req, timeout=timeout) as r:
            body = r.read()
            if r.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            ctype = r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return f"other: HTTP {e.code}"
    text = body.decode("utf-8", "replace")
    if "text/html" not in ctype:
        return f"other: {ctype}"
    return "no-ui" if NO_UI_MARKER in text else "ui"


#: seconds a page may take to load (chromedriver's own default, 300, outlasts selenium's 120-s command timeout)
PAGE_LOAD_TIMEOUT = 60


def _open(drv, url: str, reload: bool = False) -> None:
    """Load the page at url (or reload the current one). A load that has not finished after
    PAGE_LOAD_TIMEOUT (a resource that never arrives) is stopped instead of hanging the session: the
    waits for the page's elements then tell whether the page works."""
    from selenium.common.exceptions import TimeoutException

    try:
        drv.refresh() if reload else drv.get(url)
    except TimeoutException:
        drv.execute_script("window.stop();")


@contextmanager
def browser(width: int = 1280, height: int = 1000):
    """A headless Chromium session (selenium's webdriver), closed on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver, why = find_browser()
    if why:
        raise RuntimeError(why)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--window-size={width},{height}")
    drv = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    drv.set_page_load_timeout(PAGE_LOAD_TIMEOUT)
    try:
        yield drv
    finally:
        drv.quit()


@dataclass
class Answer:
    text: str                  # the assistant's answer as the page shows it
    blocks: int                # elements the answer rendered into (a markdown rule has no text)
    stats: str                 # the answer's statistics line (tokens, time, t/s)
    prompt_stats: str          # the message's statistics line (prompt tokens, prompt time, tokens/s)
    ridgefill: str | None      # RidgeFill's line, None when the page shows none
    ridgefill_state: str | None  # "applied" (a planned prompt) or "stock" (the server said why)
    seconds: float             # from the click on Send to the complete answer


_STOP = "//button[.//span[normalize-space()='Stop']]"
_SEND = "//button[@type='submit'][.//span[normalize-space()='Send']]"


def send(drv, url: str, text: str, timeout: float = 300) -> Answer:
    """Open the UI at url in a fresh conversation, send text as the user's message and wait for the
    complete answer (the Stop button came and went, the answer's statistics are shown)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    _open(drv, url + "/")
    box = WebDriverWait(drv, 60).until(EC.element_to_be_clickable((By.CSS_SELECTOR, "textarea")))
    # the text goes in as typed input (an input event on the chat box), not as a paste: the UI turns a
    # long paste into a file attachment
    drv.execute_script("const t = arguments[0]; t.focus(); t.value = arguments[1];"
                       "t.dispatchEvent(new Event('input', {bubbles: true}));", box, text)
    WebDriverWait(drv, 30).until(EC.element_to_be_clickable((By.XPATH, _SEND))).click()
    t0 = time.monotonic()
    WebDriverWait(drv, 60, poll_frequency=0.1).until(EC.presence_of_element_located((By.XPATH, _STOP)))
    WebDriverWait(drv, timeout, poll_frequency=0.2).until_not(EC.presence_of_element_located((By.XPATH, _STOP)))
    msg = WebDriverWait(drv, 30).until(EC.presence_of_element_located(
        (By.XPATH, "//*[contains(@class, 'chat-message-assistant')][.//*[contains(@class, 'info')]//*[contains(., 't/s')]]")))
    seconds = time.monotonic() - t0
    info = msg.find_element(By.CSS_SELECTOR, ".info")
    rf = info.find_elements(By.CSS_SELECTOR, "[data-ridgefill]")
    answer = drv.execute_script("const c = arguments[0].cloneNode(true); c.querySelectorAll('.info').forEach(e => e.remove());"
                                "return c.innerText;", msg)
    blocks = len(msg.find_elements(By.CSS_SELECTOR, ".markdown-content *"))
    stats = info.text.replace(rf[0].text, "").strip() if rf else info.text.strip()
    prompt_stats = drv.execute_script(
        "const u = [...document.querySelectorAll('.chat-message-user')].pop();"
        "const s = u && u.querySelector('div.inline-flex.items-center.text-xs'); return s ? s.innerText : '';")
    return Answer(text=answer.strip(), blocks=blocks, stats=stats, prompt_stats=prompt_stats.strip(),
                  ridgefill=rf[0].text.strip() if rf else None,
                  ridgefill_state=rf[0].get_attribute("data-ridgefill") if rf else None, seconds=seconds)


def set_custom_json(drv, url: str, custom: dict, tries: int = 5) -> None:
    """Settings > Developer > Custom JSON, as a user sets it: the object is merged into every request
    the UI sends (e.g. {"ridgefill": false}). Written into the UI's stored settings (localStorage
    "LlamaUi.config"), then the page is loaded again. The page saves its whole settings object itself
    once the server's /props answer arrives; a save that lands between our write and the reload
    overwrites it, so the stored object is read back after the reload and written again until it holds."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    want = json.dumps(custom)
    _open(drv, url + "/")
    for _ in range(tries):
        # the chat box is up once the page has started: most of its own saves are behind it
        WebDriverWait(drv, 60).until(EC.element_to_be_clickable((By.CSS_SELECTOR, "textarea")))
        drv.execute_script(
            "const key = 'LlamaUi.config'; const v = JSON.parse(localStorage.getItem(key) || '{}');"
            "v.customJson = arguments[0]; localStorage.setItem(key, JSON.stringify(v));", want)
        _open(drv, url + "/", reload=True)
        WebDriverWait(drv, 60).until(EC.element_to_be_clickable((By.CSS_SELECTOR, "textarea")))
        stored = drv.execute_script("return (JSON.parse(localStorage.getItem('LlamaUi.config') || '{}')).customJson;")
        if stored == want:
            return
    raise RuntimeError(f"the web UI did not keep Custom JSON {want} in its settings after {tries} tries")


def http_chat(url: str, text: str, ridgefill: bool, timeout: float = 600) -> dict:
    """The same message as the page sends it (streamed, timings per token), over plain HTTP: the final
    timings and RidgeFill statistics."""
    body = {"messages": [{"role": "user", "content": text}], "stream": True, "timings_per_token": True,
            "ridgefill": ridgefill, "cache_prompt": False}  # the whole prompt prefilled each time
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    last: dict = {}
    with _NO_PROXY.open(req, timeout=timeout) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                last.update({k: chunk[k] for k in ("timings", "ridgefill") if k in chunk})
    return last


def document_prompt(model: Path, n_tokens: int) -> str:
    """A message of about n_tokens tokens: an instruction and prose of the evaluation corpus (Python's
    language reference, pydoc_data.topics; PSF-2.0)."""
    import ridgefill_cpp  # noqa: F401  (the patched libraries)
    from llama_cpp import Llama

    from ridgefill_cpp.fitting import corpus

    prose = (d for d in corpus.default_documents("evaluation") if d.name.startswith("pydoc:"))
    text = "\n".join(d.text for _, d in zip(range(12), prose))
    llm = Llama(model_path=str(model), vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(text.encode(), add_bos=False)[:n_tokens]
        body = llm.detokenize(ids).decode("utf-8", "ignore")
    finally:
        llm.close()
    return "Summarise the following text in two sentences.\n\n" + body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--maps", type=Path)
    ap.add_argument("--identity-split", type=int)
    ap.add_argument("--tokens", type=int, default=1600)
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--screenshot", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--exact-too", action="store_true",
                    help='then the same message with Custom JSON {"ridgefill": false}, for the prompt times side by side')
    args = ap.parse_args(argv)

    from ridgefill_cpp import RidgeFill
    from ridgefill_cpp.server.serve import Server

    rf = RidgeFill(args.maps) if args.maps else RidgeFill.identity(split=args.identity_split)
    text = document_prompt(args.model, args.tokens)
    server_args = ["-c", "4096", "-np", "1", "-n", str(args.n_predict), "--threads", str(args.threads), "-ngl", "0"]
    with Server(args.model, rf, extra_args=server_args, startup_timeout=120) as srv:
        kind = page_kind(srv.url)
        if kind != "ui":
            print(f"web_ui: {srv.url}/ is not the UI ({kind})", file=sys.stderr)
            return 1
        with browser() as drv:
            answers = {"ridgefill": asdict(send(drv, srv.url, text))}
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            drv.save_screenshot(str(args.screenshot))
            if args.exact_too:
                set_custom_json(drv, srv.url, {"ridgefill": False})
                answers["exact"] = asdict(send(drv, srv.url, text))
        if args.exact_too:  # the same two requests without a browser on the cores
            answers["http"] = {name: http_chat(srv.url, text, on)["timings"] for name, on in
                               (("ridgefill", True), ("exact", False))}
    out = {"model": args.model.name, "maps": args.maps.name if args.maps else f"identity@{args.identity_split}",
           "tokens": args.tokens, "n_predict": args.n_predict, "threads": args.threads, **answers}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
