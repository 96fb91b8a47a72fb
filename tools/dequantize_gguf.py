#!/usr/bin/env python3
"""Write an F32 copy of a (quantized) GGUF model: same metadata, every tensor dequantized.

Used by the oracle tests: llama.cpp on the F32 copy and the torch oracle see exactly the same
weights, so the comparison is free of quantisation noise and can use a tight tolerance.

Usage: dequantize_gguf.py SRC.gguf DST.gguf
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np


def dequantize_gguf(src: os.PathLike | str, dst: os.PathLike | str) -> Path:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        for name, fld in reader.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
                continue
            kind = fld.types[0]
            sub = fld.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, fld.contents(), kind, sub_type=sub)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        for t in reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                arr = np.asarray(t.data, dtype=np.float32)
            else:
                arr = dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    print(dequantize_gguf(sys.argv[1], sys.argv[2]))
