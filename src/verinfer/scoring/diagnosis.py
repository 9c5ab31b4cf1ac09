"""Diagnosis: which configuration best explains a set of traces, among candidates replayed over one prefill.

A *candidate* is the claimed configuration with one thing changed: the sampler's temperature, top-k,
top-p or min-p, a repetition / presence / frequency penalty, the seeds (an offset, or one seed for
every request), the engine profile, a sampler bug (a rate of tokens uniform among the top K), or the
model (a derived model from the catalogue: ``band``, which needs a prefill of its own), or, for engines
whose noise is keyed by absolute position, prompts of another length (a hidden system or prefix message:
its length fitted by a search over offsets, ``shifted``), or the prompts rendered by another chat
template (``template``, a prefill of its own). Each candidate
is replayed on the same logits (``token_difr.score_block``, the verifier's own replay) and scored
token by token under one noise model:

    P(token | candidate) = max(2 * Phi(-m / sigma), eps)

where ``m`` is the token's Gumbel-max margin in raw logits (the distance to surviving the filters
when the candidate filters the token out), i.e. DiFR appendix A's likelihood: a token the candidate
replays exactly has P = 1, a mismatch that logit noise of std ``sigma`` explains stays likely, and
``eps`` is the floor for a token nothing in the candidate explains (an *unexplained* token).

Candidates are ranked by total log-likelihood; the best is tested against the claim with Vuong's
(1989) test for non-nested models on the per-token log-likelihood ratios (z = sum d / (sd(d) sqrt n),
one-sided), Bonferroni-corrected over the candidates tried. A candidate *explains* the traces when
its unexplained tokens are at most ``max_unexplained`` of them; when none does, the diagnosis says so.

A *sampler bug* (a rate of tokens drawn uniformly among the top K raw logits, whatever their margin)
nests the claim (rate 0) and changes few tokens, so it is judged on the tokens only a bug explains
(``off_boundary``): unexplained by the noise (a margin, or a filtered token's distance to its
filter, beyond it) and emitted where the claim's own pick is the top raw logit. Honest noise changes
a token where its margin is small or where it moves a filter's boundary across the pick, and no
top-k, top-p or min-p filter ever removes the top logit, so honest providers emit such tokens only
through rare large logit errors: at most ``HONEST_OFF_BOUNDARY`` per token (measured on honest bf16). In that event model the claim emits them at that rate, their logit rank
uniform over the top ``HONEST_RANKS``; the bug adds a rate ``rho`` of them uniform over its top K.
``rho`` is estimated by maximum likelihood (``bug_rate``), and the bug's log-likelihood is the
claim's plus the events' log-likelihood ratio at that estimate (``bug_loglik``), which ranks it and
picks K (a bug concentrated in the top 2 fits K = 2 best). Its p-value is the exact binomial tail of
its events among the top K against ``HONEST_OFF_BOUNDARY`` (``bug_test``; valid at the small counts
rare bugs give, where the boundary chi-square would not be), Bonferroni-corrected with the others. A
bug changes at most ``BUG_RATE_MAX`` of the tokens: its tokens beyond that rate's 99.9% binomial
quantile count as unexplained.

Only sums per candidate are kept (``Tally``), so memory does not grow with the tokens diagnosed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from scipy.special import log_ndtr
from scipy.stats import binom, norm

from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import params_problems, profile_names
from verinfer.scoring.shape import Shape, Shaped, classify

SIGMA = 0.1  # raw logits: honest bf16 / 8-bit mismatches of SmolLM2-135M have margins of this order (RESULTS 20)
EPS = 1e-4  # the likelihood floor of an unexplained token
MAX_UNEXPLAINED = 0.02  # a candidate explains traces when at most this share of tokens is unexplained
ALPHA = 0.01  # the LR test's level (after Bonferroni over the candidates)
WRONG_SEED_OFFSET = 1_000_003  # the catalogue's wrong-seed variant (simulate.variants), tried as a seed offset

TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5)
TEMPERATURE_FACTORS = (0.9, 0.95, 1.05, 1.1)
TOP_KS = (-1, 5, 10, 20, 30, 40, 50, 64, 100)
TOP_PS = (1.0, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99)
MIN_PS = (0.0, 0.02, 0.05, 0.1)
PENALTIES = (("repetition", 1.05), ("repetition", 1.1), ("repetition", 1.2), ("repetition", 1.3),
             ("presence", 0.5), ("presence", 1.0), ("frequency", 0.5), ("frequency", 1.0))
SEED_MAPS = ("+1", "-1", f"+{WRONG_SEED_OFFSET}", "same")
BUG_KS = (2, 4, 8, 16, 32)  # sampler bugs tried: tokens uniform among the top K raw logits
BUG_RATE_MAX = 0.05  # the most tokens a "rare" sampler bug changes
HONEST_RANKS = 64  # the claim's model of an honest off-boundary token's logit rank: uniform over the top 64
# 99% upper confidence bound (Clopper-Pearson) on the rate of honest tokens that only a bug explains
# (``off_boundary``): 9 of 32,733 honest bf16 tokens of SmolLM2-135M on the shipped calibrations'
# prompts (vllm, vllm-v1, vllm-v1-cuda, vllm-cpu, llama.cpp; top-k 50, top-p 0.95); with the
# transformers traces added since, 10 of 38,606 (bound 5.2e-4); 0 of 9,414 held out (top-k 50 / top-p
# 0.95 and min-p 0.05 claims). ``experiments/diagnose_confusion.py --honest-bound``, RESULTS 20.
HONEST_OFF_BOUNDARY = 5.8e-4


@dataclass(frozen=True)
class Candidate:
    """The claim with at most one thing changed; ``label`` names it for people."""

    label: str
    axis: str  # claim, temperature, top_k, top_p, min_p, penalty, seed, profile, bug, model, prompt
    changes: tuple[tuple[str, Any], ...] = ()  # SamplingParams fields to replace
    seed_map: str | None = None  # "+d" / "-d": every seed shifted by d; "same": every request the first seed
    penalty: tuple[str, float] | None = None  # (repetition|presence|frequency, value), vLLM semantics
    bug: int | None = None  # K: a bug draws some tokens (a rate estimated by ML) uniformly among the top K raw logits
    band: str | None = None  # a model-side variant name (None: the reference model)
    shift: int | None = None  # the provider's prompts this many tokens longer (a position-keyed engine's noise moves)
    interval: tuple[float, float] | None = None  # a fitted value's 95% interval (``scoring.fit``)
    near: tuple[str, ...] = ()  # a searched model's 95% set: the derived models as likely as it (``scoring.fit``)
    template: str | None = None  # the prompts rendered by this chat template (``verinfer.chat_templates``)

    def params(self, claimed: Sequence[SamplingParams]) -> list[SamplingParams]:
        """Each trace's sampling parameters under this candidate."""
        out = [p.with_(**dict(self.changes)) if self.changes else p for p in claimed]
        if self.seed_map == "same":
            return [p.with_(seed=out[0].seed) for p in out]
        if self.seed_map:
            return [p.with_(seed=(p.seed + int(self.seed_map)) % 2**63) if p.seed is not None else p for p in out]
        return out

    @property
    def named(self) -> str:
        """The label, with a fitted value's interval."""
        if self.near:
            others = [n for n in self.near if n not in (self.band, self.template)]
            return f"{self.label} (searched; {'95% set also holds ' + ', '.join(others) if others else 'alone in its 95% set'})"
        if self.interval is None:
            return self.label
        return f"{self.label} (fitted; 95% interval {_fmt(self.interval[0])}-{_fmt(self.interval[1])})"

    @property
    def replays(self) -> bool:
        """Whether it needs a replay of its own (a bug candidate is read from the claim's replay)."""
        return self.bug is None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "axis": self.axis, "changes": dict(self.changes), "seed_map": self.seed_map,
                "penalty": list(self.penalty) if self.penalty else None, "bug_top": self.bug,
                "band": self.band, "prompt_shift": self.shift, "chat_template": self.template,
                "interval": None if self.interval is None else list(self.interval), "near": list(self.near)}


CLAIM = Candidate("claim", "claim")


def shifted(d: int) -> Candidate:
    """The claim on prompts ``d`` tokens longer (shorter when negative) than the claimed ones: what a hidden
    system or prefix message of ``d`` tokens does to an engine whose noise is keyed by absolute position
    (``Profile.position_keyed``: vLLM's model runner V2, SGLang), whose every draw then moves by ``d``."""
    why = "a hidden system or prefix message" if d > 0 else "another system message, or a truncated context"
    n = f"{abs(d)} token{'' if abs(d) == 1 else 's'}"
    return Candidate(f"prompts {n} {'longer' if d > 0 else 'shorter'} than claimed ({why})", "prompt",
                     shift=int(d))


def _fmt(x: float) -> str:
    return f"{x:g}"


def label_for(axis: str, value: float) -> str:
    """A sampler candidate's name: ``axis`` a ``SamplingParams`` field or a penalty's kind."""
    if axis == "temperature":
        return f"temperature {_fmt(value)}"
    if axis == "top_k":
        return "top-k off" if value <= 0 else f"top-k {int(value)}"
    if axis == "top_p":
        return "top-p off" if value >= 1 else f"top-p {_fmt(value)}"
    if axis == "min_p":
        return "min-p off" if value <= 0 else f"min-p {_fmt(value)}"
    return f"{axis} penalty {_fmt(value)}"


def candidate_grid(claim: SamplingParams, bands: Sequence[str] = ()) -> list[Candidate]:
    """The claim first, then every one-change candidate that differs from it and that its profile can
    replay (``params_problems``); ``bands`` adds one model-side candidate per derived model."""
    out = [CLAIM]

    def add(c: Candidate) -> None:
        p = c.params([claim])[0]
        if p != claim and not params_problems(p):
            out.append(c)

    if not claim.is_greedy:
        temps = sorted({*TEMPERATURES, *(round(claim.temperature * f, 3) for f in TEMPERATURE_FACTORS)})
        for axis, values in (("temperature", temps), ("top_k", TOP_KS), ("top_p", TOP_PS), ("min_p", MIN_PS)):
            for v in values:
                add(Candidate(label_for(axis, v), axis, ((axis, v),)))
        for s in SEED_MAPS:  # "same" leaves a lone claim unchanged: judged on two requests
            c = Candidate("one seed for every request" if s == "same" else f"seed {s}", "seed", seed_map=s)
            pair = [claim, claim.with_(seed=(claim.seed or 0) + 1)]
            if claim.seed is not None and c.params(pair) != pair and not params_problems(c.params(pair)[1]):
                out.append(c)
        for name in profile_names():
            if name not in ("greedy", claim.profile):
                add(Candidate(f"profile {name}", "profile", (("profile", name),)))
    for kind, value in PENALTIES:
        out.append(Candidate(label_for(kind, value), "penalty", penalty=(kind, value)))
    for k in BUG_KS:
        out.append(Candidate(f"bug: tokens uniform in top {k}", "bug", bug=k))
    for band in bands:
        out.append(Candidate(f"model {band}", "model", band=band))
    return out


def penalized(logits: torch.Tensor, histories: Sequence[tuple[Sequence[int], Sequence[int]]],
              kind: str, value: float) -> torch.Tensor:
    """``logits`` [N, V] with one penalty applied as vLLM's ``apply_penalties`` does, before temperature
    (vllm/model_executor/layers/utils.py): repetition divides positive logits and multiplies negative
    ones of every token seen in the prompt or output; frequency subtracts ``value * count`` of each
    output token; presence subtracts ``value`` once per output token seen. ``histories[i]`` is row i's
    (prompt ids, output ids before the row)."""
    out = logits.clone()
    rows, cols, counts = [], [], []
    for r, (prompt, output) in enumerate(histories):
        seen = list(output) + (list(prompt) if kind == "repetition" else [])
        ids, n = np.unique(np.asarray(seen, dtype=np.int64), return_counts=True)
        rows.append(np.full(ids.size, r)), cols.append(ids)
        counts.append(n if kind == "frequency" else np.ones(ids.size))
    r = torch.as_tensor(np.concatenate(rows) if rows else np.empty(0, np.int64), device=out.device)
    if r.numel() == 0:
        return out
    c = torch.as_tensor(np.concatenate(cols), device=out.device)
    x = out[r, c]
    if kind == "repetition":
        out[r, c] = torch.where(x > 0, x / value, x * value)
    else:
        out[r, c] = x - value * torch.as_tensor(np.concatenate(counts), dtype=out.dtype, device=out.device)
    return out


def effective_margin(margin: np.ndarray, filter_distance: np.ndarray) -> np.ndarray:
    """The margin, with a filtered token's (infinite) margin replaced by its finite distance to the filter."""
    m = np.asarray(margin, dtype=np.float64)
    return np.where(np.isinf(m), np.asarray(filter_distance, dtype=np.float64), m)


def token_loglik(margin: np.ndarray, sigma: float = SIGMA, eps: float = EPS) -> np.ndarray:
    """log P(token | candidate) under the noise model (module docstring), floored at log ``eps``."""
    z = np.asarray(margin, dtype=np.float64) / sigma
    return np.maximum(np.log(2.0) + log_ndtr(-z), np.log(eps))


def bug_rate(events_in_top: int, events: int, tokens: int, k: int, honest_rate: float = HONEST_OFF_BOUNDARY,
             ranks: int = HONEST_RANKS) -> float:
    """ML estimate of the rate ``rho`` of off-boundary tokens a top-``k`` bug adds (module docstring):
    ``events_in_top`` of them lie in the top ``k``, ``events`` in all, among ``tokens``. Maximizes
    ``bug_loglik``: ``N_k c / (1 + rho c) = (n - N) / (1 - pi - rho)`` with ``c = ranks / (pi k)``."""
    if events_in_top == 0:
        return 0.0
    c = ranks / (honest_rate * k)
    rho = (events_in_top * c * (1 - honest_rate) - (tokens - events)) / (c * (events_in_top + tokens - events))
    return float(min(max(rho, 0.0), BUG_RATE_MAX))


def bug_loglik(rho: float, events_in_top: int, events: int, tokens: int, k: int,
               honest_rate: float = HONEST_OFF_BOUNDARY, ranks: int = HONEST_RANKS) -> float:
    """log P(events | bug at ``rho``) - log P(events | claim): each of the ``events_in_top`` events
    gains ``log(1 + rho c)`` (the bug's ``rho / k`` beside the claim's ``pi / ranks``), each of the
    ``tokens - events`` others loses ``log((1 - pi - rho) / (1 - pi))``."""
    c = ranks / (honest_rate * k)
    return float(events_in_top * np.log1p(rho * c) + (tokens - events) * np.log1p(-rho / (1 - honest_rate)))


def off_boundary(claim_loglik: np.ndarray, pick_is_top: np.ndarray, eps: float = EPS) -> np.ndarray:
    """Tokens only a bug explains (module docstring): unexplained by the claim's noise model and emitted
    where the claim's pick is the top raw logit (no top-k / top-p / min-p filter removes it, so noise
    cannot have moved a filter's boundary across the pick)."""
    return (np.asarray(claim_loglik) <= np.log(eps) + 1e-12) & np.asarray(pick_is_top, bool)


def bug_test(events: int, tokens: int, honest_rate: float = HONEST_OFF_BOUNDARY) -> float:
    """One-sided exact binomial p-value of ``events`` tokens only a bug explains among ``tokens``, when
    honest providers emit them at most at ``honest_rate`` per token."""
    return float(binom.sf(events - 1, tokens, honest_rate)) if events > 0 else 1.0


@dataclass
class Tally:
    """Running sums for one candidate: its fit and its per-token log-likelihood ratio against the claim."""

    tokens: int = 0
    exact: int = 0
    unexplained: int = 0
    margin_sum: float = 0.0
    loglik: float = 0.0
    d_sum: float = 0.0  # sum of loglik(candidate) - loglik(claim)
    d_sq: float = 0.0

    def add(self, exact: np.ndarray, margin: np.ndarray, loglik: np.ndarray, claim_loglik: np.ndarray,
            eps: float = EPS) -> None:
        d = loglik - claim_loglik
        self.tokens += int(loglik.size)
        self.exact += int(np.sum(exact))
        self.unexplained += int(np.sum(loglik <= np.log(eps) + 1e-12))
        self.margin_sum += float(np.sum(margin))
        self.loglik += float(np.sum(loglik))
        self.d_sum += float(np.sum(d))
        self.d_sq += float(np.sum(d * d))


@dataclass
class BugTally(Tally):
    """A bug candidate's counts, read from the claim's replay: the tokens the claim leaves unexplained
    among the bug's top K (its bug's tokens) and outside it, and the off-boundary events in the top K and in all."""

    bug_tokens: int = 0  # unexplained by the claim, among the top K (their budget is checked in ``rank``)
    events_in_top: int = 0  # ``off_boundary`` tokens among the top K: the test's count
    events: int = 0  # ``off_boundary`` tokens at any rank

    def add_bug(self, k: int, exact: np.ndarray, margin: np.ndarray, claim_loglik: np.ndarray,
                logit_rank: np.ndarray, only_bug: np.ndarray, eps: float = EPS) -> None:
        in_top = np.asarray(logit_rank) < k
        at_floor = claim_loglik <= np.log(eps) + 1e-12
        self.tokens += int(claim_loglik.size)
        self.exact += int(np.sum(exact))
        self.margin_sum += float(np.sum(margin))
        self.unexplained += int(np.sum(at_floor & ~in_top))
        self.bug_tokens += int(np.sum(at_floor & in_top))
        self.events_in_top += int(np.sum(only_bug & in_top))
        self.events += int(np.sum(only_bug))


def vuong(t: Tally) -> tuple[float, float]:
    """Vuong's one-sided test that the candidate fits better than the claim: (z, p)."""
    if t.tokens == 0:
        return 0.0, 1.0
    mean = t.d_sum / t.tokens
    var = max(t.d_sq / t.tokens - mean * mean, 0.0)
    if var <= 1e-300:
        return (np.inf, 0.0) if mean > 0 else (0.0, 1.0)
    z = mean * np.sqrt(t.tokens) / np.sqrt(var)
    return float(z), float(norm.sf(z))


@dataclass
class Ranked:
    """One candidate's line in the diagnosis."""

    candidate: Candidate
    tokens: int
    exact: float
    mean_margin: float
    unexplained: float
    loglik: float
    lr: float  # 2 * (loglik - claim loglik): the likelihood-ratio statistic against the claim
    z: float
    p: float  # one-sided p-value (Vuong's; a bug's: binomial), Bonferroni-corrected over the candidates
    rate: float | None = None  # a bug's ML rate of off-boundary tokens (``bug_rate``)
    events: int | None = None  # a bug's tokens that only a bug explains (``off_boundary``, among its top K)
    expected: float | None = None  # the most of them honest providers would emit (``HONEST_OFF_BOUNDARY``)

    @property
    def explains(self) -> bool:
        return self.unexplained <= MAX_UNEXPLAINED

    @property
    def evidence(self) -> str:
        """How this candidate beats the claim, in words."""
        if self.rate is None:
            return f"LR {self.lr:.1f}, Vuong z {self.z:.1f}"
        return (f"{self.events} of {self.tokens} tokens in its top K changed beyond honest noise and filter boundaries "
                f"where the claim's pick is the top logit (at most {self.expected:.2g} expected of an honest provider; "
                f"the bug's ML rate of them {self.rate:.2g}), binomial")

    def to_dict(self) -> dict[str, Any]:
        return {**self.candidate.to_dict(), "tokens": self.tokens, "exact": self.exact,
                "mean_margin": self.mean_margin, "unexplained": self.unexplained, "loglik": self.loglik,
                "lr": self.lr, "z": self.z, "p": self.p, "explains": self.explains,
                **({} if self.rate is None else {"rate": self.rate, "events": self.events, "expected": self.expected})}


@dataclass
class Judged:
    """``verify``'s calibrated verdict on the same traces, beside the diagnosis (issue #41 item 3, one
    story): whether the traces deviate is the calibrated verdict's to say, at its measured FPR (the
    likelihood's noise model, ``SIGMA``, is assumed, not measured); what explains them is diagnose's."""

    consistent: bool
    p: float
    tokens: int
    calibration: str
    decided_by: str | None = None  # the detector with the smallest p (margin, narrower, wider, beyond)
    uncovered: tuple[str, ...] = ()  # honest model-side variants (bf16) whose noise the calibration lacks
    recorded: bool = True  # whether the calibration records its honest precisions (else none is assumed held)
    sides: dict = field(default_factory=dict)  # the verdict's sampler-shape detectors (``Verdict.detectors``)
    detectors: int = 1  # how many detectors the verdict's Bonferroni correction counted
    alpha: float = ALPHA  # the verdict's level
    honest_off: dict = field(default_factory=dict)  # side detector -> largest honest rate per token of the other side

    @property
    def text(self) -> str:
        by = f", by {self.decided_by}" if self.decided_by else ""
        return (f"verify: {'CONSISTENT' if self.consistent else 'INCONSISTENT'}, p {self.p:.2g} over {self.tokens} "
                f"tokens ({self.calibration}{by})")

    def to_dict(self) -> dict[str, Any]:
        return {"consistent": self.consistent, "p": self.p, "tokens": self.tokens, "calibration": self.calibration,
                "decided_by": self.decided_by, "uncovered": list(self.uncovered),
                "precisions_recorded": self.recorded, "sampler_shape_detectors": self.sides}


@dataclass
class Diagnosis:
    """Candidates ranked best first, the claim's own line, the calibrated verdict on the same traces
    when one judged them, and the conclusion in words."""

    ranked: list[Ranked]
    claim: Ranked
    alpha: float = ALPHA
    settings: dict[str, Any] = field(default_factory=dict)
    verdict: Judged | None = None
    shape: Shape | None = None  # the claim's replay counts the deviation's class is read from

    @property
    def shaped(self) -> Shaped | None:
        """Which kind of deviation the evidence shows (``scoring.shape``), when the claim's replay was counted."""
        if self.shape is None:
            return None
        v = self.verdict
        return classify(self.shape, v.sides if v else None, v.detectors if v else 1, v.alpha if v else self.alpha,
                        self._context if self.context_led else None, v.honest_off if v else None,
                        v.tokens if v else 0)

    @property
    def _context(self) -> str:
        """What the context candidate that leads explains (``scoring.shape``'s context class)."""
        c = self.best.candidate
        if c.template is not None:
            return f"{c.label} reproduces the tokens (exact {self.best.exact:.1%})"
        return f"{c.label} explains the engine's position-keyed noise"

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    @property
    def tried(self) -> int:
        """Candidates the Bonferroni correction counts: those ranked, and every value screened to choose them
        (prompt offsets, fitted families' values; ``settings["screened"]``)."""
        return len(self.ranked) + int(self.settings.get("screened", 0))

    @property
    def claim_rejected(self) -> bool:
        """The best candidate is not the claim and beats it at level ``alpha`` (Bonferroni)."""
        return self.best.candidate != CLAIM and self.best.p < self.alpha

    @property
    def context_led(self) -> bool:
        """The best candidate is prompts of another length and beats the claim: it explains the noise, and
        the tokens it leaves unexplained are the other prompt's text, which no replay of the claimed one has."""
        return self.best.candidate.axis == "prompt" and self.claim_rejected

    @property
    def explained(self) -> bool:
        return any(r.explains for r in self.ranked) or self.context_led

    @property
    def deviates(self) -> bool:
        """What the exit status says: the calibrated verdict's when there is one, else the likelihood's."""
        if self.verdict is not None:
            return not self.verdict.consistent
        return self.claim_rejected or not self.explained

    @property
    def text(self) -> str:
        """The conclusion, and, where no candidate names the cause of a deviation, its class (issue #41 item 2:
        "no candidate explains it" is never the whole answer)."""
        shaped, v = self.shaped, self.verdict
        unnamed = not self.explained or (v is not None and not v.consistent and not self.claim_rejected)
        if shaped is None or shaped.kind is None or self.context_led or not unnamed:
            return self._conclusion
        return f"{self._conclusion}; {shaped.text}"

    @property
    def _conclusion(self) -> str:
        """The likelihood's conclusion, reconciled with the verdict when one judged the same traces: the two
        never say opposite things (issue #41 item 3)."""
        v, b = self.verdict, self.best
        if v is None:
            return self._likelihood
        if not v.consistent and self.explained and not self.claim_rejected:
            fits = [r for r in self.ranked if r.candidate.band in v.uncovered and r.explains]
            if fits:
                r = fits[0]
                name = r.candidate.band
                lacks = "lacks" if v.recorded else "does not record that it holds"
                return (f"the calibration {lacks} this precision's noise ({name}): the claim with {name} explains it "
                        f"(exact {r.exact:.1%}, margin {r.mean_margin:.3g}, LR vs the claim {r.lr:.1f}; the claim itself: "
                        f"exact {self.claim.exact:.1%}); {v.text}")
            if b.candidate != CLAIM:
                return (f"flagged: {v.text}; the likeliest cause is {b.candidate.named} (exact {b.exact:.1%} against "
                        f"the claim's {self.claim.exact:.1%}; {b.evidence}, p {b.p:.2g} over {self.tried} "
                        f"candidates: not significant by likelihood alone)")
            return (f"a deviation none of the candidates is: {v.text}, yet no candidate explains the tokens better "
                    f"than the claim (exact {self.claim.exact:.1%}, margin {self.claim.mean_margin:.3g}; next: "
                    f"{self._runner_up()})")
        if v.consistent and self.claim_rejected:
            return (f"not flagged: {v.text}; of the candidates, {b.candidate.named} fits the tokens better (exact "
                    f"{b.exact:.1%}; {b.evidence}, p {b.p:.2g}), which the calibrated detectors do not confirm: "
                    f"more tokens would decide")
        if v.consistent and not self.explained:
            return (f"not flagged: {v.text}; though no candidate explains the tokens well: the best, "
                    f"{b.candidate.named}, leaves {b.unexplained:.1%} unexplained (exact {b.exact:.1%})")
        return f"{self._likelihood}; {v.text}"

    @property
    def _likelihood(self) -> str:
        b, c = self.best, self.claim
        if not self.explained:
            return (f"no candidate explains it: the best, {b.candidate.named}, leaves {b.unexplained:.1%} of "
                    f"tokens unexplained (exact {b.exact:.1%}; at most {MAX_UNEXPLAINED:.0%} allowed)")
        if not self.claim_rejected:
            return (f"the claim explains it (exact {c.exact:.1%}, margin {c.mean_margin:.3g}); no candidate "
                    f"explains it better at p < {self.alpha:g} (next: {self._runner_up()})")
        context = "" if b.explains or not self.context_led or b.candidate.shift is None else (
            f"; a context-shaped deviation: the engine draws its noise by position, and the claim's draws match the "
            f"served tokens once moved by {b.candidate.shift:+d} positions; the {b.unexplained:.1%} of tokens left "
            f"unexplained are what the other prompt's text changes in the logits, which a replay of the claimed "
            f"prompt cannot reproduce")
        return (f"best explained by {b.candidate.named} (exact {b.exact:.1%}, margin {b.mean_margin:.3g}) vs the claim "
                f"(exact {c.exact:.1%}, margin {c.mean_margin:.3g}): {b.evidence} "
                f"p {b.p:.2g} (Bonferroni over {self.tried} candidates){context}")

    def _runner_up(self) -> str:
        other = next((r for r in self.ranked if r.candidate != CLAIM), None)
        if other is None:
            return "none"
        bug = "" if other.rate is None else f", {other.events} tokens only a bug explains ({other.expected:.2g} expected)"
        return f"{other.candidate.named}, exact {other.exact:.1%}{bug}, p {other.p:.2g}"

    def to_dict(self) -> dict[str, Any]:
        shaped = self.shaped
        return {"conclusion": self.text, "claim_rejected": self.claim_rejected, "explained": self.explained,
                "deviation_class": None if shaped is None else shaped.to_dict(),
                "replay_counts": None if self.shape is None else self.shape.to_dict(),
                "deviates": self.deviates, "verdict": None if self.verdict is None else self.verdict.to_dict(),
                "best": self.best.to_dict(), "claim": self.claim.to_dict(), "alpha": self.alpha,
                "test": "Vuong (1989) one-sided test on per-token log-likelihood ratios; a sampler bug: exact "
                        "binomial test of the tokens only a bug explains against honest providers' rate of them; "
                        "Bonferroni over candidates",
                "noise_model": {"sigma": self.settings.get("sigma", SIGMA), "eps": self.settings.get("eps", EPS),
                                "max_unexplained": MAX_UNEXPLAINED,
                                "honest_off_boundary": self.settings.get("honest_off_boundary", HONEST_OFF_BOUNDARY)},
                "settings": self.settings, "candidates": [r.to_dict() for r in self.ranked]}


def rank(tallies: dict[Candidate, Tally], alpha: float = ALPHA, settings: dict[str, Any] | None = None,
         honest_rate: float = HONEST_OFF_BOUNDARY, screened: int = 0) -> Diagnosis:
    """Candidates by log-likelihood (the claim first among equals), each tested against the claim (a bug
    at its ML rate, by ``bug_test`` against ``honest_rate``). ``screened``: values screened beyond the
    candidates in ``tallies`` to choose them (prompt offsets, ``diagnosis_run.search_shift``; a family's
    values, ``scoring.fit``): each counts as a candidate tried in the Bonferroni correction, as if every
    one had been replayed in full."""
    claim = tallies[CLAIM]
    k = max(len(tallies) - 1 + screened, 1)
    lines = []
    for c, t in tallies.items():
        n = max(t.tokens, 1)
        if isinstance(t, BugTally):
            rate = bug_rate(t.events_in_top, t.events, t.tokens, c.bug, honest_rate)
            loglik = claim.loglik + bug_loglik(rate, t.events_in_top, t.events, t.tokens, c.bug, honest_rate)
            p = bug_test(t.events_in_top, t.tokens, honest_rate)
            unexplained = t.unexplained + max(0, t.bug_tokens - int(binom.ppf(0.999, t.tokens, BUG_RATE_MAX)))
            bug = {"rate": rate, "events": t.events_in_top, "expected": honest_rate * t.tokens}
            z = max(0.0, float(norm.isf(p)))
        else:
            z, p = vuong(t) if c != CLAIM else (0.0, 1.0)
            loglik, unexplained, bug = t.loglik, t.unexplained, {}
        lines.append(Ranked(c, t.tokens, t.exact / n, t.margin_sum / n, unexplained / n, loglik,
                            2 * (loglik - claim.loglik), z, min(1.0, p * k), **bug))
    order = sorted(range(len(lines)), key=lambda i: (-lines[i].loglik, lines[i].candidate != CLAIM, i))
    ranked = [lines[i] for i in order]
    return Diagnosis(ranked, next(r for r in ranked if r.candidate == CLAIM), alpha, settings or {})
