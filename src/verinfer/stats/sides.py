"""The sampler-shape tests: do a provider's mismatches fall where honest noise rarely puts them? (issue #28)

``depth_shift`` (``verinfer.sampling.depth``) puts every mismatch on one side of the
verifier's token: positive when the claim is shallower in the claimed sampler's kept set (a
narrower filter or a colder temperature does this at every mismatch it makes), negative when it is
deeper (wider, hotter). Honest numerical noise puts mismatches on both sides, but not exactly half
and half: logit noise acts a little like a hotter sampler, so honest bf16 mismatches lean deeper
(RESULTS.md section 19). The null proportion is therefore not 1/2 but each honest group's own,
known only through its calibration counts.

Three detectors, each a share of the mismatches: ``narrower`` (claim shallower), ``wider`` (claim
deeper) and ``beyond`` (the claim is a token the claimed sampler's filters remove: an infinite
margin on the deep side). A served top-k 60 for a claimed 50 makes mismatches only where its
token lies beyond the claimed boundary, so every one is ``beyond``, while honest bf16 noise
reorders near-tied tokens anywhere and crosses the boundary in about a fifth of its mismatches
(58 of 301 in the calibration pool of RESULTS.md section 19). Against that pool, mismatches all of
the deviation's kind reach the rule's level at 2,000 tokens in batches of 100 (0.01 / (6 looks x 4
detectors)) with 5 of them for ``beyond``, but 16 for ``wider`` (against bf16's 60% deeper).
``wider`` stays for a hotter temperature, whose mismatches are mostly inside the kept set.

The tests are cumulative over every token judged so far, not per batch: a 20-token batch rarely
holds a deviating mismatch, a running count does. A look's p-value for one detector is the largest
over the honest groups that make mismatches (the provider runs one of them: a composite null, as
``pooled_verdict`` takes the largest over bands) of Fisher's one-sided exact test of the look's two
counts against the group's calibration counts (the hypergeometric tail ``fisher_exact`` computes
for ``alternative="greater"``, from SciPy's ``hypergeom`` so that all looks are one array call):
the comparison of two binomial samples, so the calibration's own uncertainty is in the p-value. A
group with no honest mismatch (an fp32 provider verified by the fp32 reference) is left out: a
provider of that group makes no mismatch whose place could be judged (the margin detector judges
that it made one at all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import hypergeom

SIDE_DETECTORS = ("narrower", "wider", "beyond")


def side_kinds(shift: ArrayLike, margin: ArrayLike | None = None) -> dict[str, np.ndarray]:
    """Per token, whether it is a mismatch with ``depth_shift`` > 0 (``positive``: the claim shallower
    than the verifier's token), < 0 (``negative``: deeper) and, given the margins, one of the deep side
    whose claim the claimed filters remove (``beyond``: an infinite margin)."""
    s = np.asarray(shift, dtype=np.float64)
    out = {"positive": s > 0, "negative": s < 0}
    if margin is not None:
        out["beyond"] = (s < 0) & np.isinf(np.asarray(margin, dtype=np.float64))
    return out


def side_counts(shift: ArrayLike, margin: ArrayLike | None = None) -> dict[str, int]:
    """How many tokens of each ``side_kinds`` kind."""
    return {kind: int(np.count_nonzero(mask)) for kind, mask in side_kinds(shift, margin).items()}


def fit_side_null(groups: Mapping[str, Mapping[str, ArrayLike]]) -> list[dict]:
    """Each honest group's counts (label -> its score columns: ``depth_shift`` and, for ``beyond``,
    ``margin``), as a calibration stores them."""
    return [{"group": str(label), "tokens": int(np.asarray(cols["depth_shift"]).size),
             **side_counts(cols["depth_shift"], cols.get("margin"))} for label, cols in groups.items()]


def judged_groups(null: Sequence[Mapping] | None) -> list[Mapping]:
    """The honest groups whose mismatches define the null (those that made any)."""
    return [g for g in (null or ()) if int(g["positive"]) + int(g["negative"]) > 0]


def detectors(null: Sequence[Mapping] | None) -> tuple[str, ...]:
    """The detectors a null can judge: ``beyond`` only when every judged group counted it (files written
    before it have only the two sides)."""
    groups = judged_groups(null)
    if not groups:
        return ()
    return SIDE_DETECTORS if all(g.get("beyond") is not None for g in groups) else SIDE_DETECTORS[:2]


def oriented(counts: Mapping, detector: str):
    """(mismatches ``detector`` counts, the other mismatches) of ``counts`` (``side_counts``, a group, or
    arrays of counts, one per look)."""
    positive, negative = counts["positive"], counts["negative"]
    if detector == "narrower":
        return positive, negative
    if detector == "wider":
        return negative, positive
    if detector == "beyond":
        beyond = counts["beyond"]
        return beyond, positive + negative - beyond
    raise ValueError(f"unknown sampler-shape detector {detector!r}; known: {', '.join(SIDE_DETECTORS)}")


def fisher_greater(on: ArrayLike, off: ArrayLike, g_on: ArrayLike, g_off: ArrayLike) -> np.ndarray:
    """Fisher's one-sided exact p-value that ``on / (on + off)`` exceeds ``g_on / (g_on + g_off)``
    (``scipy.stats.fisher_exact([[on, off], [g_on, g_off]], alternative="greater")``), elementwise."""
    on, off, g_on, g_off = (np.asarray(c, dtype=np.int64) for c in (on, off, g_on, g_off))
    return np.clip(hypergeom.sf(on - 1, on + off + g_on + g_off, on + off, on + g_on), 0.0, 1.0)


def side_p_value(counts: Mapping, null: Sequence[Mapping], detector: str):
    """One-sided p-value that more of the mismatches of ``counts`` are of ``detector``'s kind than under
    any honest group of ``null``: the largest over groups of Fisher's exact test (a float, or an
    array when ``counts`` holds arrays, one entry per look)."""
    on, off = (np.asarray(c, dtype=np.int64) for c in oriented(counts, detector))
    groups = judged_groups(null)
    p = np.max([fisher_greater(on, off, *(int(c) for c in oriented(g, detector))) for g in groups], axis=0) \
        if groups else np.ones(np.broadcast(on, off).shape)
    p = np.where(on + off == 0, 1.0, p)
    return float(p) if p.ndim == 0 else p


def honest_share(null: Sequence[Mapping], detector: str) -> float | None:
    """The largest share of honest mismatches of ``detector``'s kind among the null's groups (None without any)."""
    shares = [oriented(g, detector)[0] / sum(oriented(g, detector)) for g in judged_groups(null)]
    return max(shares) if shares else None


__all__ = ["SIDE_DETECTORS", "detectors", "fisher_greater", "fit_side_null", "honest_share", "judged_groups", "oriented",
           "side_counts", "side_kinds", "side_p_value"]
