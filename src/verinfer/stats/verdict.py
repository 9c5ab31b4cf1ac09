"""The one verdict rule: are these scores consistent with the honest configuration, at a stated FPR?

Every command that judges (``verify``, ``audit``, the demo and the public API) goes through this
module, so the same scores get the same verdict wherever they are judged. There are two kinds of
evidence and one sequential test over them.

*Calibrated flags* (``flag_verdict``): a ``verinfer calibrate`` detector flags consecutive batches of
``size`` tokens; its threshold is a conformal quantile of honest batches, so an honest batch is
flagged with probability at most the calibration's ``fpr``. A look at the first ``n`` batches has
the one-sided binomial p-value of its ``k`` flags at rate ``fpr`` (SciPy's binomial tail, as ``binomtest``).

*Pooled sequences* (``pooled_verdict``): the mean clipped margin over a provider's sequences against
honest bands (``verinfer audit bands``). The null is composite (the provider runs *some* honest
configuration: fp32, or bf16 as GPU providers do). A look's p-value is the largest over honest bands
of the statistic's rank among pseudo-audits of the same size that resample whole honest sequences,
``(1 + #{>= s}) / (R + 1)``; with n sequences per band, p below ``1 / (n + 1)`` rests on the
bootstrap's extrapolation and the verdict says so (``beyond_pool``).

*Several detectors, one test.* A token verdict flags batches with the calibrated margin detector
and, when the calibration holds honest mismatches, adds the sampler-shape detectors ``narrower``,
``wider`` and ``beyond`` (``verinfer.stats.sides``: honest noise puts a mismatched claim on both
sides of the verifier's token and rarely beyond the claimed filters, a wrong top-k / top-p / min-p
or temperature on one side, a wider filter beyond the claimed boundary). These count the
mismatches of their kind over every token up to the look (a batch rarely holds a deviating
mismatch) and give each look the p-value of Fisher's exact test against the least favourable
honest group. Each look's p-value is the Bonferroni minimum over the ``m`` detectors,
``min(1, m * min_j p_j)``, so the detectors add power without adding a rule or raising the
false-positive rate. A flag verdict also states the fewest flagged batches that could reject (one
flagged batch at p = fpr never can) and the tokens after the last whole batch, which are not judged.

*The sequential test.* Evidence is looked at on doubling prefixes (1, 2, 4, ... units, then all),
and each look is tested at ``alpha / L`` for ``L`` looks (Bonferroni). The verdict's p-value is
``min(1, L * min_k p_k)`` and the set is INCONSISTENT when it is below ``alpha``: the chance of
flagging an honest set stays at ``alpha`` although an auditor may stop at the first rejecting look,
whose size is reported as *tokens needed* (DiFR section 5 measures power the same way, in tokens).
Several sets judged together (providers of one audit) get Holm-Bonferroni adjusted p-values
(``holm``), so the chance of wrongly flagging any honest one stays at ``alpha``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.stats import binom, binomtest

from verinfer.stats.calibration import Calibrator
from verinfer.stats.evaluation import bootstrap_ci, wilson_interval
from verinfer.stats.pooling import MARGIN_CLIP
from verinfer.stats.sides import detectors as side_detectors
from verinfer.stats.sides import (
    honest_share,
    judged_groups,
    oriented,
    side_counts,
    side_kinds,
    side_p_value,
)

WHERE = {"narrower": "on the narrower side of the verifier's tokens", "wider": "on the wider side of the verifier's "
         "tokens", "beyond": "beyond the claimed sampler's filters"}  # sampler-shape detector -> its mismatches
CLIPPED = ("margin", "clip:99.9")  # margins clipped at their honest 99.9th percentile (DiFR section 4)
DETECTOR = ("margin", f"bound:{MARGIN_CLIP:g}")  # the bounded margin min(margin, 20): for a null without noise
COMMIT_RULE = "clip:99.9"  # commit scores (fingerprint L2, TOPLOC) clipped at their honest 99.9th percentile


@dataclass
class Verdict:
    """A calibrated statement about one set of scores (see the module docstring for the test)."""

    consistent: bool
    p_value: float  # sequential: min(1, looks * smallest look p-value)
    alpha: float  # the verdict's false-positive rate
    tokens: int
    units: int  # batches (flags) or sequences (pooled)
    unit: str  # "batch" or "sequence"
    statistic: float  # flag rate, or mean clipped margin
    statistic_name: str
    ci_low: float  # 95% interval of the statistic (Wilson for flag rates, sequence bootstrap for pooled)
    ci_high: float
    looks: int
    tokens_needed: int | None  # tokens at the first look that rejects (None: never)
    method: str
    subject: str = "the claimed configuration"
    flagged: int | None = None  # flags: batches flagged
    batch_size: int | None = None
    exact_match_rate: float | None = None
    sequences: int | None = None
    resembles: str | None = None  # pooled: the band whose 95% range holds the statistic (None: none does)
    nearest: str | None = None  # pooled: the band whose range is nearest the statistic (inside or not)
    band_ranges: dict = field(default_factory=dict)  # band -> [2.5%, 50%, 97.5%] of pseudo-audits
    pool_sequences: int | None = None  # pooled: honest sequences per band behind the p-value
    p_adjusted: float | None = None  # Holm-adjusted, when several sets are judged together
    interval: bool = True  # False: the statistic has no interval (ci_low == ci_high == statistic)
    detectors: dict = field(default_factory=dict)  # detector -> {"flagged", "p"} or, sides, {"on_side", "mismatches",
    #                                                "honest_share", "p"} (each with its own sequential p)
    decided_by: str | None = None  # flags: the detector with the smallest p-value
    unjudged_tokens: int = 0  # flags: tokens after the last whole batch (not judged)
    minimum_evidence: str | None = None  # flags: the fewest flagged batches that could reject here
    note: str | None = None  # what the calibration does not cover, when that may explain the verdict

    @property
    def fpr(self) -> float:
        return self.alpha

    @property
    def beyond_pool(self) -> bool:
        """The p-value is smaller than an honest band of n sequences alone can support (1 / (n + 1))."""
        return self.pool_sequences is not None and self.p_value < 1 / (self.pool_sequences + 1)

    @property
    def label(self) -> str:
        return "CONSISTENT" if self.consistent else "INCONSISTENT"

    @property
    def text(self) -> str:
        p = self.p_adjusted if self.p_adjusted is not None else self.p_value
        which = "Holm-adjusted p" if self.p_adjusted is not None else "p"
        side = self.detectors.get(self.decided_by or "", {})
        if self.unit == "batch" and "on_side" in side:
            evidence = (f"{side['on_side']}/{side['mismatches']} mismatches {WHERE[self.decided_by]} "
                        f"(95% CI {self.ci_low:.0%}-{self.ci_high:.0%}; honest at most "
                        f"{side['honest_share']:.0%}) in {self.units} batches of {self.batch_size} tokens, "
                        f"{self.flagged} flagged by margin")
        elif self.unit == "batch":
            by = f" by {self.decided_by}" if self.decided_by and len(self.detectors) > 1 else ""
            evidence = (f"{self.flagged}/{self.units} batches of {self.batch_size} tokens flagged{by} "
                        f"(flag rate 95% CI {self.ci_low:.0%}-{self.ci_high:.0%})")
        else:
            to = " to " if self.ci_low < 0 else "-"  # "-21.3-20.1", not "-21.3--20.1"
            interval = f" (95% CI {self.ci_low:.4f}{to}{self.ci_high:.4f})" if self.interval else ""
            evidence = (f"{self.statistic_name} {self.statistic:.4f}{interval} over {self.tokens} tokens in "
                        f"{self.units} sequences")
        beyond = (f" (beyond what {self.pool_sequences} sequences per honest band show: a bootstrap extrapolation)"
                  if self.beyond_pool else "")
        needed = (f"; detected after {self.tokens_needed} tokens"
                  if self.tokens_needed is not None and not self.consistent else "")
        like = (f"; resembles {self.resembles}" if self.resembles else
                f"; outside every band's range (nearest: {self.nearest})" if self.nearest else "")
        rest = "".join(f"; {part}" for part in (
            self.unjudged_tokens and f"the last {self.unjudged_tokens} tokens (less than a batch) were not judged",
            self.minimum_evidence, self.note) if part)
        return (f"{self.label} with {self.subject} at {self.alpha:.0%} FPR: {evidence}, "
                f"{which} {p_text(p)}{beyond}{needed}{like}{rest}")

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.label, "beyond_pool": self.beyond_pool, "text": self.text}


def p_text(p: float) -> str:
    """``= 0.0123``, or a bound where the p-value underflowed to 0 (``< 2e-308``: no test here claims 0)."""
    return f"< {np.finfo(np.float64).tiny:.0e}" if p <= 0 else f"= {p:.3g}"


def look_sizes(n: int) -> list[int]:
    """Doubling prefixes 1, 2, 4, ... then ``n`` (the looks of the sequential test)."""
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def doubling_looks(n: int) -> str:
    """How a verdict's method names its looks: "1 doubling look", "3 doubling looks"."""
    return f"{n} doubling look{'' if n == 1 else 's'}"


def sequential(p_at: Callable[[int], float], looks: Sequence[int], alpha: float) -> tuple[float, int | None]:
    """Bonferroni over ``looks``: (sequential p-value, first look rejected at ``alpha / L`` or None)."""
    ps = [p_at(k) for k in looks]
    first = next((k for k, p in zip(looks, ps) if p < alpha / len(looks)), None)
    return min(1.0, len(looks) * min(ps)), first


# --------------------------------------------------------------------------------------------------
# Calibrated flags


def default_batch_size(calibrator: Calibrator, n: int, alpha: float | None = None) -> int:
    """The largest calibrated batch size whose whole batches in ``n`` scores could reject (``can_reject``:
    one batch of 100 never can, where ten of 10 can), else the largest that fits, else the smallest."""
    alpha = calibrator.fpr if alpha is None else alpha
    detectors = 1 + len(side_detectors(getattr(calibrator, "sides", None)))
    return min(calibrator.batch_sizes,
               key=lambda s: (s > n, s > n or not can_reject(n // s, calibrator.fpr, alpha, detectors),
                              s if s > n else -s))


@functools.lru_cache(maxsize=256)
def can_reject(batches: int, fpr: float, alpha: float, detectors: int = 1) -> bool:
    """Whether ``batches`` batches, every one flagged, reach the rule's level at some look (the binomial
    p of k flags in k batches below ``alpha / (looks * detectors)``)."""
    if batches < 1:
        return False
    looks = np.asarray(look_sizes(batches))
    return bool((_binom_p(looks, looks, fpr) < alpha / (looks.size * detectors)).any())


def _binom_p(k, n, fpr: float):
    """One-sided binomial p-value of ``k`` flags in ``n`` batches at rate ``fpr`` (``binomtest(k, n, fpr,
    alternative="greater")``), elementwise."""
    return np.clip(binom.sf(np.asarray(k) - 1, n, fpr), 0.0, 1.0)


@functools.lru_cache(maxsize=256)
def minimum_evidence(n: int, fpr: float, alpha: float, detectors: int = 1) -> str:
    """The fewest flagged batches that can reject among ``n`` (a look of k batches rejects when the
    binomial p of its flags is below ``alpha / (looks * detectors)``): stated in every flag verdict,
    because a single flagged batch at p = fpr can never reject."""
    looks = look_sizes(n)
    level = alpha / (len(looks) * detectors)
    best = None
    for k in looks:
        hit = np.flatnonzero(_binom_p(np.arange(1, k + 1), k, fpr) < level)
        j = int(hit[0]) + 1 if hit.size else None
        if j is not None and (best is None or j < best[0]):
            best = (j, k)
    if best is None:
        return (f"no count of flagged batches among {n} can reject at {alpha:.0%} "
                f"({len(looks)} looks x {detectors} detector(s)): judge more tokens")
    return f"rejecting needs at least {best[0]} flagged batch(es) of one detector among the first {best[1]}"


def flag_verdict(flags: np.ndarray, fpr: float, batch_size: int, alpha: float | None = None,
                 method: str = "", subject: str = "the claimed configuration",
                 names: Sequence[str] | None = None, unjudged_tokens: int = 0,
                 sides: tuple[Mapping[str, np.ndarray], Sequence[Mapping]] | None = None) -> Verdict:
    """Sequential one-sided binomial test of batch ``flags`` (honest batches flag at <= ``fpr``).

    ``flags`` is one detector's [batches] or several detectors' [detectors, batches] (named by
    ``names``); ``sides`` (the judged tokens' ``depth_shift`` and ``margin`` columns, and the
    calibration's honest counts, ``verinfer.stats.sides``) adds the sampler-shape detectors the null
    can judge (``narrower``, ``wider``; ``beyond`` when the null and the columns count it), judged on
    every token up to each look. Each look's p-value is the Bonferroni minimum over all detectors.
    """
    flags = np.atleast_2d(np.asarray(flags, dtype=bool))
    if flags.size == 0:
        raise ValueError("no batches to judge")
    n = flags.shape[1]
    names = list(names) if names is not None else [f"detector {j}" for j in range(flags.shape[0])]
    alpha = fpr if alpha is None else alpha
    looks = look_sizes(n)
    at = np.asarray(looks)
    cum = np.concatenate([np.zeros((flags.shape[0], 1), dtype=np.int64), np.cumsum(flags, axis=1)], axis=1)
    ps = {name: _binom_p(cum[j, at], at, fpr) for j, name in enumerate(names)}  # detector -> p at each look
    shapes: tuple[str, ...] = ()
    if sides is not None:
        null, shift = sides[1], np.asarray(sides[0]["depth_shift"], dtype=np.float64)[: n * batch_size]
        margin = sides[0].get("margin")
        margin = None if margin is None else np.asarray(margin, dtype=np.float64)[: n * batch_size]
        kinds = side_kinds(shift, margin)
        upto = {c: np.concatenate([[0], np.cumsum(v)])[at * batch_size] for c, v in kinds.items()}
        shapes = tuple(d for d in side_detectors(null) if d != "beyond" or margin is not None)
        ps.update({side: side_p_value(upto, null, side) for side in shapes})
    m = len(ps)
    cache = {name: dict(zip(looks, map(float, p_at))) for name, p_at in ps.items()}
    p, first = sequential(lambda k: min(1.0, m * min(c[k] for c in cache.values())), looks, alpha)
    own = {name: sequential(c.__getitem__, looks, alpha)[0] for name, c in cache.items()}
    best = min(own, key=own.get)
    detectors = {name: {"flagged": int(flags[j].sum()), "p": own[name]} for j, name in enumerate(names)}
    k = int(flags[0].sum()) if best not in names else int(flags[names.index(best)].sum())
    ci = wilson_interval(k, n)
    statistic, statistic_name = k / n, "flag rate"
    if shapes:
        counts = side_counts(shift, margin)
        for side in shapes:
            on, off = oriented(counts, side)
            detectors[side] = {"on_side": on, "mismatches": on + off,
                               "honest_share": honest_share(sides[1], side), "p": own[side]}
        if best in shapes:
            on, total = detectors[best]["on_side"], detectors[best]["mismatches"]
            ci = wilson_interval(on, total)
            statistic, statistic_name = on / total, f"share of mismatches {WHERE[best]}"
    return Verdict(p >= alpha, p, alpha, n * batch_size, n, "batch", statistic, statistic_name, ci.low, ci.high,
                   len(looks), None if first is None else first * batch_size,
                   method or f"sequential binomial test of batches flagged at <= {fpr:.2%} when honest",
                   subject, flagged=k, batch_size=batch_size, detectors=detectors, decided_by=best,
                   unjudged_tokens=int(unjudged_tokens), minimum_evidence=minimum_evidence(n, fpr, alpha, m))


def token_detector(calibrator: Calibrator) -> tuple[str, str]:
    """The margin detector token verdicts use with this calibration.

    Margins clipped at the honest 99.9th percentile (``CLIPPED``, the seed paper's clipping): honest
    claims that fall outside the reference's top-k/top-p set (bf16 providers make a few) have
    infinite margins, and under the bounded margin they set the threshold so high that a wrong
    seed passes, while pooling fp32 and bf16 honest tokens under it flags honest bf16 providers
    (both measured: RESULTS.md section 8). When the honest margins have no spread (an exact fp32
    null: every margin 0) the percentile clip would erase every score, so the bounded margin
    (``DETECTOR``) is used instead.
    """
    clip = calibrator.percentile_values_.get(CLIPPED[0], {}).get(99.9)
    usable = CLIPPED[1] in calibrator.rules and clip is not None and clip > 0
    return CLIPPED if usable else DETECTOR


def side_evidence(calibrator: Calibrator, columns: Mapping[str, np.ndarray]) -> tuple[dict, list] | None:
    """(the scores' ``depth_shift`` and ``margin``, the calibration's honest side counts) when a token
    verdict can use the sampler-shape detectors: the scores carry ``depth_shift`` and an honest group of
    the calibration made mismatches (``verinfer.stats.sides``); else None."""
    shift = columns.get("depth_shift")
    null = getattr(calibrator, "sides", None)
    if shift is None or not judged_groups(null):
        return None
    return {k: np.asarray(columns[k], dtype=np.float64) for k in ("depth_shift", "margin") if k in columns}, list(null)


def calibrated_verdict(scores: np.ndarray | Mapping[str, np.ndarray], calibrator: Calibrator,
                       batch_size: int | None = None, metric: str | None = None, rule: str | None = None,
                       alpha: float | None = None) -> Verdict:
    """Flag consecutive batches with a calibrated detector, then ``flag_verdict``.

    ``scores`` is one metric's per-token scores (judged by ``metric`` / ``rule``, default
    ``token_detector``) or a verify's score columns: their margin (``token_detector``) and, where
    ``side_evidence`` allows, the sampler-shape detectors.
    """
    sides = None
    if isinstance(scores, Mapping):
        metric, rule = token_detector(calibrator)
        sides = side_evidence(calibrator, scores)
        values = np.asarray(scores["margin"], dtype=np.float64)
    else:
        if metric is None or rule is None:
            metric, rule = token_detector(calibrator)
        values = np.asarray(scores, dtype=np.float64)
    size = batch_size or default_batch_size(calibrator, values.size, alpha)
    if size not in calibrator.batch_sizes:
        raise ValueError(f"batch size {size} is not calibrated (calibrated: {', '.join(map(str, calibrator.batch_sizes))})")
    if size > values.size:
        raise ValueError(f"too few {metric} scores ({values.size}) for a calibrated batch of {size}")
    flags = calibrator.predict(values, size, metric=metric, rule=rule)
    looks = doubling_looks(len(look_sizes(flags.size)))
    which = f"{metric} {rule} (threshold {calibrator.threshold(metric, rule, size):.4g})"
    if sides is None:
        method = (f"sequential binomial test ({looks}, Bonferroni over looks) of batches of {size} tokens flagged "
                  f"by the calibrated {which}; honest batches flag at <= {calibrator.fpr:.0%}")
    else:
        shapes = side_detectors(sides[1])
        groups = ", ".join(f"{g['group']} {'/'.join(str(g[c]) for c in ('positive', 'negative', 'beyond') if c in g)}"
                           for g in judged_groups(sides[1]))
        method = (f"sequential test ({looks}, Bonferroni over looks and {1 + len(shapes)} detectors): batches of "
                  f"{size} tokens flagged by the calibrated {which} (binomial, honest batches flag at <= "
                  f"{calibrator.fpr:.0%}); mismatches {' / '.join(WHERE[d] for d in shapes)} up to each look "
                  f"(Fisher's exact test against the least favourable honest group, positive/negative"
                  f"{'/beyond' if 'beyond' in shapes else ''}: {groups})")
    verdict = flag_verdict(flags, calibrator.fpr, size, alpha, method, names=[metric],
                           unjudged_tokens=values.size % size, sides=sides)
    shift = scores.get("depth_shift") if isinstance(scores, Mapping) else None
    verdict.note = coverage_note(calibrator, verdict, shift)
    return verdict


def coverage_note(calibrator: Calibrator, verdict: Verdict, shift: np.ndarray | None = None) -> str | None:
    """Why an INCONSISTENT verdict may be noise the calibration never saw, or None.

    Only the sides of the mismatches can tell (``shift``, the judged tokens' ``depth_shift``): when
    they fall on both sides about equally (a two-sided sign test at ``alpha``; a sampler deviation
    puts them on one side) and the calibration was fitted on fewer precisions than GPU providers
    run, the verdict names both readings, since a wrong seed or other weights put mismatches on both
    sides as well as unseen numerical noise does: a pooled calibration settles the first,
    ``verinfer diagnose`` names the cause. Without mismatch sides nothing is said."""
    if verdict.consistent or shift is None:
        return None
    counts = side_counts(np.asarray(shift, dtype=np.float64)[: verdict.tokens])
    positive, negative = counts["positive"], counts["negative"]
    if not positive + negative:
        return None  # no evidence on where the mismatches fall
    if binomtest(min(positive, negative), positive + negative, 0.5).pvalue < verdict.alpha:
        return None  # one-sided: a sampler deviation, not noise
    covered = (getattr(calibrator, "coverage", None) or {}).get("precisions")
    if not covered:
        what = "the calibration does not record which honest precisions it covers"
    elif "bfloat16" not in covered:
        what = f"the calibration covers {', '.join(covered)} only"
    else:
        return None
    return (f"{what}; the mismatches fall on both sides of the verifier's tokens ({positive} shallower, "
            f"{negative} deeper), as numerical noise of a precision it lacks (bf16) puts them, and as a wrong seed "
            "or other weights do: a pooled fp32 + bf16 calibration tells noise apart, `verinfer diagnose` names the cause")


# --------------------------------------------------------------------------------------------------
# Pooled sequences against honest bands


def pooled(seq: np.ndarray) -> float:
    """Mean clipped margin of per-sequence rows ``[tokens, clipped-margin sum, exact matches]``."""
    return float(seq[:, 1].sum() / max(seq[:, 0].sum(), 1.0))


def pseudo_audits(sequences: np.ndarray, n_tokens: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """Pooled statistics of ``draws`` pseudo-audits of about ``n_tokens`` tokens, resampling sequences."""
    lengths = sequences[:, 0]
    k = int(np.ceil(n_tokens / max(lengths.mean(), 1.0) * 2)) + 4
    pick = rng.integers(0, len(sequences), size=(draws, k))
    tokens = np.cumsum(lengths[pick], axis=1)
    keep = np.concatenate([np.ones((draws, 1), bool), tokens[:, :-1] < n_tokens], axis=1)
    total = (lengths[pick] * keep).sum(axis=1)
    return (sequences[:, 1][pick] * keep).sum(axis=1) / np.maximum(total, 1)


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


def _draws(n_looks: int, alpha: float) -> int:
    """Enough honest pseudo-audits to resolve p-values well below ``alpha / looks``."""
    return max(999, math.ceil(20 * n_looks / alpha))


def band_noise(band: np.ndarray, draws: int, rng: np.random.Generator, chunk: int = 2_000_000) -> np.ndarray:
    """How far ``draws`` re-drawn bands' pooled statistics fall from this band's: a band is a sample
    of honest sequences (48 prompts for the shipped ones), not the honest population, so its own mean is
    uncertain by about as much as a 25-prompt audit's (issue #42: a human-eval gap band 0.003 nats below
    what other prompts of the set give flagged honest bf16 audits at several times the FPR)."""
    tokens = int(band[:, 0].sum())
    per = max(1, chunk // (2 * len(band) + 4))  # pseudo_audits draws about 2 sequences per one it keeps
    noise = np.concatenate([pseudo_audits(band, tokens, min(per, draws - i), rng) for i in range(0, draws, per)])
    return noise - pooled(band)


def band_p_value(seq: np.ndarray, honest: Sequence[np.ndarray], draws: int, rng: np.random.Generator,
                 noise: Sequence[np.ndarray] | None = None) -> float:
    """Composite-null p-value: the largest over honest bands of the rank of ``seq``'s pooled statistic
    among that band's pseudo-audits of the same size, each less a re-drawn band's offset (``band_noise``,
    one array per band): a two-sample bootstrap of audit against band, under the null that both hold
    the same honest sequences, so a band's own sampling error does not become false positives."""
    stat, tokens = pooled(seq), int(seq[:, 0].sum())
    noise = noise if noise is not None else [np.zeros(draws)] * len(honest)
    return max(float((1 + np.count_nonzero(pseudo_audits(band, tokens, draws, rng) - off[:draws] >= stat - 1e-12))
                     / (draws + 1)) for band, off in zip(honest, noise))


MIN_LOOK_SEQUENCES = 8


def pooled_looks(seq: np.ndarray, honest: Sequence[np.ndarray]) -> list[int]:
    """Doubling prefixes of sequences, from the first holding ``MIN_LOOK_SEQUENCES`` sequences and a
    median honest sequence's tokens on (pseudo-audits are made of whole honest sequences, so a shorter
    prefix would meet a null that averages over more tokens, hence too narrow). A prefix of one or two
    sequences would be judged in the band's extreme tail, which 48 honest sequences cannot show: one
    beyond the band's largest gets p = 1 / draws where its chance is about 1 / 49 (issue #42: an honest
    bf16 audit rejected at its first look, 2 sequences)."""
    shortest = float(np.median(np.concatenate(list(honest))[:, 0]))
    return [k for k in look_sizes(len(seq)) if k >= min(MIN_LOOK_SEQUENCES, len(seq)) and seq[:k, 0].sum() >= shortest] \
        or [len(seq)]


def pooled_verdict(seq: np.ndarray, honest: Sequence[np.ndarray], alpha: float = 0.01, seed: int = 0,
                   all_bands: dict[str, np.ndarray] | None = None, source: str = "",
                   clip: float = MARGIN_CLIP, statistic: str = "mean clipped margin") -> Verdict:
    """Sequential composite-null test of per-sequence rows ``[tokens, clipped-score sum, exact]``
    against ``honest`` bands' sequences; ``all_bands`` (label -> sequences, honest or not) gives
    each band's range at this size and the band the statistic resembles. ``statistic`` names the
    per-token score (the Token-DiFR margin, or the logprobs test's gap: ``auditing.logprobs``)."""
    seq = np.asarray(seq, dtype=np.float64)
    if len(seq) == 0 or seq[:, 0].sum() == 0:
        raise ValueError("no tokens to judge")
    rng = np.random.default_rng(seed)
    looks = pooled_looks(seq, honest)
    draws = _draws(len(looks), alpha)
    noise = [band_noise(np.asarray(b, dtype=np.float64), draws, rng) for b in honest]
    p, first = sequential(lambda k: band_p_value(seq[:k], honest, draws, rng, noise), looks, alpha)
    tokens, stat = int(seq[:, 0].sum()), pooled(seq)
    ranges = {label: [float(x) for x in np.percentile(pseudo_audits(s, tokens, 2000, rng), [2.5, 50, 97.5])]
              for label, s in (all_bands or {}).items()}
    nearest = resembles = None
    if ranges:  # a statistic no band's range holds resembles none of them: a misconfiguration not catalogued
        inside = [name for name, (lo, _, hi) in ranges.items() if lo <= stat <= hi]
        nearest = min(inside or list(ranges), key=lambda name: abs(ranges[name][1] - stat) if inside
                      else min(abs(ranges[name][0] - stat), abs(ranges[name][2] - stat)))
        resembles = nearest if inside else None
    lo, hi = sequence_ci(seq, seed)
    method = (f"sequential test ({doubling_looks(len(looks))} of sequences, Bonferroni) of the {statistic} "
              f"(per-token clip {clip:.4g}): largest over {len(honest)} honest band(s){f' ({source})' if source else ''} "
              f"of the two-sample bootstrap p-value among {draws} pseudo-audits resampled from the band's "
              f"sequences, each less a re-drawn band's offset from the band (the band's own sampling error)")
    return Verdict(p >= alpha, p, alpha, tokens, len(seq), "sequence", stat, statistic, lo, hi,
                   len(looks), None if first is None else int(seq[:first, 0].sum()), method,
                   exact_match_rate=float(seq[:, 2].sum() / tokens), sequences=len(seq), resembles=resembles,
                   nearest=nearest, band_ranges=ranges, pool_sequences=min(len(b) for b in honest))


# --------------------------------------------------------------------------------------------------
# Several sets at once


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (family-wise error control over the sets judged together)."""
    order = np.argsort(p_values, kind="stable")
    m, running, out = len(p_values), 0.0, [0.0] * len(p_values)
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


def adjust(verdicts: Sequence[Verdict]) -> None:
    """Holm-adjust verdicts judged together, in place; a verdict then rests on its adjusted p."""
    if len(verdicts) < 2:
        return
    for v, p in zip(verdicts, holm([v.p_value for v in verdicts])):
        v.p_adjusted = p
        v.consistent = p >= v.alpha


__all__ = [
    "CLIPPED",
    "COMMIT_RULE",
    "DETECTOR",
    "WHERE",
    "Verdict",
    "adjust",
    "band_noise",
    "band_p_value",
    "calibrated_verdict",
    "coverage_note",
    "doubling_looks",
    "flag_verdict",
    "holm",
    "look_sizes",
    "minimum_evidence",
    "pooled",
    "pooled_verdict",
    "pseudo_audits",
    "sequence_ci",
    "sequential",
    "side_evidence",
    "token_detector",
]
