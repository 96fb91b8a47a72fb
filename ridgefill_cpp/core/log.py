"""llama.cpp's log, through one switch.

llama-cpp-python prints llama.cpp's log lines on stderr by the level of its logger, which
``Llama(verbose=...)`` sets (DEBUG: everything; ERROR: errors only). Its table of llama.cpp's log
levels predates the pinned llama.cpp (``ggml.h``: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5):
it takes a warning for an error and an error for debug output, so ``verbose=False`` printed every
warning (``llama_kv_cache_iswa: using full-size SWA cache ...``) and hid the errors. Importing
:mod:`ridgefill_cpp` installs :func:`_callback` in its place, with the levels of the pinned tree:

- ``Llama(verbose=True)`` shows every line, ``Llama(verbose=False)`` only errors, as llama-cpp-python
  intends; before any ``Llama`` sets it, errors only (quiet by default);
- :func:`set_llama_log` overrides that for the whole process: ``True`` shows every line, ``False``
  none, ``None`` hands the choice back to ``Llama(verbose=...)``. The command line sets ``False``,
  and ``True`` with ``--verbose``.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import llama_cpp
from llama_cpp import _logger as _lcp_logger

#: ggml_log_level (ggml.h of the pinned llama.cpp) -> logging level; CONT continues the line before
LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5

_override: bool | None = None
_last_shown = False


def set_llama_log(show: bool | None) -> None:
    """Show all of llama.cpp's log lines (True), none (False), or what ``Llama(verbose=...)`` chose
    (None, the default)."""
    global _override
    _override = show


def llama_log_override() -> bool | None:
    """What :func:`set_llama_log` set."""
    return _override


def _shown(level: int) -> bool:
    if _override is not None:
        return _override
    threshold = _lcp_logger.logger.level or logging.ERROR  # NOTSET (no Llama yet): errors only
    return LEVELS.get(level, logging.INFO) >= threshold


@llama_cpp.llama_log_callback
def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    global _last_shown
    show = _last_shown if level == _CONT else _shown(level)
    _last_shown = show
    if show:
        print(text.decode("utf-8", errors="replace"), end="", flush=True, file=sys.stderr)


def install() -> None:
    """Route llama.cpp's (and ggml's) log through :func:`_callback`."""
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
