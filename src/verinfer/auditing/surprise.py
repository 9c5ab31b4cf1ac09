"""The surprise test: sampled completions judged against the reference's own variance, no draws.

Under the null (the provider samples from the reference's distribution q at every position), each
output token's reference log-probability ``log p(y_t)`` has, given the prefix, the mean
``E_q[log p]`` and variance ``Var_q[log p]`` that the reference's logits at that position give
(``verinfer.auditing.draws.completion_scores``: one prefill, no reference draws). Summed over the
tokens of every completion, ``Z = sum(log p - E_q[log p]) / sqrt(sum Var_q[log p])`` is a
martingale normalised by its predictable variance, so it is close to N(0, 1) for hundreds of tokens
(martingale central limit theorem); the test is two-sided (a lower temperature or greedier cheat
raises the log-probabilities, 4-bit weights, a higher temperature or a hidden system prompt lower
them). It is asymptotic, not exact: RESULTS.md section 21 measures its false-positive rate on
honest fp32 and bf16 providers at 10 to 100 queries; ``verinfer.auditing.rank`` is the exact test
with the same score.

Verdict: the one verdict rule (``verinfer.stats.verdict``), looked at on doubling prefixes of
completions at ``alpha / looks``.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import norm

from verinfer.auditing.rank import rank_looks
from verinfer.stats.verdict import Verdict, doubling_looks, sequential


def surprise_z(scores) -> float:
    """Z of the pooled centred log-probability of ``scores`` (``CompletionScores``)."""
    var = float(np.sum(scores.variance))
    return float(np.sum(scores.centred)) / np.sqrt(var) if var > 0 else 0.0


def surprise_p(scores) -> float:
    """Two-sided normal p-value of ``surprise_z``."""
    return float(2 * norm.sf(abs(surprise_z(scores))))


def surprise_verdict(scores, alpha: float = 0.01) -> Verdict:
    """Sequential surprise verdict over completions in order (``scores``: ``CompletionScores``)."""
    n = len(scores.tokens)
    if n < 1:
        raise ValueError("a surprise test needs at least 1 completion")
    looks = rank_looks(n) if n >= 2 else [1]
    p, first = sequential(lambda k: surprise_p(scores[:k]), looks, alpha)
    z = surprise_z(scores)
    per_token = float(np.sum(scores.centred)) / max(1, int(np.sum(scores.tokens)))
    tokens = np.asarray(scores.tokens)
    method = (f"sequential two-sided z-test ({doubling_looks(len(looks))} of completions, Bonferroni) of the "
              "provider's summed reference log-probability minus its expectation under the claimed sampling "
              "distribution, over its predictable standard deviation (no reference draws)")
    return Verdict(p >= alpha, p, alpha, int(tokens.sum()), n, "sequence", z, "surprise z", z, z, len(looks),
                   None if first is None else int(tokens[:first].sum()), method, sequences=n)
