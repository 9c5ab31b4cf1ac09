"""Fitting a sampler family's parameter to the traces (issue #41 item 1: families, fitted, not a fixed list).

The candidate grid (``diagnosis.candidate_grid``) tries a few values of each sampler parameter: a
temperature of 0.87, a top-k of 37 or a repetition penalty of 1.15 is none of them, and the nearest one
explains the tokens only in part. A *family* is one such parameter over its whole range: temperature,
top-k, top-p, min-p, and each penalty (repetition, presence, frequency). Once the grid has been replayed
on the diagnosis's first rows (its first blocks of logits, at least ``FIT_ROWS`` rows, or all when
fewer), every family whose best grid value beats the claim there by more than the interval's drop is
fitted on those rows (the ``MAX_FITS`` best): its value is searched on grids of at most ``POINTS``
values, each level ``LEVEL_SPAN`` steps either side of the last level's best, down to the family's
resolution (``Family.step``); the coarser levels read ``SCREEN_ROWS`` of the rows. The fit is the
middle of the values tied at the best log-likelihood and, among those, the most exact tokens (a seeded
replay reproduces the same tokens over a range of values); its interval holds the values, contiguous
with it, whose log-likelihood is within ``DROP`` of the best: a 95% profile-likelihood interval
(Wilks: half the chi-square(1) quantile) under diagnose's noise model (its ``sigma`` is assumed, not
measured). A continuous parameter's interval is widened by one step on each side where the next value
searched fell outside it (its true ends lie between the two), so it covers the continuous interval.
The fitted value then replaces the family's grid values over every row.

Every value screened counts as a candidate tried in diagnose's Bonferroni correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy.stats import chi2

from verinfer.sampling.params import SamplingParams
from verinfer.scoring.diagnosis import Candidate, label_for

DROP = float(chi2.ppf(0.95, 1) / 2)  # 1.92: a 95% profile-likelihood interval's drop in log-likelihood
POINTS = 41  # the most values one level of the search replays
LEVEL_SPAN = 2  # a finer level spans the last level's best +- this many of its steps
FIT_ROWS = 256  # a diagnosis fits on its first blocks up to this many rows (all of them when fewer)
SCREEN_ROWS = 128  # rows the coarser levels are screened on; the last level reads every row of the block
MAX_FITS = 3  # families fitted at most (those whose grid value beats the claim most)
EXTEND, EXTEND_STEPS = 4, 10  # an interval at the last level's edge is followed up to 4 x 10 steps further


@dataclass(frozen=True)
class Family:
    """One sampler parameter over its range: ``axis`` is a ``SamplingParams`` field, or a penalty's kind."""

    axis: str
    low: float
    high: float
    step: float  # the resolution the fit reaches
    integer: bool = False

    @property
    def penalty(self) -> bool:
        return self.axis in ("repetition", "presence", "frequency")

    def value_of(self, c: Candidate) -> float | None:
        """The value ``c`` gives this family's parameter, when ``c`` is one of its members."""
        if self.penalty:
            return c.penalty[1] if c.penalty and c.penalty[0] == self.axis else None
        return dict(c.changes).get(self.axis) if c.axis == self.axis else None

    def claimed(self, claim: SamplingParams) -> float | None:
        """The claim's own value (no penalty is ``1`` for repetition, ``0`` for the others); None when off."""
        if self.penalty:
            return 1.0 if self.axis == "repetition" else 0.0
        v = getattr(claim, self.axis)
        off = (self.axis == "top_k" and v <= 0) or (self.axis == "top_p" and v >= 1.0) or \
            (self.axis == "min_p" and v <= 0)
        return None if off else float(v)

    def candidate(self, value: float, interval: tuple[float, float] | None = None) -> Candidate:
        value = self.snap(value)
        if self.penalty:
            return Candidate(label_for(self.axis, value), "penalty", penalty=(self.axis, value), interval=interval)
        return Candidate(label_for(self.axis, value), self.axis, ((self.axis, value),), interval=interval)

    def snap(self, value: float) -> float:
        """``value`` on the family's resolution, within its range."""
        v = min(max(round(round(value / self.step) * self.step, 6), self.low), self.high)
        return int(v) if self.integer else v

    def grid(self, low: float, high: float) -> list[float]:
        """At most ``POINTS`` values spread evenly over [low, high], each a multiple of the resolution."""
        low, high = max(low, self.low), min(high, self.high)
        steps = max(1, math.ceil((high - low) / self.step / (POINTS - 1)))
        first = math.ceil(low / self.step - 1e-9)
        last = math.floor(high / self.step + 1e-9)
        return [self.snap(i * self.step) for i in range(first, last + 1, steps)]


FAMILIES = (
    Family("temperature", 0.05, 3.0, 0.01),
    Family("top_k", 1, 1024, 1, integer=True),
    Family("top_p", 0.05, 1.0, 0.01),
    Family("min_p", 0.0, 0.5, 0.005),
    Family("repetition", 1.0, 3.0, 0.01),
    Family("presence", 0.0, 2.5, 0.05),
    Family("frequency", 0.0, 2.5, 0.05),
)


def family_of(c: Candidate) -> Family | None:
    return next((f for f in FAMILIES if f.value_of(c) is not None), None)


@dataclass(frozen=True)
class Fit:
    """A family's fitted value, its interval, and what the search cost."""

    family: Family
    value: float
    interval: tuple[float, float]
    loglik: float  # on the rows it was fitted on
    screened: int  # values replayed, every level
    rows: int

    @property
    def candidate(self) -> Candidate:
        return self.family.candidate(self.value, self.interval)

    def is_claim(self, claim: SamplingParams) -> bool:
        """Whether the fitted value is the claim's own (the family explains nothing the claim does not)."""
        c = self.candidate
        if c.penalty:
            return self.value == self.family.claimed(claim)
        return c.params([claim])[0] == claim

    def to_dict(self) -> dict:
        return {"family": self.family.axis, "value": self.value, "interval": list(self.interval),
                "loglik": self.loglik, "screened": self.screened, "rows": self.rows,
                "resolution": self.family.step}


def interval(values: Sequence[float], logliks: Sequence[float], exact: Sequence[int] | None = None,
             drop: float = DROP) -> tuple[int, int, int]:
    """(best, first, last) indices into ascending ``values``: the middle of the values tied at the best
    log-likelihood (and, among those, at the most ``exact`` tokens), and the contiguous run around it
    within ``drop`` of that best."""
    ll = np.asarray(logliks, dtype=np.float64)
    top = float(ll.max())
    tied = np.flatnonzero(ll >= top - 1e-9)
    if exact is not None:
        ex = np.asarray(exact)[tied]
        tied = tied[ex == ex.max()]
    best = int(tied[(len(tied) - 1) // 2])
    inside = ll >= top - drop
    first = last = best
    while first > 0 and inside[first - 1]:
        first -= 1
    while last < len(ll) - 1 and inside[last + 1]:
        last += 1
    return best, first, last


def fit_family(family: Family, start: float, bracket: tuple[float, float],
               loglik: Callable[[list[float], bool], list[tuple[float, int]]]) -> Fit:
    """Search ``family`` from its best grid value ``start`` over ``bracket`` (the grid's neighbours of
    ``start``, or the family's range at an end): ``loglik(values, final)`` is each value's (log-likelihood,
    exact tokens) on the screened rows (``final`` False) or on every row (True)."""
    low, high = bracket
    screened = 0
    while True:
        values = family.grid(low, high)
        if start not in values:
            values = sorted({*values, family.snap(start)})
        spacing = max(family.step, (values[-1] - values[0]) / max(len(values) - 1, 1))
        final = spacing <= family.step * 1.000001
        ll = list(loglik(values, final))
        screened += len(values)
        best, first, last = interval(values, *zip(*ll))
        for _ in range(EXTEND) if final else ():  # an interval that reaches the level's edge goes on past it
            more = [*(family.grid(values[0] - EXTEND_STEPS * family.step, values[0] - family.step)
                      if first == 0 and values[0] > family.low else ()),
                    *(family.grid(values[-1] + family.step, values[-1] + EXTEND_STEPS * family.step)
                      if last == len(values) - 1 and values[-1] < family.high else ())]
            if not more:
                break
            ll = [*loglik(more, True), *ll]
            values = [*more, *values]
            order = np.argsort(values, kind="stable")
            values, ll = [values[i] for i in order], [ll[i] for i in order]
            screened += len(more)
            best, first, last = interval(values, *zip(*ll))
        if final:
            lo, hi = values[first], values[last]
            if not family.integer:  # a continuous parameter's ends lie between the last value in and the first out
                lo = family.snap(lo - family.step) if first > 0 else lo
                hi = family.snap(hi + family.step) if last < len(values) - 1 else hi
            return Fit(family, values[best], (lo, hi), float(ll[best][0]), screened, 0)
        start = values[best]
        low, high = start - LEVEL_SPAN * spacing, start + LEVEL_SPAN * spacing


def bracket(family: Family, claim: SamplingParams, grid_values: Sequence[float], best: float) -> tuple[float, float]:
    """The values next to ``best`` among the grid's and the claim's own (the family's range past the ends)."""
    claimed = family.claimed(claim)
    points = sorted({*grid_values, *(() if claimed is None else (claimed,))})
    points = [p for p in points if family.low <= p <= family.high]
    i = points.index(best) if best in points else int(np.searchsorted(points, best))
    return (points[i - 1] if i > 0 else family.low), (points[i + 1] if i + 1 < len(points) else family.high)


# -- the model's side: weights by bits, granularity and rounding; the first N layers; one layer removed;
# the KV cache's precision (a search over derived models, each a prefill or a decode replay of its own:
# ``diagnosis_run.search_model``) ------------------------------------------------------------------------

WEIGHT_BITS = (2, 3, 4, 5, 6, 8)
GROUPINGS = ("g32", "g64", "g128", "channel")
KV_CACHES = ("fp8-kv", "fp8-kv-tensor", "fp8-kv-head", "fp8-kv-fresh")  # fp8 KV: scale 1, per layer, per head; fresh


def weights_name(bits: int, grouping: str, symmetric: bool = True) -> str:
    """The catalogue's name of RTN weights (``simulate.variants``, ``wB-gG[-asym]``)."""
    return f"w{bits}-{grouping}{'' if symmetric else '-asym'}"


def model_coarse(layers: int) -> list[str]:
    """The first level of the model-side search: RTN weights at every bit width, grouping and rounding (a
    grouping or rounding other than the provider's reproduces its tokens no better than the unquantized
    model: they are not ordered), the first N of ``layers`` layers at a few depths, every single layer
    removed (which layer a damaged model lost: removals are not ordered either, so each is screened) and
    an fp8 KV cache at each of vLLM's scalings."""
    depths = sorted({n for n in (layers - 1, layers - 2, layers - 4, layers - 8, layers // 2) if 1 <= n < layers})
    return [weights_name(b, g, sym) for b in WEIGHT_BITS for g in GROUPINGS for sym in (True, False)] + \
        [f"layers-{n}" for n in depths] + [f"skip-layer-{i}" for i in range(layers) if layers > 1] + list(KV_CACHES)


def model_refined(best: str, coarse: Sequence[str], layers: int) -> list[str]:
    """The second level around ``best``: every depth between its coarse neighbours (weights: none, the
    first level held every member)."""
    if not best.startswith("layers-"):
        return []
    n = int(best.split("-")[1])
    depths = sorted(int(c.split("-")[1]) for c in coarse if c.startswith("layers-"))
    i = depths.index(n)
    lo, hi = (depths[i - 1] if i else 1), (depths[i + 1] if i + 1 < len(depths) else layers - 1)
    return [f"layers-{d}" for d in range(lo, hi + 1)]


def near_set(names: Sequence[str], logliks: Sequence[float], exact: Sequence[int],
             drop: float = DROP) -> tuple[str, tuple[str, ...]]:
    """The best member (the highest log-likelihood, then the most exact tokens) and every member within
    ``drop`` of it (its 95% set, as a profile-likelihood interval for a parameter without an order)."""
    ll = np.asarray(logliks, dtype=np.float64)
    best = max(range(len(names)), key=lambda i: (ll[i], exact[i], -i))
    return names[best], tuple(n for n, v in zip(names, ll) if v >= ll[best] - drop)


__all__ = ["DROP", "FAMILIES", "FIT_ROWS", "GROUPINGS", "KV_CACHES", "WEIGHT_BITS", "model_coarse", "model_refined", "near_set", "weights_name", "Family", "Fit", "bracket", "family_of", "fit_family", "interval"]
