"""Map files loaded into libllama for one model: a thin owner of ``llama_ridgefill_maps``.

The C loader checks the file against the model (type, format version, architecture, n_layer,
n_embd, split, the range of its metadata numbers, mapped layers, tensor shapes and types, each
tensor's content digest, finite values) and, given the model's file, the fingerprint of the model
the maps were fitted on.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from ..core import native as N
from ..core.limits import check_c_string
from ..maps.mapfile import MapFileError


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
