"""Diagnosis: which configuration best explains a set of traces, among candidates replayed over one prefill.

A *candidate* is the claimed configuration with one thing changed: the sampler's temperature, top-k,
top-p or min-p, a repetition / presence / frequency penalty, the seeds (an offset, or one seed for
every request), the engine profile, a sampler bug (a rate of tokens uniform among the top K), or the
model (a derived model from the catalogue: ``band``, which needs a prefill of its own). Each candidate
is replayed on the same logits (``token_difr.score_block``, the verifier's own replay) and scored
token by token under one noise model:

    P(token | candidate) = max(2 * Phi(-m / sigma), eps)

where ``m`` is the token's Gumbel-max margin in raw logits (the distance to surviving the filters
when the candidate filters the token out), i.e. DiFR appendix A's likelihood: a token the candidate
replays exactly has P = 1, a mismatch that logit noise of std ``sigma`` explains stays likely, and
``eps`` is the floor for a token nothing in the candidate explains (an *unexplained* token). A bug
candidate mixes in ``rate / K`` for tokens among the top K raw logits.

Candidates are ranked by total log-likelihood; the best is tested against the claim with Vuong's
(1989) test for non-nested models on the per-token log-likelihood ratios (z = sum d / (sd(d) sqrt n),
one-sided), Bonferroni-corrected over the candidates tried. A candidate *explains* the traces when
its unexplained tokens are at most ``max_unexplained`` of them (for a bug candidate, the tokens only
its bug explains count too beyond the 99.9% binomial quantile of its rate); when none does, the
diagnosis says so.
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
BUGS = ((2, 0.01), (2, 0.05), (8, 0.01), (8, 0.05), (32, 0.01), (32, 0.05))


@dataclass(frozen=True)
class Candidate:
    """The claim with at most one thing changed; ``label`` names it for people."""

    label: str
    axis: str  # claim, temperature, top_k, top_p, min_p, penalty, seed, profile, bug, model
    changes: tuple[tuple[str, Any], ...] = ()  # SamplingParams fields to replace
    seed_map: str | None = None  # "+d" / "-d": every seed shifted by d; "same": every request the first seed
    penalty: tuple[str, float] | None = None  # (repetition|presence|frequency, value), vLLM semantics
    bug: tuple[int, float] | None = None  # (K, rate): rate of tokens uniform among the top K raw logits
    band: str | None = None  # a model-side variant name (None: the reference model)

    def params(self, claimed: Sequence[SamplingParams]) -> list[SamplingParams]:
        """Each trace's sampling parameters under this candidate."""
        out = [p.with_(**dict(self.changes)) if self.changes else p for p in claimed]
        if self.seed_map == "same":
            return [p.with_(seed=out[0].seed) for p in out]
        if self.seed_map:
            return [p.with_(seed=(p.seed + int(self.seed_map)) % 2**63) if p.seed is not None else p for p in out]
        return out

    @property
    def replays(self) -> bool:
        """Whether it needs a replay of its own (a bug candidate is read from the claim's replay)."""
        return self.bug is None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "axis": self.axis, "changes": dict(self.changes), "seed_map": self.seed_map,
                "penalty": list(self.penalty) if self.penalty else None, "bug": list(self.bug) if self.bug else None,
                "band": self.band}


CLAIM = Candidate("claim", "claim")


def _fmt(x: float) -> str:
    return f"{x:g}"


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
        for t in temps:
            add(Candidate(f"temperature {_fmt(t)}", "temperature", (("temperature", t),)))
        for k in TOP_KS:
            add(Candidate("top-k off" if k <= 0 else f"top-k {k}", "top_k", (("top_k", k),)))
        for p in TOP_PS:
            add(Candidate("top-p off" if p >= 1 else f"top-p {_fmt(p)}", "top_p", (("top_p", p),)))
        for m in MIN_PS:
            add(Candidate("min-p off" if m <= 0 else f"min-p {_fmt(m)}", "min_p", (("min_p", m),)))
        for s in SEED_MAPS:  # "same" leaves a lone claim unchanged: judged on two requests
            c = Candidate("one seed for every request" if s == "same" else f"seed {s}", "seed", seed_map=s)
            pair = [claim, claim.with_(seed=(claim.seed or 0) + 1)]
            if claim.seed is not None and c.params(pair) != pair and not params_problems(c.params(pair)[1]):
                out.append(c)
        for name in profile_names():
            if name not in ("greedy", claim.profile):
                add(Candidate(f"profile {name}", "profile", (("profile", name),)))
    for kind, value in PENALTIES:
        out.append(Candidate(f"{kind} penalty {_fmt(value)}", "penalty", penalty=(kind, value)))
    for k, rate in BUGS:
        out.append(Candidate(f"bug: {_fmt(rate)} of tokens uniform in top {k}", "bug", bug=(k, rate)))
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


def bug_loglik(margin: np.ndarray, logit_rank: np.ndarray, k: int, rate: float, sigma: float = SIGMA,
               eps: float = EPS) -> np.ndarray:
    """log P under "the claim, but a ``rate`` of tokens uniform among the top ``k`` raw logits"."""
    p = (1 - rate) * np.exp(np.log(2.0) + log_ndtr(-np.asarray(margin, dtype=np.float64) / sigma))
    p = p + rate / k * (np.asarray(logit_rank) < k)
    return np.log(np.maximum(p, eps))


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
    bug_tokens: int = 0  # tokens only a bug candidate's bug explains (its budget is checked in ``rank``)

    def add(self, exact: np.ndarray, margin: np.ndarray, loglik: np.ndarray, claim_loglik: np.ndarray,
            eps: float = EPS, bug_only: np.ndarray | None = None) -> None:
        """Add a block; ``bug_only`` marks the tokens a bug candidate explains by its bug alone."""
        d = loglik - claim_loglik
        self.tokens += int(loglik.size)
        self.exact += int(np.sum(exact))
        self.unexplained += int(np.sum(loglik <= np.log(eps) + 1e-12))
        self.bug_tokens += 0 if bug_only is None else int(np.sum(bug_only))
        self.margin_sum += float(np.sum(margin))
        self.loglik += float(np.sum(loglik))
        self.d_sum += float(np.sum(d))
        self.d_sq += float(np.sum(d * d))


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
    p: float  # Vuong's one-sided p-value, Bonferroni-corrected over the candidates

    @property
    def explains(self) -> bool:
        return self.unexplained <= MAX_UNEXPLAINED

    def to_dict(self) -> dict[str, Any]:
        return {**self.candidate.to_dict(), "tokens": self.tokens, "exact": self.exact,
                "mean_margin": self.mean_margin, "unexplained": self.unexplained, "loglik": self.loglik,
                "lr": self.lr, "z": self.z, "p": self.p, "explains": self.explains}


@dataclass
class Diagnosis:
    """Candidates ranked best first, the claim's own line, and the conclusion in words."""

    ranked: list[Ranked]
    claim: Ranked
    alpha: float = ALPHA
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    @property
    def claim_rejected(self) -> bool:
        """The best candidate is not the claim and beats it at level ``alpha`` (Bonferroni)."""
        return self.best.candidate != CLAIM and self.best.p < self.alpha

    @property
    def explained(self) -> bool:
        return any(r.explains for r in self.ranked)

    @property
    def text(self) -> str:
        b, c = self.best, self.claim
        if not self.explained:
            return (f"no candidate explains it: the best, {b.candidate.label}, leaves {b.unexplained:.1%} of "
                    f"tokens unexplained (exact {b.exact:.1%}; at most {MAX_UNEXPLAINED:.0%} allowed)")
        if not self.claim_rejected:
            return (f"the claim explains it (exact {c.exact:.1%}, margin {c.mean_margin:.3g}); no candidate "
                    f"explains it better at p < {self.alpha:g} (next: {self._runner_up()})")
        return (f"best explained by {b.candidate.label} (exact {b.exact:.1%}, margin {b.mean_margin:.3g}) vs the claim "
                f"(exact {c.exact:.1%}, margin {c.mean_margin:.3g}): LR {b.lr:.1f}, Vuong z {b.z:.1f}, "
                f"p {b.p:.2g} (Bonferroni over {len(self.ranked)} candidates)")

    def _runner_up(self) -> str:
        other = next((r for r in self.ranked if r.candidate != CLAIM), None)
        return "none" if other is None else f"{other.candidate.label}, exact {other.exact:.1%}, p {other.p:.2g}"

    def to_dict(self) -> dict[str, Any]:
        return {"conclusion": self.text, "claim_rejected": self.claim_rejected, "explained": self.explained,
                "best": self.best.to_dict(), "claim": self.claim.to_dict(), "alpha": self.alpha,
                "test": "Vuong (1989) one-sided test on per-token log-likelihood ratios, Bonferroni over candidates",
                "noise_model": {"sigma": self.settings.get("sigma", SIGMA), "eps": self.settings.get("eps", EPS),
                                "max_unexplained": MAX_UNEXPLAINED},
                "settings": self.settings, "candidates": [r.to_dict() for r in self.ranked]}


def rank(tallies: dict[Candidate, Tally], alpha: float = ALPHA, settings: dict[str, Any] | None = None) -> Diagnosis:
    """Candidates by log-likelihood (the claim first among equals), each tested against the claim."""
    claim = tallies[CLAIM]
    k = max(len(tallies) - 1, 1)
    lines = []
    for c, t in tallies.items():
        z, p = vuong(t) if c != CLAIM else (0.0, 1.0)
        n = max(t.tokens, 1)
        unexplained = t.unexplained + (max(0, t.bug_tokens - int(binom.ppf(0.999, t.tokens, c.bug[1]))) if c.bug else 0)
        lines.append(Ranked(c, t.tokens, t.exact / n, t.margin_sum / n, unexplained / n, t.loglik,
                            2 * (t.loglik - claim.loglik), z, min(1.0, p * k)))
    order = sorted(range(len(lines)), key=lambda i: (-lines[i].loglik, lines[i].candidate != CLAIM, i))
    ranked = [lines[i] for i in order]
    return Diagnosis(ranked, next(r for r in ranked if r.candidate == CLAIM), alpha, settings or {})
