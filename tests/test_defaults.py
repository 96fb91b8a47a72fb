"""One source of RidgeFill's defaults: libllama's built-in parameters (``llama_ridgefill_builtin_params``,
``csrc/llama-ridgefill-params.cpp``) against everything else that states a default.

Python's ``RidgeFill`` and ``settings``, llama-server's flags and its ``--help`` read theirs from
libllama, so they follow a change there by construction; the oracle (an independent implementation of
docs/design.md §4, which must not import the code it checks) and the README state theirs in their own
words. :func:`drift` lists every place that disagrees with libllama, and the last test shows that it
reports a changed C default.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path
from typing import Any, Mapping

import pytest

import ridgefill_cpp.core.native as N
from ridgefill_cpp import RidgeFill
from ridgefill_cpp.core import settings
from ridgefill_cpp.oracle import fill as F
from ridgefill_cpp.server.serve import server_binary

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PYTHON_DOC = REPO / "docs" / "python.md"
DESIGN = REPO / "docs" / "design.md"


def c_defaults() -> dict[str, Any]:
    """libllama's built-in value of each setting, read through the library, by RidgeFill's names."""
    p = N.llama_ridgefill_builtin_params()
    out = {name: getattr(p, field) for name, field in settings.C_FIELDS.items()}
    out["selector"] = N.llama_ridgefill_selector_name(p.selector).decode()
    out["protected"] = p.protected_classes
    out["placement"] = "host" if N.llama_ridgefill_maps_default_params().host else "resident"
    return out


def _server_help() -> dict[str, Any]:
    """The defaults llama-server's ``--help`` states for its --ridgefill-* flags."""
    text = " ".join(subprocess.run([str(server_binary()), "--help"], capture_output=True, text=True,
                                   timeout=60).stdout.split())
    out: dict[str, Any] = {}
    for name, flag, kind in (("tail", "tail", int), ("exact_fraction", "exact-fraction", float),
                             ("selector", "selector", str), ("span", "span", int),
                             ("key_rescale", "key-rescale", int), ("min_prompt", "min-prompt", int)):
        m = re.search(rf"--ridgefill-{flag} \S+ RidgeFill: .*?\(.*?default: (?:the map file's tuned value, else )?"
                      r"([\w.+]+)\)", text)
        assert m, f"llama-server --help has no default for --ridgefill-{flag}"
        out[name] = kind(m.group(1))
    return out


def _readme() -> dict[str, Any]:
    """The defaults the README states (the Python section and the results' operating point)."""
    text = " ".join(README.read_text().split())
    m = re.search(r"else T = (\d+), (\d+) %, `\"([\w+]+)\"` \(span (\d+)\)", text)
    assert m, "the README no longer states the default operating point where this test looks"
    out: dict[str, Any] = {"tail": int(m.group(1)), "exact_fraction": int(m.group(2)) / 100, "selector": m.group(3),
                           "span": int(m.group(4))}
    m = re.search(r"value rescale c = (\d+)", text)
    assert m, "the README no longer states the value rescale of its results"
    out["value_rescale"] = int(m.group(1))
    return out


def _python_doc() -> dict[str, Any]:
    """The defaults docs/python.md (the README's "more options") states."""
    text = " ".join(PYTHON_DOC.read_text().split())
    out: dict[str, Any] = {}
    m = re.search(r"`protected=\(\"(\w+)\", \"(\w+)\"\)`", text)
    assert m, "docs/python.md no longer states the protected selector's classes"
    out["protected"] = settings.protected_mask(m.groups())
    out["key_rescale"] = 0 if "`key_rescale=c_K` (a per-head key scale, off by default)" in text else None
    return out


def _design() -> dict[str, Any]:
    """The built-in values docs/design.md §13 (the C API) lists."""
    text = " ".join(DESIGN.read_text().split())
    text = text[text.index("## 13. The C API"):text.index("## 14. The Python package")]
    out: dict[str, Any] = {}
    for name, pattern, kind in (("tail", r"`n_tail` \(T, (\d+)\)", int),
                                ("exact_fraction", r"`exact_fraction` \(([\d.]+)\)", float),
                                ("selector", r"`selector` \((\w+)\)", str), ("span", r"`span` \((\d+)\)", int),
                                ("n_queries", r"`n_sel_queries` \((\d+)\)", int),
                                ("value_rescale", r"`n_rescale` \(c, (\d+)\)", int),
                                ("min_prompt", r"`min_prompt` \((\d+)\)", int),
                                ("fill_chunk", r"`n_fill_chunk` \((\d+): n_ubatch\)", int),
                                ("key_rescale", r"`n_key_rescale` \(c_K, (\d+)\)", int)):
        m = re.search(pattern, text)
        assert m, f"docs/design.md §13 no longer states the default of {name} where this test looks"
        out[name] = kind(m.group(1))
    return out


def statements() -> dict[str, Mapping[str, Any]]:
    """Every place that states a default -> {setting: the value it states}."""
    ident = RidgeFill.identity(3)
    fields = {f.name: f.default for f in dataclasses.fields(RidgeFill)}
    python = {name: getattr(ident, name) for name in settings.TUNABLE}
    python.update({name: fields[name] for name in ("value_rescale", "min_prompt", "n_queries", "fill_chunk",
                                                   "placement")})
    python["protected"] = settings.protected_mask(fields["protected"])
    return {
        "RidgeFill": python,
        "llama-server --help": _server_help(),
        "the oracle (ridgefill_cpp/oracle/fill.py)": {"value_rescale": F.DEFAULT_VALUE_RESCALE,
                                                       "n_queries": F.DEFAULT_N_QUERIES,
                                                       "exact_fraction": F.DEFAULT_FRACTION, "span": F.DEFAULT_SPAN},
        "README.md": _readme(),
        "docs/python.md": _python_doc(),
        "docs/design.md §13": _design(),
    }


def drift(c: Mapping[str, Any], stated: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per stated default that differs from libllama's."""
    return [f"{where}: {name} = {value!r}, libllama's is {c[name]!r}"
            for where, values in stated.items() for name, value in values.items() if value != c[name]]


@pytest.fixture(scope="module")
def stated() -> dict[str, Mapping[str, Any]]:
    return statements()


def test_every_stated_default_is_libllamas(stated):
    assert drift(c_defaults(), stated) == []
    # every setting with a default is stated somewhere besides libllama
    assert set().union(*stated.values()) == set(c_defaults())


def test_default_params_leave_the_tunable_fields_unset():
    """llama_ridgefill_default_params(): the built-in values, the tunable fields unset (the map
    file's tuned value, else the built-in one, once attached)."""
    d, b = N.llama_ridgefill_default_params(), N.llama_ridgefill_builtin_params()
    for name, field in settings.C_FIELDS.items():
        if name in settings.TUNABLE:
            assert getattr(d, field) == N.LLAMA_RIDGEFILL_UNSET, name
            assert getattr(b, field) != N.LLAMA_RIDGEFILL_UNSET, name
        else:
            assert getattr(d, field) == getattr(b, field), name
    assert settings.TUNABLE_DEFAULTS == {k: c_defaults()[k] for k in settings.TUNABLE}
    # the selector names: libllama's table and Python's
    names = {}
    for value in range(16):
        name = N.llama_ridgefill_selector_name(value)
        if name is not None:
            names[name.decode()] = value
            assert N.llama_ridgefill_selector_from_name(name) == value
    assert names == dict(settings.SELECTORS) and N.llama_ridgefill_selector_from_name(b"probing") == -1
    # and the server's --help lists them
    text = " ".join(subprocess.run([str(server_binary()), "--help"], capture_output=True, text=True,
                                   timeout=60).stdout.split())
    listed = re.search(r"--ridgefill-selector NAME RidgeFill: exact-row selector: ([\w+, ]+?) \(", text)
    assert listed and listed.group(1).split(", ") == list(names)
    assert N.llama_ridgefill_selector_names().decode().split(", ") == list(names)


@pytest.mark.parametrize("name", ["tail", "exact_fraction", "selector", "span", "key_rescale", "value_rescale",
                                  "min_prompt", "n_queries", "protected"])
def test_the_drift_check_reports_a_changed_c_default(stated, name):
    """What the first test reports had one default in csrc/ changed: every place stating it, by name.
    (Done for real: RIDGEFILL_BUILTIN.n_tail set to 65 and rebuilt, test_every_stated_default_is_libllamas
    failed with "README.md: tail = 64, libllama's is 65" and "docs/design.md §13: tail = 64, libllama's
    is 65"; RidgeFill and llama-server --help followed the C value, as they read it.)"""
    c = c_defaults()
    changed = dict(c)
    value = c[name]
    changed[name] = ("none" if value != "none" else "probe") if isinstance(value, str) else (
        value / 2 if isinstance(value, float) else value + 1)
    lines = drift(changed, stated)
    assert lines and all(f": {name} = " in line for line in lines), lines
    where = {line.split(":")[0] for line in lines}
    assert "RidgeFill" in where
