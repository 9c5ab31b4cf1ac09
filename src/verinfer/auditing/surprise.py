"""The surprise test: sampled completions judged against the reference's own distribution, no draws.

Under the null (the provider samples from the reference's distribution q at every position), each
output token's centred reference log-probability ``X_t = log p(y_t) - E_q[log p]`` has, given the
prefix, a distribution the reference's logits at that position fix: its cumulant generating
function ``psi_t(lambda) = log E_q[exp(lambda X_t)]`` comes from the same prefill that scores the
completion (``verinfer.auditing.draws.completion_scores(..., tilts=TILTS)``: no reference draws).
So for every tilt ``lambda``, ``exp(sum_t lambda X_t - psi_t(lambda))`` over the tokens of the
completions judged so far is a nonnegative martingale with mean 1, and so is their average over
``TILTS``; by Ville's inequality the chance that it *ever* reaches ``1 / alpha`` is at most
``alpha``, whatever the model, the completions' lengths, stops and ties, and however often it is
looked at (Shafer & Vovk, *Game-Theoretic Foundations for Probability and Finance*, 2019; Howard et
al., *Time-uniform Chernoff bounds via nonnegative supermartingales*, Prob. Surveys 2020). The
p-value ``min(1, 1 / max_k M_k)`` over completion prefixes is valid at every size: no asymptotics,
no Bonferroni over looks. This replaced a normal z-test, which rejected 1.05-1.33% of honest audits
at a 1% target on short completions that stop (RESULTS.md section 21).

Why these tilts: at the claimed temperature T with no filter, ``exp(lambda X_t - psi_t(lambda))`` is
exactly the likelihood ratio of sampling at temperature ``T / (1 + lambda)`` against T, so each tilt
is the sequential probability ratio test of one wrong temperature (lambda = -1/11: T 1.1 claimed as
1.0) and any provider that raises or lowers the log-probabilities on average (4-bit weights, a
hidden system prompt, a greedier cheat) grows the tilt nearest its drift / variance per token.
The grid is geometric, ``+-0.0125 * 2**j`` (temperature ratios 0.56-5), before any measurement.

Verdict: rejected at the first completion where the mixture reaches ``1 / alpha`` (its tokens are
*tokens needed*); ``surprise_z`` (the pooled centred log-probability over its predictable standard
deviation) is reported as the statistic, not tested.
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp

from verinfer.stats.verdict import Verdict

TILTS = tuple(sign * 0.0125 * 2 ** j for j in range(7) for sign in (-1, 1))


def surprise_z(scores) -> float:
    """Z of the pooled centred log-probability of ``scores`` (``CompletionScores``): a description."""
    var = float(np.sum(scores.variance))
    return float(np.sum(scores.centred)) / np.sqrt(var) if var > 0 else 0.0


def log_evidence(scores) -> np.ndarray:
    """Log of the mixture martingale over ``scores.tilts`` after each completion (``CompletionScores``
    from ``completion_scores(..., tilts=TILTS)``)."""
    if scores.cgf is None or not len(scores.tilts):
        raise ValueError("the surprise test needs each completion's cumulant generating function: score with "
                         "completion_scores(..., tilts=surprise.TILTS)")
    lam = np.asarray(scores.tilts, dtype=np.float64)
    log_m = np.cumsum(scores.centred)[:, None] * lam - np.cumsum(np.asarray(scores.cgf, dtype=np.float64), axis=0)
    return logsumexp(log_m, axis=1) - np.log(lam.size)


def surprise_p(scores) -> float:
    """Anytime-valid p-value: ``1 / max`` of the mixture martingale over completion prefixes."""
    return float(np.exp(-max(0.0, float(np.max(log_evidence(scores))))))


def surprise_verdict(scores, alpha: float = 0.01) -> Verdict:
    """Surprise verdict over completions in order (``scores``: ``CompletionScores`` with ``cgf``)."""
    n = len(scores.tokens)
    if n < 1:
        raise ValueError("a surprise test needs at least 1 completion")
    evidence, p = log_evidence(scores), surprise_p(scores)
    crossed = np.flatnonzero(evidence > -np.log(alpha))
    tokens = np.asarray(scores.tokens)
    z = surprise_z(scores)
    method = (f"test martingale of the provider's reference log-probability minus its expectation under the "
              f"claimed sampling distribution (exact cumulant generating function per position, mixture over "
              f"{len(scores.tilts)} tilts = temperature likelihood ratios), checked after every completion; "
              "p = 1 / its maximum (Ville's inequality: valid at every size, no reference draws)")
    return Verdict(p >= alpha, p, alpha, int(tokens.sum()), n, "sequence", z, "surprise z", z, z, n,
                   None if crossed.size == 0 else int(tokens[: crossed[0] + 1].sum()), method, sequences=n,
                   interval=False)
