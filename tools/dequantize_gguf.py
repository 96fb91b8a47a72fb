#!/usr/bin/env python3
"""Write an F32 copy of a (quantized) GGUF model: same metadata, every tensor dequantized.

Used by the oracle tests: llama.cpp on the F32 copy and the torch oracle see exactly the same
weights, so the comparison is free of quantisation noise and can use a tight tolerance.

Usage: dequantize_gguf.py SRC.gguf DST.gguf
"""

from __future__ import annotations

import sys

from ridgefill_cpp.maps.gguf_copy import dequantize_gguf

__all__ = ["dequantize_gguf"]

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    print(dequantize_gguf(sys.argv[1], sys.argv[2]))
