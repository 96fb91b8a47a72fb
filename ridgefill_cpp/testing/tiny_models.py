"""Generate tiny random-weight GGUF models of every supported architecture, for tests.

The models are small enough to build in well under a second and run in milliseconds, yet they
reach every code path the real models do: grouped-query attention, optional Q/K/V biases, tied
and untied output embeddings, QK-norm (qwen3, gemma3), sandwich norms, embedding scaling,
sliding-window layers with their own RoPE base and final-logit softcapping (gemma3), and the
Gated DeltaNet hybrid (qwen35, built by ``tiny_qwen35`` on top of the helpers here).

Weights are drawn from a seeded ``numpy.random.Generator``: the same (arch, seed, overrides)
always gives byte-identical files. Matrices are ``normal(0, 1/sqrt(fan_in))`` so activations stay
O(1) and logits are not degenerate; norm weights are ``1 + small noise``.

Every model carries the same small SentencePiece-style vocabulary (``tokenizer.ggml.model =
"llama"``) with byte fallback, so llama.cpp tokenizes any UTF-8 text.

Usage as a library (tests)::

    from ridgefill_cpp.testing import tiny_models
    path = tiny_models.make_tiny_model("gemma3", tmp_path / "gemma3.gguf", seed=0)

Usage as a script::

    python -m ridgefill_cpp.testing.tiny_models OUTDIR [--arch llama --arch gemma3] [--seed 0] [--dtype f16]
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

import gguf

ARCHS = ("llama", "qwen3", "gemma3", "qwen35", "qwen2", "mistral3", "qwen3moe", "gpt-oss", "qwen35moe")

#: architectures whose content this file builds itself (qwen35 lives in tiny_qwen35)
DENSE_ARCHS = ("llama", "qwen3", "gemma3")


from .tiny_gguf import (  # noqa: E402,F401  (the tokenizer, writer and weights every tiny model shares; re-exported)
    BOS_ID,
    EOS_ID,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    UNK_ID,
    WeightFactory,
    new_writer,
    tokenizer_vocab,
    write_and_close,
)
from .tiny_gguf import TinyShape, add_head_keys, add_size_keys, add_tensors, check_shape, configure, head_tensors, qkv_tensors, write_tiny_model  # noqa: E402
from .tiny_qwen35 import build_qwen35, build_qwen35moe  # noqa: E402  (the hybrids' builders)
from .tiny_gpt_oss import build_gpt_oss  # noqa: E402  (gpt-oss, the MoE with attention sinks)
from .tiny_dense_more import ARCHS as MORE_ARCHS, build_dense_more  # noqa: E402  (qwen2, mistral3, qwen3moe)

# --------------------------------------------------------------------------------------------
# dense architectures (llama, qwen3, gemma3)


@dataclass(frozen=True)
class TinyConfig(TinyShape):
    """Hyperparameters of a tiny dense model (the sizes of :class:`TinyShape`, then these). Any
    field can be overridden by keyword.

    The vocabulary is always the tokenizer's (:func:`tokenizer_vocab`); QK-norm follows the
    architecture (qwen3 and gemma3 have it, llama does not).
    """

    rope_freq_base: float = 10000.0
    qkv_bias: bool = False  # blk.N.attn_{q,k,v}.bias
    tied_embeddings: bool = True  # no output.weight: the output head reuses token_embd
    # gemma3 only (llama.cpp reads these keys for gemma3 alone)
    sliding_window: int = 0
    swa_pattern: int = 0  # every swa_pattern-th layer (the last of each group) is full attention
    rope_freq_base_swa: float = 10000.0
    final_logit_softcapping: float = 0.0
    # storage type of the 2-D matrices ("f32" or "f16"); norms and biases are always F32
    dtype: str = "f32"


_DEFAULTS: dict[str, dict[str, Any]] = {
    # SmolLM2 / Llama 3 style, plus Q/K/V biases so that the bias path is exercised
    "llama": dict(qkv_bias=True, tied_embeddings=True, rms_eps=1e-5),
    # Qwen3: untied output head
    "qwen3": dict(tied_embeddings=False, rope_freq_base=1_000_000.0),
    # Gemma 3: 8 layers, pattern 4 -> layers 3 and 7 are full attention, the rest slide over 16
    # (prompts of ~100 tokens cross the window), softcapped logits
    "gemma3": dict(
        n_layer=8,
        tied_embeddings=True,
        sliding_window=16,
        swa_pattern=4,
        rope_freq_base=1_000_000.0,
        rope_freq_base_swa=10000.0,
        final_logit_softcapping=8.0,
    ),
}


def tiny_config(arch: str, **overrides: Any) -> TinyConfig:
    """The default :class:`TinyConfig` of a dense `arch`, with `overrides` applied."""
    if arch not in _DEFAULTS:
        raise ValueError(f"no dense tiny config for {arch!r}; dense architectures: {', '.join(DENSE_ARCHS)}")
    cfg = configure(TinyConfig, arch, overrides, _DEFAULTS[arch])
    check_shape(cfg)
    if arch != "gemma3" and (cfg.sliding_window or cfg.final_logit_softcapping):
        raise ValueError(f"sliding_window and final_logit_softcapping are gemma3 options; {arch} ignores them")
    return cfg


def has_qk_norm(arch: str) -> bool:
    return arch in ("qwen3", "gemma3")


def is_swa_layer(cfg: TinyConfig, il: int) -> bool:
    """Whether layer `il` uses the sliding window (llama.cpp's set_swa_pattern, dense_first=False)."""
    if cfg.sliding_window <= 0:
        return False
    n = cfg.swa_pattern
    return n == 0 or (il % n) < (n - 1)


def add_arch_keys(writer: gguf.GGUFWriter, arch: str, cfg: TinyConfig) -> None:
    """Add the ``<arch>.*`` hyperparameter keys that llama.cpp's load_hparams reads."""
    w = writer
    add_size_keys(w, arch, cfg)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.n_ff)
    add_head_keys(w, arch, cfg)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_freq_base)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    if cfg.sliding_window > 0:
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", cfg.swa_pattern)
        w.add_float32(f"{arch}.rope.freq_base_swa", cfg.rope_freq_base_swa)
    if cfg.final_logit_softcapping:
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)


def _add_dense_tensors(writer: gguf.GGUFWriter, arch: str, cfg: TinyConfig, seed: int) -> None:
    wf = WeightFactory(seed, cfg.dtype)
    d, hd = cfg.n_embd, cfg.head_dim
    n_q, n_kv = cfg.n_head * hd, cfg.n_head_kv * hd
    gemma = arch == "gemma3"

    # embedding entries O(1); gemma3 multiplies its embedding by sqrt(n_embd) = 8 on input, so its
    # entries are drawn smaller (a tied output head then gives logits of a few units either way)
    embd_std = 0.25 if gemma else 0.5
    add_tensors(writer, head_tensors(wf, cfg.n_vocab, d, embd_gain=embd_std * math.sqrt(d), tied=cfg.tied_embeddings))

    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        writer.add_tensor(p + "attn_norm.weight", wf.norm(d))
        add_tensors(writer, qkv_tensors(wf, d, n_q, n_kv, bias=cfg.qkv_bias), p)
        if has_qk_norm(arch):
            writer.add_tensor(p + "attn_q_norm.weight", wf.norm(hd))
            writer.add_tensor(p + "attn_k_norm.weight", wf.norm(hd))
        writer.add_tensor(p + "attn_output.weight", wf.matrix(d, n_q))
        if gemma:
            writer.add_tensor(p + "post_attention_norm.weight", wf.norm(d))
        writer.add_tensor(p + "ffn_norm.weight", wf.norm(d))
        writer.add_tensor(p + "ffn_gate.weight", wf.matrix(cfg.n_ff, d))
        writer.add_tensor(p + "ffn_up.weight", wf.matrix(cfg.n_ff, d))
        writer.add_tensor(p + "ffn_down.weight", wf.matrix(d, cfg.n_ff))
        if gemma:
            writer.add_tensor(p + "post_ffw_norm.weight", wf.norm(d))


def _build_dense(arch: str, path: pathlib.Path, seed: int, **overrides: Any) -> pathlib.Path:
    cfg = tiny_config(arch, **overrides)
    return write_tiny_model(path, arch, cfg.dtype, lambda w: add_arch_keys(w, arch, cfg),
                            lambda w: _add_dense_tensors(w, arch, cfg, seed))


# --------------------------------------------------------------------------------------------
# entry points


def make_tiny_model(arch: str, path: os.PathLike[str] | str, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Write a tiny random-weight GGUF model of `arch` to `path` and return the path.

    `overrides` change hyperparameters (see :class:`TinyConfig` for the dense architectures,
    ``tiny_qwen35.build_qwen35`` for qwen35), e.g. ``n_layer=4``, ``dtype="f16"``,
    ``tied_embeddings=False``.
    """
    path = pathlib.Path(path)
    if arch == "qwen35":
        return pathlib.Path(build_qwen35(path, seed, **overrides))
    if arch == "qwen35moe":
        return pathlib.Path(build_qwen35moe(path, seed, **overrides))
    if arch == "gpt-oss":
        return pathlib.Path(build_gpt_oss(path, seed, **overrides))
    if arch in MORE_ARCHS:
        return pathlib.Path(build_dense_more(arch, path, seed, **overrides))
    if arch not in DENSE_ARCHS:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHS)}")
    return _build_dense(arch, path, seed, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=pathlib.Path, help="directory to write <arch>.gguf files into")
    parser.add_argument("--arch", action="append", choices=ARCHS, help="architecture (repeatable; default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("f32", "f16"), default="f32", help="storage type of the matrices")
    args = parser.parse_args(argv)

    for arch in args.arch or ARCHS:
        overrides = {"dtype": args.dtype} if args.dtype != "f32" else {}
        out = make_tiny_model(arch, args.outdir / f"{arch}.gguf", seed=args.seed, **overrides)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
