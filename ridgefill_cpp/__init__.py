"""ridgefill-cpp: faster long-prompt prefill for llama.cpp, with no training.

Importing this package makes llama-cpp-python load the patched llama.cpp libraries built by this
project (see :mod:`ridgefill_cpp.core.native`), so import it before ``llama_cpp``.
"""

from importlib.metadata import PackageNotFoundError, version as _version

from .core.native import LIB_DIR, NativeLibraryError, build_info

try:
    __version__ = _version("ridgefill-cpp")
except PackageNotFoundError:  # pragma: no cover - source tree without an install
    __version__ = "0.0.0"

from .core import models, settings  # noqa: E402
from .core.log import install as _install_log, set_llama_log  # noqa: E402
from .runtime.native_maps import UndigestedMapsWarning  # noqa: E402
from .runtime.prefill import Llama, RidgeFill  # noqa: E402  (after _native: the patched libraries)

_install_log()  # llama.cpp's log lines by their real levels, through one switch (ridgefill_cpp.core.log)

__all__ = ["Llama", "RidgeFill", "LIB_DIR", "NativeLibraryError", "build_info", "models", "settings", "set_llama_log",
           "UndigestedMapsWarning", "__version__"]
