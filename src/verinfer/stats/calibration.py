"""Calibrate batch detectors on honest scores so that a verdict has a stated false-positive rate.

A detector is (metric, pooling rule, batch size). ``fit`` learns, on honest per-token scores only,
the winsorization percentile values of each metric (paper sec. 5.2) and, for each detector, the
threshold that honest batches exceed with probability at most ``fpr``.

Rules are short strings so they read well in reports and survive JSON:

- ``"bound:C"``     mean of scores clipped at the fixed value C: the paper's bounded margin
                    min(margin, C); unlike ``clip`` it keeps its signal when honest scores are all 0
- ``"clip:P"``      mean of scores clipped at the honest P-th percentile (paper default, P=99.9)
- ``"tail:L:H"``    clip at the H-th percentile, zero below the L-th, take the mean (paper app. E)
- ``"mismatch_rate"`` only for the metric named ``"exact_match"`` (0/1 flags): ``1 - mean``

Batch sizes that were not fitted are refused with a ValueError rather than borrowing a nearby
size's threshold: a batch mean's spread shrinks roughly like 1/sqrt(n), so another size's
threshold silently changes the false-positive rate (too many flags from a larger size, lost power
from a smaller one). Score at a fitted size instead, or refit with the size you need.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from verinfer.stats.pooling import (
    as_exact_match,
    as_scores,
    batch_means,
    clip_scores,
    finite_percentile,
    sampled_batch_means,
    tail_scores,
)

FORMAT = "verinfer.calibrator"
FORMAT_VERSION = 1
EXACT_MATCH = "exact_match"
MISMATCH_RATE = "mismatch_rate"
DEFAULT_RULES = ("bound:20", "clip:99", "clip:99.9", "clip:99.99", "clip:99.999", "tail:99.99:99.999")
DEFAULT_BATCH_SIZES = (1, 10, 100, 1000)
THRESHOLD_RULE = (
    "threshold = k-th smallest of m honest batch statistics, k = ceil((1 - fpr) * (m + 1)); "
    "flag when statistic > threshold (P(false flag) <= fpr for exchangeable honest batches)"
)


def parse_rule(rule: str) -> tuple[str, tuple[float, ...]]:
    """Split a rule string into its kind and the honest percentiles it needs."""
    kind, *params = rule.split(":")
    expected = {"bound": 1, "clip": 1, "tail": 2, MISMATCH_RATE: 0}
    if kind not in expected or len(params) != expected[kind]:
        raise ValueError(
            f"unknown pooling rule {rule!r}; use 'bound:C', 'clip:P', 'tail:L:H' or '{MISMATCH_RATE}'"
        )
    if kind == "bound":
        _bound_value(rule)
        return kind, ()
    try:
        percentiles = tuple(float(p) for p in params)
    except ValueError:
        raise ValueError(f"pooling rule {rule!r} has a non-numeric percentile") from None
    if not all(0.0 < p < 100.0 for p in percentiles):
        raise ValueError(f"pooling rule {rule!r}: percentiles must lie strictly between 0 and 100")
    if kind == "tail" and percentiles[0] > percentiles[1]:
        raise ValueError(f"pooling rule {rule!r}: zero-below percentile exceeds clip percentile")
    return kind, percentiles


def _bound_value(rule: str) -> float:
    """The fixed clip value of a ``bound:C`` rule (a positive number)."""
    try:
        value = float(rule.split(":")[1])
    except ValueError:
        raise ValueError(f"pooling rule {rule!r} has a non-numeric bound") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"pooling rule {rule!r}: the bound must be a positive finite number")
    return value


def min_batches(fpr: float) -> int:
    """Fewest honest batches for which the conservative (1 - fpr) order statistic exists."""
    return math.ceil((1.0 - fpr) / fpr - 1e-9)


def conservative_quantile(stats: np.ndarray, fpr: float) -> float:
    """The ceil((1 - fpr)(m + 1))-th smallest of ``stats``: the split-conformal threshold."""
    m = stats.size
    k = math.ceil((1.0 - fpr) * (m + 1) - 1e-9)
    if k > m:
        raise ValueError(f"{m} honest batches cannot bound fpr={fpr}; need {min_batches(fpr)}")
    return float(np.partition(stats, k - 1)[k - 1])



class NotFittedError(ValueError, AttributeError):
    """A Calibrator used before ``fit``; the same bases as scikit-learn's error of that name (not
    imported: scikit-learn costs every command's start-up about a second, for one exception)."""

class Calibrator:
    """Per-detector thresholds at a target false-positive rate, fitted on honest scores only.

    ``resample=None`` uses disjoint consecutive batches (the order-statistic guarantee holds for
    exchangeable batches) and refuses batch sizes with too few of them. ``resample=R`` instead
    draws R overlapping windows with replacement per batch size, for when honest tokens are
    scarce; its thresholds are bootstrap estimates without that guarantee, and ``to_dict`` says so.
    """

    def __init__(
        self,
        batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES,
        fpr: float = 0.01,
        rules: Iterable[str] = DEFAULT_RULES,
        resample: int | None = None,
        random_state: int | None = None,
    ) -> None:
        self.batch_sizes = tuple(sorted({int(n) for n in batch_sizes}))
        self.fpr = float(fpr)
        self.rules = tuple(rules)
        self.resample = resample
        self.random_state = random_state
        self.signature: dict | None = None  # what the honest scores were verified under (verify/scores.py)
        self.coverage: dict | None = None  # honest noise fitted on: {"precisions": [...], "profiles": [...]}
        self.sides: list[dict] | None = None  # honest groups' mismatch counts per side (verinfer.stats.sides)
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive integers, got {self.batch_sizes}")
        if not 0.0 < self.fpr < 1.0:
            raise ValueError(f"fpr must lie strictly between 0 and 1, got {fpr}")
        if not self.rules or MISMATCH_RATE in self.rules:
            raise ValueError(
                f"rules must name at least one clip/tail rule ('{MISMATCH_RATE}' is implied "
                f"for the '{EXACT_MATCH}' metric), got {self.rules}"
            )
        for rule in self.rules:
            parse_rule(rule)
        if resample is not None and resample < min_batches(self.fpr):
            raise ValueError(
                f"resample={resample} windows cannot bound fpr={self.fpr}; "
                f"use at least {min_batches(self.fpr)}"
            )

    @property
    def percentiles(self) -> tuple[float, ...]:
        """Honest percentiles learned per continuous metric (the union over the rules)."""
        return tuple(sorted({p for rule in self.rules for p in parse_rule(rule)[1]}))

    def fit(self, honest_scores: Mapping[str, ArrayLike]) -> Calibrator:
        """Learn percentile values and thresholds from honest per-token scores keyed by metric."""
        if not honest_scores:
            raise ValueError("honest_scores is empty; pass e.g. {'margin': array_of_scores}")
        rng = np.random.default_rng(self.random_state)
        n_tokens: dict[str, int] = {}
        percentile_values: dict[str, dict[float, float]] = {}
        thresholds: dict[tuple[str, str, int], tuple[float, int]] = {}
        for metric, raw in honest_scores.items():
            scores = self._check_metric_scores(metric, raw, f"honest_scores[{metric!r}]")
            n_tokens[metric] = scores.size
            if metric != EXACT_MATCH:
                values = np.atleast_1d(finite_percentile(scores, self.percentiles))
                percentile_values[metric] = dict(zip(self.percentiles, map(float, values)))
            for rule in self._rules_for(metric):
                per_token = _transform(scores, rule, percentile_values.get(metric, {}))
                for n in self.batch_sizes:
                    stats = self._honest_batches(per_token, n, metric, rng)
                    threshold = conservative_quantile(stats, self.fpr)
                    thresholds[metric, rule, n] = (threshold, stats.size)
        self.n_tokens_ = n_tokens
        self.percentile_values_ = percentile_values
        self.thresholds_ = thresholds
        return self

    def transform(self, scores: ArrayLike, *, metric: str, rule: str) -> np.ndarray:
        """Per-token scores whose batch mean is the rule's statistic (percentiles from ``fit``)."""
        self._check_metric_rule(metric, rule)
        arr = self._check_metric_scores(metric, scores, "scores")
        return _transform(arr, rule, self.percentile_values_.get(metric, {}))

    def score(self, scores: ArrayLike, batch_size: int, *, metric: str, rule: str) -> np.ndarray:
        """Batch statistics of consecutive ``batch_size``-token batches (remainder dropped)."""
        self._check_detector(metric, rule, batch_size)
        return batch_means(self.transform(scores, metric=metric, rule=rule), batch_size)

    def predict(self, scores: ArrayLike, batch_size: int, *, metric: str, rule: str) -> np.ndarray:
        """True for each batch whose statistic exceeds the honest threshold (flagged)."""
        stats = self.score(scores, batch_size, metric=metric, rule=rule)
        return stats > self.threshold(metric, rule, batch_size)

    def threshold(self, metric: str, rule: str, batch_size: int) -> float:
        """The fitted threshold of one detector."""
        self._check_detector(metric, rule, batch_size)
        return self.thresholds_[metric, rule, batch_size][0]

    def to_dict(self) -> dict[str, Any]:
        """A versioned, JSON-safe description of the fitted calibration."""
        self._check_fitted()
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "fpr": self.fpr,
            "threshold_rule": THRESHOLD_RULE,
            "batches": "disjoint" if self.resample is None else "windows_with_replacement",
            "resample": self.resample,
            "random_state": self.random_state if isinstance(self.random_state, int) else None,
            "batch_sizes": list(self.batch_sizes),
            "rules": list(self.rules),
            "percentiles": list(self.percentiles),
            "metrics": {
                metric: {
                    "n_tokens": n,
                    "percentile_values": [
                        [q, v] for q, v in self.percentile_values_.get(metric, {}).items()
                    ],
                }
                for metric, n in self.n_tokens_.items()
            },
            "thresholds": [
                {"metric": m, "rule": r, "batch_size": n, "threshold": t, "n_batches": k}
                for (m, r, n), (t, k) in self.thresholds_.items()
            ],
            "signature": self.signature,
            "coverage": self.coverage,
            "sides": self.sides,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibrator:
        """Rebuild a fitted Calibrator from :meth:`to_dict` output, checking format and version."""
        if not isinstance(data, Mapping):
            raise ValueError(f"not a {FORMAT} document (a JSON {type(data).__name__}, not an object)")
        try:
            return cls._from_dict(data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed {FORMAT} document ({type(exc).__name__}: {exc})") from None

    @classmethod
    def load(cls, path: str | Path) -> Calibrator:
        """Read a calibration file; any problem is a one-line ``ValueError`` naming the file."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read calibration file ({exc})") from None

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any]) -> Calibrator:
        if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"not a {FORMAT} version {FORMAT_VERSION} document "
                f"(format={data.get('format')!r}, version={data.get('version')!r})"
            )
        cal = cls(
            data["batch_sizes"], data["fpr"], data["rules"], data["resample"], data["random_state"]
        )
        cal.n_tokens_ = {m: int(d["n_tokens"]) for m, d in data["metrics"].items()}
        cal.percentile_values_ = {
            m: {float(q): float(v) for q, v in d["percentile_values"]}
            for m, d in data["metrics"].items()
            if m != EXACT_MATCH
        }
        cal.thresholds_ = {
            (t["metric"], t["rule"], int(t["batch_size"])): (
                float(t["threshold"]),
                int(t["n_batches"]),
            )
            for t in data["thresholds"]
        }
        cal.signature = data.get("signature")
        cal.coverage = data.get("coverage")
        cal.sides = _sides(data.get("sides"))  # absent from files written before the side counts
        return cal

    def _rules_for(self, metric: str) -> tuple[str, ...]:
        return (MISMATCH_RATE,) if metric == EXACT_MATCH else self.rules

    @staticmethod
    def _check_metric_scores(metric: str, scores: ArrayLike, name: str) -> np.ndarray:
        return as_exact_match(scores, name) if metric == EXACT_MATCH else as_scores(scores, name)

    def _honest_batches(
        self, per_token: np.ndarray, n: int, metric: str, rng: np.random.Generator
    ) -> np.ndarray:
        if self.resample is not None:
            return sampled_batch_means(per_token, n, self.resample, rng)
        needed = n * min_batches(self.fpr)
        if per_token.size < needed:
            raise ValueError(
                f"batch size {n} needs at least {needed} honest {metric!r} tokens "
                f"({min_batches(self.fpr)} disjoint batches for fpr={self.fpr}), have "
                f"{per_token.size}; fit smaller batch_sizes, add honest data, or pass "
                f"resample=<windows> to bootstrap (command line: --resample WINDOWS)"
            )
        return batch_means(per_token, n)

    def _check_fitted(self) -> None:
        if not hasattr(self, "thresholds_"):
            raise NotFittedError("this Calibrator is not fitted; call fit(honest_scores) first")

    def _check_detector(self, metric: str, rule: str, batch_size: int) -> None:
        self._check_metric_rule(metric, rule)
        if batch_size not in self.batch_sizes:
            raise ValueError(
                f"batch size {batch_size} was not calibrated (fitted: {list(self.batch_sizes)}); "
                "score at a fitted size or refit with this size"
            )

    def _check_metric_rule(self, metric: str, rule: str) -> None:
        self._check_fitted()
        if metric not in self.n_tokens_:
            raise ValueError(
                f"metric {metric!r} was not calibrated; fitted: {sorted(self.n_tokens_)}"
            )
        if rule not in self._rules_for(metric):
            raise ValueError(
                f"rule {rule!r} not fitted for {metric!r}; fitted: {self._rules_for(metric)}"
            )


def _sides(raw: Any) -> list[dict] | None:
    """A document's honest side counts, checked: a list of {"group", "tokens", "positive", "negative"} and,
    from files that count it, "beyond" (at most "negative"; absent from older files, which judge two sides)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ValueError(f"'sides' must be a list of honest groups, got {type(raw).__name__}")
    out = []
    for g in raw:
        counts = {k: int(g[k]) for k in ("tokens", "positive", "negative", "beyond") if k != "beyond" or k in g}
        if min(counts.values()) < 0:
            raise ValueError(f"'sides' group {g.get('group')!r} has a negative count")
        if counts.get("beyond", 0) > counts["negative"]:
            raise ValueError(f"'sides' group {g.get('group')!r} counts more 'beyond' than 'negative' mismatches")
        out.append({"group": str(g["group"]), **counts})
    return out


def _transform(scores: np.ndarray, rule: str, values: Mapping[float, float]) -> np.ndarray:
    """Per-token scores whose batch mean is the rule's statistic."""
    kind, percentiles = parse_rule(rule)
    if kind == MISMATCH_RATE:
        return 1.0 - scores
    if kind == "bound":
        return clip_scores(scores, _bound_value(rule))
    if kind == "clip":
        return clip_scores(scores, values[percentiles[0]])
    return tail_scores(scores, clip_hi=values[percentiles[1]], zero_below=values[percentiles[0]])


PRECISION_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                   "fp16": "float16", "float16": "float16"}


def normalize_precisions(names: Iterable[str]) -> list[str]:
    """Precision names as torch spells them (fp32 -> float32, bf16 -> bfloat16); others (w8, fp8-kv) kept."""
    out = {PRECISION_NAMES.get(n.strip().lower(), n.strip()) for n in names if n.strip()}
    if not out:
        raise ValueError("precisions: name at least one honest precision (e.g. fp32,bf16)")
    return sorted(out)


def coverage_warnings(calibrator: Calibrator, cli: bool = False) -> list[str]:
    """What a calibration's honest null leaves out, so a user learns before a verdict that honest
    bf16 providers will be rejected by an fp32-only null (REFERENCE.md: honest vLLM bf16 is 97% exact
    against the fp32 reference; RESULTS.md section 8)."""
    precisions = (calibrator.coverage or {}).get("precisions")
    pooled = ("verinfer calibrate fp32.scores.parquet bf16.scores.parquet --precisions fp32,bf16 -o pooled.json"
              if cli else "calibrate([fp32_scores, bf16_scores], precisions=['fp32', 'bf16'])")
    if not precisions:
        return [f"the honest precisions behind these scores are not recorded (pass {'--precisions' if cli else 'precisions='}"
                " fp32,bf16): a verdict cannot say whether honest bf16 noise is covered"]
    if "bfloat16" not in precisions:
        return [f"fitted on {', '.join(precisions)} only: honest bf16 providers (as GPU engines serve) will be "
                f"rejected; for a null that covers them verify honest bf16 traces too and pool them: {pooled}"]
    return []


def signature_mismatch(calibration: dict | None, data: dict | None) -> str | None:
    """Why a calibration does not fit the scores it would judge (None when it does).

    ``calibration`` and ``data`` are signatures as ``verinfer.scoring.scores.signature`` writes them:
    model, verifier dtype and the sampling settings (every field but the seed). Every sampling
    setting of the data must be one the calibration was fitted on.
    """
    if calibration is None:
        return ("the calibration records no signature (fitted before verinfer recorded one): "
                "refit it with `verinfer calibrate` on scores from this version")
    if data is None:
        return None
    for key in ("model", "dtype"):
        if calibration.get(key) != data.get(key):
            return f"{key}: calibrated on {calibration.get(key)!r}, these scores have {data.get(key)!r}"
    # A null fitted on vLLM's own hidden states (an engine judged by itself: less honest noise) would
    # flag honest scores of another reference; the transformers null (the shipped ones) judges both.
    fitted_on, scored_by = calibration.get("reference", "transformers"), data.get("reference", "transformers")
    if fitted_on != "transformers" and fitted_on != scored_by:
        return f"reference: calibrated on the {fitted_on} reference's scores, these are the {scored_by} reference's"
    fitted = [json.dumps(s, sort_keys=True) for s in calibration.get("sampling", [])]
    for s in data.get("sampling", []):
        if json.dumps(s, sort_keys=True) not in fitted:
            return f"sampling: calibrated on {calibration.get('sampling')}, these scores have {s}"
    return None
