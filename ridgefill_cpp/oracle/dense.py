"""Exact forward pass of the dense transformer architectures: llama, qwen3, gemma3.

One layer, written out (``layer_forward``)::

    h      = attn_norm(x_in)
    q      = Wq h (+bq)  → q-norm (qwen3, gemma3) → RoPE(position, layer's base)
    k, v   = kv_path(layer, x_in, positions)     # attn_norm → Wk, Wv (+bk, bv) → k-norm → RoPE
    a      = Wo · softmax(q kᵀ · scale + mask) v (+bo)   # causal; gemma3 SWA layers: window
    a      = attn_post_norm(a)                    # gemma3 only
    x_mid  = x_in + a
    f      = down(act(gate(ffn_norm(x_mid))) * up(ffn_norm(x_mid)))  # SiLU; gemma3 GELU-tanh
    f      = ffn_post_norm(f)                     # gemma3 only
    x_out  = x_mid + f

and around the layers: the embedding (gemma3: times sqrt(n_embd)), then output_norm, the output
head (``output.weight``, or ``token_embd.weight`` when the model ties them) and, for gemma3, the
final-logit softcap ``c·tanh(logits/c)``.

The conventions are llama.cpp's (src/models/{llama,qwen3,gemma3}.cpp at the pinned commit):
RoPE mode from ``llama_model_rope_type`` (llama: pairs of consecutive values; qwen3/gemma3: NEOX
halves), gemma3's attention scale ``1/sqrt(head_dim)`` applied to q (``1/sqrt(n_embd/n_head)``
for the 62-layer 27B) and its sliding-window layers from ``load_swa_pattern`` with their own RoPE
base, norm weights used as stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .common import (
    ROPE_NEOX,
    ROPE_NORM,
    Oracle,
    OracleOutput,
    apply_rope,
    attention,
    attention_mask,
    attention_probs,
    gelu_tanh,
    gelu_tanh_ggml_cpu,
    linear,
    rms_norm,
    rope_angles,
    silu,
)

DENSE_ARCHITECTURES = ("llama", "qwen3", "gemma3")

_ROPE_MODE = {"llama": ROPE_NORM, "qwen3": ROPE_NEOX, "gemma3": ROPE_NEOX}


@dataclass(frozen=True)
class DenseHParams:
    """The hyperparameters the forward pass uses, resolved the way llama.cpp resolves them."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_vocab: int
    rms_eps: float
    rope_mode: str
    attn_scale: float  # multiplies q·k
    embd_scale: float  # multiplies the token embedding (gemma3: sqrt(n_embd))
    final_logit_softcap: float  # 0: none
    ffn_act: str  # "silu" or "gelu"
    sandwich_norms: bool  # gemma3's attn_post_norm / ffn_post_norm
    # per layer
    rope_base: tuple[float, ...]
    rope_scale: tuple[float, ...]  # freq_scale = 1 / rope scaling factor
    window: tuple[int, ...]  # sliding window (0: full attention)

    def is_swa(self, il: int) -> bool:
        return self.window[il] > 0


def _swa_flags(oracle: Oracle, n_layer: int, default_pattern: int) -> list[bool]:
    """llama.cpp's load_swa_pattern: a bool array, or every n-th layer full (dense_first=False)."""
    pattern = oracle.hparam("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (list, tuple)):
        return [bool(p) for p in pattern[:n_layer]]
    n = int(pattern)
    return [n == 0 or (il % n) < (n - 1) for il in range(n_layer)]


def resolve_sizes(o: Oracle) -> tuple[int, int, int, int, int, int]:
    """``(n_layer, n_embd, n_head, n_head_kv, key_length, value_length)`` as llama.cpp's loader reads
    them: the KV heads default to the query heads, both head sizes to ``n_embd / n_head``; per-layer
    head counts (arrays) are refused. The dense, more-dense and gpt-oss oracles share it."""
    n_layer = int(o.hparam("block_count"))
    n_embd = int(o.hparam("embedding_length"))
    n_head = o.hparam("attention.head_count")
    n_head_kv = o.hparam("attention.head_count_kv", n_head)
    if isinstance(n_head, list) or isinstance(n_head_kv, list):
        raise ValueError(f"{o.arch}: per-layer head counts are not supported by the oracle")
    n_head, n_head_kv = int(n_head), int(n_head_kv)
    head_dim_k = int(o.hparam("attention.key_length", n_embd // n_head))
    head_dim_v = int(o.hparam("attention.value_length", n_embd // n_head))
    return n_layer, n_embd, n_head, n_head_kv, head_dim_k, head_dim_v


def resolve_rope_scaling(o: Oracle, supported: tuple[str, ...]) -> tuple[str, float]:
    """``rope.scaling.type`` (llama.cpp's default ``"linear"``), refused unless in `supported`, and
    the scaling factor (``rope.scaling.factor``, else the older ``rope.scale_linear``; 0: none)."""
    scaling = str(o.hparam("rope.scaling.type", "linear"))
    if scaling not in supported:
        raise ValueError(f"{o.arch}: rope scaling {scaling!r} is not supported by the oracle")
    factor = float(o.hparam("rope.scaling.factor", 0.0) or o.hparam("rope.scale_linear", 0.0) or 0.0)
    return scaling, factor


def _resolve_hparams(o: Oracle, n_vocab: int) -> DenseHParams:
    arch = o.arch
    n_layer, n_embd, n_head, n_head_kv, head_dim, head_dim_v = resolve_sizes(o)
    if head_dim_v != head_dim:
        raise ValueError(f"{arch}: key_length {head_dim} != value_length {head_dim_v} is not supported")
    n_rot = int(o.hparam("rope.dimension_count", head_dim))
    if n_rot != head_dim:  # all three graphs assert n_rot == n_embd_head
        raise ValueError(f"{arch}: rope.dimension_count {n_rot} != head_dim {head_dim}")

    _, factor = resolve_rope_scaling(o, ("none", "linear"))
    freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    freq_base = float(o.hparam("rope.freq_base", 10000.0))

    rope_base = [freq_base] * n_layer
    rope_scale = [freq_scale] * n_layer
    window = [0] * n_layer
    attn_scale = 1.0 / math.sqrt(head_dim)
    embd_scale = 1.0
    softcap = 0.0
    ffn_act = "silu"
    sandwich = False

    if arch == "gemma3":
        n_swa = int(o.hparam("attention.sliding_window", 0) or 0)
        if n_swa > 0:
            base_swa = float(o.hparam("rope.freq_base_swa", 10000.0))
            for il, swa in enumerate(_swa_flags(o, n_layer, default_pattern=6)):
                if swa:
                    window[il] = n_swa
                    rope_base[il] = base_swa
                    rope_scale[il] = 1.0  # rope_freq_scale_train_swa: never read for gemma3
        if n_layer == 62:  # LLM_TYPE_27B: query_pre_attn_scalar = n_embd / n_head
            attn_scale = 1.0 / math.sqrt(n_embd // n_head)
        # ggml_scale(inpL, sqrtf(n_embd)): the float32 square root
        embd_scale = float(np.sqrt(np.float32(n_embd)))
        softcap = float(o.hparam("final_logit_softcapping", 0.0) or 0.0)
        ffn_act = "gelu"
        sandwich = True

    return DenseHParams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_rot=n_rot, n_vocab=n_vocab,
        rms_eps=float(o.hparam("attention.layer_norm_rms_epsilon")),
        rope_mode=_ROPE_MODE[arch], attn_scale=attn_scale, embd_scale=embd_scale,
        final_logit_softcap=softcap, ffn_act=ffn_act, sandwich_norms=sandwich,
        rope_base=tuple(rope_base), rope_scale=tuple(rope_scale), window=tuple(window),
    )


@dataclass
class AttentionInputWeights:
    """A layer's attention pre-norm and Q/K/V projections (torch, the oracle's dtype; a bias is None
    when absent): the first fields of every oracle's layer weights that :class:`DenseOracle`'s
    q/k/v pieces read."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None


@dataclass
class DenseLayerWeights(AttentionInputWeights):
    """One layer's tensors (torch, the oracle's dtype): :class:`AttentionInputWeights`' fields, then
    these. Optional ones are None when absent."""

    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    attn_post_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    ffn_gate: torch.Tensor
    ffn_up: torch.Tensor
    ffn_down: torch.Tensor
    ffn_gate_b: torch.Tensor | None
    ffn_up_b: torch.Tensor | None
    ffn_down_b: torch.Tensor | None
    ffn_post_norm: torch.Tensor | None
    rope_freqs: torch.Tensor | None  # llama 3 rope frequency factors


class DenseOracle(Oracle):
    """The exact forward pass of a llama / qwen3 / gemma3 GGUF (see the module docstring).

    Options:
      gelu_fp16_table: evaluate gemma3's GELU as llama.cpp's CPU backend does, through its fp16
        table (default True: the tests compare with the CPU backend). False gives the exact
        tanh formula, which the CUDA backend computes; the two differ by ~1e-3 relative.
    """

    architectures = DENSE_ARCHITECTURES

    def __init__(self, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, Any],
                 dtype: torch.dtype = torch.float32, *, gelu_fp16_table: bool = True):
        super().__init__(tensors, metadata, dtype)
        if any(name.endswith("ffn_gate_inp.weight") for name in tensors):
            raise ValueError(f"{self.arch}: mixture-of-experts models are not supported by the oracle")
        self.tok_embd = self.weight("token_embd.weight")  # [n_vocab, n_embd]
        self.hp = _resolve_hparams(self, n_vocab=self.tok_embd.shape[0])
        self.gelu_fp16_table = gelu_fp16_table
        self.output_norm = self.weight("output_norm.weight")
        # no output.weight: the head is tied to the embedding (llama.cpp's TENSOR_DUPLICATED)
        self.output = self.maybe_weight("output.weight")
        self.tied_embeddings = self.output is None
        if self.output is None:
            self.output = self.tok_embd
        self.layers = [self._layer_weights(il) for il in range(self.hp.n_layer)]

    def _layer_weights(self, il: int) -> DenseLayerWeights:
        p = f"blk.{il}."
        w, mw = self.weight, self.maybe_weight
        hp = self.hp
        n_q, n_kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        if self.has(p + "attn_qkv.weight"):  # fused projection: rows [q | k | v]
            wq, wk, wv = torch.split(w(p + "attn_qkv.weight"), [n_q, n_kv, n_kv], dim=0)
            if self.has(p + "attn_qkv.bias"):
                bq, bk, bv = torch.split(w(p + "attn_qkv.bias"), [n_q, n_kv, n_kv], dim=0)
            else:
                bq, bk, bv = mw(p + "attn_q.bias"), mw(p + "attn_k.bias"), mw(p + "attn_v.bias")
        else:
            wq, wk, wv = w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")
            bq, bk, bv = mw(p + "attn_q.bias"), mw(p + "attn_k.bias"), mw(p + "attn_v.bias")
        qk_norm = self.arch in ("qwen3", "gemma3")
        rope_freqs = mw("rope_freqs.weight") if self.arch == "llama" else None
        return DenseLayerWeights(
            attn_norm=w(p + "attn_norm.weight"),
            wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv,
            q_norm=w(p + "attn_q_norm.weight") if qk_norm else None,
            k_norm=w(p + "attn_k_norm.weight") if qk_norm else None,
            wo=w(p + "attn_output.weight"),
            bo=mw(p + "attn_output.bias") if self.arch == "llama" else None,
            attn_post_norm=w(p + "post_attention_norm.weight") if self.hp.sandwich_norms else None,
            ffn_norm=w(p + "ffn_norm.weight"),
            ffn_gate=w(p + "ffn_gate.weight"),
            ffn_up=w(p + "ffn_up.weight"),
            ffn_down=w(p + "ffn_down.weight"),
            ffn_gate_b=mw(p + "ffn_gate.bias") if self.arch == "llama" else None,
            ffn_up_b=mw(p + "ffn_up.bias") if self.arch == "llama" else None,
            ffn_down_b=mw(p + "ffn_down.bias") if self.arch == "llama" else None,
            ffn_post_norm=w(p + "post_ffw_norm.weight") if self.hp.sandwich_norms else None,
            rope_freqs=rope_freqs,
        )

    @property
    def n_layer(self) -> int:
        return self.hp.n_layer

    @property
    def n_head(self) -> int:
        return self.hp.n_head

    @property
    def n_head_kv(self) -> int:
        return self.hp.n_head_kv

    def attention_window(self, il: int) -> int:
        return self.hp.window[il]

    # -- pieces of a layer ------------------------------------------------------------------------

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Layer 0's input ``[n_tokens, n_embd]``: embedding rows (gemma3: times sqrt(n_embd))."""
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.hp.n_vocab):
            raise ValueError(f"token id out of range [0, {self.hp.n_vocab})")
        x = self.tok_embd[ids]
        return x * self.hp.embd_scale if self.hp.embd_scale != 1.0 else x

    def _rope(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        angles = rope_angles(positions, hp.n_rot, hp.rope_base[il], hp.rope_scale[il],
                             self.layers[il].rope_freqs)
        return apply_rope(x, angles, hp.rope_mode)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.reshape(x.shape[0], n_heads, self.hp.head_dim)

    def q_path(self, il: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Queries ``[n, n_head, head_dim]`` from the attn-normed input `h`: proj → q-norm → RoPE."""
        L, hp = self.layers[il], self.hp
        q = self._heads(linear(h, L.wq, L.bq), hp.n_head)
        if L.q_norm is not None:
            q = rms_norm(q, L.q_norm, hp.rms_eps)
        return self._rope(il, q, positions)

    def kv_from_normed(self, il: int, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) ``[n, n_head_kv, head_dim]`` from the attn-normed input `h`."""
        L, hp = self.layers[il], self.hp
        k = self._heads(linear(h, L.wk, L.bk), hp.n_head_kv)
        v = self._heads(linear(h, L.wv, L.bv), hp.n_head_kv)
        if L.k_norm is not None:
            k = rms_norm(k, L.k_norm, hp.rms_eps)
        return self._rope(il, k, positions), v

    def kv_path(self, il: int, x_in: torch.Tensor, positions: Sequence[int] | torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """What layer `il` writes to its KV cache for rows with input `x_in` at `positions`.

        ``attn_norm → K, V projections (+biases) → k-norm (qwen3, gemma3) → RoPE on K`` with the
        layer's own RoPE parameters. Returns (K, V), each ``[n, n_head_kv, head_dim]``.
        `x_in` may be any input, e.g. a predicted one (RidgeFill's filled rows).
        """
        positions = torch.as_tensor(positions, dtype=torch.long)
        x_in = x_in.to(self.dtype)
        h = rms_norm(x_in, self.layers[il].attn_norm, self.hp.rms_eps)
        return self.kv_from_normed(il, h, positions)

    def attend(self, il: int, q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_positions: torch.Tensor) -> torch.Tensor:
        """Layer `il`'s attention of queries at `q_positions` over the cache rows (k, v) at
        `k_positions`: causal, within the layer's window, then the output projection.
        Returns ``[n_q, n_embd]`` (before gemma3's attn_post_norm)."""
        L, hp = self.layers[il], self.hp
        allowed = attention_mask(q_positions, k_positions, hp.window[il])
        out = attention(q, k, v, allowed, hp.attn_scale)
        return linear(out, L.wo, L.bo)

    def attention_weights(self, il: int, x_q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
                          k_positions: torch.Tensor) -> torch.Tensor:
        """The attention probabilities ``[n_head, n_q, n_k]`` of query rows with input `x_q` over
        the cache keys `k` (what :meth:`attend` weights the values with)."""
        h = rms_norm(x_q.to(self.dtype), self.layers[il].attn_norm, self.hp.rms_eps)
        q = self.q_path(il, h, q_positions)
        allowed = attention_mask(q_positions, k_positions, self.hp.window[il])
        return attention_probs(q, k, allowed, self.hp.attn_scale)

    def ffn(self, il: int, x_mid: torch.Tensor) -> torch.Tensor:
        """The feed-forward block on the post-attention residual (norm → gated MLP → post-norm)."""
        L, hp = self.layers[il], self.hp
        h = rms_norm(x_mid, L.ffn_norm, hp.rms_eps)
        gate = linear(h, L.ffn_gate, L.ffn_gate_b)
        up = linear(h, L.ffn_up, L.ffn_up_b)
        if hp.ffn_act == "gelu":
            act = gelu_tanh_ggml_cpu(gate) if self.gelu_fp16_table else gelu_tanh(gate)
        else:
            act = silu(gate)
        f = linear(act * up, L.ffn_down, L.ffn_down_b)
        if L.ffn_post_norm is not None:
            f = rms_norm(f, L.ffn_post_norm, hp.rms_eps)
        return f

    def layer_over_cache(self, il: int, x_in: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """Layer `il` for query rows `x_in` at `positions` attending to the cache rows (k, v) at
        `k_positions`: everything of the layer but the K/V path. Returns the rows' ``x_out``.

        :meth:`layer_forward` is this over the rows' own K/V; RidgeFill's exact rows run it over
        a cache that also holds filled rows.
        """
        L, hp = self.layers[il], self.hp
        h = rms_norm(x_in, L.attn_norm, hp.rms_eps)
        q = self.q_path(il, h, positions)
        a = self.attend(il, q, positions, k, v, k_positions)
        if L.attn_post_norm is not None:
            a = rms_norm(a, L.attn_post_norm, hp.rms_eps)
        x_mid = x_in + a
        return x_mid + self.ffn(il, x_mid)

    def layer_forward(self, il: int, x_in: torch.Tensor, positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run layer `il` exactly on rows `x_in` (all attending to each other causally).

        Returns ``(x_out, K, V)``: the next layer's input and the rows' KV cache entries.
        """
        k, v = self.kv_path(il, x_in, positions)
        return self.layer_over_cache(il, x_in, positions, k, v, positions), k, v

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head on residual rows `x`: output_norm → output → (gemma3) softcap."""
        hp = self.hp
        y = linear(rms_norm(x, self.output_norm, hp.rms_eps), self.output)
        if hp.final_logit_softcap:
            c = hp.final_logit_softcap
            y = c * torch.tanh(y / c)
        return y

    # -- the whole prompt -------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, tokens: Sequence[int], *, last_only: bool = False) -> OracleOutput:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("forward: empty token list")
        positions = torch.arange(len(tokens), dtype=torch.long)
        x = self.embed(tokens)
        inputs, keys, values = [], [], []
        for il in range(self.hp.n_layer):
            inputs.append(x)
            x, k, v = self.layer_forward(il, x, positions)
            keys.append(k)
            values.append(v)
        logits = self.logits(x[-1:] if last_only else x)
        return OracleOutput(tokens=tokens, positions=positions, layer_inputs=torch.stack(inputs),
                            hidden_out=x, logits=logits, keys=keys, values=values)
