"""The shape of a deviation: which kind of cause the evidence shows when no candidate names one (issue #41 item 2).

"No candidate explains it" leaves a user nowhere; the claim's own replay still says what kind of thing
happened. Read from the claimed sampler's replay of the traces (sums only, like ``diagnosis.Tally``):

- **sampler-shaped**: the mismatches fall on one side of the reference's token (a narrower or colder
  sampler emits shallower tokens, a wider or hotter one deeper ones, a wider filter tokens the claimed
  filters remove), beyond the share honest noise puts there, and the other side holds no more than
  honest noise makes. The first half is ``verify``'s own sampler-shape evidence (``stats.sides``: the
  calibrated verdict's ``narrower`` / ``wider`` / ``beyond`` detectors at the verdict's level,
  Bonferroni over its detectors), so it needs a calibration that holds honest side counts. The second
  half is what a sampler change is: it makes every one of its own mismatches on its side. Other
  weights make many on both sides, and a large share of them beyond the filters too (4-bit weights:
  147 of 377 beyond, where honest bf16 puts about a fifth, so the ``beyond`` detector fires), so
  the other side's count is held to the 99% binomial quantile of the largest per-token rate of such
  mismatches among the calibration's honest groups.
- **context-shaped**: a prompt of another length explains the noise (``diagnosis.shifted``: on engines
  whose noise is keyed by absolute position, a hidden or changed system message moves every draw), or
  the prompts rendered by another chat template explain the tokens (``verinfer.chat_templates``).
- **numerics-shaped**: most mismatches have margins the noise model explains (within ``SIGMA``'s
  reach: above the likelihood floor), on both sides: precision noise, more of it than the claim's.
- **weights-shaped**: most mismatches have margins no precision noise explains, spread over the
  output: other weights (a quantization, a damaged or missing layer, another model). On engines whose
  noise is keyed by the step, a changed prompt gives the same picture, and on those keyed by position a
  changed prompt of the claimed length does (its draws fall where the claim's do): the issue's proposed tell,
  divergence fading with position, was measured not to separate them (RESULTS.md section 34: a
  missing layer fades, a hidden system prompt does not), so the class says so.

The split between numerics and weights is at half the mismatches within the noise: honest bf16 and
8-bit weights put 93-96% of theirs there, 4-bit weights, two missing layers and another prompt 5-20%
(SmolLM2-135M, RESULTS.md section 34).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from scipy.stats import binom

NUMERICS_SHARE = 0.5  # mismatches within the noise model's reach: at least this share is numerics-shaped
SIDE_WORDS = {"narrower": "shallower than the reference's token (a narrower or colder sampler)",
              "wider": "deeper than the reference's token (a wider or hotter sampler)",
              "beyond": "tokens the claimed filters remove (a wider filter)"}


@dataclass
class Shape:
    """Running counts from the claim's replay."""

    tokens: int = 0
    mismatches: int = 0
    within_noise: int = 0  # mismatches whose margin the noise model explains (log-likelihood above its floor)
    shallower: int = 0  # mismatches whose claim is shallower than the replay's pick (``depth_shift`` > 0)
    deeper: int = 0
    beyond: int = 0  # deeper ones the claimed filters remove

    def add(self, exact: np.ndarray, loglik: np.ndarray, shift: np.ndarray, filtered: np.ndarray,
            floor: float) -> None:
        miss = ~np.asarray(exact, bool)
        shift = np.asarray(shift, dtype=np.float64)
        self.tokens += int(miss.size)
        self.mismatches += int(miss.sum())
        self.within_noise += int((miss & (np.asarray(loglik) > floor + 1e-12)).sum())
        self.shallower += int((miss & (shift > 0)).sum())
        self.deeper += int((miss & (shift < 0)).sum())
        self.beyond += int((miss & (shift < 0) & np.asarray(filtered, bool)).sum())

    def to_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass(frozen=True)
class Shaped:
    """The class and the evidence behind it, in words."""

    kind: str | None  # sampler, context, numerics, weights; None: no mismatch to read
    evidence: str

    @property
    def text(self) -> str:
        return f"the deviation is {self.kind}-shaped: {self.evidence}" if self.kind else self.evidence

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "evidence": self.evidence}


def classify(shape: Shape, sides: Mapping[str, Mapping] | None = None, detectors: int = 1, alpha: float = 0.01,
             context: str | None = None, honest_off: Mapping[str, float] | None = None, judged: int = 0) -> Shaped:
    """The deviation's class (module docstring). ``sides``: the calibrated verdict's side detectors
    (name -> {"on_side", "mismatches", "honest_share", "p"}) over its ``judged`` tokens, ``detectors`` how
    many the verdict corrected over, and ``honest_off`` (name -> the largest honest per-token rate of
    mismatches not on that side); ``context``: what a prompt candidate that beat the claim explains."""
    if context:
        return Shaped("context", context)
    off = honest_off or {}
    significant = {k: v for k, v in (sides or {}).items()
                   if v.get("mismatches") and v["p"] * detectors < alpha and k in off
                   and v["mismatches"] - v["on_side"] <= binom.ppf(0.99, judged, off[k])}
    if significant:
        name = min(significant, key=lambda k: significant[k]["p"])
        s = significant[name]
        return Shaped("sampler", f"{s['on_side']} of {s['mismatches']} mismatches are {SIDE_WORDS[name]}, where "
                                 f"honest noise puts at most {s['honest_share']:.0%} (verify's {name} detector, "
                                 f"p {s['p'] * detectors:.2g})")
    n, k = shape.tokens, shape.mismatches
    if k == 0:
        return Shaped(None, f"every one of {n} tokens replays exactly under the claim")
    share = shape.within_noise / k
    sides_text = f"{shape.shallower} shallower and {shape.deeper} deeper than the reference's token"
    if share >= NUMERICS_SHARE:
        return Shaped("numerics", f"{k} mismatches ({k / max(n, 1):.1%} of tokens), {share:.0%} of them within "
                                  f"the precision noise's margins, {sides_text}: noise of a precision or kernel the "
                                  f"claim does not hold")
    return Shaped("weights", f"{k} mismatches ({k / max(n, 1):.1%} of tokens), {1 - share:.0%} of them with "
                             f"margins no precision noise explains, {sides_text}: other weights (quantized, "
                             f"damaged, another model) or another prompt (on an engine whose noise is keyed by "
                             f"position, one of the claimed length), which these margins do not tell apart")
