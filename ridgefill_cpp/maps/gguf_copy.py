"""Derived copies of a model GGUF: an F32 copy (every tensor dequantized) or the first S layers.

The source model is only read; the copy is written atomically (a temporary file in the target
directory, then a rename). Used by the oracle tests (F32 copies: the same weights for llama.cpp
and the torch oracle) and by ``bench`` (a model cut to its first S layers: what prefill would cost
if the late layers cost nothing, the physical ceiling of any late-layer skipping).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..core.files import atomic_path
from ..core.gguf_model import read_model_info

# gguf-py is imported in the functions that read or write GGUF files: `import ridgefill_cpp` (and so
# `ridgefill-gguf --help`) does not pay its ~30 ms

_BLOCK = re.compile(r"^blk\.(\d+)\.")


@contextmanager
def atomic_gguf_writer(dst: os.PathLike | str, arch: str, *, mode: int | None = None) -> Iterator[Any]:
    """A ``gguf.GGUFWriter`` whose file appears at ``dst`` only when the block completes
    (:func:`ridgefill_cpp.core.files.atomic_path`: a temporary file in the same directory, then a rename;
    on any error nothing is left behind; only a regular file is replaced; the permission bits are
    ``mode``, else the replaced file's, else ``0666 & ~umask``)."""
    import gguf

    with atomic_path(dst, mode=mode) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            yield writer
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


def copy_gguf(
    src: os.PathLike | str,
    dst: os.PathLike | str,
    *,
    keep: Callable[[str], bool] = lambda name: True,
    dequantize: bool = False,
    metadata: dict[str, Any] | None = None,
    per_layer_arrays: int | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Copy ``src`` to ``dst``: the tensors ``keep`` accepts (dequantized to F32 if asked), all
    metadata with ``metadata`` overriding values of existing keys, and, with ``per_layer_arrays``
    = n, arrays of per-layer values (length = the source's block count) cut to their first n;
    ``extra_tensors`` (name -> array) are added after the source's."""
    import gguf
    from gguf.quants import dequantize as dequant

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layer_src = reader.fields[f"{arch}.block_count"].contents()
    overrides = dict(metadata or {})
    dst = Path(dst)
    with atomic_gguf_writer(dst, arch) as writer:
        for name, fld in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            kind = fld.types[0]
            sub = fld.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            value = overrides.pop(name, fld.contents())
            if name == "general.file_type" and dequantize:
                value = int(gguf.LlamaFileType.ALL_F32)
            if (per_layer_arrays is not None and kind == gguf.GGUFValueType.ARRAY and not name.startswith("tokenizer.")
                    and isinstance(value, list) and len(value) == n_layer_src):
                value = value[:per_layer_arrays]
            writer.add_key_value(name, value, kind, sub_type=sub)
        if overrides:
            raise KeyError(f"metadata keys not in {src}: {', '.join(overrides)}")
        for t in reader.tensors:
            if not keep(t.name):
                continue
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dtype = np.float32 if (dequantize or t.tensor_type == gguf.GGMLQuantizationType.F32) else np.float16
                writer.add_tensor(t.name, np.ascontiguousarray(np.asarray(t.data).astype(dtype)).reshape(shape))
            elif dequantize:
                writer.add_tensor(t.name, np.ascontiguousarray(dequant(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
            else:
                writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # rows of raw blocks
        for name, data in (extra_tensors or {}).items():
            writer.add_tensor(name, data)
    return dst


def dequantize_gguf(src: os.PathLike | str, dst: os.PathLike | str) -> Path:
    """An F32 copy of ``src``: same metadata (file type ALL_F32), every tensor dequantized."""
    return copy_gguf(src, dst, dequantize=True)


def first_layers_gguf(src: os.PathLike | str, dst: os.PathLike | str, n_layers: int) -> Path:
    """A copy of ``src`` with only its first ``n_layers`` blocks (the rest of the model unchanged)."""
    info = read_model_info(src)
    if not 1 <= n_layers <= info.n_layer:
        raise ValueError(f"n_layers {n_layers} outside 1..{info.n_layer}")

    def keep(name: str) -> bool:
        m = _BLOCK.match(name)
        return m is None or int(m.group(1)) < n_layers

    return copy_gguf(src, dst, keep=keep, metadata={f"{info.architecture}.block_count": n_layers},
                     per_layer_arrays=n_layers)
