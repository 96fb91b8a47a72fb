"""Independent torch reference implementations of the models RidgeFill supports (the test oracle).

Each oracle reads the same GGUF weights as llama.cpp and computes the exact forward pass from the
math, so that llama.cpp's hidden states and logits (and later RidgeFill's filled KV-cache rows,
docs/design.md §4) can be checked against it. The layer structure is explicit: a layer's K/V path
(:meth:`DenseOracle.kv_path`) can be called on any input, e.g. a predicted one.

    from ridgefill_cpp.oracle import load_oracle
    out = load_oracle("model.gguf").forward(tokens)
    out.layer_inputs  # [n_layer, n_tokens, n_embd]
    out.logits        # [n_tokens, n_vocab]

RidgeFill's filled-row prefill (docs/design.md §4) and the attention selector (§5) on top of an oracle,
the reference the C++ implementation is checked against, are in :mod:`.fill`::

    from ridgefill_cpp.oracle.fill import fill_forward, select_attention_rows
    rows = select_attention_rows(oracle, tokens, split=S, tail=T)
    out = fill_forward(oracle, tokens, split=S, maps=maps, tail=T, exact_positions=rows)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .common import Oracle, OracleOutput
from .dense import DENSE_ARCHITECTURES, DenseOracle
from .dense_more import MORE_ARCHITECTURES, MoreDenseOracle
from .fill import FillOutput, fill_forward

#: general.architecture values an oracle exists for
SUPPORTED_ARCHITECTURES = (*DENSE_ARCHITECTURES, "qwen35", *MORE_ARCHITECTURES, "qwen35moe", "gpt-oss")


def oracle_class(arch: str) -> type[Oracle]:
    """The oracle class for a ``general.architecture`` value (ValueError naming the supported ones)."""
    if arch in DENSE_ARCHITECTURES:
        return DenseOracle
    if arch in MORE_ARCHITECTURES:
        return MoreDenseOracle
    if arch == "qwen35":
        from .qwen35 import Qwen35Oracle  # noqa: PLC0415 (imported only when needed)

        return Qwen35Oracle
    if arch == "qwen35moe":
        from .qwen35moe import Qwen35MoeOracle  # noqa: PLC0415 (imported only when needed)

        return Qwen35MoeOracle
    if arch == "gpt-oss":
        from .gpt_oss import GptOssOracle  # noqa: PLC0415 (imported only when needed)

        return GptOssOracle
    raise ValueError(
        f"no oracle for architecture {arch!r}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def load_oracle(path: os.PathLike | str, dtype: torch.dtype = torch.float32, **options: Any) -> Oracle:
    """Build the oracle for the model GGUF at `path`, dispatching on ``general.architecture``.

    `dtype` is the computation dtype (torch.float32 or torch.float64); `options` go to the
    oracle class (e.g. ``gelu_fp16_table=False`` for :class:`DenseOracle`).
    """
    from ..core.gguf_model import read_metadata, read_tensors

    metadata = read_metadata(path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: no general.architecture key: not a model GGUF")
    cls = oracle_class(arch)
    return cls(read_tensors(path), metadata, dtype=dtype, **options)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DenseOracle",
    "MoreDenseOracle",
    "FillOutput",
    "Oracle",
    "OracleOutput",
    "fill_forward",
    "load_oracle",
    "oracle_class",
]
