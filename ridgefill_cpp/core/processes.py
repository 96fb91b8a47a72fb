"""Child processes of the command line and the library: the patched ``llama-server`` (:mod:`.serve`) and
the RPC workers (:mod:`.rpc`) start, stop and report through these helpers.

A child runs in its own process group (a Ctrl-C at the terminal reaches this process, which forwards
one signal) and gets SIGTERM if this process dies (Linux), so no path leaves an orphan; a port of 0
picks a free one, retried when another process takes it first.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Callable

LOOPBACK = "127.0.0.1"



def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_log(prefix: str) -> Path:
    """A new empty log file in the temporary directory (kept after the process stops)."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    return Path(name)


def on_free_port(want_port: int, host: str, start: Callable[[int], None], port_taken: Callable[[], bool]) -> None:
    """``start(port)`` with ``want_port``, or with a free port of ``host`` when it is 0: up to three of
    them, since another process can take a free port between our probe and the server's bind
    (``port_taken()`` says whether that is why a start failed)."""
    attempts = 3 if want_port == 0 else 1
    for attempt in range(attempts):
        try:
            start(want_port or free_port(host))
            return
        except Exception:
            if attempt + 1 < attempts and port_taken():
                continue
            raise


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``."""
    if host in ("0.0.0.0", ""):
        return LOOPBACK
    if host == "::":
        return "::1"
    return host


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def http_status(url: str, api_key: str | None = None, timeout: float = 2.0) -> int | None:
    """The HTTP status of ``GET url`` (None: no answer)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with _NO_PROXY.open(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):  # refused, reset, timed out
        return None


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def child_setup(parent: int) -> Callable[[], None] | None:
    """In the child before exec: SIGTERM when the parent dies (Linux), and exit if it already has.
    (Linux ties this to the thread that started the child: start servers from a thread that outlives them.)"""
    if _PRCTL is None:
        return None

    def setup() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return setup


def popen(args: list[str], **kw):
    # its own process group: a Ctrl-C at the terminal reaches us only, and we forward one signal
    # (two SIGINTs make llama-server exit at once, without its clean shutdown)
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=child_setup(os.getpid()), **kw)


def reap_group(pgid: int) -> None:
    """SIGKILL whatever is left in the server's process group once the server has exited."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(proc, timeout: float, sig: int = signal.SIGTERM) -> int:
    """Signal, wait up to ``timeout`` s, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reap_group(proc.pid)
    return proc.returncode


def tail(path: Path, n: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            lines = deque(f, maxlen=n)
    except OSError:
        return ""
    return b"".join(lines).decode(errors="replace").rstrip()
