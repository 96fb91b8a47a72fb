"""Reading model GGUF files: metadata, the architecture summary RidgeFill needs, and weights.

Everything here reads; nothing writes or modifies a model file. Bad input (a missing, truncated
or non-GGUF file) raises :class:`GGUFFileError` with a message that says what is wrong.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import native as N

# gguf-py is imported in the functions that read or write GGUF files: `import ridgefill_cpp` (and so
# `ridgefill-gguf --help`) does not pay its ~30 ms

GGUF_MAGIC = b"GGUF"


def _libllama_architectures() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The architectures libllama's RidgeFill supports and the hybrid ones among them, from its table
    (csrc/llama-ridgefill-arch.cpp, llama_ridgefill_supported_arch)."""
    names, hybrid = [], []
    flag = ctypes.c_bool(False)
    while (name := N.llama_ridgefill_supported_arch(len(names), ctypes.byref(flag))) is not None:
        names.append(name.decode())
        if flag.value:
            hybrid.append(names[-1])
    return tuple(names), tuple(hybrid)


#: architectures RidgeFill implements (docs/design.md §12): model inspection, ``fit`` and libllama's
#: filled-row prefill; anything else is refused with this list. libllama's table is the one list:
#: adding an architecture there adds it here
SUPPORTED_ARCHITECTURES, HYBRID_ARCHITECTURES = _libllama_architectures()


def supported_architectures() -> tuple[str, ...]:
    """The architectures RidgeFill supports (libllama's table)."""
    return SUPPORTED_ARCHITECTURES


class GGUFFileError(ValueError):
    """A file that is not a usable GGUF file."""


def _check_file(path: os.PathLike | str) -> Path:
    p = Path(path)
    if not p.exists():
        raise GGUFFileError(f"{p}: no such file")
    if not p.is_file():
        raise GGUFFileError(f"{p}: not a regular file")
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        if len(magic) < 4:
            raise GGUFFileError(f"{p}: not a GGUF file (only {p.stat().st_size} bytes)")
        raise GGUFFileError(f"{p}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    return p


def open_gguf(path: os.PathLike | str):
    """A ``gguf.GGUFReader`` for ``path``, with truncation checked against the tensor data."""
    import gguf

    p = _check_file(path)
    try:
        reader = gguf.GGUFReader(p, "r")
    except Exception as e:  # gguf-py raises ValueError / IndexError / struct errors on bad input
        raise GGUFFileError(f"{p}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    size = p.stat().st_size
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size:
            raise GGUFFileError(
                f"{p}: truncated GGUF file (tensor {t.name} ends at byte {end}, file has {size})"
            )
    return reader


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne[0] first)
    ggml_type: int
    n_bytes: int
    offset: int = 0  # absolute byte offset of the tensor data in the file

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _SkippedArray(list):
    """Stands for an array too long to decode (only its length is known)."""

    def __init__(self, n: int):
        super().__init__()
        self.length = n


# GGUF value types -> struct formats of the scalars
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_header(path: os.PathLike | str, *, max_array: int = 4096) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Metadata and tensor infos of a GGUF file, without reading tensor data.

    Much faster than ``gguf.GGUFReader`` on models with large vocabularies: arrays longer than
    ``max_array`` (the tokenizer's) are skipped, not decoded. Raises :class:`GGUFFileError` on a
    truncated or corrupt header, or on tensor data that runs past the end of the file.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    p = _check_file(path)
    size = p.stat().st_size
    with p.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 4

        def take(fmt: str):
            nonlocal pos
            v = struct.unpack_from(fmt, mm, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            if pos + n > size:
                raise struct.error("string runs past the end of the file")
            s = mm[pos:pos + n].decode("utf-8", errors="replace")
            pos += n
            return s

        def value(vtype: int):
            nonlocal pos
            if vtype in _SCALAR:
                return take(_SCALAR[vtype])
            if vtype == _STRING:
                return string()
            if vtype == _ARRAY:
                itype, n = take("<I"), take("<Q")
                if n > size:
                    raise struct.error("array longer than the file")
                if n <= max_array:
                    return [value(itype) for _ in range(n)]
                if itype == _STRING:  # skip without decoding
                    for _ in range(n):
                        pos += 8 + struct.unpack_from("<Q", mm, pos)[0]
                elif itype in _SCALAR:
                    pos += n * struct.calcsize(_SCALAR[itype])
                else:
                    raise struct.error(f"unsupported nested array type {itype}")
                return _SkippedArray(n)
            raise struct.error(f"unknown GGUF value type {vtype}")

        try:
            version = take("<I")
            if version not in (2, 3):
                raise GGUFFileError(f"{p}: unsupported GGUF version {version}")
            n_tensors, n_kv = take("<Q"), take("<Q")
            if n_tensors > size or n_kv > size:
                raise struct.error("implausible tensor or key count")
            md: dict[str, Any] = {}
            for _ in range(n_kv):
                k = string()
                md[k] = value(take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = string()
                n_dims = take("<I")
                if n_dims > 8:
                    raise struct.error(f"tensor {name} has {n_dims} dimensions")
                shape = tuple(take("<Q") for _ in range(n_dims))
                infos.append((name, shape, take("<I"), take("<Q")))
        except (struct.error, IndexError) as e:
            raise GGUFFileError(f"{p}: truncated or corrupt GGUF file ({e})") from None
    align = int(md.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors = []
    for name, shape, ttype, offset in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise GGUFFileError(f"{p}: tensor {name} has unknown ggml type {ttype}") from None
        n = 1
        for d in shape:
            n *= d
        n_bytes = n // block * type_size
        end = data_start + offset + n_bytes
        if end > size:
            raise GGUFFileError(f"{p}: truncated GGUF file (tensor {name} ends at byte {end}, file has {size})")
        tensors.append(TensorInfo(name, shape, ttype, n_bytes, data_start + offset))
    return md, tensors


def read_metadata(path: os.PathLike | str, *, skip_arrays_longer_than: int = 4096) -> dict[str, Any]:
    """GGUF key -> Python value. Arrays longer than ``skip_arrays_longer_than`` (the tokenizer's) are left out."""
    md, _ = read_header(path, max_array=skip_arrays_longer_than)
    return {k: v for k, v in md.items() if not isinstance(v, _SkippedArray)}


def read_tensors(path: os.PathLike | str, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors as float32 numpy arrays (dequantized), shaped as gguf-py reports them.

    A matrix is ``[out_features, in_features]`` (numpy order, the reverse of ggml's ``ne``).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = open_gguf(path)
    wanted = set(names) if names is not None else None
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if wanted is not None and t.name not in wanted:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            if t.tensor_type == GGMLQuantizationType.BF16:
                arr = dequantize(t.data, t.tensor_type)
            else:
                arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type)
        out[t.name] = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
    if wanted is not None and len(out) != len(wanted):
        missing = sorted(wanted - set(out))
        raise KeyError(f"{path}: tensors not found: {', '.join(missing)}")
    return out


@dataclass(frozen=True)
class ModelInfo:
    """What RidgeFill needs to know about a model GGUF (``ridgefill-gguf info`` shows it)."""

    path: str
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    context_length: int
    qk_norm: bool
    sliding_window: int  # 0: none
    swa_layers: tuple[int, ...] = ()
    recurrent_layers: tuple[int, ...] = ()
    file_type: str = ""
    n_params: int = 0
    file_size: int = 0
    tensor_types: dict[str, int] = field(default_factory=dict)

    @property
    def supported(self) -> bool:
        return self.architecture in supported_architectures()

    @property
    def default_split(self) -> int:
        """S = L - floor(L/3) (docs/design.md §8)."""
        return self.n_layer - self.n_layer // 3

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["swa_layers"] = list(self.swa_layers)
        d["recurrent_layers"] = list(self.recurrent_layers)
        d["default_split"] = self.default_split
        d["supported"] = self.supported
        return d


def _per_layer(value: Any, n_layer: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value[:n_layer]]
    return [int(value)] * n_layer


def _swa_layers(md: dict[str, Any], arch: str, n_layer: int) -> tuple[int, ...]:
    """Sliding-window layers, following llama.cpp's ``load_swa_pattern`` for the archs it applies to."""
    window = int(md.get(f"{arch}.attention.sliding_window", 0) or 0)
    if window <= 0:
        return ()
    pattern = md.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(il for il in range(n_layer) if pattern[il])
    if arch in ("gemma3", "gpt-oss"):  # load_swa_pattern(ml, 6) / (ml, 2), dense_first = False
        n = int(pattern) if pattern is not None else {"gemma3": 6, "gpt-oss": 2}[arch]
        return tuple(il for il in range(n_layer) if n == 0 or il % n < n - 1)
    # other archs: every layer uses the window (llama.cpp's default swa pattern)
    return tuple(range(n_layer))


def _recurrent_layers(md: dict[str, Any], arch: str, n_layer: int) -> tuple[int, ...]:
    if arch not in HYBRID_ARCHITECTURES:
        return ()
    arr = md.get(f"{arch}.attention.recurrent_layers")
    if isinstance(arr, list):
        return tuple(il for il in range(n_layer) if arr[il])
    interval = int(md.get(f"{arch}.full_attention_interval", 4))
    return tuple(il for il in range(n_layer) if (il + 1) % interval != 0)


def read_model_info(path: os.PathLike | str) -> ModelInfo:
    """Summarise a model GGUF. Raises :class:`GGUFFileError` for unusable files."""
    import gguf

    raw, tensors = read_header(path)
    md = {k: v for k, v in raw.items() if not isinstance(v, _SkippedArray)}
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFFileError(f"{path}: no general.architecture key: not a model GGUF")
    if md.get("general.type") == "adapter":
        raise GGUFFileError(f"{path}: this is an adapter GGUF (adapter.type={md.get('adapter.type')}), not a model")

    def key(k: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{k}", default)

    n_layer_all = key("block_count")
    if n_layer_all is None:
        raise GGUFFileError(f"{path}: no {arch}.block_count key")
    n_layer = int(n_layer_all) - int(key("nextn_predict_layers", 0) or 0)
    n_embd = int(key("embedding_length", 0))
    n_head = max(_per_layer(key("attention.head_count", 0), n_layer) or [0])
    kv = _per_layer(key("attention.head_count_kv", n_head), n_layer)
    n_head_kv = max([v for v in kv if v > 0] or [n_head])
    head_dim = int(key("attention.key_length", 0) or (n_embd // n_head if n_head else 0))
    names = {t.name for t in tensors}
    qk_norm = any(n.endswith("attn_k_norm.weight") for n in names)
    tok = next((t for t in tensors if t.name == "token_embd.weight"), None)
    vocab = raw.get("tokenizer.ggml.tokens")
    n_vocab = int(tok.shape[1]) if tok is not None else (getattr(vocab, "length", None) or len(vocab or []))
    types: dict[str, int] = {}
    n_params = 0
    for t in tensors:
        tname = gguf.GGMLQuantizationType(t.ggml_type).name
        types[tname] = types.get(tname, 0) + 1
        n_params += t.n_elements
    ft = md.get("general.file_type")
    try:
        file_type = gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else ""
    except ValueError:
        file_type = str(ft)
    return ModelInfo(
        path=str(path),
        architecture=arch,
        name=str(md.get("general.name", "")),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_vocab=n_vocab,
        context_length=int(key("context_length", 0) or 0),
        qk_norm=qk_norm,
        sliding_window=int(key("attention.sliding_window", 0) or 0),
        swa_layers=_swa_layers(md, arch, n_layer),
        recurrent_layers=_recurrent_layers(md, arch, n_layer),
        file_type=file_type,
        n_params=n_params,
        file_size=Path(path).stat().st_size,
        tensor_types=types,
    )
