"""Summaries of per-token scores, verdicts, and the Parquet score file.

A verdict is only as good as its calibration: without a calibration file the summary reports the
scores and says the verdict is uncalibrated; with one it reports, per batch of tokens, whether
the calibrated detector flags it and at which false-positive rate it was calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from verinfer.stats import Calibrator, clip_scores, wilson_interval

MARGIN_CLIP = 20.0  # raw-logit units: the paper's bounded margin min(margin, clip) for uncalibrated summaries
DETECTOR = ("margin", "bound:20")  # the paper's bounded margin min(margin, 20) for verdicts

SCORE_SCHEMA = pa.schema([
    ("trace_id", pa.string()), ("position", pa.int64()), ("claimed", pa.int64()), ("verifier_token", pa.int64()),
    ("exact_match", pa.bool_()), ("margin", pa.float64()), ("filter_distance", pa.float64()),
    ("filtered", pa.bool_()), ("cross_entropy", pa.float64()), ("logit_rank", pa.int64()),
    ("gumbel_rank", pa.int64()),
])


class ScoreWriter:
    """Streams score blocks into one Parquet file, written under a temporary name until closed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._writer = pq.ParquetWriter(self._tmp, SCORE_SCHEMA)

    def write(self, columns: dict[str, np.ndarray]) -> None:
        self._writer.write_table(pa.table({k: columns[k] for k in SCORE_SCHEMA.names}, schema=SCORE_SCHEMA))

    def close(self) -> Path:
        self._writer.close()
        self._tmp.replace(self.path)
        return self.path

    def __enter__(self) -> "ScoreWriter":
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._writer.close()
            self._tmp.unlink(missing_ok=True)


def read_scores(path: str | Path) -> dict[str, np.ndarray]:
    table = pq.read_table(path)
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


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
    verdict: str
    flagged_batches: int | None = None
    batches: int | None = None
    batch_size: int | None = None
    fpr: float | None = None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def summarize(columns: dict[str, np.ndarray], calibrator: Calibrator | None = None,
              batch_size: int | None = None) -> Summary:
    """Pool per-token scores; with a calibrator, flag each batch of ``batch_size`` tokens."""
    margin = np.asarray(columns["margin"], dtype=np.float64)
    em = np.asarray(columns["exact_match"], dtype=bool)
    ce = np.asarray(columns["cross_entropy"], dtype=np.float64)
    base = dict(
        traces=len(set(columns["trace_id"])), tokens=int(margin.size),
        exact_match_rate=float(em.mean()), margin_zero_rate=float((margin == 0).mean()),
        mean_margin=float(clip_scores(margin, MARGIN_CLIP).mean()), filtered_rate=float(np.isinf(margin).mean()),
        mean_cross_entropy=float(clip_scores(ce, MARGIN_CLIP).mean()),
    )
    if calibrator is None:
        return Summary(**base, verdict="uncalibrated: pass a calibration file for a verdict with a known false-positive rate")
    metric, rule = DETECTOR
    size = batch_size or min(calibrator.batch_sizes, key=lambda s: (s > margin.size, -s))
    if size > margin.size:
        return Summary(**base, verdict=f"too few tokens: {margin.size} < the smallest calibrated batch ({size})")
    flags = calibrator.predict(margin, size, metric=metric, rule=rule)
    k, n = int(flags.sum()), int(flags.size)
    ci = wilson_interval(k, n)
    verdict = (
        f"DIVERGES from the claimed configuration: {k}/{n} batches of {size} tokens flagged "
        f"(flag rate 95% CI {ci.low:.0%}-{ci.high:.0%}; honest batches are flagged at <= {calibrator.fpr:.0%})"
        if k / n > calibrator.fpr and ci.low > calibrator.fpr else
        f"consistent with the claimed configuration: {k}/{n} batches of {size} tokens flagged "
        f"(flag rate 95% CI {ci.low:.0%}-{ci.high:.0%}; calibrated false-positive rate {calibrator.fpr:.0%})"
    )
    return Summary(**base, verdict=verdict, flagged_batches=k, batches=n, batch_size=size, fpr=calibrator.fpr,
                   details={"detector": f"{metric} {rule}", "threshold": calibrator.threshold(metric, rule, size)})


def fit_calibrator(columns: dict[str, np.ndarray], batch_sizes: tuple[int, ...], fpr: float = 0.01,
                   commit_scores: dict[str, np.ndarray] | None = None) -> Calibrator:
    """Fit the margin / cross-entropy / exact-match detectors on honest per-token scores, plus the
    commit detectors (fingerprint_l2 per fingerprint, toploc per chunk) when honest commit scores are given."""
    return Calibrator(batch_sizes=batch_sizes, fpr=fpr).fit({
        "margin": columns["margin"], "cross_entropy": columns["cross_entropy"],
        "exact_match": np.asarray(columns["exact_match"], dtype=np.float64), **(commit_scores or {}),
    })




COMMIT_SCHEMA = pa.schema([("trace_id", pa.string()), ("metric", pa.string()), ("index", pa.int64()),
                           ("score", pa.float64())])
COMMIT_METRICS = {"fingerprint_l2": "Activation-DiFR L2 per logged token",
                  "toploc": "TOPLOC exponent mismatches + mean mantissa error per 32-token chunk"}
COMMIT_RULE = "clip:99.9"


def commit_scores(checks: list) -> dict[str, np.ndarray]:
    """Continuous commit scores (higher = more divergent) by metric, in trace order."""
    l2 = [c.fingerprint_l2 for c in checks if c.fingerprint_l2 is not None]
    tl = [c.toploc_score for c in checks if c.toploc_score is not None]
    out = {}
    if l2:
        out["fingerprint_l2"] = np.concatenate(l2).astype(np.float64)
    if tl:
        out["toploc"] = np.concatenate(tl).astype(np.float64)
    return out


def write_commit_scores(checks: list, path: str | Path) -> Path:
    """One row per fingerprint (metric fingerprint_l2) and per TOPLOC chunk (metric toploc)."""
    cols: dict[str, list] = {n: [] for n in COMMIT_SCHEMA.names}
    for c in checks:
        for metric, values in (("fingerprint_l2", c.fingerprint_l2), ("toploc", c.toploc_score)):
            if values is None:
                continue
            cols["trace_id"] += [c.trace_id] * len(values)
            cols["metric"] += [metric] * len(values)
            cols["index"] += list(range(len(values)))
            cols["score"] += [float(v) for v in values]
    path = Path(path)
    pq.write_table(pa.table(cols, schema=COMMIT_SCHEMA), path)
    return path


def read_commit_scores(path: str | Path) -> dict[str, np.ndarray]:
    table = pq.read_table(path).to_pydict()
    metrics = np.asarray(table["metric"], dtype=object)
    scores = np.asarray(table["score"], dtype=np.float64)
    return {m: scores[metrics == m] for m in COMMIT_METRICS if (metrics == m).any()}


def commit_verdicts(scores: dict[str, np.ndarray], calibrator: Calibrator, batch_size: int | None) -> dict[str, str]:
    """Calibrated verdict per commit metric the calibrator knows (batch = fingerprints or chunks)."""
    out = {}
    for metric, values in scores.items():
        if metric not in calibrator.percentile_values_:
            continue
        size = batch_size if batch_size in calibrator.batch_sizes else min(
            calibrator.batch_sizes, key=lambda s: (s > values.size, -s))
        if size > values.size:
            out[metric] = f"too few {metric} scores ({values.size}) for the smallest calibrated batch ({size})"
            continue
        flags = calibrator.predict(values, size, metric=metric, rule=COMMIT_RULE)
        k, n = int(flags.sum()), int(flags.size)
        ci = wilson_interval(k, n)
        word = "DIVERGES" if k / n > calibrator.fpr and ci.low > calibrator.fpr else "consistent"
        out[metric] = (f"{word}: {k}/{n} batches of {size} flagged (95% CI {ci.low:.0%}-{ci.high:.0%}; "
                       f"calibrated false-positive rate {calibrator.fpr:.0%})")
    return out


def summarize_commits(checks: list) -> dict:
    """Pool activation-commit checks: TOPLOC chunk pass rate (reference thresholds) and fingerprint
    distances (uncalibrated: their honest band depends on the hardware, see RESULTS.md)."""
    l2 = [c.fingerprint_l2 for c in checks if c.fingerprint_l2 is not None]
    passed = [c.toploc_passed for c in checks if c.toploc_passed is not None]
    out = {"traces_with_commits": len(checks), "errors": [c.error for c in checks if c.error]}
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
