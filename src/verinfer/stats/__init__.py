"""Statistics over per-token verification scores: pooling, calibration and evaluation."""

from verinfer.stats.calibration import Calibrator
from verinfer.stats.evaluation import (
    Interval,
    Proportion,
    auc_at_fpr,
    bootstrap_ci,
    held_out_fpr,
    tokens_needed,
    train_test_split_by_sequence,
    wilson_interval,
)
from verinfer.stats.pooling import (
    batch_means,
    clip_scores,
    finite_percentile,
    pool_clipped_mean,
    pool_exact_mismatch_rate,
    pool_mean,
    pool_tail,
    sampled_batch_means,
    tail_scores,
)

__all__ = [
    "Calibrator",
    "Interval",
    "Proportion",
    "auc_at_fpr",
    "batch_means",
    "bootstrap_ci",
    "clip_scores",
    "finite_percentile",
    "held_out_fpr",
    "pool_clipped_mean",
    "pool_exact_mismatch_rate",
    "pool_mean",
    "pool_tail",
    "sampled_batch_means",
    "tail_scores",
    "tokens_needed",
    "train_test_split_by_sequence",
    "wilson_interval",
]
