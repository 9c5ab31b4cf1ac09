"""The cross-entropy-matching adversary (DiFR figure 2): a misconfigured provider that tunes its
temperature until the verifier's mean cross-entropy on its outputs looks honest; and the pooled
scores it is judged by."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


from verinfer.models.backend import Backend
from verinfer.simulate.generate import Request
from verinfer.simulate.variants import Variant, compose, get_variant, temperature_variant
from verinfer.trace import Trace
from verinfer.scoring.traces import score_traces as verify
from verinfer.stats.summary import token_statistics



@dataclass(frozen=True)
class ScoreSummary:
    """Pooled Token-DiFR scores of a set of traces against the reference."""

    tokens: int
    exact_match: float
    mean_margin: float  # min(margin, clip) averaged
    mean_cross_entropy: float  # min(-log p, clip) averaged, p under the claimed processed distribution
    filtered: float  # share of claimed tokens outside the claimed top-k/top-p set

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def score_traces(reference: Backend, traces: Sequence[Trace]) -> ScoreSummary:
    """Verify ``traces`` with the reference (one prefill each) and pool the scores (``token_statistics``)."""
    t = token_statistics(verify(reference, traces).columns)
    return ScoreSummary(t["tokens"], t["exact_match_rate"], t["mean_margin"], t["mean_cross_entropy"],
                        t["filtered_rate"])


@dataclass
class CrossEntropyMatch:
    """What the temperature-tuning adversary found."""

    variant: Variant  # base variant + the chosen temperature
    temperature: float
    cross_entropy: float
    target: float
    history: list[tuple[float, float]]  # (temperature, mean cross-entropy) per generation round
    bracketed: bool  # whether the search bracket straddled the target

    @property
    def gap(self) -> float:
        return self.cross_entropy - self.target


def match_cross_entropy(
    reference: Backend,
    base: Variant | str,
    requests: Sequence[Request],
    max_new_tokens: int = 48,
    batch_size: int = 8,
    target: float | None = None,
    bracket: tuple[float, float] = (0.6, 1.0),
    rounds: int = 6,
    tol: float = 0.01,
    backend: Backend | None = None,
) -> CrossEntropyMatch:
    """Tune the sampling temperature of ``base`` until the verifier's mean cross-entropy on its
    outputs matches the honest one (DiFR figure 2's adversary).

    ``target`` defaults to the mean cross-entropy of honest traces for the same requests. Each round
    generates the same requests (same seeds) at one temperature and measures the clipped mean
    cross-entropy with the reference; the search evaluates the bracket ends, then runs Illinois
    regula falsi in T (cross-entropy grows with T), within ``rounds`` generations in all.
    """
    base = get_variant(base) if isinstance(base, str) else base
    if target is None:
        target = score_traces(reference, get_variant("honest").generate(reference, requests, max_new_tokens,
                                                                         batch_size)).mean_cross_entropy
    built = backend if backend is not None else base.build(reference)
    history: list[tuple[float, float]] = []

    def f(t: float) -> float:
        v = compose(base, temperature_variant(round(t, 4)))
        ce = score_traces(reference, v.generate(reference, requests, max_new_tokens, batch_size, backend=built)).mean_cross_entropy
        history.append((round(t, 4), ce))
        return ce - target

    lo, hi = bracket
    f_hi = f(hi)
    f_lo = f(lo) if rounds > 1 and abs(f_hi) > tol else math.nan
    bracketed = not math.isnan(f_lo) and f_lo <= 0 <= f_hi
    if bracketed:
        side = 0
        for _ in range(rounds - 2):
            t = hi - f_hi * (hi - lo) / (f_hi - f_lo) if f_hi != f_lo else (lo + hi) / 2
            ft = f(t)
            if abs(ft) <= tol:
                break
            if ft > 0:
                hi, f_hi = t, ft
                if side == 1:
                    f_lo /= 2
                side = 1
            else:
                lo, f_lo = t, ft
                if side == -1:
                    f_hi /= 2
                side = -1
    t_best, ce_best = min(history, key=lambda h: abs(h[1] - target))
    return CrossEntropyMatch(compose(base, temperature_variant(t_best)), t_best, ce_best, float(target),
                             history, bracketed)
