"""Tiny random-weight ``qwen35`` and ``qwen35moe`` GGUFs (Qwen3.5: Gated DeltaNet + gated full
attention; dense SwiGLU FFNs, or mixture-of-experts FFNs with a gated shared expert).

The dense model follows llama.cpp's ``llama_model_qwen35`` (``src/models/qwen35.cpp``) tensor for
tensor, at toy size:

* 6 layers; ``full_attention_interval = 3`` makes layers 2 and 5 full attention (llama.cpp:
  layer ``il`` is recurrent when ``(il + 1) % interval != 0``), the others Gated DeltaNet (GDN);
* full attention: 4 query heads, 2 KV heads, head dim 16; ``attn_q`` projects to Q *and* the
  output gate, ``2 * head_dim`` rows per head (``[q_h, gate_h]`` interleaved by head); Q/K RMS
  norms; interleaved M-RoPE (IMROPE) over the first ``n_rot`` dims with ``rope.dimension_sections``;
* GDN: 2 key heads (``ssm.group_count``), 4 value heads (``ssm.time_step_rank``), head dim 8
  (``ssm.state_size``; llama.cpp requires key and value head dims equal), conv kernel 4;
  ``attn_qkv`` (conv input, ``[q | k | v]``), ``attn_gate`` (z), ``ssm_beta``, ``ssm_alpha``,
  ``ssm_dt.bias``, ``ssm_a`` (= -exp(A_log), stored negated as the converter does),
  ``ssm_conv1d``, ``ssm_norm``, ``ssm_out``;
* every layer: ``attn_norm``, ``post_attention_norm`` (the FFN's pre-norm) and a SwiGLU FFN;
  untied ``output.weight``.

The MoE model (:func:`build_qwen35moe`) is the same with ``llama_model_qwen35moe``'s FFN
(``src/models/qwen35moe.cpp``, ``build_layer_ffn``) in every layer, and no dense FFN:

* 4 routed experts, 2 used (``expert_count``, ``expert_used_count``), expert width 32
  (``expert_feed_forward_length``): ``ffn_gate_inp`` (the router, F32 as the converter stores
  it), ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` (3-D, one matrix per expert);
  llama.cpp routes by softmax, top-k, and renormalises the k weights (``norm_w`` = true);
* the shared expert, width 48 (``expert_shared_feed_forward_length``): ``ffn_gate_shexp``,
  ``ffn_up_shexp``, ``ffn_down_shexp``, scaled by ``sigmoid(ffn_gate_inp_shexp · y)`` (a vector,
  F32); llama.cpp's loader requires it;
* no ``feed_forward_length`` key (``n_ff = 0``): llama.cpp reads it only as a fallback for the two
  widths above.

Two options reach llama.cpp's other tensor layouts, each drawing the same numbers as the split
one so the model is the same up to rounding: ``attn_qkv_fused`` (full-attention layers with one
``attn_qkv`` of ``[q and gate | k | v]`` rows, qwen35 and qwen35moe) and ``gate_up_merged``
(qwen35moe: one ``ffn_gate_up_exps`` of ``[gate | up]`` rows per expert).

The decay parameters are drawn so that the recurrence neither forgets at once nor never: the
per-step decay ``exp(softplus(alpha + dt_bias) * ssm_a)`` lies roughly in 0.6..0.999 with a
spread over heads, so state from tens of tokens back still matters.

The general keys and the tokenizer come from ``tiny_gguf.new_writer``; the file is written
atomically by ``tiny_gguf.write_and_close``.
"""

from __future__ import annotations

import math
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


from .tiny_gguf import WeightFactory, add_head_keys, add_size_keys, add_tensors, check_shape  # noqa: E402
from .tiny_gguf import configure, head_tensors, with_tokenizer_vocab, write_tiny_model  # noqa: E402

ARCH = "qwen35"
ARCH_MOE = "qwen35moe"


@dataclass(frozen=True)
class Qwen35TinyConfig:
    """Hyperparameters of the tiny qwen35 model. Any field can be overridden by keyword."""

    n_vocab: int = 0  # 0: the tokenizer's size
    n_ctx: int = 2048
    n_embd: int = 64
    n_layer: int = 6
    full_attention_interval: int = 3
    # explicit per-layer pattern (True = recurrent/GDN); written as attention.recurrent_layers
    # when given, instead of relying on full_attention_interval
    recurrent_layers: tuple[bool, ...] | None = None
    # full attention
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_rot: int = 8  # partial rotary: the first n_rot dims of each head
    rope_sections: tuple[int, int, int, int] = (2, 1, 1, 0)  # sum = n_rot / 2 as in Qwen3.5
    rope_freq_base: float = 10000.0
    # Gated DeltaNet
    ssm_d_conv: int = 4
    ssm_head_dim: int = 8  # ssm.state_size: key head dim == value head dim
    ssm_n_k_heads: int = 2  # ssm.group_count
    ssm_n_v_heads: int = 4  # ssm.time_step_rank (a multiple of the key heads)
    ssm_a_range: tuple[float, float] = (0.05, 2.0)  # -ssm_a = exp(A_log), log-uniform in this range
    ssm_dt_bias_range: tuple[float, float] = (-4.0, -1.0)
    # FFN, norms (n_ff: the dense FFN; 0 writes no feed_forward_length key)
    n_ff: int = 128
    rms_eps: float = 1e-6
    # mixture of experts (qwen35moe; 0 experts: the dense qwen35)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    gate_up_merged: bool = False  # one ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    # full-attention layers: one attn_qkv instead of attn_q, attn_k, attn_v
    attn_qkv_fused: bool = False
    # storage type of the projection matrices ("f32" or "f16"); norms, conv and SSM vectors F32
    dtype: str = "f32"

    @property
    def arch(self) -> str:
        return ARCH_MOE if self.n_expert else ARCH

    @property
    def d_inner(self) -> int:
        return self.ssm_head_dim * self.ssm_n_v_heads

    @property
    def key_dim(self) -> int:
        return self.ssm_head_dim * self.ssm_n_k_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.d_inner

    def is_recurrent(self, il: int) -> bool:
        if self.recurrent_layers is not None:
            return bool(self.recurrent_layers[il])
        return (il + 1) % self.full_attention_interval != 0


#: the qwen35moe defaults on top of Qwen35TinyConfig's (see the module docstring)
MOE_DEFAULTS: dict[str, Any] = dict(n_ff=0, n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=48)


def qwen35_config(**overrides: Any) -> Qwen35TinyConfig:
    """The default :class:`Qwen35TinyConfig` with `overrides` applied (validated)."""
    cfg = configure(Qwen35TinyConfig, ARCH, overrides, tuples={"recurrent_layers": bool, "rope_sections": int})
    cfg = with_tokenizer_vocab(cfg)
    check_shape(cfg, layers=False)  # dtype and head grouping (the rotary width n_rot is checked below)
    if cfg.ssm_n_v_heads % cfg.ssm_n_k_heads:
        raise ValueError(f"ssm_n_v_heads ({cfg.ssm_n_v_heads}) must be a multiple of ssm_n_k_heads ({cfg.ssm_n_k_heads})")
    if cfg.n_rot % 2 or not 0 < cfg.n_rot <= cfg.head_dim:
        raise ValueError(f"n_rot ({cfg.n_rot}) must be even and in (0, head_dim]")
    if len(cfg.rope_sections) != 4 or sum(cfg.rope_sections) > cfg.head_dim or not any(cfg.rope_sections[:3]):
        raise ValueError(f"rope_sections {cfg.rope_sections}: 4 entries, sum <= head_dim, one of the first 3 > 0")
    if cfg.recurrent_layers is not None and len(cfg.recurrent_layers) != cfg.n_layer:
        raise ValueError(f"recurrent_layers has {len(cfg.recurrent_layers)} entries, expected n_layer ({cfg.n_layer})")
    if cfg.full_attention_interval < 1:
        raise ValueError("full_attention_interval must be >= 1")
    if cfg.n_expert and not (0 < cfg.n_expert_used <= cfg.n_expert and cfg.n_ff_exp > 0 and cfg.n_ff_shexp > 0):
        raise ValueError(f"MoE: need 0 < n_expert_used ({cfg.n_expert_used}) <= n_expert ({cfg.n_expert}) and "
                         f"positive n_ff_exp, n_ff_shexp ({cfg.n_ff_exp}, {cfg.n_ff_shexp})")
    if not cfg.n_expert and (cfg.n_ff <= 0 or cfg.gate_up_merged):
        raise ValueError("the dense qwen35 needs n_ff > 0 and has no experts to merge (gate_up_merged)")
    return cfg


def qwen35moe_config(**overrides: Any) -> Qwen35TinyConfig:
    """The default qwen35moe :class:`Qwen35TinyConfig` (:data:`MOE_DEFAULTS`) with `overrides` applied."""
    if overrides.get("n_expert", 1) < 1:
        raise ValueError("qwen35moe needs n_expert >= 1 (the dense model is build_qwen35's)")
    return qwen35_config(**{**MOE_DEFAULTS, **overrides})


def add_qwen35_keys(writer, cfg: Qwen35TinyConfig) -> None:
    """The ``qwen35.*`` (``qwen35moe.*``) hyperparameter keys llama.cpp's loader reads."""
    a = cfg.arch
    w = writer
    add_size_keys(w, a, cfg)
    if cfg.n_ff:
        w.add_uint32(f"{a}.feed_forward_length", cfg.n_ff)
    add_head_keys(w, a, cfg)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.n_rot)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_freq_base)
    w.add_array(f"{a}.rope.dimension_sections", [int(x) for x in cfg.rope_sections])
    w.add_uint32(f"{a}.ssm.conv_kernel", cfg.ssm_d_conv)
    w.add_uint32(f"{a}.ssm.state_size", cfg.ssm_head_dim)
    w.add_uint32(f"{a}.ssm.group_count", cfg.ssm_n_k_heads)
    w.add_uint32(f"{a}.ssm.time_step_rank", cfg.ssm_n_v_heads)
    w.add_uint32(f"{a}.ssm.inner_size", cfg.d_inner)
    w.add_uint32(f"{a}.full_attention_interval", cfg.full_attention_interval)
    if cfg.recurrent_layers is not None:
        w.add_array(f"{a}.attention.recurrent_layers", [bool(x) for x in cfg.recurrent_layers])
    if cfg.n_expert:
        w.add_uint32(f"{a}.expert_count", cfg.n_expert)
        w.add_uint32(f"{a}.expert_used_count", cfg.n_expert_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", cfg.n_ff_exp)
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", cfg.n_ff_shexp)


def _add_moe_tensors(writer, wf: WeightFactory, cfg: Qwen35TinyConfig, p: str) -> None:
    """One layer's routed and shared experts (qwen35moe's build_layer_ffn)."""
    d, E, f = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
    writer.add_tensor(p + "ffn_gate_inp.weight", wf.matrix(E, d).astype(np.float32))  # the router, F32
    gate = wf.experts(E, f, d)  # [E, f, d] (ggml {d, f, E})
    up = wf.experts(E, f, d)
    if cfg.gate_up_merged:
        writer.add_tensor(p + "ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1))  # [E, 2f, d]
    else:
        writer.add_tensor(p + "ffn_gate_exps.weight", gate)
        writer.add_tensor(p + "ffn_up_exps.weight", up)
    writer.add_tensor(p + "ffn_down_exps.weight", wf.experts(E, d, f))  # [E, d, f]
    # the shared expert's gate: one row of the router's scale, F32 as the converter stores it
    writer.add_tensor(p + "ffn_gate_inp_shexp.weight", wf.matrix(1, d)[0].astype(np.float32))
    writer.add_tensor(p + "ffn_gate_shexp.weight", wf.matrix(cfg.n_ff_shexp, d))
    writer.add_tensor(p + "ffn_up_shexp.weight", wf.matrix(cfg.n_ff_shexp, d))
    writer.add_tensor(p + "ffn_down_shexp.weight", wf.matrix(d, cfg.n_ff_shexp))


def _add_qwen35_tensors(writer, cfg: Qwen35TinyConfig, seed: int) -> None:
    wf = WeightFactory(seed, cfg.dtype)
    rng = wf.rng
    d, hd = cfg.n_embd, cfg.head_dim

    add_tensors(writer, head_tensors(wf, cfg.n_vocab, d, embd_gain=math.sqrt(d)))  # embedding entries ~N(0, 1)

    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        writer.add_tensor(p + "attn_norm.weight", wf.norm(d))
        writer.add_tensor(p + "post_attention_norm.weight", wf.norm(d))
        if cfg.is_recurrent(il):
            H_v, D = cfg.ssm_n_v_heads, cfg.ssm_head_dim
            writer.add_tensor(p + "attn_qkv.weight", wf.matrix(cfg.conv_dim, d))
            writer.add_tensor(p + "attn_gate.weight", wf.matrix(cfg.d_inner, d))
            # depthwise causal conv: [conv_dim, d_conv] (ggml {d_conv, conv_dim})
            conv = rng.normal(0.0, 1.0 / math.sqrt(cfg.ssm_d_conv), size=(cfg.conv_dim, cfg.ssm_d_conv))
            writer.add_tensor(p + "ssm_conv1d.weight", conv.astype(np.float32))
            lo, hi = cfg.ssm_dt_bias_range
            writer.add_tensor(p + "ssm_dt.bias", rng.uniform(lo, hi, size=H_v).astype(np.float32))
            alo, ahi = cfg.ssm_a_range
            a = -np.exp(rng.uniform(math.log(alo), math.log(ahi), size=H_v))
            writer.add_tensor(p + "ssm_a", a.astype(np.float32))
            writer.add_tensor(p + "ssm_beta.weight", wf.matrix(H_v, d))
            writer.add_tensor(p + "ssm_alpha.weight", wf.matrix(H_v, d))
            writer.add_tensor(p + "ssm_norm.weight", wf.norm(D))
            writer.add_tensor(p + "ssm_out.weight", wf.matrix(d, cfg.d_inner))
        else:
            qkv = (wf.matrix(2 * hd * cfg.n_head, d),  # [q_h | gate_h] per head
                   wf.matrix(hd * cfg.n_head_kv, d), wf.matrix(hd * cfg.n_head_kv, d))
            if cfg.attn_qkv_fused:
                writer.add_tensor(p + "attn_qkv.weight", np.concatenate(qkv))
            else:
                for name, w in zip(("attn_q", "attn_k", "attn_v"), qkv):
                    writer.add_tensor(p + name + ".weight", w)
            writer.add_tensor(p + "attn_q_norm.weight", wf.norm(hd))
            writer.add_tensor(p + "attn_k_norm.weight", wf.norm(hd))
            writer.add_tensor(p + "attn_output.weight", wf.matrix(d, hd * cfg.n_head))
        if cfg.n_expert:
            _add_moe_tensors(writer, wf, cfg, p)
            continue
        writer.add_tensor(p + "ffn_gate.weight", wf.matrix(cfg.n_ff, d))
        writer.add_tensor(p + "ffn_up.weight", wf.matrix(cfg.n_ff, d))
        writer.add_tensor(p + "ffn_down.weight", wf.matrix(d, cfg.n_ff))


def build_qwen35(path: os.PathLike[str] | str, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Write the tiny qwen35 GGUF to `path` (atomically) and return the path.

    `overrides` are :class:`Qwen35TinyConfig` fields, e.g. ``n_layer=4``,
    ``full_attention_interval=2``, ``rope_sections=(1, 1, 1, 1)``, ``dtype="f16"``.
    The same (seed, overrides) always gives byte-identical files.
    """
    cfg = qwen35_config(**overrides)
    if cfg.n_expert:
        raise ValueError("build_qwen35 writes the dense qwen35; experts are build_qwen35moe's")
    return _write(path, cfg, seed)


def build_qwen35moe(path: os.PathLike[str] | str, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Write the tiny qwen35moe GGUF to `path` (atomically) and return the path.

    `overrides` are :class:`Qwen35TinyConfig` fields on top of :data:`MOE_DEFAULTS`, e.g.
    ``n_expert=8``, ``n_expert_used=1``, ``gate_up_merged=True``, ``attn_qkv_fused=True``.
    The same (seed, overrides) always gives byte-identical files.
    """
    return _write(path, qwen35moe_config(**overrides), seed)


def _write(path: os.PathLike[str] | str, cfg: Qwen35TinyConfig, seed: int) -> pathlib.Path:
    return write_tiny_model(path, cfg.arch, cfg.dtype, lambda w: add_qwen35_keys(w, cfg),
                            lambda w: _add_qwen35_tensors(w, cfg, seed))


if __name__ == "__main__":
    moe = "--moe" in sys.argv[1:]
    args = [a for a in sys.argv[1:] if a != "--moe"]
    build = build_qwen35moe if moe else build_qwen35
    print(build(args[0] if args else (f"{ARCH_MOE}.gguf" if moe else f"{ARCH}.gguf")))
