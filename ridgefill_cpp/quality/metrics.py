"""The quality metrics of ``ridgefill-gguf eval`` (docs/design.md §9), as plain numpy functions.

Every figure compares a filled run with exact prefill of the same model and prompt. Per-token
losses (NLL, in nats) come from the caller's logits (:func:`nll`); this module defines which tokens
are scored and how the numbers are aggregated:

* **Novel tokens** (:func:`novel_token_mask`): tail tokens whose 8-token run, ending at the token,
  does not occur earlier in the prompt, so they cannot simply be copied.
* **Key tokens** (:func:`key_token_mask`): tokens whose exact loss rises by more than 2 nats when
  the context is cut to the last K tokens. The paper uses K = 4,096 on 128K-context models;
  :func:`scaled_key_cut` scales that to a small model and short prompts and says what it did.
* **ΔNLL** (:func:`delta_nll`, :func:`document_delta`): NLL with fill minus NLL exact, on the
  scored tokens; :func:`perplexity_ratio` turns a mean ΔNLL into ``exp(mean ΔNLL)``.
* **Confidence intervals** (:func:`bootstrap_ci`): percentile bootstrap over *documents* (whole
  documents are resampled, never single tokens, because tokens of one document are correlated).
* **Splice test** (:func:`splice_share`, :func:`splice_share_ci`): the share of the fill's ΔNLL
  that goes away when the filled K, V or recurrent state is replaced with the exact one.
* **Filled-region retrieval** (:func:`retrieval_correct`, :func:`retrieval_accuracy`).

Pure numpy; nothing here prints or touches llama.cpp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "CI",
    "KeyCut",
    "PAPER_KEY_CUT",
    "PAPER_CONTEXT",
    "KEY_THRESHOLD_NATS",
    "NOVEL_RUN",
    "novel_token_mask",
    "key_token_mask",
    "scaled_key_cut",
    "nll",
    "delta_nll",
    "document_delta",
    "perplexity_ratio",
    "perplexity_ratio_ci",
    "bootstrap_ci",
    "splice_share",
    "splice_share_ci",
    "retrieval_correct",
    "retrieval_accuracy",
]

NOVEL_RUN = 8                 # the paper's run length for novel tokens
KEY_THRESHOLD_NATS = 2.0      # the paper's key-token loss rise
PAPER_KEY_CUT = 4096          # the paper's context cut for key tokens ...
PAPER_CONTEXT = 131072        # ... on 128K-context models (Llama-3.1-8B, Qwen3-8B class)


# --------------------------------------------------------------------------------------------
# novel tokens


def novel_token_mask(tokens: Sequence[int] | np.ndarray, start: int, run: int = NOVEL_RUN) -> np.ndarray:
    """Which tail tokens are *novel*: their ``run``-token run does not occur earlier in the prompt.

    ``tokens`` is the whole prompt (token ids, 1-D); ``start`` is the position of the first tail
    token to classify. Returns a bool array of length ``len(tokens) - start`` where element ``k``
    classifies position ``i = start + k``.

    Position ``i`` is novel when the run ``tokens[i-run+1 .. i]`` (ending at, and including, the
    token) does not occur as ``tokens[j-run+1 .. j]`` for any ``j < i`` with ``j-run+1 >= 0``.
    Decisions on the edges:

    * An earlier occurrence may *overlap* the run (only its end must come strictly before ``i``):
      that is exactly what lets an induction/copy mechanism predict token ``i`` from position
      ``j`` (the ``run-1`` tokens before ``i`` matched those before ``j``, and ``tokens[j]`` is
      visible at ``i-1``). So in ``a a a a a a a a a`` the ninth ``a`` is not novel.
    * Positions with fewer than ``run-1`` predecessors (``i < run-1``) are novel: no complete run
      can end before them, so nothing could have been copied by a run match.
    * The whole prompt counts as "earlier", including the prefix before ``start``; runs are
      matched within ``tokens`` only (whether a BOS token belongs to ``tokens`` is the caller's
      choice and only affects the first ``run`` positions).

    Runs are kept in a hash set (tuples of ids), so the cost is O(N * run), i.e. linear in N.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    if run < 1:
        raise ValueError(f"run must be >= 1, got {run}")
    n = len(arr)
    if not 0 <= start <= n:
        raise ValueError(f"start must be in [0, {n}], got {start}")

    ids = arr.tolist()
    out = np.ones(n - start, dtype=bool)
    seen: set[tuple[int, ...]] = set()
    for i in range(run - 1, n):
        key = tuple(ids[i - run + 1:i + 1])
        if i >= start and key in seen:
            out[i - start] = False
        seen.add(key)
    return out


# --------------------------------------------------------------------------------------------
# key tokens


def key_token_mask(nll_full: np.ndarray, nll_cut: np.ndarray, threshold: float = KEY_THRESHOLD_NATS) -> np.ndarray:
    """Which tokens are *key*: exact loss rises by strictly more than ``threshold`` nats when cut.

    ``nll_full[k]`` is the exact model's loss on a token with the whole prompt as context,
    ``nll_cut[k]`` its loss when the context is cut to the last K tokens before it (see
    :func:`scaled_key_cut`). Both are exact-prefill losses, never filled ones. A rise of exactly
    ``threshold`` is not key (the paper says "more than"). A NaN in either array (e.g. a cut loss
    the caller did not compute) makes the token not key, since NaN compares false.
    """
    full = np.asarray(nll_full, dtype=np.float64)
    cut = np.asarray(nll_cut, dtype=np.float64)
    if full.shape != cut.shape:
        raise ValueError(f"nll_full and nll_cut differ in shape: {full.shape} vs {cut.shape}")
    with np.errstate(invalid="ignore"):
        return (cut - full) > threshold


@dataclass(frozen=True)
class KeyCut:
    """The context cut K used to find key tokens, and how it was chosen (for the report)."""

    k: int                # the cut: the cut context is the last k tokens before each scored token
    by_context: float     # paper_cut scaled by the model's context: paper_cut * n_ctx / paper_ctx
    prompt_cap: int       # the cap from the prompt: floor(max_fraction * prompt_len)
    note: str             # one sentence for the report

    def __int__(self) -> int:
        return self.k


def scaled_key_cut(
    n_ctx_model: int,
    prompt_len: int,
    paper_cut: int = PAPER_KEY_CUT,
    paper_ctx: int = PAPER_CONTEXT,
    max_fraction: float = 0.25,
    min_cut: int = 64,
) -> KeyCut:
    """Scale the paper's 4,096-token key-token cut to a model with a shorter context and prompt.

    The paper cuts 128K-context models to the last 4,096 tokens, i.e. 1/32 of the context the
    model was trained to use. The rule here:

    1. keep that fraction of the model's own context: ``paper_cut * n_ctx_model / paper_ctx``
       (SmolLM2-135M, 8K context -> 256; Gemma 3 270M, 32K -> 1,024; a 128K model -> 4,096);
    2. cap it at ``max_fraction`` (1/4) of the prompt, so scored tail tokens lose most of their
       context (the paper's own shortest reported prompts, 16K, are cut to 1/4 as well);
    3. but never below ``min_cut`` tokens (64): a shorter cut would mostly measure dependence on
       the current sentence, not long-range context.

    ``prompt_len`` should be the position of the first scored token (for a short tail, the
    prompt length): that is how much context the earliest scored token has. If the result is not
    well below it (``k >= prompt_len / 2``), key tokens cannot be defined and ValueError is
    raised. The returned :class:`KeyCut` carries ``k`` and a sentence to print in the report.
    """
    if n_ctx_model < 1 or prompt_len < 1 or paper_cut < 1 or paper_ctx < 1:
        raise ValueError("n_ctx_model, prompt_len, paper_cut and paper_ctx must be positive")
    if not 0 < max_fraction <= 1:
        raise ValueError(f"max_fraction must be in (0, 1], got {max_fraction}")
    by_ctx = paper_cut * n_ctx_model / paper_ctx
    cap = int(math.floor(max_fraction * prompt_len))
    k = max(int(min_cut), min(int(math.floor(by_ctx)), cap))
    if 2 * k >= prompt_len:
        raise ValueError(
            f"a key-token cut of {k} tokens is not well below a prompt of {prompt_len} tokens; "
            f"use prompts of at least {2 * k + 1} tokens"
        )
    if k == int(math.floor(by_ctx)):
        why = f"scaled from the paper's {paper_cut} on {paper_ctx}-token contexts to this model's {n_ctx_model}"
    elif k == cap:
        why = (f"capped at {max_fraction:g} of the {prompt_len}-token prompt "
               f"(scaled by context it would be {by_ctx:g})")
    else:
        why = f"raised to the minimum of {min_cut} (scaled by context {by_ctx:g}, prompt cap {cap})"
    note = f"key tokens: exact loss rises > {KEY_THRESHOLD_NATS:g} nats when the context is cut to the last {k} tokens ({why})"
    return KeyCut(k=k, by_context=by_ctx, prompt_cap=cap, note=note)


# --------------------------------------------------------------------------------------------
# ΔNLL


def _pair(a: np.ndarray, b: np.ndarray, names: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"{names} differ in shape: {x.shape} vs {y.shape}")
    return x, y


def nll(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """Per-row next-token loss (nats, float64): ``-log softmax(logits[i])[targets[i]]`` for logits
    ``[n, n_vocab]`` and ``n`` target token ids."""
    x = np.asarray(logits).astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x).sum(axis=1))
    return lse - x[np.arange(len(targets)), np.asarray(targets)]


def delta_nll(nll_fill: np.ndarray, nll_exact: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Per-token ΔNLL = NLL with fill − NLL exact (nats), on the tokens where ``mask`` is True.

    All three arrays are aligned on the same scored tokens; ``mask=None`` keeps every token.
    Returns a 1-D array of the selected tokens' ΔNLL (positive: the fill made the token harder).
    """
    fill, exact = _pair(nll_fill, nll_exact, "nll_fill and nll_exact")
    d = fill - exact
    if mask is None:
        return d.reshape(-1)
    m = np.asarray(mask)
    if m.dtype != bool:
        raise ValueError(f"mask must be boolean, got dtype {m.dtype}")
    if m.shape != d.shape:
        raise ValueError(f"mask shape {m.shape} differs from the losses' {d.shape}")
    return d[m]


def document_delta(nll_fill: np.ndarray, nll_exact: np.ndarray, mask: np.ndarray | None = None) -> tuple[float, int]:
    """One document's ``(mean ΔNLL over the masked tokens, number of masked tokens)``.

    The pair feeds :func:`bootstrap_ci` as ``values`` and ``weights``, which gives the
    token-weighted mean over documents. A document with no masked token gives ``(nan, 0)`` and
    carries no weight there.
    """
    d = delta_nll(nll_fill, nll_exact, mask)
    if d.size == 0:
        return float("nan"), 0
    return float(d.mean()), int(d.size)


def perplexity_ratio(mean_delta: float) -> float:
    """Perplexity with fill / perplexity exact = ``exp(mean ΔNLL)`` (1.0265 means +2.65 %)."""
    return float(np.exp(mean_delta))


# --------------------------------------------------------------------------------------------
# bootstrap


class CI(NamedTuple):
    """A point estimate with a percentile-bootstrap interval; ``n`` documents (or prompts)."""

    estimate: float
    low: float
    high: float
    n: int


_MAX_DRAW = 1 << 22  # indices drawn per chunk (n_boot rows x n columns)


def _resampled(stat: Callable[[np.ndarray], np.ndarray], n: int, n_boot: int, seed: int) -> np.ndarray:
    """``stat(idx)`` over ``n_boot`` resamples; ``idx`` is (rows, n) indices drawn with replacement."""
    rng = np.random.default_rng(seed)
    rows = max(1, _MAX_DRAW // n)
    out = []
    for lo in range(0, n_boot, rows):
        idx = rng.integers(0, n, size=(min(rows, n_boot - lo), n))
        out.append(stat(idx))
    return np.concatenate(out)


def _check_boot(n_boot: int, alpha: float) -> None:
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def _checked_weights(weights, n: int) -> np.ndarray:
    """Per-document weights as a float64 array of length ``n``: finite and non-negative."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != n:
        raise ValueError(f"values and weights differ in length: {n} vs {w.size}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and non-negative")
    return w


def _values_weights(values, weights) -> tuple[np.ndarray, np.ndarray | None]:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if weights is None:
        if not np.all(np.isfinite(v)):
            raise ValueError("values must be finite (give a zero weight to documents with nothing scored)")
        return v, None
    w = _checked_weights(weights, v.size)
    keep = w > 0
    v, w = v[keep], w[keep]
    if not np.all(np.isfinite(v)):
        raise ValueError("values with a positive weight must be finite")
    return v, w


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    weights: Sequence[float] | np.ndarray | None = None,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> CI:
    """Percentile-bootstrap CI of a mean over documents: ``CI(estimate, low, high, n)``.

    ``values`` holds one number per document (e.g. its mean ΔNLL). Resampling draws whole
    documents with replacement, ``n_boot`` times, from ``numpy.random.default_rng(seed)``, so the
    result is deterministic for a seed.

    Without ``weights`` the statistic is the plain mean over documents. With ``weights`` (token
    counts) it is the token-weighted mean ``sum(w*v) / sum(w)`` and every resample is that ratio
    of sums over the drawn documents: the pooled per-token mean, with documents (not tokens) as
    the unit of resampling. Documents of weight 0 (nothing scored; their value may be NaN) are
    dropped first and not counted in ``n``.

    ``estimate`` is the statistic on the full sample (not the bootstrap mean); ``low``/``high`` are
    the ``alpha/2`` and ``1-alpha/2`` quantiles of the resampled statistic. With one document there
    is no interval: ``low`` and ``high`` are NaN. A population of equal values gives a zero-width
    interval.
    """
    _check_boot(n_boot, alpha)
    v, w = _values_weights(values, weights)
    n = v.size
    if n == 0:
        raise ValueError("no documents to bootstrap (all weights zero or no values)")
    if w is None:
        est = float(v.mean())
        stat = lambda idx: v[idx].mean(axis=1)  # noqa: E731
    else:
        vw = v * w
        est = float(vw.sum() / w.sum())
        stat = lambda idx: vw[idx].sum(axis=1) / w[idx].sum(axis=1)  # noqa: E731
    if n == 1:
        return CI(est, float("nan"), float("nan"), 1)
    boots = _resampled(stat, n, n_boot, seed)
    low, high = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return CI(est, float(low), float(high), n)


def perplexity_ratio_ci(delta_ci: CI) -> CI:
    """A CI of mean ΔNLL as a CI of the perplexity ratio ``exp(ΔNLL)``.

    Percentile intervals commute with monotone maps, so this is exact, not an approximation.
    """
    return CI(float(np.exp(delta_ci.estimate)), float(np.exp(delta_ci.low)), float(np.exp(delta_ci.high)), delta_ci.n)


# --------------------------------------------------------------------------------------------
# splice test


def splice_share(delta_fill: float | np.ndarray, delta_spliced: float | np.ndarray) -> float:
    """Share of the fill's ΔNLL that the splice removes: ``1 - mean(Δspliced) / mean(Δfill)``.

    ``delta_fill`` is ΔNLL of the filled run against exact, ``delta_spliced`` ΔNLL of the same run
    with the filled K (or V, or recurrent state) replaced by the exact one, on the same tokens
    (scalars or aligned per-token arrays). 1.0: the splice removes all the error (it lives in what
    was spliced); 0.0: none. Not clipped: below 0 the splice made things worse, above 1 the spliced
    run beats exact. NaN when ``mean(Δfill) <= 0``: there is no error to apportion.
    """
    f, s = _pair(delta_fill, delta_spliced, "delta_fill and delta_spliced")
    if f.size == 0:
        raise ValueError("no tokens")
    mf = float(f.mean())
    if not mf > 0:
        return float("nan")
    return 1.0 - float(s.mean()) / mf


def splice_share_ci(
    delta_fill_docs: Sequence[float] | np.ndarray,
    delta_spliced_docs: Sequence[float] | np.ndarray,
    weights: Sequence[float] | np.ndarray | None = None,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> CI:
    """Splice share over documents with a percentile-bootstrap CI: ``CI(estimate, low, high, n)``.

    Inputs are per-document mean ΔNLL of the filled run and of the spliced run (same tokens), and
    optionally per-document token counts. The share is computed on the pooled means,
    ``1 - Σ w·Δspliced / Σ w·Δfill`` (not as a mean of per-document shares, which blow up on
    documents whose fill error is near zero), and each resample draws documents jointly for both.
    If the pooled fill ΔNLL is not positive in the sample, the estimate is NaN; if it is not
    positive in some resample, the share is undefined there and ``low``/``high`` are NaN (the fill
    error is not distinguishable from zero, so there is nothing to apportion).
    """
    _check_boot(n_boot, alpha)
    f, s = _pair(delta_fill_docs, delta_spliced_docs, "delta_fill_docs and delta_spliced_docs")
    f, s = f.reshape(-1), s.reshape(-1)
    w = np.ones_like(f) if weights is None else _checked_weights(weights, f.size)
    keep = w > 0
    f, s, w = f[keep], s[keep], w[keep]
    if not (np.all(np.isfinite(f)) and np.all(np.isfinite(s))):
        raise ValueError("ΔNLL values with a positive weight must be finite")
    n = f.size
    if n == 0:
        raise ValueError("no documents to bootstrap (all weights zero or no values)")
    fw, sw = f * w, s * w
    den = fw.sum()
    est = 1.0 - sw.sum() / den if den > 0 else float("nan")
    if n == 1:
        return CI(float(est), float("nan"), float("nan"), 1)

    def stat(idx: np.ndarray) -> np.ndarray:
        d = fw[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(d > 0, 1.0 - sw[idx].sum(axis=1) / d, np.nan)

    boots = _resampled(stat, n, n_boot, seed)
    if np.isnan(boots).any():
        return CI(float(est), float("nan"), float("nan"), n)
    low, high = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return CI(float(est), float(low), float(high), n)


# --------------------------------------------------------------------------------------------
# filled-region retrieval


def _normalise(text: str) -> str:
    return " ".join(str(text).casefold().split())


def retrieval_correct(predictions: Sequence[str], answers: Sequence[str], match: str = "contains") -> np.ndarray:
    """Per prompt, whether the generated text gives the fact placed in the filled region.

    Case and runs of whitespace are ignored. ``match="contains"`` (default, as RULER's string
    match): the answer occurs in the prediction; ``match="exact"``: they are equal.
    """
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} answers")
    if match not in ("contains", "exact"):
        raise ValueError(f"match must be 'contains' or 'exact', got {match!r}")
    out = np.zeros(len(answers), dtype=bool)
    for i, (p, a) in enumerate(zip(predictions, answers)):
        pn, an = _normalise(p), _normalise(a)
        if not an:
            raise ValueError(f"answer {i} is empty")
        out[i] = (an in pn) if match == "contains" else (an == pn)
    return out


def retrieval_accuracy(
    predictions: Sequence[str],
    answers: Sequence[str],
    match: str = "contains",
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> CI:
    """Retrieval accuracy (fraction of prompts correct) with a bootstrap CI over prompts.

    Caveat of the percentile bootstrap: when every prompt is right (or every one wrong) the
    interval has zero width; it does not mean the accuracy is known exactly — use more prompts.
    """
    return bootstrap_ci(retrieval_correct(predictions, answers, match).astype(np.float64),
                        n_boot=n_boot, alpha=alpha, seed=seed)
