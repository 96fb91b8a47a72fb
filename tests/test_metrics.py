"""Metric definitions of ``ridgefill-gguf eval``: novel/key tokens, ΔNLL, bootstrap CIs, splice share,
retrieval accuracy. Hand-made inputs with known answers; pure numpy, well under a second."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ridgefill_cpp.quality.metrics import (
    CI,
    bootstrap_ci,
    delta_nll,
    document_delta,
    key_token_mask,
    novel_token_mask,
    perplexity_ratio,
    perplexity_ratio_ci,
    retrieval_accuracy,
    retrieval_correct,
    scaled_key_cut,
    splice_share,
    splice_share_ci,
)


# ---------------------------------------------------------------------------------------------
# novel tokens


def _novel_brute(tokens, start, run=8):
    """The definition, O(N^2): run ending at i occurs ending at some j < i (overlap allowed)."""
    t = list(tokens)
    out = []
    for i in range(start, len(t)):
        if i < run - 1:
            out.append(True)
            continue
        r = t[i - run + 1:i + 1]
        out.append(not any(t[j - run + 1:j + 1] == r for j in range(run - 1, i)))
    return np.array(out, dtype=bool)


def test_repeated_run_is_not_novel():
    first = list(range(100, 120))
    toks = first + first  # a 20-token passage, then the same passage again
    m = novel_token_mask(toks, 0)
    assert m.shape == (40,)
    assert m[:20].all()                       # first occurrence: everything novel
    assert m[20:27].all()                     # runs crossing the seam (…,119,100,…) never occurred
    assert not m[27:].any()                   # from the 8th repeated token on, the run is a copy


def test_changed_token_makes_following_runs_novel_again():
    first = list(range(100, 140))
    second = list(first)
    second[10] = 999                          # one token changed inside the copy
    toks = first + second
    m = novel_token_mask(toks, 40)
    assert m.shape == (40,)
    expected = np.zeros(40, dtype=bool)
    expected[:7] = True                       # seam
    expected[10:18] = True                    # the 8 runs that contain the changed token
    np.testing.assert_array_equal(m, expected)


def test_positions_without_a_full_run_are_novel():
    toks = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7]
    m = novel_token_mask(toks, 0)
    assert m[:7].all()                        # fewer than 8 tokens to form a run: novel
    assert m[7] and m[8] and m[9]             # the three distinct 8-runs of a period-3 sequence
    assert not m[10:].any()                   # ... then they repeat


def test_earlier_occurrence_may_overlap():
    m = novel_token_mask([3] * 12, 0)
    np.testing.assert_array_equal(m, [True] * 8 + [False] * 4)


def test_tail_start_offset_aligns_and_prefix_counts_as_earlier():
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 4, size=300)       # tiny vocabulary: many repeats, many novel runs
    full = novel_token_mask(toks, 0)
    for start in (0, 3, 7, 8, 150, 299, 300):
        tail = novel_token_mask(toks, start)
        assert tail.shape == (300 - start,)
        np.testing.assert_array_equal(tail, full[start:])
    # the prefix before `start` is "earlier": a tail that copies the prefix is not novel
    base = list(range(50))
    m = novel_token_mask(base + base[:20], 50)
    assert m[:7].all() and not m[7:].any()


@pytest.mark.parametrize("run", [1, 2, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_definition(run, seed):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 3, size=120)
    start = int(rng.integers(0, 120))
    np.testing.assert_array_equal(novel_token_mask(toks, start, run=run), _novel_brute(toks, start, run))


def test_run_of_one_is_first_occurrence():
    np.testing.assert_array_equal(novel_token_mask([1, 2, 1, 3, 2], 0, run=1), [True, True, False, True, False])


def test_novel_bad_input():
    with pytest.raises(ValueError, match="1-D"):
        novel_token_mask(np.zeros((2, 3), dtype=int), 0)
    with pytest.raises(ValueError, match="start"):
        novel_token_mask([1, 2, 3], 4)
    with pytest.raises(ValueError, match="start"):
        novel_token_mask([1, 2, 3], -1)
    with pytest.raises(ValueError, match="run"):
        novel_token_mask([1, 2, 3], 0, run=0)
    with pytest.raises(ValueError, match="integer"):
        novel_token_mask([1.5, 2.0], 0)
    assert novel_token_mask([1, 2, 3], 3).shape == (0,)


# ---------------------------------------------------------------------------------------------
# key tokens


def test_key_threshold_is_strict():
    full = np.array([1.0, 1.0, 1.0, 0.5, 3.0, 1.0])
    cut = np.array([3.0, 3.25, 2.5, 0.5, 1.0, np.nan])  # +2 exactly, +2.25, +1.5, 0, -2, NaN
    np.testing.assert_array_equal(key_token_mask(full, cut), [False, True, False, False, False, False])
    np.testing.assert_array_equal(key_token_mask(full, cut, threshold=1.0), [True, True, True, False, False, False])
    with pytest.raises(ValueError, match="shape"):
        key_token_mask(full, cut[:3])


@pytest.mark.parametrize(
    "n_ctx, prompt_len, k",
    [
        (131072, 131072, 4096),   # the paper's own setting is unchanged
        (131072, 16384, 4096),    # paper's shortest prompts: the cap (1/4) equals the cut
        (8192, 8192, 256),        # SmolLM2-135M (8K context): 1/32 of the context
        (32768, 8192, 1024),      # Gemma 3 270M (32K context) at an 8K prompt
        (32768, 2048, 512),       # ... at a 2K prompt: capped at a quarter of the prompt
        (2048, 1000, 64),         # 2048/32 = 64
        (1024, 4096, 64),         # 1024/32 = 32 -> raised to the 64-token minimum
        (8192, 200, 64),          # cap 50 -> raised to the minimum, still < prompt/2
    ],
)
def test_scaled_key_cut_examples(n_ctx, prompt_len, k):
    cut = scaled_key_cut(n_ctx, prompt_len)
    assert cut.k == int(cut) == k
    assert 2 * cut.k < prompt_len
    assert str(k) in cut.note


def test_scaled_key_cut_explains_itself_and_refuses_short_prompts():
    assert "scaled" in scaled_key_cut(8192, 8192).note
    assert "capped" in scaled_key_cut(32768, 2048).note
    assert "minimum" in scaled_key_cut(1024, 4096).note
    with pytest.raises(ValueError, match="not well below"):
        scaled_key_cut(8192, 128)            # 64-token minimum is half the prompt
    with pytest.raises(ValueError):
        scaled_key_cut(0, 1000)


# ---------------------------------------------------------------------------------------------
# ΔNLL


def test_delta_nll_and_document_mean():
    fill = np.array([2.0, 3.0, 1.0, 4.0])
    exact = np.array([1.0, 3.5, 1.0, 2.0])
    mask = np.array([True, True, False, True])
    np.testing.assert_allclose(delta_nll(fill, exact, mask), [1.0, -0.5, 2.0])
    np.testing.assert_allclose(delta_nll(fill, exact), [1.0, -0.5, 0.0, 2.0])
    mean, n = document_delta(fill, exact, mask)
    assert n == 3 and mean == pytest.approx(2.5 / 3)
    mean, n = document_delta(fill, exact, np.zeros(4, dtype=bool))
    assert n == 0 and math.isnan(mean)
    assert perplexity_ratio(0.0) == 1.0
    assert perplexity_ratio(math.log(1.0265)) == pytest.approx(1.0265)
    with pytest.raises(ValueError, match="boolean"):
        delta_nll(fill, exact, np.array([1, 0, 1, 0]))   # an index array is not a mask
    with pytest.raises(ValueError, match="shape"):
        delta_nll(fill, exact[:3])


# ---------------------------------------------------------------------------------------------
# bootstrap


def test_constant_population_has_zero_width_ci():
    ci = bootstrap_ci([0.3] * 25)
    assert isinstance(ci, CI)
    assert ci == pytest.approx((0.3, 0.3, 0.3, 25))
    w = bootstrap_ci([0.3] * 25, weights=np.arange(1, 26))
    assert (w.low, w.high) == pytest.approx((0.3, 0.3))


def test_deterministic_for_a_seed():
    v = np.random.default_rng(5).normal(size=40)
    assert bootstrap_ci(v, seed=7) == bootstrap_ci(v, seed=7)
    assert bootstrap_ci(v, seed=7) != bootstrap_ci(v, seed=8)
    assert bootstrap_ci(v, seed=7).estimate == pytest.approx(v.mean())   # estimate: the full sample


def test_ci_covers_the_true_mean_about_95_percent():
    # 200 synthetic studies of 30 documents each (mildly skewed, like per-document ΔNLL: gamma, mean 1,
    # sd 0.5): a 95 % percentile bootstrap covers the true mean ~93 % of the time here; a wrong interval
    # (the spread of the documents, or of a single resample) covers ~100 % or far less.
    true_mean, sd, n = 1.0, 0.5, 30
    hits = 0
    widths = []
    for seed in range(200):
        sample = np.random.default_rng(1000 + seed).gamma(4.0, 0.25, size=n)
        ci = bootstrap_ci(sample, n_boot=400, seed=seed)
        hits += ci.low <= true_mean <= ci.high
        widths.append(ci.high - ci.low)
    assert 0.88 <= hits / 200 <= 0.99
    # the width is about 2 * 1.96 * sd / sqrt(n) = 0.36
    assert 0.28 < np.mean(widths) < 0.42


def test_weights_give_ratio_of_sums():
    values, weights = np.array([0.0, 1.0]), np.array([1.0, 3.0])
    ci = bootstrap_ci(values, weights=weights, n_boot=4000, alpha=0.6)
    assert ci.estimate == pytest.approx(0.75)             # sum(w*v)/sum(w), not mean(v) = 0.5
    # resamples {0,0}: 0, {1,1}: 1, mixed (p = 1/2): 3/(1+3) = 0.75 — the 30/70 % quantiles both land
    # on the mixed value; a mean of per-document values would put them at 0.5
    assert ci.low == pytest.approx(0.75) and ci.high == pytest.approx(0.75)
    assert ci.n == 2


def test_zero_weight_documents_are_dropped():
    ci = bootstrap_ci([1.0, float("nan"), 3.0], weights=[1, 0, 1], n_boot=200)
    assert ci.n == 2 and ci.estimate == pytest.approx(2.0)
    assert 1.0 <= ci.low <= ci.high <= 3.0


def test_bootstrap_edge_cases():
    one = bootstrap_ci([0.7])
    assert one.estimate == 0.7 and one.n == 1 and math.isnan(one.low) and math.isnan(one.high)
    with pytest.raises(ValueError, match="no documents"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="no documents"):
        bootstrap_ci([1.0, 2.0], weights=[0, 0])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="non-negative"):
        bootstrap_ci([1.0, 2.0], weights=[1, -1])
    with pytest.raises(ValueError, match="length"):
        bootstrap_ci([1.0, 2.0], weights=[1])
    with pytest.raises(ValueError, match="alpha"):
        bootstrap_ci([1.0, 2.0], alpha=0)


def test_perplexity_ratio_ci_is_exp_of_delta_ci():
    ci = CI(0.02, -0.001, 0.05, 10)
    p = perplexity_ratio_ci(ci)
    assert p == pytest.approx((math.exp(0.02), math.exp(-0.001), math.exp(0.05), 10))


# ---------------------------------------------------------------------------------------------
# splice test


def test_splice_share_extremes():
    d_fill = np.array([0.5, 1.5, 1.0])
    assert splice_share(d_fill, np.zeros(3)) == pytest.approx(1.0)   # exact splice removes all
    assert splice_share(d_fill, d_fill) == pytest.approx(0.0)        # no-op splice removes nothing
    assert splice_share(d_fill, d_fill / 2) == pytest.approx(0.5)
    assert splice_share(1.0, 1.5) == pytest.approx(-0.5)             # worse: not clipped
    assert math.isnan(splice_share(np.array([0.1, -0.2]), np.zeros(2)))  # no error to apportion


def test_splice_share_ci():
    rng = np.random.default_rng(3)
    d_fill = rng.uniform(0.2, 1.0, size=20)
    tokens = rng.integers(10, 200, size=20)
    exact = splice_share_ci(d_fill, np.zeros(20), weights=tokens, n_boot=300)
    assert exact == pytest.approx((1.0, 1.0, 1.0, 20))
    noop = splice_share_ci(d_fill, d_fill, weights=tokens, n_boot=300)
    assert noop == pytest.approx((0.0, 0.0, 0.0, 20))
    half = splice_share_ci(d_fill, d_fill * rng.uniform(0.3, 0.7, size=20), weights=tokens, n_boot=300, seed=1)
    assert half.low < half.estimate < half.high and 0.3 < half.low and half.high < 0.7
    # pooled, not a mean of per-document shares: a document with tiny fill error must not dominate
    pooled = splice_share_ci([1.0, 0.001], [0.0, 0.01], n_boot=50)
    assert pooled.estimate == pytest.approx(1 - 0.01 / 1.001)
    # fill error that can be zero or negative in a resample: no interval
    und = splice_share_ci([0.5, -0.6, 0.2], [0.0, 0.0, 0.0], n_boot=200)
    assert math.isnan(und.low) and math.isnan(und.high)


# ---------------------------------------------------------------------------------------------
# retrieval


def test_retrieval_accuracy():
    preds = ["The code is 4721.", "  the CODE is\n 88 ", "I don't know", "4721"]
    answers = ["4721", "code is 88", "1234", "4721"]
    np.testing.assert_array_equal(retrieval_correct(preds, answers), [True, True, False, True])
    np.testing.assert_array_equal(retrieval_correct(preds, answers, match="exact"), [False, False, False, True])
    acc = retrieval_accuracy(preds, answers, n_boot=500)
    assert acc.estimate == 0.75 and acc.n == 4 and 0.0 <= acc.low <= 0.75 <= acc.high <= 1.0
    with pytest.raises(ValueError, match="predictions"):
        retrieval_correct(preds, answers[:2])
    with pytest.raises(ValueError, match="match"):
        retrieval_correct(preds, answers, match="fuzzy")
