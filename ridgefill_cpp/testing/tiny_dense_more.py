"""Tiny random-weight GGUFs of ``qwen2``, ``mistral3`` and ``qwen3moe`` (llama.cpp's architecture names).

Each follows its loader in the pinned llama.cpp tree (``src/models/<arch>.cpp``,
``load_arch_hparams`` / ``load_arch_tensors``) key for key and tensor for tensor, at toy size:

* ``qwen2`` (Qwen2 / Qwen2.5, DeepSeek-R1 distills): Q/K/V biases (``build_qkv`` adds them), no
  QK-norm, NEOX RoPE, untied ``output.weight`` (``tied_embeddings=True`` drops it, as the 0.5B
  model does; ``output_bias=True`` adds the optional ``output.bias``). The query width is
  ``n_embd`` (the loader creates ``attn_q`` as ``{n_embd, n_embd}``). ``fused_qkv=True`` (any of
  the three) stores the same values as one ``attn_qkv`` weight and bias, create_tensor_qkv's other form.
* ``mistral3`` (Ministral 3, Mistral Small 3.x): plain Llama-style attention with NORM RoPE and the
  optional ``rope_freqs.weight`` factors (on by default here, so the factor path is exercised), a
  query width ``n_head * head_dim`` different from ``n_embd`` (96 vs 64, as in the real models),
  tied output, dense SwiGLU FFN. Options: ``attn_out_bias`` / ``ffn_bias`` (the optional biases),
  ``rope_scaling="yarn"`` with ``rope_scaling_factor`` / ``rope_orig_ctx`` / ``yarn_*`` (the real
  Ministral 3 GGUFs use YaRN), ``attn_temp_scale`` (``attention.temperature_scale``: llama.cpp then
  multiplies Q by ``1 + temp_scale * log(floor(pos / n_ctx_orig) + 1)``), and ``n_expert`` /
  ``n_expert_used`` for the MoE branch (experts of width ``n_ff``). The defaults leave YaRN, the
  temperature and the experts off.
* ``qwen3moe`` (Qwen3-30B-A3B, 235B-A22B): QK-norm as qwen3, NEOX RoPE, query width 128 vs
  ``n_embd`` 64 (head_dim 32), untied output, and a mixture-of-experts FFN on every layer: router
  ``ffn_gate_inp``, 4 experts of width ``expert_feed_forward_length`` 32, 2 used per row
  (llama.cpp: softmax gating, top-k, the chosen weights renormalised to sum 1).

Weights come from ``tiny_gguf.WeightFactory`` (seeded numpy, drawn in a fixed order): the same
(arch, seed, overrides) gives byte-identical files. Matrices are F32 or F16 (``dtype``); norms,
biases, rope factors and the router stay F32 (llama.cpp's converter keeps ``ffn_gate_inp`` F32).
The router is drawn with gain 2 so that the top-2 choice is decisive (the gap between the 2nd and
3rd expert's probability is far above float rounding), and expert tensors are stacked
``[n_expert, out, in]`` (ggml ``{in, out, n_expert}``).

The general keys and the tokenizer come from ``tiny_gguf.new_writer``; the file is written
atomically by ``tiny_gguf.write_and_close``. ``tiny_models.make_tiny_model`` dispatches here.
"""

from __future__ import annotations

import math
import os
import pathlib
import sys
from dataclasses import dataclass, replace
from typing import Any

import numpy as np


from .tiny_gguf import TinyShape, WeightFactory, add_tensors  # noqa: E402
from .tiny_gguf import head_tensors, qkv_tensors, shape_problems, write_tiny_model  # noqa: E402

ARCHS = ("qwen2", "mistral3", "qwen3moe")

_ROPE_SCALING = ("", "none", "linear", "yarn")


@dataclass(frozen=True)
class MoreTinyConfig(TinyShape):
    """Hyperparameters of a tiny qwen2 / mistral3 / qwen3moe model (the sizes of
    ``tiny_gguf.TinyShape``, then these); any field can be overridden."""

    rope_freq_base: float = 1_000_000.0
    tied_embeddings: bool = False  # no output.weight: the head reuses token_embd
    qkv_bias: bool = False  # blk.N.attn_{q,k,v}.bias
    fused_qkv: bool = False  # one blk.N.attn_qkv.weight (and .bias) of rows [q | k | v] instead
    output_bias: bool = False  # output.bias (qwen2 only)
    attn_out_bias: bool = False  # blk.N.attn_output.bias (mistral3 only)
    ffn_bias: bool = False  # blk.N.ffn_{gate,up,down}.bias (mistral3's dense FFN only)
    rope_freqs: bool = False  # rope_freqs.weight, the per-dimension factors (mistral3 only)
    # RoPE scaling: "" writes no key (llama.cpp's default "linear" with factor 1)
    rope_scaling: str = ""
    rope_scaling_factor: float = 0.0
    rope_orig_ctx: int = 0  # rope.scaling.original_context_length (0: not written)
    yarn_beta_fast: float = 0.0  # mistral3 reads these three; 0: not written
    yarn_beta_slow: float = 0.0
    yarn_log_mul: float = 0.0
    attn_temp_scale: float = 0.0  # mistral3's attention.temperature_scale (0: not written)
    # mixture of experts (qwen3moe always; mistral3's optional branch)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0  # qwen3moe's expert_feed_forward_length (mistral3's experts are n_ff wide)
    router_gain: float = 2.0
    # storage type of the 2-D and expert matrices ("f32" or "f16")
    dtype: str = "f32"

    @property
    def moe(self) -> bool:
        return self.n_expert > 0

    @property
    def expert_width(self) -> int:
        return self.n_ff_exp or self.n_ff


_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": dict(qkv_bias=True),
    "mistral3": dict(head_dim=24, rms_eps=1e-5, tied_embeddings=True, rope_freqs=True),
    "qwen3moe": dict(head_dim=32, n_expert=4, n_expert_used=2, n_ff_exp=32),
}

#: options only some of the architectures have (llama.cpp's loader would reject the tensors, or
#: ignore the keys, of the others)
_ONLY = {
    "output_bias": ("qwen2",),
    "attn_out_bias": ("mistral3",),
    "ffn_bias": ("mistral3",),
    "rope_freqs": ("mistral3",),
    "yarn_beta_fast": ("mistral3",),
    "yarn_beta_slow": ("mistral3",),
    "yarn_log_mul": ("mistral3",),
    "attn_temp_scale": ("mistral3",),
    "n_expert": ("mistral3", "qwen3moe"),
    "n_ff_exp": ("qwen3moe",),
}


def more_config(arch: str, **overrides: Any) -> MoreTinyConfig:
    """The default :class:`MoreTinyConfig` of `arch` with `overrides` applied (validated)."""
    if arch not in _DEFAULTS:
        raise ValueError(f"no tiny config for {arch!r}; architectures here: {', '.join(ARCHS)}")
    try:
        cfg = replace(MoreTinyConfig(**_DEFAULTS[arch]), **overrides)
    except TypeError as e:  # "... got an unexpected keyword argument 'x'"
        raise TypeError(f"tiny {arch} model: {e}") from None
    wrong = [k for k, archs in _ONLY.items() if arch not in archs and getattr(cfg, k)]
    if wrong:
        owners = sorted({a for k in wrong for a in _ONLY[k]})
        raise ValueError(f"{arch} has no {', '.join(wrong)} (only {', '.join(owners)})")
    problems = shape_problems(cfg)
    if arch == "qwen2" and cfg.n_head * cfg.head_dim != cfg.n_embd:
        problems.append(f"qwen2's query width is n_embd: n_head * head_dim must be {cfg.n_embd}")
    if arch == "qwen3moe" and not (cfg.n_expert and cfg.n_expert_used):
        problems.append("qwen3moe needs n_expert > 0 and n_expert_used > 0 (llama.cpp refuses it otherwise)")
    if cfg.n_expert_used > cfg.n_expert or (cfg.n_expert_used > 0) != (cfg.n_expert > 0):
        problems.append(f"n_expert_used ({cfg.n_expert_used}) must be in 1..n_expert ({cfg.n_expert}), or both 0")
    if cfg.rope_scaling not in _ROPE_SCALING:
        problems.append(f"rope_scaling must be one of {_ROPE_SCALING}, not {cfg.rope_scaling!r}")
    if cfg.attn_temp_scale and not (cfg.rope_orig_ctx or cfg.n_ctx):
        problems.append("attn_temp_scale needs rope_orig_ctx or n_ctx (llama.cpp's floor scale)")
    if problems:
        raise ValueError("; ".join(problems))
    return cfg


def _keys(arch: str, cfg: MoreTinyConfig) -> list[tuple[str, str, Any]]:
    """(key suffix, GGUF type, value) of every ``<arch>.*`` key the loader reads, in writing order;
    optional keys only when set."""
    keys: list[tuple[str, str, Any]] = [
        ("vocab_size", "u32", cfg.n_vocab),
        ("context_length", "u32", cfg.n_ctx),
        ("embedding_length", "u32", cfg.n_embd),
        ("block_count", "u32", cfg.n_layer),
        ("feed_forward_length", "u32", cfg.n_ff),
        ("attention.head_count", "u32", cfg.n_head),
        ("attention.head_count_kv", "u32", cfg.n_head_kv),
        ("attention.key_length", "u32", cfg.head_dim),
        ("attention.value_length", "u32", cfg.head_dim),
        ("rope.dimension_count", "u32", cfg.head_dim),
        ("rope.freq_base", "f32", cfg.rope_freq_base),
        ("attention.layer_norm_rms_epsilon", "f32", cfg.rms_eps),
        # optional from here on: written only when set
        ("rope.scaling.type", "str", cfg.rope_scaling),
        ("rope.scaling.factor", "f32", cfg.rope_scaling_factor),
        ("rope.scaling.original_context_length", "u32", cfg.rope_orig_ctx),
        ("rope.scaling.yarn_beta_fast", "f32", cfg.yarn_beta_fast),
        ("rope.scaling.yarn_beta_slow", "f32", cfg.yarn_beta_slow),
        ("rope.scaling.yarn_log_multiplier", "f32", cfg.yarn_log_mul),
        ("attention.temperature_scale", "f32", cfg.attn_temp_scale),
        ("expert_count", "u32", cfg.n_expert),
        ("expert_used_count", "u32", cfg.n_expert_used),
        ("expert_feed_forward_length", "u32", cfg.n_ff_exp),
    ]
    n_required = 12
    return keys[:n_required] + [k for k in keys[n_required:] if k[2]]


def _write_keys(writer, arch: str, cfg: MoreTinyConfig) -> None:
    add = {"u32": writer.add_uint32, "f32": writer.add_float32, "str": writer.add_string}
    for suffix, kind, value in _keys(arch, cfg):
        add[kind](f"{arch}.{suffix}", value)


def _tensors(arch: str, cfg: MoreTinyConfig, seed: int) -> list[tuple[str, np.ndarray]]:
    """Every tensor of the model, in writing (and drawing) order."""
    wf = WeightFactory(seed, cfg.dtype)
    d, hd = cfg.n_embd, cfg.head_dim
    n_q, n_kv = cfg.n_head * hd, cfg.n_head_kv * hd
    out = head_tensors(wf, cfg.n_vocab, d, embd_gain=0.5 * math.sqrt(d), tied=cfg.tied_embeddings)
    if cfg.output_bias:
        out.append(("output.bias", wf.bias(cfg.n_vocab)))
    if cfg.rope_freqs:  # Llama-3-style factors: 1 for the fastest pairs up to 8 for the slowest
        out.append(("rope_freqs.weight", np.geomspace(1.0, 8.0, hd // 2).astype(np.float32)))

    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        layer = [("attn_norm.weight", wf.norm(d))]
        qkv = qkv_tensors(wf, d, n_q, n_kv, bias=cfg.qkv_bias)
        if cfg.fused_qkv:  # create_tensor_qkv's fused form, the same values
            qkv = [(f"attn_qkv.{kind}", np.concatenate([t for name, t in qkv if name.endswith(kind)]))
                   for kind in ("weight", "bias")[: 1 + cfg.qkv_bias]]
        layer += qkv
        if arch == "qwen3moe":
            layer += [("attn_q_norm.weight", wf.norm(hd)), ("attn_k_norm.weight", wf.norm(hd))]
        layer.append(("attn_output.weight", wf.matrix(d, n_q)))
        if cfg.attn_out_bias:
            layer.append(("attn_output.bias", wf.bias(d)))
        layer.append(("ffn_norm.weight", wf.norm(d)))
        if cfg.moe:
            ff, n_e = cfg.expert_width, cfg.n_expert
            router = wf.rng.normal(0.0, cfg.router_gain / math.sqrt(d), size=(n_e, d)).astype(np.float32)
            layer += [
                ("ffn_gate_inp.weight", router),
                ("ffn_gate_exps.weight", wf.experts(n_e, ff, d)),
                ("ffn_up_exps.weight", wf.experts(n_e, ff, d)),
                ("ffn_down_exps.weight", wf.experts(n_e, d, ff)),
            ]
        else:
            layer += [
                ("ffn_gate.weight", wf.matrix(cfg.n_ff, d)),
                ("ffn_up.weight", wf.matrix(cfg.n_ff, d)),
                ("ffn_down.weight", wf.matrix(d, cfg.n_ff)),
            ]
            if cfg.ffn_bias:
                layer += [("ffn_gate.bias", wf.bias(cfg.n_ff)), ("ffn_up.bias", wf.bias(cfg.n_ff)),
                          ("ffn_down.bias", wf.bias(d))]
        out += [(p + name, t) for name, t in layer]
    return out


def build_dense_more(arch: str, path: os.PathLike[str] | str, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Write the tiny `arch` GGUF (one of :data:`ARCHS`) to `path`, atomically, and return the path.

    `overrides` are :class:`MoreTinyConfig` fields, e.g. ``n_layer=4``, ``dtype="f16"``,
    ``tied_embeddings=True``, ``rope_scaling="yarn", rope_scaling_factor=4.0, rope_orig_ctx=32``.
    """
    cfg = more_config(arch, **overrides)
    return write_tiny_model(path, arch, cfg.dtype, lambda w: _write_keys(w, arch, cfg),
                            lambda w: add_tensors(w, _tensors(arch, cfg, seed)))


if __name__ == "__main__":
    for a in ARCHS:
        print(build_dense_more(a, pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".") / f"{a}.gguf"))
