"""llama.cpp's ``--device``: the devices a model's offloaded layers go to, by name.

llama.cpp offloads the ``n_gpu_layers`` layers to every GPU it finds unless ``--device`` names some
(``CUDA0``, ``CUDA1,CUDA2``, ``Vulkan0``; ``none``: no offload at all, whatever ``-ngl`` says), and
refuses a name it does not know or the CPU (common/arg.cpp ``parse_device_list``). Here the same
list becomes ``llama_model_params.devices`` (llama-cpp-python 0.3.36's ``Llama`` has no argument for
it): :func:`device_list` builds it, :func:`loading_on_devices` gives it to every model loaded inside
(the CLI's ``--device``), ``ridgefill_cpp.Llama(..., devices=...)`` to one model.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Iterator, Sequence

import llama_cpp

from ..core.machine import current_devices, offload
from .rpc import loading_on

#: ggml_backend_dev_type (ggml-backend.h)
DEVICE_TYPES = ("CPU", "GPU", "IGPU", "ACCEL", "META")


@dataclass(frozen=True)
class Device:
    name: str         # what --device takes: CUDA0, Vulkan1, Metal, RPC[host:port], ...
    description: str  # the GPU's model, as the backend reports it
    type: str         # one of DEVICE_TYPES


def _ggml():
    """libllama's handle: the ggml device API is resolved through it (ggml is one of its libraries)."""
    lib = llama_cpp.llama_cpp._lib
    if not getattr(lib, "_ridgefill_devices", False):
        lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], ctypes.c_size_t
        lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
        for name, res in (("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("type", ctypes.c_int)):
            f = getattr(lib, f"ggml_backend_dev_{name}")
            f.argtypes, f.restype = [ctypes.c_void_p], res
        lib._ridgefill_devices = True
    return lib


def _handles() -> list[tuple[Device, int]]:
    lib = _ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        h = lib.ggml_backend_dev_get(i)
        t = lib.ggml_backend_dev_type(h)
        out.append((Device(lib.ggml_backend_dev_name(h).decode(errors="replace"),
                           (lib.ggml_backend_dev_description(h) or b"").decode(errors="replace"),
                           DEVICE_TYPES[t] if 0 <= t < len(DEVICE_TYPES) else str(t)), h))
    return out


def offload_devices() -> list[Device]:
    """The devices this build finds on this machine that layers can be offloaded to (all but the CPU),
    as llama.cpp's ``--list-devices`` shows them."""
    return [d for d, _ in _handles() if d.type != "CPU"]


def device_names(value: str | Sequence[str]) -> list[str]:
    """``value`` (``"CUDA0,CUDA1"``, ``["CUDA0"]`` or ``"none"``; an empty list is ``none`` too)
    checked as llama.cpp checks ``--device``: ``[]`` for ``none``, else the names, each a device of
    :func:`offload_devices`. Raises ``ValueError`` naming the devices there are."""
    if not isinstance(value, str) and len(value) == 0:
        return []
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value)]
    if not any(names):
        raise ValueError(f"no device named in {value!r} (give NAME[,NAME...] or none)")
    if not all(names):
        raise ValueError(f"an empty name in {value!r} (give NAME[,NAME...] or none)")
    if names == ["none"]:
        return []
    known = {d.name: d for d in offload_devices()}
    for n in names:
        if n not in known:
            there = ", ".join(f"{d.name} ({d.description})" for d in known.values()) or "none but the CPU"
            why = " (the CPU is not a device to offload to; leave --device out or give none)" if n.upper() == "CPU" else ""
            raise ValueError(f"invalid device: {n}{why}; this build's offload devices here: {there}")
    return names


def device_list(value: str | Sequence[str]):
    """The NULL-terminated ``llama_model_params.devices`` for ``value`` (see :func:`device_names`)."""
    return _null_terminated(device_names(value))


def _null_terminated(names: list[str]):
    handles = {d.name: h for d, h in _handles()}
    return (ctypes.c_void_p * (len(names) + 1))(*[handles[n] for n in names], None)


@contextlib.contextmanager
def loading_on_devices(value: str | Sequence[str] | None) -> Iterator[list[str] | None]:
    """While inside, every model llama-cpp-python loads on this thread offloads to the devices of
    ``value`` only (``none``: to none); ``None`` changes nothing. Yields the names (``[]`` for none)."""
    if value is None:
        yield None
        return
    names = device_names(value)
    devs = _null_terminated(names)
    before = current_devices()
    offload.names = names  # what measurement files record (core.machine.measured_on)
    try:
        with loading_on(devs):
            yield names
    finally:
        offload.names = before
