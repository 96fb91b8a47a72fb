"""Exact forward pass of ``gpt-oss`` (llama.cpp's LLM_ARCH_OPENAI_MOE, ``src/models/openai-moe.cpp``).

One layer, written out (``layer_forward``; x = the residual stream entering the layer)::

    h      = rms_norm(x) · attn_norm
    q      = RoPE(Wq h + bq)                                   # NEOX pairs, YaRN, the layer's base
    k, v   = kv_path(layer, x, positions)  = RoPE(Wk h + bk), Wv h + bv
    a      = Wo · attn(q, k, v) + bo                           # sinks in the softmax (below)
    x_mid  = x + a
    f      = MoE(rms_norm(x_mid) · post_attention_norm)        # post_attention_norm is the FFN's pre-norm
    x_out  = x_mid + f

and around the layers: the embedding rows (no scale), then ``output_norm`` and the untied
``output.weight``. The conventions are llama.cpp's at the pinned commit:

* **Layers.** ``load_swa_pattern(ml, 2)``: an ``attention.sliding_window_pattern`` array when the
  file has one, else period 2 with dense_first = False, so layer ``il`` slides when ``il % 2 == 0``
  (0, 2, 4, ... over ``attention.sliding_window`` rows, LLAMA_SWA_TYPE_STANDARD: key j is visible to
  query i while ``0 <= i - j < window``); the odd layers are full attention.
* **Heads.** ``n_head · head_dim`` need not be ``n_embd`` (gpt-oss-20b: 64 · 64 vs 2880); the head
  dim is ``rope.dimension_count`` (``create_tensor_qkv`` and ``build_qkv`` use ``n_rot``), the
  attention scale ``1/sqrt(n_rot)`` (float32). No QK-norm.
* **RoPE** (:func:`yarn_rope_angles`): NEOX halves; full layers use ``rope.freq_base`` and
  freq_scale = 1/``rope.scaling.factor`` (1 when ``rope.scaling.type`` is ``none``); sliding layers
  use ``rope.freq_base_swa`` (default: ``rope.freq_base``) and the trained freq_scale (1/factor).
  With ``rope.scaling.type = yarn`` llama.cpp sets ext_factor = 1 and attn_factor =
  ``(1 + 0.1 ln f) / (1 + 0.1 ln f) · rope.scaling.attn_factor`` (llama_context: get_mscale over
  the cancellation of ggml's own factor), beta_fast = 32, beta_slow = 1 (llama.cpp's defaults: the
  gpt-oss loader does not read ``rope.scaling.yarn_beta_*``), n_ctx_orig =
  ``rope.scaling.original_context_length``. Per rotary pair i (ggml's rope_yarn):
  ``θ_extrap = p · base^(-2i/n_rot)`` (ggml's float32 running product), ``θ_interp = freq_scale ·
  θ_extrap``, ``θ = θ_interp (1 - r_i) + θ_extrap r_i`` with the ramp ``r_i = 1 - clamp((i - lo) /
  max(0.001, hi - lo), 0, 1)`` between the correction dims ``lo = floor(d(beta_fast))``, ``hi =
  ceil(d(beta_slow))``, ``d(b) = n_rot · ln(n_ctx_orig / (2π b)) / (2 ln base)`` (clamped to
  [0, n_rot - 1]); cos and sin are multiplied by ``mscale = attn_factor · (1 + 0.1 ln(1/freq_scale))``,
  i.e. by YaRN's magnitude ``(1 + 0.1 ln f) · rope.scaling.attn_factor`` (1.21 at f = 8, 1.35 at
  gpt-oss's f = 32), on Q and K alike, so q·k grows by its square.
  Everything is computed in float32 as ggml does (the angle and mscale) and then applied in the
  oracle's dtype.
* **Attention sinks** (``attn_sinks.weight``, one logit per *query* head, not scaled by the
  attention scale): llama.cpp's ``ggml_soft_max_add_sinks`` (the same in its flash-attention
  kernels) computes, for query head h and query row i over the keys j it may see,
  ``p_ij = exp(s_ij - m) / (Σ_j' exp(s_ij' - m) + exp(sink_h - m))`` with ``s = q·k · scale`` and
  ``m = max(max_j s_ij, sink_h)``: the sink is an extra logit in the denominator with no value, so
  each row's probabilities over the keys sum to less than 1. :meth:`GptOssOracle.attention_weights`
  returns exactly these ``p_ij`` (the sink's own share is *not* a column): it is what the values are
  weighted with and what RidgeFill's attention selector sums (the C++ selector's scores follow the
  same convention).
* **MoE** (``build_moe_ffn(..., LLM_FFN_SWIGLU_OAI_MOE, norm_w = false, w_scale =
  expert_weights_scale = 0 (not read for gpt-oss), LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)``):
  router logits ``z = W_r u + b_r`` over ``expert_count`` experts; the ``expert_used_count`` experts
  with the largest z (ggml_argsort_top_k, descending); their weights ``softmax(z_chosen)`` (over the
  chosen k only, no renormalisation, no scale); each chosen expert e computes ``g = W_gate[e] u +
  b_gate[e]``, ``up = W_up[e] u + b_up[e]``, the SWIGLU_OAI activation ``a = min(g, 7) ·
  σ(1.702 · min(g, 7)) · (clamp(up, -7, 7) + 1)`` (ggml_swiglu_oai, alpha 1.702, limit 7), and
  ``W_down[e] a + b_down[e]``; the FFN output is the weighted sum over the chosen experts.
  RidgeFill's filled rows never reach this block (they run only :meth:`kv_path`).

Tensor layouts as :func:`~ridgefill_cpp.core.gguf_model.read_tensors` returns them (numpy order, the
reverse of ggml's ne): ``ffn_gate_inp.weight [E, n_embd]``, ``ffn_{gate,up}_exps.weight
[E, n_ff_exp, n_embd]``, ``ffn_down_exps.weight [E, n_embd, n_ff_exp]``, biases ``[E, n]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from .common import (
    ROPE_NEOX,
    Oracle,
    _kv_group,
    apply_rope,
    attention_mask,
    linear,
    rms_norm,
)
from .dense import AttentionInputWeights, DenseHParams, DenseOracle, resolve_rope_scaling, resolve_sizes
from .dense import _swa_flags as dense_swa_flags  # llama.cpp's load_swa_pattern

ARCH = "gpt-oss"

#: ggml_swiglu_oai's constants in build_moe_ffn (LLM_FFN_SWIGLU_OAI_MOE)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


# ------------------------------------------------------------------------------------------------
# numerics


def yarn_rope_angles(positions: torch.Tensor, n_rot: int, freq_base: float, freq_scale: float, *,
                     ext_factor: float, n_ctx_orig: int, beta_fast: float, beta_slow: float
                     ) -> torch.Tensor:
    """RoPE angles ``[n_tokens, n_rot/2]`` with ggml's YaRN correction (ggml-cpu rope_yarn).

    ext_factor 0 gives plain scaled RoPE (``θ = freq_scale · θ_extrap``). Computed in float32 as
    ggml does (the running product for ``θ_extrap``, the ramp, the mix); returned as float64.
    """
    f32 = np.float32
    theta_scale = f32(freq_base) ** f32(f32(-2.0) / f32(n_rot))
    theta = positions.detach().cpu().numpy().astype(np.float32)
    extrap = np.empty((theta.shape[0], n_rot // 2), dtype=np.float32)
    for i in range(n_rot // 2):
        extrap[:, i] = theta
        theta = theta * theta_scale
    interp = f32(freq_scale) * extrap
    if ext_factor == 0.0:
        return torch.from_numpy(interp.astype(np.float64))
    lo, hi = yarn_corr_dims(n_rot, n_ctx_orig, freq_base, beta_fast, beta_slow)
    i = np.arange(n_rot // 2, dtype=np.float32)  # ggml: i0 / 2 for i0 = 0, 2, ...
    y = (i - f32(lo)) / f32(max(f32(0.001), f32(hi - lo)))
    ramp = (f32(1.0) - np.minimum(f32(1.0), np.maximum(f32(0.0), y))).astype(np.float32)
    mix = (ramp * f32(ext_factor)).astype(np.float32)
    out = interp * (f32(1.0) - mix)[None, :] + extrap * mix[None, :]
    return torch.from_numpy(out.astype(np.float32).astype(np.float64))


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float
                   ) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the rotary-pair range over which YaRN ramps from extrapolation
    (below) to interpolation (above), float32 as ggml computes it."""
    f32 = np.float32

    def corr_dim(beta: float) -> np.float32:
        return f32(f32(n_rot) * np.log(f32(f32(n_ctx_orig) / f32(f32(beta) * f32(2.0) * f32(math.pi))))
                   / f32(f32(2.0) * np.log(f32(freq_base))))

    start = np.floor(corr_dim(beta_fast))
    end = np.ceil(corr_dim(beta_slow))
    return float(max(f32(0.0), start)), float(min(f32(n_rot - 1), end))


def yarn_mscale(attn_factor: float, freq_scale: float, ext_factor: float) -> float:
    """The factor ggml's rope multiplies cos and sin by: attn_factor, times ``1 + 0.1 ln(1/freq_scale)``
    when ext_factor != 0 (float32)."""
    f32 = np.float32
    m = f32(attn_factor)
    if ext_factor != 0.0:
        m = f32(m * f32(f32(1.0) + f32(0.1) * np.log(f32(f32(1.0) / f32(freq_scale)))))
    return float(m)


def attention_probs_sinks(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float,
                          sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention probabilities ``[n_head, n_q, n_k]`` with an optional sink logit per query head in
    the denominator (``ggml_soft_max_ext`` + ``ggml_soft_max_add_sinks``; see the module docstring).

    ``q [n_q, n_head, d]``, ``k [n_k, n_head_kv, d]`` (query head h reads KV head
    ``h // (n_head / n_head_kv)``), ``sinks [n_head]`` or None. A row's probabilities sum to
    ``1 - p_sink`` (1 without sinks).
    """
    k = k.repeat_interleave(_kv_group(q.shape[1], k.shape[1]), dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    n_head, n_q, _ = scores.shape
    sink_col = sinks.to(scores.dtype)[:, None, None].expand(n_head, n_q, 1)
    return torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_OAI_ALPHA,
               limit: float = SWIGLU_OAI_LIMIT) -> torch.Tensor:
    """ggml_swiglu_oai: ``x = min(gate, limit)``, ``y = clamp(up, -limit, limit)``,
    ``x · σ(alpha · x) · (y + 1)``."""
    x = torch.clamp(gate, max=limit)
    y = torch.clamp(up, min=-limit, max=limit)
    return x * torch.sigmoid(alpha * x) * (y + 1.0)


# ------------------------------------------------------------------------------------------------
# hyperparameters and weights


@dataclass(frozen=True)
class GptOssHParams(DenseHParams):
    """:class:`DenseHParams` (its per-layer ``rope_base`` / ``rope_scale`` / ``window``) plus YaRN and
    the mixture of experts, resolved the way llama.cpp resolves them for gpt-oss."""

    rope_ext_factor: float  # 1 for yarn, else 0
    rope_attn_factor: float  # llama_cparams::yarn_attn_factor
    yarn_beta_fast: float
    yarn_beta_slow: float
    n_ctx_orig: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int


def _swa_flags(o: Oracle, n_layer: int) -> list[bool]:
    """llama.cpp's load_swa_pattern(ml, 2) for gpt-oss: an explicit bool array, or period 2."""
    pattern = o.hparam("attention.sliding_window_pattern", 2)
    if isinstance(pattern, (list, tuple)) and len(pattern) < n_layer:
        raise ValueError(f"gpt-oss: attention.sliding_window_pattern has {len(pattern)} entries for {n_layer} layers")
    return dense_swa_flags(o, n_layer, default_pattern=2)


def _scalar(value: Any) -> int:
    """A per-layer key given as an array: llama.cpp's n_*() accessors without il read layer 0."""
    if isinstance(value, (list, tuple)):
        return int(value[0])
    return int(value)


def resolve_hparams(o: Oracle, n_vocab: int) -> GptOssHParams:
    f32 = np.float32
    n_layer, n_embd, n_head, n_head_kv, head_dim_k, head_dim_v = resolve_sizes(o)
    n_rot = int(o.hparam("rope.dimension_count", head_dim_k))
    if not n_rot == head_dim_k == head_dim_v:  # the tensors are created with n_rot as the head dim
        raise ValueError(f"gpt-oss: rope.dimension_count {n_rot}, key_length {head_dim_k} and value_length "
                         f"{head_dim_v} must agree")

    scaling, factor = resolve_rope_scaling(o, ("none", "linear", "yarn"))
    freq_scale_train = float(f32(1.0) / f32(factor)) if factor != 0.0 else 1.0
    freq_scale = 1.0 if scaling == "none" else freq_scale_train  # cparams: never scale under "none"
    freq_base = float(o.hparam("rope.freq_base", 10000.0))
    freq_base_swa = float(o.hparam("rope.freq_base_swa", freq_base))
    n_ctx_train = int(o.hparam("context_length"))
    n_ctx_orig = int(o.hparam("rope.scaling.original_context_length", n_ctx_train) or n_ctx_train)

    ext_factor = 1.0 if scaling == "yarn" else 0.0
    attn_factor = f32(1.0)
    if ext_factor != 0.0:  # llama_context's yarn_attn_factor (rope_yarn_log_mul is 0 for gpt-oss)
        fac = f32(f32(1.0) / f32(freq_scale))
        mscale = f32(1.0) if fac <= 1.0 else f32(f32(0.1) * np.log(fac) + f32(1.0))
        attn_factor = f32(mscale * f32(f32(1.0) / f32(f32(1.0) + f32(0.1) * np.log(fac))))
    attn_factor = f32(attn_factor * f32(o.hparam("rope.scaling.attn_factor", 1.0)))

    n_swa = int(o.hparam("attention.sliding_window"))  # required by llama.cpp's loader
    rope_base, rope_scale, window = [], [], []
    for swa in _swa_flags(o, n_layer):
        rope_base.append(freq_base_swa if swa else freq_base)
        rope_scale.append(freq_scale_train if swa else freq_scale)  # rope_freq_scale_train_swa
        window.append(n_swa if swa else 0)

    n_expert = int(o.hparam("expert_count"))
    n_expert_used = _scalar(o.hparam("expert_used_count"))
    if not 0 < n_expert_used <= n_expert:
        raise ValueError(f"gpt-oss: expert_used_count {n_expert_used} outside 1..{n_expert}")
    return GptOssHParams(
        arch=ARCH, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=n_rot, n_rot=n_rot, n_vocab=n_vocab,
        rms_eps=float(o.hparam("attention.layer_norm_rms_epsilon")),
        rope_mode=ROPE_NEOX, attn_scale=float(f32(1.0) / np.sqrt(f32(n_rot))), embd_scale=1.0,
        final_logit_softcap=0.0, ffn_act="swiglu_oai", sandwich_norms=False,
        rope_base=tuple(rope_base), rope_scale=tuple(rope_scale), window=tuple(window),
        rope_ext_factor=ext_factor, rope_attn_factor=float(attn_factor), yarn_beta_fast=32.0,
        yarn_beta_slow=1.0, n_ctx_orig=n_ctx_orig, n_expert=n_expert, n_expert_used=n_expert_used,
        n_ff_exp=_scalar(o.hparam("expert_feed_forward_length")),
    )


@dataclass
class GptOssLayerWeights(AttentionInputWeights):
    """One layer's tensors: :class:`~.dense.AttentionInputWeights`' fields (so :class:`DenseOracle`'s
    q/k/v pieces read them), then these; gpt-oss has no QK-norm and no post-norms."""

    wo: torch.Tensor
    bo: torch.Tensor
    sinks: torch.Tensor  # [n_head]
    ffn_norm: torch.Tensor  # post_attention_norm: the FFN's pre-norm
    router: torch.Tensor  # [E, n_embd]
    router_b: torch.Tensor  # [E]
    gate_exps: torch.Tensor  # [E, n_ff_exp, n_embd]
    gate_exps_b: torch.Tensor  # [E, n_ff_exp]
    up_exps: torch.Tensor
    up_exps_b: torch.Tensor
    down_exps: torch.Tensor  # [E, n_embd, n_ff_exp]
    down_exps_b: torch.Tensor  # [E, n_embd]
    q_norm: None = None
    k_norm: None = None
    attn_post_norm: None = None
    rope_freqs: None = None


# ------------------------------------------------------------------------------------------------
# the oracle


class GptOssOracle(DenseOracle):
    """The exact forward pass of a gpt-oss GGUF (see the module docstring).

    :class:`DenseOracle`'s pieces are reused where the math is the same (embedding, Q/K/V
    projections, :meth:`kv_path`, :meth:`layer_over_cache`, :meth:`layer_forward`, :meth:`logits`,
    :meth:`forward`); RoPE (YaRN), attention (sinks) and the FFN (mixture of experts) are its own.

    Options:
      kv_f16: round K and V to fp16 inside attention (not in the returned keys/values), to match
        llama.cpp with flash attention on (which casts even an F32 KV cache to F16) or an F16 cache.
        Default False: exact, matches llama.cpp with an F32 cache and flash attention off.
    """

    architectures = (ARCH,)

    def __init__(self, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, Any],
                 dtype: torch.dtype = torch.float32, *, kv_f16: bool = False):
        Oracle.__init__(self, tensors, metadata, dtype)  # DenseOracle's own refuses MoE tensors
        self.kv_f16 = kv_f16
        self.gelu_fp16_table = False  # unused (no GELU); DenseOracle's attribute
        self.tok_embd = self.weight("token_embd.weight")
        self.hp: GptOssHParams = resolve_hparams(self, n_vocab=self.tok_embd.shape[0])
        self.output_norm = self.weight("output_norm.weight")
        self.output = self.weight("output.weight")  # required by llama.cpp's loader (no tying)
        self.tied_embeddings = False
        self.layers = [self._layer_weights(il) for il in range(self.hp.n_layer)]

    def _layer_weights(self, il: int) -> GptOssLayerWeights:  # type: ignore[override]
        p, hp = f"blk.{il}.", self.hp
        w, mw = self.weight, self.maybe_weight
        n_q, n_kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        if self.has(p + "attn_qkv.weight"):  # create_tensor_qkv's fused form: rows [q | k | v]
            wq, wk, wv = torch.split(w(p + "attn_qkv.weight"), [n_q, n_kv, n_kv], dim=0)
            if self.has(p + "attn_qkv.bias"):
                bq, bk, bv = torch.split(w(p + "attn_qkv.bias"), [n_q, n_kv, n_kv], dim=0)
            else:
                bq, bk, bv = mw(p + "attn_q.bias"), mw(p + "attn_k.bias"), mw(p + "attn_v.bias")
                if not (bq is not None and bk is not None and bv is not None):
                    bq = bk = bv = None  # build_qkv adds separate biases to a fused QKV only as a triple
        else:
            wq, wk, wv = w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")
            bq, bk, bv = mw(p + "attn_q.bias"), mw(p + "attn_k.bias"), mw(p + "attn_v.bias")
        E, F, d = hp.n_expert, hp.n_ff_exp, hp.n_embd
        L = GptOssLayerWeights(
            attn_norm=w(p + "attn_norm.weight"), wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv,
            wo=w(p + "attn_output.weight"), bo=w(p + "attn_output.bias"),
            sinks=w(p + "attn_sinks.weight"), ffn_norm=w(p + "post_attention_norm.weight"),
            router=w(p + "ffn_gate_inp.weight"), router_b=w(p + "ffn_gate_inp.bias"),
            gate_exps=w(p + "ffn_gate_exps.weight"), gate_exps_b=w(p + "ffn_gate_exps.bias"),
            up_exps=w(p + "ffn_up_exps.weight"), up_exps_b=w(p + "ffn_up_exps.bias"),
            down_exps=w(p + "ffn_down_exps.weight"), down_exps_b=w(p + "ffn_down_exps.bias"),
        )
        want = {"wq": (n_q, d), "wk": (n_kv, d), "wv": (n_kv, d), "wo": (d, n_q), "sinks": (hp.n_head,),
                "router": (E, d), "router_b": (E,), "gate_exps": (E, F, d), "gate_exps_b": (E, F),
                "up_exps": (E, F, d), "up_exps_b": (E, F), "down_exps": (E, d, F), "down_exps_b": (E, d)}
        for name, shape in want.items():
            got = tuple(getattr(L, name).shape)
            if got != shape:
                raise ValueError(f"gpt-oss: {p}{name} has shape {got}, expected {shape}")
        return L

    # -- pieces of a layer ------------------------------------------------------------------------

    def _rope(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        angles = yarn_rope_angles(positions, hp.n_rot, hp.rope_base[il], hp.rope_scale[il],
                                  ext_factor=hp.rope_ext_factor, n_ctx_orig=hp.n_ctx_orig,
                                  beta_fast=hp.yarn_beta_fast, beta_slow=hp.yarn_beta_slow)
        y = apply_rope(x, angles, hp.rope_mode)
        mscale = yarn_mscale(hp.rope_attn_factor, hp.rope_scale[il], hp.rope_ext_factor)
        return y if mscale == 1.0 else y * mscale

    def _probs(self, il: int, q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
               k_positions: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        if self.kv_f16:
            k = k.to(torch.float16).to(q.dtype)
        allowed = attention_mask(q_positions, k_positions, hp.window[il])
        return attention_probs_sinks(q, k, allowed, hp.attn_scale, self.layers[il].sinks)

    def attend(self, il: int, q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_positions: torch.Tensor) -> torch.Tensor:
        """Layer `il`'s attention of queries at `q_positions` over the cache rows (k, v) at
        `k_positions`: causal, within the layer's window, sinks in the softmax, then the output
        projection with its bias. Returns ``[n_q, n_embd]``."""
        L = self.layers[il]
        probs = self._probs(il, q, q_positions, k, k_positions)
        if self.kv_f16:
            v = v.to(torch.float16).to(q.dtype)
        v = v.repeat_interleave(_kv_group(q.shape[1], v.shape[1]), dim=1)
        out = torch.einsum("hqk,khd->qhd", probs, v)
        return linear(out.reshape(out.shape[0], -1), L.wo, L.bo)

    def attention_weights(self, il: int, x_q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
                          k_positions: torch.Tensor) -> torch.Tensor:
        """The attention probabilities ``[n_head, n_q, n_k]`` of query rows with input `x_q` over the
        cache keys `k`, with the layer's sinks in the denominator (ggml_soft_max_add_sinks): what
        :meth:`attend` weights the values with; each row sums to 1 minus the sink's share."""
        h = rms_norm(x_q.to(self.dtype), self.layers[il].attn_norm, self.hp.rms_eps)
        q = self.q_path(il, h, q_positions)
        return self._probs(il, q, q_positions, k, k_positions)

    def router(self, il: int, x_mid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts each row uses and their weights: ``(ids [n, k] int64, weights [n, k])``,
        top-k of the biased router logits (descending), weights a softmax over the chosen logits."""
        L, hp = self.layers[il], self.hp
        u = rms_norm(x_mid, L.ffn_norm, hp.rms_eps)
        z = linear(u, L.router, L.router_b)  # [n, E]
        top, ids = torch.topk(z, hp.n_expert_used, dim=-1, largest=True, sorted=True)
        return ids, torch.softmax(top, dim=-1)

    def ffn(self, il: int, x_mid: torch.Tensor) -> torch.Tensor:
        """The MoE block on the post-attention residual: post_attention_norm → router (top-k,
        softmax weights) → the chosen experts (biases, SWIGLU_OAI) → their weighted sum."""
        L, hp = self.layers[il], self.hp
        u = rms_norm(x_mid, L.ffn_norm, hp.rms_eps)
        ids, weights = self.router(il, x_mid)
        out = torch.zeros_like(x_mid)
        for e in range(hp.n_expert):
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            ue = u[rows]
            g = linear(ue, L.gate_exps[e], L.gate_exps_b[e])
            up = linear(ue, L.up_exps[e], L.up_exps_b[e])
            y = linear(swiglu_oai(g, up), L.down_exps[e], L.down_exps_b[e])
            out.index_add_(0, rows, y * weights[rows, slot][:, None])
        return out


__all__ = [
    "ARCH",
    "GptOssHParams",
    "GptOssLayerWeights",
    "GptOssOracle",
    "attention_probs_sinks",
    "swiglu_oai",
    "yarn_corr_dims",
    "yarn_mscale",
    "yarn_rope_angles",
]
