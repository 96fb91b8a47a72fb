"""What every tiny test model shares: the small SentencePiece-style vocabulary (with byte fallback,
so llama.cpp tokenizes any UTF-8 text), a GGUF writer with the general and tokenizer keys, and an
atomic write (the package's, :func:`ridgefill_cpp.core.files.atomic_path`); the seeded weights, the
configuration checks every builder makes, and the tensors every model has (embedding, output
head, attention projections). The architecture builders (``tiny_models`` for the dense
ones, ``tiny_dense_more.py``, ``tiny_gpt_oss.py``, ``tiny_qwen35`` for the Gated DeltaNet
hybrids) import it; it imports none of them.
"""

from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterable, Mapping

import numpy as np

import gguf
from ..core.files import atomic_path

# --------------------------------------------------------------------------------------------
# tokenizer

# gguf.TokenType values, spelled out so that the file does not depend on a particular gguf-py
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_BYTE = 6

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

_SPACE = "\u2581"  # SentencePiece's word-boundary marker "▁"

_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-:;()\""

_BIGRAMS = (
    "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le "
    "ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur"
).split()

_WORDS = (
    "the and of to in is that it for was on are with as be this have from or one had by word "
    "but not what all were we when your can said use an each she do how their if will up out "
    "many then them so some her make like him into time has two more go see no way my than "
    "been who now long day did get may part"
).split()


def tokenizer_vocab() -> tuple[list[str], list[float], list[int]]:
    """The tiny SentencePiece vocabulary: (pieces, scores, token types).

    Layout: ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens ``<0x00>``..``<0xFF>``, then the
    normal pieces: single characters, common bigrams, and every prefix of "▁word" for a list of
    common words (so llama.cpp's bigram merging can reach each whole word). Scores favour longer
    pieces, as SentencePiece's log-probabilities do for frequent words.
    """
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL] + [TOKEN_TYPE_BYTE] * 256

    normal: list[str] = [_SPACE, *_CHARS, *_BIGRAMS]
    for word in _WORDS:
        spaced = _SPACE + word
        normal.extend(spaced[:n] for n in range(2, len(spaced) + 1))
    seen: set[str] = set()
    for rank, piece in enumerate(normal):
        if piece in seen:
            continue
        seen.add(piece)
        pieces.append(piece)
        # longer pieces win merges; ties broken by list order (earlier = more frequent)
        scores.append(-10.0 + len(piece) - rank * 1e-4)
        types.append(TOKEN_TYPE_NORMAL)
    return pieces, scores, types


# --------------------------------------------------------------------------------------------
# writer helpers


def new_writer(path: os.PathLike[str] | str, arch: str) -> gguf.GGUFWriter:
    """A GGUFWriter for a tiny model of `arch` with the general.* keys and the tokenizer added.

    `path` is the destination that will be passed to :func:`write_and_close`; nothing is written
    before that call, and the file's content does not depend on it (the same model is
    byte-identical wherever it is written). The caller adds the architecture's hyperparameters
    (``<arch>.*`` keys, e.g. with :func:`add_arch_keys`) and its tensors.
    """
    if not str(path):
        raise ValueError("new_writer: empty destination path")
    writer = gguf.GGUFWriter(None, arch)  # general.architecture
    writer.add_string("general.type", "model")
    writer.add_string("general.name", f"ridgefill tiny {arch}")
    writer.add_string("general.description", "random weights, for tests only (ridgefill_cpp/testing/tiny_models.py)")

    pieces, scores, types = tokenizer_vocab()
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", pieces)
    writer.add_array("tokenizer.ggml.scores", scores)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", UNK_ID)
    writer.add_uint32("tokenizer.ggml.bos_token_id", BOS_ID)
    writer.add_uint32("tokenizer.ggml.eos_token_id", EOS_ID)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_eos_token", False)
    return writer


def add_size_keys(writer: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    """``<arch>.vocab_size``, ``context_length``, ``embedding_length`` and ``block_count`` of `cfg`."""
    writer.add_uint32(f"{arch}.vocab_size", cfg.n_vocab)
    writer.add_uint32(f"{arch}.context_length", cfg.n_ctx)
    writer.add_uint32(f"{arch}.embedding_length", cfg.n_embd)
    writer.add_uint32(f"{arch}.block_count", cfg.n_layer)


def add_head_keys(writer: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    """``<arch>.attention.head_count``, ``head_count_kv``, ``key_length`` and ``value_length``
    (both `cfg.head_dim`)."""
    writer.add_uint32(f"{arch}.attention.head_count", cfg.n_head)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.n_head_kv)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)


def write_tiny_model(path: os.PathLike[str] | str, arch: str, dtype: str,
                     add_keys: Callable[[gguf.GGUFWriter], None],
                     add_tensors: Callable[[gguf.GGUFWriter], None]) -> pathlib.Path:
    """Write a tiny model of `arch` to `path` (atomically) and return the path: :func:`new_writer`,
    the ``<arch>.*`` keys (`add_keys`), ``general.file_type`` for `dtype`, the tensors
    (`add_tensors`), then :func:`write_and_close`."""
    writer = new_writer(path, arch)
    add_keys(writer)
    writer.add_uint32("general.file_type", 1 if dtype == "f16" else 0)  # MOSTLY_F16 / ALL_F32
    add_tensors(writer)
    return write_and_close(writer, path)


def write_and_close(writer: gguf.GGUFWriter, path: os.PathLike[str] | str) -> pathlib.Path:
    """Write header, key/values and tensors of `writer` to `path`, atomically
    (:func:`ridgefill_cpp.core.files.atomic_path`: a temporary file in the same directory, renamed into
    place once complete), so `path` never holds a half-written model. Returns `path` as a Path.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        try:
            writer.write_header_to_file(path=pathlib.Path(tmp))
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return path


class WeightFactory:
    """Seeded random tensors with the scales the tiny models use."""

    def __init__(self, seed: int, dtype: str = "f32"):
        self.rng = np.random.default_rng(seed)
        self.matrix_dtype = np.float16 if dtype == "f16" else np.float32

    def matrix(self, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        """A [n_out, n_in] projection (numpy layout; ggml sees it as {n_in, n_out})."""
        w = self.rng.normal(0.0, gain / math.sqrt(n_in), size=(n_out, n_in))
        return w.astype(self.matrix_dtype)

    def norm(self, n: int, center: float = 1.0, noise: float = 0.1) -> np.ndarray:
        return (center + noise * self.rng.standard_normal(n)).astype(np.float32)

    def bias(self, n: int, scale: float = 0.1) -> np.ndarray:
        return (scale * self.rng.standard_normal(n)).astype(np.float32)

    def experts(self, n_expert: int, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        """``[n_expert, n_out, n_in]`` stacked projections (ggml ``{n_in, n_out, n_expert}``), one
        :meth:`matrix` per expert, drawn in expert order."""
        return np.stack([self.matrix(n_out, n_in, gain=gain) for _ in range(n_expert)])


# --------------------------------------------------------------------------------------------
# configurations


@dataclass(frozen=True)
class TinyShape:
    """The sizes the dense-style tiny models share (``tiny_models.TinyConfig`` and
    ``tiny_dense_more.MoreTinyConfig`` add their own fields after these); the vocabulary is
    always the tokenizer's."""

    n_ctx: int = 2048
    n_embd: int = 64
    n_layer: int = 6
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    rms_eps: float = 1e-6

    @property
    def n_vocab(self) -> int:
        return len(tokenizer_vocab()[0])


def configure(cls: type, arch: str, overrides: Mapping[str, Any], defaults: Mapping[str, Any] | None = None,
              tuples: Mapping[str, Callable[[Any], Any]] | None = None) -> Any:
    """``cls(**defaults)`` with `overrides` applied: unknown fields are a TypeError naming `arch`;
    a field of `tuples` given (and not None) becomes a tuple of its entries converted by the mapped
    function (e.g. ``{"swa_pattern": bool}``)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown tiny-model option(s) for {arch}: {', '.join(unknown)}")
    overrides = dict(overrides)
    for name, convert in (tuples or {}).items():
        if overrides.get(name) is not None:
            overrides[name] = tuple(convert(x) for x in overrides[name])
    return replace(cls(**(defaults or {})), **overrides)


def with_tokenizer_vocab(cfg: Any) -> Any:
    """`cfg` with ``n_vocab`` 0 set to the tokenizer's size; a smaller one is a ValueError."""
    n_tok = len(tokenizer_vocab()[0])
    if cfg.n_vocab == 0:
        cfg = replace(cfg, n_vocab=n_tok)
    if cfg.n_vocab < n_tok:
        raise ValueError(f"n_vocab must be at least the tokenizer's {n_tok} tokens")
    return cfg


def shape_problems(cfg: Any, *, layers: bool = True) -> list[str]:
    """What is wrong with the fields every tiny model has, in this order: ``dtype``, ``n_head`` /
    ``n_head_kv`` and (`layers`) ``n_layer`` / ``head_dim``."""
    problems = []
    if cfg.dtype not in ("f32", "f16"):
        problems.append(f"dtype must be 'f32' or 'f16', not {cfg.dtype!r}")
    if cfg.n_head % cfg.n_head_kv:
        problems.append(f"n_head ({cfg.n_head}) must be a multiple of n_head_kv ({cfg.n_head_kv})")
    if layers and (cfg.n_layer < 1 or cfg.head_dim % 2):
        problems.append("n_layer must be positive and head_dim even")
    return problems


def check_shape(cfg: Any, *, layers: bool = True) -> None:
    """Raise a ValueError with the first of :func:`shape_problems`, if any."""
    problems = shape_problems(cfg, layers=layers)
    if problems:
        raise ValueError(problems[0])


# --------------------------------------------------------------------------------------------
# tensors every model has (lists of (name, tensor), drawn in list order)

Tensors = list[tuple[str, np.ndarray]]


def head_tensors(wf: WeightFactory, n_vocab: int, d: int, *, embd_gain: float, tied: bool = False) -> Tensors:
    """``token_embd`` (drawn with `embd_gain`), ``output_norm`` and, unless `tied`, ``output.weight``."""
    out = [("token_embd.weight", wf.matrix(n_vocab, d, gain=embd_gain)), ("output_norm.weight", wf.norm(d))]
    if not tied:
        out.append(("output.weight", wf.matrix(n_vocab, d)))
    return out


def qkv_tensors(wf: WeightFactory, d: int, n_q: int, n_kv: int, *, bias: bool) -> Tensors:
    """``attn_{q,k,v}.weight`` and, with `bias`, then ``attn_{q,k,v}.bias`` (names without the layer prefix)."""
    out = [("attn_q.weight", wf.matrix(n_q, d)), ("attn_k.weight", wf.matrix(n_kv, d)),
           ("attn_v.weight", wf.matrix(n_kv, d))]
    if bias:
        out += [("attn_q.bias", wf.bias(n_q)), ("attn_k.bias", wf.bias(n_kv)), ("attn_v.bias", wf.bias(n_kv))]
    return out


def add_tensors(writer: gguf.GGUFWriter, tensors: Iterable[tuple[str, np.ndarray]], prefix: str = "") -> None:
    """``writer.add_tensor(prefix + name, tensor)`` for each, in order."""
    for name, tensor in tensors:
        writer.add_tensor(prefix + name, tensor)
