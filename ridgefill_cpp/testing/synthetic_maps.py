"""Random F16 ridge maps of a model's real size, for speed and size measurements (never for quality),
and a map file as written before content digests existed.

Used by tools/measure/gpu_h200.py (map placement on a GPU) and tools/measure/map_digest.py (what the content
digest costs). The file is a complete map file for ``model`` (its fingerprint, every late layer),
written with the package's map writer, so libllama's loader takes it as it takes a fitted one.
"""

from __future__ import annotations

import pathlib

import numpy as np


def write_synthetic_maps(model: pathlib.Path, path: pathlib.Path, split: int, *, reuse: bool = False,
                         seed: int = 0) -> pathlib.Path:
    """Write random F16 maps (A ~ N(0, 1/n_embd), b = 0) for every late layer of ``model`` at ``split``.
    ``reuse``: one random matrix for every layer (one draw at any depth; the bytes of the file are
    then the same per layer)."""
    import gguf

    from ..maps import mapfile
    from ..maps.fingerprint import model_fingerprint
    from ..core.gguf_model import read_model_info

    info = read_model_info(model)
    n = info.n_embd
    layers = list(range(split + 1, info.n_layer))
    rng = np.random.default_rng(seed)

    def matrix() -> np.ndarray:
        return (rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)).astype(np.float16)

    shared = matrix() if reuse else None
    with mapfile._map_writer(path, info.architecture) as w:
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string("adapter.type", mapfile.ADAPTER_TYPE)
        w.add_uint32(mapfile.KEY_FORMAT_VERSION, mapfile.FORMAT_VERSION)
        w.add_uint32(mapfile.KEY_SPLIT, split)
        w.add_uint32(mapfile.KEY_N_LAYER, info.n_layer)
        w.add_uint32(mapfile.KEY_N_EMBD, n)
        w.add_string(mapfile.KEY_OBJECTIVE, "normalized")
        w.add_string(mapfile.KEY_INPUT_NORM, "rms")
        w.add_float32(mapfile.KEY_INPUT_NORM_EPS, 1e-5)
        w.add_array(mapfile.KEY_LAYERS, layers)
        w.add_string(mapfile.KEY_FINGERPRINT, model_fingerprint(model))
        for il in layers:
            w.add_tensor(mapfile.tensor_name_a(il), shared if reuse else matrix())
            w.add_tensor(mapfile.tensor_name_b(il), np.zeros(n, dtype=np.float32))
    return path


def without_digest(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """``src`` as a file written before content digests existed (every key but the digest)."""
    import gguf

    from ..maps import mapfile

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, fld in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", mapfile.KEY_DIGEST):
            continue
        kind = fld.types[0]
        w.add_key_value(name, fld.contents(), kind, sub_type=fld.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(int(x) for x in reversed(t.shape.tolist()))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
