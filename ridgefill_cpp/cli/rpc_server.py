"""``ridgefill-gguf rpc-server``: this machine as an RPC worker."""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from .app import (app, fail)


@app.command("rpc-server")
def rpc_server_cmd(
    host: str = typer.Option(
        "127.0.0.1", "--host", "-H",
        help="The address to listen on (default: loopback only). The RPC protocol has no authentication and no "
             "encryption: give the address of a private network between your machines, never a public one."),
    port: int = typer.Option(50052, "--port", "-p", min=1, max=65535, help="Port to listen on."),
    threads: Optional[int] = typer.Option(
        None, "--threads", "-t", min=1, help="Threads of the worker's CPU device (default: half the cores)."),
    device: Optional[str] = typer.Option(
        None, "--device", "-d", help="Comma-separated devices to offer (default: every accelerator, else the CPU)."),
    cache: bool = typer.Option(
        False, "--cache", "-c", help="Keep large weights in a local file cache, so that loading the model again "
                                     "does not send them again."),
) -> None:
    """Run this machine as a worker of a model split over several machines: llama.cpp's own
    ggml-rpc-server, installed with the package (the same llama.cpp commit as the host's, which the
    protocol needs). The host then loads the model with Llama(..., rpc_servers="THIS-HOST:PORT") or
    `ridgefill-gguf serve MODEL -- --rpc THIS-HOST:PORT`. A worker serves one host at a time and needs
    no model file, maps or RidgeFill setting. Runs in the foreground until Ctrl-C."""
    from ..runtime.rpc import worker_binary

    try:
        binary = worker_binary()
    except FileNotFoundError as e:
        fail(str(e))
    args = [str(binary), "-H", host, "-p", str(port)]
    if threads is not None:
        args += ["-t", str(threads)]
    if device is not None:
        args += ["-d", device]
    if cache:
        args.append("-c")
    sys.stdout.flush()
    os.execv(binary, args)
