"""What every tiny test model shares: the small SentencePiece-style vocabulary (with byte fallback,
so llama.cpp tokenizes any UTF-8 text), a GGUF writer with the general and tokenizer keys, and an
atomic write (the package's, :func:`ridgefill_cpp.files.atomic_path`). The architecture builders
(``make_tiny_models.py`` for the dense ones, ``tiny_qwen35.py`` for the Gated DeltaNet hybrid)
import it; it imports neither.
"""

from __future__ import annotations

import math
import os
import pathlib

import numpy as np

import gguf
from ridgefill_cpp.files import atomic_path

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
    writer.add_string("general.description", "random weights, for tests only (tools/make_tiny_models.py)")

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


def write_and_close(writer: gguf.GGUFWriter, path: os.PathLike[str] | str) -> pathlib.Path:
    """Write header, key/values and tensors of `writer` to `path`, atomically
    (:func:`ridgefill_cpp.files.atomic_path`: a temporary file in the same directory, renamed into
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
