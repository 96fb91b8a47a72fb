"""Building blocks shared by the oracles: the output record, the base class and the numerics.

Everything here is written from the math, in torch on the CPU, at the dtype the caller picks
(float32 or float64). Where llama.cpp's definition of an operation differs from the textbook one
in a way that shows at the tolerances the tests use, the difference is reproduced on purpose and
says so (RoPE angles, GELU on the CPU backend); nothing else is copied from ggml.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

# llama.cpp's rope types (llama_model_rope_type): which head values a rotation pairs up
ROPE_NORM = "norm"  # consecutive pairs (x[2i], x[2i+1]) - llama
ROPE_NEOX = "neox"  # halves (x[i], x[i + n_rot/2]) - qwen3, gemma3


@dataclass
class OracleOutput:
    """What one exact forward pass over a prompt produced.

    `layer_inputs[l]` is the residual stream entering layer l for every row (layer 0's is the
    embedding, scaled where the architecture scales it). `keys[l]` / `values[l]` are the rows the
    layer writes to its KV cache, ``[n_tokens, n_head_kv, head_dim]`` (keys after k-norm and
    RoPE), or None for a layer without one (recurrent layers).
    """

    tokens: list[int]
    positions: torch.Tensor  # [n_tokens] int64
    layer_inputs: torch.Tensor  # [n_layer, n_tokens, n_embd]
    hidden_out: torch.Tensor  # [n_tokens, n_embd]: the residual stream after the last layer
    logits: torch.Tensor  # [n_tokens, n_vocab], or [1, n_vocab] with last_only
    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)


class Oracle(ABC):
    """An exact forward pass of one model, reading the weights of its GGUF file.

    Subclasses take ``(tensors, metadata, dtype=..., **options)``: `tensors` as
    :func:`ridgefill_cpp.core.gguf_model.read_tensors` returns them (float32 numpy, matrices
    ``[out_features, in_features]``), `metadata` as :func:`read_metadata` does.
    """

    #: ``general.architecture`` values the subclass implements
    architectures: tuple[str, ...] = ()

    def __init__(self, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, Any],
                 dtype: torch.dtype = torch.float32):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"oracle dtype must be torch.float32 or torch.float64, not {dtype}")
        self.arch: str = str(metadata["general.architecture"])
        if self.architectures and self.arch not in self.architectures:
            raise ValueError(f"{type(self).__name__} implements {', '.join(self.architectures)}, not {self.arch!r}")
        self.dtype = dtype
        self.metadata = dict(metadata)
        self._tensors = tensors

    @classmethod
    def from_gguf(cls, path: os.PathLike | str, dtype: torch.dtype = torch.float32, **options: Any) -> "Oracle":
        """Read `path` (weights dequantized to float32) and build the oracle."""
        from ..core.gguf_model import read_metadata, read_tensors

        return cls(read_tensors(path), read_metadata(path), dtype=dtype, **options)

    # -- metadata and weights ------------------------------------------------------------------

    def hparam(self, key: str, default: Any = ...) -> Any:
        """The ``<arch>.<key>`` metadata value (KeyError naming the key when absent and no default)."""
        full = f"{self.arch}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is ...:
            raise KeyError(f"model metadata has no {full!r}")
        return default

    def has(self, name: str) -> bool:
        return name in self._tensors

    def weight(self, name: str) -> torch.Tensor:
        """Tensor `name` as a torch tensor of the oracle's dtype."""
        try:
            arr = self._tensors[name]
        except KeyError:
            raise KeyError(f"model has no tensor {name!r}") from None
        return torch.from_numpy(np.array(arr, dtype=np.float32)).to(self.dtype)  # a writable copy

    def maybe_weight(self, name: str) -> torch.Tensor | None:
        return self.weight(name) if self.has(name) else None

    # -- the forward pass ----------------------------------------------------------------------

    @property
    @abstractmethod
    def n_layer(self) -> int: ...

    def is_recurrent(self, il: int) -> bool:
        """Whether layer `il` is a recurrent (Gated DeltaNet) layer, i.e. has no KV cache."""
        return False

    def attention_window(self, il: int) -> int:
        """Layer `il`'s sliding attention window (0: full attention; keys at q_pos - window or
        further back are invisible). Meaningless for a recurrent layer."""
        return 0

    @abstractmethod
    def forward(self, tokens: Sequence[int], *, last_only: bool = False) -> OracleOutput:
        """Run `tokens` (positions 0..n-1) through every layer; see :class:`OracleOutput`."""


# ------------------------------------------------------------------------------------------------
# numerics


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dimension (ggml_rms_norm + ggml_mul).

    The weight is used as stored: GGUF conversion already folded Gemma's ``1 + w``.
    """
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ + bias`` with weight ``[out_features, in_features]``."""
    y = x @ weight.T
    return y if bias is None else y + bias


def rope_angles(positions: torch.Tensor, n_rot: int, freq_base: float, freq_scale: float = 1.0,
                freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE angles ``[n_tokens, n_rot/2]``: ``θ_i = p · freq_scale · base^(-2i/n_rot) / ff_i``.

    Computed the way ggml defines them, in float32 with the running product
    ``θ_{i+1} = θ_i · base^(-2/n_rot)`` (ggml_rope_cache_init), not as a float64 power: the two
    differ by ~i·1e-7 relative, which at position 2000 is already ~1e-3 rad. Returned as float64.
    """
    theta_scale = np.float32(freq_base) ** np.float32(np.float32(-2.0) / np.float32(n_rot))
    theta = positions.detach().cpu().numpy().astype(np.float32)
    out = np.empty((theta.shape[0], n_rot // 2), dtype=np.float32)
    for i in range(n_rot // 2):
        out[:, i] = theta
        theta = theta * theta_scale
    if freq_factors is not None:
        out = out / freq_factors.detach().cpu().numpy().astype(np.float32)[None, :]
    out = out * np.float32(freq_scale)
    return torch.from_numpy(out.astype(np.float64))


def apply_rope(x: torch.Tensor, angles: torch.Tensor, mode: str) -> torch.Tensor:
    """Rotate ``x [n_tokens, n_heads, head_dim]`` by ``angles [n_tokens, n_rot/2]``.

    ``mode`` is :data:`ROPE_NORM` (pairs ``(2i, 2i+1)``) or :data:`ROPE_NEOX` (pairs
    ``(i, i + n_rot/2)``); head dimensions past ``n_rot`` pass through unrotated.
    """
    n_rot = 2 * angles.shape[-1]
    cos = torch.cos(angles).to(x.dtype)[:, None, :]
    sin = torch.sin(angles).to(x.dtype)[:, None, :]
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if mode == ROPE_NORM:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        y = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    elif mode == ROPE_NEOX:
        x0, x1 = rot[..., : n_rot // 2], rot[..., n_rot // 2:]
        y = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        raise ValueError(f"unknown rope mode {mode!r}")
    return torch.cat((y, rest), dim=-1)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """``[n_q, n_k]`` boolean: may query at q_pos see key at k_pos (causal, optional window).

    The window is llama.cpp's LLAMA_SWA_TYPE_STANDARD: a key is visible while
    ``q_pos - k_pos < window`` (the row itself and the window-1 before it).
    """
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window > 0:
        allowed &= diff < window
    return allowed


def _kv_group(n_head: int, n_head_kv: int) -> int:
    if n_head % n_head_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    return n_head // n_head_kv


def attention_probs(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention probabilities ``[n_head, n_q, n_k]``: ``softmax(q kᵀ · scale + mask)``.

    ``q [n_q, n_head, d]``, ``k [n_k, n_head_kv, d]``; query head h reads KV head
    ``h // (n_head / n_head_kv)`` (ggml's broadcast in mul_mat). Each query row's probabilities
    over the keys it may see sum to 1 per head (RidgeFill's attention selector sums them).
    """
    k = k.repeat_interleave(_kv_group(q.shape[1], k.shape[1]), dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Softmax attention with grouped-query heads.

    ``q [n_q, n_head, d]``, ``k``/``v`` ``[n_k, n_head_kv, d]``; query head h reads KV head
    ``h // (n_head / n_head_kv)`` (ggml's broadcast in mul_mat). Returns ``[n_q, n_head * d_v]``.
    """
    probs = attention_probs(q, k, allowed, scale)
    v = v.repeat_interleave(_kv_group(q.shape[1], v.shape[1]), dim=1)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out.reshape(out.shape[0], -1)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


_GELU_A = 0.044715
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + _GELU_A * x * x)))


def gelu_tanh_ggml_cpu(x: torch.Tensor) -> torch.Tensor:
    """GELU as llama.cpp's CPU backend evaluates it (GGML_GELU_FP16 in ggml-cpu/vec.h).

    For -10 < x < 10 the input is rounded to fp16 and the result read from a table of
    fp16-rounded ``gelu_tanh`` values; outside, 0 or x. This is a ~1e-3 relative deviation from
    :func:`gelu_tanh`, which the CUDA backend computes instead.
    """
    x16 = x.to(torch.float16).to(torch.float32)
    table = gelu_tanh(x16).to(torch.float16).to(x.dtype)
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))
