"""Several machines: a model split over llama.cpp's RPC backend, with stock ``ggml-rpc-server`` workers.

Each worker machine runs ``ggml-rpc-server`` (installed with this package as
``ridgefill_cpp/bin/ggml-rpc-server``, ``ridgefill-gguf rpc-server`` runs it; a stock build of the
same llama.cpp commit works as well). The host loads the model with
``Llama(..., rpc_servers="host1:50052,host2:50052")`` or ``ridgefill-gguf serve MODEL -- --rpc ...``:
the layers it offloads (``n_gpu_layers``, split by ``tensor_split``) live on the workers, the rest
on the host. RidgeFill needs nothing on the workers: its graphs are ggml operators, serialised to
them like llama.cpp's own.

A worker serves one host connection at a time. When one stops answering, the model's tensors on it
are gone: every decode then raises :class:`RpcServerLost` (the process and the context stay up;
the rows of the failed call are removed, on hybrid models the whole sequence since a recurrent state
cannot be rolled back), until the worker is started again and the model is loaded again.

:class:`Worker` starts a ``ggml-rpc-server`` on this machine (tests, measurements, one-machine
trials).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import llama_cpp

from ..core import native as N
from ..core import processes as P
from ..core.limits import check_c_string

#: how many devices a list of RPC servers may give (llama.cpp's own limit is its tensor_split size)
MAX_DEVICES = 64


class RpcServerLost(RuntimeError):
    """A worker of the model stopped answering: its layers are lost until it runs again and the model
    is loaded again."""

    def __init__(self, servers: str):
        self.servers = servers.split(",")
        super().__init__(
            f"RPC server {servers} stopped responding: the model's tensors there are lost, so every decode of "
            "this model fails. Start the server again, close() this Llama and load the model again.")


def worker_binary() -> Path:
    """The ``ggml-rpc-server`` installed with the package (``bin/ggml-rpc-server``)."""
    path = N.BIN_DIR / ("ggml-rpc-server.exe" if sys.platform == "win32" else "ggml-rpc-server")
    if not path.is_file():
        raise FileNotFoundError(f"ggml-rpc-server was not found at {path} (it is built and installed with the "
                                "package: reinstall ridgefill-cpp)")
    return path


def server_list(servers: str | Sequence[str]) -> str:
    """``servers`` as llama.cpp's ``--rpc`` takes them: ``"host:port,host:port"`` (a string of that
    form, or a sequence of ``host:port``). Raises ``ValueError`` for an empty or malformed list."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    items = [str(s).strip() for s in items]
    for s in items:
        check_c_string("rpc_servers: server", s)
        host, sep, port = s.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rpc_servers: {s!r} is not host:port (in {servers!r})")
    if not items:
        raise ValueError("rpc_servers: no server given")
    return ",".join(items)


def model_devices(servers: str | Sequence[str]):
    """The NULL-terminated device list (``llama_model_params.devices``) of a model split over
    ``servers``: their devices in the order given, then this machine's GPUs. Connects to each server;
    raises ``ValueError`` when one does not answer."""
    devs = (ctypes.c_void_p * (MAX_DEVICES + 1))()
    n = N.llama_ridgefill_rpc_devices(server_list(servers).encode(), devs, MAX_DEVICES + 1)
    if n < 0:
        raise ValueError(f"rpc_servers: {N.llama_ridgefill_last_error().decode(errors='replace')}")
    if n > MAX_DEVICES:
        raise ValueError(f"rpc_servers: {n} devices, more than the {MAX_DEVICES} a model can use")
    return devs


_load_lock = threading.RLock()  # re-entrant: edits of both kinds of parameters may nest


@contextlib.contextmanager
def default_params_edited(name: str, edit: Callable[[object], None]) -> Iterator[None]:
    """While inside, llama-cpp-python's ``llama_cpp.<name>()`` (``llama_model_default_params`` or
    ``llama_context_default_params``, which its ``Llama`` starts its parameters from) returns the
    parameters with ``edit(params)`` applied, for calls on this thread: how a ``Llama`` gets a field
    it has no argument for."""
    module = llama_cpp.llama_cpp
    default = getattr(module, name)
    thread = threading.get_ident()

    def edited():
        params = default()
        if threading.get_ident() == thread:
            edit(params)
        return params

    with _load_lock:
        setattr(module, name, edited)
        try:
            yield
        finally:
            setattr(module, name, default)


def loading_on(devices):
    """While inside, a model that llama-cpp-python loads on this thread gets ``devices`` as its
    ``llama_model_params.devices`` (llama-cpp-python 0.3.36's ``Llama`` has no argument for it)."""
    return default_params_edited("llama_model_default_params",
                                 lambda params: setattr(params, "devices", ctypes.cast(devices, ctypes.c_void_p)))


def lost_servers(model) -> str:
    """The RPC servers (comma-separated) whose connection the model (a ``llama_model *``) lost; ""
    when none."""
    return N.llama_ridgefill_lost_rpc_servers(model).decode(errors="replace")


# ------------------------------------------------------------------------------------------------
# workers on this machine


class Worker:
    """A ``ggml-rpc-server`` on this machine, as a context manager: binds ``host`` (loopback by
    default; the RPC protocol has no authentication, so never bind a public address), ``port=0`` picks
    a free port. ``threads``: its CPU threads. Output goes to ``log_path`` (default: a new temporary
    file). :meth:`start` returns once the worker accepts connections."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, threads: int | None = None,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 startup_timeout: float = 30.0):
        self.host, self._want_port, self.threads = host, int(port), threads
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout = float(startup_timeout)
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise RuntimeError("the worker has not been started")
        return f"{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def start(self) -> "Worker":

        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the worker is already running")
        if self.log_path is None:
            self.log_path = P.new_log("ridgefill-rpc-")
        P.on_free_port(self._want_port, self.host, self._start_on,
                      lambda: "Failed to create server socket" in self.log())
        return self

    def _start_on(self, port: int) -> None:

        self.port = port
        args = [str(worker_binary()), "-H", self.host, "-p", str(self.port)]
        if self.threads is not None:
            args += ["-t", str(int(self.threads))]
        args += self.extra_args
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(args)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=P.child_setup(os.getpid()))
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"ggml-rpc-server exited with code {self.process.returncode} during start-up; "
                                   f"the end of its log ({self.log_path}):\n{P.tail(self.log_path)}")
            # a probe connection: the worker takes it, sees it close and waits for the next client
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ggml-rpc-server did not listen after {self.startup_timeout:g} s; the end of its "
                                   f"log ({self.log_path}):\n{P.tail(self.log_path)}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the worker dies as a crashed machine's would (tests)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; returns the exit code (None: never started)."""

        if self.process is None:
            return None
        return P.stop_process(self.process, timeout)

    def __enter__(self) -> "Worker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
