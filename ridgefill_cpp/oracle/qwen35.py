"""Independent torch reference of llama.cpp's ``qwen35`` forward pass (Gated DeltaNet hybrid).

It reads the same GGUF weights as llama.cpp and reproduces the math of
``src/models/qwen35.cpp`` + ``src/models/delta-net-base.cpp`` and the CPU ops they use
(``ggml_ssm_conv``, ``ggml_gated_delta_net``, ``ggml_rms_norm``, ``ggml_rope_multi`` in IMROPE
mode) -- written from the math, not by translating the graph, so that it can catch mistakes in
RidgeFill's changes to that graph.

Layer ``il`` (``x`` = residual stream entering it, ``u = rms_norm(x) * attn_norm``)::

    h   = x + (GDN(u) if recurrent(il) else GatedAttention(u))
    out = h + FFN(rms_norm(h) * post_attention_norm)          # SwiGLU

Gated DeltaNet (one sequence, rows in position order), split in two parts because RidgeFill's
filled rows run only the first (docs/design.md §4.4):

* **state update** (:func:`gdn_state_update`) -- from the row's normalised input ``u``:
  ``qkv = W_qkv u`` (conv input), ``beta = sigmoid(W_beta u)``,
  ``g = softplus(W_alpha u + dt_bias) * ssm_a`` (``ssm_a = -exp(A_log)`` < 0, so ``exp(g)`` is the
  per-head decay); causal depthwise conv of width ``d_conv`` over ``[conv_state | qkv]`` then
  SiLU; split into ``q, k`` (``n_k_heads`` heads) and ``v`` (``n_v_heads`` heads);
  ``q, k <- x / sqrt(sum(x^2) + eps)`` (L2 norm, eps = the RMS-norm eps); then per value head
  ``h`` (key head ``h % n_k_heads``)::

      S <- exp(g) * S
      S <- S + beta * (v - S k) k^T        # S: [value dim, key dim]

* **output** (:func:`gdn_output`) -- ``o = S q / sqrt(head_dim)`` (S after the row's update),
  ``o <- rms_norm(o) * ssm_norm * silu(z)`` per head with ``z = W_gate u``, ``ssm_out o``.

Gated attention: ``attn_q`` gives ``[q_h | gate_h]`` per head; Q/K RMS norm per head; IMROPE on
the first ``n_rot`` dims (text tokens: the t/h/w positions are all the token position, the 4th
is 0); causal softmax attention with GQA; ``* sigmoid(gate)``; ``attn_output``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .common import (ROPE_NEOX, Oracle, OracleOutput, apply_rope, attention, attention_mask,
                     attention_probs, linear, rms_norm, silu)

ARCH = "qwen35"


# ------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class Qwen35Config:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    rms_eps: float
    # full attention
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_sections: tuple[int, int, int, int]
    rope_freq_base: float
    rope_freq_scale: float
    # Gated DeltaNet
    d_conv: int
    ssm_head_dim: int  # key head dim == value head dim (ssm.state_size)
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    recurrent: tuple[bool, ...]

    @property
    def key_dim(self) -> int:
        return self.ssm_head_dim * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.ssm_head_dim * self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_recurrent(self, il: int) -> bool:
        return self.recurrent[il]

    @classmethod
    def from_gguf(cls, md: dict[str, Any], tensors: dict[str, np.ndarray]) -> "Qwen35Config":
        arch = md.get("general.architecture")
        if arch != ARCH:
            raise ValueError(f"not a {ARCH} model (general.architecture = {arch!r})")

        def key(name: str, default: Any = None) -> Any:
            v = md.get(f"{ARCH}.{name}", default)
            if v is None:
                raise ValueError(f"missing GGUF key {ARCH}.{name}")
            return v

        def scalar(v: Any) -> Any:
            if isinstance(v, list):  # per-layer arrays: the model uses one value here
                if len(set(v)) != 1:
                    raise ValueError(f"per-layer values {v} not supported by the oracle")
                return v[0]
            return v

        n_layer = int(key("block_count")) - int(md.get(f"{ARCH}.nextn_predict_layers", 0) or 0)
        n_embd = int(key("embedding_length"))
        n_head = int(scalar(key("attention.head_count")))
        head_dim = int(md.get(f"{ARCH}.attention.key_length", n_embd // n_head))
        if int(md.get(f"{ARCH}.attention.value_length", head_dim)) != head_dim:
            raise ValueError("qwen35 requires attention.key_length == attention.value_length")
        rec = md.get(f"{ARCH}.attention.recurrent_layers")
        if isinstance(rec, list):
            recurrent = tuple(bool(x) for x in rec[:n_layer])
        else:
            interval = int(md.get(f"{ARCH}.full_attention_interval", 4))
            recurrent = tuple((il + 1) % interval != 0 for il in range(n_layer))
        sections = [int(x) for x in key("rope.dimension_sections")]
        sections = (sections + [0, 0, 0, 0])[:4]
        scale = float(md.get(f"{ARCH}.rope.scaling.factor", 0.0) or 0.0)
        d_state = int(key("ssm.state_size"))
        n_v_heads = int(key("ssm.time_step_rank"))
        if int(key("ssm.inner_size")) != d_state * n_v_heads:
            raise ValueError("ssm.inner_size must equal ssm.state_size * ssm.time_step_rank")
        rope_type = md.get(f"{ARCH}.rope.scaling.type", "none")
        if rope_type not in ("none", "linear"):
            raise ValueError(f"rope scaling {rope_type!r} not supported by the oracle")
        return cls(
            n_vocab=int(tensors["token_embd.weight"].shape[0]),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=int(scalar(key("feed_forward_length"))),
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            n_head=n_head,
            n_head_kv=int(scalar(md.get(f"{ARCH}.attention.head_count_kv", n_head))),
            head_dim=head_dim,
            n_rot=int(md.get(f"{ARCH}.rope.dimension_count", head_dim)),
            rope_sections=tuple(sections),  # type: ignore[arg-type]
            rope_freq_base=float(md.get(f"{ARCH}.rope.freq_base", 10000.0)),
            rope_freq_scale=1.0 / scale if scale else 1.0,
            d_conv=int(key("ssm.conv_kernel")),
            ssm_head_dim=d_state,
            n_k_heads=int(key("ssm.group_count")),
            n_v_heads=n_v_heads,
            recurrent=recurrent,
        )


# ------------------------------------------------------------------------------------------------
# shared pieces


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.cpp's ``build_gdn_l2_norm``: rms_norm(x, eps/n) / sqrt(n) = x / sqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def imrope_angles(positions: np.ndarray, cfg: Qwen35Config) -> np.ndarray:
    """Rotation angles [n_tokens, n_rot/2] of ``ggml_rope_multi`` in IMROPE mode for text tokens.

    Pair ``i`` (dims ``i`` and ``i + n_rot/2``, NeoX layout) is in sector ``i % sum(sections)``;
    sector ``s`` takes the h position if ``s % 3 == 1 and s < 3*sections[1]``, w if
    ``s % 3 == 2 and s < 3*sections[2]``, t if ``s % 3 == 0 and s < 3*sections[0]``, else the 4th
    ("e") position. For text, t = h = w = the token position and e = 0 (llm_graph_input_pos).
    The angle is ``pos * theta_scale^i`` formed as ggml does, by repeated float32 multiplication.
    """
    n_pairs = cfg.n_rot // 2
    sec = cfg.rope_sections
    sect_dims = sum(sec)
    theta_scale = np.float32(cfg.rope_freq_base) ** (np.float32(-2.0) / np.float32(cfg.n_rot))  # powf
    pos = np.asarray(positions, dtype=np.int64)
    pos_thw = pos.astype(np.float32)
    pos_e = np.zeros_like(pos_thw)
    out = np.empty((len(pos), n_pairs), dtype=np.float32)
    th_t = pos_thw.copy()  # theta_t, theta_h, theta_w are equal for text tokens
    th_e = pos_e.copy()
    for i in range(n_pairs):
        s = i % sect_dims
        use_thw = ((s % 3 == 1 and s < 3 * sec[1]) or (s % 3 == 2 and s < 3 * sec[2])
                   or (s % 3 == 0 and s < 3 * sec[0]))
        out[:, i] = th_t if use_thw else th_e
        th_t = (th_t * theta_scale).astype(np.float32)
        th_e = (th_e * theta_scale).astype(np.float32)
    return (out * np.float32(cfg.rope_freq_scale)).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Gated DeltaNet


@dataclass
class GDNState:
    """Recurrent state of one GDN layer for one sequence, in llama.cpp's memory layout.

    ``conv``: [conv_dim, d_conv - 1], the last d_conv-1 conv inputs (``W_qkv u``) per channel,
    oldest first: ``conv.reshape(-1)`` is the layer's row of ``r_l`` (ggml {d_conv-1, conv_dim}).

    ``ssm``: [n_v_heads, D_v, D_k]: head h's state as a [value, key] matrix M, the ``S`` of the
    module docstring (``M <- exp(g) M``, ``M <- M + beta (v - M k) k^T``, readout ``M q``).
    ``ssm.reshape(-1)`` is the layer's row of ``s_l`` (ggml {D_k, D_v, H_v}); ggml's CPU kernel
    comments call the transpose ``S[key][value]`` ("state is stored transposed").
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def zeros(cls, cfg: Qwen35Config, dtype: torch.dtype = torch.float32) -> "GDNState":
        D = cfg.ssm_head_dim
        return cls(conv=torch.zeros(cfg.conv_dim, cfg.d_conv - 1, dtype=dtype),
                   ssm=torch.zeros(cfg.n_v_heads, D, D, dtype=dtype))

    def clone(self) -> "GDNState":
        return GDNState(conv=self.conv.clone(), ssm=self.ssm.clone())


@dataclass
class GDNUpdate:
    """What :func:`gdn_state_update` computed for a run of rows."""

    state: GDNState  # after the last row
    q: torch.Tensor  # [T, n_k_heads, D], L2-normalised queries (the readout needs them)
    row_states: torch.Tensor | None  # [T, n_v_heads, D_v, D_k], ssm state after each row
    beta: torch.Tensor  # [T, n_v_heads]
    g: torch.Tensor  # [T, n_v_heads], log-decay (exp(g) multiplies the state)


def gdn_state_update(lw: dict[str, torch.Tensor], cfg: Qwen35Config, u: torch.Tensor,
                     state: GDNState, *, keep_row_states: bool = True) -> GDNUpdate:
    """The part of a GDN layer that a row contributes to the recurrence.

    ``u`` [T, n_embd]: the rows' normalised inputs (``rms_norm(x) * attn_norm``), in position
    order, continuing ``state``. No z, no gated norm, no ``ssm_out``: a filled row runs only this.
    """
    T = u.shape[0]
    D, H_k, H_v = cfg.ssm_head_dim, cfg.n_k_heads, cfg.n_v_heads
    qkv = u @ lw["attn_qkv.weight"].T  # [T, conv_dim]
    beta = torch.sigmoid(u @ lw["ssm_beta.weight"].T)  # [T, H_v]
    alpha = u @ lw["ssm_alpha.weight"].T + lw["ssm_dt.bias"]
    g = F.softplus(alpha) * lw["ssm_a"]  # softplus has ggml's threshold (x > 20 -> x)

    # causal depthwise conv (ggml_ssm_conv): out[t, c] = sum_k w[c, k] * in[c, t + k] over
    # in = [conv_state | qkv^T]; the new conv state is the last d_conv-1 columns of in
    conv_in = torch.cat([state.conv, qkv.T], dim=1)  # [C, d_conv-1+T]
    windows = conv_in.unfold(1, cfg.d_conv, 1)  # [C, T, d_conv]
    conv_out = torch.einsum("ctk,ck->tc", windows, lw["ssm_conv1d.weight"])
    new_conv = conv_in[:, conv_in.shape[1] - (cfg.d_conv - 1):].clone()
    x = silu(conv_out)

    q = l2_norm(x[:, : cfg.key_dim].reshape(T, H_k, D), cfg.rms_eps)
    k = l2_norm(x[:, cfg.key_dim: 2 * cfg.key_dim].reshape(T, H_k, D), cfg.rms_eps)
    v = x[:, 2 * cfg.key_dim:].reshape(T, H_v, D)
    k_v = k[:, torch.arange(H_v) % H_k]  # value head h reads key head h % H_k (ggml broadcast)

    S = state.ssm.clone()  # [H_v, D_v, D_k]
    rows = torch.empty(T, H_v, D, D, dtype=S.dtype) if keep_row_states else None
    decay = torch.exp(g)
    for t in range(T):
        S = S * decay[t][:, None, None]
        kt = k_v[t]  # [H_v, D_k]
        delta = (v[t] - torch.einsum("hji,hi->hj", S, kt)) * beta[t][:, None]  # [H_v, D_v]
        S = S + delta[:, :, None] * kt[:, None, :]
        if rows is not None:
            rows[t] = S
    return GDNUpdate(state=GDNState(conv=new_conv, ssm=S), q=q, row_states=rows, beta=beta, g=g)


def gdn_output(lw: dict[str, torch.Tensor], cfg: Qwen35Config, u: torch.Tensor,
               upd: GDNUpdate, rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """The output part of a GDN layer for ``rows`` (default: all rows of ``upd``): [len, n_embd].

    ``u`` holds the same rows as were given to :func:`gdn_state_update` (all of them; only
    ``rows`` are used).
    """
    if upd.row_states is None:
        raise ValueError("gdn_output needs the per-row states (keep_row_states=True)")
    idx = torch.arange(u.shape[0]) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    D, H_k, H_v = cfg.ssm_head_dim, cfg.n_k_heads, cfg.n_v_heads
    q_v = upd.q[idx][:, torch.arange(H_v) % H_k]  # [R, H_v, D_k]
    o = torch.einsum("rhji,rhi->rhj", upd.row_states[idx], q_v) / math.sqrt(D)  # [R, H_v, D_v]
    z = (u[idx] @ lw["attn_gate.weight"].T).reshape(-1, H_v, D)
    o = rms_norm(o, lw["ssm_norm.weight"], cfg.rms_eps) * silu(z)
    return o.reshape(-1, H_v * D) @ lw["ssm_out.weight"].T


# ------------------------------------------------------------------------------------------------
# gated full attention


def attn_kv(lw: dict[str, torch.Tensor], cfg: Qwen35Config, u: torch.Tensor,
            angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V path of a full-attention layer from normalised rows ``u`` (what a filled row writes
    to the KV cache): ``K = rope(k_norm(W_k u))``, ``V = W_v u``, each [T, n_head_kv, head_dim]."""
    T, hd = u.shape[0], cfg.head_dim
    k = rms_norm(linear(u, lw["attn_k.weight"]).reshape(T, cfg.n_head_kv, hd), lw["attn_k_norm.weight"], cfg.rms_eps)
    v = linear(u, lw["attn_v.weight"]).reshape(T, cfg.n_head_kv, hd)
    return apply_rope(k, angles, ROPE_NEOX), v


def attn_q(lw: dict[str, torch.Tensor], cfg: Qwen35Config, u: torch.Tensor,
           angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query side of gated attention from normalised rows ``u``: ``attn_q`` rows are
    ``[q_h | gate_h]`` per head; Q gets its RMS norm and RoPE, the gate not.
    Returns (Q [T, n_head, head_dim], gate [T, n_head * head_dim] before the sigmoid)."""
    T, hd, nh = u.shape[0], cfg.head_dim, cfg.n_head
    qg = linear(u, lw["attn_q.weight"]).reshape(T, nh, 2, hd)
    q = apply_rope(rms_norm(qg[:, :, 0], lw["attn_q_norm.weight"], cfg.rms_eps), angles, ROPE_NEOX)
    return q, qg[:, :, 1].reshape(T, nh * hd)


def attn_output(lw: dict[str, torch.Tensor], cfg: Qwen35Config, u: torch.Tensor, angles: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                kv_f16: bool = False) -> torch.Tensor:
    """Gated attention of rows ``u`` (positions ``q_pos``) over cache rows ``k, v`` (``k_pos``).

    ``attn_q`` rows are ``[q_h | gate_h]`` per head; Q gets its RMS norm and RoPE, the gate not.
    Output: ``attn_output((softmax(q k^T / sqrt(hd)) v) * sigmoid(gate))``, [T, n_embd].
    ``kv_f16`` rounds K and V to fp16 first, as llama.cpp's flash-attention path does (it casts an
    F32 cache to F16 before ``ggml_flash_attn_ext``) and as an F16 cache stores them.
    """
    hd = cfg.head_dim
    q, gate = attn_q(lw, cfg, u, angles)
    if kv_f16:
        k = k.to(torch.float16).to(q.dtype)
        v = v.to(torch.float16).to(q.dtype)
    out = attention(q, k, v, attention_mask(q_pos, k_pos), 1.0 / math.sqrt(hd))
    return linear(out * torch.sigmoid(gate), lw["attn_output.weight"])


# ------------------------------------------------------------------------------------------------
# the model


@dataclass
class Qwen35OracleOutput(OracleOutput):
    """:class:`OracleOutput` plus ``gdn_states``: GDN layer -> its :class:`GDNState` after the
    last row (llama.cpp's memory layout). ``keys``/``values`` are None for the GDN layers."""

    gdn_states: dict[int, GDNState] = field(default_factory=dict)


class Qwen35Oracle(Oracle):
    """Exact forward pass of a qwen35 GGUF in torch (CPU), one sequence from position 0.

    ``Qwen35Oracle(path, dtype)`` reads the file; ``Qwen35Oracle(tensors, metadata, dtype=...)``
    (the :func:`~ridgefill_cpp.oracle.load_oracle` convention) takes what
    :func:`read_tensors` / :func:`read_metadata` returned.

    Options:
      kv_f16: round K and V to fp16 inside attention (not in the returned keys/values), to match
        llama.cpp with flash attention on (which casts even an F32 KV cache to F16) or with an F16
        cache. Default False: exact, matches llama.cpp with an F32 cache and flash attention off.
    """

    architectures = (ARCH,)
    #: reads the hyperparameters (qwen35moe's oracle reads its expert keys too)
    config_class: type[Qwen35Config] = Qwen35Config

    def __init__(self, tensors: Mapping[str, np.ndarray] | str | os.PathLike,
                 metadata: Mapping[str, Any] | torch.dtype | None = None,
                 dtype: torch.dtype = torch.float32, *, kv_f16: bool = False):
        if isinstance(metadata, torch.dtype):  # Qwen35Oracle(path, torch.float64)
            dtype, metadata = metadata, None
        if isinstance(tensors, (str, os.PathLike)):
            from ..core.gguf_model import read_metadata, read_tensors

            self.path: str | None = str(tensors)
            metadata = read_metadata(tensors) if metadata is None else metadata
            tensors = read_tensors(tensors)
        else:
            self.path = None
            if metadata is None:
                raise TypeError("Qwen35Oracle(tensors, metadata): metadata is required with a tensor dict")
        super().__init__(tensors, metadata, dtype)
        self.kv_f16 = kv_f16
        self.cfg = self.config_class.from_gguf(self.metadata, tensors)  # type: ignore[arg-type]
        if self.arch == ARCH and any(name.endswith("ffn_gate_inp.weight") for name in tensors):
            raise ValueError("qwen35: mixture-of-experts tensors found (that is qwen35moe); not supported")
        self.tok_embd = self.weight("token_embd.weight")
        self.output_norm = self.weight("output_norm.weight")
        out = self.maybe_weight("output.weight")
        self.output = self.tok_embd if out is None else out
        self.layers: list[dict[str, torch.Tensor]] = [self._layer_weights(il) for il in range(self.cfg.n_layer)]

    def _layer_weights(self, il: int) -> dict[str, torch.Tensor]:
        c, p = self.cfg, f"blk.{il}."
        if c.is_recurrent(il):
            D = c.ssm_head_dim
            want = {"attn_qkv.weight": (c.conv_dim, c.n_embd), "attn_gate.weight": (c.value_dim, c.n_embd),
                    "ssm_conv1d.weight": (c.conv_dim, c.d_conv), "ssm_a": (c.n_v_heads,),
                    "ssm_dt.bias": (c.n_v_heads,), "ssm_beta.weight": (c.n_v_heads, c.n_embd),
                    "ssm_alpha.weight": (c.n_v_heads, c.n_embd), "ssm_norm.weight": (D,),
                    "ssm_out.weight": (c.n_embd, c.value_dim)}
        else:
            hd = c.head_dim
            want = {"attn_q.weight": (2 * hd * c.n_head, c.n_embd), "attn_k.weight": (hd * c.n_head_kv, c.n_embd),
                    "attn_v.weight": (hd * c.n_head_kv, c.n_embd), "attn_q_norm.weight": (hd,),
                    "attn_k_norm.weight": (hd,), "attn_output.weight": (c.n_embd, hd * c.n_head)}
        want.update({"attn_norm.weight": (c.n_embd,), "post_attention_norm.weight": (c.n_embd,)})
        want.update(self._ffn_shapes())
        lw: dict[str, torch.Tensor] = {}
        for name, shape in want.items():
            t = self.weight(p + name)
            if tuple(t.shape) != shape:
                raise ValueError(f"blk.{il}.{name} has shape {tuple(t.shape)}, expected {shape}")
            lw[name] = t
        return lw

    def _ffn_shapes(self) -> dict[str, tuple[int, ...]]:
        """The FFN tensors of every layer and their shapes (the dense SwiGLU)."""
        c = self.cfg
        return {"ffn_gate.weight": (c.n_ff, c.n_embd), "ffn_up.weight": (c.n_ff, c.n_embd),
                "ffn_down.weight": (c.n_embd, c.n_ff)}

    @property
    def n_layer(self) -> int:
        return self.cfg.n_layer

    @property
    def n_head(self) -> int:
        return self.cfg.n_head

    @property
    def n_head_kv(self) -> int:
        return self.cfg.n_head_kv

    def is_recurrent(self, il: int) -> bool:
        return self.cfg.is_recurrent(il)

    # -- pieces usable on their own -------------------------------------------------------------

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.n_vocab):
            raise ValueError(f"token id out of range [0, {self.cfg.n_vocab})")
        return self.tok_embd[ids]

    def attn_norm(self, il: int, x: torch.Tensor) -> torch.Tensor:
        """The layer's input norm: ``u = rms_norm(x) * attn_norm``."""
        return rms_norm(x.to(self.dtype), self.layers[il]["attn_norm.weight"], self.cfg.rms_eps)

    def angles(self, positions: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """IMROPE angles [len, n_rot/2] (float64 of the float32 angles ggml forms)."""
        pos = positions.cpu().numpy() if isinstance(positions, torch.Tensor) else np.asarray(positions)
        return torch.from_numpy(imrope_angles(pos, self.cfg).astype(np.float64))

    def kv_path(self, il: int, x_in: torch.Tensor, positions: Sequence[int] | torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) a full-attention layer writes to its cache for rows with input ``x_in``."""
        if self.cfg.is_recurrent(il):
            raise ValueError(f"layer {il} is a Gated DeltaNet layer: it has no KV cache")
        return attn_kv(self.layers[il], self.cfg, self.attn_norm(il, x_in), self.angles(positions))

    def gdn_update(self, il: int, x_in: torch.Tensor, state: GDNState | None = None, *,
                   keep_row_states: bool = False) -> GDNUpdate:
        """The state update a GDN layer makes for rows with input ``x_in`` (in position order),
        starting from ``state`` (default: zeros, a fresh sequence). What a filled row computes."""
        if not self.cfg.is_recurrent(il):
            raise ValueError(f"layer {il} is a full-attention layer, not Gated DeltaNet")
        state = GDNState.zeros(self.cfg, self.dtype) if state is None else state
        return gdn_state_update(self.layers[il], self.cfg, self.attn_norm(il, x_in), state,
                                keep_row_states=keep_row_states)

    def ffn_block(self, il: int, h: torch.Tensor) -> torch.Tensor:
        """``h + FFN(rms_norm(h) * post_attention_norm)``: the layer's second half (SwiGLU)."""
        lw = self.layers[il]
        y = rms_norm(h, lw["post_attention_norm.weight"], self.cfg.rms_eps)
        y = linear(silu(linear(y, lw["ffn_gate.weight"])) * linear(y, lw["ffn_up.weight"]), lw["ffn_down.weight"])
        return h + y

    def layer_over_cache(self, il: int, x_in: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """Full-attention layer ``il`` for query rows ``x_in`` at ``positions`` attending to the
        cache rows (k, v) at ``k_positions``: everything of the layer but the K/V path (gated Q,
        attention, output projection, FFN). Returns the rows' ``x_out``."""
        if self.cfg.is_recurrent(il):
            raise ValueError(f"layer {il} is a Gated DeltaNet layer: it has no KV cache")
        u = self.attn_norm(il, x_in)
        mix = attn_output(self.layers[il], self.cfg, u, self.angles(positions), k, v, positions, k_positions,
                          self.kv_f16)
        return self.ffn_block(il, x_in + mix)

    def gdn_layer_output(self, il: int, x_in: torch.Tensor, upd: GDNUpdate,
                         rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """GDN layer ``il``'s output ``x_out`` for ``rows`` (default: all) of the run ``x_in`` whose
        state update is ``upd`` (:meth:`gdn_update` with ``keep_row_states=True`` on the same
        ``x_in``): readout, gated norm, ``ssm_out``, residual and FFN."""
        idx = torch.arange(x_in.shape[0]) if rows is None else torch.as_tensor(rows, dtype=torch.long)
        mix = gdn_output(self.layers[il], self.cfg, self.attn_norm(il, x_in), upd, idx)
        return self.ffn_block(il, x_in[idx] + mix)

    def attention_weights(self, il: int, x_q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
                          k_positions: torch.Tensor) -> torch.Tensor:
        """The attention probabilities ``[n_head, n_q, n_k]`` of a full-attention layer's query
        rows with input ``x_q`` over the cache keys ``k`` (the gate is applied after them)."""
        if self.cfg.is_recurrent(il):
            raise ValueError(f"layer {il} is a Gated DeltaNet layer: it has no attention")
        q, _gate = attn_q(self.layers[il], self.cfg, self.attn_norm(il, x_q), self.angles(q_positions))
        k = k.to(torch.float16).to(q.dtype) if self.kv_f16 else k
        return attention_probs(q, k, attention_mask(q_positions, k_positions), 1.0 / math.sqrt(self.cfg.head_dim))

    def layer_forward(self, il: int, x_in: torch.Tensor, positions: torch.Tensor,
                      state: GDNState | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | GDNState]:
        """Run layer ``il`` exactly on rows ``x_in`` (a fresh sequence at ``positions``).

        Returns ``(x_out, kv)`` for a full-attention layer (``kv`` = (K, V)) and
        ``(x_out, final GDN state)`` for a GDN layer (``state`` = the state before the rows).
        """
        if self.cfg.is_recurrent(il):
            upd = self.gdn_update(il, x_in, state, keep_row_states=True)
            return self.gdn_layer_output(il, x_in, upd), upd.state
        k, v = self.kv_path(il, x_in, positions)
        return self.layer_over_cache(il, x_in, positions, k, v, positions), (k, v)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, self.output_norm, self.cfg.rms_eps), self.output)

    # -- forward --------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, tokens: Sequence[int], *, last_only: bool = False) -> Qwen35OracleOutput:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("forward: empty token list")
        positions = torch.arange(len(tokens), dtype=torch.long)
        x = self.embed(tokens)
        inputs: list[torch.Tensor] = []
        keys: list[torch.Tensor | None] = []
        values: list[torch.Tensor | None] = []
        states: dict[int, GDNState] = {}
        for il in range(self.cfg.n_layer):
            inputs.append(x)
            x, extra = self.layer_forward(il, x, positions)
            if isinstance(extra, GDNState):
                states[il] = extra
                keys.append(None)
                values.append(None)
            else:
                keys.append(extra[0])
                values.append(extra[1])
        logits = self.logits(x[-1:] if last_only else x)
        return Qwen35OracleOutput(tokens=tokens, positions=positions, layer_inputs=torch.stack(inputs),
                                  hidden_out=x, logits=logits, keys=keys, values=values, gdn_states=states)
