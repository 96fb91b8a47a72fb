"""Terminal-state gains for hybrid models (qwen35), measured with llama.cpp (docs/design.md §4 item 4).

A late Gated DeltaNet layer's recurrence consumes every prompt row; filled rows feed it the state
update of their predicted input x̂_l, so its state at the prefix/tail boundary (after row N-T-1)
is off. ``RidgeFill(state_correction="gain")`` multiplies that state, per value head h of each
mapped recurrent layer l, by a gain g[l][h] before the tail runs. The gain is the least-squares
one from the filled to the exact boundary state over calibration windows w,

    g[l][h] = Σ_w ⟨M^exact_{w,l,h}, M^fill_{w,l,h}⟩_F / Σ_w ‖M^fill_{w,l,h}‖²_F

over the [S_v, S_v] delta-net state matrix of the head (the conv state is left alone). The
derivation and why a per-head gain: :mod:`ridgefill_cpp.oracle.state_correction`, whose
``fit_state_gains`` computes the same numbers on the float64 oracle.

Here both states come from llama.cpp, with the numerics of run time: the exact one from a stock
prefill of the window's prefix (``read_state``), the filled one from a RidgeFill prefill of the
whole window with the plan prefill would use (same maps, tail, selector, fraction and value
rescale), recorded before any correction (``ridgefill_boundary_state``). Sums are float64.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from . import capture
from ..core import settings
from .fit import FitError, bos_prefix, calibration_tokens, heldout_windows
from ..core.gguf_model import read_metadata, read_model_info
from ..maps.mapfile import (_STATE_GAIN_SUFFIX, STATE_GAIN_PREFIX, check_maps, read_map_file, rewrite_map_file,
                      state_gain_key_values, tensor_name_state_gain)
from ..runtime.prefill import Llama, RidgeFill


def late_recurrent_layers(model_path: os.PathLike | str, layers: Sequence[int]) -> list[int]:
    """The recurrent (Gated DeltaNet) layers among the mapped ``layers`` (S+1..L-1) of the model."""
    rec = set(read_model_info(model_path).recurrent_layers)
    return [il for il in layers if il in rec]


def ssm_shape(model_path: os.PathLike | str) -> tuple[int, int]:
    """(n_v_heads, S_v) of the model's delta-net state: ``{arch}.ssm.time_step_rank`` heads of
    [S_v, S_v] with S_v = ``ssm.inner_size`` / n_v_heads."""
    md = read_metadata(model_path)
    arch = md.get("general.architecture")
    n_v, d_inner = md.get(f"{arch}.ssm.time_step_rank"), md.get(f"{arch}.ssm.inner_size")
    if not n_v or not d_inner:
        raise FitError(f"{model_path}: no {arch}.ssm.time_step_rank / ssm.inner_size keys (not a hybrid model)")
    return int(n_v), int(d_inner) // int(n_v)


def _ssm_part(state: np.ndarray, n_v: int, s_v: int, what: str) -> np.ndarray:
    """The delta-net state [n_v, S_v, S_v] (float64) of a state in llama.cpp's layout (conv then ssm)."""
    n = n_v * s_v * s_v
    if state is None or state.size < n:
        raise RuntimeError(f"{what}: expected at least {n} state values, got {0 if state is None else state.size}")
    return state[state.size - n:].astype(np.float64).reshape(n_v, s_v, s_v)


def boundary_states(model_path: os.PathLike | str, map_path: os.PathLike | str, windows: Sequence[Sequence[int]], *,
                    tail: int = settings.TAIL, fraction: float = settings.EXACT_FRACTION,
                    selector: str = settings.SELECTOR, value_rescale: int = settings.VALUE_RESCALE,
                    n_threads: int | None = None, n_gpu_layers: int = 0,
                    progress: Callable[[int, int], None] | None = None,
                    on_pair: Callable[[int, dict[int, np.ndarray], dict[int, np.ndarray]], None] | None = None,
                    ) -> list[int]:
    """Measure each window's exact and filled boundary states of every late recurrent layer and hand
    them to ``on_pair(window index, exact, filled)`` (layer -> float64 [n_v_heads, S_v, S_v]).
    Returns the layers. ``progress(done, total)`` counts prefills (two per window).

    The exact pass runs first on a stock ``Llama`` (its states are kept, float32), which is closed
    before the RidgeFill ``Llama`` opens: one copy of the weights at a time.
    """
    meta = read_map_file(map_path).meta
    layers = late_recurrent_layers(model_path, meta.layers)
    if not layers:
        raise FitError(f"{model_path}: the model has no Gated DeltaNet (recurrent) layer above the split "
                       f"S = {meta.split_layer}, so there is no boundary state to correct")
    windows = [[int(t) for t in w] for w in windows]
    if not windows:
        raise FitError("no calibration windows for the state gains")
    short = [len(w) for w in windows if len(w) <= tail]
    if short:
        raise FitError(f"a calibration window of {short[0]} tokens is not longer than the tail ({tail}): "
                       f"state gains need prefix rows before the tail")
    n_v, s_v = ssm_shape(model_path)
    n_ctx = int(math.ceil(max(len(w) for w in windows) / 64) * 64)
    total, done = 2 * len(windows), 0

    exact_states: list[dict[int, np.ndarray]] = []
    llm = capture.open_model(model_path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers)
    try:
        for w in windows:
            llm.reset()
            llm.eval(w[:len(w) - tail])
            exact_states.append({il: _ssm_part(llm.read_state(il), n_v, s_v, f"layer {il} state").astype(np.float32)
                                 for il in layers})
            done += 1
            if progress:
                progress(done, total)
    finally:
        llm.close()

    rf = RidgeFill(str(map_path), tail=tail, exact_fraction=fraction, selector=selector,
                   value_rescale=value_rescale, min_prompt=0)
    llm = capture.open_model(model_path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                             ridgefill=rf)
    try:
        llm.ridgefill_record_boundary_states(True)
        for i, w in enumerate(windows):
            llm.reset()
            llm.eval(w)
            if not llm.ridgefill_stats:
                raise RuntimeError(f"window {i}: RidgeFill did not plan a prompt of {len(w)} tokens")
            filled = {il: _ssm_part(llm.ridgefill_boundary_state(il), n_v, s_v, f"layer {il} boundary state")
                      for il in layers}
            exact = {il: s.astype(np.float64) for il, s in exact_states[i].items()}
            exact_states[i] = {}
            if on_pair:
                on_pair(i, exact, filled)
            done += 1
            if progress:
                progress(done, total)
    finally:
        llm.close()
    return layers


def fit_state_gains(model_path: os.PathLike | str, map_path: os.PathLike | str, windows: Sequence[Sequence[int]], *,
                    tail: int = settings.TAIL, fraction: float = settings.EXACT_FRACTION,
                    selector: str = settings.SELECTOR, value_rescale: int = settings.VALUE_RESCALE,
                    n_threads: int | None = None, n_gpu_layers: int = 0,
                    progress: Callable[[int, int], None] | None = None) -> dict[int, np.ndarray]:
    """The per-head terminal-state gains of every late recurrent layer of ``model_path`` for the maps
    at ``map_path``, fitted on calibration ``windows`` (token lists, BOS first, each longer than
    ``tail``) with the plan prefill would use: ``{layer: float32 [n_v_heads]}``; 1 for a head whose
    filled state is zero in every window. The formula is the module docstring's (derivation:
    :mod:`ridgefill_cpp.oracle.state_correction`). Raises :class:`~ridgefill_cpp.fitting.fit.FitError` for a
    model without recurrent layers above the split, no windows, or a window not longer than the tail.
    """
    num: dict[int, np.ndarray] = {}
    den: dict[int, np.ndarray] = {}

    def add(_i: int, exact: dict[int, np.ndarray], filled: dict[int, np.ndarray]) -> None:
        for il, f in filled.items():
            num[il] = num.get(il, 0.0) + (exact[il] * f).sum(axis=(1, 2))
            den[il] = den.get(il, 0.0) + (f * f).sum(axis=(1, 2))

    layers = boundary_states(model_path, map_path, windows, tail=tail, fraction=fraction, selector=selector,
                             value_rescale=value_rescale, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                             progress=progress, on_pair=add)
    return {il: np.where(den[il] > 0, num[il] / np.where(den[il] > 0, den[il], 1.0), 1.0).astype(np.float32)
            for il in layers}


def calibration_windows(model_path: os.PathLike | str, documents: Iterable, *, n_tokens: int, ctx: int,
                        max_windows: int, holdout_every: int = 10) -> list[list[int]]:
    """Up to ``max_windows`` windows of ``ctx`` rows (BOS first where the model uses one) of the
    calibration text, cut as :func:`ridgefill_cpp.fitting.fit.fit_ridge_maps` cuts them from the same
    ``documents`` and ``n_tokens``: the windows the fit held out first (their filled states carry the
    maps' out-of-sample error, as at run time), then the others in order."""
    llm = Llama(str(model_path), vocab_only=True, verbose=False)
    try:
        tokens = calibration_tokens(llm, documents, n_tokens)
        bos = bos_prefix(llm)
    finally:
        llm.close()
    per_window = ctx - len(bos)
    n_windows = len(tokens) // per_window
    held = heldout_windows(n_windows, holdout_every) if n_windows else set()
    order = sorted(held) + [w for w in range(n_windows) if w not in held]
    return [bos + tokens[w * per_window:(w + 1) * per_window] for w in order[:max_windows]]


def add_state_gains(map_path: os.PathLike | str, gains: dict[int, np.ndarray],
                    out_path: os.PathLike | str | None = None, *, settings: dict | None = None) -> Path:
    """Rewrite the map file at ``map_path`` (or write ``out_path``) with ``gains`` as its state-gain
    tensors, replacing any it had; every other key and tensor is copied unchanged (an F16 A stays
    F16, tuned defaults stay). ``settings`` is the operating point the gains were fitted at
    (``tail``, ``exact_fraction``, ``selector``, ``value_rescale``, ``windows``, ``window_rows``:
    :data:`ridgefill_cpp.maps.mapfile.STATE_GAIN_KEYS`), written as ``ridgefill.state_gain.*`` keys; the
    keys of earlier gains are always dropped (with no ``settings``, or no ``gains``, the file records
    none). Atomic (:func:`ridgefill_cpp.maps.mapfile.rewrite_map_file`). Raises
    :class:`~ridgefill_cpp.maps.mapfile.MapFileError` for gains that are not finite, positive, 1-D and
    for mapped layers, ``ValueError`` for unknown or ill-typed settings."""
    maps = read_map_file(map_path)
    maps.g = {int(il): np.ascontiguousarray(g, dtype=np.float32) for il, g in gains.items()}
    check_maps(maps)
    keys = state_gain_key_values(settings)  # checked even when there are no gains to go with
    if not maps.g:
        keys = []
    return rewrite_map_file(map_path, out_path, drop_key=lambda name: name.startswith(STATE_GAIN_PREFIX),
                            add_keys=keys, drop_tensor=lambda name: name.endswith(_STATE_GAIN_SUFFIX),
                            add_tensors=[(tensor_name_state_gain(il), maps.g[il]) for il in sorted(maps.g)])


def gain_plan() -> dict:
    """The plan the gains are fitted with: the built-in tail, exact fraction, selector and value
    rescale (libllama's defaults)."""
    return {"tail": settings.TAIL, "exact_fraction": settings.EXACT_FRACTION, "selector": settings.SELECTOR,
            "value_rescale": settings.VALUE_RESCALE}


def fit_state_gains_into(model_path: os.PathLike | str, map_path: os.PathLike | str, documents: Iterable, *,
                         n_tokens: int, ctx: int, max_windows: int, n_threads: int | None = None,
                         n_gpu_layers: int = 0, progress: Callable[[int, int], None] | None = None) -> tuple[dict[int, np.ndarray], dict]:
    """``fit --state-gains``: the gains of the maps at ``map_path`` fitted on the windows the fit cut
    from ``documents`` (:func:`calibration_windows`) with :func:`gain_plan`, written into that map file
    with the settings they were fitted at. Returns the gains and those settings (the plan, ``windows``,
    ``window_rows``). Raises :class:`~ridgefill_cpp.fitting.fit.FitError` as :func:`fit_state_gains`."""
    windows = calibration_windows(model_path, documents, n_tokens=n_tokens, ctx=ctx, max_windows=max_windows)
    plan = gain_plan()
    gains = fit_state_gains(model_path, map_path, windows, tail=plan["tail"], fraction=plan["exact_fraction"],
                            selector=plan["selector"], value_rescale=plan["value_rescale"], n_threads=n_threads,
                            n_gpu_layers=n_gpu_layers, progress=progress)
    fitted_at = {**plan, "windows": len(windows), "window_rows": max(len(w) for w in windows)}
    add_state_gains(map_path, gains, settings=fitted_at)
    return gains, fitted_at


__all__ = ["fit_state_gains", "fit_state_gains_into", "gain_plan", "add_state_gains", "calibration_windows",
           "boundary_states", "late_recurrent_layers", "ssm_shape"]
