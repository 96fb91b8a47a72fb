"""Where and when a measurement ran, written into every measurement file (``bench --json``,
``eval``'s results.json, ``eval --ruler``'s ruler.json, ``tune``'s tune.json) so that a figure
carries its hardware, threads and date wherever it is quoted."""

from __future__ import annotations

import datetime
import os
import platform
import threading


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def measured_on(n_threads: int | None, n_gpu_layers: int = 0) -> dict:
    """``{"date", "cpu", "cores", "threads", "os", "ridgefill_cpp", "llama_cpp", "patchset", "backends",
    "n_gpu_layers"}``: ``threads`` are the prefill's (llama-cpp-python uses every core when none are
    given); ``n_gpu_layers`` the layers offloaded (-1: all; offloaded only where ``backends`` has a GPU)."""
    from .. import __version__
    from .native import build_info

    try:
        info = build_info()
    except Exception:  # a measurement file is still written without the library's self-description
        info = {}
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "cpu": cpu_name(),
            "cores": os.cpu_count(), "threads": n_threads or os.cpu_count(),
            "os": f"{platform.system()} {platform.machine()}", "ridgefill_cpp": __version__,
            "llama_cpp": info.get("llama_cpp_commit"), "patchset": info.get("patchset"), "backends": info.get("backends"),
            "n_gpu_layers": n_gpu_layers, **_devices()}


#: the offload devices named on this thread (runtime.devices.loading_on_devices sets them)
offload = threading.local()


def current_devices() -> list[str] | None:
    """The device names ``--device`` gave the models loaded on this thread (``[]``: none), else None."""
    return getattr(offload, "names", None)


def _devices() -> dict:
    """``{"devices": [...]}`` while ``--device`` named the offload devices (``[]``: none), else nothing."""
    names = current_devices()
    return {} if names is None else {"devices": names}


def measured_text(m: dict) -> str:
    """One line for a report: "2026-12-07, AMD EPYC 9R14 (2 cores), 2 threads, ridgefill-cpp 0.1.0,
    llama.cpp 0c1e57098bba, CPU backend"."""
    if not m:
        return "not recorded"
    backends = [b for b in (m.get("backends") or []) if b != "RPC"]
    return (f"{m.get('date')}, {m.get('cpu')} ({m.get('cores')} cores), {m.get('threads')} threads, "
            f"ridgefill-cpp {m.get('ridgefill_cpp')}, llama.cpp {m.get('llama_cpp')}"
            + (f", {'/'.join(backends)} backend{'s' if len(backends) > 1 else ''}" if backends else "")
            + (f", {gpu_layers_text(m['n_gpu_layers'])} offloaded" if m.get("n_gpu_layers") else "")
            + (f", devices {','.join(m['devices']) or 'none'}" if m.get("devices") is not None else ""))


def gpu_layers_text(n_gpu_layers: int) -> str:
    """``-ngl``'s value in words: "all layers", "12 layers"."""
    return "all layers" if n_gpu_layers < 0 else f"{n_gpu_layers} layer{'s' if n_gpu_layers != 1 else ''}"
