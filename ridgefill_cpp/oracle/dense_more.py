"""Exact forward pass of ``qwen2``, ``mistral3`` and ``qwen3moe``, on top of :class:`DenseOracle`.

The layer is the dense one (:mod:`.dense`) with these architectures' own pieces, as llama.cpp's
builders in the pinned tree compute them (src/models/{qwen2,mistral3,qwen3moe}.cpp):

    qwen2     q, k, v = W h + b (build_qkv adds attn_{q,k,v}.bias when present); NEOX RoPE;
              no QK-norm; optional output.bias on the logits
    mistral3  NORM RoPE with the optional rope_freqs.weight factors (model.get_rope_factors);
              optional attn_output.bias and MLP biases; query width n_head·head_dim ≠ n_embd;
              with attention.temperature_scale τ ≠ 0 (llama 4 style) Q is multiplied, after RoPE,
              by 1 + τ·log(⌊pos / n_ctx_orig⌋ + 1) (build_inp_attn_scale; K and V are not);
              the kq scale is always 1/sqrt(head_dim) (mistral3 never reads attention.scale,
              so f_attention_scale stays 0); with expert_count > 0 the FFN is the MoE below
    qwen3moe  QK-norm then NEOX RoPE as qwen3; the FFN of every layer is a mixture of experts

The mixture of experts (build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, norm_w = true,
w_scale = expert_weights_scale, which neither architecture reads, so 0: no scaling)::

    h      = ffn_norm(x_mid)
    p      = softmax(W_router h)                        # over the n_expert experts
    E      = the n_expert_used largest p                # ggml_argsort_top_k
    w_e    = p_e / max(Σ_{e∈E} p_e, 6.1e-5)             # renormalised (the clamp is ggml's)
    f      = Σ_{e∈E} w_e · down_e(silu(gate_e h) · up_e h)

RoPE scaling, for all three (the context llama.cpp builds, src/llama-context.cpp): ``linear``
divides the angles by the factor; ``none`` never scales; ``yarn`` (real Ministral 3 GGUFs, and
Qwen2.5 GGUFs converted with a YaRN config) mixes the interpolated and extrapolated angle per
dimension pair with ggml's ramp between the correction dims of beta_fast / beta_slow and
multiplies cos and sin by the magnitude factor llama.cpp derives (1 + 0.1·ln factor, cancelled to
1 when ``rope.scaling.yarn_log_multiplier`` is set as in Ministral 3). Written from the YaRN
definition with ggml's choices (``ggml_rope_yarn_corr_dims``' floor/ceil, the ramp on
``i0/2``, float32 arithmetic); longrope factors are refused.

A RidgeFill filled row runs only :meth:`kv_path` (attn norm → K, V projections with their biases
→ k-norm (qwen3moe) → RoPE with the factors and scaling above): it never reaches the router or an
expert, nor the temperature scale (queries only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from .common import ROPE_NEOX, ROPE_NORM, Oracle, apply_rope, linear, rms_norm, rope_angles, silu
from .dense import DenseHParams, DenseLayerWeights, DenseOracle, resolve_rope_scaling, resolve_sizes

MORE_ARCHITECTURES = ("qwen2", "mistral3", "qwen3moe")

_ROPE_MODE = {"qwen2": ROPE_NEOX, "mistral3": ROPE_NORM, "qwen3moe": ROPE_NEOX}

#: ggml_clamp's lower bound on the sum of the chosen experts' weights (the smallest normal fp16)
_MOE_WEIGHT_SUM_MIN = 6.103515625e-5


@dataclass(frozen=True)
class MoreHParams(DenseHParams):
    """:class:`DenseHParams` plus the RoPE scaling, temperature and expert settings."""

    n_ctx_orig: int = 0  # cparams.n_ctx_orig_yarn
    ext_factor: float = 0.0  # YaRN extrapolation mix (1 with rope.scaling.type = yarn, else 0)
    rope_mscale: float = 1.0  # what ggml multiplies cos and sin by
    yarn_corr_dims: tuple[float, float] = (0.0, 0.0)
    attn_temp_scale: float = 0.0  # τ; 0: off
    n_expert: int = 0
    n_expert_used: int = 0
    expert_weights_norm: bool = True  # build_moe_ffn's norm_w (both builders pass true)
    expert_weights_scale: float = 0.0  # 0 or 1: no scaling


def _f32(x: float) -> np.float32:
    return np.float32(x)


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float
                   ) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the dimension-pair range over which YaRN ramps from extrapolation
    to interpolation, ``[max(0, ⌊d(β_fast)⌋), min(n_dims-1, ⌈d(β_slow)⌉)]`` with
    ``d(β) = n_dims · ln(n_ctx_orig / (2πβ)) / (2 ln base)`` in float32."""
    def corr_dim(beta: float) -> np.float32:
        ratio = _f32(n_ctx_orig) / (_f32(beta) * _f32(2) * _f32(math.pi))
        return _f32(n_dims) * np.log(ratio, dtype=np.float32) / (_f32(2) * np.log(_f32(freq_base), dtype=np.float32))

    start = np.floor(corr_dim(beta_fast))
    end = np.ceil(corr_dim(beta_slow))
    return float(max(0.0, start)), float(min(n_dims - 1, end))


def yarn_rope_angles(positions: torch.Tensor, n_rot: int, freq_base: float, freq_scale: float,
                     freq_factors: torch.Tensor | None, ext_factor: float, corr_dims: tuple[float, float]
                     ) -> torch.Tensor:
    """ggml's rope_yarn angles ``[n, n_rot/2]`` (float64 of float32 values): per pair i,
    ``θ = θ_interp·(1 - r_i·ext) + θ_extrap·r_i·ext`` with ``θ_extrap = p·base^(-2i/n_rot)/ff_i``,
    ``θ_interp = freq_scale·θ_extrap`` and the ramp ``r_i = 1 - clamp((i - lo)/max(0.001, hi - lo), 0, 1)``."""
    extrap = rope_angles(positions, n_rot, freq_base, 1.0, freq_factors).numpy().astype(np.float32)
    interp = _f32(freq_scale) * extrap
    if ext_factor == 0.0:
        return torch.from_numpy(interp.astype(np.float64))
    lo, hi = _f32(corr_dims[0]), _f32(corr_dims[1])
    i = np.arange(n_rot // 2, dtype=np.float32)
    y = (i - lo) / max(_f32(0.001), hi - lo)
    mix = (_f32(1) - np.clip(y, 0, 1)).astype(np.float32) * _f32(ext_factor)
    theta = interp * (_f32(1) - mix) + extrap * mix
    return torch.from_numpy(theta.astype(np.float64))


def _get_mscale(scale: np.float32, m: float) -> np.float32:
    """llama_context's get_mscale: ``1`` for scale ≤ 1, else ``0.1·m·ln(scale) + 1`` (float32)."""
    return _f32(1.0) if scale <= 1 else _f32(0.1) * _f32(m) * np.log(scale, dtype=np.float32) + _f32(1.0)


def _rope_scaling(o: Oracle, freq_base: float, n_rot: int, yarn_beta: tuple[float, float] | None) -> dict[str, Any]:
    """freq_scale, ext_factor, the cos/sin magnitude and the YaRN correction dims, resolved as
    llama_context's constructor does with default context parameters (nothing overridden)."""
    kind, factor = resolve_rope_scaling(o, ("none", "linear", "yarn"))
    freq_scale = _f32(1.0) if factor == 0.0 or kind == "none" else _f32(1.0) / _f32(factor)
    n_ctx_orig = int(o.hparam("rope.scaling.original_context_length", 0) or o.hparam("context_length"))
    ext_factor = 1.0 if kind == "yarn" else 0.0  # yarn_ext_factor < 0: "not set"
    attn_factor, corr = _f32(1.0), (0.0, 0.0)
    if ext_factor != 0.0:
        f = _f32(1.0) / freq_scale
        log_mul = float(o.hparam("rope.scaling.yarn_log_multiplier", 0.0)) if o.arch == "mistral3" else 0.0
        attn_factor = _get_mscale(f, 1.0) / _get_mscale(f, log_mul) if log_mul != 0.0 else _get_mscale(f, 1.0)
        # ... cancelled by the factor rope_yarn multiplies in again below
        attn_factor = attn_factor * (_f32(1.0) / (_f32(1.0) + _f32(0.1) * np.log(f, dtype=np.float32)))
        if yarn_beta is None:  # llama_hparams' defaults 32 / 1; mistral3 reads its own keys
            own = o.arch == "mistral3"
            yarn_beta = (float(o.hparam("rope.scaling.yarn_beta_fast", 32.0)) if own else 32.0,
                         float(o.hparam("rope.scaling.yarn_beta_slow", 1.0)) if own else 1.0)
        corr = yarn_corr_dims(n_rot, n_ctx_orig, freq_base, *yarn_beta)
    attn_factor = attn_factor * _f32(o.hparam("rope.scaling.attn_factor", 1.0))
    mscale = attn_factor
    if ext_factor != 0.0:  # rope_yarn: mscale *= 1 + 0.1·ln(1/freq_scale)
        mscale = mscale * (_f32(1.0) + _f32(0.1) * np.log(_f32(1.0) / freq_scale, dtype=np.float32))
    return dict(freq_scale=float(freq_scale), ext_factor=ext_factor, mscale=float(mscale), corr=corr,
                n_ctx_orig=n_ctx_orig)


def _resolve(o: Oracle, n_vocab: int, yarn_beta: tuple[float, float] | None) -> MoreHParams:
    arch = o.arch
    n_layer, n_embd, n_head, n_head_kv, head_k, head_v = resolve_sizes(o)
    n_rot = int(o.hparam("rope.dimension_count", head_k))
    if not head_k == head_v == n_rot:  # each builder asserts n_embd_head_k == n_embd_head_v == n_rot
        raise ValueError(f"{arch}: key_length {head_k}, value_length {head_v}, rope.dimension_count {n_rot} differ")
    freq_base = float(o.hparam("rope.freq_base", 10000.0))
    rs = _rope_scaling(o, freq_base, n_rot, yarn_beta)
    temp = float(o.hparam("attention.temperature_scale", 0.0)) if arch == "mistral3" else 0.0
    n_expert = int(o.hparam("expert_count", 0))
    n_used = o.hparam("expert_used_count", 0)
    if isinstance(n_used, list):
        raise ValueError(f"{arch}: per-layer expert_used_count is not supported by the oracle")
    if arch == "qwen3moe" and not (n_expert and n_used):
        raise ValueError("qwen3moe: expert_count and expert_used_count must be > 0")
    return MoreHParams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_k,
        n_rot=n_rot, n_vocab=n_vocab, rms_eps=float(o.hparam("attention.layer_norm_rms_epsilon")),
        rope_mode=_ROPE_MODE[arch], attn_scale=1.0 / math.sqrt(head_k), embd_scale=1.0,
        final_logit_softcap=0.0, ffn_act="silu", sandwich_norms=False,
        rope_base=(freq_base,) * n_layer, rope_scale=(rs["freq_scale"],) * n_layer, window=(0,) * n_layer,
        n_ctx_orig=rs["n_ctx_orig"], ext_factor=rs["ext_factor"], rope_mscale=rs["mscale"],
        yarn_corr_dims=rs["corr"], attn_temp_scale=temp, n_expert=n_expert, n_expert_used=int(n_used),
    )


@dataclass
class ExpertWeights:
    """One layer's mixture of experts: router ``[n_expert, n_embd]``, experts ``[n_expert, out, in]``."""

    router: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class Routing:
    """The experts chosen for each row (in ggml's order: largest probability first)."""

    experts: torch.Tensor  # [n, n_expert_used] int64
    weights: torch.Tensor  # [n, n_expert_used], renormalised
    probs: torch.Tensor  # [n, n_expert], the router's softmax

    @property
    def margin(self) -> torch.Tensor:
        """[n]: the gap between the last chosen and the first unchosen expert's probability (how far
        a row is from a different choice; inf when every expert is used)."""
        k = self.experts.shape[1]
        if k == self.probs.shape[1]:
            return torch.full((self.probs.shape[0],), math.inf, dtype=self.probs.dtype)
        top = torch.topk(self.probs, k + 1, dim=-1).values
        return top[:, k - 1] - top[:, k]


class MoreDenseOracle(DenseOracle):
    """The exact forward pass of a qwen2 / mistral3 / qwen3moe GGUF (see the module docstring).

    Options:
      yarn_beta: (beta_fast, beta_slow) of YaRN models, to mirror a context created with explicit
        values (llama-cpp-python's ``Llama`` passes 32 and 1 unless told otherwise, which override
        mistral3's ``rope.scaling.yarn_beta_*`` keys). Default: the model's, as llama.cpp's own
        tools (llama-cli, llama-server) resolve them.
    """

    architectures = MORE_ARCHITECTURES

    def __init__(self, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, Any],
                 dtype: torch.dtype = torch.float32, *, yarn_beta: tuple[float, float] | None = None):
        Oracle.__init__(self, tensors, metadata, dtype)  # DenseOracle's own checks refuse experts
        self.gelu_fp16_table = False  # no GELU in these architectures
        self.tok_embd = self.weight("token_embd.weight")
        self.hp: MoreHParams = _resolve(self, self.tok_embd.shape[0], yarn_beta)
        self.output_norm = self.weight("output_norm.weight")
        self.output = self.maybe_weight("output.weight")
        self.tied_embeddings = self.output is None
        if self.output is None:
            self.output = self.tok_embd
        self.output_b = self.maybe_weight("output.bias") if self.arch == "qwen2" else None
        self.rope_freqs = self.maybe_weight("rope_freqs.weight") if self.arch == "mistral3" else None
        self.layers = [self._more_layer(il) for il in range(self.hp.n_layer)]
        self.experts = [self._expert_weights(il) for il in range(self.hp.n_layer)]

    # -- weights ----------------------------------------------------------------------------------

    def _projections(self, il: int) -> dict[str, torch.Tensor | None]:
        """wq, wk, wv and their biases; a fused ``attn_qkv`` (create_tensor_qkv's other form) is split
        into its [q | k | v] rows."""
        p, hp = f"blk.{il}.", self.hp
        widths = [hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim, hp.n_head_kv * hp.head_dim]
        names = ("q", "k", "v")
        if self.has(p + "attn_qkv.weight"):
            proj = dict(zip(("wq", "wk", "wv"), torch.split(self.weight(p + "attn_qkv.weight"), widths)))
        else:
            proj = {f"w{n}": self.weight(f"{p}attn_{n}.weight") for n in names}
        if self.has(p + "attn_qkv.bias"):
            proj.update(zip(("bq", "bk", "bv"), torch.split(self.weight(p + "attn_qkv.bias"), widths)))
        else:
            proj.update({f"b{n}": self.maybe_weight(f"{p}attn_{n}.bias") for n in names})
        return proj

    def _more_layer(self, il: int) -> DenseLayerWeights:
        p, mw = f"blk.{il}.", self.maybe_weight
        mistral = self.arch == "mistral3"
        qk_norm = self.arch == "qwen3moe"
        dense_ffn = not self.has(p + "ffn_gate_inp.weight")
        return DenseLayerWeights(
            attn_norm=self.weight(p + "attn_norm.weight"),
            **self._projections(il),
            q_norm=self.weight(p + "attn_q_norm.weight") if qk_norm else None,
            k_norm=self.weight(p + "attn_k_norm.weight") if qk_norm else None,
            wo=self.weight(p + "attn_output.weight"),
            bo=mw(p + "attn_output.bias") if mistral else None,
            attn_post_norm=None,
            ffn_norm=self.weight(p + "ffn_norm.weight"),
            ffn_gate=self.weight(p + "ffn_gate.weight") if dense_ffn else None,
            ffn_up=self.weight(p + "ffn_up.weight") if dense_ffn else None,
            ffn_down=self.weight(p + "ffn_down.weight") if dense_ffn else None,
            ffn_gate_b=mw(p + "ffn_gate.bias") if mistral and dense_ffn else None,
            ffn_up_b=mw(p + "ffn_up.bias") if mistral and dense_ffn else None,
            ffn_down_b=mw(p + "ffn_down.bias") if mistral and dense_ffn else None,
            ffn_post_norm=None,
            rope_freqs=self.rope_freqs,
        )

    def _expert_weights(self, il: int) -> ExpertWeights | None:
        p = f"blk.{il}."
        if not self.has(p + "ffn_gate_inp.weight"):
            if self.hp.n_expert:
                raise ValueError(f"{self.arch}: expert_count {self.hp.n_expert} but layer {il} has no router")
            return None
        if self.has(p + "ffn_gate_up_exps.weight") or not self.has(p + "ffn_gate_exps.weight"):
            raise ValueError(f"{self.arch}: layer {il}: only separate gate/up/down experts are supported by the oracle")
        w = self.weight
        return ExpertWeights(router=w(p + "ffn_gate_inp.weight"), gate=w(p + "ffn_gate_exps.weight"),
                             up=w(p + "ffn_up_exps.weight"), down=w(p + "ffn_down_exps.weight"))

    # -- pieces of a layer ------------------------------------------------------------------------

    def _rope(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        if hp.ext_factor == 0.0 and hp.rope_mscale == 1.0:
            return super()._rope(il, x, positions)
        angles = yarn_rope_angles(positions, hp.n_rot, hp.rope_base[il], hp.rope_scale[il], self.layers[il].rope_freqs,
                                  hp.ext_factor, hp.yarn_corr_dims)
        y = apply_rope(x, angles, hp.rope_mode)
        return torch.cat((y[..., :hp.n_rot] * hp.rope_mscale, y[..., hp.n_rot:]), dim=-1)

    def attn_temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """mistral3's per-row query scale ``1 + τ·log(⌊pos / n_ctx_orig⌋ + 1)`` ``[n]`` (None when τ = 0)."""
        hp = self.hp
        if hp.attn_temp_scale == 0.0:
            return None
        pos = positions.detach().cpu().numpy().astype(np.float32)
        floor = np.floor(pos / np.float32(hp.n_ctx_orig)).astype(np.float64)
        scale = (np.log(floor + 1.0) * float(_f32(hp.attn_temp_scale)) + 1.0).astype(np.float32)
        return torch.from_numpy(scale).to(self.dtype)

    def q_path(self, il: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Queries: projection (+bias) → q-norm (qwen3moe) → RoPE → mistral3's temperature."""
        q = super().q_path(il, h, positions)
        t = self.attn_temperature(torch.as_tensor(positions))
        return q if t is None else q * t[:, None, None]

    def route(self, il: int, h: torch.Tensor) -> Routing:
        """Layer `il`'s expert choice for the ffn-normed rows `h` ``[n, n_embd]``."""
        E, hp = self.experts[il], self.hp
        probs = torch.softmax(linear(h, E.router), dim=-1)
        weights, experts = torch.topk(probs, hp.n_expert_used, dim=-1)
        if hp.expert_weights_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(_MOE_WEIGHT_SUM_MIN)
        if hp.expert_weights_scale not in (0.0, 1.0):
            weights = weights * hp.expert_weights_scale
        return Routing(experts=experts, weights=weights, probs=probs)

    def moe(self, il: int, h: torch.Tensor) -> torch.Tensor:
        """The mixture of experts on the ffn-normed rows `h` (see the module docstring)."""
        E = self.experts[il]
        r = self.route(il, h)
        out = torch.zeros_like(h)
        for e in torch.unique(r.experts).tolist():
            rows, slot = torch.nonzero(r.experts == e, as_tuple=True)
            x = h[rows]
            y = linear(silu(linear(x, E.gate[e])) * linear(x, E.up[e]), E.down[e])
            out.index_add_(0, rows, y * r.weights[rows, slot, None])
        return out

    def ffn(self, il: int, x_mid: torch.Tensor) -> torch.Tensor:
        """The feed-forward block: the dense SwiGLU MLP, or the mixture of experts."""
        if self.experts[il] is None:
            return super().ffn(il, x_mid)
        return self.moe(il, rms_norm(x_mid, self.layers[il].ffn_norm, self.hp.rms_eps))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """output_norm → output (+ qwen2's optional output.bias)."""
        return linear(rms_norm(x, self.output_norm, self.hp.rms_eps), self.output, self.output_b)
