"""Map files loaded into libllama for one model: a thin owner of ``llama_ridgefill_maps``.

The C loader checks the file against the model (type, format version, architecture, n_layer,
n_embd, split, the range of its metadata numbers, mapped layers, tensor shapes and types, each
tensor's content digest, finite values) and, given the model's file, the fingerprint of the model
the maps were fitted on. A file without a content digest loads only with
``LLAMA_RIDGEFILL_ALLOW_UNDIGESTED`` set (:func:`undigested_allowed`), and then with an
:class:`UndigestedMapsWarning`.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np

from ..core import native as N
from ..core.limits import check_c_string
from ..maps.mapfile import KEY_DIGEST, MapFileError

#: the environment variable that makes libllama load a map file without a content digest
ALLOW_UNDIGESTED = "LLAMA_RIDGEFILL_ALLOW_UNDIGESTED"


class UndigestedMapsWarning(UserWarning):
    """A map file without a content digest was loaded, only because ``LLAMA_RIDGEFILL_ALLOW_UNDIGESTED``
    is set: corrupted map weights in it would not be detected."""


def undigested_allowed() -> bool:
    """Whether libllama loads a map file without a content digest: ``LLAMA_RIDGEFILL_ALLOW_UNDIGESTED``
    read as libllama reads it (C ``atoi`` > 0: ``1`` yes; ``0``, ``yes`` or empty no)."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", os.environ.get(ALLOW_UNDIGESTED, ""))
    return m is not None and int(m.group(1)) > 0


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this package: a warning names the caller's line."""
    package = __name__.split(".")[0] + "."
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(package):
        level, frame = level + 1, frame.f_back
    return level


class NativeMaps:
    """Maps of ``path`` loaded for ``model`` (a ``llama_model *``); free with :meth:`close`."""

    def __init__(self, model, path: os.PathLike | str, *, split: int | None = None, host: bool = False,
                 model_path: os.PathLike | str | None = None):
        self.path = Path(check_c_string("map file", path))
        if model_path is not None:
            check_c_string("model file", model_path)
        params = N.llama_ridgefill_maps_default_params()
        params.split_layer = -1 if split is None else int(split)
        params.host = bool(host)
        params.model_path = None if model_path is None else os.fsencode(model_path)
        handle = N.llama_ridgefill_maps_init(model, os.fsencode(self.path), params)
        if not handle:
            raise MapFileError(N.llama_ridgefill_last_error().decode(errors="replace"))
        self._handle = handle
        if not self.digest_checked:  # libllama's own line is a warning of its log, which verbose=False hides
            warnings.warn(f"{self.path}: the map file has no content digest ({KEY_DIGEST}) and was loaded "
                          f"only because {ALLOW_UNDIGESTED} is set: corrupted map weights in it would not be "
                          "detected (`ridgefill-gguf digest FILE` adds one to a file whose bytes you trust)",
                          UndigestedMapsWarning, stacklevel=_caller_stacklevel())

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError("the maps were freed")
        return self._handle

    @property
    def split_layer(self) -> int:
        return N.llama_ridgefill_maps_split_layer(self.handle)

    @property
    def fingerprint(self) -> str:
        return N.llama_ridgefill_maps_fingerprint(self.handle).decode()

    @property
    def n_bytes(self) -> int:
        return N.llama_ridgefill_maps_n_bytes(self.handle)

    @property
    def has_state_gains(self) -> bool:
        """Whether the file holds terminal-state gains (``RidgeFill(state_correction="gain")``)."""
        return bool(N.llama_ridgefill_maps_has_state_gains(self.handle))

    @property
    def digest_checked(self) -> bool:
        """Whether every tensor matched the file's content digest (False: the file has none)."""
        return bool(N.llama_ridgefill_maps_digest_checked(self.handle))

    @property
    def placement(self) -> str:
        """``"host"`` (pinned host memory, streamed to the accelerator per layer) or ``"resident"``."""
        return "host" if N.llama_ridgefill_maps_host(self.handle) else "resident"

    @property
    def type(self) -> str:
        """The storage type of the map matrices: ``"f32"``, ``"f16"``, ``"q8_0"``, ``"q4_0"`` or ``"q4_k"``."""
        return N.llama_ridgefill_maps_type(self.handle).decode()

    @property
    def form(self) -> str:
        """``"full"``, ``"identity_low_rank"`` (A = I + U Vᵀ) or ``"low_rank"`` (A = U Vᵀ)."""
        return N.llama_ridgefill_maps_form(self.handle).decode()

    @property
    def buffer_types(self) -> list[str]:
        """The ggml buffer types holding the maps (e.g. ``["CPU"]``, ``["CUDA0"]``, ``["CUDA_Host"]``)."""
        names = N.llama_ridgefill_maps_buffer_types(self.handle).decode()
        return [n for n in names.split(",") if n]

    def predict(self, il: int, xs: np.ndarray) -> np.ndarray:
        """x̂_il for split-layer states ``xs`` [n, n_embd], computed by libllama's fill step."""
        xs = np.ascontiguousarray(xs, dtype=np.float32)
        out = np.empty_like(xs)
        f = ctypes.POINTER(ctypes.c_float)
        rc = N.llama_ridgefill_maps_predict(self.handle, il, xs.ctypes.data_as(f), xs.shape[0], out.ctypes.data_as(f))
        if rc != 0:
            raise ValueError(N.llama_ridgefill_last_error().decode(errors="replace"))
        return out

    def close(self) -> None:
        if self._handle is not None:
            N.llama_ridgefill_maps_free(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
