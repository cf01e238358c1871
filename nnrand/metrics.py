"""Prediction-divergence metrics between the members of one configuration.

Members of a configuration are trained with identical settings except the noise under study, so every
difference between them is that noise's doing. Conventions:

    M members, N test examples, C classes
    logits (M, N, C) float, labels (N,) int, groups (N,) int (0 majority, 1 minority, -1 unknown)
    preds  (M, N) = argmax over classes; a tie goes to the lowest class index (NumPy's argmax), so
           equal logits never make two members "disagree" by accident

Every standard deviation is the sample SD across members (ddof=1) and comes with a bootstrap standard
error: the members are resampled with replacement ``BOOT`` times (seed ``BOOT_SEED``) and the SE is the
SD (ddof=1) of the resampled SDs. With 3 members there are only 10 distinct resamples, so that SE is a
rough indication, not a precise one. Rates over test examples (disagreement) get a bootstrap SE over
examples instead. Arithmetic is float64 throughout. Confidence intervals over members, pairwise
matrices and the tests between configurations are ``nnrand.stats``.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

BOOT = 1000
BOOT_SEED = 0
DDOF = 1


# --------------------------------------------------------------------------------------------------
# Basics


def predictions(logits: np.ndarray) -> np.ndarray:
    """(M, N, C) logits -> (M, N) predicted classes (ties -> lowest index)."""
    return np.asarray(logits).argmax(axis=-1)


def pairs(m: int) -> list[tuple[int, int]]:
    return list(itertools.combinations(range(m), 2))


def sd(values) -> float:
    """Sample standard deviation (ddof=1); NaN for fewer than two values."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return math.nan
    # equal values have SD exactly 0 (np.std may leave a rounding residue of the mean)
    return 0.0 if np.all(v == v[0]) else float(np.std(v, ddof=DDOF))


def bootstrap_se(values, stat=sd, n_boot: int = BOOT, seed: int = BOOT_SEED) -> float:
    """SE of ``stat(values)`` by resampling ``values`` along axis 0 with replacement; NaN for < 2 rows."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(v), size=(n_boot, len(v)))
    boot = np.array([stat(v[i]) for i in idx], dtype=np.float64)
    boot = boot[np.isfinite(boot)]
    return float(np.std(boot, ddof=1)) if len(boot) > 1 else math.nan


def spread(values) -> dict:
    """Mean, SD (ddof=1) and the SD's bootstrap SE over members of one per-member quantity."""
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()) if len(v) else math.nan, "sd": sd(v), "sd_se": bootstrap_se(v), "n": len(v)}


def accuracy(preds: np.ndarray, labels: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """(M,) top-1 accuracy of each member (over ``mask`` when given; NaN if the mask is empty)."""
    hit = np.asarray(preds) == np.asarray(labels)[None, :]
    if mask is not None:
        hit = hit[:, np.asarray(mask, dtype=bool)]
    return hit.mean(axis=1) if hit.shape[1] else np.full(hit.shape[0], math.nan)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def softmax(logits: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(logits))


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(M,) mean test cross-entropy of each member (natural log)."""
    lp = log_softmax(logits)
    y = np.asarray(labels)
    return -lp[:, np.arange(len(y)), y].mean(axis=1)


# --------------------------------------------------------------------------------------------------
# Disagreement


def not_all_equal(preds: np.ndarray) -> np.ndarray:
    """(N,) bool: the members' predicted labels are not all the same (Fort et al. 2019, Figure S4)."""
    p = np.asarray(preds)
    return (p != p[:1]).any(axis=0)


def example_disagreement(preds: np.ndarray) -> np.ndarray:
    """(N,) fraction of member pairs whose predictions differ on each example (0 with one member)."""
    p = np.asarray(preds)
    pr = pairs(len(p))
    if not pr:
        return np.zeros(p.shape[1])
    return np.mean([p[i] != p[j] for i, j in pr], axis=0)


def pairwise_disagreement(preds: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Mean over member pairs of the fraction of (masked) test examples whose predictions differ
    (churn). NaN with one member or an empty mask."""
    p = np.asarray(preds)
    if len(p) < 2:
        return math.nan
    d = example_disagreement(p)
    if mask is not None:
        d = d[np.asarray(mask, dtype=bool)]
    return float(d.mean()) if len(d) else math.nan


def rate_se(per_example: np.ndarray, n_boot: int = BOOT, seed: int = BOOT_SEED) -> float:
    """Bootstrap SE over test examples of the mean of a per-example quantity."""
    v = np.asarray(per_example, dtype=np.float64)
    if len(v) < 2:
        return math.nan
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(axis=1)
    return float(np.std(means, ddof=1))


def logit_correlation(logits: np.ndarray) -> float:
    """Mean over member pairs of the Pearson correlation of their flattened (N*C) test logits; NaN
    with one member. Two members with constant logits are perfectly correlated when equal."""
    z = np.asarray(logits, dtype=np.float64).reshape(len(logits), -1)
    out = []
    for i, j in pairs(len(z)):
        a, b = z[i] - z[i].mean(), z[j] - z[j].mean()
        den = math.sqrt(float(a @ a) * float(b @ b))
        out.append(float(a @ b) / den if den > 0 else (1.0 if np.array_equal(z[i], z[j]) else 0.0))
    return float(np.mean(out)) if out else math.nan


def ensemble2_gain(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean over member pairs of the accuracy of their 2-member ensemble (argmax of the mean softmax
    probabilities, ties to the lowest class) minus the mean single-member accuracy. 0 when all members
    are identical; NaN with one member."""
    probs = softmax(logits)
    y = np.asarray(labels)
    pr = pairs(len(probs))
    if not pr:
        return math.nan
    acc = accuracy(predictions(logits), y)
    # per pair: ensemble accuracy minus the pair's mean accuracy (every member is in M-1 pairs, so the
    # mean over pairs of the latter is the mean single accuracy); identical members give exactly 0
    gain = [float(((probs[i] + probs[j]).argmax(axis=-1) == y).mean()) - (acc[i] + acc[j]) / 2 for i, j in pr]
    return float(np.mean(gain))


# --------------------------------------------------------------------------------------------------
# Weights


def first_divergent_step(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int | None:
    """First step recorded for both members (``(step, checksum)`` rows) at which their exact weight
    checksums differ; None if they never do. The checksum covers every float32 bit of every
    parameter, so equal checksums at a step mean bitwise-equal weights there (up to a 2^-64 collision)."""
    cb = {int(s): int(c) for s, c in b}
    for s, c in sorted((int(s), int(c)) for s, c in a):
        if s in cb and cb[s] != c:
            return s
    return None


def weight_l2(wa, wb) -> float:
    """||wa - wb||_2 of two flat weight vectors, in float64."""
    d = np.asarray(wa, dtype=np.float64) - np.asarray(wb, dtype=np.float64)
    return float(np.sqrt(d @ d))


def pairwise_l2(weights: list) -> float:
    """Mean over member pairs of the L2 distance between their flat weight vectors."""
    pr = pairs(len(weights))
    return float(np.mean([weight_l2(weights[i], weights[j]) for i, j in pr])) if pr else math.nan


# --------------------------------------------------------------------------------------------------
# Who pays: classes, subgroups, hard examples


def per_class_accuracy(preds: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """(M, C) accuracy of each member on the test examples of each true class (NaN for an absent one)."""
    y = np.asarray(labels)
    return np.stack([accuracy(preds, y, y == c) for c in range(num_classes)], axis=1)


def hardness(logits: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """Per example: ``confidence`` = mean over members of the top softmax probability, ``wrong`` =
    fraction of members that misclassify it."""
    probs = softmax(logits)
    return {"confidence": probs.max(axis=-1).mean(axis=0),
            "wrong": (predictions(logits) != np.asarray(labels)[None, :]).mean(axis=0)}


def concentration(flips: np.ndarray, mask: np.ndarray) -> dict:
    """How much a per-example flip indicator/rate concentrates inside ``mask``: the rate inside and
    outside, their ratio, and the share of all flips inside beside the share of examples inside."""
    f = np.asarray(flips, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    inside = float(f[m].mean()) if m.any() else math.nan
    outside = float(f[~m].mean()) if (~m).any() else math.nan
    total = float(f.sum())
    return {"rate_in": inside, "rate_out": outside,
            # no example outside (NaN rate): no ratio; none flipping outside while some inside: infinite
            "ratio": (math.nan if math.isnan(outside) else inside / outside if outside > 0 else
                      math.inf if inside > 0 else math.nan),
            "share_of_flips": float(f[m].sum()) / total if total > 0 else math.nan,
            "share_of_examples": float(m.mean()) if len(m) else math.nan, "n_in": int(m.sum())}


# --------------------------------------------------------------------------------------------------
# Everything for one configuration


def summarize(logits: np.ndarray, labels: np.ndarray, groups: np.ndarray | None = None) -> dict:
    """Every prediction metric of one configuration as plain floats (JSON-ready)."""
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    m, n, c = logits.shape
    preds = predictions(logits)
    acc = accuracy(preds, labels)
    flips = not_all_equal(preds)
    pair_d = example_disagreement(preds)
    out = {
        "members": m, "n_test": n,
        "accuracy": spread(acc), "cross_entropy": spread(cross_entropy(logits, labels)),
        "frac_not_all_equal": float(flips.mean()), "frac_not_all_equal_se": rate_se(flips),
        "disagreement": pairwise_disagreement(preds), "disagreement_se": rate_se(pair_d) if m > 1 else math.nan,
        "logit_corr": logit_correlation(logits), "ensemble2_gain": ensemble2_gain(logits, labels),
    }
    pc = per_class_accuracy(preds, labels, c)
    out["per_class"] = [{"class": k, "n": int((labels == k).sum()), **spread(pc[:, k][np.isfinite(pc[:, k])]),
                         "disagreement": pairwise_disagreement(preds, labels == k)} for k in range(c)]
    out["groups"] = {}
    if groups is not None:
        g = np.asarray(groups)
        for gid, gname in ((0, "majority"), (1, "minority")):
            mask = g == gid
            if mask.any():
                out["groups"][gname] = {"n": int(mask.sum()), "accuracy": spread(accuracy(preds, labels, mask)),
                                        "disagreement": pairwise_disagreement(preds, mask),
                                        "frac_not_all_equal": float(flips[mask].mean())}
    h = hardness(logits, labels)
    low_conf = h["confidence"] <= np.quantile(h["confidence"], 0.25)
    out["concentration"] = {
        "misclassified_by_most": concentration(flips, h["wrong"] > 0.5),
        "lowest_confidence_quartile": concentration(flips, low_conf),
    }
    if groups is not None and (np.asarray(groups) == 1).any():
        out["concentration"]["minority"] = concentration(flips, np.asarray(groups) == 1)
    return out
