"""Filled-row prefill from Python: :class:`RidgeFill` settings and the :class:`Llama` that uses them.

``Llama`` is llama-cpp-python's ``Llama`` with one more keyword, ``ridgefill``. With
``ridgefill=None`` (the default) it *is* llama-cpp-python's class, untouched. Otherwise every prompt
of at least ``min_prompt`` new rows is prefilled by libllama's RidgeFill path (docs/design.md §4-§6): the
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
import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import llama_cpp
import numpy as np

from ..core import native as N
from . import devices as dev
from . import rpc
from ..core import settings
from ..core.limits import MAX_THREADS, check_c_string, check_int
from ..core.files import not_regular
from ..core.gguf_model import GGUFFileError, read_metadata, read_model_info
from ..maps.mapfile import ADAPTER_TYPE, TUNED_PREFIX, MapFileError, tuned_defaults_from_metadata
from .native_maps import NativeMaps
# the vocabulary of the settings, re-exported where users of the class look for it
from ..core.settings import PLACEMENTS, SELECTORS, TOKEN_CLASSES, protected_mask  # noqa: F401


@dataclass(frozen=True)
class RidgeFill:
    """How to prefill long prompts (docs/design.md §4-§5).

    ``maps``: the map file written by ``ridgefill-gguf fit`` (None: identity fill, x̂ = x_S, which
    needs ``split``). ``split``: S (default: the map file's). ``tail``: T, the last prompt rows kept
    exact. ``exact_fraction``: share of the prefix rows the selector keeps exact. ``tail``,
    ``exact_fraction``, ``selector``, ``span`` and ``key_rescale`` left as None resolve to the operating point
    ``ridgefill-gguf tune`` wrote into the map file (its ``ridgefill.tuned.*`` keys), else to the
    built-in defaults (:data:`ridgefill_cpp.core.settings.TUNABLE_DEFAULTS`); an explicit argument
    always wins. After construction they hold the resolved values; :attr:`tuned` is the map file's
    tuned operating point (None: it has none) and :attr:`origin` says where each of the five came
    from (``"argument"``, ``"map file"`` or ``"built-in"``).
    ``selector``: ``"attention"`` (the rows the last ``n_queries`` prompt rows attend to most, at a
    full-attention layer below S), ``"probe"`` (the same score at the late layers: the tail first
    runs them against the filled cache; costs T more rows), ``"protected"`` (rows in the classes of
    ``protected``, default :data:`ridgefill_cpp.core.settings.PROTECTED`: ``"sink"`` = positions 0-3,
    ``"digits"``, ``"rare"`` = once in the prompt, ``"line_start"``; no attention pass),
    ``"attention+protected"`` (the protected rows, then the attention selector's), ``"none"``, or a
    list of absolute positions that stay exact.
    ``span`` (``attention``, ``attention+protected``, ``probe``): three quarters of the exact rows
    are taken by the highest score within the span of this many rows around them, so the rows
    around each top-scoring row (the name before a fact, the fact's other tokens) stay exact
    together, and the rest are the top-scoring single rows; 1: single rows.
    ``value_rescale``: c, the tail rows the per-head value scale is measured on (0: off).
    ``key_rescale``: c_K, the tail rows a per-head key scale is measured on, the key analogue of the
    value scale (0: off, the built-in default; ``tune --key-rescales`` can choose it).
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
    ``splice`` (diagnostics, the splice test of docs/design.md §9): ``"K"``, ``"V"`` or ``"KV"``,
    the filled rows keep the late-layer K, V or both that their cells already hold (e.g. from an
    exact prefill of the same prompt, :meth:`Llama.forget_cells`) instead of the filled ones.
    Defaults and names: :mod:`ridgefill_cpp.core.settings`.
    """

    maps: str | os.PathLike | None = None
    split: int | None = None
    tail: int | None = None
    exact_fraction: float | None = None
    selector: str | Sequence[int] | None = None
    value_rescale: int = settings.VALUE_RESCALE
    key_rescale: int | None = None
    min_prompt: int = settings.MIN_PROMPT
    n_queries: int = settings.N_QUERIES
    span: int | None = None
    selector_layer: int | None = None
    fill_chunk: int = settings.FILL_CHUNK
    protected: str | Sequence[str] = settings.PROTECTED
    placement: str = settings.PLACEMENT
    state_correction: str | None = None
    splice: str | None = None
    positions: tuple[int, ...] = field(default=(), init=False, repr=False)
    #: the map file's tuned operating point (``ridgefill.tuned.*``), None when it has none
    tuned: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    #: where ``tail``, ``exact_fraction``, ``selector``, ``span`` and ``key_rescale`` came from: "argument", "map file" or "built-in"
    origin: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    #: the built-in defaults of the settings ``ridgefill-gguf tune`` can choose
    BUILTIN_DEFAULTS = settings.TUNABLE_DEFAULTS

    def __post_init__(self):
        tuned = None
        if self.maps is not None:
            check_c_string("maps", self.maps)
            what = not_regular(self.maps, follow_symlinks=True)
            if what is not None:  # opening a FIFO would block; a device or directory is no map file
                raise MapFileError(f"{self.maps}: the map file is {what}, not a regular file")
            try:
                md = read_metadata(self.maps)
            except (GGUFFileError, OSError):
                md = {}  # the loader says what is wrong with the file when a Llama attaches it
            if md.get("adapter.type") == ADAPTER_TYPE:
                tuned = tuned_defaults_from_metadata(md, self.maps)
        # the arguments given, then (libllama resolves them as it will when attached) the map file's
        # tuned values, then the built-in ones
        given = {k: getattr(self, k) for k in settings.TUNABLE}
        for name, value in given.items():
            if value is not None and name != "selector":
                given[name] = settings.check(name, value)
        values, origin = settings.resolve_tunable(given, self.maps if tuned is not None else None)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "tuned", dict(tuned) if tuned is not None else None)
        object.__setattr__(self, "origin", origin)
        tuned_hint = lambda name: (f" (the map file's tuned value, {TUNED_PREFIX}{name})"  # noqa: E731
                                   if origin[name] == "map file" else "")
        selector = settings.check("selector", self.selector, hint=tuned_hint("selector"))
        if isinstance(selector, tuple):
            object.__setattr__(self, "positions", selector)
            object.__setattr__(self, "selector", "positions")
        if self.maps is None and self.split is None:
            raise ValueError("identity fill needs a split: RidgeFill.identity(split=S)")
        if self.split is not None:
            settings.check("split", self.split)
        settings.check("tail", self.tail, hint=tuned_hint("tail"))
        settings.check("span", self.span, hint=tuned_hint("span"))
        settings.check("key_rescale", self.key_rescale, hint=tuned_hint("key_rescale"))
        object.__setattr__(self, "exact_fraction",
                           settings.check("exact_fraction", self.exact_fraction, hint=tuned_hint("exact_fraction")))
        for name in ("value_rescale", "min_prompt", "n_queries"):
            settings.check(name, getattr(self, name))
        if self.selector_layer is not None:
            settings.check("selector_layer", self.selector_layer)
        settings.check("fill_chunk", self.fill_chunk)
        object.__setattr__(self, "protected", settings.check("protected", self.protected))
        for name in ("placement", "state_correction", "splice"):
            settings.check(name, getattr(self, name))

    def arguments(self) -> dict[str, Any]:
        """The constructor arguments that give these settings again: every setting as given, a tunable
        one that was not given as None (so that it resolves as it did: the map file's tuned value,
        else the built-in one), an explicit selector as its positions."""
        args = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name in settings.TUNABLE:
            if self.origin.get(name) != "argument":
                args[name] = None
        if self.selector == "positions":
            args["selector"] = list(self.positions)
        return args

    def __reduce__(self):
        # pickle and copy by the arguments, so that the copy is checked and resolved as this one was
        # (a frozen dataclass's default copies its resolved fields and bypasses the checks)
        return (_ridgefill_from_arguments, (self.arguments(),))

    @classmethod
    def identity(cls, split: int, **kwargs: Any) -> "RidgeFill":
        """Identity fill at split S (no map file): x̂_l = x_S for every late layer."""
        return cls(None, split=split, **kwargs)

    def params(self) -> N.llama_ridgefill_params:
        """The C parameters: libllama's defaults with the settings given here. ``split_layer`` -1: the
        map file's; a tunable setting not given as an argument stays unset, and libllama resolves it
        when attached (the map file's tuned value, else its built-in one: the values this object
        holds)."""
        p = N.llama_ridgefill_default_params()
        given = lambda name: self.origin.get(name) == "argument"  # noqa: E731
        p.split_layer = -1 if self.split is None else int(self.split)
        if given("tail"):
            p.n_tail = int(self.tail)
        if given("exact_fraction"):
            p.exact_fraction = float(self.exact_fraction)
        if given("selector"):
            # an explicit list of positions: no selector, the positions are set per prompt (llama_ridgefill_set_exact)
            p.selector = settings.SELECTORS.get(self.selector, settings.SELECTORS["none"])
        if given("span"):
            p.span = int(self.span)
        if given("key_rescale"):
            p.n_key_rescale = int(self.key_rescale)
        p.n_sel_queries = int(self.n_queries)
        p.sel_layer = -1 if self.selector_layer is None else int(self.selector_layer)
        p.n_rescale = int(self.value_rescale)
        p.min_prompt = int(self.min_prompt)
        p.n_fill_chunk = int(self.fill_chunk)
        p.protected_classes = protected_mask(self.protected)
        p.state_correction = settings.STATE_CORRECTIONS[self.state_correction]
        p.splice = settings.SPLICES[self.splice]
        return p


def _ridgefill_from_arguments(arguments: dict[str, Any]) -> RidgeFill:
    return RidgeFill(**arguments)


@dataclass(frozen=True)
class OperatingPoint:
    """The settings bench and eval run with: T, the exact fraction, the selector spec (a tuned span
    joins a selector that takes one: ``attention@32``), c_K, and which values came from the map
    file (``"tail 12"``, ``"exact_fraction 0.25"``, ...)."""

    tail: int
    exact_fraction: float
    selector: str
    key_rescale: int
    from_file: tuple[str, ...] = ()


def operating_point(maps: str | os.PathLike | None, *, tail: int | None = None, exact_fraction: float | None = None,
                    selector: str | None = None, key_rescale: int | None = None) -> OperatingPoint:
    """The operating point of ``bench`` and ``eval`` (given as options, a selector as a spec such as
    ``attention@16``), resolved as ``RidgeFill`` and the server resolve it: a value given, else the
    map file's tuned one (``ridgefill-gguf tune``), else the built-in one. Raises ``ValueError``
    (``MapFileError``) when the map file or a tuned value it would take is bad."""
    try:
        spec_span = selector is not None and settings.parse_selector(selector).get("span")
    except ValueError:
        spec_span = None  # the caller's check says what is wrong with the spec
    given = {"tail": tail, "exact_fraction": exact_fraction, "selector": selector, "span": spec_span or None,
             "key_rescale": key_rescale}
    tuned = None
    if maps is not None and None in given.values():
        tuned = RidgeFill(maps).tuned  # (RidgeFill checks the file and its tuned values)
    value, origin = settings.resolve_tunable(given, maps if tuned is not None else None)
    spec = str(value["selector"])
    if origin["span"] == "map file" and spec.partition(":")[0] in settings.SPAN_SELECTORS:
        spec += f"@{value['span']}"
    else:
        origin["span"] = "built-in"  # not used: the spec gives it, or the selector takes none
    from_file = tuple(f"{k} {value[k]:g}" if k == "exact_fraction" else f"{k} {value[k]}"
                      for k in given if origin[k] == "map file")
    return OperatingPoint(int(value["tail"]), float(value["exact_fraction"]), spec, int(value["key_rescale"]),
                          from_file)


def as_ridgefill(ridgefill: RidgeFill | str | os.PathLike | None) -> RidgeFill | None:
    """A RidgeFill, None, or a map file path for the defaults (its tuned ones, if any)."""
    return ridgefill if ridgefill is None or isinstance(ridgefill, RidgeFill) else RidgeFill(ridgefill)


def _last_error() -> str:
    return N.llama_ridgefill_last_error().decode(errors="replace")


def _check_context(logits_all: bool, embedding: bool) -> None:
    """What a context RidgeFill prefills must not be."""
    if logits_all:
        raise ValueError("RidgeFill computes the logits of the last prompt row only: logits_all=True is not supported")
    if embedding:
        raise ValueError("RidgeFill prefill does not apply to embedding contexts (embedding=True)")


class Llama(llama_cpp.Llama):
    """llama-cpp-python's ``Llama`` with ``ridgefill=`` (a :class:`RidgeFill`, or a map file path
    for the defaults). ``ridgefill=None`` is the stock class's behaviour, bit for bit.

    After a prompt has been evaluated, :attr:`ridgefill_stats` describes its prefill (empty when
    it ran stock: no RidgeFill, or a prompt shorter than ``min_prompt`` or the tail; its keys:
    :data:`ridgefill_cpp.core.settings.STATS`). :meth:`prefill` evaluates a prompt and returns the
    logits of its last rows; :meth:`set_ridgefill` changes the settings (or turns RidgeFill off)
    for the next prompts. ``devices`` (``"CUDA1"``, a list, or ``"none"``) names the devices the
    ``n_gpu_layers`` go to, as llama.cpp's ``--device``; ``rpc_servers`` puts them on RPC servers.
    """

    def __init__(self, model_path: str, *args: Any, ridgefill: RidgeFill | str | os.PathLike | None = None,
                 rpc_servers: str | Sequence[str] | None = None, devices: str | Sequence[str] | None = None,
                 **kwargs: Any):
        self._closed = False  # close() sets it
        self._rf: RidgeFill | None = None
        self.rpc_servers: str | None = None  # set below, once the servers answer
        #: the offload devices given (llama.cpp's --device; [] for "none"), None for llama.cpp's default
        self.devices: list[str] | None = None
        self._rf_maps: NativeMaps | None = None
        #: every map file loaded for this context, by (path, split, host): reused, freed at close()
        self._rf_loaded: dict[tuple[str, int | None, bool], NativeMaps] = {}
        self._rf_attached = False
        self._rf_release = False  # whether close() detaches and frees the maps (registered once)
        self._rf_stats: dict[str, Any] = {}
        self._info = None  # the model's ModelInfo, read when RidgeFill needs it
        for name in ("n_threads", "n_threads_batch"):  # more than ggml's thread arrays hold crashes llama.cpp
            if kwargs.get(name) is not None:
                check_int(name, kwargs[name], 1, MAX_THREADS, "; llama.cpp's GGML_MAX_N_THREADS is the most")
        check_c_string("model_path", model_path)
        what = not_regular(model_path, follow_symlinks=True)
        if what is not None:  # llama.cpp would block opening a FIFO, or fail on a device or directory
            raise ValueError(f"{model_path}: the model file is {what}, not a regular file")
        if devices is not None and rpc_servers is not None:
            raise ValueError("devices and rpc_servers: give one (rpc_servers puts the layers on its servers' devices)")
        if devices is not None:
            self.devices = dev.device_names(devices)  # a name that is not a device fails here, before the load
        if ridgefill is None:
            self._load(model_path, args, kwargs, rpc_servers, devices)
            return

        rf = as_ridgefill(ridgefill)
        _check_context(kwargs.get("logits_all"), kwargs.get("embedding"))
        self._info = read_model_info(model_path)

        self._load(model_path, args, kwargs, rpc_servers, devices)
        try:
            self.set_ridgefill(rf)
        except Exception:
            self.close()
            raise

    def _load(self, model_path: str, args: tuple, kwargs: dict[str, Any], rpc_servers, devices=None) -> None:
        """llama-cpp-python's constructor; with ``rpc_servers``, on the devices of those servers (then
        this machine's GPUs) instead of every device this process has registered; with ``devices``, on
        those (llama.cpp's ``--device``; ``"none"``: no offload)."""
        if devices is not None:
            with dev.loading_on_devices(devices):
                super().__init__(model_path, *args, **kwargs)
            return
        if rpc_servers is None:
            super().__init__(model_path, *args, **kwargs)
            return
        servers = rpc.server_list(rpc_servers)
        devices = rpc.model_devices(servers)
        # llama.cpp's --rpc offloads every layer by default; llama-cpp-python's n_gpu_layers defaults to 0
        kwargs.setdefault("n_gpu_layers", -1)
        with rpc.loading_on(devices):
            super().__init__(model_path, *args, **kwargs)
        self.rpc_servers = servers

    def _check_rpc(self, n_past: int, error: BaseException | None = None) -> None:
        """After evaluating rows from ``n_past`` on: when a server of the model stopped answering,
        remove those rows (computed without its layers) and raise
        :class:`~ridgefill_cpp.runtime.rpc.RpcServerLost`."""
        if self.rpc_servers is None or self._model is None:
            return
        lost = rpc.lost_servers(self._model.model)
        if lost:
            mem = llama_cpp.llama_get_memory(self._ctx.ctx)
            llama_cpp.llama_memory_seq_rm(mem, 0, n_past, -1)
            if llama_cpp.llama_memory_seq_pos_max(mem, 0) >= n_past:
                # a recurrent state cannot be rolled back to n_past: the whole sequence goes
                llama_cpp.llama_memory_seq_rm(mem, 0, 0, -1)
                n_past = 0
            self.n_tokens = min(self.n_tokens, n_past)
            raise rpc.RpcServerLost(lost) from error

    def close(self) -> None:
        """Free the model, the context and the maps. Every method that needs them raises
        ``ValueError`` afterwards (llama-cpp-python's would crash the process)."""
        self._closed = True
        if hasattr(self, "_stack"):  # not when __init__ refused the arguments before llama-cpp-python ran
            super().close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` freed the model and the context."""
        return self._closed

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any):
        # llama-cpp-python's sampler asserts on an empty context: an empty prompt of a model that
        # adds no BOS token (llm("")) raised a bare AssertionError
        if len(tokens) == 0 and self.n_tokens == 0:
            raise ValueError("the prompt has no tokens (an empty prompt, and this model adds no BOS token): "
                             "give at least one token")
        return super().generate(tokens, *args, **kwargs)

    def set_ridgefill(self, ridgefill: RidgeFill | str | os.PathLike | None) -> None:
        """Prefill the next prompts with ``ridgefill`` (a :class:`RidgeFill`, or a map file path for
        its defaults), or stock (None). The cache is left as it is; :attr:`ridgefill_stats` is
        emptied. A map file is loaded once per context and reused when attached again (freed by
        :meth:`close`). Any KV cache layout works: with a window-sized sliding-window cache
        (``swa_full=False``; gemma3, gpt-oss) the late sliding-window layers of the first rows of a
        long prompt run over a small scratch cache (``ridgefill_stats["window"]``). Raises
        ``ValueError`` (``MapFileError``: the maps) for settings libllama refuses; RidgeFill is then
        off."""
        rf = as_ridgefill(ridgefill)
        if rf is not None:
            _check_context(self._logits_all, self.context_params.embeddings)
        if not self._rf_release:
            # detach before the context is freed, then free the maps (the exit stack unwinds in reverse)
            self._stack.callback(self._ridgefill_release)
            self._rf_release = True
        if self._rf_attached:
            N.llama_ridgefill_detach(self._ctx.ctx)
        self._rf, self._rf_maps, self._rf_attached = None, None, False
        self._rf_stats = {}
        if rf is None:
            return
        maps = self._load_maps(rf) if rf.maps is not None else None
        if rf.state_correction == "gain" and not (maps and maps.has_state_gains):
            # (libllama refuses it only where a late layer is recurrent; elsewhere it would be a no-op)
            raise ValueError("the state correction 'gain' needs maps with state gains (ridgefill-gguf fit "
                             f"--state-gains); {rf.maps if rf.maps is not None else 'identity fill'} has none")
        if N.llama_ridgefill_attach(self._ctx.ctx, maps.handle if maps else None, rf.params()) != 0:
            raise ValueError(f"RidgeFill: {_last_error()}")
        self._rf, self._rf_maps, self._rf_attached = rf, maps, True

    def _load_maps(self, rf: RidgeFill) -> NativeMaps:
        key = (os.fspath(rf.maps), rf.split, rf.placement == "host")
        if key not in self._rf_loaded:
            self._rf_loaded[key] = NativeMaps(self._model.model, rf.maps, split=rf.split, host=key[2],
                                              model_path=self.model_path)
        return self._rf_loaded[key]

    def _ridgefill_release(self) -> None:
        if self._rf_attached and self._ctx is not None and self._ctx.ctx is not None:
            N.llama_ridgefill_detach(self._ctx.ctx)
        self._rf, self._rf_maps, self._rf_attached = None, None, False
        for maps in self._rf_loaded.values():
            maps.close()
        self._rf_loaded.clear()

    @property
    def ridgefill(self) -> RidgeFill | None:
        """The RidgeFill settings in use (None: stock prefill)."""
        self._check_open("ridgefill")
        return self._rf

    @property
    def ridgefill_stats(self) -> dict[str, Any]:
        """What the last prompt's prefill did (its keys: :data:`ridgefill_cpp.core.settings.STATS`);
        empty when it ran stock. Raises ``ValueError`` after :meth:`close`."""
        self._check_open("ridgefill_stats")
        return self._rf_stats

    def _check_open(self, member: str) -> None:
        if self._closed:
            raise ValueError(f"Llama.{member}: this Llama is closed (close() freed its model and context); "
                             "create a new one")

    def __getstate__(self) -> dict[str, Any]:
        """llama-cpp-python's constructor arguments, with RidgeFill's settings, the RPC servers and devices:
        ``pickle.loads(pickle.dumps(llm))`` loads the model again with the same RidgeFill (the map
        file is read again, from its path). A closed Llama (whose RidgeFill is gone) is refused."""
        self._check_open("__getstate__")
        state = super().__getstate__()
        state["ridgefill"] = self._rf
        state["rpc_servers"] = self.rpc_servers
        state["devices"] = self.devices
        return state

    def eval(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        if self._rf is not None and len(tokens) > 1:
            self.prefill(tokens, n_logits=1)
            return
        # no RidgeFill, or a generated token: every layer runs
        n_past = self.n_tokens
        try:
            super().eval(tokens)
        except RuntimeError as e:
            self._check_rpc(n_past, e)
            raise
        self._check_rpc(n_past)

    def prefill(self, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Evaluate ``tokens`` after the ``n_tokens`` already in the context, as :meth:`eval` does,
        and return the logits of the last ``n_logits`` of them: float32 ``[n_logits, n_vocab]``, a
        copy (row ``-1`` predicts the token after the prompt).

        With RidgeFill on, a prompt of more than one row is planned (docs/design.md §6: it runs
        filled, or stock when it is shorter than ``min_prompt`` or the tail) and
        :attr:`ridgefill_stats` describes it; a planned prompt has logits for its tail rows only, so
        rows before the tail come back NaN (keep ``n_logits`` <= ``tail``). The rows are decoded in
        the chunks of ``n_batch`` rows :meth:`eval` uses, except that the last chunk starts early
        enough to hold the last ``n_logits`` rows: ``1 <= n_logits <= min(len(tokens), n_batch)``.
        Without RidgeFill it is llama-cpp-python's evaluation, with the logits of the last rows kept.
        """
        tokens = list(tokens)
        n = len(tokens)
        if n == 0:
            raise ValueError("prefill: no tokens")
        check_int("n_logits", n_logits, 1, min(n, self.n_batch), ": the last rows that get logits, all in the last "
                  "decode call (at most the prompt and n_batch)")
        plan = self._rf is not None and n > 1
        ctx = self._ctx.ctx
        planned = 0
        if plan:
            self._rf_stats = {}
            planned = N.llama_ridgefill_begin(ctx, 0, self.n_tokens, self.n_tokens + n)
            if planned < 0:
                raise RuntimeError(f"RidgeFill: {_last_error()}")
            if planned and self._rf.selector == "positions":
                pos = (ctypes.c_int32 * len(self._rf.positions))(*self._rf.positions)
                if N.llama_ridgefill_set_exact(ctx, pos, len(self._rf.positions)) != 0:
                    N.llama_ridgefill_cancel(ctx)
                    raise ValueError(f"RidgeFill: {_last_error()}")
        t0, n_past = time.perf_counter(), self.n_tokens
        try:
            logits = self._decode(tokens, n_logits)
        except BaseException as e:
            if planned:
                N.llama_ridgefill_cancel(ctx)
            self._check_rpc(n_past, e)
            if planned and isinstance(e, RuntimeError) and _last_error():
                raise RuntimeError(f"{e}: RidgeFill: {_last_error()}") from e
            raise
        self._check_rpc(n_past)
        if planned:
            self._rf_stats = self._read_stats((time.perf_counter() - t0) * 1000.0)
        return logits

    def _decode(self, tokens: list[int], n_logits: int) -> np.ndarray:
        """llama-cpp-python's evaluation loop (``Llama.eval``: the same chunks, cache trim and
        bookkeeping), with every one of the last ``n_logits`` rows asking for logits in the last call."""
        n, n_batch, n_vocab = len(tokens), self.n_batch, self._n_vocab
        starts = list(range(0, n, n_batch))
        starts[-1] = min(starts[-1], n - n_logits)
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        for start, end in zip(starts, starts[1:] + [n]):
            batch, n_past = tokens[start:end], self.n_tokens
            self._batch.set_batch(batch=batch, n_past=n_past, logits_all=self._logits_all)
            if end == n:
                for i in range(n - n_logits - start, end - start):
                    self._batch.batch.logits[i] = True
            self._ctx.decode(self._batch)
            self.input_ids[n_past:n_past + len(batch)] = batch
            if self._logits_all:
                rows = np.ctypeslib.as_array(self._ctx.get_logits(), shape=(len(batch), n_vocab))
                self.scores[n_past:n_past + len(batch), :] = rows
            self.n_tokens += len(batch)
            self._requires_eval = False
        if self._logits_all:
            return self.scores[self.n_tokens - n_logits:self.n_tokens, :].copy()
        return np.ctypeslib.as_array(self._ctx.get_logits(), shape=(n_logits, n_vocab)).copy()

    def forget_cells(self) -> None:
        """Forget every cell of the KV cache but keep its data, then :meth:`reset`: for the splice
        test (docs/design.md §9), where a prefill with ``RidgeFill(splice=...)`` keeps the late-layer
        K/V that an exact prefill of the same prompt left in the cells."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx.ctx), False)
        self.reset()

    def _read_stats(self, prefill_ms: float) -> dict[str, Any]:
        ctx = self._ctx.ctx
        s = N.llama_ridgefill_stats()
        if N.llama_ridgefill_get_stats(ctx, ctypes.byref(s)) != 0 or not s.active:
            return {}
        n = N.llama_ridgefill_get_exact(ctx, None, 0)
        exact = (ctypes.c_int32 * max(n, 1))()
        N.llama_ridgefill_get_exact(ctx, exact, n)
        stats = {
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
            "graphs": {"early_built": s.n_early_built, "early_reused": s.n_early_reused,
                       "late_built": s.n_late_built, "late_reused": s.n_late_reused},
            "times_ms": {"early": s.t_early_ms, "late": float(s.t_late_ms), "build": s.t_build_ms,
                         "alloc": s.t_alloc_ms, "set_input": s.t_set_input_ms, "compute": s.t_compute_ms,
                         "wait": s.t_wait_ms, "other": s.t_other_ms},
            "late_rows": {"attention": s.n_late_rows, "recurrent": s.n_late_rows_recr},
            "window": {"scratch_cells": s.n_scratch_cells, "scratch_bytes": s.scratch_bytes,
                       "graphs": s.n_window_graphs},
            "kq_mask": "graph" if s.graph_kq_mask else "host",
            **self.ridgefill_memory(),
        }
        return {key: stats[key] for key in settings.STATS}  # the documented keys, in their order

    def ridgefill_memory(self) -> dict[str, Any]:
        """Where the maps live: ``maps_bytes``, ``maps_placement`` (``"resident"`` / ``"host"``) and
        ``maps_buffers`` (the ggml buffer types) and ``maps_type`` (the storage type and, for a low-rank
        map, its form: ``"q8_0"``, ``"f16 identity_low_rank"``); 0 bytes for identity fill."""
        m = self._rf_maps
        if m is None:
            return {"maps_bytes": 0, "maps_placement": self._rf.placement if self._rf else None, "maps_buffers": [],
                    "maps_type": None}
        return {"maps_bytes": m.n_bytes, "maps_placement": m.placement, "maps_buffers": m.buffer_types,
                "maps_type": m.type + ("" if m.form == "full" else f" {m.form}")}

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

    def layer_devices(self) -> list[str]:
        """The device each layer lives on, as ``"NAME (DESCRIPTION)"``: ``"CPU (...)"`` on this
        machine, ``"RPC0 (host:port)"`` on an RPC server (``rpc_servers``), ``"CUDA0 (...)"`` ..."""
        out = []
        while (name := N.llama_ridgefill_layer_device(self._model.model, len(out))) is not None:
            out.append(name.decode(errors="replace"))
        return out

    def read_kv(self, layer: int, positions: Sequence[int]):
        """K and V cache rows of ``layer`` at ``positions`` (sequence 0) as float32 arrays
        [n, n_embd_k_gqa] and [n, n_embd_v_gqa]: what the prefill wrote. For tests and tools."""
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
        """The splice test for recurrent state (docs/design.md §9): in the next RidgeFill prefills, late
        recurrent ``layer``'s tail rows start from ``state`` (the layout of :meth:`read_state`, e.g.
        read after an exact prefill of the prompt's prefix) instead of the state its filled rows left.
        ``layer`` None: no layer is spliced any more."""
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
        n = get(None, 0)
        if n < 0:
            raise ValueError(_last_error())
        out = np.empty(n, dtype=np.float32)
        get(out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
        return out


def _open_only(method):
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        self._check_open(method.__name__)
        return method(self, *args, **kwargs)
    return checked


#: the methods that use the model or the context: after close() they raise instead of crashing
_NEEDS_OPEN = (
    # llama-cpp-python's
    "tokenize", "detokenize", "tokenizer", "eval", "sample", "generate", "create_embedding", "embed",
    "create_completion", "__call__", "create_chat_completion", "create_chat_completion_openai_v1",
    "save_state", "load_state", "n_ctx", "n_embd", "n_vocab", "token_eos", "token_bos", "token_nl",
    "pooling_type",
    # ours
    "set_ridgefill", "prefill", "forget_cells", "ridgefill_value_scales", "ridgefill_key_scales",
    "ridgefill_scores", "layer_devices", "read_kv", "read_state", "ridgefill_boundary_state",
    "ridgefill_splice_state", "ridgefill_record_boundary_states", "ridgefill_memory",
)
for _name in _NEEDS_OPEN:
    setattr(Llama, _name, _open_only(getattr(Llama, _name)))
del _name


__all__ = ["Llama", "RidgeFill", "SELECTORS", "TOKEN_CLASSES", "PLACEMENTS"]
