"""The RidgeFill map file (docs/design.md §7): GGUF side tensors, their metadata schema, reading and writing.

One module owns the schema (key names, tensor names) so that ``fit``, ``info``, the runtime loader
and the tests agree. A map file is a GGUF adapter::

    general.type = "adapter", adapter.type = "ridgefill", general.architecture = <the model's>
    ridgefill.*                                   metadata below
    blk.{l}.ridgefill_a.weight  [n_embd, n_embd]  F16/F32/Q8_0/Q4_0/Q4_K, numpy [out, in]: ggml mul_mat(A, x) = A·x
    blk.{l}.ridgefill_b.bias    [n_embd]          F32
    for every late layer l = S+1 .. L-1          (l = S uses x_S itself)

or, for a low-rank map (``ridgefill.map_form`` = ``"identity_low_rank"``: A = I + U Vᵀ, or
``"low_rank"``: A = U Vᵀ; :mod:`ridgefill_cpp.maps.compact`), instead of ``ridgefill_a``::

    blk.{l}.ridgefill_a_down.weight  [r, n_embd]  Vᵀ, numpy [r, in]
    blk.{l}.ridgefill_a_up.weight    [n_embd, r]  U, numpy [out, r]
    with r = ridgefill.map_ranks[l - S - 1]

Every map matrix of a file has one storage type (``fit --dtype``); a file without
``ridgefill.map_form`` holds full matrices.
    blk.{l}.ridgefill_state_gain.weight [n_v_heads]  F32, optional (hybrid models, qwen35): the
        per-value-head gains of the terminal-state correction (docs/design.md §4 item 4;
        :mod:`ridgefill_cpp.fitting.state_gains`), for every mapped layer l that is recurrent (Gated
        DeltaNet) or for none; n_v_heads = the model's ``{arch}.ssm.time_step_rank``; with them,
        optionally, ``ridgefill.state_gain.*``: the operating point they were fitted at
        (:data:`STATE_GAIN_KEYS`; files written before these keys existed have none)

Every tensor's bytes have a content digest, ``ridgefill.digest.xxh64``: one ``"NAME HEX"`` string per
tensor, XXH64 (seed 0) of the tensor data as stored - the digest ``llama-gguf-hash --xxh64`` prints
for it. ``fit`` and every rewrite (``tune``, ``fit --state-gains``) write it; :func:`read_map_file`
and the runtime loader check it, so a file corrupted after it was written (a bad copy, a flipped
bit) is refused naming the tensor. Files written before digests existed have none and still load.

The map predicts the input of layer l from the split-layer state of the same row:
``x̂_l = A_l φ(x_S) + b_l`` where φ is the identity (``input_norm = "none"``) or RMS
normalisation without weight (``"rms"``: ``x / sqrt(mean(x²) + eps)``), as recorded in the file.
"""

from __future__ import annotations

import math
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..core.files import check_output
from .fingerprint import model_fingerprint
from .gguf_copy import atomic_gguf_writer
from ..core.gguf_model import GGUFFileError, read_header, read_metadata, read_model_info, read_tensors
from ..core.settings import check as check_setting

# gguf-py is imported in the functions that read or write GGUF files: `import ridgefill_cpp` (and so
# `ridgefill-gguf --help`) does not pay its ~30 ms

FORMAT_VERSION = 1
ADAPTER_TYPE = "ridgefill"

# metadata keys
KEY_FORMAT_VERSION = "ridgefill.format_version"
KEY_TOOL_VERSION = "ridgefill.tool_version"
KEY_SPLIT = "ridgefill.split_layer"
KEY_N_LAYER = "ridgefill.n_layer"
KEY_N_EMBD = "ridgefill.n_embd"
KEY_OBJECTIVE = "ridgefill.objective"
KEY_INPUT_NORM = "ridgefill.input_norm"
KEY_INPUT_NORM_EPS = "ridgefill.input_norm_eps"
KEY_LAYERS = "ridgefill.layers"
KEY_LAMBDA = "ridgefill.lambda"
KEY_CALIB_TOKENS = "ridgefill.calibration.n_tokens"
KEY_CALIB_ROWS = "ridgefill.calibration.n_rows"
KEY_CALIB_SOURCE = "ridgefill.calibration.source"
KEY_CALIB_CTX = "ridgefill.calibration.ctx"
KEY_CALIB_SKIP = "ridgefill.calibration.skip_rows"
KEY_CALIB_CTX_MIX = "ridgefill.calibration.ctx_lengths"  # only for mixed-length windows
KEY_HELDOUT_ROWS = "ridgefill.quality.n_heldout_rows"
KEY_R2 = "ridgefill.quality.r2"
KEY_REL_ERR = "ridgefill.quality.rel_err_median"
KEY_ID_REL_ERR = "ridgefill.quality.identity_rel_err_median"
KEY_FINGERPRINT = "ridgefill.model.fingerprint"
KEY_MODEL_NAME = "ridgefill.model.name"
#: per-tensor content digests, "NAME HEX" (XXH64 of the tensor's bytes, seed 0)
KEY_DIGEST = "ridgefill.digest.xxh64"
#: "full" (A), "identity_low_rank" (A = I + U Vᵀ) or "low_rank" (A = U Vᵀ); absent: "full"
KEY_MAP_FORM = "ridgefill.map_form"
#: the rank r of each mapped layer's low-rank map (low-rank forms only)
KEY_MAP_RANKS = "ridgefill.map_ranks"
# the operating point the state gains were fitted at (optional, only with state-gain tensors)
KEY_STATE_GAIN_TAIL = "ridgefill.state_gain.tail"
KEY_STATE_GAIN_FRACTION = "ridgefill.state_gain.exact_fraction"
KEY_STATE_GAIN_SELECTOR = "ridgefill.state_gain.selector"
KEY_STATE_GAIN_VALUE_RESCALE = "ridgefill.state_gain.value_rescale"
KEY_STATE_GAIN_WINDOWS = "ridgefill.state_gain.windows"
KEY_STATE_GAIN_WINDOW_ROWS = "ridgefill.state_gain.window_rows"
STATE_GAIN_PREFIX = "ridgefill.state_gain."
#: state-gain setting (:attr:`RidgeMaps.state_gain_settings` name) -> (metadata key, GGUF value type name, what it is)
STATE_GAIN_KEYS: dict[str, tuple[str, str, str]] = {
    "tail": (KEY_STATE_GAIN_TAIL, "UINT32", "T, the last prompt rows kept exact"),
    "exact_fraction": (KEY_STATE_GAIN_FRACTION, "FLOAT32", "share of the prefix rows the selector keeps exact"),
    "selector": (KEY_STATE_GAIN_SELECTOR, "STRING", "exact-row selector"),
    "value_rescale": (KEY_STATE_GAIN_VALUE_RESCALE, "UINT32", "c, the value-scale rows (0: off)"),
    "windows": (KEY_STATE_GAIN_WINDOWS, "UINT32", "calibration windows the gains were fitted on"),
    "window_rows": (KEY_STATE_GAIN_WINDOW_ROWS, "UINT32", "rows per calibration window"),
}

#: the operating point chosen by ``ridgefill-gguf tune`` (optional; :func:`read_tuned_defaults`)
TUNED_PREFIX = "ridgefill.tuned."
#: tuned key (without the prefix) -> (GGUF value type name, required, what it is)
TUNED_KEYS: dict[str, tuple[str, bool, str]] = {
    "tail": ("UINT32", True, "T, the last prompt rows kept exact"),
    "exact_fraction": ("FLOAT64", True, "share of the prefix rows the selector keeps exact"),
    "selector": ("STRING", True, "exact-row selector"),
    "span": ("UINT32", False, "rows kept exact together around each top-scoring row (attention, probe)"),
    "key_rescale": ("UINT32", False, "c_K, the tail rows the per-head key scale is measured on (0: off)"),
    "budget": ("FLOAT64", False, "the novel-token ΔNLL budget (nats) the setting was chosen under"),
    "criterion": ("STRING", False, "'estimate' (point estimate <= budget) or 'upper' (CI upper bound, --strict)"),
    "delta_nll_novel": ("FLOAT64", False, "measured novel-token ΔNLL (nats), point estimate"),
    "delta_nll_novel_low": ("FLOAT64", False, "its 95 % bootstrap CI, lower bound"),
    "delta_nll_novel_high": ("FLOAT64", False, "its 95 % bootstrap CI, upper bound"),
    "delta_nll_all": ("FLOAT64", False, "measured ΔNLL over all scored tokens (nats)"),
    "speedup": ("FLOAT64", False, "measured prefill speedup over exact prefill (median ratio)"),
    "ceiling": ("FLOAT64", False, "the plan's compute ceiling 1/r"),
    "value_rescale": ("UINT32", False, "c, the value-scale rows the setting was measured with"),
    "n_docs": ("UINT32", False, "held-out documents measured"),
    "length": ("UINT32", False, "prompt length of the documents (tokens)"),
    "scored_rows": ("UINT32", False, "last prompt rows scored per document"),
    "retrieval_prompts": ("UINT32", False, "planted-code retrieval prompts the setting was checked on"),
    "retrieval_exact": ("UINT32", False, "of them, those exact prefill answers"),
    "retrieval_kept": ("UINT32", False, "of those, the ones the setting answers too"),
    "source": ("STRING", False, "the held-out text"),
    "tool_version": ("STRING", False, "ridgefill-cpp version that tuned"),
    "date": ("STRING", False, "when it was tuned (ISO 8601, UTC)"),
}

OBJECTIVES = ("raw", "normalized")
INPUT_NORMS = {"raw": "none", "normalized": "rms"}


def tensor_name_a(il: int) -> str:
    return f"blk.{il}.ridgefill_a.weight"


def tensor_name_a_down(il: int) -> str:
    return f"blk.{il}.ridgefill_a_down.weight"


def tensor_name_a_up(il: int) -> str:
    return f"blk.{il}.ridgefill_a_up.weight"


def tensor_name_b(il: int) -> str:
    return f"blk.{il}.ridgefill_b.bias"


def tensor_name_state_gain(il: int) -> str:
    return f"blk.{il}.ridgefill_state_gain.weight"


_STATE_GAIN_SUFFIX = ".ridgefill_state_gain.weight"


class MapFileError(ValueError):
    """A map file that cannot be used: unreadable, malformed, non-finite, or for another model."""


@dataclass
class MapFileMeta:
    architecture: str
    split_layer: int
    n_layer: int
    n_embd: int
    objective: str = "normalized"
    input_norm_eps: float = 1e-6
    layers: list[int] = field(default_factory=list)  # late layers with maps: S+1 .. L-1
    lambdas: list[float] = field(default_factory=list)
    calib_n_tokens: int = 0
    calib_n_rows: int = 0
    calib_source: str = ""
    calib_ctx: int = 0  # window length; with mixed-length windows the longest
    calib_skip_rows: int = 0
    calib_ctx_lengths: list[int] = field(default_factory=list)  # mixed-length windows: every length; else []
    heldout_n_rows: int = 0
    r2: list[float] = field(default_factory=list)
    rel_err_median: list[float] = field(default_factory=list)
    identity_rel_err_median: list[float] = field(default_factory=list)
    fingerprint: str = ""
    model_name: str = ""
    tool_version: str = ""
    format_version: int = FORMAT_VERSION
    #: the content digest the file's tensors were checked against ("xxh64"), "" when it has none
    digest: str = ""
    #: the map form (:data:`ridgefill_cpp.maps.compact.FORMS`) and, for the low-rank forms, each layer's rank
    map_form: str = "full"
    ranks: list[int] = field(default_factory=list)
    #: the storage type of the map matrices as read (:data:`ridgefill_cpp.maps.compact.DTYPES`), "" before writing
    dtype: str = ""

    @property
    def input_norm(self) -> str:
        return INPUT_NORMS[self.objective]

    @property
    def calib_windows(self) -> str:
        """The calibration windows' rows as text: ``"512"``, or ``"512+4096"`` for mixed lengths."""
        return "+".join(str(n) for n in self.calib_ctx_lengths) if len(self.calib_ctx_lengths) > 1 else str(self.calib_ctx)


@dataclass
class RidgeMaps:
    meta: MapFileMeta
    a: dict[int, np.ndarray]  # layer -> [n_embd, n_embd] (out, in), float32
    b: dict[int, np.ndarray]  # layer -> [n_embd], float32
    #: terminal-state gains, mapped recurrent layer -> [n_v_heads] float32 (empty: none in the file)
    g: dict[int, np.ndarray] = field(default_factory=dict)
    #: the operating point the gains were fitted at (:data:`STATE_GAIN_KEYS` names: tail,
    #: exact_fraction, selector, value_rescale, windows, window_rows); empty when the file does not
    #: record it (older files) or has no gains
    state_gain_settings: dict[str, Any] = field(default_factory=dict)
    #: low-rank maps: layer -> (U [n_embd, r], Vᵀ [r, n_embd]) float32, with ``a`` holding the matrix
    #: they stand for (I + U Vᵀ or U Vᵀ, :attr:`MapFileMeta.map_form`); empty for full maps
    factors: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    #: E[φ(x_S)²] per input dimension on the calibration rows (from ``fit``; not stored): the
    #: importance matrix a quantized map is written with (:func:`ridgefill_cpp.maps.compact.quantize`)
    importance: np.ndarray | None = None
    #: :meth:`predict` rounds each product's input as ggml's CPU backend does for the stored type
    #: (:func:`ridgefill_cpp.maps.compact.cpu_activation_round`): off, the exact product with the stored
    #: values; on, what libllama's CPU fill step computes (the oracle tests of quantized maps)
    activation_rounding: bool = False

    def predict(self, il: int, xs: np.ndarray) -> np.ndarray:
        """x̂_l for rows ``xs`` ([n, n_embd] split-layer states), as the runtime computes it (a
        low-rank map as its two thin products)."""
        xs = np.asarray(xs, dtype=np.float64)
        if self.meta.objective == "normalized":
            xs = xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + self.meta.input_norm_eps)
        if self.activation_rounding and self.meta.dtype:
            from .compact import cpu_activation_round

            rnd = lambda x: cpu_activation_round(x, self.meta.dtype)  # noqa: E731
        else:
            rnd = lambda x: x  # noqa: E731
        if il in self.factors:
            up, down = self.factors[il]
            out = rnd(rnd(xs) @ down.astype(np.float64).T) @ up.astype(np.float64).T + self.b[il]
            return out + xs if self.meta.map_form == "identity_low_rank" else out
        return rnd(xs) @ self.a[il].astype(np.float64).T + self.b[il]

    def stored(self, dtype: str) -> "RidgeMaps":
        """These maps as a file of storage type ``dtype`` reads them back (the quantization error
        included; :func:`write_map_file` stores the same bytes)."""
        from . import compact

        out = RidgeMaps(replace(self.meta, dtype=dtype), dict(self.a), dict(self.b), dict(self.g), dict(self.state_gain_settings),
                        {}, self.importance)
        if self.factors:
            for il, (up, down) in self.factors.items():
                up2 = compact.round_trip(up, dtype)
                down2 = compact.round_trip(down, dtype, self.importance)
                out.factors[il] = (up2, down2)
                out.a[il] = compact.dense_map(up2, down2, self.meta.map_form).astype(np.float32)
        else:
            out.a = {il: compact.round_trip(a, dtype, self.importance) for il, a in self.a.items()}
        return out


def write_map_file(path: os.PathLike | str, maps: RidgeMaps, *, dtype: str = "f16", overwrite: bool = False) -> Path:
    """Write ``maps`` atomically (:func:`ridgefill_cpp.core.files.atomic_path`: a temporary file in the
    same directory, then a rename). Only a regular file is replaced (a symlink, FIFO or device at
    ``path`` is refused, :class:`ridgefill_cpp.core.files.OutputPathError`), and only with ``overwrite``
    (``FileExistsError`` otherwise). A new file gets the mode ``open()`` gives (``0666 & ~umask``);
    a replaced file keeps its permission bits.

    ``dtype`` is the storage type of the map matrices (:data:`ridgefill_cpp.maps.compact.DTYPES`): a
    quantized type is written by ggml's quantizer with ``maps.importance`` as its importance matrix;
    a row length that is not a multiple of its block raises :class:`MapFileError`. Low-rank maps
    (``maps.factors``) are written as their two factors."""
    import gguf

    from . import compact

    meta = maps.meta
    if dtype not in compact.DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(compact.DTYPES)}, not {dtype!r}")
    check_maps(maps)
    rows = {meta.n_embd} | {int(up.shape[1]) for up, _ in maps.factors.values()}
    try:
        compact.check_dtype(dtype, sorted(rows), f"the maps of {meta.model_name or meta.architecture} "
                                                 f"({'n_embd' if len(rows) == 1 else 'n_embd and ranks'})")
    except compact.CompactError as e:
        raise MapFileError(str(e)) from None
    path = check_output(path, overwrite=overwrite)

    def add_matrix(w, name: str, x: np.ndarray, importance: np.ndarray | None = None) -> None:
        q = compact.quantize(x, dtype, importance)
        if dtype in compact.QUANTIZED:
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType(compact.GGML_TYPES[dtype]))
        else:
            w.add_tensor(name, q)
    with _map_writer(path, meta.architecture) as w:
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string("adapter.type", ADAPTER_TYPE)
        w.add_string("general.name", f"RidgeFill maps for {meta.model_name or meta.architecture} (S={meta.split_layer})")
        w.add_uint32(KEY_FORMAT_VERSION, meta.format_version)
        w.add_string(KEY_TOOL_VERSION, meta.tool_version or "unknown")
        w.add_uint32(KEY_SPLIT, meta.split_layer)
        w.add_uint32(KEY_N_LAYER, meta.n_layer)
        w.add_uint32(KEY_N_EMBD, meta.n_embd)
        w.add_string(KEY_OBJECTIVE, meta.objective)
        w.add_string(KEY_INPUT_NORM, meta.input_norm)
        w.add_float32(KEY_INPUT_NORM_EPS, meta.input_norm_eps)
        w.add_array(KEY_LAYERS, [int(x) for x in meta.layers])
        w.add_key_value(KEY_LAMBDA, [float(x) for x in meta.lambdas], gguf.GGUFValueType.ARRAY,
                        sub_type=gguf.GGUFValueType.FLOAT32)
        w.add_uint64(KEY_CALIB_TOKENS, meta.calib_n_tokens)
        w.add_uint64(KEY_CALIB_ROWS, meta.calib_n_rows)
        w.add_string(KEY_CALIB_SOURCE, meta.calib_source or "unspecified")  # gguf-py drops empty strings
        w.add_uint32(KEY_CALIB_CTX, meta.calib_ctx)
        w.add_uint32(KEY_CALIB_SKIP, meta.calib_skip_rows)
        if len(meta.calib_ctx_lengths) > 1:
            w.add_array(KEY_CALIB_CTX_MIX, [int(x) for x in meta.calib_ctx_lengths])
        w.add_uint64(KEY_HELDOUT_ROWS, meta.heldout_n_rows)
        for key, vals in ((KEY_R2, meta.r2), (KEY_REL_ERR, meta.rel_err_median), (KEY_ID_REL_ERR, meta.identity_rel_err_median)):
            w.add_key_value(key, [float(x) for x in vals], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        w.add_string(KEY_FINGERPRINT, meta.fingerprint or "unknown")
        w.add_string(KEY_MODEL_NAME, meta.model_name or meta.architecture)
        if meta.map_form != "full":
            w.add_string(KEY_MAP_FORM, meta.map_form)
            w.add_array(KEY_MAP_RANKS, [int(maps.factors[il][0].shape[1]) for il in meta.layers])
        for il in meta.layers:
            if il in maps.factors:
                up, down = maps.factors[il]
                add_matrix(w, tensor_name_a_down(il), down, maps.importance)
                add_matrix(w, tensor_name_a_up(il), up)
            else:
                add_matrix(w, tensor_name_a(il), maps.a[il], maps.importance)
            w.add_tensor(tensor_name_b(il), np.ascontiguousarray(maps.b[il], dtype=np.float32))
        if maps.g:
            for key, value, kind in state_gain_key_values(maps.state_gain_settings):
                w.add_key_value(key, value, kind)
        for il in sorted(maps.g):
            w.add_tensor(tensor_name_state_gain(il), np.ascontiguousarray(maps.g[il], dtype=np.float32))
    return path


def tensor_digest(data) -> str:
    """The content digest of one tensor: XXH64 (seed 0) of its bytes as stored, 16 hex digits (what
    ``llama-gguf-hash --xxh64`` prints for it)."""
    import xxhash

    return xxhash.xxh64(memoryview(np.ascontiguousarray(data)).cast("B"), seed=0).hexdigest()


@contextmanager
def _map_writer(path: os.PathLike | str, arch: str, *, mode: int | None = None) -> Iterator[Any]:
    """:func:`ridgefill_cpp.maps.gguf_copy.atomic_gguf_writer` that records the digest of every tensor
    added and writes them as :data:`KEY_DIGEST` (every map file gets one)."""
    with atomic_gguf_writer(path, arch, mode=mode) as w:
        digests: list[str] = []
        add_tensor = w.add_tensor

        def add(name: str, tensor: np.ndarray, *args: Any, **kwargs: Any) -> None:
            digests.append(f"{name} {tensor_digest(tensor)}")
            add_tensor(name, tensor, *args, **kwargs)

        w.add_tensor = add
        yield w
        w.add_array(KEY_DIGEST, digests)


def check_digests(path: os.PathLike | str, md: dict[str, Any] | None = None) -> str:
    """Check every tensor of the map file at ``path`` against its :data:`KEY_DIGEST` entry.
    Returns ``"xxh64"`` (checked) or ``""`` (the file has no digests: written before they existed).
    Raises :class:`MapFileError` naming the tensor whose bytes changed, or a tensor without a digest."""
    from ..core.gguf_model import open_gguf

    md = read_metadata(path) if md is None else md
    if KEY_DIGEST not in md:
        return ""
    entries = md[KEY_DIGEST]
    want: dict[str, str] = {}
    for e in entries if isinstance(entries, list) else [entries]:
        name, _, hexd = str(e).partition(" ")
        if not name or len(hexd) != 16 or any(c not in "0123456789abcdef" for c in hexd) or name in want:
            raise MapFileError(f"{path}: {KEY_DIGEST}: malformed entry {str(e)[:80]!r} (expected 'TENSOR HEX16', one per tensor)")
        want[name] = hexd
    try:
        reader = open_gguf(path)
    except GGUFFileError as e:
        raise MapFileError(str(e)) from None
    names = [t.name for t in reader.tensors]
    if sorted(names) != sorted(want):
        missing = sorted(set(names) - set(want)) or sorted(set(want) - set(names))
        raise MapFileError(f"{path}: {KEY_DIGEST} does not list the file's tensors (differs at {missing[0]}): "
                           "the file was altered after it was written")
    for t in reader.tensors:
        got = tensor_digest(t.data)
        if got != want[t.name]:
            raise MapFileError(f"{path}: tensor {t.name}: its bytes give xxh64 {got}, the file records {want[t.name]}: "
                               "the file was corrupted after it was written (copy it again, or fit new maps)")
    del reader
    return "xxh64"


def state_gain_key_values(settings: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """``(key, value, GGUFValueType)`` of the ``ridgefill.state_gain.*`` keys for ``settings``
    (:data:`STATE_GAIN_KEYS` names; None values are left out). Raises ``ValueError`` for an unknown
    name or a value of the wrong kind."""
    import gguf

    settings = dict(settings or {})
    unknown = [k for k in settings if k not in STATE_GAIN_KEYS]
    if unknown:
        raise ValueError(f"unknown state-gain settings: {', '.join(unknown)} (known: {', '.join(STATE_GAIN_KEYS)})")
    out = []
    for name, (key, kind, _) in STATE_GAIN_KEYS.items():
        value = settings.get(name)
        if value is None:
            continue
        if kind == "STRING":
            value = str(value)
            if not value:
                raise ValueError(f"state-gain {name} must not be empty")
        elif kind == "UINT32":
            if isinstance(value, bool) or int(value) != value or not 0 <= int(value) < 2**32:
                raise ValueError(f"state-gain {name} = {value!r} must be a non-negative integer")
            value = int(value)
        else:
            value = float(value)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"state-gain {name} = {value!r} outside [0, 1]")
        out.append((key, value, getattr(gguf.GGUFValueType, kind)))
    return out


def state_gain_settings_from_metadata(md: dict[str, Any], path: os.PathLike | str = "") -> dict[str, Any]:
    """The ``ridgefill.state_gain.*`` values of a map file's metadata as ``{name: value}`` (empty
    when it has none). Raises :class:`MapFileError` on unknown or ill-typed keys."""
    where = f"{path}: " if str(path) else ""
    by_key = {key: (name, kind) for name, (key, kind, _) in STATE_GAIN_KEYS.items()}
    out: dict[str, Any] = {}
    for key, value in md.items():
        if not key.startswith(STATE_GAIN_PREFIX):
            continue
        if key not in by_key:
            raise MapFileError(f"{where}unknown state-gain key {key}")
        name, kind = by_key[key]
        ok = (isinstance(value, str) if kind == "STRING" else
              isinstance(value, int) and not isinstance(value, bool) if kind == "UINT32" else
              isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            raise MapFileError(f"{where}{key} = {value!r} is not a {kind.lower()}")
        if (kind == "UINT32" and not 0 <= value < 2**32) or (kind == "FLOAT32" and not 0.0 <= value <= 1.0):
            raise MapFileError(f"{where}{key} = {value!r} outside {'0..2^32-1' if kind == 'UINT32' else '[0, 1]'}")
        # an F32 in the file: the shortest decimal that round-trips to the same float32 (0.1, not 0.100000001)
        out[name] = float(np.format_float_positional(np.float32(value), unique=True)) if kind == "FLOAT32" else value
    return {k: out[k] for k in STATE_GAIN_KEYS if k in out}


def check_maps(maps: RidgeMaps) -> None:
    """Structural and numeric checks shared by the writer and the reader."""
    m = maps.meta
    check_meta_values(m)
    if m.objective not in OBJECTIVES:
        raise MapFileError(f"unknown objective {m.objective!r} (expected one of {', '.join(OBJECTIVES)})")
    if not 0 < m.split_layer < m.n_layer:
        raise MapFileError(f"split layer {m.split_layer} outside 1..{m.n_layer - 1}")
    want = list(range(m.split_layer + 1, m.n_layer))
    if list(m.layers) != want:
        raise MapFileError(f"maps for layers {list(m.layers)}, expected {want} (S+1 .. L-1)")
    for name, vals in (("lambda", m.lambdas), ("r2", m.r2), ("rel_err_median", m.rel_err_median),
                       ("identity_rel_err_median", m.identity_rel_err_median)):
        if len(vals) != len(want):
            raise MapFileError(f"{name} has {len(vals)} entries, expected one per mapped layer ({len(want)})")
    for il in want:
        a, b = maps.a.get(il), maps.b.get(il)
        if m.map_form != "full" and il not in maps.factors:
            raise MapFileError(f"layer {il}: missing {tensor_name_a_up(il)} / {tensor_name_a_down(il)} ({m.map_form} maps)")
        if a is None or b is None:
            raise MapFileError(f"layer {il}: missing {tensor_name_a(il) if a is None else tensor_name_b(il)}")
        if a.shape != (m.n_embd, m.n_embd) or b.shape != (m.n_embd,):
            raise MapFileError(f"layer {il}: A {a.shape} / b {b.shape}, expected ({m.n_embd}, {m.n_embd}) / ({m.n_embd},)")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise MapFileError(f"layer {il}: the map has NaN or Inf values")
    check_factors(maps, want)
    check_state_gains(maps.g, want)


def check_factors(maps: RidgeMaps, layers: Sequence[int]) -> None:
    """The map form and, for the low-rank forms, one pair of factors per mapped layer of matching
    shapes (U [n_embd, r], Vᵀ [r, n_embd], 1 <= r < n_embd), finite, with ``meta.ranks`` their ranks."""
    from .compact import FORMS

    m = maps.meta
    if m.map_form not in FORMS:
        raise MapFileError(f"{KEY_MAP_FORM} = {m.map_form!r}: expected one of {', '.join(FORMS)}")
    if m.map_form == "full":
        if maps.factors or m.ranks:
            raise MapFileError("full maps with low-rank factors or ranks")
        return
    if sorted(maps.factors) != list(layers):
        raise MapFileError(f"{m.map_form} maps need factors for layers {list(layers)}, have {sorted(maps.factors)}")
    ranks = []
    for il in layers:
        up, down = maps.factors[il]
        r = up.shape[1] if up.ndim == 2 else -1
        if up.shape != (m.n_embd, r) or down.shape != (r, m.n_embd) or not 1 <= r < m.n_embd:
            raise MapFileError(f"layer {il}: low-rank factors {tensor_name_a_up(il)} {up.shape} / {tensor_name_a_down(il)} "
                               f"{down.shape}, expected ({m.n_embd}, r) / (r, {m.n_embd}) with 1 <= r < {m.n_embd}")
        if not (np.isfinite(up).all() and np.isfinite(down).all()):
            raise MapFileError(f"layer {il}: the low-rank factors have NaN or Inf values")
        ranks.append(int(r))
    if m.ranks and list(m.ranks) != ranks:
        raise MapFileError(f"{KEY_MAP_RANKS} = {list(m.ranks)}, the factors have ranks {ranks}")


def check_state_gains(gains: dict[int, np.ndarray], layers: Sequence[int]) -> None:
    """Terminal-state gains: 1-D, one length for every layer, finite and positive, only for mapped
    ``layers``. (Which layers must have them - every mapped recurrent layer - depends on the model:
    :func:`compatibility_problems` and the runtime loader check that.)"""
    stray = sorted(il for il in gains if il not in layers)
    if stray:
        raise MapFileError(f"state gains for layers {stray} that have no map (mapped layers: {list(layers)})")
    lengths = set()
    for il in sorted(gains):
        g = np.asarray(gains[il])
        if g.ndim != 1 or g.size == 0:
            raise MapFileError(f"layer {il}: state gains of shape {g.shape}, expected one per value head (1-D)")
        lengths.add(g.size)
        if not np.isfinite(g).all():
            raise MapFileError(f"layer {il}: the state gains have NaN or Inf values")
        if not (g > 0).all():
            raise MapFileError(f"layer {il}: state gains must be positive, got {float(g.min()):g}")
    if len(lengths) > 1:
        raise MapFileError(f"state gains of different lengths {sorted(lengths)} (one per value head in every layer)")


def read_map_file(path: os.PathLike | str) -> RidgeMaps:
    """Read and check a map file. Raises :class:`MapFileError` saying what is wrong."""

    try:
        md = read_metadata(path)
    except GGUFFileError as e:
        raise MapFileError(str(e)) from None
    if md.get("general.type") != "adapter" or md.get("adapter.type") != ADAPTER_TYPE:
        raise MapFileError(
            f"{path}: not a RidgeFill map file (general.type={md.get('general.type')!r}, "
            f"adapter.type={md.get('adapter.type')!r}; expected 'adapter' / '{ADAPTER_TYPE}')"
        )
    version = md.get(KEY_FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise MapFileError(f"{path}: map file format version {version}, this tool reads version {FORMAT_VERSION}")
    meta = _meta_from_metadata(md, path)
    if md.get(KEY_INPUT_NORM) != meta.input_norm:
        raise MapFileError(f"{path}: input_norm {md.get(KEY_INPUT_NORM)!r} does not match objective {meta.objective!r}")
    try:
        _, header = read_header(path)
    except GGUFFileError as e:
        raise MapFileError(str(e)) from None
    meta.dtype = _check_tensor_types(path, header)  # before reading the data
    try:
        tensors = read_tensors(path)
    except GGUFFileError as e:
        raise MapFileError(str(e)) from None
    from .compact import dense_map

    maps = RidgeMaps(meta, {}, {})
    for il in meta.layers:
        if tensor_name_a(il) in tensors:
            maps.a[il] = tensors[tensor_name_a(il)]
        if tensor_name_b(il) in tensors:
            maps.b[il] = tensors[tensor_name_b(il)]
        if meta.map_form != "full" and tensor_name_a_up(il) in tensors and tensor_name_a_down(il) in tensors:
            up, down = tensors[tensor_name_a_up(il)], tensors[tensor_name_a_down(il)]
            maps.factors[il] = (up, down)
            if up.ndim == 2 and down.ndim == 2 and up.shape[1] == down.shape[0]:
                square = up.shape[0] == down.shape[1]  # else check_maps names the shapes
                maps.a[il] = dense_map(up, down, meta.map_form if square else "low_rank").astype(np.float32)
    stray = sorted(n for n in tensors if n.endswith(_MATRIX_SUFFIXES) and n not in
                   {f(il) for il in meta.layers for f in ((tensor_name_a,) if meta.map_form == "full"
                                                            else (tensor_name_a_up, tensor_name_a_down))})
    if stray:
        raise MapFileError(f"{path}: tensor {stray[0]} does not belong in {meta.map_form} maps of layers "
                           f"{meta.layers[0]}..{meta.layers[-1]}")
    for name, t in tensors.items():  # every gain tensor, so that a stray one is reported
        if name.startswith("blk.") and name.endswith(_STATE_GAIN_SUFFIX):
            try:
                maps.g[int(name[len("blk."):-len(_STATE_GAIN_SUFFIX)])] = t
            except ValueError:
                raise MapFileError(f"{path}: unexpected tensor {name}") from None
    if maps.g:
        maps.state_gain_settings = state_gain_settings_from_metadata(md, path)
    try:
        check_maps(maps)
    except MapFileError as e:
        raise MapFileError(f"{path}: {e}") from None
    meta.digest = check_digests(path, md)
    return maps


_MATRIX_SUFFIXES = (".ridgefill_a.weight", ".ridgefill_a_down.weight", ".ridgefill_a_up.weight")


def _check_tensor_types(path: os.PathLike | str, header: Sequence[Any]) -> str:
    """The storage type of the file's map matrices (one for all of them, one the runtime multiplies:
    :data:`ridgefill_cpp.maps.compact.DTYPES`), after checking that the biases and state gains are F32.
    Raises :class:`MapFileError` naming the first tensor of another type."""
    from gguf import GGMLQuantizationType

    from . import compact

    first = None
    for t in header:
        if t.name.endswith((".ridgefill_b.bias", _STATE_GAIN_SUFFIX)):
            if t.ggml_type != GGMLQuantizationType.F32:
                what = "state gains" if t.name.endswith(_STATE_GAIN_SUFFIX) else "biases"
                raise MapFileError(f"{path}: {t.name} is {_ggml_type_name(t.ggml_type)}, {what} must be F32")
        elif t.name.endswith(_MATRIX_SUFFIXES):
            if t.ggml_type not in compact.GGML_TYPES.values():
                raise MapFileError(f"{path}: {t.name} is {_ggml_type_name(t.ggml_type)}; map matrices must be one of "
                                   f"{', '.join(d.upper() for d in compact.DTYPES)}")
            if first is None:
                first = t
            elif t.ggml_type != first.ggml_type:
                raise MapFileError(f"{path}: {t.name} is {_ggml_type_name(t.ggml_type)}, {first.name} is "
                                   f"{_ggml_type_name(first.ggml_type)}: every map matrix of a file has one type")
    return compact.dtype_name(first.ggml_type) if first is not None else ""


def _meta_from_metadata(md: dict[str, Any], path: os.PathLike | str) -> MapFileMeta:
    """The :class:`MapFileMeta` of a map file's metadata, every value checked for its type and range
    (:func:`check_meta_values`); the error names the key."""
    def get(key: str, kind: str, default: Any = None) -> Any:
        if key not in md:
            if default is not None:
                return default
            raise MapFileError(f"{path}: missing metadata key {key}")
        v = md[key]
        if kind == "str":
            ok = isinstance(v, str)
        elif kind == "int":
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        elif kind == "float":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        elif kind == "ints":
            ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        else:  # floats
            ok = isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        if not ok:
            what = {"str": "a string", "int": "a non-negative integer", "float": "a number",
                    "ints": "an array of integers", "floats": "an array of numbers"}[kind]
            raise MapFileError(f"{path}: metadata key {key} = {str(v)[:60]!r} is not {what}")
        return v

    meta = MapFileMeta(
        architecture=get("general.architecture", "str"),
        split_layer=get(KEY_SPLIT, "int"),
        n_layer=get(KEY_N_LAYER, "int"),
        n_embd=get(KEY_N_EMBD, "int"),
        objective=get(KEY_OBJECTIVE, "str"),
        input_norm_eps=float(get(KEY_INPUT_NORM_EPS, "float")),
        layers=list(get(KEY_LAYERS, "ints")),
        lambdas=[float(x) for x in get(KEY_LAMBDA, "floats")],
        calib_n_tokens=get(KEY_CALIB_TOKENS, "int"),
        calib_n_rows=get(KEY_CALIB_ROWS, "int"),
        calib_source=get(KEY_CALIB_SOURCE, "str"),
        calib_ctx=get(KEY_CALIB_CTX, "int"),
        calib_skip_rows=get(KEY_CALIB_SKIP, "int"),
        calib_ctx_lengths=list(get(KEY_CALIB_CTX_MIX, "ints", [])),
        heldout_n_rows=get(KEY_HELDOUT_ROWS, "int"),
        r2=[float(x) for x in get(KEY_R2, "floats")],
        rel_err_median=[float(x) for x in get(KEY_REL_ERR, "floats")],
        identity_rel_err_median=[float(x) for x in get(KEY_ID_REL_ERR, "floats")],
        fingerprint=get(KEY_FINGERPRINT, "str"),
        model_name=get(KEY_MODEL_NAME, "str", ""),
        tool_version=get(KEY_TOOL_VERSION, "str", ""),
        format_version=get(KEY_FORMAT_VERSION, "int"),
        map_form=get(KEY_MAP_FORM, "str", "full"),
        ranks=list(get(KEY_MAP_RANKS, "ints", [])),
    )
    try:
        check_meta_values(meta)
    except MapFileError as e:
        raise MapFileError(f"{path}: {e}") from None
    return meta


#: the largest RMS-norm epsilon a map file may record (models use 1e-6 .. 1e-5)
MAX_INPUT_NORM_EPS = 1e-2


def check_meta_values(meta: MapFileMeta) -> None:
    """The ranges of a map file's numbers, each error naming its metadata key: what the runtime
    computes with must be usable (a NaN or negative ``input_norm_eps`` would abort libllama at the
    first planned prompt), and what ``info`` reports must be finite."""
    if not (math.isfinite(meta.input_norm_eps) and 0.0 <= meta.input_norm_eps <= MAX_INPUT_NORM_EPS):
        raise MapFileError(f"{KEY_INPUT_NORM_EPS} = {meta.input_norm_eps:g} outside [0, {MAX_INPUT_NORM_EPS:g}]")
    if not 3 <= meta.n_layer <= 100_000:
        raise MapFileError(f"{KEY_N_LAYER} = {meta.n_layer} outside 3..100000")
    if not 1 <= meta.n_embd <= 1_000_000:
        raise MapFileError(f"{KEY_N_EMBD} = {meta.n_embd} outside 1..1000000")
    if not 1 <= meta.split_layer <= meta.n_layer - 2:
        raise MapFileError(f"{KEY_SPLIT} = {meta.split_layer} outside 1..{meta.n_layer - 2}")
    for key, vals, lo, hi in ((KEY_LAMBDA, meta.lambdas, 0.0, math.inf),
                              (KEY_R2, meta.r2, -math.inf, 1.0),
                              (KEY_REL_ERR, meta.rel_err_median, 0.0, math.inf),
                              (KEY_ID_REL_ERR, meta.identity_rel_err_median, 0.0, math.inf)):
        bad = [v for v in vals if not (math.isfinite(v) and lo <= v <= hi)]
        if bad:
            raise MapFileError(f"{key} has {bad[0]:g}, outside [{lo:g}, {hi:g}] (finite)")
    if meta.calib_ctx_lengths and min(meta.calib_ctx_lengths) < 1:
        raise MapFileError(f"{KEY_CALIB_CTX_MIX} has a length below 1: {meta.calib_ctx_lengths}")


def _ggml_type_name(t: int | None) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"ggml type {t}"


def fitting_map_metas(maps: Sequence[os.PathLike | str], model_path: os.PathLike | str) -> list[MapFileMeta]:
    """The metadata of each map file, after checking that every file is a readable map file that
    fits the model at ``model_path``. Raises :class:`MapFileError` saying which file does not fit
    and why."""
    metas = [read_map_file(m).meta for m in maps]
    for m, meta in zip(maps, metas):
        problems = compatibility_problems(meta, model_path)
        if problems:
            raise MapFileError(f"{m}: the maps do not fit {model_path}: " + "; ".join(problems))
    return metas


def map_file_splits(maps: Sequence[os.PathLike | str], model_path: os.PathLike | str) -> list[int]:
    """The split of each map file, after checking that every file is a readable map file that fits
    the model at ``model_path`` and that no two are for the same split (eval's sweep, tune's grid).
    Raises :class:`MapFileError` saying which file does not fit and why."""
    splits = [meta.split_layer for meta in fitting_map_metas(maps, model_path)]
    if len(set(splits)) != len(splits):
        dup = sorted({s for s in splits if splits.count(s) > 1})
        raise MapFileError(f"two map files for the same split ({', '.join(f'S = {s}' for s in dup)}): give one per split")
    return splits


def compatibility_problems(meta: MapFileMeta, model_path: os.PathLike | str,
                           gains: dict[int, np.ndarray] | None = None) -> list[str]:
    """Why the maps do not fit the model at ``model_path`` (empty list: they fit); with ``gains``
    (:attr:`RidgeMaps.g`) also why the state gains do not (:func:`state_gain_problems`)."""
    info = read_model_info(model_path)
    problems = []
    if info.architecture != meta.architecture:
        problems.append(f"architecture: maps are for {meta.architecture}, the model is {info.architecture}")
    if info.n_layer != meta.n_layer:
        problems.append(f"layers: maps are for {meta.n_layer}, the model has {info.n_layer}")
    if info.n_embd != meta.n_embd:
        problems.append(f"n_embd: maps are for {meta.n_embd}, the model has {info.n_embd}")
    if not problems:
        fp = model_fingerprint(model_path)
        if fp != meta.fingerprint:
            problems.append(f"fingerprint: maps were fitted on {meta.fingerprint}, the model is {fp} (another checkpoint)")
    if not problems and gains:
        problems += state_gain_problems(gains, meta, model_path)
    return problems


def state_gain_problems(gains: dict[int, np.ndarray], meta: MapFileMeta, model_path: os.PathLike | str) -> list[str]:
    """Why the terminal-state gains do not fit the model (empty: they fit, or there are none): the
    runtime wants gains for every mapped recurrent layer or for none, [n_v_heads] each."""
    if not gains:
        return []
    info = read_model_info(model_path)
    want = [il for il in meta.layers if il in info.recurrent_layers]
    if sorted(gains) != want:
        return [f"state gains: the file has them for layers {sorted(gains)}, the model's mapped recurrent "
                f"layers are {want}"]
    n_v = read_metadata(model_path).get(f"{info.architecture}.ssm.time_step_rank")
    sizes = sorted({int(np.asarray(g).size) for g in gains.values()})
    if n_v is not None and sizes != [int(n_v)]:
        return [f"state gains: {sizes[0] if len(sizes) == 1 else sizes} per layer, the model has {n_v} value heads"]
    return []


def tuned_defaults_from_metadata(md: dict[str, Any], path: os.PathLike | str = "") -> dict[str, Any] | None:
    """The ``ridgefill.tuned.*`` values of a map file's metadata as ``{short name: value}``, or None
    when it has none. Raises :class:`MapFileError` on unknown, missing or ill-typed tuned keys, a
    negative integer or a non-finite number. (Whether a tuned tail, fraction or span is a usable
    setting is checked where it applies, naming the key: :class:`ridgefill_cpp.RidgeFill`, where an
    explicit argument wins over the file's value.)"""
    found = {k[len(TUNED_PREFIX):]: v for k, v in md.items() if k.startswith(TUNED_PREFIX)}
    if not found:
        return None
    where = f"{path}: " if str(path) else ""
    out: dict[str, Any] = {}
    for name, value in found.items():
        if name not in TUNED_KEYS:
            raise MapFileError(f"{where}unknown tuned key {TUNED_PREFIX}{name}")
        kind = TUNED_KEYS[name][0]
        ok = (isinstance(value, str) if kind == "STRING" else
              isinstance(value, int) and not isinstance(value, bool) if kind == "UINT32" else
              isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            raise MapFileError(f"{where}{TUNED_PREFIX}{name} = {value!r} is not a {kind.lower()}")
        if (kind == "UINT32" and not 0 <= value < 2**32) or (kind == "FLOAT64" and not math.isfinite(value)):
            raise MapFileError(f"{where}{TUNED_PREFIX}{name} = {value!r} is not a "
                               f"{'non-negative 32-bit integer' if kind == 'UINT32' else 'finite number'}")
        out[name] = float(value) if kind == "FLOAT64" else value
    missing = [k for k, (_, req, _) in TUNED_KEYS.items() if req and k not in out]
    if missing:
        raise MapFileError(f"{where}tuned defaults without {', '.join(TUNED_PREFIX + k for k in missing)}")
    return {k: out[k] for k in TUNED_KEYS if k in out}


def _read_map_metadata(path: os.PathLike | str) -> dict[str, Any]:
    try:
        md = read_metadata(path)
    except GGUFFileError as e:
        raise MapFileError(str(e)) from None
    if md.get("general.type") != "adapter" or md.get("adapter.type") != ADAPTER_TYPE:
        raise MapFileError(f"{path}: not a RidgeFill map file (general.type={md.get('general.type')!r}, "
                           f"adapter.type={md.get('adapter.type')!r})")
    return md


def read_tuned_defaults(path: os.PathLike | str) -> dict[str, Any] | None:
    """The operating point ``ridgefill-gguf tune`` wrote into a map file (``tail``,
    ``exact_fraction``, ``selector`` and how they were measured: see :data:`TUNED_KEYS`), or None
    when the file has none. Raises :class:`MapFileError` for a file that is not a map file."""
    return tuned_defaults_from_metadata(_read_map_metadata(path), path)


def write_tuned_defaults(path: os.PathLike | str, defaults: dict[str, Any]) -> Path:
    """Rewrite the map file at ``path`` with ``defaults`` as its ``ridgefill.tuned.*`` keys.

    Every other key and every tensor is copied unchanged (tensor bytes included); tuned keys of an
    earlier run are replaced, not merged. Atomic: a temporary file next to it, then a rename (a
    symlink is followed, the file keeps its permission bits); on any error the original is left
    as it was. ``defaults`` needs ``tail``, ``exact_fraction`` and ``selector``.
    """
    import gguf

    path = Path(path).resolve()
    _read_map_metadata(path)  # a map file (clear error otherwise)
    unknown = [k for k in defaults if k not in TUNED_KEYS]
    if unknown:
        raise ValueError(f"unknown tuned keys: {', '.join(unknown)} (known: {', '.join(TUNED_KEYS)})")
    values: dict[str, Any] = {}
    for name, value in defaults.items():
        if value is None:
            continue
        kind = TUNED_KEYS[name][0]
        if kind == "STRING":
            value = str(value) or "-"  # gguf-py drops empty strings
        elif kind == "UINT32":
            if isinstance(value, bool) or int(value) != value or int(value) < 0:
                raise ValueError(f"tuned {name} = {value!r} must be a non-negative integer")
            value = int(value)
        else:
            value = float(value)
            if not np.isfinite(value):
                raise ValueError(f"tuned {name} = {value!r} must be finite")
        values[name] = value
    tuned_defaults_from_metadata({TUNED_PREFIX + k: v for k, v in values.items()}, path)  # required keys present
    for name in ("tail", "exact_fraction", "span"):  # what RidgeFill(path) will check (int32s in the C parameters)
        if name in values:
            check_setting(name, values[name], label=f"tuned {name}")

    return rewrite_map_file(
        path, drop_key=lambda name: name.startswith(TUNED_PREFIX),
        add_keys=[(TUNED_PREFIX + name, value, getattr(gguf.GGUFValueType, TUNED_KEYS[name][0]))
                  for name, value in values.items()])


UNDIGESTED_HINT = "add one with `ridgefill-gguf digest FILE` if you trust its bytes (or fit the maps again)"


def other_gguf(path: os.PathLike | str) -> str | None:
    """What the file at ``path`` is when it is a GGUF file other than a RidgeFill map file (``"a GGUF
    model (general.type='model')"``) or cannot be read to tell, else None: nothing there, not a
    regular file (:func:`ridgefill_cpp.core.files.check_output` refuses those), a map file, or a file
    that is not GGUF."""
    from ..core.files import not_regular

    path = Path(path)
    if not_regular(path) is not None or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
    except OSError as e:  # what it is cannot be told: not replaced either
        return f"a file that cannot be read ({e.strerror or type(e).__name__})"
    try:
        md = read_metadata(path)
    except GGUFFileError:
        return "a GGUF file whose metadata cannot be read"
    kind, adapter = md.get("general.type"), md.get("adapter.type")
    if kind == "adapter" and adapter == ADAPTER_TYPE:
        return None
    return f"a GGUF adapter (adapter.type={adapter!r})" if kind == "adapter" else f"a GGUF model (general.type={kind!r})"


def check_map_output(path: os.PathLike | str, *, overwrite: bool = False) -> Path:
    """``path`` as a Path, after checking that a map file may be written there
    (:func:`ridgefill_cpp.core.files.check_output`: a regular file or nothing, replaced only with
    ``overwrite``, in a writable directory) and that what is there is no GGUF other than a RidgeFill
    map file: a model is never replaced, not even with ``overwrite`` (:class:`MapFileError`)."""
    what = other_gguf(path)
    if what is not None:
        raise MapFileError(f"{path} is {what}, not a RidgeFill map file: refusing to replace it, even with --force "
                           "(give another output file)")
    return check_output(path, overwrite=overwrite)


def _changes(before: os.stat_result, after: os.stat_result) -> list[str]:
    """What differs between two stats of one path: another inode, size, modification time."""
    out = []
    if (after.st_ino, after.st_dev) != (before.st_ino, before.st_dev):
        out.append("it was replaced by another file")
    if after.st_size != before.st_size:
        out.append(f"its size went from {before.st_size} to {after.st_size} bytes")
    if after.st_mtime_ns != before.st_mtime_ns:
        out.append("it was modified")
    return out


def add_digest(path: os.PathLike | str, out_path: os.PathLike | str | None = None, *,
               overwrite: bool = False) -> tuple[Path, bool]:
    """Give the map file at ``path`` the content digest of the bytes it holds now (written to
    ``out_path``, default ``path`` itself, atomically; everything else copied unchanged), for a file
    written before map files had one. A file that has one is only checked against it (a corrupted
    file is refused, never given a fresh digest) and not written. Returns the file that has the
    digest and whether it was written.

    A digest vouches for the bytes, so a file that cannot be a finished map file is refused
    (:class:`MapFileError` saying why), never given one: values the readers refuse
    (:func:`read_map_file`: NaN or Inf, metadata out of range), a map matrix or low-rank factor that
    is all zeros (preallocated and not yet filled in), and a file that changes while it is read (its
    size, modification time or inode differ before and after: a writer still at work, whose later
    bytes the rename would lose). An output other than ``path`` that exists is replaced only with
    ``overwrite`` (``FileExistsError``), and never when it is a GGUF other than a RidgeFill map file
    (:func:`check_map_output`)."""
    from ..core.files import atomic_path

    given, path = Path(path), Path(path).resolve()
    dest = path if out_path is None else Path(out_path).resolve()
    if dest != path:
        check_map_output(out_path, overwrite=overwrite)
    before = os.stat(path)
    md = _read_map_metadata(path)  # a map file (clear error otherwise)
    if check_digests(given, md):
        if dest != path:
            raise MapFileError(f"{given} already has a content digest (checked: the weights are as written); "
                               "copy it instead of writing it again")
        return given, False
    refused = "not given a digest; run digest again once the file is complete (or fit the maps again)"
    try:
        maps = read_map_file(path)  # every check the readers run: a digest for a file they refuse is no use
    except MapFileError as e:
        raise MapFileError(f"{e}: {refused}") from None
    for il in maps.meta.layers:
        matrices = ((tensor_name_a_up(il), maps.factors[il][0]), (tensor_name_a_down(il), maps.factors[il][1])) \
            if il in maps.factors else ((tensor_name_a(il), maps.a[il]),)
        for name, x in matrices:
            if not np.any(x):
                raise MapFileError(f"{path}: tensor {name} is all zeros, which no fit writes (a file still being "
                                   f"written, preallocated and not yet filled in?): {refused}")
    with atomic_path(dest, mode=stat.S_IMODE(before.st_mode)) as tmp:
        rewrite_map_file(path, tmp, allow_undigested=True)
        changed = _changes(before, os.stat(path))  # before the rename: a writer's later bytes would be lost
        if changed:
            raise MapFileError(f"{path} changed while it was being read ({'; '.join(changed)}): it is still being "
                               "written; not given a digest, nothing written: run digest again once the writer has finished")
    return dest, True


def rewrite_map_file(path: os.PathLike | str, out_path: os.PathLike | str | None = None, *,
                     drop_key=lambda name: False, add_keys: Sequence[tuple[str, Any, Any]] = (),
                     drop_tensor=lambda name: False, add_tensors: Sequence[tuple] = (),
                     allow_undigested: bool = False) -> Path:
    """Copy the GGUF at ``path`` to ``out_path`` (default: ``path`` itself) with every key and tensor
    (tensor bytes included, F16 stays F16) except those ``drop_key`` / ``drop_tensor`` accept, then
    ``add_keys`` ((name, value, GGUFValueType)) and ``add_tensors`` ((name, array), or (name, raw
    bytes, GGMLQuantizationType) for a quantized tensor). Atomic
    (:func:`ridgefill_cpp.core.files.atomic_path`): a temporary file next to the output, then a rename (a
    symlink is followed; the output gets the source's permission bits); on any error the output is
    left as it was. The source's tensors are checked against its content digest first (a corrupted
    file is refused, not given a fresh digest; a file without one is refused unless
    ``allow_undigested``: :func:`add_digest`); the output gets the digest of what it holds."""
    import gguf

    path = Path(path).resolve()
    out_path = path if out_path is None else Path(out_path).resolve()
    mode = path.stat().st_mode & 0o7777
    if not check_digests(path) and not allow_undigested:
        raise MapFileError(f"{path}: the file has no content digest ({KEY_DIGEST}), so corrupted weights could not be "
                           f"detected and would be given a fresh digest here: {UNDIGESTED_HINT}")
    reader = gguf.GGUFReader(path, "r")
    arch = reader.fields["general.architecture"].contents()
    with _map_writer(out_path, arch, mode=mode) as w:
        for name, fld in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture" or name == KEY_DIGEST or drop_key(name):
                continue
            kind = fld.types[0]
            sub = fld.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            if name == "general.alignment":
                w.data_alignment = int(fld.contents())
            w.add_key_value(name, fld.contents(), kind, sub_type=sub)
        for name, value, kind in add_keys:
            w.add_key_value(name, value, kind)
        for t in reader.tensors:
            if drop_tensor(t.name):
                continue
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
            else:
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        for name, arr, *raw_dtype in add_tensors:
            w.add_tensor(name, arr, raw_dtype=raw_dtype[0] if raw_dtype else None)
    del reader
    return out_path


def summary_rows(meta: MapFileMeta) -> list[dict[str, Any]]:
    """One dict per mapped layer: layer, lambda, r2, rel_err, identity_rel_err."""
    return [
        {"layer": il, "lambda": lam, "r2": r2, "rel_err": e, "identity_rel_err": ie}
        for il, lam, r2, e, ie in zip(meta.layers, meta.lambdas, meta.r2, meta.rel_err_median,
                                      meta.identity_rel_err_median)
    ]


def late_layers(split_layer: int, n_layer: int) -> Sequence[int]:
    """The layers that get a map: S+1 .. L-1."""
    return range(split_layer + 1, n_layer)


def map_tensor_bytes(path: os.PathLike | str) -> int:
    """Bytes of the map tensors in a map file (what a loaded copy takes, in the stored type)."""
    return sum(map_tensor_bytes_by_layer(path).values())


def map_tensor_bytes_by_layer(path: os.PathLike | str) -> dict[int, int]:
    """Bytes of each mapped layer's tensors (matrices or factors, bias, state gains) in a map file."""
    from gguf import GGUFReader

    out: dict[int, int] = {}
    for t in GGUFReader(str(path)).tensors:
        if t.name.startswith("blk.") and t.name.endswith(_MATRIX_SUFFIXES + (".ridgefill_b.bias", _STATE_GAIN_SUFFIX)):
            il = int(t.name.split(".")[1])
            out[il] = out.get(il, 0) + int(t.n_bytes)
    return dict(sorted(out.items()))


def describe_form(meta: MapFileMeta) -> str:
    """The map matrices in words: ``"Q8_0, full matrices"``, ``"F16, I + U Vᵀ of rank 64"``."""
    dtype = (meta.dtype or "?").upper()
    if meta.map_form == "full":
        return f"{dtype}, full {meta.n_embd}×{meta.n_embd} matrices"
    ranks = sorted(set(meta.ranks))
    rank = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, meta.ranks))} (per layer)"
    return f"{dtype}, {'I + U Vᵀ' if meta.map_form == 'identity_low_rank' else 'U Vᵀ'} of {rank}"
