"""nnrand.stats on cases small enough to count by hand, plus properties of the bootstrap and the
permutation test. Everything is seeded; float results are compared exactly where the arithmetic is a
ratio of small integers (exact in float64 up to the final division's rounding, hence the 1e-15
relative tolerance of pytest.approx defaults being replaced by exact fractions where possible)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nnrand import metrics, stats

# 3 members x 4 examples; labels 0 1 2 3.
#   example:   0  1  2  3
#   member 0:  0  1  2  3
#   member 1:  0  1  2  0     differs from member 0 on example 3                 -> 1/4
#   member 2:  1  1  0  3     differs from 0 on examples 0, 2; from 1 on 0, 2, 3 -> 2/4, 3/4
PREDS = np.array([[0, 1, 2, 3], [0, 1, 2, 0], [1, 1, 0, 3]])
LABELS = np.array([0, 1, 2, 3])


def one_hot_logits(preds, classes=4, hot=4.0):
    p = np.asarray(preds)
    z = np.zeros(p.shape + (classes,))
    np.put_along_axis(z, p[..., None], hot, axis=-1)
    return z


def test_disagreement_matrix_by_hand():
    d = stats.disagreement_matrix(PREDS)
    expect = np.array([[0, 1, 2], [1, 0, 3], [2, 3, 0]]) / 4
    assert np.array_equal(d, expect)
    assert stats.pair_mean(d) == pytest.approx((1 + 2 + 3) / 12, rel=1e-15)   # = 0.5
    # agrees with the per-example route of nnrand.metrics (mean over examples of pairs that differ)
    assert stats.pair_mean(d) == pytest.approx(metrics.pairwise_disagreement(PREDS), rel=1e-15)
    # examples of true class 2 (only example 2): members 0,1 say 2, member 2 says 0 -> pairs (0,2), (1,2)
    d2 = stats.disagreement_matrix(PREDS, LABELS == 2)
    assert np.array_equal(d2, np.array([[0, 0, 1], [0, 0, 1], [1, 1, 0]]))
    assert stats.pair_mean(d2) == pytest.approx(2 / 3, rel=1e-15)
    assert np.isnan(stats.disagreement_matrix(PREDS, np.zeros(4, bool))).all()


def test_disagreement_is_churn_not_agreement():
    same = np.repeat(PREDS[:1], 3, axis=0)
    assert stats.pair_mean(stats.disagreement_matrix(same)) == 0.0
    opposite = np.array([[0, 0, 0, 0], [1, 1, 1, 1]])
    assert stats.pair_mean(stats.disagreement_matrix(opposite)) == 1.0


def test_pair_mean_with_repeated_members():
    d = stats.disagreement_matrix(PREDS)
    # resample (0, 0, 2): positions (0,1) are member 0 with itself (left out); (0,2) and (1,2) are both
    # the pair (0, 2) -> 2/4
    assert stats.pair_mean(d, np.array([0, 0, 2])) == 0.5
    # (1, 2, 2): pairs (1,2) twice, (2,2) left out -> 3/4
    assert stats.pair_mean(d, np.array([1, 2, 2])) == 0.75
    assert math.isnan(stats.pair_mean(d, np.array([1, 1, 1])))


def test_logit_correlation_and_ensemble_gain_by_hand():
    z = np.array([[[1.0, 2.0], [3.0, 4.0]],        # flattened 1 2 3 4
                  [[2.0, 4.0], [6.0, 8.0]],        # 2 x member 0: correlation 1
                  [[4.0, 3.0], [2.0, 1.0]]])       # reversed: correlation -1
    c = stats.logit_corr_matrix(z)
    assert c[0, 1] == pytest.approx(1.0, abs=1e-15) and c[0, 2] == pytest.approx(-1.0, abs=1e-15)
    assert stats.pair_mean(c) == pytest.approx((1 - 1 - 1) / 3, abs=1e-15)
    assert stats.logit_corr_matrix(np.ones((2, 2, 2)))[0, 1] == 1.0     # equal constants: identical

    # Two classes, 3 examples, labels 0 0 1. Member a: right on examples 0, 1 (2/3); member b: right on
    # 0 and 2 (2/3). Example 1: a says 0 with p=0.9, b says 1 with p=0.6 -> mean p(0)=0.65 -> ensemble right.
    # Example 2: a says 0 with p=0.9 (wrong), b says 1 with p=0.6 -> mean p(1)=0.35 -> ensemble wrong.
    # Ensemble: right on 0, 1 -> 2/3; gain = 2/3 - 2/3 = 0. Make b surer on example 2 (p(1)=0.95):
    # mean p(1) = 0.525 -> ensemble right on all 3: gain 1 - 2/3 = 1/3.
    p_a = np.array([[0.9, 0.1], [0.9, 0.1], [0.9, 0.1]])
    p_b = np.array([[0.9, 0.1], [0.4, 0.6], [0.05, 0.95]])
    logits = np.log(np.stack([p_a, p_b]))
    g = stats.ensemble2_gain_matrix(logits, np.array([0, 0, 1]))
    assert g[0, 1] == pytest.approx(1 / 3, abs=2.0**-52)   # 1 - 2/3: the 2/3's rounding only (Sterbenz)
    same = np.stack([p_a, p_a])
    assert stats.ensemble2_gain_matrix(np.log(same), np.array([0, 0, 1]))[0, 1] == 0.0


def test_l2_matrix_and_growth():
    w = [np.zeros(2), np.array([3.0, 4.0]), np.array([0.0, 1.0])]
    m = stats.l2_matrix(w)
    assert (m[0, 1], m[0, 2], m[1, 2]) == (5.0, 1.0, math.sqrt(9 + 9))
    rows = stats.l2_growth([(0, m / 2, 1.0), (1, m, 2.0)])
    assert rows[0]["l2"] == pytest.approx((5 + 1 + math.sqrt(18)) / 6, rel=1e-15)
    assert rows[1]["growth"] == pytest.approx(2.0, rel=1e-15) and rows[1]["norm"] == 2.0
    # members one ULP apart in one float32 weight of size ~30: the distance is that ULP, 2^-19 (a Gram-matrix
    # route would lose it to cancellation in ||a||^2 ~ 900)
    a = np.array([30.0, 1.0], np.float32)
    b = a.copy()
    b[0] = np.nextafter(a[0], np.float32(np.inf))
    assert stats.l2_matrix([a, b])[0, 1] == 2.0 ** -19
    same = stats.l2_growth([(0, np.zeros((3, 3)), 1.0), (1, m, 1.0)])
    assert same[0]["l2"] == 0.0 and math.isnan(same[1]["growth"])   # identical at first: no ratio


def test_config_stats_by_hand():
    s = stats.config_stats(one_hot_logits(PREDS), LABELS, np.array([0, 0, 1, 1]), n_boot=200)
    # accuracies 4/4, 3/4, 2/4 -> mean 0.75, SD 0.25
    assert s["accuracy_mean"]["value"] == pytest.approx(0.75, rel=1e-15)
    assert s["accuracy_sd"]["value"] == 0.25   # quarters: every step of the SD is exact
    assert s["disagreement"]["value"] == pytest.approx(0.5, rel=1e-15)
    assert s["per_class"][2]["value"] == pytest.approx(2 / 3, rel=1e-15)
    assert s["per_class"][1]["value"] == 0.0                            # example 1: all say 1
    # majority = examples 0, 1: pairs differ on example 0 only for (0,2), (1,2) -> (0 + 1/2 + 1/2)/3
    assert s["groups"]["majority"]["value"] == pytest.approx(1 / 3, rel=1e-15)
    # minority = examples 2, 3: (0,1) 1/2, (0,2) 1/2, (1,2) 2/2 -> 2/3
    assert s["groups"]["minority"]["value"] == pytest.approx(2 / 3, rel=1e-15)
    assert s["bootstrap"]["unit"] == "members"


# --------------------------------------------------------------------------------------------------
# Properties of intervals and tests


def _all_intervals(s):
    yield from (s[k] for k in ("accuracy_mean", "accuracy_sd", "cross_entropy_sd", "disagreement", "logit_corr",
                               "ensemble2_gain"))
    yield from s["per_class"]
    yield from s["groups"].values()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_intervals_contain_the_point_and_are_reproducible(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(6, 40, 5))
    labels = rng.integers(0, 5, 40)
    groups = (np.arange(40) % 4 == 0).astype(int)
    a = stats.config_stats(logits, labels, groups, n_boot=300, seed=7)
    b = stats.config_stats(logits, labels, groups, n_boot=300, seed=7)
    assert a == b                                                       # seeded: bit for bit
    c = stats.config_stats(logits, labels, groups, n_boot=300, seed=8)
    assert c["disagreement"]["lo"] != a["disagreement"]["lo"] or c["disagreement"]["hi"] != a["disagreement"]["hi"]
    for ci in _all_intervals(a):
        if math.isfinite(ci["value"]):
            assert ci["lo"] <= ci["value"] <= ci["hi"], ci


def test_identical_members_have_zero_disagreement_and_a_zero_width_interval():
    logits = np.repeat(np.random.default_rng(3).normal(size=(1, 30, 4)), 5, axis=0)
    s = stats.config_stats(logits, np.zeros(30, int), n_boot=200)
    assert (s["disagreement"]["value"], s["disagreement"]["lo"], s["disagreement"]["hi"]) == (0.0, 0.0, 0.0)
    assert s["accuracy_sd"]["value"] == 0.0 and s["ensemble2_gain"]["value"] == 0.0
    assert s["logit_corr"]["value"] == pytest.approx(1.0, abs=64 * 2.0**-53)   # a few tens of roundings


def test_interval_extends_to_a_point_outside():
    ci = stats.interval(5.0, [1.0, 2.0, 3.0])
    assert ci["extended"] and ci["hi"] == 5.0 and ci["lo"] <= 2.0
    assert not stats.interval(2.0, [1.0, 2.0, 3.0])["extended"]


def test_permutation_test_exact_enumeration_by_hand():
    # values a = (0, 0), b = (1, 1); statistic mean(a) - mean(b) = -1. Of the C(4,2) = 6 splits, only the
    # observed one and its mirror reach |stat| = 1 -> p = 2/6.
    v = np.array([0.0, 0.0, 1.0, 1.0])
    t = stats.permutation_test(lambda a, b: v[a].mean(axis=1) - v[b].mean(axis=1), 2, 2)
    assert t["exact"] and t["splits"] == 6 and t["stat"] == -1.0
    assert t["p_value"] == pytest.approx(2 / 6, rel=1e-15) and t["min_p"] == 1 / 6   # one division
    a, b, exact = stats.splits(2, 2)
    assert exact and a.tolist()[0] == [0, 1] and b.tolist()[0] == [2, 3]
    assert sorted(map(sorted, np.concatenate([a, b], axis=1).tolist())) == [[0, 1, 2, 3]] * 6


def _groups_of_members(rng, m, n, flip):
    """m members predicting ``labels`` except a random ``flip`` fraction of examples each."""
    labels = rng.integers(0, 10, n)
    preds = np.where(rng.random((m, n)) < flip, rng.integers(0, 10, (m, n)), labels[None])
    return one_hot_logits(preds, 10), labels


def test_holm_adjustment_by_hand():
    """Holm's step-down by hand: sorted p (0.01, 0.02, 0.03, 0.5) times (4, 3, 2, 1) = (0.04, 0.06, 0.06,
    0.5), already non-decreasing; a later smaller product is raised to the running maximum; NaN stays NaN
    and is not counted; products above 1 are capped."""
    got = stats.holm([0.03, 0.5, 0.01, 0.02])
    assert np.allclose(got, [0.06, 0.5, 0.04, 0.06])
    got = stats.holm([0.04, 0.041, np.nan])       # m = 2: 0.08, then max(0.08, 0.041) = 0.08
    assert np.allclose(got[:2], [0.08, 0.08]) and np.isnan(got[2])
    assert np.allclose(stats.holm([0.6, 0.7]), [1.0, 1.0])
    assert stats.holm([]).shape == (0,)


def test_compare_identical_groups_gives_a_large_p_value():
    rng = np.random.default_rng(0)
    logits, labels = _groups_of_members(rng, 6, 200, 0.2)
    c = stats.compare_configs(logits, logits.copy(), labels, n_boot=300, n_perm=2000)
    assert c["disagreement"]["diff"]["value"] == 0.0
    assert c["disagreement"]["p_value"] > 0.5 and c["accuracy_sd"]["p_value"] > 0.5
    d = c["disagreement"]["diff"]
    assert d["lo"] <= 0.0 <= d["hi"]


def test_compare_shifted_groups_gives_a_small_p_value_and_is_reproducible():
    rng = np.random.default_rng(1)
    quiet, labels = _groups_of_members(rng, 8, 300, 0.02)
    noisy = one_hot_logits(np.where(rng.random((8, 300)) < 0.4, rng.integers(0, 10, (8, 300)), labels[None]), 10)
    c = stats.compare_configs(noisy, quiet, labels, n_boot=300, n_perm=2000)
    # C(16, 8) = 12870 splits > 2000: random splits; the observed split is the most extreme possible
    assert not c["disagreement"]["exact"]
    assert c["disagreement"]["p_value"] == 1 / 2001   # (0 + 1) / (2000 + 1): one division
    assert c["disagreement"]["diff"]["lo"] > 0.2                     # ~0.36 vs ~0.04 disagreement
    assert c == stats.compare_configs(noisy, quiet, labels, n_boot=300, n_perm=2000)


def test_compare_members_by_hand():
    # SDs: a = (0, 2) -> sqrt(2), b = (1, 1) -> 0
    c = stats.compare_members([0.0, 2.0], [1.0, 1.0], n_boot=100)
    assert c["a"] == pytest.approx(math.sqrt(2), rel=1e-15) and c["b"] == 0.0
    assert c["diff"]["value"] == pytest.approx(math.sqrt(2), rel=1e-15)
    # splits of (0, 2, 1, 1) into pairs: {0,2}|{1,1} -> +sqrt2, {1,1}|{0,2} -> -sqrt2, and four splits
    # of one of 0/2 with a 1: SD 1/sqrt2 each side -> 0. Two of six reach |sqrt2|.
    assert c["exact"] and c["p_value"] == pytest.approx(2 / 6, rel=1e-15)


def test_compare_needs_pairs_and_equal_test_sets():
    z = np.zeros((2, 5, 3))
    with pytest.raises(ValueError, match=">= 2 members"):
        stats.compare_configs(z[:1], z, np.zeros(5, int))
    with pytest.raises(ValueError, match="test sets differ"):
        stats.compare_configs(z, np.zeros((2, 6, 3)), np.zeros(5, int))


def test_pair_interval_bounds_by_enumeration_of_three_members():
    """The bootstrap of 3 members can be enumerated: 27 equally likely resamples (i, j, k). Their pair
    means over distinct members are: one value for the 3 resamples of a single member (no pair: dropped),
    the pair's value for the 18 resamples of two distinct members (each pair 6 times: the pairs of
    a multiset {a, a, b} are (a, b) twice and (a, a) left out), the mean of all three pairs for the 6
    permutations. With pair values 0.1, 0.2, 0.6 the 24 kept values are 0.1 x6, 0.2 x6, 0.6 x6, 0.3 x6,
    so the 2.5% and 97.5% quantiles of enough resamples are 0.1 and 0.6, and the interval has width."""
    mat = np.array([[0, 0.1, 0.2], [0.1, 0, 0.6], [0.2, 0.6, 0]])
    ci = stats.pair_ci(mat, n_boot=20000, seed=3)
    assert ci["value"] == pytest.approx(0.3, rel=1e-15)          # (0.1 + 0.2 + 0.6) / 3: two roundings
    assert (ci["lo"], ci["hi"]) == (pytest.approx(0.1, rel=1e-15), pytest.approx(0.6, rel=1e-15))
    idx = np.array([[0, 0, 1], [0, 1, 2], [2, 2, 2]])
    assert np.allclose(stats.pair_means(mat, idx)[:2], [0.1, 0.3], rtol=1e-15) and math.isnan(stats.pair_means(mat, idx)[2])


def test_two_members_give_no_interval():
    """With 2 members every resample with a pair is that pair: no interval (NaN bounds), the point kept;
    a comparison of 2 against 2 keeps its permutation p-value but gives no interval of the difference."""
    mat = np.array([[0, 0.4], [0.4, 0]])
    ci = stats.pair_ci(mat)
    assert ci["value"] == 0.4 and math.isnan(ci["lo"]) and math.isnan(ci["hi"])
    sd = stats.member_ci([0.5, 0.7])
    assert sd["value"] == pytest.approx(np.std([0.5, 0.7], ddof=1), rel=1e-15) and math.isnan(sd["lo"])
    pooled = np.array([[0, .1, .5, .5], [.1, 0, .5, .5], [.5, .5, 0, .4], [.5, .5, .4, 0]])
    c = stats.compare_pairwise(pooled, 2, 2)
    assert c["diff"]["value"] == pytest.approx(-0.3, rel=1e-15) and math.isnan(c["diff"]["lo"])
    assert c["splits"] == 6 and 0 < c["p_value"] <= 1
    three = stats.compare_pairwise(np.pad(pooled, ((0, 2), (0, 2)), constant_values=0.3), 3, 3)
    assert math.isfinite(three["diff"]["lo"]) and math.isfinite(three["diff"]["hi"])
