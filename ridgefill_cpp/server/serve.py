"""``ridgefill-gguf serve``: llama.cpp's own ``llama-server``, built from the patched tree, with RidgeFill.

This module does not serve anything itself: it checks the settings, builds the command line of the
patched ``llama-server`` binary installed inside the package (``ridgefill_cpp/bin/llama-server``),
starts it, waits until ``GET /health`` answers 200 and stops it cleanly. RidgeFill settings become
the server's own flags (``--ridgefill-maps``, ``--ridgefill-split``, ``--ridgefill-tail``,
``--ridgefill-exact-fraction``, ``--ridgefill-selector``, ``--ridgefill-min-prompt``); without
RidgeFill the command line is stock llama-server's. Per request, the server takes a ``"ridgefill"``
JSON field on ``/completion``, ``/v1/completions`` and ``/v1/chat/completions``: ``false`` (exact
prefill for this request), ``true`` (the server's settings) or an object overriding ``tail``,
``exact_fraction`` and ``selector``.

>>> with Server("model.gguf", ridgefill="model.ridgefill.gguf", extra_args=["-np", "4"]) as srv:
...     client = openai.OpenAI(base_url=srv.base_url, api_key="-")

Every check (the model file, the map file against the model, the settings) runs before a process
starts. The server binds only ``host`` (loopback by default), runs in its own process group (a
Ctrl-C at the terminal reaches this process, which forwards one signal) and gets SIGTERM if this
process dies (Linux), so no path leaves an orphan.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from ..core import native as _native, settings
from ..core import processes as P
from ..core.processes import http_status  # noqa: F401  (part of this module's API)
from ..core.files import not_regular
from ..core.limits import check_c_string
from ..core.gguf_model import read_model_info, supported_architectures
from ..maps.mapfile import map_file_splits
from ..runtime.prefill import RidgeFill, as_ridgefill

#: RidgeFill settings that have no llama-server flag: they must keep their defaults to be served
_NO_SERVER_FLAG = ("value_rescale", "n_queries", "selector_layer", "fill_chunk", "protected", "placement",
                   "state_correction", "splice")

#: flags the command line sets from serve's own options; refused in the extra arguments
_MANAGED_FLAGS = {
    "-m": "the model argument", "--model": "the model argument",
    "--host": "the host option", "--port": "the port option",
    "--ridgefill-maps": "the maps option", "--ridgefill-split": "the identity split option",
    "--ridgefill-tail": "the tail option", "--ridgefill-exact-fraction": "the exact fraction option",
    "--ridgefill-selector": "the selector option", "--ridgefill-span": "the selector option (NAME@SPAN)",
    "--ridgefill-min-prompt": "the min prompt option", "--ridgefill-key-rescale": "the key rescale option",
}

_LOOPBACK = P.LOOPBACK

#: llama-server reads its --api-key from this environment variable (common/arg.cpp: set_env), so a
#: key never has to be on its command line, which every user of the machine can read (ps, /proc)
API_KEY_ENV = "LLAMA_API_KEY"


class ServerError(RuntimeError):
    """llama-server could not be started (missing binary, exited during start-up, not healthy in time)."""


def server_binary() -> Path:
    """The patched ``llama-server`` installed with the package: ``bin/llama-server`` next to the
    native libraries it links (found the way :mod:`ridgefill_cpp.core.native` finds them, so a source
    checkout on ``PYTHONPATH`` uses the installed build)."""
    path = _native.BIN_DIR / ("llama-server.exe" if sys.platform == "win32" else "llama-server")
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ServerError(f"the patched llama-server was not found at {path} (it is built and installed with the "
                          "native libraries of " + str(_native.LIB_DIR) + "): run `make setup` (see README)")
    return path


def _check_servable(rf: RidgeFill) -> None:
    """Settings the server flags can express: a selector by name, the others at their defaults."""
    if rf.selector == "positions":
        raise ValueError(f"the server takes a selector by name ({settings.names(settings.SELECTORS)}), not a list "
                         "of positions")
    # a tunable setting left as None resolves (argument, map file, built-in): its built-in default
    defaults = {f.name: settings.TUNABLE_DEFAULTS.get(f.name, f.default) for f in dataclasses.fields(RidgeFill)
                if f.name in _NO_SERVER_FLAG}
    changed = []
    for name, default in defaults.items():
        value = getattr(rf, name)
        same = (settings.protected_mask(value) == settings.protected_mask(default) if name == "protected"
                else value == default)
        if not same:
            where = " from the map file's tuned defaults" if rf.origin.get(name) == "map file" else ""
            changed.append(f"{name}={value!r}{where} (the server uses {default!r})")
    if changed:
        raise ValueError("llama-server has no flag for these RidgeFill settings: " + ", ".join(changed))


def check_ridgefill(model: str | os.PathLike, ridgefill: RidgeFill | str | os.PathLike | None) -> RidgeFill | None:
    """The RidgeFill settings to serve ``model`` with (a map file path resolves to its tuned defaults),
    after checking, before any process starts, what ``Llama(model, ridgefill=...)`` would refuse:
    the model file, the map file (readable, not corrupt, fitted on this model: architecture,
    dimensions, fingerprint; :func:`ridgefill_cpp.maps.mapfile.map_file_splits`), the split, the
    architecture, and settings the server has flags for. Raises ``ValueError`` (``GGUFFileError`` /
    ``MapFileError`` are ``ValueError`` s) saying what is wrong."""
    info = read_model_info(model)
    rf = as_ridgefill(ridgefill)
    if rf is None:
        return None
    _check_servable(rf)
    if not info.supported:
        raise ValueError(f"{model}: architecture '{info.architecture}' is not supported by RidgeFill prefill "
                         f"(supported: {', '.join(supported_architectures())}); serve it without RidgeFill")
    if rf.maps is not None:
        (file_split,) = map_file_splits([rf.maps], model)
        if rf.split is not None and rf.split != file_split:
            raise ValueError(f"the maps were fitted for split {file_split}, not the requested split {rf.split}")
    elif not 1 <= rf.split <= info.n_layer - 1:
        raise ValueError(f"split {rf.split} outside 1..{info.n_layer - 1} ({model} has {info.n_layer} layers)")
    return rf


def _split_api_keys(extra: Sequence[str]) -> tuple[list[str], list[str]]:
    """``extra`` without its ``--api-key K`` / ``--api-key=K`` arguments, and those keys."""
    rest, keys = [], []
    args = [str(a) for a in extra]
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--api-key":
            if i + 1 >= len(args):
                raise ValueError("--api-key needs a value")
            keys.append(args[i + 1])
            i += 2
            continue
        if a.startswith("--api-key="):
            keys.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    if any(not k for k in keys):
        raise ValueError("the API key is empty")
    return rest, keys


def check_api_key_file(path: str | os.PathLike) -> Path:
    """A file of API keys for llama-server's ``--api-key-file`` (one per line, ``#`` comments), checked
    the way llama-server reads it: a readable regular file holding at least one key."""
    p = Path(path)
    what = not_regular(p, follow_symlinks=True)
    if what is not None:
        raise ValueError(f"API key file {p} is {what}, not a regular file")
    try:
        lines = p.read_text(errors="replace").splitlines()
    except OSError as e:
        raise ValueError(f"API key file {p}: {e.strerror or e}") from None
    if not any(line and not line.startswith("#") for line in lines):
        raise ValueError(f"API key file {p} holds no key (one per line; lines starting with # are comments)")
    return p


def _check_extra(extra: Sequence[str]) -> list[str]:
    extra = [str(a) for a in extra]
    for i, a in enumerate(extra):
        check_c_string("llama-server argument", a)
        flag = a.split("=", 1)[0]
        if flag in _MANAGED_FLAGS:
            raise ValueError(f"{flag} is set by {_MANAGED_FLAGS[flag]} of serve, not among the extra llama-server "
                             "arguments")
        if flag == "--api-key-file":
            value = a.split("=", 1)[1] if "=" in a else (extra[i + 1] if i + 1 < len(extra) else None)
            if value is None:
                raise ValueError("--api-key-file needs a value")
            check_api_key_file(value)
    _split_api_keys(extra)  # checks
    return extra


def _check_host(host: str) -> str:
    host = str(host).strip()
    if not host or "," in host or host.endswith(".sock") or "/" in host:
        raise ValueError(f"host {host!r}: give one IP address or host name to listen on")
    return host


def server_args(model: str | os.PathLike, ridgefill: RidgeFill | str | os.PathLike | None = None,
                host: str = _LOOPBACK, port: int = 8080, extra: Sequence[str] = (), *,
                api_key: str | None = None) -> list[str]:
    """The command line of the patched llama-server: the binary, ``-m model --host H --port P``, the
    RidgeFill flags of the resolved settings (none when ``ridgefill`` is None: stock llama-server),
    then ``extra`` unchanged, except that no API key is ever on it: ``api_key`` and any ``--api-key
    K`` / ``--api-key=K`` of ``extra`` go to the server through its environment
    (:func:`server_env`), since every user of the machine can read a command line.

    Only the settings given as arguments become flags: the server resolves the others the way
    ``RidgeFill`` did, in libllama (the map file's tuned defaults of ``ridgefill-gguf tune``, else
    the built-in ones), so it runs exactly what ``RidgeFill`` says. With maps, the split is the
    file's (``--ridgefill-maps``); identity fill passes ``--ridgefill-split``. Does not read the model or check the settings against it:
    :func:`check_ridgefill` does.
    """
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port {port} outside 0..65535")
    check_c_string("model", model)
    args = [str(server_binary()), "-m", str(model), "--host", _check_host(host), "--port", str(int(port))]
    rf = as_ridgefill(ridgefill)
    if rf is not None:
        _check_servable(rf)
        if rf.maps is not None:
            args += ["--ridgefill-maps", str(rf.maps)]
        else:
            args += ["--ridgefill-split", str(int(rf.split))]
        # only the settings given as arguments: the server resolves the others as RidgeFill did, in
        # libllama (the map file's tuned values, else the built-in ones)
        given = {name for name, origin in rf.origin.items() if origin == "argument"}
        for name, flag, value in (("tail", "--ridgefill-tail", str(int(rf.tail))),
                                  ("exact_fraction", "--ridgefill-exact-fraction", repr(float(rf.exact_fraction))),
                                  ("selector", "--ridgefill-selector", str(rf.selector)),
                                  ("span", "--ridgefill-span", str(int(rf.span))),
                                  ("key_rescale", "--ridgefill-key-rescale", str(int(rf.key_rescale)))):
            if name in given:
                args += [flag, value]
        if rf.min_prompt != settings.MIN_PROMPT:
            args += ["--ridgefill-min-prompt", str(int(rf.min_prompt))]
        # the patched server itself turns on --swa-full when RidgeFill is on
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty")
    return args + _split_api_keys(_check_extra(extra))[0]


def server_env(api_key: str | None = None, extra: Sequence[str] = (),
               environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the patched llama-server: ``environ`` (default: this process's), with the
    API keys (``api_key``, the ``--api-key`` values among ``extra``, after any ``LLAMA_API_KEY``
    already set) in ``LLAMA_API_KEY``, comma-separated as llama-server's ``--api-key`` takes them.
    Only the owner of the process (and root) can read its environment."""
    env = dict(os.environ if environ is None else environ)
    keys = ([api_key] if api_key is not None else []) + _split_api_keys(extra)[1]
    if any(not k for k in keys):
        raise ValueError("the API key is empty")
    if keys:
        env[API_KEY_ENV] = ",".join(([env[API_KEY_ENV]] if env.get(API_KEY_ENV) else []) + keys)
    return env


def describe(rf: RidgeFill | None) -> str:
    """One line saying what the server will run (and where each setting came from)."""
    if rf is None:
        return "RidgeFill off: stock llama-server prefill"
    src = lambda k: f" ({rf.origin[k]})" if rf.origin.get(k, "argument") != "argument" else ""  # noqa: E731
    what = f"maps {rf.maps}" if rf.maps is not None else f"identity fill at split {rf.split}"
    return (f"RidgeFill: {what}; tail {rf.tail}{src('tail')}, exact fraction {rf.exact_fraction:g}"
            f"{src('exact_fraction')}, selector {rf.selector}{src('selector')}"
            + (f" with span {rf.span}" if rf.span != 1 else "")
            + (f", key rescale c_K = {rf.key_rescale}{src('key_rescale')}" if rf.key_rescale else "")
            + f", prompts from {rf.min_prompt} tokens")


class Server:
    """The patched llama-server as a context manager.

    ``ridgefill``: None (stock llama-server), a :class:`RidgeFill`, or a map file path (its tuned
    defaults). ``port=0`` picks a free port on ``host``. ``api_key`` is required on the API endpoints;
    it reaches llama-server through its environment (``LLAMA_API_KEY``), never its command line, as
    does an ``--api-key`` among ``extra_args`` (:func:`server_args`, :func:`server_env`). The other
    ``extra_args`` go to llama-server unchanged (``--api-key-file FILE`` is checked first). stdout and stderr
    go to ``log_path`` (default: a new file in the temporary directory, kept after :meth:`stop`).
    The settings are checked when the object is made, before any process starts.
    """

    def __init__(self, model: str | os.PathLike, ridgefill: RidgeFill | str | os.PathLike | None = None, *,
                 host: str = _LOOPBACK, port: int = 0, api_key: str | None = None, extra_args: Sequence[str] = (),
                 log_path: str | os.PathLike | None = None, startup_timeout: float = 120.0):
        self.model = Path(model)
        self.ridgefill = check_ridgefill(self.model, ridgefill)
        self.host = _check_host(host)
        self.api_key = api_key
        self.extra_args = _check_extra(extra_args)
        self.startup_timeout = float(startup_timeout)
        self._want_port = int(port)
        server_args(self.model, self.ridgefill, self.host, self._want_port, self.extra_args, api_key=api_key)  # checks
        self._log_path = Path(log_path) if log_path is not None else None
        self.port: int | None = None
        self.process = None
        self.args: list[str] = []

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServerError("the server has not been started")
        return f"http://{P.url_host(P.connect_host(self.host))}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url``."""
        return self.url + "/v1"

    def log(self) -> str:
        """The server's output so far."""
        return self._log_path.read_text(errors="replace") if self._log_path and self._log_path.exists() else ""

    def start(self) -> "Server":
        if self.process is not None and self.process.poll() is None:
            raise ServerError("the server is already running")
        if self._log_path is None:
            self._log_path = P.new_log("ridgefill-server-")

        def start(port: int) -> None:
            self.port = port
            self.args = server_args(self.model, self.ridgefill, self.host, self.port, self.extra_args,
                                    api_key=self.api_key)
            with open(self._log_path, "ab") as log:
                log.write(f"$ {' '.join(self.args)}\n".encode())
                log.flush()
                self.process = P.popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                      env=server_env(self.api_key, self.extra_args))
            try:
                self._wait_healthy()
            except BaseException:
                self.stop()
                raise

        P.on_free_port(self._want_port, self.host, start, lambda: "couldn't bind" in P.tail(self._log_path, 20))
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = self.url + "/health"
        while True:
            rc = self.process.poll()
            if rc is not None:
                raise ServerError(f"llama-server exited with code {rc} during start-up; the end of its log "
                                  f"({self._log_path}):\n{P.tail(self._log_path)}")
            if http_status(url, self.api_key, timeout=2.0) == 200 and self.process.poll() is None:
                return
            if time.monotonic() > deadline:
                raise ServerError(f"llama-server was not healthy after {self.startup_timeout:g} s; the end of its "
                                  f"log ({self._log_path}):\n{P.tail(self._log_path)}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; returns the exit code (None: never started)."""
        if self.process is None:
            return None
        return P.stop_process(self.process, timeout)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(model: str | os.PathLike, ridgefill: RidgeFill | str | os.PathLike | None = None, *,
          host: str = _LOOPBACK, port: int = 8080, api_key: str | None = None, extra_args: Sequence[str] = (),
          startup_timeout: float = 600.0, grace: float = 10.0, echo: Callable[[str], None] | None = None) -> int:
    """Run the patched llama-server in the foreground (its output on this terminal) until it exits or
    this process gets SIGINT / SIGTERM, which is forwarded to it once (a second one kills it; SIGKILL
    ``grace`` s after the first). Says the URL once the server is healthy. Returns the server's exit
    code (128 + N when a signal N ended it). Raises ``ValueError`` on bad settings (before starting
    anything) and :class:`ServerError` when the server exits during start-up or is not healthy in
    ``startup_timeout`` s; no path leaves the server running."""
    echo = echo or (lambda s: print(s, flush=True))
    rf = check_ridgefill(model, ridgefill)
    host = _check_host(host)
    port = int(port) or P.free_port(host)
    args = server_args(model, rf, host, port, extra_args, api_key=api_key)
    url = f"http://{P.url_host(P.connect_host(host))}:{port}"
    echo(describe(rf))

    stop_sig: list[int] = []
    state = {"proc": None, "kill_at": None}

    def forward(signum, frame) -> None:
        proc = state["proc"]
        if stop_sig and proc is not None and proc.poll() is None:
            proc.kill()  # a second signal: do not wait
        elif proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)  # it handles INT and TERM
        stop_sig.append(signum)
        state["kill_at"] = time.monotonic() + grace

    main = threading.current_thread() is threading.main_thread()
    old = {}
    if main:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[s] = signal.signal(s, forward)
    proc = None
    try:
        proc = state["proc"] = P.popen(args, env=server_env(api_key, extra_args))
        if stop_sig:  # a signal between the handlers and the start
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + startup_timeout
        healthy = False
        while proc.poll() is None:
            now = time.monotonic()
            if stop_sig:
                if state["kill_at"] is not None and now > state["kill_at"]:
                    proc.kill()
            elif not healthy:
                if http_status(url + "/health", api_key, timeout=1.0) == 200 and proc.poll() is None:
                    healthy = True
                    echo(f"llama-server is ready: {url}  (open it in a browser: llama.cpp's chat page)")
                    echo(f"OpenAI base URL: {url}/v1  (Ctrl-C stops the server)")
                elif now > deadline:
                    P.stop_process(proc, grace)
                    raise ServerError(f"llama-server was not healthy after {startup_timeout:g} s: stopped it")
            try:
                proc.wait(timeout=0.1 if not healthy else 0.5)
            except subprocess.TimeoutExpired:
                pass
        rc = proc.returncode
        P.reap_group(proc.pid)
        if not healthy and not stop_sig:
            raise ServerError(f"llama-server exited with code {rc} before it was ready (its output is above)")
        return rc if rc >= 0 else 128 - rc
    finally:
        if proc is not None and proc.poll() is None:
            P.stop_process(proc, grace)
        for s, h in old.items():
            signal.signal(s, h)
