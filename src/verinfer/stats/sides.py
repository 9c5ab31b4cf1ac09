"""The sampler-shape test: do a provider's mismatches lean to one side more than honest noise does? (issue #28)

``depth_shift`` (``verinfer.scoring.sampler_shape``) puts every mismatch on one side of the
verifier's token: positive when the claim is shallower in the claimed sampler's kept set (a
narrower filter or a colder temperature does this at every mismatch it makes), negative when it is
deeper (wider, hotter). Honest numerical noise puts mismatches on both sides, but not exactly half
and half: logit noise acts a little like a hotter sampler, so honest bf16 mismatches lean deeper
(RESULTS.md section 19). The null proportion is therefore not 1/2 but each honest group's own,
known only through its calibration counts.

The test is cumulative over every token judged so far, not per batch: a 20-token batch rarely
holds a deviating mismatch (RESULTS.md section 19), a running count of sides does. A look's
p-value for one side is the largest over the honest groups that make mismatches (the provider runs
one of them: a composite null, as ``pooled_verdict`` takes the largest over bands) of Fisher's
one-sided exact test of the look's two side counts against the group's calibration counts (SciPy's
``fisher_exact``): the comparison of two binomial samples, so the calibration's own uncertainty is
in the p-value. A group with no honest mismatch (an fp32 provider verified by the fp32 reference)
is left out: a provider of that group makes no mismatch whose side could be judged (the margin
detector judges that it made one at all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import fisher_exact

from verinfer.scoring.sampler_shape import SHAPE_METRICS


def side_counts(shift: ArrayLike) -> tuple[int, int]:
    """(mismatches with ``depth_shift`` > 0, with < 0): the claim shallower / deeper than the verifier's token."""
    s = np.asarray(shift, dtype=np.float64)
    return int(np.count_nonzero(s > 0)), int(np.count_nonzero(s < 0))


def fit_side_null(groups: Mapping[str, ArrayLike]) -> list[dict]:
    """Each honest group's side counts (label -> its tokens' ``depth_shift``), as a calibration stores them."""
    out = []
    for label, shift in groups.items():
        positive, negative = side_counts(shift)
        out.append({"group": str(label), "tokens": int(np.asarray(shift).size), "positive": positive,
                    "negative": negative})
    return out


def judged_groups(null: Sequence[Mapping] | None) -> list[Mapping]:
    """The honest groups whose mismatches define the null (those that made any)."""
    return [g for g in (null or ()) if int(g["positive"]) + int(g["negative"]) > 0]


def _oriented(positive: int, negative: int, side: str) -> tuple[int, int]:
    """(mismatches on ``side``, on the other side)."""
    return (positive, negative) if SHAPE_METRICS[side] > 0 else (negative, positive)


def side_p_value(positive: int, negative: int, null: Sequence[Mapping], side: str) -> float:
    """One-sided p-value that more mismatches fall on ``side`` ("narrower": positive shifts, "wider":
    negative) than under any honest group of ``null``: the largest over groups of Fisher's exact test."""
    on, off = _oriented(positive, negative, side)
    groups = judged_groups(null)
    if on + off == 0 or not groups:
        return 1.0
    ps = []
    for g in groups:
        g_on, g_off = _oriented(int(g["positive"]), int(g["negative"]), side)
        ps.append(float(fisher_exact([[on, off], [g_on, g_off]], alternative="greater").pvalue))
    return min(1.0, max(ps))


def honest_share(null: Sequence[Mapping], side: str) -> float | None:
    """The largest share of honest mismatches on ``side`` among the null's groups (None without any)."""
    shares = [_oriented(int(g["positive"]), int(g["negative"]), side)[0] / (int(g["positive"]) + int(g["negative"]))
              for g in judged_groups(null)]
    return max(shares) if shares else None


__all__ = ["fit_side_null", "honest_share", "judged_groups", "side_counts", "side_p_value"]
