"""Compact maps (docs/design.md §7.1): quantized map tensors and low-rank maps.

A ridge map is a full ``n_embd × n_embd`` matrix per late layer. Two ways make it smaller, and they
combine:

- **Quantization** (``dtype``): the map matrices are stored as one of ggml's block types and
  multiplied as they are by ggml's ``mul_mat`` on every backend (no new kernel). Quantized with
  llama.cpp's own quantizers (``ggml_quantize_chunk`` of the patched libggml, what
  ``llama-quantize`` runs), with the fit's input second moments ``E[φ(x_S)²]`` as the importance
  matrix where the type uses one (Q4_0, Q4_K): the map's inputs are known, so the error is
  weighted where the inputs are large. The biases stay F32. Read back, the file's bytes are
  dequantized by gguf-py (an implementation independent of ggml's), which is what the oracle applies.
- **Low rank** (``form``): ``A = I + U Vᵀ`` (``"identity_low_rank"``, the correction of identity
  fill is low rank) or ``A = U Vᵀ`` (``"low_rank"``), with ``U`` ``[n_embd, r]`` and ``Vᵀ``
  ``[r, n_embd]``, applied as two thin products. The factors are the best rank-r correction in the
  metric of the calibration inputs (reduced-rank regression): with ``M = A − I`` (or ``A``) and the
  centred input covariance ``C``, ``M C^½ = P S Rᵀ``, ``U = P_r``, ``Vᵀ = P_rᵀ M``; the bias is
  re-centred, ``b_r = b + (A − A_r) μ_x``. The rank is given, or the smallest whose held-out error
  keeps a given share of the full map's gain over the form's baseline (identity fill, or the mean).

The module imports numpy only; the quantizer loads the patched libggml on first use.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

#: storage types of the map matrices, ``fit --dtype`` names
DTYPES = ("f16", "f32", "q8_0", "q4_0", "q4_k")
#: quantized ones (ggml block types)
QUANTIZED = ("q8_0", "q4_0", "q4_k")
#: the map forms: the full matrix, identity plus a low-rank correction, a low-rank matrix
FORMS = ("full", "identity_low_rank", "low_rank")
#: ggml type ids (enum ggml_type; gguf-py's GGMLQuantizationType has the same values)
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "q4_k": 12}
#: elements per quantization block: a quantized row's length must be a multiple
BLOCK = {"f32": 1, "f16": 1, "q4_0": 32, "q8_0": 32, "q4_k": 256}
#: bytes per block
BLOCK_BYTES = {"f32": 4, "f16": 2, "q4_0": 18, "q8_0": 34, "q4_k": 144}


class CompactError(ValueError):
    """A storage type or rank that the maps cannot take (a row length that is not a multiple of the
    type's block, a rank out of range)."""


def dtype_name(ggml_type: int) -> str:
    """The ``fit --dtype`` name of a ggml type id, or the type's own name for others."""
    for name, t in GGML_TYPES.items():
        if t == ggml_type:
            return name
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name.lower()
    except ValueError:
        return f"ggml type {ggml_type}"


def row_bytes(dtype: str, n: int) -> int:
    """Bytes of one stored row of ``n`` elements."""
    return n // BLOCK[dtype] * BLOCK_BYTES[dtype]


def check_dtype(dtype: str, row_lengths: Sequence[int], what: str = "the maps") -> None:
    """Raise :class:`CompactError` unless every row length is a multiple of ``dtype``'s block."""
    if dtype not in DTYPES:
        raise CompactError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    bad = sorted({n for n in row_lengths if n % BLOCK[dtype]})
    if bad:
        alt = [d for d in QUANTIZED if all(n % BLOCK[d] == 0 for n in row_lengths)]
        raise CompactError(f"{dtype} stores rows in blocks of {BLOCK[dtype]} elements; {what} have rows of "
                           f"{', '.join(map(str, bad))}" + (f": use {' or '.join(alt)}" if alt else ""))


def map_bytes(n_embd: int, n_maps: int, dtype: str = "f16", rank: int | None = None) -> int:
    """Bytes of ``n_maps`` maps of width ``n_embd`` stored as ``dtype`` (full, or low rank ``rank``),
    biases (F32) included: what a loaded copy takes."""
    # full: d rows of d; low rank: Vᵀ (r rows of d) and U (d rows of r)
    per = rank * row_bytes(dtype, n_embd) + n_embd * row_bytes(dtype, rank) if rank else n_embd * row_bytes(dtype, n_embd)
    return n_maps * (per + 4 * n_embd)


# ------------------------------------------------------------------------------------------------
# quantization (llama.cpp's quantizers) and dequantization (gguf-py's)

@lru_cache(maxsize=1)
def _ggml_base() -> ctypes.CDLL:
    from ..core.native import LIB_DIR

    names = ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll")
    for name in names:
        if (LIB_DIR / name).is_file():
            lib = ctypes.CDLL(str(LIB_DIR / name))
            break
    else:
        raise OSError(f"libggml-base not found in {LIB_DIR}")
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def quantize(x: np.ndarray, dtype: str, importance: np.ndarray | None = None) -> np.ndarray:
    """``x`` [rows, n] (float) as ``dtype``: a float array for f16/f32, else the raw blocks as
    uint8 [rows, row_bytes], quantized by ggml (``ggml_quantize_chunk``) with ``importance``
    ([n], non-negative: the inputs' second moments) as the importance matrix where the type uses one."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise CompactError(f"quantize takes a matrix, not shape {x.shape}")
    check_dtype(dtype, [x.shape[1]], "the matrix")
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16)
    rows, n = x.shape
    out = np.zeros((rows, row_bytes(dtype, n)), dtype=np.uint8)
    imat = None
    if importance is not None:
        imat = np.ascontiguousarray(importance, dtype=np.float32)
        if imat.shape != (n,) or not (np.isfinite(imat).all() and (imat >= 0).all()):
            raise CompactError(f"importance must be {n} finite non-negative values")
    lib = _ggml_base()
    lib.ggml_quantize_init(GGML_TYPES[dtype])
    written = lib.ggml_quantize_chunk(GGML_TYPES[dtype], x.ctypes.data, out.ctypes.data, 0, rows, n,
                                      None if imat is None else imat.ctypes.data)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def dequantize(q: np.ndarray, dtype: str, n: int) -> np.ndarray:
    """The float32 values [rows, n] of :func:`quantize`'s output (gguf-py's dequantizers)."""
    if dtype in ("f16", "f32"):
        return np.asarray(q, dtype=np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return np.ascontiguousarray(gguf_dequantize(q, GGMLQuantizationType(GGML_TYPES[dtype])),
                                dtype=np.float32).reshape(-1, n)


def round_trip(x: np.ndarray, dtype: str, importance: np.ndarray | None = None) -> np.ndarray:
    """``x`` as a map stored as ``dtype`` reads back (float32)."""
    return dequantize(quantize(x, dtype, importance), dtype, np.shape(x)[1])


def cpu_activation_round(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` [rows, n] as ggml's CPU backend hands it to the dot product with a matrix of type
    ``dtype``: converted to the type's ``vec_dot_type`` and back - F16 for f16, Q8_0 blocks of 32
    for q8_0 and q4_0, Q8_K blocks of 256 for q4_k (``quantize_row_q8_0_ref``,
    ``quantize_row_q8_K_ref``), unchanged for f32. The products themselves are then exact, so the
    oracle (:meth:`ridgefill_cpp.maps.mapfile.RidgeMaps.predict` with ``activation_rounding``) meets
    libllama's CPU fill step to float32 rounding. Other backends round activations their own way."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "f32":
        return x32.astype(np.float64)
    if dtype == "f16":
        return x32.astype(np.float16).astype(np.float64)
    rows, n = x32.shape
    if dtype in ("q8_0", "q4_0"):  # Q8_0: d = amax/127 stored as F16, q = roundf(x / d)
        blocks = x32.reshape(rows, n // 32, 32)
        d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        q = np.trunc(blocks * inv + np.copysign(np.float32(0.5), blocks * inv))  # roundf: half away from zero
        return (q * d.astype(np.float16).astype(np.float64)).reshape(rows, n)
    if dtype == "q4_k":  # Q8_K: the signed value of largest magnitude -> -127, d = 1/iscale in F32
        blocks = x32.reshape(rows, n // 256, 256)
        idx = np.abs(blocks).argmax(axis=-1)[..., None]
        mx = np.take_along_axis(blocks, idx, axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(mx == 0, np.float32(0), np.float32(-127) / mx).astype(np.float32)
            d = np.where(mx == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
        v = np.minimum(np.rint(iscale * blocks), 127)  # nearest_int: round half to even
        return (v * d.astype(np.float64)).reshape(rows, n)
    raise CompactError(f"no CPU activation rounding for {dtype!r}")


# ------------------------------------------------------------------------------------------------
# low rank (reduced-rank regression in the calibration inputs' metric)

@dataclass
class LowRank:
    """The rank-ordered factors of one map: ``A_r = base + P[:, :r] (P[:, :r]ᵀ M)``."""

    form: str
    p: np.ndarray  # [d, d] orthonormal, columns by decreasing weighted singular value
    m: np.ndarray  # [d, d]: A − I or A
    a: np.ndarray  # [d, d] the full map
    b: np.ndarray  # [d]
    mx: np.ndarray  # [d] the calibration inputs' mean

    def factors(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(U [d, r], Vᵀ [r, d], b_r), float64."""
        u = self.p[:, :rank]
        vt = u.T @ self.m
        return u, vt, self.b + (self.a - self.dense_of(u, vt)) @ self.mx

    def dense_of(self, u: np.ndarray, vt: np.ndarray) -> np.ndarray:
        """The matrix the factors stand for: I + U Vᵀ or U Vᵀ."""
        return dense_map(u, vt, self.form)


def dense_map(up: np.ndarray, down: np.ndarray, form: str) -> np.ndarray:
    """The matrix low-rank factors stand for (float64): I + U Vᵀ (``"identity_low_rank"``) or U Vᵀ."""
    uv = np.asarray(up, dtype=np.float64) @ np.asarray(down, dtype=np.float64)
    return uv + np.eye(uv.shape[0]) if form == "identity_low_rank" else uv


def low_rank_basis(a: np.ndarray, b: np.ndarray, mx: np.ndarray, cxx: np.ndarray, form: str) -> LowRank:
    """The reduced-rank factorisation of the map ``(a, b)`` fitted on inputs of mean ``mx`` and
    centred covariance ``cxx`` (all float64)."""
    if form not in FORMS[1:]:
        raise CompactError(f"low-rank form must be one of {', '.join(FORMS[1:])}, not {form!r}")
    a = np.asarray(a, dtype=np.float64)
    d = a.shape[0]
    m = a - np.eye(d) if form == "identity_low_rank" else a
    evals, q = np.linalg.eigh(np.asarray(cxx, dtype=np.float64))
    half = (q * np.sqrt(np.clip(evals, 0.0, None))) @ q.T
    p, _, _ = np.linalg.svd(m @ half)
    return LowRank(form, p, m, a, np.asarray(b, dtype=np.float64), np.asarray(mx, dtype=np.float64))


def held_out_errors(lr: LowRank, hx: np.ndarray, hy: np.ndarray, ranks: Sequence[int]) -> dict[int, float]:
    """Mean squared held-out error of the rank-r map for each r in ``ranks`` (0: the form's
    baseline, identity fill or the mean; d: the full map), in O(rows · d²) for all ranks together."""
    hx = np.asarray(hx, dtype=np.float64)
    hy = np.asarray(hy, dtype=np.float64)
    d = lr.a.shape[0]
    base = np.eye(d) if lr.form == "identity_low_rank" else np.zeros((d, d))
    xc = hx - lr.mx
    # rank r predicts b_r + A_r x = (b + A μx) + base (x − μx) + P_r P_rᵀ M (x − μx)
    t = hy - (lr.b + lr.a @ lr.mx) - xc @ base.T  # what the correction must explain
    z = (xc @ lr.m.T) @ lr.p  # [rows, d]: the correction's coordinates along P
    tp = t @ lr.p
    gain = np.concatenate([[0.0], np.cumsum(2.0 * (tp * z).sum(0) - (z * z).sum(0))])
    total = float((t * t).sum())
    n = max(hx.shape[0], 1)
    return {int(r): (total - float(gain[min(int(r), d)])) / n for r in ranks}


def rank_for_share(errors: dict[int, float], share: float, full: int) -> int:
    """The smallest rank whose error keeps ``share`` of the full map's gain over the baseline
    (``errors`` has rank 0 and ``full``)."""
    if not 0.0 < share <= 1.0:
        raise CompactError(f"the share of the gain to keep must be in (0, 1], not {share!r}")
    e0, ef = errors[0], errors[full]
    want = e0 - share * (e0 - ef)
    for r in sorted(errors):
        if r > 0 and errors[r] <= want + 1e-12 * max(abs(e0), 1.0):
            return r
    return full


def rank_grid(d: int, dtype: str) -> list[int]:
    """The ranks a low-rank map of width ``d`` stored as ``dtype`` may take: multiples of the
    type's block (for U's rows), at least 8 apart, below d."""
    step = max(BLOCK[dtype], 8)
    return list(range(step, d, step))
