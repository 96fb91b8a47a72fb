"""Per-layer hidden states from llama.cpp itself (the same numerics as at run time).

Used by the oracle tests and by calibration: the input of every requested layer (the residual
stream entering it) for every prompt row, read back through RidgeFill's capture entry points.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from llama_cpp import llama_cpp as C

from ..core.native import llama_ridgefill_capture_layer_input, llama_ridgefill_get_layer_input
from ..runtime.prefill import Llama

GGML_TYPE_F32 = 0


@dataclass
class CaptureResult:
    layers: list[int]
    layer_inputs: np.ndarray  # [len(layers), n_tokens, n_embd] float32
    logits: np.ndarray  # [n_vocab] float32, the last row
    all_logits: np.ndarray | None = None  # [n_tokens, n_vocab] when asked for


def open_model(model_path: str | os.PathLike, *, n_ctx: int, n_batch: int, n_ubatch: int | None = None,
               kv_f32: bool = True, flash_attn: bool = True, n_threads: int | None = None, n_gpu_layers: int = 0,
               **kwargs):
    """A llama-cpp-python ``Llama`` on the patched library, quiet, ready for capture (``ridgefill=...``
    in `kwargs` attaches RidgeFill, :class:`ridgefill_cpp.runtime.prefill.Llama`). ``n_gpu_layers``:
    the layers offloaded to a GPU, as llama.cpp's ``-ngl`` (-1: all; a build without a GPU backend
    runs them on the CPU); a captured layer input is copied to the host wherever it was computed."""
    return Llama(
        model_path=str(model_path),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_ubatch or n_batch,
        type_k=GGML_TYPE_F32 if kv_f32 else None,
        type_v=GGML_TYPE_F32 if kv_f32 else None,
        flash_attn=flash_attn,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        n_gpu_layers=n_gpu_layers,
        verbose=False,
        **kwargs,
    )


def capture_layer_inputs(
    model_path: str | os.PathLike,
    tokens: Sequence[int],
    *,
    layers: Sequence[int] | None = None,
    n_ctx: int | None = None,
    chunk: int | None = None,
    n_ubatch: int | None = None,
    kv_f32: bool = True,
    flash_attn: bool = True,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    all_logits: bool = False,
) -> CaptureResult:
    """Run ``tokens`` through llama.cpp and return the inputs of ``layers`` (default: all) for every row.

    The prompt is decoded in calls of ``chunk`` rows (default: one call), each split into ubatches
    of ``n_ubatch`` rows, so callers can check that chunking does not change the result.
    ``all_logits`` also returns the logits of every row.
    """
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("capture_layer_inputs: empty token list")
    chunk = chunk or len(tokens)
    n_ctx = n_ctx or max(64, len(tokens))
    if len(tokens) > n_ctx:
        raise ValueError(f"capture_layer_inputs: {len(tokens)} tokens do not fit the context ({n_ctx})")
    llm = open_model(model_path, n_ctx=n_ctx, n_batch=chunk, n_ubatch=min(n_ubatch or chunk, chunk),
                     kv_f32=kv_f32, flash_attn=flash_attn, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                     logits_all=all_logits)
    try:
        ctx = llm._ctx.ctx

        n_layer = C.llama_model_n_layer(llm._model.model)
        n_embd = C.llama_model_n_embd(llm._model.model)
        layers = list(range(n_layer)) if layers is None else [int(il) for il in layers]
        for il in layers:
            if llama_ridgefill_capture_layer_input(ctx, il, True) != 0:
                raise ValueError(f"layer {il} out of range [0, {n_layer}]")
        out = np.empty((len(layers), len(tokens), n_embd), dtype=np.float32)
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            llm.eval(part)
            for k, il in enumerate(layers):
                ptr = llama_ridgefill_get_layer_input(ctx, il)
                if not ptr:
                    raise RuntimeError(f"llama.cpp returned no input for layer {il}")
                buf = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(len(part), n_embd))
                out[k, start:start + len(part)] = buf
        logits_ptr = C.llama_get_logits_ith(ctx, -1)
        n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(llm._model.model))
        logits = np.ctypeslib.as_array(logits_ptr, shape=(n_vocab,)).copy()
        every = np.array(llm.scores[: len(tokens)], dtype=np.float32) if all_logits else None
        return CaptureResult(layers=layers, layer_inputs=out, logits=logits, all_logits=every)
    finally:
        llm.close()
