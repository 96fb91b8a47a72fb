"""Fitting the ridge maps: hidden states from llama.cpp, streaming statistics, closed-form solve.

For a split S and every late layer l = S+1 .. L-1, fit ``x_l ≈ A_l φ(x_S) + b_l`` (docs/design.md §8):

1. **Capture.** The calibration text is tokenized with the model's own tokenizer and cut into
   windows of ``ctx`` rows, each a fresh sequence starting with BOS where the model uses one.
   With several lengths (mixed-length windows, e.g. ``ctx=(512, 4096)``) each length gets an
   equal share of the tokens, and its windows are spread evenly through the sequence
   (:func:`window_plan`): the maps see the positions of long prompts, and the early positions
   keep the weight the short windows give them.
   llama.cpp runs each window and returns the inputs of layers S..L-1 for every row, through the
   patched library (:mod:`ridgefill_cpp.fitting.capture`), i.e. with the numerics of run time.
2. **Attention-sink rows are left out.** The first ``skip_rows`` rows of a window (BOS and the
   first tokens) carry the attention sink: their hidden states have huge outlier dimensions and
   would dominate a least-squares fit while saying nothing about ordinary rows. They are excluded
   from the statistics. (At run time such rows are rare; keeping them exact is the selector's job.)
3. **Streaming statistics.** Every ``holdout_every``-th window of each length (at least one) is held out; the others update
   float64 sums ``n, Σx, Σxxᵀ`` and, per layer, ``Σy, Σxyᵀ``. Memory does not grow with the
   number of calibration tokens: held-out rows are kept only up to ``max_heldout_rows``.
4. **Objective.** ``normalized`` (default) fits on RMS-normalised states, φ(x) = x / rms(x), for
   both x_S and the target x_l: every supported layer starts with an RMS norm, so only the
   direction of x̂_l reaches it, and a raw fit is dominated by a few outlier dimensions of huge
   magnitude. ``raw`` fits the states as they are.
5. **Solve.** With centred statistics (the bias is not penalised), one eigendecomposition
   Cxx = QΛQᵀ gives every ridge solution W(λ) = Q (Λ+λ)⁻¹ Qᵀ Cxy. The held-out squared error of
   each λ on a log grid is computed from held-out second moments in O(d²) per λ, and each layer
   takes its best λ. ``A_l = W(λ_l)ᵀ``, ``b_l = μ_y − A_l μ_x``.
6. **Quality** on the held-out rows, in the space the layer consumes (directions, i.e. after
   RMS normalisation of prediction and truth): R² and the median relative error, next to
   identity fill's (x̂_l = x_S).
7. **Compact maps** (optional, :func:`compact_result`; :mod:`ridgefill_cpp.maps.compact`): a low-rank
   form of each map from the same statistics, and a quantized storage type; the quality figures
   are then those of the maps as stored.

The library never prints: progress goes to an optional callback.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from .. import __version__
from . import capture
from ..core import settings
from ..core.native import llama_ridgefill_capture_layer_input, llama_ridgefill_get_layer_input
from .corpus import Document
from ..maps.fingerprint import model_fingerprint
from ..core.gguf_model import read_metadata, read_model_info, supported_architectures
from ..maps.mapfile import OBJECTIVES, MapFileMeta, RidgeMaps, late_layers

#: relative ridge strengths tried per layer (λ = α · mean eigenvalue of Cxx)
LAMBDA_GRID = tuple(10.0 ** e for e in np.arange(-7.0, 1.01, 0.5))


class FitError(ValueError):
    """Unusable fit input: unsupported model, split out of range, too little text."""


def check_split(split: int, n_layer: int) -> None:
    """That maps can be fitted for ``split`` in a model of ``n_layer`` layers (they map layers
    S+1..L-1: 1 <= S <= L-2); :class:`FitError` says why not."""
    if not 1 <= split <= n_layer - 1:
        raise FitError(f"split {split} outside 1..{n_layer - 1} (the model has {n_layer} layers)")
    if split == n_layer - 1:
        raise FitError(f"split {split} = L-1 leaves no layer to map (maps exist for S+1..L-1)")


@dataclass
class FitOptions:
    split: int | None = None  # None: L - floor(L/3)
    objective: str = "normalized"
    n_tokens: int = settings.FIT_TOKENS  # calibration token budget
    ctx: int | tuple[int, ...] = settings.FIT_CTX  # window length; several: mixed-length windows
    skip_rows: int = 4  # attention-sink rows left out at the start of each window
    holdout_every: int = 10  # every k-th window is held out
    max_heldout_rows: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = 0  # layers offloaded to a GPU for the capture (-1: all), as llama.cpp's -ngl
    lambda_grid: Sequence[float] = LAMBDA_GRID


@dataclass
class FitTimings:
    forward_s: float = 0.0  # llama.cpp decode, including the capture copies
    accumulate_s: float = 0.0  # statistics (torch, float64)
    solve_s: float = 0.0
    tokenize_s: float = 0.0


@dataclass
class FitEstimate:
    """What a fit will take, said after its first windows (:func:`fit_ridge_maps_for_splits`'s
    ``on_estimate``): the capture at the speed measured so far, the solve from a timed float64 product
    on this machine, and the memory the statistics, held-out rows and solve add to what is resident."""

    tokens: int           # calibration tokens of the plan
    tokens_per_s: float   # capture and statistics together, measured on the windows after the first
    capture_s: float      # the whole capture at that speed (the windows done included)
    solve_s: float        # the solve of every split
    rss_bytes: int        # resident now (the model, llama.cpp's buffers, the statistics)
    peak_bytes: int       # expected peak

    @property
    def total_s(self) -> float:
        return self.capture_s + self.solve_s


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS; the peak so far where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def float64_flops_per_s(d: int) -> float:
    """Float64 multiply speed of this machine (torch, its threads) on a d×d product, the solve's kind of work."""
    a = torch.randn(d, d, dtype=torch.float64)
    a @ a  # warm-up
    t0 = time.perf_counter()
    a @ a
    return 2.0 * d**3 / max(time.perf_counter() - t0, 1e-6)


def solve_flops(d: int, n_late: int, n_held: int) -> float:
    """Floating-point operations of one split's solve (:func:`select_and_solve` and the held-out
    quality): the eigendecomposition of Cxx (~9 d³), and per late layer three d×d products and four
    products of the held-out rows with d×d matrices."""
    return 9.0 * d**3 + n_late * (6.0 * d**3 + 4.0 * n_held * d * d)


def expected_peak_bytes(rss: int, d: int, splits: Sequence[tuple[int, int, int]]) -> int:
    """The peak a fit reaches from ``rss`` resident now: ``splits`` holds per split (late layers, held-out
    rows still to come, held-out rows in all). Each split's held-out rows grow as float64 (input and
    late layers); its solve keeps the maps (float32) and float32 copies of the held-out rows (the
    calibration :func:`compact_result` uses), and needs while it runs about eight d×d and four
    held-out-sized float64 arrays; the storage type's quantizer then works on one split's maps."""
    growth = sum(todo * d * (n_late + 1) * 8 for n_late, todo, _ in splits)
    kept = sum(n_late * d * (d + 1) * 4 + held * d * (n_late + 1) * 4 + d * d * 8 for n_late, _, held in splits)
    transient = max(8 * d * d * 8 + 4 * held * d * 8 + n_late * d * d * 4 for n_late, _, held in splits)
    return int(rss + growth + kept + transient)


def _estimate(plan: Sequence[Window], n_done: int, first_s: float, since_first_s: float,
              accs: Sequence["_SplitAccumulator"], d: int, held_total: int) -> FitEstimate:
    """The :class:`FitEstimate` of a fit whose first ``n_done`` windows of ``plan`` are done: the
    first (with the model's loading) in ``first_s``, the others in ``since_first_s``."""
    rate = sum(w.n_tokens for w in plan[1:n_done]) / max(since_first_s, 1e-9)
    flops = sum(solve_flops(d, len(acc.layers), held_total) for acc in accs)
    rss = resident_bytes()
    return FitEstimate(tokens=sum(w.n_tokens for w in plan), tokens_per_s=rate,
                       capture_s=first_s + sum(w.n_tokens for w in plan[1:]) / rate,
                       solve_s=flops / float64_flops_per_s(d), rss_bytes=rss,
                       peak_bytes=expected_peak_bytes(rss, d, [(len(acc.layers), held_total - acc.n_held, held_total)
                                                               for acc in accs]))


@dataclass
class Calibration:
    """What :func:`compact_result` needs of a fit: the training inputs' mean and centred covariance
    and the held-out rows (objective space, float32)."""

    mx: np.ndarray
    cxx: np.ndarray
    held_x: np.ndarray
    held_y: dict[int, np.ndarray]
    eps: float


@dataclass
class FitResult:
    maps: RidgeMaps
    timings: FitTimings
    n_windows: int
    lambda_curves: dict[int, list[float]] = field(default_factory=dict)  # layer -> held-out MSE per λ
    #: the statistics the maps were solved from (for :func:`compact_result`)
    calibration: Calibration | None = field(default=None, repr=False)
    #: the storage type the quality figures were measured at ("" : the fitted float values)
    dtype: str = ""


#: windows after which a fit says what it will take (the first one's warm-up is not counted)
ESTIMATE_AFTER_WINDOWS = 3


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RidgeStatistics:
    """Streaming float64 sufficient statistics of ``y_l ≈ W_lᵀ x + b_l`` for several targets."""

    def __init__(self, d: int, layers: Sequence[int]):
        self.d = d
        self.layers = list(layers)
        self.n = 0
        self.sx = torch.zeros(d, dtype=torch.float64)
        self.sxx = torch.zeros(d, d, dtype=torch.float64)
        self.sy = {il: torch.zeros(d, dtype=torch.float64) for il in self.layers}
        self.sxy = {il: torch.zeros(d, d, dtype=torch.float64) for il in self.layers}

    def update(self, x: torch.Tensor, ys: dict[int, torch.Tensor]) -> None:
        x = x.to(torch.float64)
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sxx.addmm_(x.T, x)
        for il in self.layers:
            y = ys[il].to(torch.float64)
            self.sy[il] += y.sum(0)
            self.sxy[il].addmm_(x.T, y)

    def centred(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(μx, Cxx): mean and covariance of x."""
        mx = self.sx / self.n
        return mx, self.sxx / self.n - torch.outer(mx, mx)

    def cross(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(μy, Cxy) for layer ``il``."""
        mx = self.sx / self.n
        my = self.sy[il] / self.n
        return my, self.sxy[il] / self.n - torch.outer(mx, my)


def solve_ridge(stats: RidgeStatistics, il: int, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ridge solution for one λ: (A [out, in], b [out]) with A·x + b ≈ y. Direct solve (for tests)."""
    mx, cxx = stats.centred()
    my, cxy = stats.cross(il)
    w = torch.linalg.solve(cxx + lam * torch.eye(stats.d, dtype=torch.float64), cxy)
    a = w.T
    return a, my - a @ mx


def select_and_solve(
    stats: RidgeStatistics,
    heldout_x: torch.Tensor,
    heldout_y: dict[int, torch.Tensor],
    grid: Sequence[float],
) -> dict[int, tuple[torch.Tensor, torch.Tensor, float, list[float]]]:
    """Per layer: (A, b, λ, held-out MSE per grid point), λ chosen on the held-out rows."""
    mx, cxx = stats.centred()
    evals, q = torch.linalg.eigh(cxx)
    evals = evals.clamp_min(0)
    scale = float(evals.mean())
    lams = [a * scale for a in grid]
    p = (heldout_x.to(torch.float64) - mx) @ q  # held-out x in the eigenbasis
    gv = p.T @ p
    out = {}
    for il in stats.layers:
        my, cxy = stats.cross(il)
        r = q.T @ cxy  # [d, d]
        yc = heldout_y[il].to(torch.float64) - my
        t = p.T @ yc
        term1 = float((yc * yc).sum())
        t2 = (r * t).sum(1)  # per eigen-direction
        m = gv * (r @ r.T)
        mses = []
        for lam in lams:
            u = 1.0 / (evals + lam)
            sse = term1 - 2.0 * float((t2 * u).sum()) + float(u @ m @ u)
            mses.append(max(sse, 0.0) / max(yc.shape[0], 1))
        best = int(np.argmin(mses))
        lam = lams[best]
        w = q @ (r / (evals + lam)[:, None])
        a = w.T.contiguous()
        out[il] = (a, my - a @ mx, lam, mses)
    return out


def objective_space(states: dict[int, torch.Tensor], normalize: bool, eps: float) -> dict[int, torch.Tensor]:
    """Captured layer inputs in float64, RMS-normalised for the ``normalized`` objective."""
    return {il: (rms_normalize(x.to(torch.float64), eps) if normalize else x.to(torch.float64))
            for il, x in states.items()}


def _rel_err(pred: torch.Tensor, true: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row ‖φ(pred) − φ(true)‖ / ‖φ(true)‖: error in the direction the layer's norm sees."""
    p, t = rms_normalize(pred, eps), rms_normalize(true, eps)
    return (p - t).norm(dim=-1) / t.norm(dim=-1)


def bos_prefix(llm) -> list[int]:
    """``[BOS]`` when the model's tokenizer adds one to a prompt, else ``[]``."""
    bos = llm.token_bos()
    return [bos] if llm._model.add_bos_token() and bos >= 0 else []


def heldout_windows(n_windows: int, every: int) -> set[int]:
    """The calibration windows the fit holds out: every ``every``-th; with fewer, the last one."""
    return {w for w in range(n_windows) if (w + 1) % every == 0} or {n_windows - 1}


def window_lengths(ctx: int | Sequence[int]) -> tuple[int, ...]:
    """The calibration window lengths of ``ctx`` (one length, or several for mixed-length windows),
    ascending."""
    lengths = (int(ctx),) if isinstance(ctx, (int, np.integer)) else tuple(sorted(int(c) for c in ctx))
    if not lengths or len(set(lengths)) != len(lengths):
        raise FitError(f"ctx {ctx}: window lengths must be distinct and at least one")
    return lengths


@dataclass(frozen=True)
class Window:
    start: int  # first calibration token
    n_tokens: int  # calibration tokens (the window less its BOS)
    heldout: bool


def window_plan(n_tokens: int, lengths: Sequence[int], n_bos: int, holdout_every: int) -> list[Window]:
    """The calibration windows of ``n_tokens`` tokens, in decode order.

    Each length gets an equal share of the tokens and as many windows as fit in it; every
    ``holdout_every``-th window of a length is held out (at least one: :func:`heldout_windows`).
    Windows of different lengths are interleaved by their relative place in their own length's
    sequence, so each length is spread over the whole text. With one length this is the plain cut
    into consecutive windows. A length that gets no window leaves it out of the plan (the caller
    reports it)."""
    share = n_tokens // len(lengths)
    keyed = []
    for j, ln in enumerate(lengths):
        per = ln - n_bos
        count = share // per
        held = heldout_windows(count, holdout_every) if count else set()
        keyed += [((i + 0.5) / count, j, per, i in held) for i in range(count)]
    plan, start = [], 0
    for _, _, per, held in sorted(keyed):
        plan.append(Window(start, per, held))
        start += per
    return plan


def calibration_tokens(llm, documents: Iterable[Document], budget: int) -> list[int]:
    """Tokens of ``documents`` (model tokenizer, no BOS), separated by EOS, up to ``budget``."""
    eos = llm.token_eos()
    out: list[int] = []
    for doc in documents:
        toks = llm.tokenize(doc.text.encode("utf-8"), add_bos=False)
        if not toks:
            continue
        out.extend(toks)
        if eos >= 0:
            out.append(eos)
        if len(out) >= budget:
            break
    return out[:budget]


class _WindowCapture:
    """Decode calibration windows with llama.cpp and hand back the captured layer inputs."""

    def __init__(self, model_path, layers: Sequence[int], ctx: int, n_threads: int | None, n_gpu_layers: int = 0):
        try:
            self.llm = capture.open_model(model_path, n_ctx=ctx, n_batch=ctx, n_threads=n_threads,
                                          n_gpu_layers=n_gpu_layers)
        except ValueError as e:
            if "llama_context" not in str(e):
                raise
            raise FitError(f"llama.cpp could not create a context of {ctx} rows for {model_path} (not enough "
                           "memory for its KV cache and compute buffers?): use a smaller ctx") from None
        self.layers = list(layers)
        self.ctx = ctx
        self.bos = bos_prefix(self.llm)
        self.n_embd = self.llm.n_embd()
        for il in self.layers:
            llama_ridgefill_capture_layer_input(self.llm._ctx.ctx, il, True)

    @property
    def per_window(self) -> int:
        """Calibration tokens per window (the window less its BOS)."""
        return self.ctx - len(self.bos)

    def run(self, window_tokens: Sequence[int], skip_rows: int) -> dict[int, torch.Tensor]:
        """layer -> float32 [rows - skip_rows, n_embd] inputs of that layer for one window."""
        window = self.bos + list(window_tokens)
        self.llm.reset()
        self.llm.eval(window)
        out = {}
        for il in self.layers:
            ptr = llama_ridgefill_get_layer_input(self.llm._ctx.ctx, il)
            arr = np.ctypeslib.as_array(ptr, shape=(len(window), self.n_embd))
            out[il] = torch.from_numpy(arr[skip_rows:].copy())
        return out

    def close(self) -> None:
        self.llm.close()


class _SplitAccumulator:
    """The statistics and held-out rows of one split S (maps for S+1..L-1)."""

    def __init__(self, split: int, n_layer: int, d: int):
        self.split = split
        self.layers = list(late_layers(split, n_layer))
        self.stats = RidgeStatistics(d, self.layers)
        self.held_x: list[torch.Tensor] = []
        self.held_y: dict[int, list[torch.Tensor]] = {il: [] for il in self.layers}
        self.n_held = 0

    def add(self, phi: dict[int, torch.Tensor], heldout: bool, max_heldout: int) -> None:
        x, ys = phi[self.split], {il: phi[il] for il in self.layers}
        if not heldout:
            self.stats.update(x, ys)
        elif self.n_held < max_heldout:
            k = min(x.shape[0], max_heldout - self.n_held)
            self.held_x.append(x[:k])
            for il in self.layers:
                self.held_y[il].append(ys[il][:k])
            self.n_held += k

    def solve(self, grid: Sequence[float], eps: float):
        """(a, b, lambdas, r2, rel_err, identity_rel_err, curves, n_heldout)."""
        hx = torch.cat(self.held_x)
        hy = {il: torch.cat(v) for il, v in self.held_y.items()}
        solved = select_and_solve(self.stats, hx, hy, grid)
        a_maps, b_maps, lambdas, r2s, errs, id_errs, curves = {}, {}, [], [], [], [], {}
        hx_phi = rms_normalize(hx, eps)  # identity fill compares x_S with x_l in the consumed space
        for il in self.layers:
            a, b, lam, mses = solved[il]
            r2, err = held_out_quality(hx, hy[il], a, b, eps)
            r2s.append(r2)
            errs.append(err)
            id_errs.append(float(_rel_err(hx_phi, hy[il], eps).median()))
            lambdas.append(float(lam))
            curves[il] = mses
            a_maps[il] = a.to(torch.float32).numpy()
            b_maps[il] = b.to(torch.float32).numpy()
        mx, cxx = self.stats.centred()
        cal = Calibration(mx.numpy(), cxx.numpy(), hx.to(torch.float32).numpy(),
                          {il: v.to(torch.float32).numpy() for il, v in hy.items()}, eps)
        return a_maps, b_maps, lambdas, r2s, errs, id_errs, curves, int(hx.shape[0]), cal

    def importance(self) -> np.ndarray:
        """E[x²] per input dimension over the training rows (the quantizers' importance matrix)."""
        return (torch.diagonal(self.stats.sxx) / max(self.stats.n, 1)).to(torch.float32).numpy()


def held_out_quality(hx: torch.Tensor, hy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float) -> tuple[float, float]:
    """(R², median relative error) of the map (a, b) on held-out rows, as the fit reports them."""
    hx, hy = hx.to(torch.float64), hy.to(torch.float64)
    pred = hx @ a.to(torch.float64).T + b.to(torch.float64)
    resid = ((hy - pred) ** 2).sum()
    total = ((hy - hy.mean(0)) ** 2).sum()
    return float(1.0 - resid / total), float(_rel_err(pred, hy, eps).median())


def fit_ridge_maps(
    model_path: os.PathLike | str,
    documents: Iterable[Document],
    options: FitOptions | None = None,
    *,
    source: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> FitResult:
    """Fit the maps of ``model_path`` on ``documents``. ``progress(tokens_done, tokens_total)``."""
    opt = options or FitOptions()
    return fit_ridge_maps_for_splits(model_path, documents, [opt.split], opt, source=source, progress=progress)[0]


def fit_ridge_maps_for_splits(
    model_path: os.PathLike | str,
    documents: Iterable[Document],
    splits: Sequence[int | None],
    options: FitOptions | None = None,
    *,
    source: str = "",
    progress: Callable[[int, int], None] | None = None,
    on_estimate: Callable[[FitEstimate], None] | None = None,
) -> list[FitResult]:
    """Maps for several splits from one capture pass (layers min(S)..L-1 are captured once).

    Each split's maps equal those of a separate :func:`fit_ridge_maps` run on the same text
    (``options.split`` is ignored here; None in ``splits`` is the default split). ``on_estimate``
    gets what the whole fit will take once, after the first :data:`ESTIMATE_AFTER_WINDOWS` windows
    (not for a fit of fewer windows).
    """
    opt = options or FitOptions()
    info = read_model_info(model_path)
    if not info.supported:
        raise FitError(f"{model_path}: architecture {info.architecture!r} is not supported "
                       f"(supported: {', '.join(supported_architectures())})")
    L, d = info.n_layer, info.n_embd
    splits = [info.default_split if s is None else int(s) for s in splits]
    if not splits or len(set(splits)) != len(splits):
        raise FitError(f"splits must be distinct and at least one: {splits}")
    for split in splits:
        check_split(split, L)
    if opt.objective not in OBJECTIVES:
        raise FitError(f"objective {opt.objective!r}: expected one of {', '.join(OBJECTIVES)}")
    lengths = window_lengths(opt.ctx)
    if lengths[0] <= opt.skip_rows + 1:
        raise FitError(f"ctx {lengths[0]} leaves no rows after skipping {opt.skip_rows} sink rows")
    if info.context_length and lengths[-1] > info.context_length:
        raise FitError(f"ctx {lengths[-1]} is longer than the model's training context ({info.context_length} tokens): "
                       f"calibration windows must fit in it")
    md = read_metadata(model_path)
    eps = float(md.get(f"{info.architecture}.attention.layer_norm_rms_epsilon", 1e-6))
    normalize = opt.objective == "normalized"
    captured = list(range(min(splits), L))

    timings = FitTimings()
    t_start = time.perf_counter()
    accs = [_SplitAccumulator(s, L, d) for s in splits]
    cap = _WindowCapture(model_path, captured, lengths[-1], opt.n_threads, opt.n_gpu_layers)
    try:
        t0 = time.perf_counter()
        tokens = calibration_tokens(cap.llm, documents, opt.n_tokens)
        timings.tokenize_s = time.perf_counter() - t0
        n_bos = len(cap.bos)
        plan = window_plan(len(tokens), lengths, n_bos, opt.holdout_every)
        n_train_rows = sum(w.n_tokens + n_bos - opt.skip_rows for w in plan if not w.heldout)
        needed = d + 1
        counts = {ln: sum(w.n_tokens == ln - n_bos for w in plan) for ln in lengths}
        if min(counts.values()) < (2 if len(lengths) == 1 else 1) or n_train_rows < needed:
            shortest = (math.ceil(needed / (lengths[0] - opt.skip_rows)) + 1) * (lengths[0] - n_bos)
            raise FitError(
                f"too little calibration text: {len(tokens)} tokens make "
                f"{', '.join(f'{c} window(s) of {ln}' for ln, c in counts.items())}; the fit needs at least "
                f"{needed} training rows (n_embd + 1 unknowns) plus held-out windows"
                f"{', and a window of every length' if len(lengths) > 1 else ''}, "
                f"i.e. about {len(lengths) * max(shortest, lengths[-1] - n_bos)} tokens"
            )
        n_planned = sum(w.n_tokens for w in plan)
        held_total = min(opt.max_heldout_rows, sum(w.n_tokens + n_bos - opt.skip_rows for w in plan if w.heldout))
        t_first = None  # the end of the first window: its warm-up is left out of the speed
        for k, w in enumerate(plan):
            t0 = time.perf_counter()
            states = cap.run(tokens[w.start:w.start + w.n_tokens], opt.skip_rows)
            t1 = time.perf_counter()
            timings.forward_s += t1 - t0
            phi = objective_space(states, normalize, eps)
            for acc in accs:
                acc.add(phi, w.heldout, opt.max_heldout_rows)
            timings.accumulate_s += time.perf_counter() - t1
            if progress:
                progress(w.start + w.n_tokens, n_planned)
            if k == 0:
                t_first = time.perf_counter()
            elif k + 1 == ESTIMATE_AFTER_WINDOWS and on_estimate is not None and len(plan) > k + 1:
                on_estimate(_estimate(plan, k + 1, t_first - t_start, time.perf_counter() - t_first, accs, d,
                                      held_total))
    finally:
        cap.close()

    fingerprint = model_fingerprint(model_path)
    results = []
    for acc in accs:
        t0 = time.perf_counter()
        a_maps, b_maps, lambdas, r2s, errs, id_errs, curves, n_held, cal = acc.solve(opt.lambda_grid, eps)
        tm = FitTimings(forward_s=timings.forward_s, accumulate_s=timings.accumulate_s,
                        solve_s=time.perf_counter() - t0, tokenize_s=timings.tokenize_s)
        meta = MapFileMeta(
            architecture=info.architecture,
            split_layer=acc.split,
            n_layer=L,
            n_embd=d,
            objective=opt.objective,
            input_norm_eps=eps,
            layers=acc.layers,
            lambdas=lambdas,
            calib_n_tokens=n_planned,
            calib_n_rows=acc.stats.n,
            calib_source=source,
            calib_ctx=lengths[-1],
            calib_skip_rows=opt.skip_rows,
            calib_ctx_lengths=list(lengths) if len(lengths) > 1 else [],
            heldout_n_rows=n_held,
            r2=r2s,
            rel_err_median=errs,
            identity_rel_err_median=id_errs,
            fingerprint=fingerprint,
            model_name=info.name or Path(model_path).name,
            tool_version=__version__,
        )
        results.append(FitResult(RidgeMaps(meta, a_maps, b_maps, importance=acc.importance()), tm, len(plan), curves, cal))
    return results


def compact_result(result: FitResult, *, dtype: str = "f16", form: str = "full", rank: int | None = None,
                   rank_share: float | None = None) -> FitResult:
    """``result``'s maps in a compact form (:mod:`ridgefill_cpp.maps.compact`), with the held-out quality
    of the maps as a file of storage type ``dtype`` holds them.

    ``form``: ``"full"``, ``"identity_low_rank"`` (A = I + U Vᵀ) or ``"low_rank"`` (A = U Vᵀ); for
    the low-rank forms either ``rank`` (every layer) or ``rank_share``: per layer, the smallest rank
    (of :func:`ridgefill_cpp.maps.compact.rank_grid`) whose held-out error keeps that share of the full
    map's gain over the form's baseline (the largest of the grid when none does). The fit's own
    result is not changed. Raises :class:`FitError` for a rank or type the maps cannot take."""
    from ..maps import compact

    cal = result.calibration
    if cal is None:
        raise FitError("the fit result has no calibration statistics (only a fresh fit result can be compacted)")
    maps = result.maps
    meta = maps.meta
    d = meta.n_embd
    if dtype not in compact.DTYPES:
        raise FitError(f"dtype must be one of {', '.join(compact.DTYPES)}, not {dtype!r}")
    if form not in compact.FORMS:
        raise FitError(f"form must be one of {', '.join(compact.FORMS)}, not {form!r}")
    low = form != "full"
    if low and (rank is None) == (rank_share is None):
        raise FitError(f"a {form} map needs a rank or a share of the gain to keep (one of them)")
    if not low and (rank is not None or rank_share is not None):
        raise FitError("a rank applies to the low-rank forms only")
    if rank is not None and not 1 <= rank < d:
        raise FitError(f"rank {rank} outside 1..{d - 1} (n_embd {d})")
    try:
        compact.check_dtype(dtype, [d] + ([rank] if rank else []), "the maps (n_embd" + (", rank)" if rank else ")"))
        if rank_share is not None and not 0.0 < rank_share <= 1.0:
            raise compact.CompactError(f"the share of the gain to keep must be in (0, 1], not {rank_share!r}")
    except compact.CompactError as e:
        raise FitError(str(e)) from None
    out = RidgeMaps(meta, dict(maps.a), dict(maps.b), dict(maps.g), dict(maps.state_gain_settings), {}, maps.importance)
    ranks = []
    if low:
        grid = compact.rank_grid(d, dtype)
        if rank_share is not None and not grid:
            raise FitError(f"n_embd {d} leaves no rank for {dtype} factors (ranks are multiples of {compact.BLOCK[dtype]})")
        for il in meta.layers:
            basis = compact.low_rank_basis(maps.a[il], maps.b[il], cal.mx, cal.cxx, form)
            r = rank
            if r is None:
                errors = compact.held_out_errors(basis, cal.held_x, cal.held_y[il], [0, *grid, d])
                r = min(compact.rank_for_share(errors, rank_share, d), grid[-1])
            u, vt, b = basis.factors(r)
            out.factors[il] = (u.astype(np.float32), vt.astype(np.float32))
            out.b[il] = b.astype(np.float32)
            out.a[il] = basis.dense_of(u, vt).astype(np.float32)
            ranks.append(int(r))
    out.meta = replace(meta, map_form=form, ranks=ranks)
    stored = out.stored(dtype)
    hx = torch.from_numpy(cal.held_x)
    r2s, errs = [], []
    for il in meta.layers:
        r2, err = held_out_quality(hx, torch.from_numpy(cal.held_y[il]), torch.from_numpy(stored.a[il]),
                                   torch.from_numpy(stored.b[il]), cal.eps)
        r2s.append(r2)
        errs.append(err)
    out.meta = replace(out.meta, r2=r2s, rel_err_median=errs)
    return replace(result, maps=out, dtype=dtype)


def evaluate_maps(
    model_path: os.PathLike | str,
    maps: RidgeMaps,
    documents: Iterable[Document],
    *,
    n_tokens: int = 20_000,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Median relative error of the predicted layer input on ``documents`` (e.g. evaluation text):
    ``{"layers", "ridge", "identity"}``, per mapped layer, in the direction the layer's norm sees.
    Uses the calibration windowing of the map file (window length, the longest of mixed lengths;
    skipped sink rows)."""
    meta = maps.meta
    cap = _WindowCapture(model_path, [meta.split_layer] + list(meta.layers), meta.calib_ctx, n_threads, n_gpu_layers)
    errs: dict[int, list[torch.Tensor]] = {il: [] for il in meta.layers}
    id_errs: dict[int, list[torch.Tensor]] = {il: [] for il in meta.layers}
    try:
        tokens = calibration_tokens(cap.llm, documents, n_tokens)
        n_windows = len(tokens) // cap.per_window
        if n_windows < 1:
            raise FitError(f"too little evaluation text: {len(tokens)} tokens, a window needs {cap.per_window}")
        for w in range(n_windows):
            states = cap.run(tokens[w * cap.per_window:(w + 1) * cap.per_window], meta.calib_skip_rows)
            xs = states[meta.split_layer].to(torch.float64)
            for il in meta.layers:
                pred = torch.from_numpy(maps.predict(il, xs.numpy()))
                errs[il].append(_rel_err(pred, states[il].to(torch.float64), meta.input_norm_eps))
                id_errs[il].append(_rel_err(xs, states[il].to(torch.float64), meta.input_norm_eps))
            if progress:
                progress((w + 1) * cap.per_window, n_windows * cap.per_window)
    finally:
        cap.close()
    return {
        "layers": list(meta.layers),
        "ridge": [float(torch.cat(errs[il]).median()) for il in meta.layers],
        "identity": [float(torch.cat(id_errs[il]).median()) for il in meta.layers],
        "n_tokens": n_windows * cap.per_window,
    }
