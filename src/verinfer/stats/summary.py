"""Summaries of a verified trace set: pooled token statistics, the calibrated verdict (one rule:
``verinfer.stats.verdict``) and the activation-commit checks with their calibrated verdicts.

Without a calibration the summary reports the scores and says its verdict is uncalibrated; with
one it judges the tokens and each calibrated commit metric; an unparseable commit fails the check.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from verinfer.stats.calibration import Calibrator
from verinfer.stats.pooling import MARGIN_CLIP, clip_scores
from verinfer.stats.sides import fit_side_null
from verinfer.stats.verdict import COMMIT_RULE, Verdict, calibrated_verdict, default_batch_size

UNCALIBRATED = "uncalibrated: pass a calibration file for a verdict with a known false-positive rate"


@dataclass
class Summary:
    """Pooled scores of a set of traces, and the calibrated verdict when a calibration is given."""

    traces: int
    tokens: int
    exact_match_rate: float
    margin_zero_rate: float
    mean_margin: float  # clipped at MARGIN_CLIP
    filtered_rate: float
    mean_cross_entropy: float  # clipped at the same bound in nats
    verdict: Verdict | None = None
    note: str = UNCALIBRATED  # why there is no verdict
    commits: dict[str, Any] = field(default_factory=dict)
    commit_verdicts: dict[str, Verdict] = field(default_factory=dict)
    calibration: str | None = None  # which calibration judged (a file, or a shipped default)

    @property
    def consistent(self) -> bool | None:
        """False when the tokens or any calibrated commit check diverge, or a commit is invalid;
        None when nothing was calibrated."""
        if self.commits.get("errors"):
            return False
        verdicts = ([self.verdict] if self.verdict else []) + list(self.commit_verdicts.values())
        return None if not verdicts else all(v.consistent for v in verdicts)

    @property
    def verdict_text(self) -> str:
        return self.verdict.text if self.verdict else self.note

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict.to_dict() if self.verdict else None
        d["commit_verdicts"] = {m: v.to_dict() for m, v in self.commit_verdicts.items()}
        d["consistent"] = self.consistent
        return d


def token_statistics(columns: dict[str, np.ndarray]) -> dict[str, Any]:
    """Pooled statistics of per-token scores (clipped means at ``MARGIN_CLIP``)."""
    margin = np.asarray(columns["margin"], dtype=np.float64)
    ce = np.asarray(columns["cross_entropy"], dtype=np.float64)
    return dict(traces=len(set(columns["trace_id"])), tokens=int(margin.size),
                exact_match_rate=float(np.asarray(columns["exact_match"], dtype=bool).mean()),
                margin_zero_rate=float((margin == 0).mean()), mean_margin=float(clip_scores(margin, MARGIN_CLIP).mean()),
                filtered_rate=float(np.isinf(margin).mean()), mean_cross_entropy=float(clip_scores(ce, MARGIN_CLIP).mean()))


def summarize(columns: dict[str, np.ndarray], calibrator: Calibrator | None = None, batch_size: int | None = None,
              commit_checks: list | None = None, commit_scores: dict[str, np.ndarray] | None = None,
              alpha: float | None = None) -> Summary:
    """Pool per-token scores; with a calibrator, judge them (and the commit scores) by the one verdict rule.

    The caller checks that the calibration fits the scores (``signature_mismatch``) before scoring.
    """
    summary = Summary(**token_statistics(columns))
    if commit_checks:
        summary.commits = summarize_commits(commit_checks)
    if calibrator is None:
        return summary
    margin = np.asarray(columns["margin"], dtype=np.float64)
    size = batch_size or default_batch_size(calibrator, margin.size, alpha)
    if size > margin.size:
        summary.note = f"too few tokens: {margin.size} < the smallest calibrated batch ({size})"
    else:
        summary.verdict = calibrated_verdict(columns, calibrator, size, alpha=alpha)
    for metric, values in (commit_scores or {}).items():
        if metric not in calibrator.percentile_values_:
            continue
        csize = batch_size if batch_size in calibrator.batch_sizes else default_batch_size(calibrator, values.size, alpha)
        if csize <= values.size:
            summary.commit_verdicts[metric] = calibrated_verdict(values, calibrator, csize, metric, COMMIT_RULE, alpha)
    return summary


def fit_calibrator(columns: dict[str, np.ndarray], batch_sizes: tuple[int, ...], fpr: float = 0.01,
                   commit_scores: dict[str, np.ndarray] | None = None, signature: dict | None = None,
                   shape: bool = True, resample: int | None = None, coverage: dict | None = None,
                   groups: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> Calibrator:
    """Fit the margin / cross-entropy / exact-match detectors on honest per-token scores, the
    sampler-shape null (each honest group's mismatch side counts, ``verinfer.stats.sides``) when the
    scores carry ``depth_shift`` and ``shape`` is on, plus the commit detectors (fingerprint_l2 per
    fingerprint, toploc per chunk) when honest commit scores are given. ``groups`` (label -> that
    honest provider's score columns, ``depth_shift`` and ``margin``: one per precision)
    keeps the providers apart, so the verdict can take the least favourable; without it the pooled
    scores are one group. ``coverage`` records
    the honest precisions and engines the scores came from (``Calibrator.coverage``)."""
    honest = {"margin": columns["margin"], "cross_entropy": columns["cross_entropy"],
              "exact_match": np.asarray(columns["exact_match"], dtype=np.float64)}
    calibrator = Calibrator(batch_sizes=batch_sizes, fpr=fpr, resample=resample).fit({**honest, **(commit_scores or {})})
    if shape and columns.get("depth_shift") is not None:
        calibrator.sides = fit_side_null({"pooled": columns} if groups is None else groups)
    calibrator.signature = signature
    calibrator.coverage = coverage
    return calibrator


def summarize_commits(checks: list) -> dict:
    """Pool activation-commit checks: TOPLOC chunk pass rate (reference thresholds), fingerprint
    distances (uncalibrated: their honest band depends on the hardware, see RESULTS.md) and the
    commits that could not be parsed (each a failed check)."""
    l2 = [c.fingerprint_l2 for c in checks if c.fingerprint_l2 is not None]
    passed = [c.toploc_passed for c in checks if c.toploc_passed is not None]
    out: dict[str, Any] = {"traces_with_commits": len(checks), "errors": [c.error for c in checks if c.error]}
    if l2:
        all_l2 = np.concatenate(l2)
        out["activation_difr"] = {"fingerprints": int(all_l2.size), "mean_l2": float(all_l2.mean()),
                                  "max_l2": float(all_l2.max())}
    if passed:
        all_p = np.concatenate(passed)
        out["toploc"] = {"chunks": int(all_p.size), "passed": int(all_p.sum()),
                         "failed_traces": [c.trace_id for c in checks
                                           if c.toploc_passed is not None and not c.toploc_passed.all()]}
    return out
