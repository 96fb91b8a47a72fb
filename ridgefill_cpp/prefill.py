"""Filled-row prefill from Python: :class:`RidgeFill` settings and the :class:`Llama` that uses them.

``Llama`` is llama-cpp-python's ``Llama`` with one more keyword, ``ridgefill``. With
``ridgefill=None`` (the default) it *is* llama-cpp-python's class, untouched. Otherwise every prompt
of at least ``min_prompt`` new rows is prefilled by libllama's RidgeFill path (docs/method.md §4-§6): the
early layers run on every row in the ordinary decode calls, the late layers run on the exact rows
only, the filled rows' K/V come from the ridge maps. Everything else (completion, chat, streaming,
``generate``, ``eval``, prefix reuse, ``reset``, ``save_state`` / ``load_state``) is unchanged:
generated tokens run every layer.

>>> llm = Llama("model.gguf", n_ctx=8192, ridgefill=RidgeFill("model.ridgefill.gguf", tail=64))
>>> out = llm("...a long prompt...", max_tokens=64)
>>> llm.ridgefill_stats["ceiling"]
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import llama_cpp

from . import _native as N
from ._limits import INT32_MAX, MAX_THREADS, check_fraction, check_int
from .gguf_model import read_model_info
from .native_maps import NativeMaps

#: selectors by name (docs/method.md §5); a sequence of positions is the explicit selector
SELECTORS = {
    "attention": N.LLAMA_RIDGEFILL_SELECTOR_ATTENTION,
    "probe": N.LLAMA_RIDGEFILL_SELECTOR_PROBE,
    "protected": N.LLAMA_RIDGEFILL_SELECTOR_PROTECTED,
    "attention+protected": N.LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED,
    "none": N.LLAMA_RIDGEFILL_SELECTOR_NONE,
}

#: row classes of the ``protected`` selector
TOKEN_CLASSES = {
    "sink": N.LLAMA_RIDGEFILL_CLASS_SINK,
    "digits": N.LLAMA_RIDGEFILL_CLASS_DIGIT,
    "rare": N.LLAMA_RIDGEFILL_CLASS_RARE,
    "line_start": N.LLAMA_RIDGEFILL_CLASS_LINE_START,
}

#: the default protected classes (chosen from the eval: see README, "Selectors")
DEFAULT_PROTECTED = ("sink", "digits")

PLACEMENTS = ("resident", "host")
#: RidgeFill(state_correction=...) -> enum llama_ridgefill_state_correction
STATE_CORRECTIONS = {None: N.LLAMA_RIDGEFILL_STATE_CORRECTION_NONE, "gain": N.LLAMA_RIDGEFILL_STATE_CORRECTION_GAIN}


def protected_mask(classes: str | Sequence[str]) -> int:
    """The C bit mask of token class names (``"digits,rare"`` or ``("digits", "rare")``)."""
    names = [c.strip() for c in classes.split(",")] if isinstance(classes, str) else [str(c) for c in classes]
    names = [c for c in names if c]
    bad = [c for c in names if c not in TOKEN_CLASSES]
    if bad or not names:
        raise ValueError(f"protected token classes {classes!r}: use one or more of {', '.join(TOKEN_CLASSES)}")
    mask = 0
    for c in names:
        mask |= TOKEN_CLASSES[c]
    return mask


@dataclass(frozen=True)
class RidgeFill:
    """How to prefill long prompts (docs/method.md §4-§5).

    ``maps``: the map file written by ``ridgefill-gguf fit`` (None: identity fill, x̂ = x_S, which
    needs ``split``). ``split``: S (default: the map file's). ``tail``: T, the last prompt rows kept
    exact. ``exact_fraction``: share of the prefix rows the selector keeps exact. ``tail``,
    ``exact_fraction`` and ``selector`` left as None resolve to the operating point
    ``ridgefill-gguf tune`` wrote into the map file (its ``ridgefill.tuned.*`` keys), else to the
    built-in defaults (64, 0.10, ``"attention"``); an explicit argument always wins. After
    construction they hold the resolved values; :attr:`tuned` is the map file's tuned operating
    point (None: it has none) and :attr:`origin` says where each of the three came from
    (``"argument"``, ``"map file"`` or ``"built-in"``). ``selector``:
    ``"attention"`` (the rows the last ``n_queries`` prompt rows attend to most, at a
    full-attention layer below S), ``"probe"`` (the same score at the late layers: the tail first
    runs them against the filled cache; costs T more rows), ``"protected"`` (rows in the classes of
    ``protected``, default ``("sink", "digits")``: ``"sink"`` = positions 0-3, ``"digits"``, ``"rare"``
    = once in the prompt, ``"line_start"``; no attention pass), ``"none"``, or a list of absolute
    positions that stay exact.
    ``value_rescale``: c, the tail rows the per-head value scale is measured on (0: off).
    ``key_rescale``: c_K, the key analogue of the value scale (issue #8; 0: off, the default).
    ``min_prompt``: prompts with fewer new rows run stock prefill. ``selector_layer``: the
    attention selector's layer (default: the last full-attention layer below S).
    ``fill_chunk``: filled rows per fill step (0: ``n_ubatch``). ``placement``: where the maps
    live, ``"resident"`` (with their layer's weights) or ``"host"`` (pinned host memory, streamed to
    the accelerator once per layer: saves VRAM; the same on CPU).
    ``state_correction`` (hybrid models with Gated DeltaNet late layers, qwen35): the terminal-state
    correction, ``None`` (off, the default) or ``"gain"`` (each late recurrent layer's state is
    multiplied by per-head gains at the prefix/tail boundary, before the tail runs; the gains are
    fitted in closed form by ``ridgefill-gguf fit --state-gains`` and stored in the map file; see
    :mod:`ridgefill_cpp.oracle.state_correction` for the derivation).
    """

    maps: str | os.PathLike | None = None
    split: int | None = None
    tail: int | None = None
    exact_fraction: float | None = None
    selector: str | Sequence[int] | None = None
    value_rescale: int = 512
    key_rescale: int = 0
    min_prompt: int = 1024
    n_queries: int = 64
    selector_layer: int | None = None
    fill_chunk: int = 0
    protected: str | Sequence[str] = DEFAULT_PROTECTED
    placement: str = "resident"
    state_correction: str | None = None
    positions: tuple[int, ...] = field(default=(), init=False, repr=False)
    #: the map file's tuned operating point (``ridgefill.tuned.*``), None when it has none
    tuned: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    #: where ``tail``, ``exact_fraction`` and ``selector`` came from: "argument", "map file" or "built-in"
    origin: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    #: the built-in defaults of the settings ``ridgefill-gguf tune`` can choose
    BUILTIN_DEFAULTS = {"tail": 64, "exact_fraction": 0.10, "selector": "attention"}

    def __post_init__(self):
        from .gguf_model import GGUFFileError, read_metadata
        from .mapfile import ADAPTER_TYPE, TUNED_PREFIX, tuned_defaults_from_metadata

        tuned = None
        if self.maps is not None:
            from .files import not_regular
            from .mapfile import MapFileError

            what = not_regular(self.maps, follow_symlinks=True)
            if what is not None:  # opening a FIFO would block; a device or directory is no map file
                raise MapFileError(f"{self.maps}: the map file is {what}, not a regular file")
            try:
                md = read_metadata(self.maps)
            except (GGUFFileError, OSError):
                md = {}  # the loader says what is wrong with the file when a Llama attaches it
            if md.get("adapter.type") == ADAPTER_TYPE:
                tuned = tuned_defaults_from_metadata(md, self.maps)
        origin = {}
        for name, builtin in self.BUILTIN_DEFAULTS.items():
            if getattr(self, name) is not None:
                origin[name] = "argument"
            elif tuned is not None and name in tuned:
                object.__setattr__(self, name, tuned[name])
                origin[name] = "map file"
            else:
                object.__setattr__(self, name, builtin)
                origin[name] = "built-in"
        object.__setattr__(self, "tuned", dict(tuned) if tuned is not None else None)
        object.__setattr__(self, "origin", origin)
        tuned_hint = lambda name: (f" (the map file's tuned value, {TUNED_PREFIX}{name})"  # noqa: E731
                                   if origin[name] == "map file" else "")
        if isinstance(self.selector, str):
            if self.selector not in SELECTORS:
                raise ValueError(f"selector {self.selector!r}: use one of {', '.join(SELECTORS)} or a list of positions"
                                 + tuned_hint("selector"))
        else:
            try:
                given = list(self.selector)
            except TypeError as e:
                raise ValueError(f"selector {self.selector!r}: use one of {', '.join(SELECTORS)} or a list of positions") from e
            pos = tuple(sorted({check_int("selector position", p, 0, INT32_MAX)
                                for p in given}))
            object.__setattr__(self, "positions", pos)
            object.__setattr__(self, "selector", "positions")
        if self.maps is None and self.split is None:
            raise ValueError("identity fill needs a split: RidgeFill.identity(split=S)")
        if self.split is not None:
            check_int("split", self.split, 1)
        check_int("tail", self.tail, 1, hint=": the last prompt rows kept exact (at least the last prompt row must be exact)" + tuned_hint("tail"))
        object.__setattr__(self, "exact_fraction",
                           check_fraction("exact_fraction", self.exact_fraction, tuned_hint("exact_fraction")))
        check_int("value_rescale", self.value_rescale, 0, hint="; 0 is off")
        check_int("key_rescale", self.key_rescale, 0, hint="; 0 is off")
        check_int("min_prompt", self.min_prompt, 0)
        check_int("n_queries", self.n_queries, 1)
        if self.selector_layer is not None:
            check_int("selector_layer", self.selector_layer, 0,
                      hint="; None is the last full-attention layer below the split")
        check_int("fill_chunk", self.fill_chunk, 0, hint="; 0 is n_ubatch")
        protected_mask(self.protected)
        if not isinstance(self.protected, str):
            object.__setattr__(self, "protected", tuple(self.protected))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r}: use one of {', '.join(PLACEMENTS)}")
        if self.state_correction not in STATE_CORRECTIONS:
            raise ValueError(f"state_correction {self.state_correction!r}: use None or 'gain'")

    @classmethod
    def identity(cls, split: int, **kwargs: Any) -> "RidgeFill":
        """Identity fill at split S (no map file): x̂_l = x_S for every late layer."""
        return cls(None, split=split, **kwargs)

    def params(self) -> N.llama_ridgefill_params:
        """The C parameters (``split_layer`` -1: the map file's)."""
        p = N.llama_ridgefill_default_params()
        p.split_layer = -1 if self.split is None else int(self.split)
        p.n_tail = int(self.tail)
        p.exact_fraction = float(self.exact_fraction)
        p.selector = SELECTORS.get(self.selector, N.LLAMA_RIDGEFILL_SELECTOR_NONE)
        p.n_sel_queries = int(self.n_queries)
        p.sel_layer = -1 if self.selector_layer is None else int(self.selector_layer)
        p.n_rescale = int(self.value_rescale)
        p.n_key_rescale = int(self.key_rescale)
        p.min_prompt = int(self.min_prompt)
        p.n_fill_chunk = int(self.fill_chunk)
        p.protected_classes = protected_mask(self.protected)
        p.state_correction = STATE_CORRECTIONS[self.state_correction]
        return p


def _last_error() -> str:
    return N.llama_ridgefill_last_error().decode(errors="replace")


class Llama(llama_cpp.Llama):
    """llama-cpp-python's ``Llama`` with ``ridgefill=`` (a :class:`RidgeFill`, or a map file path
    for the defaults). ``ridgefill=None`` is the stock class's behaviour, bit for bit.

    After a prompt has been evaluated, :attr:`ridgefill_stats` describes its prefill (empty when
    it ran stock: no RidgeFill, or a prompt shorter than ``min_prompt`` or the tail).
    """

    def __init__(self, model_path: str, *args: Any, ridgefill: RidgeFill | str | os.PathLike | None = None,
                 **kwargs: Any):
        self._rf: RidgeFill | None = None
        self._rf_maps: NativeMaps | None = None
        self._rf_attached = False
        self.ridgefill_stats: dict[str, Any] = {}
        self._info = None  # the model's ModelInfo, read when RidgeFill needs it
        for name in ("n_threads", "n_threads_batch"):  # more than ggml's thread arrays hold crashes llama.cpp
            if kwargs.get(name) is not None:
                check_int(name, kwargs[name], 1, MAX_THREADS, "; llama.cpp's GGML_MAX_N_THREADS is the most")
        if ridgefill is None:
            super().__init__(model_path, *args, **kwargs)
            return

        rf = ridgefill if isinstance(ridgefill, RidgeFill) else RidgeFill(ridgefill)
        if kwargs.get("logits_all"):
            raise ValueError("RidgeFill computes the logits of the last prompt row only: logits_all=True is not supported")
        if kwargs.get("embedding"):
            raise ValueError("RidgeFill prefill does not apply to embedding contexts (embedding=True)")
        self._info = read_model_info(model_path)
        if self._info.architecture == "gemma3" and kwargs.get("swa_full") is None:
            # sliding-window layers of filled and exact rows need every cell of the prompt kept
            kwargs["swa_full"] = True

        super().__init__(model_path, *args, **kwargs)
        try:
            if rf.maps is not None:
                self._rf_maps = NativeMaps(self._model.model, rf.maps, split=rf.split, host=rf.placement == "host",
                                           model_path=model_path)
            if rf.state_correction == "gain" and not (self._rf_maps and self._rf_maps.has_state_gains):
                # (libllama refuses it only where a late layer is recurrent; elsewhere it would be a no-op)
                raise ValueError("the state correction 'gain' needs maps with state gains (ridgefill-gguf fit "
                                 f"--state-gains); {rf.maps if rf.maps is not None else 'identity fill'} has none")
            rc = N.llama_ridgefill_attach(self._ctx.ctx, self._rf_maps.handle if self._rf_maps else None, rf.params())
            if rc != 0:
                raise ValueError(f"RidgeFill: {_last_error()}")
        except Exception:
            if self._rf_maps is not None:
                self._rf_maps.close()
            self.close()
            raise
        self._rf = rf
        self._rf_attached = True
        # detach before the context is freed, then free the maps (the exit stack unwinds in reverse)
        self._stack.callback(self._ridgefill_release)

    def close(self) -> None:
        if hasattr(self, "_stack"):  # not when __init__ refused the arguments before llama-cpp-python ran
            super().close()

    def _ridgefill_release(self) -> None:
        if self._rf_attached and self._ctx is not None and self._ctx.ctx is not None:
            N.llama_ridgefill_detach(self._ctx.ctx)
        self._rf_attached = False
        if self._rf_maps is not None:
            self._rf_maps.close()
            self._rf_maps = None

    @property
    def ridgefill(self) -> RidgeFill | None:
        """The RidgeFill settings in use (None: stock prefill)."""
        return self._rf

    def eval(self, tokens: Sequence[int]) -> None:
        rf = self._rf
        tokens = list(tokens)
        if rf is None or len(tokens) <= 1:
            # no RidgeFill, or a generated token: every layer runs
            return super().eval(tokens)

        ctx = self._ctx.ctx
        pos0 = self.n_tokens
        pos_end = pos0 + len(tokens)
        self.ridgefill_stats = {}
        planned = N.llama_ridgefill_begin(ctx, 0, pos0, pos_end)
        if planned < 0:
            raise RuntimeError(f"RidgeFill: {_last_error()}")
        if planned and rf.selector == "positions":
            pos = (ctypes.c_int32 * len(rf.positions))(*rf.positions)
            if N.llama_ridgefill_set_exact(ctx, pos, len(rf.positions)) != 0:
                N.llama_ridgefill_cancel(ctx)
                raise ValueError(f"RidgeFill: {_last_error()}")

        t0 = time.perf_counter()
        try:
            super().eval(tokens)
        except BaseException:
            if planned:
                N.llama_ridgefill_cancel(ctx)
            raise
        if planned:
            self.ridgefill_stats = self._read_stats((time.perf_counter() - t0) * 1000.0)

    def _read_stats(self, prefill_ms: float) -> dict[str, Any]:
        ctx = self._ctx.ctx
        s = N.llama_ridgefill_stats()
        if N.llama_ridgefill_get_stats(ctx, ctypes.byref(s)) != 0 or not s.active:
            return {}
        n = N.llama_ridgefill_get_exact(ctx, None, 0)
        exact = (ctypes.c_int32 * max(n, 1))()
        N.llama_ridgefill_get_exact(ctx, exact, n)
        return {
            "n_prompt": s.n_prompt,
            "pos0": s.pos0,
            "n_layer": s.n_layer,
            "split": s.split_layer,
            "tail": s.n_tail,
            "n_filled": s.n_filled,
            "n_exact": s.n_exact,
            "exact_positions": list(exact[:n]),
            "selector_layer": s.sel_layer,
            "value_scale_rows": s.n_scale_rows,
            "probe_rows": s.n_probe,
            "ceiling": float(s.ceiling),
            "late_ms": float(s.t_late_ms),
            "prefill_ms": prefill_ms,
            **self.ridgefill_memory(),
        }

    def ridgefill_memory(self) -> dict[str, Any]:
        """Where the maps live: ``maps_bytes``, ``maps_placement`` (``"resident"`` / ``"host"``) and
        ``maps_buffers`` (the ggml buffer types); 0 bytes for identity fill."""
        m = self._rf_maps
        if m is None:
            return {"maps_bytes": 0, "maps_placement": self._rf.placement if self._rf else None, "maps_buffers": []}
        return {"maps_bytes": m.n_bytes, "maps_placement": m.placement, "maps_buffers": m.buffer_types}

    def _floats(self, getter) -> list[float]:
        n = getter(self._ctx.ctx, None, 0)
        if n <= 0:
            return []
        buf = (ctypes.c_float * n)()
        getter(self._ctx.ctx, buf, n)
        return list(buf)

    def _per_late_layer(self, getter) -> list[list[float]]:
        values = self._floats(getter)
        if not values or not self.ridgefill_stats:
            return []
        n_late = self.ridgefill_stats["n_layer"] - self.ridgefill_stats["split"]
        per = len(values) // max(n_late, 1)
        return [values[i * per:(i + 1) * per] for i in range(n_late)]

    def ridgefill_value_scales(self) -> list[list[float]]:
        """s_{l,h} of the last RidgeFill prefill, one row per late layer S..L-1 (1 where not measured)."""
        return self._per_late_layer(N.llama_ridgefill_get_value_scales)

    def ridgefill_key_scales(self) -> list[list[float]]:
        """The key scales of the last RidgeFill prefill (``key_rescale`` > 0), one row per late layer."""
        return self._per_late_layer(N.llama_ridgefill_get_key_scales)

    def ridgefill_scores(self) -> list[float]:
        """The attention selector's scores of the last RidgeFill prefill, one per prompt row (empty when
        no scores were measured)."""
        return self._floats(N.llama_ridgefill_get_scores)

    def read_kv(self, layer: int, positions: Sequence[int]):
        """K and V cache rows of ``layer`` at ``positions`` (sequence 0) as float32 arrays
        [n, n_embd_k_gqa] and [n, n_embd_v_gqa]: what the prefill wrote. For tests and tools."""
        import numpy as np

        if self._info is None:
            self._info = read_model_info(self.model_path)
        n = len(positions)
        n_embd_gqa = self._info.n_head_kv * self._info.head_dim
        k = np.empty((n, n_embd_gqa), dtype=np.float32)
        v = np.empty((n, n_embd_gqa), dtype=np.float32)
        pos = (ctypes.c_int32 * max(n, 1))(*positions)
        f = ctypes.POINTER(ctypes.c_float)
        rc = N.llama_ridgefill_read_kv(self._ctx.ctx, layer, 0, pos, n, k.ctypes.data_as(f), v.ctypes.data_as(f))
        if rc != 0:
            raise ValueError(_last_error())
        return k, v

    def read_state(self, layer: int):
        """The recurrent state of Gated DeltaNet ``layer`` (hybrid models, sequence 0) as one float32
        array in llama.cpp's layout: the conv state ([conv channels][d_conv - 1]) then the delta-net
        state ([v heads][S_v][S_v]). For tests and tools."""
        return self._state_floats(lambda out, n: N.llama_ridgefill_read_state(self._ctx.ctx, layer, 0, out, n))

    def ridgefill_boundary_state(self, layer: int):
        """The state of late recurrent ``layer`` after the last prefix row of the last RidgeFill
        prefill, before any terminal-state correction (layout of :meth:`read_state`), or None when
        none was recorded (:meth:`ridgefill_record_boundary_states`)."""
        st = self._state_floats(lambda out, n: N.llama_ridgefill_get_boundary_state(self._ctx.ctx, layer, out, n))
        return st if st.size else None

    def ridgefill_splice_state(self, layer: int | None, state=None) -> None:
        """The splice test for recurrent state (docs/method.md §9): in the next RidgeFill prefills, late
        recurrent ``layer``'s tail rows start from ``state`` (the layout of :meth:`read_state`, e.g.
        read after an exact prefill of the prompt's prefix) instead of the state its filled rows left.
        ``layer`` None: no layer is spliced any more."""
        import numpy as np

        if layer is None:
            N.llama_ridgefill_splice_state(self._ctx.ctx, 0, None, 0)
            return
        st = np.ascontiguousarray(state, dtype=np.float32)
        if N.llama_ridgefill_splice_state(self._ctx.ctx, int(layer), st.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                          st.size) != 0:
            raise ValueError(_last_error())

    def ridgefill_record_boundary_states(self, record: bool = True) -> None:
        """Record each late recurrent layer's boundary state in the next RidgeFill prefills."""
        N.llama_ridgefill_record_boundary_states(self._ctx.ctx, bool(record))

    @staticmethod
    def _state_floats(get):
        import numpy as np

        n = get(None, 0)
        if n < 0:
            raise ValueError(_last_error())
        out = np.empty(n, dtype=np.float32)
        get(out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
        return out


__all__ = ["Llama", "RidgeFill", "SELECTORS", "TOKEN_CLASSES", "PLACEMENTS"]
