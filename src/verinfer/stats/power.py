"""Detection power: AUC at a low FPR of pooled detectors as a function of the tokens per batch.

The protocol follows DiFR section 5.2, with one deliberate change. Per-token scores of every
configuration are split 50/50 *by sequence* (the paper splits by token, which lets correlated
tokens of one sequence sit on both sides); winsorization percentiles and the orientation check
come from the honest training half only; batches of ``n`` test tokens are drawn at random and
averaged; the AUC at 1% FPR separates honest test batches from misconfigured test batches.

Batches draw tokens with replacement: a pool of a few thousand test tokens cannot give many
disjoint 10,000-token batches, and drawing without replacement from a pool barely larger than
the batch would shrink the spread of batch means (finite-population correction) and flatter the
detector. Large batch sizes are therefore an extrapolation that treats tokens as independent,
as the paper's random token batches do; ``held_out`` checks calibration on consecutive tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from verinfer.stats.calibration import Calibrator, min_batches
from verinfer.stats.evaluation import Interval, Proportion, auc_at_fpr, bootstrap_ci, held_out_fpr

BATCH_SIZES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass(frozen=True)
class Detector:
    """A per-token metric and the pooling rule that turns a batch of it into one statistic."""

    metric: str  # a per-token score column (higher = more divergent)
    rule: str  # a Calibrator rule: bound:C, clip:P, tail:L:H, mismatch_rate
    label: str


DETECTORS = (
    Detector("margin", "bound:20", "margin (bound 20)"),
    Detector("margin", "clip:99", "margin clip 99"),
    Detector("margin", "clip:99.9", "margin clip 99.9"),
    Detector("margin", "clip:99.99", "margin clip 99.99"),
    Detector("margin", "clip:99.999", "margin clip 99.999"),
    Detector("margin", "tail:99.99:99.999", "margin tail"),
    Detector("likelihood", "clip:99.9", "likelihood clip 99.9"),
    Detector("exact_match", "mismatch_rate", "exact mismatch"),
    Detector("cross_entropy", "clip:99.99", "cross-entropy clip 99.99"),
)
COMBINED = "combined (max z)"
COMBINED_PARTS = ("margin clip 99.9", "margin tail", "cross-entropy clip 99.99", "exact mismatch")


def fit_transforms(honest_train: Mapping[str, np.ndarray], detectors: Sequence[Detector] = DETECTORS,
                   fpr: float = 0.01, batch_sizes: Sequence[int] = (1,), disjoint: bool = False) -> Calibrator:
    """Winsorization percentiles from honest training tokens (thresholds too, when ``disjoint``).

    Curves need only the percentiles, so their thresholds come from bootstrapped windows and any
    amount of honest data will do; ``disjoint`` asks for the order-statistic guarantee instead.
    """
    rules = tuple(dict.fromkeys(d.rule for d in detectors if d.metric != "exact_match"))
    metrics = {d.metric for d in detectors}
    resample = None if disjoint else min_batches(fpr)
    return Calibrator(batch_sizes, fpr, rules, resample=resample, random_state=0).fit(
        {m: honest_train[m] for m in metrics})


def random_batch_means(per_token: np.ndarray, n: int, n_batches: int, rng: np.random.Generator,
                       chunk_elems: int = 4_000_000) -> np.ndarray:
    """Means of ``n_batches`` batches of ``n`` tokens drawn with replacement (see module docstring).

    ``per_token`` may be 2-D [detectors, tokens]: every row is averaged over the same draws, so
    detectors are compared on identical batches (and the draws are paid for once).
    """
    x = np.atleast_2d(per_token)
    out = np.empty((x.shape[0], n_batches))
    step = max(1, chunk_elems // (n * x.shape[0]))
    for lo in range(0, n_batches, step):
        k = min(step, n_batches - lo)
        out[:, lo: lo + k] = x[:, rng.integers(0, x.shape[1], size=(k, n))].mean(axis=2)
    return out if np.ndim(per_token) == 2 else out[0]


@dataclass(frozen=True)
class CurvePoint:
    tokens: int
    auc: Interval
    oriented: bool  # False: the bad configuration looked no more divergent on train; AUC set to 0.5


def power_curves(calibrator: Calibrator, honest_train: Mapping[str, np.ndarray],
                 honest_test: Mapping[str, np.ndarray], bad_train: Mapping[str, np.ndarray],
                 bad_test: Mapping[str, np.ndarray], detectors: Sequence[Detector] = DETECTORS,
                 batch_sizes: Sequence[int] = BATCH_SIZES, n_batches: int = 1000, n_boot: int = 100,
                 max_fpr: float = 0.01, seed: int = 0, combined: bool = True) -> dict[str, list[CurvePoint]]:
    """AUC at ``max_fpr`` with a bootstrap interval, per detector and batch size.

    A detector whose mean per-token statistic is not larger on the misconfiguration's training
    tokens than on the honest ones scores 0.5 at every size (DiFR sec. 5.2: a provider that looks
    *more* consistent than the honest pool is not flagged). ``combined`` adds the maximum over a few
    detectors of the batch statistic standardized by honest training batches of the same size.
    """
    def per_token(cols, d):
        return calibrator.transform(cols[d.metric], metric=d.metric, rule=d.rule)

    curves: dict[str, list[CurvePoint]] = {d.label: [] for d in detectors}
    parts = [d for d in detectors if d.label in COMBINED_PARTS] if combined else []
    if parts:
        curves[COMBINED] = []
    sides = {k: np.stack([per_token(c, d) for d in detectors])
             for k, c in (("ht", honest_train), ("hs", honest_test), ("bt", bad_train), ("bs", bad_test))}
    oriented = sides["bt"].mean(axis=1) > sides["ht"].mean(axis=1)
    in_combined = np.array([d in parts for d in detectors]) & oriented
    for i, n in enumerate(batch_sizes):
        rng = np.random.default_rng([seed, i])
        h, b = (random_batch_means(sides[k], n, n_batches, rng) for k in ("hs", "bs"))
        for j, d in enumerate(detectors):
            curves[d.label].append(_point(n, h[j], b[j], bool(oriented[j]), n_boot, max_fpr, rng))
        if parts:
            ok = bool(in_combined.any())
            if ok:  # standardize by honest *training* batches of the same size, then take the max
                ref = random_batch_means(sides["ht"][in_combined], n, n_batches, rng)
                mu, sd = ref.mean(axis=1, keepdims=True), ref.std(axis=1, keepdims=True)
                sd[sd == 0] = 1.0
                zh, zb = ((x[in_combined] - mu) / sd for x in (h, b))
            zh_max = zh.max(axis=0) if ok else np.zeros(n_batches)
            zb_max = zb.max(axis=0) if ok else np.zeros(n_batches)
            curves[COMBINED].append(_point(n, zh_max, zb_max, ok, n_boot, max_fpr, rng))
    return curves


def _point(n: int, honest: np.ndarray, bad: np.ndarray, oriented: bool, n_boot: int, max_fpr: float,
           rng: np.random.Generator) -> CurvePoint:
    if not oriented:
        return CurvePoint(n, Interval(0.5, 0.5, 0.5), False)
    fn = lambda h, b: auc_at_fpr(h, b, max_fpr)  # noqa: E731
    if np.ptp(np.concatenate([honest, bad])) == 0:
        return CurvePoint(n, Interval(0.5, 0.5, 0.5), True)
    if bad.min() > honest.max():  # complete separation: every bootstrap resample has AUC 1 too
        return CurvePoint(n, Interval(1.0, 1.0, 1.0), True)
    return CurvePoint(n, bootstrap_ci(fn, honest, bad, n_boot=n_boot, rng=rng), True)


def tokens_to_reach(points: Sequence[CurvePoint], target: float = 0.99) -> int | None:
    """Smallest batch size whose AUC estimate reaches ``target`` (None: none does)."""
    reached = [p.tokens for p in points if p.auc.estimate >= target]
    return min(reached) if reached else None


def held_out(honest_train: Mapping[str, np.ndarray], honest_test: Mapping[str, np.ndarray],
             detectors: Sequence[Detector], batch_sizes: Sequence[int], fpr: float = 0.01
             ) -> tuple[Calibrator | None, dict[tuple[str, int], Proportion]]:
    """Fit thresholds on consecutive disjoint honest training batches; flag rate on held-out honest.

    Batch sizes with fewer than the 99 training batches an order statistic at 1% needs are left out
    (no sizes at all: no calibrator and no rows).
    """
    n_train = min(np.asarray(honest_train[d.metric]).size for d in detectors)
    sizes = tuple(n for n in batch_sizes if n_train // n >= min_batches(fpr))
    out: dict[tuple[str, int], Proportion] = {}
    if not sizes:
        return None, out
    cal = fit_transforms(honest_train, detectors, fpr, sizes, disjoint=True)
    for d in detectors:
        for n in sizes:
            if np.asarray(honest_test[d.metric]).size >= n:
                out[d.label, n] = held_out_fpr(cal, honest_test[d.metric], n, metric=d.metric, rule=d.rule)
    return cal, out


__all__ = ["BATCH_SIZES", "COMBINED", "CurvePoint", "DETECTORS", "Detector", "fit_transforms", "held_out",
           "power_curves", "random_batch_means", "tokens_to_reach"]
