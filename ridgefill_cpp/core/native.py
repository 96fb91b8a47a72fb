"""Loading the patched llama.cpp libraries and binding RidgeFill's C API with ctypes.

llama-cpp-python is installed without its own native build (``LLAMA_BUILD=OFF``). Importing this
module points it at the libraries built by this project (``ridgefill_cpp/lib``): libllama through
``LLAMA_CPP_LIB_PATH``, and libggml by installing a ``llama_cpp._ggml`` module that loads ours
(llama-cpp-python's own ``_ggml.py`` always looks in ``llama_cpp/lib`` and ignores the variable).
It must therefore run before anything imports ``llama_cpp``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import types
from importlib.metadata import distribution
from pathlib import Path

_LIB_NAME = "libllama.so" if sys.platform.startswith("linux") else (
    "libllama.dylib" if sys.platform == "darwin" else "llama.dll"
)


class NativeLibraryError(ImportError):
    """The patched llama.cpp libraries are missing or a different libllama is already loaded."""


def _candidate_dirs() -> list[Path]:
    here = Path(__file__).resolve().parent.parent  # the package: ridgefill_cpp/lib
    dirs = []
    env = os.environ.get("RIDGEFILL_CPP_LIB_DIR")
    if env:
        dirs.append(Path(env))
    dirs.append(here / "lib")
    # running from a source checkout (PYTHONPATH=repo): use the installed native build
    try:
        dist = distribution("ridgefill-cpp")
        dirs.append(Path(dist.locate_file("ridgefill_cpp/lib")))
    except Exception:
        pass
    return dirs


def _find_lib_dir() -> Path:
    tried = _candidate_dirs()
    for d in tried:
        if (d / _LIB_NAME).is_file():
            return d.resolve()
    raise NativeLibraryError(
        "the patched llama.cpp libraries were not found (looked in: "
        + ", ".join(str(d) for d in tried)
        + "). Build them with `make setup` (see README)."
    )


LIB_DIR = _find_lib_dir()
BIN_DIR = LIB_DIR.parent / "bin"


def _install_llama_cpp_hooks() -> None:
    already = sys.modules.get("llama_cpp.llama_cpp")
    if already is not None:
        loaded = Path(getattr(already._lib, "_name", "")).resolve()
        if loaded.parent != LIB_DIR:
            raise NativeLibraryError(
                f"llama_cpp was imported before ridgefill_cpp and loaded {loaded}; "
                "import ridgefill_cpp first so llama_cpp uses the patched libraries in " + str(LIB_DIR)
            )
        return
    os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    import llama_cpp  # here, by design: only once the variable above says which libllama to load
    from llama_cpp._ctypes_extensions import load_shared_library

    ggml = types.ModuleType("llama_cpp._ggml", "libggml of the ridgefill-cpp build (replaces llama_cpp/_ggml.py)")
    ggml.libggml_base_path = LIB_DIR
    ggml.libggml = load_shared_library("ggml", LIB_DIR)
    sys.modules["llama_cpp._ggml"] = ggml
    llama_cpp._ggml = ggml


_install_llama_cpp_hooks()

from llama_cpp import llama_cpp as _llama  # noqa: E402  (after the hooks, by design)
from llama_cpp._ctypes_extensions import ctypes_function_for_shared_library  # noqa: E402

lib = _llama._lib
ctypes_function = ctypes_function_for_shared_library(lib)
llama_context_p = _llama.llama_context_p_ctypes


# LLAMA_API const char * llama_ridgefill_build_info(void);
@ctypes_function("llama_ridgefill_build_info", [], ctypes.c_char_p)
def llama_ridgefill_build_info() -> bytes: ...


# LLAMA_API int32_t llama_ridgefill_capture_layer_input(struct llama_context * ctx, int32_t il, bool enable);
@ctypes_function("llama_ridgefill_capture_layer_input", [llama_context_p, ctypes.c_int32, ctypes.c_bool], ctypes.c_int32)
def llama_ridgefill_capture_layer_input(ctx, il: int, enable: bool, /) -> int: ...


# LLAMA_API const float * llama_ridgefill_get_layer_input(struct llama_context * ctx, int32_t il);
@ctypes_function("llama_ridgefill_get_layer_input", [llama_context_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float))
def llama_ridgefill_get_layer_input(ctx, il: int, /): ...


def build_info() -> dict:
    """What the loaded native library was built from (llama.cpp commit, patch set, backends ...)."""
    info = json.loads(llama_ridgefill_build_info().decode())
    info["lib_dir"] = str(LIB_DIR)
    server = BIN_DIR / "llama-server"
    info["llama_server"] = str(server) if server.is_file() else None
    return info


# struct llama_ridgefill_maps_params { int32_t split_layer; bool host; const char * model_path; };
class llama_ridgefill_maps_params(ctypes.Structure):
    _fields_ = [("split_layer", ctypes.c_int32), ("host", ctypes.c_bool), ("model_path", ctypes.c_char_p)]


llama_ridgefill_maps_p = ctypes.c_void_p


# LLAMA_API struct llama_ridgefill_maps_params llama_ridgefill_maps_default_params(void);
@ctypes_function("llama_ridgefill_maps_default_params", [], llama_ridgefill_maps_params)
def llama_ridgefill_maps_default_params() -> llama_ridgefill_maps_params: ...


# LLAMA_API struct llama_ridgefill_maps * llama_ridgefill_maps_init(const struct llama_model * model, const char * path,
#                                                                  struct llama_ridgefill_maps_params params);
@ctypes_function("llama_ridgefill_maps_init", [_llama.llama_model_p_ctypes, ctypes.c_char_p, llama_ridgefill_maps_params],
                 llama_ridgefill_maps_p)
def llama_ridgefill_maps_init(model, path: bytes, params: llama_ridgefill_maps_params, /): ...


# LLAMA_API void llama_ridgefill_maps_free(struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_free", [llama_ridgefill_maps_p], None)
def llama_ridgefill_maps_free(maps, /) -> None: ...


# LLAMA_API int32_t llama_ridgefill_maps_split_layer(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_split_layer", [llama_ridgefill_maps_p], ctypes.c_int32)
def llama_ridgefill_maps_split_layer(maps, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_model_fingerprint(const char * model_path, char * buf, size_t buf_size);
@ctypes_function("llama_ridgefill_model_fingerprint", [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int32)
def llama_ridgefill_model_fingerprint(model_path: bytes, buf, buf_size: int, /) -> int: ...


# LLAMA_API const char * llama_ridgefill_maps_fingerprint(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_fingerprint", [llama_ridgefill_maps_p], ctypes.c_char_p)
def llama_ridgefill_maps_fingerprint(maps, /) -> bytes: ...


# LLAMA_API uint64_t llama_ridgefill_maps_n_bytes(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_n_bytes", [llama_ridgefill_maps_p], ctypes.c_uint64)
def llama_ridgefill_maps_n_bytes(maps, /) -> int: ...


# LLAMA_API const char * llama_ridgefill_maps_buffer_types(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_buffer_types", [llama_ridgefill_maps_p], ctypes.c_char_p)
def llama_ridgefill_maps_buffer_types(maps, /) -> bytes: ...


# LLAMA_API bool llama_ridgefill_maps_has_state_gains(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_has_state_gains", [llama_ridgefill_maps_p], ctypes.c_bool)
def llama_ridgefill_maps_has_state_gains(maps, /) -> bool: ...


# LLAMA_API const char * llama_ridgefill_supported_arch(int32_t i, bool * hybrid);
@ctypes_function("llama_ridgefill_supported_arch", [ctypes.c_int32, ctypes.POINTER(ctypes.c_bool)], ctypes.c_char_p)
def llama_ridgefill_supported_arch(i: int, hybrid, /) -> bytes | None: ...


# LLAMA_API bool llama_ridgefill_maps_digest_checked(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_digest_checked", [llama_ridgefill_maps_p], ctypes.c_bool)
def llama_ridgefill_maps_digest_checked(maps, /) -> bool: ...


# LLAMA_API bool llama_ridgefill_maps_host(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_host", [llama_ridgefill_maps_p], ctypes.c_bool)
def llama_ridgefill_maps_host(maps, /) -> bool: ...


# LLAMA_API const char * llama_ridgefill_maps_type(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_type", [llama_ridgefill_maps_p], ctypes.c_char_p)
def llama_ridgefill_maps_type(maps, /) -> bytes: ...


# LLAMA_API const char * llama_ridgefill_maps_form(const struct llama_ridgefill_maps * maps);
@ctypes_function("llama_ridgefill_maps_form", [llama_ridgefill_maps_p], ctypes.c_char_p)
def llama_ridgefill_maps_form(maps, /) -> bytes: ...


# LLAMA_API int32_t llama_ridgefill_maps_predict(const struct llama_ridgefill_maps * maps, int32_t il,
#                                                const float * xs, int32_t n_rows, float * out);
@ctypes_function("llama_ridgefill_maps_predict",
                 [llama_ridgefill_maps_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.c_int32,
                  ctypes.POINTER(ctypes.c_float)], ctypes.c_int32)
def llama_ridgefill_maps_predict(maps, il: int, xs, n_rows: int, out, /) -> int: ...


# LLAMA_API const char * llama_ridgefill_last_error(void);
@ctypes_function("llama_ridgefill_last_error", [], ctypes.c_char_p)
def llama_ridgefill_last_error() -> bytes: ...


# the enums of llama_ridgefill_params (selector, token classes, splice, state correction): their
# values are the tables of ridgefill_cpp.core.settings (SELECTORS, TOKEN_CLASSES, SPLICES, STATE_CORRECTIONS)


# struct llama_ridgefill_params { ... };
class llama_ridgefill_params(ctypes.Structure):
    _fields_ = [
        ("split_layer", ctypes.c_int32),
        ("n_tail", ctypes.c_int32),
        ("exact_fraction", ctypes.c_double),
        ("selector", ctypes.c_int32),
        ("n_sel_queries", ctypes.c_int32),
        ("sel_layer", ctypes.c_int32),
        ("n_rescale", ctypes.c_int32),
        ("min_prompt", ctypes.c_int32),
        ("n_fill_chunk", ctypes.c_int32),
        ("splice", ctypes.c_int32),
        ("n_key_rescale", ctypes.c_int32),
        ("protected_classes", ctypes.c_int32),
        ("state_correction", ctypes.c_int32),
        ("span", ctypes.c_int32),
    ]


# struct llama_ridgefill_stats { ... };
class llama_ridgefill_stats(ctypes.Structure):
    _fields_ = [
        ("active", ctypes.c_int32),
        ("seq_id", ctypes.c_int32),
        ("pos0", ctypes.c_int32),
        ("n_prompt", ctypes.c_int32),
        ("n_layer", ctypes.c_int32),
        ("split_layer", ctypes.c_int32),
        ("n_tail", ctypes.c_int32),
        ("n_exact", ctypes.c_int32),
        ("n_filled", ctypes.c_int32),
        ("sel_layer", ctypes.c_int32),
        ("n_scale_rows", ctypes.c_int32),
        ("ceiling", ctypes.c_float),
        ("n_probe", ctypes.c_int32),
        ("t_late_ms", ctypes.c_double),
        ("n_early_built", ctypes.c_int32),
        ("n_early_reused", ctypes.c_int32),
        ("n_late_built", ctypes.c_int32),
        ("n_late_reused", ctypes.c_int32),
        ("t_early_ms", ctypes.c_double),
        ("t_build_ms", ctypes.c_double),
        ("t_alloc_ms", ctypes.c_double),
        ("t_set_input_ms", ctypes.c_double),
        ("t_compute_ms", ctypes.c_double),
        ("t_wait_ms", ctypes.c_double),
        ("t_other_ms", ctypes.c_double),
        ("n_late_rows", ctypes.c_int32),
        ("n_late_rows_recr", ctypes.c_int32),
        ("n_scratch_cells", ctypes.c_int32),
        ("n_window_graphs", ctypes.c_int32),
        ("scratch_bytes", ctypes.c_int64),
        ("graph_kq_mask", ctypes.c_int32),
    ]


_pos_p = ctypes.POINTER(ctypes.c_int32)
_float_p = ctypes.POINTER(ctypes.c_float)


# LLAMA_API struct llama_ridgefill_params llama_ridgefill_default_params(void);
@ctypes_function("llama_ridgefill_default_params", [], llama_ridgefill_params)
def llama_ridgefill_default_params() -> llama_ridgefill_params: ...


# LLAMA_API struct llama_ridgefill_params llama_ridgefill_builtin_params(void);
@ctypes_function("llama_ridgefill_builtin_params", [], llama_ridgefill_params)
def llama_ridgefill_builtin_params() -> llama_ridgefill_params: ...


#: the value of an unset tunable field (LLAMA_RIDGEFILL_UNSET): the map file's tuned value, else built in
LLAMA_RIDGEFILL_UNSET = -1
#: enum llama_ridgefill_tunable: the tunable fields as bits (the RidgeFill name of each)
LLAMA_RIDGEFILL_TUNABLE = {"tail": 1, "exact_fraction": 2, "selector": 4, "span": 8, "key_rescale": 16}


# LLAMA_API int32_t llama_ridgefill_resolve_params(const char * maps_path, struct llama_ridgefill_params * params);
@ctypes_function("llama_ridgefill_resolve_params", [ctypes.c_char_p, ctypes.POINTER(llama_ridgefill_params)],
                 ctypes.c_int32)
def llama_ridgefill_resolve_params(maps_path: bytes | None, params, /) -> int: ...


# LLAMA_API const char * llama_ridgefill_selector_name(int32_t selector);
@ctypes_function("llama_ridgefill_selector_name", [ctypes.c_int32], ctypes.c_char_p)
def llama_ridgefill_selector_name(selector: int, /) -> bytes | None: ...


# LLAMA_API int32_t llama_ridgefill_selector_from_name(const char * name);
@ctypes_function("llama_ridgefill_selector_from_name", [ctypes.c_char_p], ctypes.c_int32)
def llama_ridgefill_selector_from_name(name: bytes, /) -> int: ...


# LLAMA_API const char * llama_ridgefill_selector_names(void);
@ctypes_function("llama_ridgefill_selector_names", [], ctypes.c_char_p)
def llama_ridgefill_selector_names() -> bytes: ...


# LLAMA_API int32_t llama_ridgefill_get_params(const struct llama_context * ctx, struct llama_ridgefill_params * out);
@ctypes_function("llama_ridgefill_get_params", [llama_context_p, ctypes.POINTER(llama_ridgefill_params)], ctypes.c_int32)
def llama_ridgefill_get_params(ctx, out, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_attach(struct llama_context * ctx, const struct llama_ridgefill_maps * maps,
#                                          struct llama_ridgefill_params params);
@ctypes_function("llama_ridgefill_attach", [llama_context_p, llama_ridgefill_maps_p, llama_ridgefill_params], ctypes.c_int32)
def llama_ridgefill_attach(ctx, maps, params: llama_ridgefill_params, /) -> int: ...


# LLAMA_API void llama_ridgefill_detach(struct llama_context * ctx);
@ctypes_function("llama_ridgefill_detach", [llama_context_p], None)
def llama_ridgefill_detach(ctx, /) -> None: ...


# LLAMA_API int32_t llama_ridgefill_begin(struct llama_context * ctx, llama_seq_id seq_id, llama_pos pos0, llama_pos pos_end);
@ctypes_function("llama_ridgefill_begin", [llama_context_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32)
def llama_ridgefill_begin(ctx, seq_id: int, pos0: int, pos_end: int, /) -> int: ...


# LLAMA_API const char * llama_ridgefill_stock_reason(const struct llama_context * ctx);
@ctypes_function("llama_ridgefill_stock_reason", [llama_context_p], ctypes.c_char_p)
def llama_ridgefill_stock_reason(ctx, /) -> bytes: ...


# LLAMA_API int32_t llama_ridgefill_set_exact(struct llama_context * ctx, const llama_pos * pos, int32_t n);
@ctypes_function("llama_ridgefill_set_exact", [llama_context_p, _pos_p, ctypes.c_int32], ctypes.c_int32)
def llama_ridgefill_set_exact(ctx, pos, n: int, /) -> int: ...


# LLAMA_API void llama_ridgefill_cancel(struct llama_context * ctx);
@ctypes_function("llama_ridgefill_cancel", [llama_context_p], None)
def llama_ridgefill_cancel(ctx, /) -> None: ...


# LLAMA_API int32_t llama_ridgefill_get_stats(struct llama_context * ctx, struct llama_ridgefill_stats * out);
@ctypes_function("llama_ridgefill_get_stats", [llama_context_p, ctypes.POINTER(llama_ridgefill_stats)], ctypes.c_int32)
def llama_ridgefill_get_stats(ctx, out, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_get_exact(struct llama_context * ctx, llama_pos * out, int32_t n);
@ctypes_function("llama_ridgefill_get_exact", [llama_context_p, _pos_p, ctypes.c_int32], ctypes.c_int32)
def llama_ridgefill_get_exact(ctx, out, n: int, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_get_scores(struct llama_context * ctx, float * out, int32_t n);
@ctypes_function("llama_ridgefill_get_scores", [llama_context_p, _float_p, ctypes.c_int32], ctypes.c_int32)
def llama_ridgefill_get_scores(ctx, out, n: int, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_get_value_scales(struct llama_context * ctx, float * out, int32_t n);
@ctypes_function("llama_ridgefill_get_value_scales", [llama_context_p, _float_p, ctypes.c_int32], ctypes.c_int32)
def llama_ridgefill_get_value_scales(ctx, out, n: int, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_read_state(struct llama_context * ctx, int32_t il, llama_seq_id seq_id,
#                                              float * out, int32_t n);
@ctypes_function("llama_ridgefill_read_state", [llama_context_p, ctypes.c_int32, ctypes.c_int32, _float_p, ctypes.c_int32],
                 ctypes.c_int32)
def llama_ridgefill_read_state(ctx, il: int, seq_id: int, out, n: int, /) -> int: ...


# LLAMA_API void llama_ridgefill_record_boundary_states(struct llama_context * ctx, bool record);
@ctypes_function("llama_ridgefill_record_boundary_states", [llama_context_p, ctypes.c_bool], None)
def llama_ridgefill_record_boundary_states(ctx, record: bool, /) -> None: ...


# LLAMA_API int32_t llama_ridgefill_get_boundary_state(struct llama_context * ctx, int32_t il, float * out, int32_t n);
@ctypes_function("llama_ridgefill_get_boundary_state", [llama_context_p, ctypes.c_int32, _float_p, ctypes.c_int32],
                 ctypes.c_int32)
def llama_ridgefill_get_boundary_state(ctx, il: int, out, n: int, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_splice_state(struct llama_context * ctx, int32_t il, const float * state, int32_t n);
@ctypes_function("llama_ridgefill_splice_state", [llama_context_p, ctypes.c_int32, _float_p, ctypes.c_int32], ctypes.c_int32)
def llama_ridgefill_splice_state(ctx, il: int, state, n: int, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_read_kv(struct llama_context * ctx, int32_t il, llama_seq_id seq_id,
#                                           const llama_pos * pos, int32_t n, float * k_out, float * v_out);
@ctypes_function("llama_ridgefill_read_kv",
                 [llama_context_p, ctypes.c_int32, ctypes.c_int32, _pos_p, ctypes.c_int32, _float_p, _float_p],
                 ctypes.c_int32)
def llama_ridgefill_read_kv(ctx, il: int, seq_id: int, pos, n: int, k_out, v_out, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_get_key_scales(struct llama_context * ctx, float * out, int32_t n);
@ctypes_function("llama_ridgefill_get_key_scales", [llama_context_p, _float_p, ctypes.c_int32], ctypes.c_int32)
def llama_ridgefill_get_key_scales(ctx, out, n: int, /) -> int: ...


# LLAMA_API int32_t llama_ridgefill_rpc_devices(const char * servers, ggml_backend_dev_t * devs, int32_t n_max);
@ctypes_function("llama_ridgefill_rpc_devices", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32],
                 ctypes.c_int32)
def llama_ridgefill_rpc_devices(servers: bytes, devs, n_max: int, /) -> int: ...


# LLAMA_API const char * llama_ridgefill_lost_rpc_servers(const struct llama_model * model);
@ctypes_function("llama_ridgefill_lost_rpc_servers", [_llama.llama_model_p_ctypes], ctypes.c_char_p)
def llama_ridgefill_lost_rpc_servers(model, /) -> bytes: ...


# LLAMA_API const char * llama_ridgefill_layer_device(const struct llama_model * model, int32_t il);
@ctypes_function("llama_ridgefill_layer_device", [_llama.llama_model_p_ctypes, ctypes.c_int32], ctypes.c_char_p)
def llama_ridgefill_layer_device(model, il: int, /) -> bytes | None: ...
