"""Independent torch reference of llama.cpp's ``qwen35moe`` forward pass (the Qwen3.5 MoE hybrid).

``src/models/qwen35moe.cpp`` is ``qwen35.cpp`` with another FFN: the Gated DeltaNet layers, the
gated full-attention layers (their Q projection also carries the output gate; Q/K RMS norms;
IMROPE), the norms and the residuals are the same, so everything but the FFN is
:class:`~ridgefill_cpp.oracle.qwen35.Qwen35Oracle`'s. The FFN of every layer is
``build_layer_ffn``: ``build_moe_ffn`` with softmax gating, top-k, renormalised weights, plus a
shared expert with a sigmoid gate. Written from the math, as the other oracles are.

Layer ``il`` (``x`` = residual stream entering it)::

    h   = x + (GDN(u) if recurrent(il) else GatedAttention(u))       # u = rms_norm(x) * attn_norm
    y   = rms_norm(h) * post_attention_norm
    out = h + (MoE(y) + sigmoid(w_shexp_gate · y) * SwiGLU_shexp(y))

    MoE(y): p = softmax(W_router y)                       # [n_expert]
            E = the n_expert_used largest p_e             # ggml_argsort_top_k
            w_e = p_e / max(sum_{e' in E} p_e', 6.1e-5)  # norm_w = true (the clamp: F16's smallest normal)
            MoE(y) = sum_{e in E} w_e * down_e(silu(gate_e y) * up_e y)

What llama.cpp reads, and so does this oracle: ``expert_count``, ``expert_used_count``,
``expert_feed_forward_length`` (default ``feed_forward_length / expert_used_count``),
``expert_shared_feed_forward_length`` (default ``feed_forward_length``); the experts' gate and up
as ``ffn_gate_exps`` + ``ffn_up_exps`` or one merged ``ffn_gate_up_exps`` (``[gate | up]`` rows
per expert). The gating function (softmax), the renormalisation (on) and the weight scale (none)
are fixed by the builder: ``expert_gating_func``, ``expert_weights_norm`` and
``expert_weights_scale`` keys are not read for this architecture, so neither are they here.
``expert_group_count`` > 1 (grouped routing) is refused. The loader requires the shared expert.

A full-attention layer may also store its projections as one ``attn_qkv`` (``[q and gate | k | v]``
rows, llama.cpp's ``create_tensor_qkv`` / ``build_qkv``); the oracle splits it into the same
``attn_q``, ``attn_k``, ``attn_v`` rows. Attention biases (optional in the loader, absent from the
converted models) are refused rather than ignored.

For RidgeFill (docs/design.md §4): a filled row runs only the K/V path of an attention layer or
the state update of a GDN layer (``kv_path``, ``gdn_update``), never :meth:`ffn_block`, so it
never reaches the router or an expert; :func:`~ridgefill_cpp.oracle.fill.fill_forward` works
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from .common import linear, rms_norm, silu
from .qwen35 import ARCH as QWEN35_ARCH
from .qwen35 import Qwen35Config, Qwen35Oracle

ARCH = "qwen35moe"

#: ggml_clamp of the routing weights' sum in build_moe_ffn (the smallest normal F16)
WEIGHT_SUM_MIN = 6.103515625e-5


@dataclass(frozen=True)
class Qwen35MoeConfig(Qwen35Config):
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int

    @classmethod
    def from_gguf(cls, md: dict[str, Any], tensors: dict[str, np.ndarray]) -> "Qwen35MoeConfig":
        arch = md.get("general.architecture")
        if arch != ARCH:
            raise ValueError(f"not a {ARCH} model (general.architecture = {arch!r})")
        # the attention, GDN and norm keys are qwen35's under this prefix; feed_forward_length is
        # optional here (only the fallback of the expert widths)
        prefix = f"{ARCH}."
        view = {(QWEN35_ARCH + "." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in md.items()}
        view["general.architecture"] = QWEN35_ARCH
        view.setdefault(f"{QWEN35_ARCH}.feed_forward_length", 0)
        base = Qwen35Config.from_gguf(view, tensors)

        def uniform(name: str, default: int | None = None) -> int:
            v = md.get(prefix + name, default)
            if v is None:
                raise ValueError(f"missing GGUF key {prefix}{name}")
            if isinstance(v, list):
                if len(set(v[:base.n_layer])) != 1:
                    raise ValueError(f"per-layer {prefix}{name} {v} not supported by the oracle")
                v = v[0]
            return int(v)

        n_expert = uniform("expert_count")
        n_used = uniform("expert_used_count")
        if not 0 < n_used <= n_expert:
            raise ValueError(f"{ARCH}: expert_used_count {n_used} must be in 1..expert_count ({n_expert})")
        if uniform("expert_group_count", 0) > 1:
            raise ValueError(f"{ARCH}: grouped expert routing (expert_group_count > 1) is not supported by the oracle")
        n_ff_exp = uniform("expert_feed_forward_length", 0) or base.n_ff // n_used
        n_ff_shexp = uniform("expert_shared_feed_forward_length", 0) or base.n_ff
        if n_ff_exp <= 0 or n_ff_shexp <= 0:
            raise ValueError(f"{ARCH}: no expert widths (expert_feed_forward_length, "
                             "expert_shared_feed_forward_length, or feed_forward_length)")
        return cls(**{f.name: getattr(base, f.name) for f in fields(Qwen35Config)},
                   n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp)


@dataclass
class Routing:
    """What the router chose for a run of rows."""

    experts: torch.Tensor  # [T, n_expert_used] long, in ggml_argsort_top_k's order (largest first)
    weights: torch.Tensor  # [T, n_expert_used], renormalised
    probs: torch.Tensor  # [T, n_expert], the softmax over every expert


class Qwen35MoeOracle(Qwen35Oracle):
    """Exact forward pass of a qwen35moe GGUF in torch (CPU), one sequence from position 0.

    Everything of :class:`Qwen35Oracle` (constructor, options, layer pieces, ``forward``) with the
    MoE FFN of the module docstring in :meth:`ffn_block`; :meth:`route` is the router alone.
    """

    architectures = (ARCH,)
    config_class = Qwen35MoeConfig
    cfg: Qwen35MoeConfig

    def _layer_weights(self, il: int) -> dict[str, torch.Tensor]:
        # llama.cpp's alternative layouts, split into the rows of the separate tensors (exact)
        c, p = self.cfg, f"blk.{il}."
        split: dict[str, np.ndarray] = {}
        if not c.is_recurrent(il):
            biases = [b for b in ("attn_qkv", "attn_q", "attn_k", "attn_v") if self.has(p + b + ".bias")]
            if biases:
                raise ValueError(f"blk.{il}: attention biases ({', '.join(biases)}) are not supported by the oracle")
            if self.has(p + "attn_qkv.weight"):
                qkv = self._tensors[p + "attn_qkv.weight"]
                n_q, n_kv = 2 * c.head_dim * c.n_head, c.head_dim * c.n_head_kv
                if qkv.shape[0] != n_q + 2 * n_kv:
                    raise ValueError(f"blk.{il}.attn_qkv.weight has {qkv.shape[0]} rows, expected {n_q + 2 * n_kv}")
                split.update({p + "attn_q.weight": qkv[:n_q], p + "attn_k.weight": qkv[n_q:n_q + n_kv],
                              p + "attn_v.weight": qkv[n_q + n_kv:]})
        if self.has(p + "ffn_gate_up_exps.weight"):
            gate_up = self._tensors[p + "ffn_gate_up_exps.weight"]  # [n_expert, 2 n_ff_exp, n_embd]
            if gate_up.ndim != 3 or gate_up.shape[1] != 2 * c.n_ff_exp:
                raise ValueError(f"blk.{il}.ffn_gate_up_exps.weight has shape {gate_up.shape}, "
                                 f"expected ({c.n_expert}, {2 * c.n_ff_exp}, {c.n_embd})")
            split.update({p + "ffn_gate_exps.weight": gate_up[:, :c.n_ff_exp],
                          p + "ffn_up_exps.weight": gate_up[:, c.n_ff_exp:]})
        if split:
            self._tensors = {**self._tensors, **split}
        return super()._layer_weights(il)

    def _ffn_shapes(self) -> dict[str, tuple[int, ...]]:
        """The routed and shared experts (llama_model_qwen35moe::load_arch_tensors)."""
        c = self.cfg
        d, E, f, fs = c.n_embd, c.n_expert, c.n_ff_exp, c.n_ff_shexp
        return {"ffn_gate_inp.weight": (E, d), "ffn_gate_exps.weight": (E, f, d),
                "ffn_up_exps.weight": (E, f, d), "ffn_down_exps.weight": (E, d, f),
                "ffn_gate_inp_shexp.weight": (d,), "ffn_gate_shexp.weight": (fs, d),
                "ffn_up_shexp.weight": (fs, d), "ffn_down_shexp.weight": (d, fs)}

    # -- the MoE FFN ----------------------------------------------------------------------------

    def route(self, il: int, y: torch.Tensor) -> Routing:
        """The router of layer ``il`` for rows ``y`` (the FFN's normalised input)."""
        probs = torch.softmax(linear(y, self.layers[il]["ffn_gate_inp.weight"]), dim=-1)
        top, experts = torch.topk(probs, self.cfg.n_expert_used, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True).clamp_min(WEIGHT_SUM_MIN)
        return Routing(experts=experts, weights=weights, probs=probs)

    def moe_ffn(self, il: int, y: torch.Tensor) -> torch.Tensor:
        """``MoE(y) + sigmoid(w_shexp_gate · y) * SwiGLU_shexp(y)`` for rows ``y`` [T, n_embd]."""
        lw = self.layers[il]
        r = self.route(il, y)
        T, k = r.experts.shape
        slots = torch.zeros(T, k, y.shape[1], dtype=y.dtype)  # each row's k weighted expert outputs
        for e in torch.unique(r.experts).tolist():
            rows, slot = torch.nonzero(r.experts == e, as_tuple=True)
            ye = y[rows]
            h = silu(linear(ye, lw["ffn_gate_exps.weight"][e])) * linear(ye, lw["ffn_up_exps.weight"][e])
            slots[rows, slot] = linear(h, lw["ffn_down_exps.weight"][e]) * r.weights[rows, slot, None]
        moe = slots[:, 0]
        for i in range(1, k):  # summed in selection order, as build_moe_ffn adds its views
            moe = moe + slots[:, i]
        shexp = linear(silu(linear(y, lw["ffn_gate_shexp.weight"])) * linear(y, lw["ffn_up_shexp.weight"]),
                       lw["ffn_down_shexp.weight"])
        gate = torch.sigmoid(y @ lw["ffn_gate_inp_shexp.weight"])[:, None]
        return moe + shexp * gate

    def ffn_block(self, il: int, h: torch.Tensor) -> torch.Tensor:
        """``h + MoE-FFN(rms_norm(h) * post_attention_norm)``: the layer's second half."""
        y = rms_norm(h, self.layers[il]["post_attention_norm.weight"], self.cfg.rms_eps)
        return h + self.moe_ffn(il, y)
