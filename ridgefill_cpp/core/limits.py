"""The ranges values must be in before they cross into C (llama.cpp, libllama's RidgeFill API).

ctypes converts a Python int to a C ``int32_t`` modulo 2**32, silently (``2**32 + 64`` -> 64), and a
float to an int by truncation; :func:`check_int` and :func:`check_fraction` refuse such values with
a message that names the setting and its range. A C string ends at its first NUL character, so a
Python string with one inside would be cut where it crosses (``"attention\0junk"`` -> ``"attention"``):
:func:`check_c_string` refuses it whole.
"""

from __future__ import annotations

import math
import numbers
import os

#: the most threads llama.cpp takes (GGML_MAX_N_THREADS in ggml.h: more overflow its per-thread arrays)
MAX_THREADS = 512
#: the largest value of a C int32_t (RidgeFill's settings and llama_pos)
INT32_MAX = 2**31 - 1


def check_int(name: str, value, lo: int, hi: int = INT32_MAX, hint: str = "") -> int:
    """``value`` as an int, after checking that it is an integer (not a bool, not a float such as
    1.7) in ``lo..hi``; raises ``ValueError`` naming ``name``, the range and ``hint``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} {value!r} must be an integer in {lo}..{hi}{hint}")
    value = int(value)
    if value < lo:
        raise ValueError(f"{name} {value} must be >= {lo} (an integer in {lo}..{hi}){hint}")
    if value > hi:
        raise ValueError(f"{name} {value} must be <= {hi} (an integer in {lo}..{hi}){hint}")
    return value


def check_fraction(name: str, value, hint: str = "") -> float:
    """``value`` as a float, after checking that it is a real number (not a bool) in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} {value!r} must be a number in [0, 1]{hint}")
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} {value!r} outside [0, 1]{hint}")
    return float(value)


def check_c_string(name: str, value, hint: str = ""):
    """``value`` (a ``str``, ``bytes`` or path) unchanged, after checking that it holds no NUL character:
    C would read only the part before it. Raises ``ValueError`` naming ``name``."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if isinstance(text, (str, bytes)) and (b"\0" if isinstance(text, bytes) else "\0") in text:
        raise ValueError(f"{name} {value!r} contains a NUL character (C would read only the part before it){hint}")
    return value
