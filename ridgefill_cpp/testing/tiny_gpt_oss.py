"""A tiny random-weight ``gpt-oss`` GGUF (OpenAI's open-weight MoE; llama.cpp's LLM_ARCH_OPENAI_MOE).

The model follows llama.cpp's ``llama_model_openai_moe`` (``src/models/openai-moe.cpp`` at the pinned
commit) tensor for tensor and key for key, at toy size:

* 6 layers alternating sliding-window and full attention: the loader calls
  ``load_swa_pattern(ml, 2)`` (dense_first = False), so layer ``il`` slides when ``il % 2 == 0``
  (layers 0, 2, 4 over a 16-row window, ``attention.sliding_window``; 1, 3, 5 full). The SWA layers'
  RoPE base is ``rope.freq_base_swa`` when present, else ``rope.freq_base`` (real gpt-oss files have
  no such key; ``rope_freq_base_swa`` writes it);
* attention: 8 query heads, 2 KV heads, head dim 16, so ``n_head · head_dim = 128 ≠ n_embd = 64``
  (as in gpt-oss-20b, 64 · 64 ≠ 2880: ``attention.key_length`` is required); Q/K/V biases and an
  output bias (``attn_output.bias``); per-head attention sinks ``attn_sinks.weight`` [n_head], drawn
  large enough that the sink takes a real share of each softmax; NEOX RoPE with YaRN scaling
  (``rope.scaling.type = yarn``, factor 8 over an original context of 256: the ramp falls inside the
  8 rotary pairs of a 16-dim head); the converter's ``rope.scaling.yarn_beta_fast`` / ``_slow`` keys
  are written as it writes them (32 / 1; llama.cpp's gpt-oss loader does not read them);
* FFN: ``post_attention_norm`` (the FFN's pre-norm), then a mixture of 4 experts, 2 used per row:
  router ``ffn_gate_inp`` with bias, top-k on the router logits, the weights a softmax over the k
  chosen logits; each expert's gate / up / down projections with their biases
  (``ffn_{gate,up,down}_exps.{weight,bias}``), the SWIGLU_OAI activation
  ``min(g, 7)·σ(1.702·min(g, 7))·(clamp(u, ±7) + 1)``. The expert gate/up weights are drawn with a
  gain that sends a few per cent of the pre-activations past ±7, so the clamps are exercised;
* untied ``output.weight``, ``output_norm``.

Weights come from a seeded ``numpy.random.Generator`` (``tiny_gguf.WeightFactory``): the same
(seed, overrides) always gives byte-identical files. The general keys and the tokenizer come from
``tiny_gguf.new_writer``; the file is written atomically by ``tiny_gguf.write_and_close``.
``dtype="f16"`` stores the 2-D and expert matrices as F16 (norms, biases and sinks stay F32).
"""

from __future__ import annotations

import math
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


from .tiny_gguf import WeightFactory, add_head_keys, add_size_keys, add_tensors, check_shape, configure  # noqa: E402
from .tiny_gguf import head_tensors, qkv_tensors, with_tokenizer_vocab, write_tiny_model  # noqa: E402

ARCH = "gpt-oss"


@dataclass(frozen=True)
class GptOssTinyConfig:
    """Hyperparameters of the tiny gpt-oss model. Any field can be overridden by keyword."""

    n_vocab: int = 0  # 0: the tokenizer's size
    n_ctx: int = 2048  # context_length (= original context · YaRN factor, as in gpt-oss)
    n_embd: int = 64
    n_layer: int = 6
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 16  # key_length = value_length = rope.dimension_count
    rms_eps: float = 1e-5
    # attention
    sliding_window: int = 16
    # explicit per-layer pattern (True = sliding window), written as attention.sliding_window_pattern;
    # None: llama.cpp's default for gpt-oss (period 2, even layers slide)
    swa_pattern: tuple[bool, ...] | None = None
    sink_mean: float = 2.0  # attn_sinks ~ N(sink_mean, sink_std) per head
    sink_std: float = 1.5
    # RoPE
    rope_freq_base: float = 150000.0
    rope_freq_base_swa: float = 0.0  # 0: no rope.freq_base_swa key (the SWA layers use freq_base)
    rope_scaling: str = "yarn"  # rope.scaling.type: "yarn", "linear" or "none"
    rope_scaling_factor: float = 8.0
    rope_orig_ctx: int = 256  # rope.scaling.original_context_length
    yarn_beta_fast: float = 32.0  # written as the converter writes them; not read for gpt-oss
    yarn_beta_slow: float = 1.0
    rope_attn_factor: float = 0.0  # rope.scaling.attn_factor (0: no key; llama.cpp's default 1)
    # MoE
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 32
    expert_gain: float = 3.0  # std of the gate/up pre-activations (limit 7: a few per cent clip)
    expert_down_gain: float = 0.5
    router_bias_scale: float = 0.5
    # storage type of the matrices ("f32" or "f16"); norms, biases and sinks are always F32
    dtype: str = "f32"

    def is_swa(self, il: int) -> bool:
        """Whether layer `il` uses the sliding window (llama.cpp's set_swa_pattern(2))."""
        if self.swa_pattern is not None:
            return bool(self.swa_pattern[il])
        return il % 2 < 1


def gpt_oss_config(**overrides: Any) -> GptOssTinyConfig:
    """The default :class:`GptOssTinyConfig` with `overrides` applied (validated)."""
    cfg = with_tokenizer_vocab(configure(GptOssTinyConfig, ARCH, overrides, tuples={"swa_pattern": bool}))
    check_shape(cfg)
    if not 0 < cfg.n_expert_used <= cfg.n_expert:
        raise ValueError(f"n_expert_used ({cfg.n_expert_used}) must be in 1..n_expert ({cfg.n_expert})")
    if cfg.sliding_window < 1:
        raise ValueError("sliding_window must be positive (llama.cpp requires the key for gpt-oss)")
    if cfg.swa_pattern is not None and len(cfg.swa_pattern) != cfg.n_layer:
        raise ValueError(f"swa_pattern has {len(cfg.swa_pattern)} entries, expected n_layer ({cfg.n_layer})")
    if cfg.rope_scaling not in ("yarn", "linear", "none"):
        raise ValueError(f"rope_scaling must be 'yarn', 'linear' or 'none', not {cfg.rope_scaling!r}")
    return cfg


def add_gpt_oss_keys(writer, cfg: GptOssTinyConfig) -> None:
    """The ``gpt-oss.*`` hyperparameter keys llama.cpp's loader reads (and the converter writes)."""
    a = ARCH
    w = writer
    add_size_keys(w, a, cfg)
    w.add_uint32(f"{a}.feed_forward_length", cfg.n_ff_exp)  # the converter writes intermediate_size twice
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg.n_ff_exp)
    w.add_uint32(f"{a}.expert_count", cfg.n_expert)
    w.add_uint32(f"{a}.expert_used_count", cfg.n_expert_used)
    add_head_keys(w, a, cfg)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_uint32(f"{a}.attention.sliding_window", cfg.sliding_window)
    if cfg.swa_pattern is not None:
        w.add_array(f"{a}.attention.sliding_window_pattern", [bool(x) for x in cfg.swa_pattern])
    w.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_freq_base)
    if cfg.rope_freq_base_swa:
        w.add_float32(f"{a}.rope.freq_base_swa", cfg.rope_freq_base_swa)
    w.add_string(f"{a}.rope.scaling.type", cfg.rope_scaling)
    if cfg.rope_scaling != "none":
        w.add_float32(f"{a}.rope.scaling.factor", cfg.rope_scaling_factor)
    if cfg.rope_scaling == "yarn":
        w.add_uint32(f"{a}.rope.scaling.original_context_length", cfg.rope_orig_ctx)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", cfg.yarn_beta_fast)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", cfg.yarn_beta_slow)
    if cfg.rope_attn_factor:
        w.add_float32(f"{a}.rope.scaling.attn_factor", cfg.rope_attn_factor)


def _add_gpt_oss_tensors(writer, cfg: GptOssTinyConfig, seed: int) -> None:
    wf = WeightFactory(seed, cfg.dtype)
    rng = wf.rng
    d, hd, E, F = cfg.n_embd, cfg.head_dim, cfg.n_expert, cfg.n_ff_exp
    n_q, n_kv = cfg.n_head * hd, cfg.n_head_kv * hd

    add_tensors(writer, head_tensors(wf, cfg.n_vocab, d, embd_gain=math.sqrt(d)))  # embedding entries ~N(0, 1)

    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        writer.add_tensor(p + "attn_norm.weight", wf.norm(d))
        add_tensors(writer, qkv_tensors(wf, d, n_q, n_kv, bias=True), p)
        writer.add_tensor(p + "attn_output.weight", wf.matrix(d, n_q))
        writer.add_tensor(p + "attn_output.bias", wf.bias(d))
        sinks = cfg.sink_mean + cfg.sink_std * rng.standard_normal(cfg.n_head)
        writer.add_tensor(p + "attn_sinks.weight", sinks.astype(np.float32))
        writer.add_tensor(p + "post_attention_norm.weight", wf.norm(d))
        writer.add_tensor(p + "ffn_gate_inp.weight", wf.matrix(E, d))
        writer.add_tensor(p + "ffn_gate_inp.bias", wf.bias(E, scale=cfg.router_bias_scale))
        writer.add_tensor(p + "ffn_gate_exps.weight", wf.experts(E, F, d, cfg.expert_gain))
        writer.add_tensor(p + "ffn_gate_exps.bias", wf.bias(E * F).reshape(E, F))
        writer.add_tensor(p + "ffn_up_exps.weight", wf.experts(E, F, d, cfg.expert_gain))
        writer.add_tensor(p + "ffn_up_exps.bias", wf.bias(E * F).reshape(E, F))
        writer.add_tensor(p + "ffn_down_exps.weight", wf.experts(E, d, F, cfg.expert_down_gain))
        writer.add_tensor(p + "ffn_down_exps.bias", wf.bias(E * d).reshape(E, d))


def build_gpt_oss(path: os.PathLike[str] | str, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Write the tiny gpt-oss GGUF to `path` (atomically) and return the path.

    `overrides` are :class:`GptOssTinyConfig` fields, e.g. ``n_layer=4``, ``rope_freq_base_swa=10000``,
    ``swa_pattern=(False, True, ...)``, ``dtype="f16"``. The same (seed, overrides) always gives
    byte-identical files.
    """
    cfg = gpt_oss_config(**overrides)
    return write_tiny_model(path, ARCH, cfg.dtype, lambda w: add_gpt_oss_keys(w, cfg),
                            lambda w: _add_gpt_oss_tensors(w, cfg, seed))


if __name__ == "__main__":
    out = build_gpt_oss(sys.argv[1] if len(sys.argv) > 1 else "gpt-oss.gguf")
    print(out)
