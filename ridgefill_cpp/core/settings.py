"""RidgeFill's settings vocabulary, in one place: the selector and token-class names with their C
values, the ``protected:CLASS+CLASS`` selector grammar, the check of every setting, the keys of
``Llama.ridgefill_stats``, and the commands' own defaults (prompt lengths, grids, budgets).

The defaults of RidgeFill's settings themselves are libllama's: ``llama_ridgefill_builtin_params()``
(``csrc/llama-ridgefill-params.cpp``) holds every one, and the names below (:data:`TAIL`,
:data:`EXACT_FRACTION`, :data:`SELECTOR`, ... , :data:`TUNABLE_DEFAULTS`) read them from there when
first used, so Python, llama-server and any C caller run the same values. The tunable ones (tail,
exact fraction, selector, span, key rescale) are resolved against a map file's tuned operating point
by libllama too (:func:`resolve_tunable`).

:class:`ridgefill_cpp.RidgeFill`, the command line and the commands' library functions (``bench``,
``eval``, ``tune``, ``serve``, ``fit --state-gains``) read their defaults and names from here; no
other module restates them. The C values of the names mirror the enums of ``csrc/llama-ridgefill.h``
(docs/design.md §5).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Sequence

from .limits import INT32_MAX, check_fraction, check_int

# ------------------------------------------------------------------------------------------------
# the plan's defaults (RidgeFill's keyword arguments): libllama's, read when first used
#
#   TAIL            T: the last prompt rows, always exact
#   EXACT_FRACTION  share of the prefix rows the selector keeps exact
#   SELECTOR        the exact-row selector
#   SPAN            the attention and probe selectors' span: rows are taken by the highest score within
#                   the span of this many rows around them (1: single rows), for SPAN_SHARE of the exact
#                   rows, then single rows by score; at most MAX_SPAN. 16 keeps a planted fact whole
#                   where single rows keep only its name (docs/selector-spans)
#   KEY_RESCALE     c_K: tail rows the key scale is measured on (0: off)
#   VALUE_RESCALE   c: tail rows the per-head value scale is measured on (0: off)
#   MIN_PROMPT      prompts with fewer new rows run stock prefill
#   N_QUERIES       the attention selector's query rows (the last prompt rows)
#   FILL_CHUNK      filled rows per fill step (0: n_ubatch)
#   PROTECTED       the protected selector's token classes (chosen from the eval: README, "Selectors")
#   PLACEMENT       where the maps live
#   TUNABLE_DEFAULTS  the settings ``ridgefill-gguf tune`` chooses and writes into a map file
#                   (``ridgefill.tuned.*``), with their built-in values: an explicit value wins over the
#                   map file's, which wins over these

#: the constants of the span and recency rules (LLAMA_RIDGEFILL_MAX_SPAN, _SPAN_SHARE, _RECENCY_SHARE
#: of csrc/llama-ridgefill.h; tests/test_settings.py compares them): the longest span, the share of
#: the exact rows a span > 1 takes as whole spans, and the share the attention selectors take first by
#: the recency-corrected score (docs/selector-spans)
MAX_SPAN = 4096
SPAN_SHARE = 0.75
RECENCY_SHARE = 0.25

#: RidgeFill's name of each field of llama_ridgefill_params with a default
C_FIELDS: Mapping[str, str] = {
    "tail": "n_tail", "exact_fraction": "exact_fraction", "selector": "selector", "span": "span",
    "key_rescale": "n_key_rescale", "value_rescale": "n_rescale", "min_prompt": "min_prompt",
    "n_queries": "n_sel_queries", "fill_chunk": "n_fill_chunk", "protected": "protected_classes",
}
#: the settings ``ridgefill-gguf tune`` chooses (enum llama_ridgefill_tunable)
TUNABLE = ("tail", "exact_fraction", "selector", "span", "key_rescale")
#: the module's default names -> RidgeFill's setting
_DEFAULT_NAMES: Mapping[str, str] = {
    "TAIL": "tail", "EXACT_FRACTION": "exact_fraction", "SELECTOR": "selector", "SPAN": "span",
    "KEY_RESCALE": "key_rescale", "VALUE_RESCALE": "value_rescale", "MIN_PROMPT": "min_prompt",
    "N_QUERIES": "n_queries", "FILL_CHUNK": "fill_chunk", "PROTECTED": "protected", "PLACEMENT": "placement",
}


@functools.lru_cache(maxsize=None)
def builtin() -> Mapping[str, Any]:
    """libllama's built-in value of every RidgeFill setting, by RidgeFill's names
    (``llama_ridgefill_builtin_params()``, ``llama_ridgefill_maps_default_params()``)."""
    from . import native as N

    p = N.llama_ridgefill_builtin_params()
    out: dict[str, Any] = {name: getattr(p, field) for name, field in C_FIELDS.items()}
    out["selector"] = selector_name(p.selector)
    out["protected"] = tuple(c for c, bit in TOKEN_CLASSES.items() if p.protected_classes & bit)
    out["placement"] = "host" if N.llama_ridgefill_maps_default_params().host else "resident"
    return out


def selector_name(value: int) -> str:
    """The name of a C selector value (libllama's ``llama_ridgefill_selector_name``)."""
    from . import native as N

    name = N.llama_ridgefill_selector_name(int(value))
    if name is None:
        raise ValueError(f"libllama has no selector {value}")
    return name.decode()


def __getattr__(name: str) -> Any:
    # the defaults of RidgeFill's settings: libllama's (PEP 562, read when first used)
    if name in _DEFAULT_NAMES:
        return builtin()[_DEFAULT_NAMES[name]]
    if name == "TUNABLE_DEFAULTS":
        return {k: builtin()[k] for k in TUNABLE}
    if name == "TUNE_SPANS":
        return (builtin()["span"],)
    if name == "TUNE_KEY_RESCALES":
        return (builtin()["key_rescale"],)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------
# the commands' defaults (the library functions and the command line share them)

#: llama.cpp batch (and ubatch) size of bench, eval and tune
N_BATCH = 512
#: bench: prompt lengths, timed prefills per variant and length, greedy tokens compared with stock's
BENCH_LENGTHS = (2048, 4096)
BENCH_REPEATS = 3
BENCH_GREEDY_TOKENS = 16
#: eval: prompt lengths and documents per length
EVAL_LENGTHS = (2048,)
EVAL_DOCS = 12
#: eval --ruler: lengths (prompt plus generation, tokens; RULER's shortest) and prompts per task and length
RULER_LENGTHS = (4096,)
RULER_SAMPLES = 20
#: eval --quick: a smoke run (a few minutes on SmolLM2)
EVAL_QUICK: Mapping[str, Any] = {"lengths": (1024,), "n_docs": 4, "depths": (0.2, 0.6), "names_per_depth": 1,
                                 "n_boot": 500}
#: tune: the grid of tails and exact fractions, the held-out documents' length and number
TUNE_TAILS = (32, 64, 128)
TUNE_FRACTIONS = (0.0, 0.05, 0.10, 0.20)
TUNE_LENGTH = 2048
TUNE_DOCS = 8
#: tune: the spans searched (the span selectors only) and the key rescales c_K (0: off) are TUNE_SPANS
#: and TUNE_KEY_RESCALES: the built-in span and c_K (read from libllama when first used)
#: tune's retrieval check: prompts (one per depth, spread over the filled region) with this many
#: planted codes each
TUNE_RETRIEVAL_PROMPTS = 5
TUNE_RETRIEVAL_CODES = 2
#: fit: the calibration token budget and rows per calibration window. The budget is the smallest whose
#: novel-token ΔNLL stays within the 95 % CI of 100K tokens' on every model measured (docs/fit-budget,
#: summary.json's default_tokens; a test keeps the two equal)
FIT_TOKENS = 10_000
FIT_CTX = 512
#: ``fit``'s storage type of the map matrices: Q8_0 kept novel-token ΔNLL within F16's CI and every
#: planted code on both real models at 0.53x the bytes (docs/compact-maps); F16 where n_embd is not a
#: multiple of Q8_0's 32-element blocks
FIT_DTYPE = "q8_0"
#: fit --state-gains (hybrids): at most this many calibration windows for the terminal-state gains
FIT_STATE_GAIN_WINDOWS = 16

# ------------------------------------------------------------------------------------------------
# names and their C values

#: selectors by name -> enum llama_ridgefill_selector (docs/design.md §5); a sequence of positions
#: is the explicit selector (RidgeFill.selector then reads "positions")
SELECTORS: Mapping[str, int] = {
    "attention": 1,
    "attention+protected": 4,
    "probe": 2,
    "protected": 3,
    "none": 0,
}
#: the selectors that keep the rows of token classes (``protected:CLASS+CLASS`` names them)
CLASS_SELECTORS = ("protected", "attention+protected")
#: the selectors that rank rows by a score, and so take a span (``attention@16``)
SPAN_SELECTORS = ("attention", "attention+protected", "probe")

#: row classes of the protected selectors -> enum llama_ridgefill_token_class (a bit mask)
TOKEN_CLASSES: Mapping[str, int] = {
    "sink": 8,        # positions 0-3, the attention sink
    "digits": 1,      # a decimal digit in the token's text
    "rare": 2,        # the token occurs once in the prompt
    "line_start": 4,  # the token after a newline
}

#: RidgeFill(placement=...)
PLACEMENTS = ("resident", "host")
#: RidgeFill(state_correction=...) -> enum llama_ridgefill_state_correction
STATE_CORRECTIONS: Mapping[str | None, int] = {None: 0, "gain": 1}
#: RidgeFill(splice=...) -> enum llama_ridgefill_splice (diagnostics, the splice test of docs/design.md §9:
#: the filled rows keep the late-layer K, V or both that the cells already hold)
SPLICES: Mapping[str | None, int] = {None: 0, "K": 1, "V": 2, "KV": 3}

# ------------------------------------------------------------------------------------------------
# what the library reports

#: the keys of ``Llama.ridgefill_stats`` (the last planned prefill; ``{}`` when it ran stock), in order
STATS: Mapping[str, str] = {
    "n_prompt": "rows of the prompt (the new rows of this prefill)",
    "pos0": "position of its first row",
    "n_layer": "L, the model's layers",
    "split": "S, the first late layer",
    "tail": "T, the last prompt rows, exact",
    "n_filled": "prefix rows filled",
    "n_exact": "prefix rows the selector kept exact",
    "exact_positions": "their positions",
    "selector_layer": "the attention selector's layer (-1: none)",
    "value_scale_rows": "tail rows the value scale was measured on",
    "probe_rows": "extra late-layer rows of the probe selector",
    "ceiling": "the plan's compute ceiling 1/r",
    "late_ms": "time in the late layers (ms)",
    "prefill_ms": "time of the whole prefill (ms)",
    "graphs": "graphs of the plan: {early_built, early_reused, late_built, late_reused}",
    "times_ms": "where its time went (ms): {early, late, build, alloc, set_input, compute, wait, other}; the last six"
                " split the late phase",
    "late_rows": "rows of a late graph: {attention (exact rows of a chunk: n_ubatch), recurrent (rows of a chunk,"
                 " at most n_ubatch of them exact)}",
    "window": "a window-sized sliding-window cache (swa_full off): {scratch_cells, scratch_bytes (the late sliding-window"
              " layers' scratch cache; 0: none), graphs (late graphs over it)}",
    "kq_mask": "'graph': the plan's graphs computed their KQ masks from the cells' positions (the default where the"
               " KV cache is in device memory; LLAMA_RIDGEFILL_GRAPH_MASK=0/1 overrides), 'host': llama.cpp's masks",
    "maps_bytes": "bytes of the maps (0: identity fill)",
    "maps_placement": "'resident' or 'host'",
    "maps_buffers": "the ggml buffer types holding the maps",
    "maps_type": "the map matrices' storage type and form, e.g. 'f16', 'q8_0', 'f16 identity_low_rank' (None: identity fill)",
}


def names(table: Mapping | Sequence) -> str:
    """The names of a table, comma-separated, for messages and help texts."""
    return ", ".join(str(k) for k in table)


# ------------------------------------------------------------------------------------------------
# the selector grammar


def parse_classes(classes: str | Sequence[str]) -> tuple[str, ...]:
    """Token class names from ``"digits,rare"`` or ``("digits", "rare")``, after checking them (at
    least one, each a name of :data:`TOKEN_CLASSES`)."""
    if isinstance(classes, str):
        names_ = [c.strip() for c in classes.split(",")]
    else:
        names_ = [str(c) for c in classes]
    names_ = [c for c in names_ if c]
    bad = [c for c in names_ if c not in TOKEN_CLASSES]
    if bad or not names_:
        raise ValueError(f"protected token classes {classes!r}: use one or more of {names(TOKEN_CLASSES)}")
    return tuple(names_)


def protected_mask(classes: str | Sequence[str]) -> int:
    """The C bit mask of token class names (``"digits,rare"`` or ``("digits", "rare")``)."""
    mask = 0
    for c in parse_classes(classes):
        mask |= TOKEN_CLASSES[c]
    return mask


def parse_selector(spec: str) -> dict[str, Any]:
    """A selector spec of the command line (bench, eval, tune) -> RidgeFill keyword arguments:
    ``NAME[:CLASS+CLASS][@SPAN]``. NAME: ``attention``, ``probe``, ``none``, ``protected`` or
    ``attention+protected`` (the last two with the default classes, :data:`PROTECTED`, unless
    ``:CLASS+CLASS`` names some of :data:`TOKEN_CLASSES`); ``@SPAN``: the span of the attention and
    probe scores (e.g. ``attention@16``). ``{"selector": name}``, plus ``"protected": classes`` and
    ``"span": n`` when the spec gives them."""
    head, at, span = str(spec).partition("@")
    name, _, classes = head.partition(":")
    if name not in SELECTORS or (classes and name not in CLASS_SELECTORS):
        raise ValueError(f"selector {spec!r}: use one of {names(SELECTORS)}, or protected:CLASS+CLASS, "
                         "optionally with @SPAN (attention@16)")
    out: dict[str, Any] = {"selector": name}
    if classes:
        out["protected"] = parse_classes(classes.split("+"))
    if at:
        if name not in SPAN_SELECTORS:
            raise ValueError(f"selector {spec!r}: only {names(SPAN_SELECTORS)} take a span (@SPAN)")
        if not span.isdigit():
            raise ValueError(f"selector {spec!r}: the span after @ must be an integer in 1..{MAX_SPAN}")
        out["span"] = check("span", int(span), label=f"selector {spec!r}: span")
    return out


# ------------------------------------------------------------------------------------------------
# checks: every setting before it crosses into C (int32, no silent truncation, no bools)

#: integer settings -> (lowest value, what the message adds)
_INT_SETTINGS: Mapping[str, tuple[int, str]] = {
    "split": (1, ""),
    "tail": (1, ": the last prompt rows kept exact (at least the last prompt row must be exact)"),
    "value_rescale": (0, "; 0 is off"),
    "key_rescale": (0, "; 0 is off"),
    "min_prompt": (0, ""),
    "n_queries": (1, ""),
    "selector_layer": (0, "; None is the last full-attention layer below the split"),
    "fill_chunk": (0, "; 0 is n_ubatch"),
    "span": (1, ": rows around each top-scoring row kept exact with it; 1 is single rows"),
}
#: their highest values below INT32_MAX
_INT_MAX: Mapping[str, int] = {"span": MAX_SPAN}


def check(setting: str, value: Any, *, label: str | None = None, hint: str = "") -> Any:
    """``value`` of RidgeFill setting ``setting`` after checking it, normalised (an int, a float in
    [0, 1], a selector name or a sorted tuple of positions, a tuple of class names, ...); raises
    ``ValueError`` naming ``label`` (default: the setting) and adding ``hint``."""
    label = setting if label is None else label
    if setting in _INT_SETTINGS:
        lo, what = _INT_SETTINGS[setting]
        return check_int(label, value, lo, _INT_MAX.get(setting, INT32_MAX), hint=what + hint)
    if setting == "exact_fraction":
        return check_fraction(label, value, hint)
    if setting == "selector":
        return check_selector(value, hint=hint)
    if setting == "protected":
        parse_classes(value)
        return value if isinstance(value, str) else tuple(value)
    if setting == "placement":
        if value not in PLACEMENTS:
            raise ValueError(f"{label} {value!r}: use one of {names(PLACEMENTS)}")
        return value
    if setting == "state_correction":
        if value not in STATE_CORRECTIONS:
            raise ValueError(f"{label} {value!r}: use None or 'gain'")
        return value
    if setting == "splice":
        if value not in SPLICES:
            raise ValueError(f"{label} {value!r}: use None, 'K', 'V' or 'KV'")
        return value
    raise ValueError(f"unknown RidgeFill setting {setting!r}")


def check_selector(selector: str | Sequence[int], *, hint: str = "") -> str | tuple[int, ...]:
    """A selector name (of :data:`SELECTORS`), or the sorted distinct positions of an explicit one."""
    if isinstance(selector, str):
        if selector not in SELECTORS:
            raise ValueError(f"selector {selector!r}: use one of {names(SELECTORS)} or a list of positions{hint}")
        return selector
    try:
        given = list(selector)
    except TypeError as e:
        raise ValueError(f"selector {selector!r}: use one of {names(SELECTORS)} or a list of positions") from e
    return tuple(sorted({check_int("selector position", p, 0, INT32_MAX) for p in given}))


def resolve_tunable(given: Mapping[str, Any], maps: str | os.PathLike | None) -> tuple[dict[str, Any], dict[str, str]]:
    """``tail``, ``exact_fraction``, ``selector``, ``span`` and ``key_rescale`` resolved as libllama
    resolves them when RidgeFill is attached (``llama_ridgefill_resolve_params``): the ``given`` value
    when not None, else the tuned value of the map file at ``maps`` (``ridgefill.tuned.*``; None: no
    map file), else the built-in one. Returns the values and where each came from (``"argument"``,
    ``"map file"`` or ``"built-in"``). A selector given as positions is passed as "none" and returned
    as given. Raises ``ValueError`` when a tuned value it would take is of the wrong type or out of
    range, naming the key."""
    from . import native as N

    p = N.llama_ridgefill_default_params()
    for name in TUNABLE:
        value = given.get(name)
        if value is None:
            continue
        if name == "selector":
            p.selector = SELECTORS.get(value, SELECTORS["none"]) if isinstance(value, str) else SELECTORS["none"]
        else:
            setattr(p, C_FIELDS[name], value)
    path = None if maps is None else os.fsencode(maps)
    from_file = N.llama_ridgefill_resolve_params(path, p)
    if from_file < 0:
        raise ValueError(N.llama_ridgefill_last_error().decode(errors="replace"))
    values, origin = {}, {}
    for name in TUNABLE:
        if given.get(name) is not None:
            values[name], origin[name] = given[name], "argument"
            continue
        value = getattr(p, C_FIELDS[name])
        values[name] = selector_name(value) if name == "selector" else value
        origin[name] = "map file" if from_file & N.LLAMA_RIDGEFILL_TUNABLE[name] else "built-in"
    return values, origin


__all__ = ["TAIL", "EXACT_FRACTION", "SELECTOR", "VALUE_RESCALE", "KEY_RESCALE", "MIN_PROMPT", "N_QUERIES",
           "SPAN", "MAX_SPAN", "SPAN_SHARE", "RECENCY_SHARE", "FILL_CHUNK", "PROTECTED", "PLACEMENT", "TUNABLE",
           "TUNABLE_DEFAULTS", "C_FIELDS", "N_BATCH", "BENCH_LENGTHS", "BENCH_REPEATS", "BENCH_GREEDY_TOKENS",
           "EVAL_LENGTHS", "EVAL_DOCS", "EVAL_QUICK", "RULER_LENGTHS", "RULER_SAMPLES",
           "TUNE_TAILS", "TUNE_FRACTIONS", "TUNE_LENGTH", "TUNE_DOCS",
           "TUNE_SPANS", "TUNE_KEY_RESCALES", "TUNE_RETRIEVAL_PROMPTS", "TUNE_RETRIEVAL_CODES", "FIT_TOKENS",
           "FIT_CTX", "FIT_DTYPE", "SELECTORS", "CLASS_SELECTORS", "SPAN_SELECTORS", "TOKEN_CLASSES", "PLACEMENTS",
           "STATE_CORRECTIONS", "SPLICES", "STATS", "builtin", "selector_name", "names", "parse_classes",
           "protected_mask", "parse_selector", "check", "check_selector", "resolve_tunable"]
