"""Verdicts: is a provider's pooled score consistent with the honest band, at a stated FPR?

The pooled statistic is the mean clipped margin over all of a provider's tokens, with a 95%
bootstrap interval over sequences (tokens of one sequence are correlated, so sequences are the
unit that gets resampled). The null hypothesis is composite: the provider runs *some* honest
configuration (the fp32 reference, or bf16 as GPU providers do). For each honest band the p-value
is the rank of the statistic among pseudo-audits of the same size, ``p_b = (1 + #{>= s}) / (R + 1)``,
which resample whole sequences of that band until they hold as many tokens as the audit; the
audit's p-value is the largest, ``p = max_b p_b``, so a provider is called inconsistent only when it
is inconsistent with every honest band (pooling the bands instead would test against a mixture
and flag honest bf16 providers, as measured in RESULTS.md section 7). Each ``p_b`` is a bootstrap
estimate, like ``Calibrator(resample=R)``, not an exact conformal p-value: with n sequences in a
band, a p-value below ``1 / (n + 1)`` says the statistic lies beyond what the band shows and rests
on the bootstrap's extrapolation; verdicts flag it (``beyond_pool``) and give n.
A provider is judged inconsistent when ``p < fpr``.

*Tokens needed* is when a sequential auditor would have stopped: the statistic is re-tested on
doubling prefixes of the sequences (1, 2, 4, ... sequences, then all; from the first prefix as
long as a median honest sequence) at ``fpr / L`` each for L looks (Bonferroni), so stopping at the
first rejection keeps the overall false-positive rate at ``fpr``. Several providers in one audit get Holm-Bonferroni adjusted p-values (``holm``), so the
chance of wrongly flagging any honest one stays at ``fpr``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.stats import binomtest

from verinfer.audit.bands import Bands, pseudo_audits
from verinfer.stats import Calibrator, bootstrap_ci


@dataclass
class Verdict:
    tokens: int
    sequences: int
    statistic: float  # mean clipped margin
    ci_low: float
    ci_high: float
    exact_match_rate: float
    p_value: float
    fpr: float
    consistent: bool
    tokens_needed: int | None  # first sequential look that rejects (None: never)
    resembles: str | None
    method: str
    band_ranges: dict = field(default_factory=dict)  # band -> [2.5%, 50%, 97.5%] at this many tokens
    p_adjusted: float | None = None  # Holm-adjusted, when several providers are audited together
    pool_sequences: int | None = None  # honest sequences behind the p-value (bands verdicts)

    @property
    def beyond_pool(self) -> bool:
        """The p-value is smaller than an honest band of n sequences alone can support (1 / (n + 1))."""
        return self.pool_sequences is not None and self.p_value < 1 / (self.pool_sequences + 1)

    @property
    def text(self) -> str:
        p = self.p_adjusted if self.p_adjusted is not None else self.p_value
        which = "Holm-adjusted p" if self.p_adjusted is not None else "p"
        head = ("CONSISTENT with the claimed configuration" if self.consistent
                else "INCONSISTENT with the claimed configuration")
        needed = f"; detected after {self.tokens_needed} tokens" if self.tokens_needed and not self.consistent else ""
        like = f"; resembles {self.resembles}" if self.resembles else ""
        beyond = (f" (beyond what {self.pool_sequences} sequences per honest band show: a bootstrap extrapolation)"
                  if self.beyond_pool else "")
        return (f"{head} at {self.fpr:.0%} FPR: mean clipped margin {self.statistic:.4f} "
                f"(95% CI {self.ci_low:.4f}-{self.ci_high:.4f}) over {self.tokens} tokens in {self.sequences} "
                f"sequences, {which} = {p:.3g}{beyond}{needed}{like}")

    def to_dict(self) -> dict:
        return {**asdict(self), "beyond_pool": self.beyond_pool, "text": self.text}


def pooled(seq: np.ndarray) -> float:
    return float(seq[:, 1].sum() / max(seq[:, 0].sum(), 1.0))


def sequence_ci(seq: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the pooled statistic, resampling sequences."""
    if len(seq) < 2 or np.ptp(seq[:, 1] / np.maximum(seq[:, 0], 1)) == 0:
        s = pooled(seq)
        return s, s
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ci = bootstrap_ci(lambda idx: pooled(seq[np.asarray(idx, dtype=int)]), np.arange(len(seq), dtype=float),
                          n_boot=2000, rng=seed)
    return ci.low, ci.high


def _looks(n: int) -> list[int]:
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _draws(n_sequences: int, fpr: float) -> int:
    """Enough honest pseudo-audits to resolve p-values well below ``fpr / looks``."""
    return max(999, math.ceil(20 * len(_looks(n_sequences)) / fpr))


def p_value(seq: np.ndarray, honest: list[np.ndarray], fpr: float, rng: np.random.Generator,
            draws: int | None = None) -> float:
    """Composite-null p-value: the largest over honest bands of the rank of ``seq``'s pooled
    statistic among that band's pseudo-audits of the same size."""
    draws = draws or _draws(len(seq), fpr)
    stat, tokens = pooled(seq), int(seq[:, 0].sum())
    return max(float((1 + np.count_nonzero(pseudo_audits(band, tokens, draws, rng) >= stat - 1e-12)) / (draws + 1))
               for band in honest)


def tokens_needed(seq: np.ndarray, honest: list[np.ndarray], fpr: float, rng: np.random.Generator) -> int | None:
    """Tokens at the first doubling prefix rejected at ``fpr / looks`` (None: never rejected).

    Pseudo-audits are made of whole honest sequences, so a prefix shorter than a typical honest
    sequence would be compared with a null that averages over more tokens (too narrow): looks
    start once the prefix holds the honest sequences' median length.
    """
    shortest = float(np.median(np.concatenate(honest)[:, 0]))
    looks = [k for k in _looks(len(seq)) if seq[:k, 0].sum() >= shortest] or [len(seq)]
    draws = _draws(len(seq), fpr)
    return next((int(seq[:k, 0].sum()) for k in looks
                 if p_value(seq[:k], honest, fpr, rng, draws) < fpr / len(looks)), None)


def judge(seq: np.ndarray, bands: Bands, fpr: float = 0.01, seed: int = 0) -> Verdict:
    """Test a provider's per-sequence stats ``[tokens, clipped margin sum, exact]`` against the bands."""
    if len(seq) == 0 or seq[:, 0].sum() == 0:
        raise ValueError("no tokens to judge")
    rng = np.random.default_rng(seed)
    honest = bands.honest_bands()
    tokens, stat = int(seq[:, 0].sum()), pooled(seq)
    p = p_value(seq, honest, fpr, rng)
    needed = tokens_needed(seq, honest, fpr, rng)
    ranges = {}
    for b in bands.bands:
        q = np.percentile(pseudo_audits(b.sequences, tokens, 2000, rng), [2.5, 50, 97.5])
        ranges[b.label] = [float(x) for x in q]
    inside = [name for name, (lo, _, hi) in ranges.items() if lo <= stat <= hi]
    candidates = inside or list(ranges)
    resembles = min(candidates, key=lambda name: abs(ranges[name][1] - stat) if inside
                    else min(abs(ranges[name][0] - stat), abs(ranges[name][2] - stat)))
    lo, hi = sequence_ci(seq, seed)
    names = ", ".join(b.label for b in bands.bands if b.honest)
    method = (f"largest over the honest bands ({names}) of the bootstrap p-value of the pooled statistic among "
              f"{_draws(len(seq), fpr)} pseudo-audits resampled from each band's sequences "
              f"({Path(bands.source).name}); per-token clip {bands.clip:.4g}")
    return Verdict(tokens, len(seq), stat, lo, hi, float(seq[:, 2].sum() / tokens), p, fpr, p >= fpr, needed,
                   resembles, method, ranges, pool_sequences=min(len(b) for b in honest))


def judge_calibrated(seq: np.ndarray, margins: np.ndarray, calibrator: Calibrator, batch_size: int | None,
                     seed: int = 0) -> Verdict:
    """Verdict from a ``verinfer calibrate`` file: batches of tokens flagged by its bounded-margin
    detector, and the binomial p-value of that many flags when honest batches flag at ``fpr``."""
    from verinfer.verify.report import DETECTOR

    metric, rule = DETECTOR
    margins = np.asarray(margins, dtype=np.float64)
    size = batch_size or min(calibrator.batch_sizes, key=lambda s: (s > margins.size, -s))
    if size > margins.size:
        raise ValueError(f"too few tokens ({margins.size}) for the smallest calibrated batch ({size})")
    flags = calibrator.predict(margins, size, metric=metric, rule=rule)
    looks = _looks(flags.size)

    def p_value(f: np.ndarray) -> float:
        return float(binomtest(int(f.sum()), f.size, calibrator.fpr, alternative="greater").pvalue)

    p = p_value(flags)
    needed = next((k * size for k in looks if p_value(flags[:k]) < calibrator.fpr / len(looks)), None)
    lo, hi = sequence_ci(seq, seed)
    method = (f"binomial p-value of {int(flags.sum())}/{flags.size} batches of {size} tokens flagged by the "
              f"calibrated {metric} {rule} detector (honest batches flag at <= {calibrator.fpr:.0%})")
    tokens = int(seq[:, 0].sum())
    return Verdict(tokens, len(seq), pooled(seq), lo, hi, float(seq[:, 2].sum() / tokens), p, calibrator.fpr,
                   p >= calibrator.fpr, needed, None, method)


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (family-wise error control over the providers)."""
    order = np.argsort(p_values, kind="stable")
    m, running, out = len(p_values), 0.0, [0.0] * len(p_values)
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out
