"""``ridgefill-gguf serve`` and :mod:`ridgefill_cpp.server.serve`: the patched llama-server started on a free
loopback port with the tiny llama model (and SmolLM2), driven by the official ``openai`` client and
raw HTTP; its command line (the RidgeFill flags) as a pure function; argument errors before any
process starts; clean shutdown with no process left, from Python and from the CLI on SIGTERM/SIGINT.

The tests run llama-server *without* RidgeFill flags (they work with the stock server too). Every
wait and HTTP call is bounded; nothing listens or connects outside 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import ridgefill_cpp
from ridgefill_cpp import RidgeFill
from ridgefill_cpp.core import processes
from ridgefill_cpp.server import serve
from ridgefill_cpp.maps.fingerprint import model_fingerprint
from ridgefill_cpp.maps.mapfile import write_map_file, write_tuned_defaults
from ridgefill_cpp.server.serve import Server, ServerError, check_ridgefill, server_args, server_binary

if not sys.platform.startswith("linux"):
    pytest.skip("the process checks read /proc", allow_module_level=True)

KEY = "test-key-0123"
#: a small, CPU-only, single-slot server for the tiny models (one thread: with more, llama.cpp's spinning
#: thread barriers make the first requests take seconds when other jobs load the CPUs)
TINY_ARGS = ["-c", "2048", "-np", "1", "--threads", "1", "-ngl", "0"]
HTTP_TIMEOUT = 30


@pytest.fixture(scope="module")
def openai():
    import openai  # a test dependency (pyproject.toml)

    return openai


@pytest.fixture(scope="module", autouse=True)
def no_proxy():
    """Loopback requests never go through a proxy of the environment (urllib, httpx)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            mp.delenv(var, raising=False)
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("no_proxy", "127.0.0.1,localhost")
        yield


# ------------------------------------------------------------------------------------------------
# helpers: HTTP and processes (/proc)

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(method: str, url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers,
                                 method=method)
    try:
        with _OPENER.open(req, timeout=HTTP_TIMEOUT) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[2])


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _processes() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _children(pid: int) -> list[int]:
    return [p for p in _processes() if (st := _stat(p)) and st[1] == pid and st[0] != "Z"]


def _group(pgid: int) -> list[int]:
    return [p for p in _processes() if (st := _stat(p)) and st[2] == pgid and st[0] != "Z"]


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                ip = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
            found.add((ip, int(port, 16)))
    return found


def _gone(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _assert_stopped_cleanly(pid: int) -> None:
    assert _gone([pid]), f"llama-server {pid} is still running"
    assert _children(pid) == [] and _group(pid) == [], "processes of the server's group are left"


# ------------------------------------------------------------------------------------------------
# map files for the tiny llama model (synthetic maps with its fingerprint: cheap, no fit)


@pytest.fixture(scope="module")
def maps(tiny_models, tmp_path_factory) -> Path:
    from test_mapfile import _maps

    root = tmp_path_factory.mktemp("serve-maps")
    m = _maps(n_embd=64, split=3, n_layer=6, fingerprint=model_fingerprint(tiny_models["llama"]))
    return write_map_file(root / "tiny-llama.ridgefill.gguf", m, dtype="f32")


@pytest.fixture(scope="module")
def tuned_maps(maps, tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("serve-tuned") / "tuned.ridgefill.gguf"
    shutil.copy(maps, p)
    write_tuned_defaults(p, {"tail": 12, "exact_fraction": 0.25, "selector": "none", "budget": 0.02})
    return p


# ------------------------------------------------------------------------------------------------
# the command line (pure)


def test_server_binary_is_the_installed_patched_build():
    b = server_binary()
    assert b.name == "llama-server" and os.access(b, os.X_OK)
    assert b == Path(ridgefill_cpp.build_info()["llama_server"])
    assert b.parent == Path(ridgefill_cpp.LIB_DIR).parent / "bin"


def test_server_args_stock_identity_and_maps(tiny_models, maps):
    tiny = tiny_models["llama"]
    head = [str(server_binary()), "-m", str(tiny), "--host", "127.0.0.1", "--port", "8081"]
    # no RidgeFill: stock llama-server, extra arguments last and unchanged
    assert server_args(tiny, None, "127.0.0.1", 8081, ["-np", "4", "-c", "8192"]) == head + ["-np", "4", "-c", "8192"]
    # identity fill: the split; the settings not given are the server's to resolve (built-in here)
    assert server_args(tiny, RidgeFill.identity(3), "127.0.0.1", 8081, ["-np", "4"]) == head + [
        "--ridgefill-split", "3", "-np", "4"]
    # maps with explicit settings (no split flag: the file's); no API key on the command line
    rf = RidgeFill(maps, tail=32, exact_fraction=0.05, selector="attention+protected", span=4, min_prompt=0)
    assert server_args(tiny, rf, "127.0.0.1", 8081, ["--metrics", "--api-key", "k2", "--api-key=k3"], api_key="k") == head + [
        "--ridgefill-maps", str(maps), "--ridgefill-tail", "32", "--ridgefill-exact-fraction", "0.05",
        "--ridgefill-selector", "attention+protected", "--ridgefill-span", "4", "--ridgefill-min-prompt", "0", "--metrics"]
    # a map file path alone: the server resolves RidgeFill(path)'s settings from the file, as RidgeFill does
    assert server_args(tiny, maps, "127.0.0.1", 8081) == head + ["--ridgefill-maps", str(maps)]


def test_api_keys_go_to_the_environment_never_the_command_line(tmp_path):
    """llama-server reads --api-key from LLAMA_API_KEY: serve's key and any --api-key after -- go there
    (after a key the environment already holds), comma-separated as --api-key takes several."""
    from ridgefill_cpp.server.serve import API_KEY_ENV, server_env

    assert API_KEY_ENV == "LLAMA_API_KEY"
    base = {"PATH": "/bin"}
    assert server_env(None, ["-np", "2"], base) == base
    assert server_env("k", ["-np", "2", "--api-key", "k2", "--api-key=k3"], base) == dict(base, LLAMA_API_KEY="k,k2,k3")
    assert server_env(None, ["--api-key=k3"], dict(base, LLAMA_API_KEY="k0")) == dict(base, LLAMA_API_KEY="k0,k3")
    assert server_env("k", [], dict(base, LLAMA_API_KEY="k0"))["LLAMA_API_KEY"] == "k0,k"
    for extra, api_key, message in ((["--api-key"], None, "--api-key needs a value"),
                                    (["--api-key="], None, "the API key is empty"), ([], "", "the API key is empty")):
        with pytest.raises(ValueError, match=message):
            server_env(api_key, extra, base)
    # a key file for llama-server's --api-key-file: checked the way llama-server reads it
    from ridgefill_cpp.server.serve import check_api_key_file

    keys = tmp_path / "keys"
    keys.write_text("# comment\nk1\n")
    assert check_api_key_file(keys) == keys
    keys.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        check_api_key_file(keys)
    with pytest.raises(ValueError, match="No such file"):
        check_api_key_file(tmp_path / "missing")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="is a FIFO, not a regular file"):
        check_api_key_file(tmp_path / "fifo")


def test_server_args_use_the_tuned_defaults_and_arguments_win(tiny_models, tuned_maps):
    tiny = tiny_models["llama"]

    def flags(args):
        return {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--ridgefill-")}

    # the tuned values stay the server's to read from the map file (libllama resolves them for both)
    assert flags(server_args(tiny, tuned_maps, "127.0.0.1", 1)) == {"--ridgefill-maps": str(tuned_maps)}
    got = flags(server_args(tiny, RidgeFill(tuned_maps, tail=20, min_prompt=512), "127.0.0.1", 1))
    assert got == {"--ridgefill-maps": str(tuned_maps), "--ridgefill-tail": "20", "--ridgefill-min-prompt": "512"}


def test_server_args_refusals(tiny_models, maps):
    tiny = tiny_models["llama"]
    with pytest.raises(ValueError, match="selector by name"):
        server_args(tiny, RidgeFill(maps, selector=[1, 5]), "127.0.0.1", 1)
    with pytest.raises(ValueError, match=r"no flag for these RidgeFill settings: value_rescale=0"):
        server_args(tiny, RidgeFill(maps, value_rescale=0), "127.0.0.1", 1)
    with pytest.raises(ValueError, match="placement='host'"):
        server_args(tiny, RidgeFill(maps, placement="host"), "127.0.0.1", 1)
    with pytest.raises(ValueError, match="state_correction='gain'"):
        server_args(tiny, RidgeFill(maps, state_correction="gain"), "127.0.0.1", 1)
    server_args(tiny, RidgeFill(maps, protected="digits,sink"), "127.0.0.1", 1)  # the default classes, spelled otherwise
    for flag in ("--port", "--host", "-m", "--ridgefill-tail"):
        with pytest.raises(ValueError, match=f"{flag} is set by"):
            server_args(tiny, None, "127.0.0.1", 1, ["-np", "2", flag, "x"])
    for host in ("127.0.0.1,0.0.0.0", "/tmp/s.sock", ""):
        with pytest.raises(ValueError, match="one IP address"):
            server_args(tiny, None, host, 1)
    with pytest.raises(ValueError, match="port 70000"):
        server_args(tiny, None, "127.0.0.1", 70000)


def test_settings_are_checked_against_the_model_before_anything_starts(tiny_models, maps, tmp_path, monkeypatch,
                                                                        unsupported_model):
    from ridgefill_cpp.testing import tiny_models as mtm

    from ridgefill_cpp.maps.mapfile import MapFileError

    monkeypatch.setattr(processes, "popen", _no_process)
    tiny = tiny_models["llama"]
    assert check_ridgefill(tiny, None) is None
    assert check_ridgefill(tiny, maps).maps == maps
    with pytest.raises(MapFileError, match="architecture: maps are for llama, the model is qwen3"):
        Server(tiny_models["qwen3"], maps)
    other = mtm.make_tiny_model("llama", tmp_path / "other-seed.gguf", seed=1)
    with pytest.raises(MapFileError, match="another checkpoint"):
        Server(other, maps)
    cut = tmp_path / "cut.ridgefill.gguf"
    cut.write_bytes(maps.read_bytes()[:4000])
    with pytest.raises(MapFileError, match="truncated"):
        Server(tiny, cut)
    with pytest.raises(MapFileError, match="not a RidgeFill map file"):
        Server(tiny, tiny_models["qwen3"])
    with pytest.raises(ValueError, match="fitted for split 3, not the requested split 2"):
        Server(tiny, RidgeFill(maps, split=2))
    with pytest.raises(ValueError, match=r"split 9 outside 1\.\.5"):
        Server(tiny, RidgeFill.identity(9))
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported by RidgeFill prefill"):
        Server(unsupported_model, RidgeFill.identity(2))
    with pytest.raises(ValueError, match="no such file"):
        Server(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="no such file"):
        serve.serve(tmp_path / "missing.gguf", port=0)


def _no_process(*a, **k):
    raise AssertionError("a process was started")


# ------------------------------------------------------------------------------------------------
# a running server (tiny llama, API key), shared by the module


@pytest.fixture(scope="module")
def srv(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with Server(tiny_models["llama"], api_key=KEY, extra_args=TINY_ARGS, log_path=log, startup_timeout=60) as s:
        yield s
    _assert_stopped_cleanly(s.process.pid)


def test_starts_on_a_free_loopback_port_and_is_healthy(srv):
    assert srv.process.poll() is None
    assert srv.url == f"http://127.0.0.1:{srv.port}" and srv.base_url == srv.url + "/v1"
    assert _http("GET", srv.url + "/health") == (200, {"status": "ok"})
    # it listens on the loopback address and port it was given, nothing else
    assert _listening(srv.process.pid) == {("127.0.0.1", srv.port)}
    # the command line: the installed patched binary, stock flags (no RidgeFill), the extra arguments last;
    # the API key only in the environment (readable by this user), not on the command line nor in the log
    assert _cmdline(srv.process.pid) == srv.args and srv.args[0] == str(server_binary())
    assert not any(KEY in a for a in srv.args) and KEY not in srv.log_path.read_text()
    assert f"LLAMA_API_KEY={KEY}".encode() in Path(f"/proc/{srv.process.pid}/environ").read_bytes().split(b"\0")
    assert srv.args[-len(TINY_ARGS):] == TINY_ARGS and not any(a.startswith("--ridgefill") for a in srv.args)
    assert "listening on http://127.0.0.1:" in srv.log_path.read_text()


def test_openai_client_completion_and_chat(srv, openai):
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, timeout=HTTP_TIMEOUT, max_retries=0)
    model = client.models.list().data[0].id
    assert Path(model).name == "tiny-llama.gguf"  # the -m path
    texts = []
    for _ in range(2):
        r = client.completions.create(model=model, prompt="the day was long, and we did", max_tokens=8, temperature=0)
        assert r.object == "text_completion" and len(r.choices) == 1
        assert isinstance(r.choices[0].text, str) and r.choices[0].finish_reason in ("length", "stop")
        assert 0 < r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
        texts.append(r.choices[0].text)
    assert texts[0] == texts[1]  # greedy: the same text again (the second one from the prompt cache)
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "how many of them?"}],
                                       max_tokens=8, temperature=0)
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert isinstance(c.choices[0].message.content, str) and 0 < c.usage.completion_tokens <= 8


def test_api_key_is_enforced(srv, openai):
    body = {"model": "m", "prompt": "the day", "max_tokens": 2}
    assert _http("GET", srv.url + "/v1/models")[0] == 401
    assert _http("GET", srv.url + "/v1/models", key="wrong")[0] == 401
    status, err = _http("POST", srv.url + "/v1/completions", body)
    assert status == 401 and err["error"]["type"] == "authentication_error"
    assert _http("GET", srv.url + "/v1/models", key=KEY)[0] == 200
    assert _http("POST", srv.url + "/v1/completions", body, key=KEY)[0] == 200
    bad = openai.OpenAI(base_url=srv.base_url, api_key="wrong", timeout=HTTP_TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="the day", max_tokens=2)


# ------------------------------------------------------------------------------------------------
# start-up failures and shutdown (own servers)


def test_stop_is_clean_and_kills_a_server_that_does_not_stop(tiny_models, tmp_path):
    s = Server(tiny_models["llama"], extra_args=TINY_ARGS, log_path=tmp_path / "a.log", startup_timeout=60).start()
    pid = s.process.pid
    assert _group(pid) == [pid]  # its own process group, nothing else in it
    t0 = time.monotonic()
    assert s.stop() == 0  # SIGTERM: llama-server shuts down and exits 0
    assert time.monotonic() - t0 < 10
    _assert_stopped_cleanly(pid)
    assert "cleaning up before exit" in s.log_path.read_text()
    assert s.stop() == 0  # again: nothing to do

    # a server that cannot handle SIGTERM (stopped): SIGKILL after the timeout
    with Server(tiny_models["llama"], extra_args=TINY_ARGS, log_path=tmp_path / "b.log", startup_timeout=60) as s:
        pid = s.process.pid
        os.kill(pid, signal.SIGSTOP)
        assert s.stop(timeout=1) == -signal.SIGKILL
    _assert_stopped_cleanly(pid)


def test_startup_failures_fail_fast_with_the_log(tiny_models, tmp_path, monkeypatch):
    # the server exits during start-up: the error carries the end of its log, nothing is left
    t0 = time.monotonic()
    s = Server(tiny_models["llama"], extra_args=["--no-such-flag"], log_path=tmp_path / "bad.log", startup_timeout=60)
    with pytest.raises(ServerError, match=r"(?s)exited with code 1 during start-up.*--no-such-flag"):
        s.start()
    assert time.monotonic() - t0 < 15
    _assert_stopped_cleanly(s.process.pid)

    # not healthy in time: stopped
    monkeypatch.setattr(serve, "http_status", lambda *a, **k: 503)
    s = Server(tiny_models["llama"], extra_args=TINY_ARGS, log_path=tmp_path / "slow.log", startup_timeout=1)
    with pytest.raises(ServerError, match="not healthy after 1 s"):
        s.start()
    _assert_stopped_cleanly(s.process.pid)


def test_a_port_taken_before_the_server_binds_is_retried(tiny_models, tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound, not listening: the server's bind fails, a connection is refused
    ports = [taken.getsockname()[1]]
    real = processes.free_port
    monkeypatch.setattr(processes, "free_port", lambda host: ports.pop() if ports else real(host))
    try:
        with Server(tiny_models["llama"], extra_args=TINY_ARGS, log_path=tmp_path / "p.log", startup_timeout=60) as s:
            assert s.port != taken.getsockname()[1]
            assert _http("GET", s.url + "/health")[0] == 200
        assert "couldn't bind" in s.log_path.read_text()
    finally:
        taken.close()


@pytest.mark.slow
def test_smollm2_chat_through_the_openai_client(smollm2_path, tmp_path, openai):
    with Server(smollm2_path, extra_args=["-c", "4096", "-np", "1", "--threads", "1", "-ngl", "0"],
                log_path=tmp_path / "smollm2.log", startup_timeout=120) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="-", timeout=120, max_retries=0)
        msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        a = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
        b = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
        assert "paris" in a.choices[0].message.content.lower()
        assert b.choices[0].message.content == a.choices[0].message.content
        assert b.usage.prompt_tokens_details.cached_tokens > 0  # the prompt cache served the second one
        pid = s.process.pid
    _assert_stopped_cleanly(pid)


# ------------------------------------------------------------------------------------------------
# the CLI


def _cli_env() -> dict:
    env = dict(os.environ)
    src = str(Path(ridgefill_cpp.__file__).resolve().parent.parent)  # the package these tests import
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env.pop(var, None)
    return env


def _start_cli(args, out: Path) -> subprocess.Popen:
    with open(out, "wb") as f:
        return subprocess.Popen([sys.executable, "-c", "from ridgefill_cpp.cli import app; app()", "serve", *map(str, args)],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_cli_env())


def _wait_for(proc: subprocess.Popen, out: Path, pattern: str, timeout: float = 60.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, out.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in the output (exit code {proc.poll()}):\n{out.read_text()[-3000:]}")


def _server_child(cli_pid: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in _children(cli_pid):
            try:
                if _cmdline(p)[0].endswith("llama-server"):
                    return p
            except (FileNotFoundError, IndexError, ProcessLookupError):
                pass
        time.sleep(0.005)
    raise AssertionError("the CLI started no llama-server")


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_serves_prints_the_url_and_stops_on_a_signal(sig, tiny_models, tmp_path):
    out = tmp_path / "cli.out"
    extra = ["-np", "2", "-c", "1024", "--threads", "1", "-ngl", "0"]
    key2, key3 = "second-key-4567", "file-key-89ab"
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# the third key\n{key3}\n")
    proc = _start_cli([tiny_models["llama"], "--port", "0", "--api-key", KEY, "--api-key-file", keys, "--",
                       "--api-key", key2, *extra], out)
    try:
        url = _wait_for(proc, out, r"OpenAI base URL: (http://127\.0\.0\.1:\d+)/v1").group(1)
        assert f"llama-server is ready: {url}" in out.read_text()
        assert "RidgeFill off: stock llama-server prefill" in out.read_text()
        server = _server_child(proc.pid)
        # everything after -- reached llama-server unchanged, after serve's own flags, except the API key:
        # no key on its command line (what `ps` shows every user), each of the three accepted
        assert _cmdline(server)[-len(extra) - 2:] == [*extra, "--api-key-file", str(keys)]
        assert not any(k in a for a in _cmdline(server) for k in (KEY, key2, key3))
        assert _http("GET", url + "/v1/models")[0] == 401
        assert _http("GET", url + "/v1/models", key="wrong")[0] == 401
        assert [_http("GET", url + "/v1/models", key=k)[0] for k in (KEY, key2, key3)] == [200, 200, 200]
        assert _listening(server) == {("127.0.0.1", int(url.rsplit(":", 1)[1]))}
        status, props = _http("GET", url + "/props", key=KEY)
        assert status == 200 and props["total_slots"] == 2
        status, r = _http("POST", url + "/v1/completions", {"model": "m", "prompt": "the day", "max_tokens": 4,
                                                             "temperature": 0}, key=KEY)
        assert status == 200 and r["usage"]["completion_tokens"] > 0
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0  # the server shut down cleanly and its code is the CLI's
        assert time.monotonic() - t0 < 15
        _assert_stopped_cleanly(server)
        assert "cleaning up before exit" in out.read_text()
    finally:
        _end(proc)


def test_cli_ctrl_c_while_the_server_is_loading(tiny_models, tmp_path):
    """A server that is not healthy yet (stopped right after it starts): Ctrl-C is forwarded, a second
    Ctrl-C kills it at once; nothing is left."""
    out = tmp_path / "cli.out"
    proc = _start_cli([tiny_models["llama"], "--port", "0", "--", *TINY_ARGS], out)
    try:
        server = _server_child(proc.pid)
        os.kill(server, signal.SIGSTOP)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert proc.poll() is None and _alive(server)  # waiting for the (stopped) server to exit
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 128 + signal.SIGKILL
        _assert_stopped_cleanly(server)
    finally:
        _end(proc)


def test_cli_server_exits_during_startup(tiny_models, cli, monkeypatch):
    r = cli("serve", tiny_models["llama"], "--port", "0", "--", "--no-such-flag")
    assert r.exit_code == 1
    assert "llama-server exited with code 1 before it was ready" in r.output


def test_cli_help_lists_every_option(cli):
    r = cli("serve", "--help")
    assert r.exit_code == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", r.output).split())
    for opt in ("--maps", "-m", "--identity-split", "--tail", "--exact-fraction", "--selector", "--min-prompt",
                "--host", "--port", "--api-key", "--api-key-file", "--startup-timeout", "LLAMA-SERVER ARGS"):
        assert opt in text, opt
    for words in ("patched llama.cpp llama-server", "not a Python re-implementation", '"ridgefill" JSON field',
                  "false (exact prefill for this request)", '{"tail", "exact_fraction", "selector", "span"}',
                  "binds 127.0.0.1 unless --host"):
        assert words in text, words


def test_cli_argument_errors_start_nothing(cli, tiny_models, maps, tmp_path, monkeypatch):
    from ridgefill_cpp.testing import tiny_models as mtm

    monkeypatch.setattr(processes, "popen", _no_process)
    tiny = tiny_models["llama"]
    cases = [
        ((tiny, "--maps", maps, "--identity-split", 3), "give --maps or --identity-split, not both"),
        ((tiny_models["qwen3"], "--maps", maps), "architecture: maps are for llama, the model is qwen3"),
        ((mtm.make_tiny_model("llama", tmp_path / "seed1.gguf", seed=1), "-m", maps), "another checkpoint"),
        ((tmp_path / "missing.gguf",), "missing.gguf: no such file"),
        ((tmp_path / "missing.gguf", "--maps", maps), "missing.gguf: no such file"),
        ((tiny, "--maps", tmp_path / "nomaps.gguf"), "nomaps.gguf: no such file"),
        ((tiny, "--tail", 32), "--tail: RidgeFill settings need --maps or --identity-split"),
        ((tiny, "--maps", maps, "--selector", "bogus"), "selector 'bogus'"),
        ((tiny, "--identity-split", 9), r"split 9 outside 1..5"),
        ((tiny, "--", "-np", "2", "--port", "9000"), "--port is set by the port option of serve"),
        ((tiny, "--host", "0.0.0.0,::"), "one IP address"),
        ((tiny, "--api-key-file", tmp_path / "no-keys.txt"), "no-keys.txt: No such file or directory"),
        ((tiny, "--", "--api-key-file", tmp_path), "is a directory, not a regular file"),
        ((tiny, "--", "-np", "2", "--api-key"), "--api-key needs a value"),
        ((tiny, "--api-key", ""), "the API key is empty"),
    ]
    for args, message in cases:
        r = cli("serve", *args)
        assert r.exit_code != 0 and message in " ".join(r.output.split()), (args, r.output)


def test_peer_suite_tool_reads_junit_and_lists_the_differences(tmp_path):
    """tools/peer_server_tests.py (make peer-tests; not run in CI): its JUnit reading, the list of
    differing tests with their expected reasons, and the pytest plugin it writes into the suite."""
    import ast

    import peer_server_tests as peer

    junit = tmp_path / "r.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="unit.test_a" name="test_ok"/>'
                     '<testcase classname="unit.test_a" name="test_bad"><failure message="x"/></testcase>'
                     '<testcase classname="unit.test_slot_save" name="test_slot_save_restore"><skipped/></testcase>'
                     '</testsuite></testsuites>')
    got = peer.outcomes(junit)
    assert got == {"unit.test_a::test_ok": "passed", "unit.test_a::test_bad": "failed",
                   "unit.test_slot_save::test_slot_save_restore": "skipped"}
    rf = dict(got, **{"unit.test_a::test_ok": "failed", "unit.test_slot_save::test_slot_save_restore": "failed"})
    diffs = peer.differences(got, rf)
    assert [d["test"] for d in diffs] == ["unit.test_a::test_ok", "unit.test_slot_save::test_slot_save_restore"]
    assert diffs[0]["expected"] is None and "not saved" in diffs[1]["expected"]
    text = peer.report(diffs, {"stock": {"passed": 1, "failed": 1, "error": 0, "skipped": 1}}, "unit test")
    assert "**NEW**" in text and "`unit.test_a::test_ok` | passed | failed" in text
    ast.parse(peer.PLUGIN)  # the plugin the tool writes is valid Python
    assert peer.ridgefill_flags(20) == ["--ridgefill-split", "20", "--ridgefill-min-prompt", "8", "--ridgefill-tail", "1"]
