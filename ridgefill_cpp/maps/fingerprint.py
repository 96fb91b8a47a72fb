"""A cheap fingerprint of a model GGUF that tells two checkpoints of one architecture apart.

It hashes the architecture, the tensor layout (names, shapes, types) and a sample of the tensor
bytes: 64 blocks of 4 KiB evenly spaced over the tensor data, plus the first and last 4 KiB of
the embeddings, the output head and every tensor of the first and last layer. About a megabyte is
read; any retraining or requantisation changes the sampled bytes.
"""

from __future__ import annotations

import hashlib
import mmap
import os

from ..core.gguf_model import read_header

_BLOCK = 4096
_N_SPREAD = 64


def model_fingerprint(path: os.PathLike | str) -> str:
    """``"sha256:<32 hex digits>"`` for the model GGUF at ``path``."""
    md, tensors = read_header(path)
    arch = str(md.get("general.architecture", ""))
    h = hashlib.sha256(arch.encode() + b"\0")
    for t in tensors:
        h.update(f"{t.name}:{list(t.shape)}:{t.ggml_type}:{t.n_bytes};".encode())
    if not tensors:
        return "sha256:" + h.hexdigest()[:32]
    last = int(md.get(f"{arch}.block_count", 1)) - 1
    sampled = ("token_embd.", "output.", "blk.0.", f"blk.{last}.")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = min(t.offset for t in tensors)
        end = max(t.offset + t.n_bytes for t in tensors)
        span = max(end - start - _BLOCK, 0)
        for i in range(_N_SPREAD):
            off = start + span * i // (_N_SPREAD - 1)
            h.update(data[off:off + _BLOCK])
        for t in tensors:
            if t.name.startswith(sampled):
                a, b = t.offset, t.offset + t.n_bytes
                h.update(data[a:min(a + _BLOCK, b)])
                h.update(data[max(b - _BLOCK, a):b])
    return "sha256:" + h.hexdigest()[:32]
