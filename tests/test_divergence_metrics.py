"""Divergence metrics against cases computed by hand: all agree, all disagree, two members, ties.

Tolerances, with u = 2^-53 (float64 round to nearest): a result that is one rounded operation on exact
values is compared with ``==``; ratios of small integers and means of a few exact values take at most a
handful of roundings (rel 1e-15, about 9u); a correlation, a log-softmax or a standard deviation of a few
values, a few tens (rel 1e-14, about 90u, or a bound stated beside the check)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nnrand import metrics


def onehot_logits(preds, classes=4, scale=5.0) -> np.ndarray:
    """(M, N, C) logits whose argmax is ``preds`` (M, N)."""
    p = np.asarray(preds)
    z = np.zeros(p.shape + (classes,), dtype=np.float32)
    np.put_along_axis(z, p[..., None], scale, axis=-1)
    return z


# --------------------------------------------------------------------------------------------------
# Disagreement


def test_all_agree():
    preds = np.array([[0, 1, 2, 3]] * 3)
    assert not metrics.not_all_equal(preds).any()
    assert metrics.pairwise_disagreement(preds) == 0.0
    assert metrics.example_disagreement(preds).tolist() == [0, 0, 0, 0]
    logits = onehot_logits(preds)
    assert metrics.ensemble2_gain(logits, np.array([0, 1, 2, 0])) == 0.0
    assert metrics.logit_correlation(logits) == 1.0


def test_all_disagree():
    preds = np.array([[0, 1], [1, 2], [2, 0]])   # every pair differs on both examples
    assert metrics.not_all_equal(preds).tolist() == [True, True]
    assert metrics.pairwise_disagreement(preds) == 1.0
    assert metrics.example_disagreement(preds).tolist() == [1.0, 1.0]


def test_two_members():
    preds = np.array([[0, 1, 2, 3], [0, 1, 3, 3]])
    assert metrics.not_all_equal(preds).tolist() == [False, False, True, False]
    assert metrics.pairwise_disagreement(preds) == 0.25
    assert metrics.pairwise_disagreement(preds, mask=np.array([0, 0, 1, 1], bool)) == 0.5


def test_three_members_mixed():
    # example 0: all 0; example 1: 0,1,1 (2 of 3 pairs differ); example 2: 0,0,1 (2 of 3)
    preds = np.array([[0, 0, 0], [0, 1, 0], [0, 1, 1]])
    assert metrics.example_disagreement(preds) == pytest.approx([0, 2 / 3, 2 / 3], abs=0)
    assert metrics.pairwise_disagreement(preds) == pytest.approx(4 / 9, rel=1e-15)
    assert metrics.not_all_equal(preds).mean() == pytest.approx(2 / 3, rel=1e-15)


def test_single_member_has_no_pairs():
    preds = np.array([[0, 1]])
    assert math.isnan(metrics.pairwise_disagreement(preds))
    assert metrics.example_disagreement(preds).tolist() == [0, 0]
    assert math.isnan(metrics.logit_correlation(onehot_logits(preds)))
    assert math.isnan(metrics.ensemble2_gain(onehot_logits(preds), np.array([0, 1])))


def test_ties_in_logits_go_to_the_lowest_class():
    # member 0 ties classes 0 and 1, member 1 ties 0 and 2: both predict class 0, so they agree
    logits = np.array([[[1.0, 1.0, 0.0]], [[2.0, -1.0, 2.0]]])
    assert metrics.predictions(logits).tolist() == [[0], [0]]
    assert metrics.pairwise_disagreement(metrics.predictions(logits)) == 0.0
    assert not metrics.not_all_equal(metrics.predictions(logits)).any()
    # a tie in an ensemble's mean probabilities goes to the lowest class as well
    tie = np.log(np.array([[[0.5, 0.5]], [[0.5, 0.5]]]))
    assert metrics.ensemble2_gain(tie, np.array([1])) == 0.0


# --------------------------------------------------------------------------------------------------
# Correlation, ensembles, losses


def test_logit_correlation_by_hand():
    a = np.array([[[1.0, 2.0, 3.0]]])
    b, c = 2 * a, a[..., ::-1]
    logits = np.concatenate([a, b, c])          # pairs: (a,b) = 1, (a,c) = -1, (b,c) = -1
    assert metrics.logit_correlation(logits) == pytest.approx(-1 / 3, rel=1e-14)


def test_ensemble_of_two_gains_by_hand():
    # each member is right on one of two examples (accuracy 0.5); averaged, both are right
    labels = np.array([0, 1])
    a = np.log([[0.9, 0.1], [0.6, 0.4]])
    b = np.log([[0.4, 0.6], [0.1, 0.9]])
    logits = np.stack([a, b])
    assert metrics.accuracy(metrics.predictions(logits), labels).tolist() == [0.5, 0.5]
    assert metrics.ensemble2_gain(logits, labels) == pytest.approx(0.5, abs=1e-15)


def test_cross_entropy_by_hand():
    logits = np.array([[[0.0, 0.0], [0.0, math.log(3.0)]]])   # p(label) = 1/2 and 3/4
    ce = metrics.cross_entropy(logits, np.array([0, 1]))
    assert ce[0] == pytest.approx((math.log(2) + math.log(4 / 3)) / 2, rel=1e-14)


# --------------------------------------------------------------------------------------------------
# Spread and its standard error


def test_sd_is_sample_sd():
    assert metrics.sd([0.5, 0.6, 0.7]) == pytest.approx(0.1, rel=64 * 2.0**-53)   # ddof=1; bound as below
    assert math.isnan(metrics.sd([0.5]))
    s = metrics.spread([0.5, 0.6, 0.7])
    u = 2.0**-53
    # the mean: three values each within u of their decimal, two additions, one division (4u); the SD:
    # centring cancels fewer than 3 bits of each deviation (0.6 / 0.1 < 2^3), then squares, a sum, a
    # division and a square root add a few u each: 2^6 u
    assert s["mean"] == pytest.approx(0.6, rel=4 * u) and s["n"] == 3 and s["sd"] == pytest.approx(0.1, rel=64 * u)


def test_bootstrap_se():
    assert metrics.bootstrap_se([0.3, 0.3, 0.3]) == 0.0
    # two values: a resample is {0,0} or {1,1} (SD 0) or mixed (SD 1/sqrt(2)), each with probability 1/2,
    # so the SE is (1/sqrt 2) * sqrt(p(1-p)) with p the mixed fraction of 1000 draws (0.4 < p < 0.6)
    se = metrics.bootstrap_se([0.0, 1.0])
    assert math.sqrt(0.5) * math.sqrt(0.24) <= se <= math.sqrt(0.5) * math.sqrt(0.25) * 1.001
    assert metrics.bootstrap_se([0.0, 1.0]) == se   # seeded
    assert math.isnan(metrics.bootstrap_se([1.0]))


def test_rate_se_of_a_constant_is_zero():
    assert metrics.rate_se(np.ones(50)) == 0.0
    assert metrics.rate_se(np.r_[np.zeros(50), np.ones(50)]) > 0


# --------------------------------------------------------------------------------------------------
# Weights and checksums


def test_first_divergent_step():
    a = [(0, 10), (1, 11), (2, 12), (3, 13), (6, 16)]
    assert metrics.first_divergent_step(a, list(a)) is None
    b = [(0, 10), (1, 11), (2, 12), (3, 99), (6, 98)]
    assert metrics.first_divergent_step(a, b) == 3
    assert metrics.first_divergent_step(a, [(0, 10), (6, 17)]) == 6   # only steps recorded in both count


def test_weight_distances():
    assert metrics.weight_l2([0, 0], [3, 4]) == 5.0
    ws = [np.array([0.0, 0.0]), np.array([3.0, 4.0]), np.array([0.0, 0.0])]   # pairs: 5, 0, 5
    assert metrics.pairwise_l2(ws) == pytest.approx(10 / 3, rel=1e-15)


# --------------------------------------------------------------------------------------------------
# Classes, groups, hard examples


def test_per_class_and_groups():
    labels = np.array([0, 0, 1, 1])
    preds = np.array([[0, 1, 1, 1], [0, 0, 1, 0]])
    pc = metrics.per_class_accuracy(preds, labels, 3)
    assert pc[:, :2].tolist() == [[0.5, 1.0], [1.0, 0.5]]
    assert np.isnan(pc[:, 2]).all()                       # no example of class 2
    group = np.array([0, 1, 0, 1])
    assert metrics.accuracy(preds, labels, group == 1).tolist() == [0.5, 0.5]
    assert metrics.pairwise_disagreement(preds, group == 1) == 1.0
    assert metrics.pairwise_disagreement(preds, group == 0) == 0.0


def test_concentration():
    c = metrics.concentration(np.array([1, 0, 1, 0]), np.array([1, 1, 0, 0], bool))
    assert (c["rate_in"], c["rate_out"], c["ratio"]) == (0.5, 0.5, 1.0)
    assert (c["share_of_flips"], c["share_of_examples"], c["n_in"]) == (0.5, 0.5, 2)
    c = metrics.concentration(np.array([1, 1, 0, 0]), np.array([1, 1, 0, 0], bool))
    assert c["ratio"] == math.inf and c["share_of_flips"] == 1.0
    c = metrics.concentration(np.zeros(4), np.array([1, 0, 0, 0], bool))
    assert math.isnan(c["share_of_flips"]) and math.isnan(c["ratio"])


def test_hardness():
    labels = np.array([0, 1])
    logits = np.log(np.array([[[0.8, 0.2], [0.7, 0.3]], [[0.6, 0.4], [0.1, 0.9]]]))
    h = metrics.hardness(logits, labels)
    # exp of log p: within |log p| u + u of p (2u here); the softmax's sum and division, and the mean of two,
    # a few u more: 16u
    assert h["confidence"] == pytest.approx([0.7, 0.8], rel=16 * 2.0**-53)
    assert h["wrong"].tolist() == [0.0, 0.5]


def test_summarize_identical_members_and_json():
    rng = np.random.default_rng(0)
    one = rng.normal(size=(1, 40, 10)).astype(np.float32)
    logits = np.repeat(one, 3, axis=0)
    labels = rng.integers(0, 10, 40)
    groups = (np.arange(40) % 3 == 0).astype(int)
    s = metrics.summarize(logits, labels, groups)
    assert s["disagreement"] == 0.0 and s["frac_not_all_equal"] == 0.0
    assert s["accuracy"]["sd"] == 0.0 and s["ensemble2_gain"] == 0.0
    assert set(s["groups"]) == {"majority", "minority"} and s["groups"]["minority"]["n"] == 14
    assert len(s["per_class"]) == 10
    json.dumps(s)   # plain floats and ints only


def test_summarize_differing_members():
    labels = np.array([0, 1, 2, 3])
    preds = np.array([[0, 1, 2, 3], [0, 1, 2, 0], [0, 2, 2, 3]])
    s = metrics.summarize(onehot_logits(preds), labels, np.array([0, 0, 1, 1]))
    # pairs (0,1): 1 of 4 differ, (0,2): 1, (1,2): 2 -> 4/12
    assert s["disagreement"] == pytest.approx(1 / 3, rel=1e-15)
    assert s["frac_not_all_equal"] == 0.5
    # accuracies 1, 0.75, 0.75 are exact, their sum too: the mean is one rounded division, 5/6; the SD is
    # numpy's of the same three values
    assert s["accuracy"]["mean"] == 5 / 6 and s["accuracy"]["sd"] == np.std([1.0, 0.75, 0.75], ddof=1)
    # example 3: 2 of 3 pairs; example 2: 0; a ratio of small integers, at most two roundings
    assert s["groups"]["minority"]["disagreement"] == pytest.approx(1 / 3, rel=2 * 2.0**-53)
