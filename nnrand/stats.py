"""Statistics of a divergence study: point estimates, bootstrap intervals and tests between configurations.

NumPy only: no training, no file reading, no rendering. The per-member definitions (predictions, accuracy,
cross-entropy, ...) are ``nnrand.metrics``; this module says how sure we are of them.

    M members, N test examples, C classes; logits (M, N, C), labels (N,), groups (N,) (-1 unknown)

**Resampling unit: the member.** A member is one training run; the test set is fixed (every member is
evaluated on the same images), so the question "how much would this number move with other training
runs?" is answered by resampling members with replacement (seeded: ``BOOT_SEED``), never test images.

**Pairwise quantities** (disagreement, logit correlation, two-model ensemble gain, weight L2) are means
over member pairs. Pairs share members, so they are not independent and resampling pairs would
understate the spread. Instead the members are resampled and the mean is recomputed over all pairs of
*distinct* members in the resample (a pair drawn with multiplicity counts that often; a member paired
with its own copy is left out, as the pair statistic of a member with itself is 0 by construction and
would bias the mean towards 0). A resample with a single distinct member has no pair and is dropped.

**Intervals** are percentile intervals (``LEVEL``, default 95%) of ``BOOT`` resamples, given only where
every configuration involved has at least ``MIN_CI_MEMBERS`` (3) members (with 2, every resample with a
pair is the same pair, so an interval would collapse to the point and read as certainty: its bounds are
NaN instead, and reports show the point alone). With few members they are coarse: read them as "at least
this uncertain". A percentile interval can miss its own point
estimate when the statistic is biased under resampling (an SD of few members shrinks); it is then
extended to the point and marked ``extended``.

**Tests between configurations** (is `impl`'s disagreement different from `algo`'s?) are permutation
tests over members: under the null hypothesis the members of both configurations are exchangeable
(drawn from one distribution), so relabelling them at random gives the statistic's null distribution.
That null is stronger than "equal disagreement" (relabelled splits pair members across configurations),
so a small p says the configurations differ; the bootstrap interval of the difference says by how much
in the statistic itself.
All splits are enumerated when there are at most ``PERM`` of them, else ``PERM`` random splits (seeded)
are drawn and p = (1 + #{|stat| >= |observed|}) / (1 + PERM). The difference also gets a bootstrap
interval (members resampled within each configuration independently). Both configurations must be
evaluated on the same test images (the pooled disagreement matrix pairs members across them).

A table of several such tests is a family: reading each p below 0.05 would find some difference in a
family of 20 independent true nulls with probability 1 - 0.95^20 = 64%. ``holm`` gives Holm's step-down
adjusted p-values (family-wise error at most the level, under any dependence between the tests); a
report reads a difference in a family as detected only where its adjusted p is below the level.

Churn is always *disagreement*: the fraction of test examples on which two members' top-1 predictions
differ (0 for identical predictions), never agreement.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np

from nnrand import metrics

BOOT = 2000          # bootstrap resamples
BOOT_SEED = 0
LEVEL = 0.95         # interval coverage
PERM = 10_000        # permutation-test splits (all of them when there are fewer)
PERM_SEED = 0
# Two statistics closer than this (relative) are ties in a permutation test: equal disagreement rates
# computed through different pair orders may differ in the last bits of a float64 mean.
TIE_RTOL = 1e-12
MIN_CI_MEMBERS = 3   # members per configuration below which no interval is given (see the module doc)


# --------------------------------------------------------------------------------------------------
# Pairwise matrices: entry (i, j) is the pair statistic of members i and j; the diagonal is unused


def disagreement_matrix(preds: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """(M, M) fraction of the (masked) test examples on which members i and j predict different labels;
    NaN everywhere for an empty mask."""
    p = np.asarray(preds)
    if mask is not None:
        p = p[:, np.asarray(mask, dtype=bool)]
    m, n = p.shape
    if n == 0:
        return np.full((m, m), math.nan)
    return (p[:, None, :] != p[None, :, :]).mean(axis=-1)


def logit_corr_matrix(logits: np.ndarray) -> np.ndarray:
    """(M, M) Pearson correlation of members' flattened (N*C) test logits (1 for equal constant logits)."""
    z = np.asarray(logits, dtype=np.float64).reshape(len(logits), -1)
    z = z - z.mean(axis=1, keepdims=True)
    norm = np.sqrt((z * z).sum(axis=1))
    out = (z @ z.T) / np.maximum(np.outer(norm, norm), np.finfo(np.float64).tiny)
    zero = np.outer(norm == 0, norm == 0)
    out[zero] = 0.0
    for i, j in zip(*np.nonzero(zero)):
        out[i, j] = 1.0 if np.array_equal(z[i], z[j]) else 0.0
    return out


def ensemble2_gain_matrix(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(M, M) accuracy of the two-member ensemble (argmax of the mean softmax; ties to the lowest class)
    minus the mean of the two members' accuracies. 0 for identical members."""
    probs = metrics.softmax(logits)
    y = np.asarray(labels)
    acc = metrics.accuracy(metrics.predictions(logits), y)
    m = len(probs)
    out = np.zeros((m, m))
    for i, j in itertools.combinations(range(m), 2):
        g = float(((probs[i] + probs[j]).argmax(axis=-1) == y).mean()) - (acc[i] + acc[j]) / 2
        out[i, j] = out[j, i] = g
    return out


def l2_matrix(weights: list) -> np.ndarray:
    """(M, M) L2 distance between members' flat weight vectors, in float64. Each difference is taken
    element by element (not through ||a||^2 + ||b||^2 - 2ab, which cancels catastrophically for members
    one ULP apart); every vector is converted to float64 once (ResNet-18, 10 members: 45 pairs of 11M)."""
    w = [np.asarray(x, dtype=np.float64) for x in weights]
    m = len(w)
    out = np.zeros((m, m))
    for i, j in itertools.combinations(range(m), 2):
        d = w[i] - w[j]
        out[i, j] = out[j, i] = math.sqrt(float(d @ d))
    return out


def pair_means(mat: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Row by row of ``idx`` (B, k): the mean of ``mat`` over the pairs of distinct members of that row
    (positions a < b with idx[a] != idx[b]; a repeated member counts as often as it is drawn). NaN for a
    row without such a pair."""
    mat = np.asarray(mat, dtype=np.float64)
    idx = np.atleast_2d(np.asarray(idx))
    a, b = np.triu_indices(idx.shape[1], k=1)
    ia, ib = idx[:, a], idx[:, b]
    keep = ia != ib
    total = np.where(keep, mat[ia, ib], 0.0).sum(axis=1)
    count = keep.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), math.nan)


def pair_mean(mat: np.ndarray, idx: np.ndarray | None = None) -> float:
    """``pair_means`` of one index row (default: every member once)."""
    idx = np.arange(len(mat)) if idx is None else np.asarray(idx)
    return float(pair_means(mat, idx[None])[0])


def sd_rows(v: np.ndarray) -> np.ndarray:
    """Sample SD (ddof=1) of each row of ``v`` (B, k); exactly 0 for a row of equal values (``metrics.sd``)."""
    v = np.asarray(v, dtype=np.float64)
    if v.shape[1] < 2:
        return np.full(len(v), math.nan)
    out = np.std(v, axis=1, ddof=metrics.DDOF)
    return np.where((v == v[:, :1]).all(axis=1), 0.0, out)


def mean_rows(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float64).mean(axis=1)


# --------------------------------------------------------------------------------------------------
# Bootstrap over members


def resamples(m: int, n_boot: int = BOOT, seed: int = BOOT_SEED) -> np.ndarray:
    """(n_boot, m) member indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, m, size=(n_boot, m))


def interval(point: float, boot, level: float = LEVEL) -> dict:
    """Percentile interval of the finite bootstrap values, extended to ``point`` if it lies outside."""
    b = np.asarray(boot, dtype=np.float64)
    b = b[np.isfinite(b)]
    if not math.isfinite(point) or len(b) == 0:
        return {"value": point, "lo": math.nan, "hi": math.nan, "level": level, "n_boot": int(len(b)),
                "extended": False}
    lo, hi = (float(x) for x in np.quantile(b, [(1 - level) / 2, (1 + level) / 2]))
    extended = not (lo <= point <= hi)
    return {"value": float(point), "lo": min(lo, point), "hi": max(hi, point), "level": level,
            "n_boot": int(len(b)), "extended": extended}


def member_ci(values, stat: Callable[[np.ndarray], np.ndarray] = sd_rows, n_boot: int = BOOT,
              seed: int = BOOT_SEED, level: float = LEVEL) -> dict:
    """``stat`` of per-member values (default their SD, ddof=1) with its member-bootstrap interval.
    ``stat`` maps rows of values (B, k) to (B,)."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return interval(math.nan, [], level)
    point = float(stat(v[None])[0])
    if len(v) < MIN_CI_MEMBERS:
        return interval(point, [], level)
    return interval(point, stat(v[resamples(len(v), n_boot, seed)]), level)


def pair_ci(mat: np.ndarray, n_boot: int = BOOT, seed: int = BOOT_SEED, level: float = LEVEL) -> dict:
    """Mean over member pairs of a pairwise matrix, with the member-bootstrap interval (see module doc)."""
    m = len(mat)
    if m < 2:
        return interval(math.nan, [], level)
    if m < MIN_CI_MEMBERS:
        return interval(pair_mean(mat), [], level)
    return interval(pair_mean(mat), pair_means(mat, resamples(m, n_boot, seed)), level)


# --------------------------------------------------------------------------------------------------
# Tests between two configurations


def splits(n_a: int, n_b: int, n_perm: int = PERM, seed: int = PERM_SEED) -> tuple[np.ndarray, np.ndarray, bool]:
    """Relabellings of n_a + n_b pooled members as index arrays (S, n_a) and (S, n_b), the observed one
    (a = the first n_a) first: all C(n_a + n_b, n_a) of them when there are at most ``n_perm`` (exact),
    else the observed one and ``n_perm`` random ones."""
    n = n_a + n_b
    if math.comb(n, n_a) <= n_perm:
        a = np.array(list(itertools.combinations(range(n), n_a)), dtype=np.int64).reshape(-1, n_a)
        rest = np.ones((len(a), n), bool)
        rest[np.arange(len(a))[:, None], a] = False
        b = np.nonzero(rest)[1].reshape(len(a), n_b)
        return a, b, True
    rng = np.random.default_rng(seed)
    perm = np.concatenate([np.arange(n)[None], np.argsort(rng.random((n_perm, n)), axis=1)])
    return perm[:, :n_a], perm[:, n_a:], False


def permutation_test(stat: Callable[[np.ndarray, np.ndarray], np.ndarray], n_a: int, n_b: int,
                     n_perm: int = PERM, seed: int = PERM_SEED) -> dict:
    """Two-sided permutation test of ``stat(A, B)`` (index rows (S, n_a), (S, n_b) of the pooled members;
    group a is 0..n_a-1, group b the rest; returns (S,)). p = the fraction of splits, the observed one
    included, whose |stat| reaches the observed one: with random splits (1 + k) / (1 + n_perm). With all
    splits enumerated the smallest attainable p is 2 / C(n_a + n_b, n_a) for equal group sizes (the
    mirror split reaches the same |stat|), e.g. 1/3 for 2 + 2 members: two members per configuration
    cannot show a difference."""
    a, b, exact = splits(n_a, n_b, n_perm, seed)
    s = np.asarray(stat(a, b), dtype=np.float64)
    observed = float(s[0])
    tol = TIE_RTOL * max(abs(observed), 1e-300)
    hits = np.isfinite(s) & (np.abs(s) >= abs(observed) - tol)
    return {"stat": observed, "p_value": float(hits.mean()), "splits": int(len(s)), "exact": exact,
            "min_p": 1 / len(s)}


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjustment of a family of p-values: sorted ascending, p_(i) is multiplied by
    (m - i) for i = 0..m-1, made non-decreasing along that order and capped at 1; returned in the input's
    order. NaN entries (no test) stay NaN and do not count in m."""
    p = np.asarray(p_values, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m = len(order)
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    out[order] = adjusted
    return out


def _compare(stat, n_a: int, n_b: int, n_boot: int, n_perm: int, seed: int, level: float) -> dict:
    test = permutation_test(stat, n_a, n_b, n_perm, seed)
    boot = stat(resamples(n_a, n_boot, seed), resamples(n_b, n_boot, seed + 1) + n_a) \
        if min(n_a, n_b) >= MIN_CI_MEMBERS else []
    return {"diff": interval(test["stat"], boot, level), **{k: test[k] for k in ("p_value", "splits", "exact")}}


def compare_pairwise(mat_pooled: np.ndarray, n_a: int, n_b: int, *, n_boot: int = BOOT, n_perm: int = PERM,
                     seed: int = BOOT_SEED, level: float = LEVEL) -> dict:
    """a minus b of a pairwise mean (e.g. disagreement), from the (n_a+n_b)^2 matrix of the pooled
    members (a first): permutation p-value and the bootstrap interval of the difference (members
    resampled within each configuration)."""
    mat = np.asarray(mat_pooled, dtype=np.float64)
    out = _compare(lambda ia, ib: pair_means(mat, ia) - pair_means(mat, ib), n_a, n_b, n_boot, n_perm, seed, level)
    return {"a": pair_mean(mat, np.arange(n_a)), "b": pair_mean(mat, np.arange(n_a, n_a + n_b)), **out}


def compare_members(values_a, values_b, stat: Callable[[np.ndarray], np.ndarray] = sd_rows, *, n_boot: int = BOOT,
                    n_perm: int = PERM, seed: int = BOOT_SEED, level: float = LEVEL) -> dict:
    """a minus b of ``stat`` (rows -> (B,), default the SD) of a per-member quantity (e.g. accuracy)."""
    v = np.concatenate([np.asarray(values_a, np.float64), np.asarray(values_b, np.float64)])
    n_a, n_b = len(values_a), len(values_b)
    out = _compare(lambda ia, ib: stat(v[ia]) - stat(v[ib]), n_a, n_b, n_boot, n_perm, seed, level)
    return {"a": float(stat(v[None, :n_a])[0]), "b": float(stat(v[None, n_a:])[0]), **out}


def compare_configs(logits_a: np.ndarray, logits_b: np.ndarray, labels: np.ndarray, **kw) -> dict:
    """Disagreement and accuracy SD of configuration a against b, each with its permutation p-value and
    the bootstrap interval of the difference. Both must be evaluated on the same test labels."""
    if len(logits_a) < 2 or len(logits_b) < 2:
        raise ValueError(f"compare_configs needs >= 2 members on each side, got {len(logits_a)} and {len(logits_b)}")
    if np.shape(logits_a)[1:] != np.shape(logits_b)[1:]:
        raise ValueError(f"compare_configs: test sets differ in shape, {np.shape(logits_a)} vs {np.shape(logits_b)}")
    pa, pb = metrics.predictions(logits_a), metrics.predictions(logits_b)
    pooled = np.concatenate([pa, pb])
    y = np.asarray(labels)
    return {"members": [len(pa), len(pb)],
            "disagreement": compare_pairwise(disagreement_matrix(pooled), len(pa), len(pb), **kw),
            "accuracy_sd": compare_members(metrics.accuracy(pa, y), metrics.accuracy(pb, y), **kw)}


# --------------------------------------------------------------------------------------------------
# Everything about one configuration


def config_stats(logits: np.ndarray, labels: np.ndarray, groups: np.ndarray | None = None, *,
                 n_boot: int = BOOT, seed: int = BOOT_SEED, level: float = LEVEL) -> dict:
    """Intervals of one configuration's metrics (member bootstrap; see the module doc):
    accuracy mean and SD, cross-entropy SD, pairwise disagreement, logit correlation, two-model ensemble
    gain, and disagreement per true class and per subgroup."""
    logits = np.asarray(logits)
    y = np.asarray(labels)
    preds = metrics.predictions(logits)
    acc = metrics.accuracy(preds, y)
    kw = {"n_boot": n_boot, "seed": seed, "level": level}
    out = {
        "bootstrap": {"unit": "members", "method": "percentile", "n_boot": n_boot, "seed": seed, "level": level,
                      "pairs": "all pairs of distinct members of each resample"},
        "accuracy_mean": member_ci(acc, mean_rows, **kw),
        "accuracy_sd": member_ci(acc, **kw),
        "cross_entropy_sd": member_ci(metrics.cross_entropy(logits, y), **kw),
        "disagreement": pair_ci(disagreement_matrix(preds), **kw),
        "logit_corr": pair_ci(logit_corr_matrix(logits), **kw),
        "ensemble2_gain": pair_ci(ensemble2_gain_matrix(logits, y), **kw),
        "per_class": [pair_ci(disagreement_matrix(preds, y == k), **kw) for k in range(logits.shape[-1])],
        "groups": {},
    }
    if groups is not None:
        g = np.asarray(groups)
        for gid, name in ((0, "majority"), (1, "minority")):
            if (g == gid).any():
                out["groups"][name] = pair_ci(disagreement_matrix(preds, g == gid), **kw)
    return out


def l2_growth(per_epoch: list[tuple[int, np.ndarray, float]], **kw) -> list[dict]:
    """Weight distance per epoch: ``per_epoch`` rows (epoch, (M, M) L2 matrix, mean weight norm) ->
    rows with the mean pairwise L2 (``l2``, with its member-bootstrap interval ``l2_ci``), the norm,
    and ``growth`` = l2 / the first epoch's l2 (NaN when that is 0: members still identical)."""
    out = []
    first = None
    for epoch, mat, norm in per_epoch:
        ci = pair_ci(mat, **kw)
        first = ci["value"] if first is None else first
        growth = ci["value"] / first if first and math.isfinite(first) and first > 0 else math.nan
        out.append({"epoch": int(epoch), "l2": ci["value"], "l2_ci": ci, "norm": float(norm), "growth": growth})
    return out
