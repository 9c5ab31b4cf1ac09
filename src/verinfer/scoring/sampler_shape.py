"""Sampler-shape scores: on which side of the verifier's token a mismatched claim lies (issue #28).

Honest numerical noise (bf16 weights, other kernels, batching) moves the argmax of ``x + G`` between
near-tied candidates, and which of the two has the higher logit is a coin flip: the claim is as
often deeper in the distribution than the verifier's token as shallower. A wrong sampler moves it
one way. A narrower top-k / top-p / min-p never emits the verifier's token when that token lies
beyond the served boundary, and emits a shallower one instead; a colder temperature favours the
higher logit of every pair (if ``x_c / T_s + G_c > x_v / T_s + G_v`` and ``x_v / T + G_v > x_c / T + G_c``
with ``T_s < T`` then ``x_c > x_v``). A wider filter or a hotter temperature emits a deeper token.

``depth(t)`` places token ``t`` in the claimed sampler's kept set as its tightest filter sees it:
the largest of ``rank / top_k``, the probability mass before ``t`` over ``top_p`` (over the tokens
min-p and top-k keep, as vLLM's top-p; with top-p off this is the mass before ``t`` itself) and
``min_p * p_max / p_t``. Kept tokens have depth below 1 (the top token 0); a token a filter removes
has depth at least 1 (capped at ``DEPTH_CAP``). A served filter a fifth narrower than the claim
makes mismatches whose verifier token has depth >= 0.8 and whose claim is shallow.

``depth_shift = depth(verifier token) - depth(claim)`` at mismatches, 0 where they agree (and for
greedy rows, whose sampler has no filter or temperature to deviate): positive means the provider
looks narrower or colder than claimed, negative wider or hotter. Honest noise puts it on both
sides; the detectors ``narrower`` and ``wider`` count the mismatches on each side cumulatively, and
``beyond`` those of the deep side whose claim the claimed filters remove (an infinite margin: where
a wider filter puts all of its mismatches), and test them against the honest groups' counts of the
same calibration as the margin (``verinfer.stats.sides``).
Computed only for the mismatched rows of a block of logits the prefill already produced (about 1%
of tokens), so it costs nothing next to the prefill.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from verinfer.sampling.params import SamplingParams

DEPTH_CAP = 2.0  # a claim twice as deep as the claimed boundary allows counts no more than at 2x


def depth(x: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Depth of ``tokens`` [M] in rows of tempered logits ``x`` [M, V] under each row's claimed filters."""
    m, vocab = x.shape
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=x.device)
    top_p = torch.tensor([min(max(p.top_p, 1e-9), 1.0) for p in params], dtype=torch.float64, device=x.device)
    min_p = torch.tensor([max(p.min_p, 0.0) for p in params], dtype=torch.float64, device=x.device)
    xt = x.gather(1, tokens[:, None]).squeeze(1)
    above = x > xt[:, None]
    rank = above.sum(-1)
    row_max = x.max(-1).values
    tau = torch.full((m,), float("-inf"), dtype=x.dtype, device=x.device)
    m_on = min_p > 0
    tau = torch.where(m_on, row_max + torch.log(min_p.clamp_min(1e-45)).to(x.dtype), tau)
    k_on = (top_k > 0) & (top_k < vocab)
    if bool(k_on.any()):
        kth = x.topk(int(top_k[k_on].max()), dim=-1).values.gather(1, (top_k.clamp(1, vocab) - 1)[:, None]).squeeze(1)
        tau = torch.where(k_on, torch.maximum(tau, kth), tau)
    e = torch.exp((x - row_max[:, None]).double()).masked_fill(x < tau[:, None], 0.0)
    mass_before = (e * above).sum(-1) / e.sum(-1)
    d = mass_before / top_p
    d = torch.where(k_on, torch.maximum(d, rank.double() / top_k.clamp_min(1).double()), d)
    d = torch.where(m_on, torch.maximum(d, min_p * torch.exp((row_max - xt).double())), d)
    return d.clamp(0.0, DEPTH_CAP)


def depth_shift(logits: torch.Tensor, claimed: np.ndarray, verifier: np.ndarray,
                params: Sequence[SamplingParams]) -> np.ndarray:
    """Per-row ``depth(verifier) - depth(claim)`` for rows of raw ``logits`` [N, V] (0 where they agree)."""
    out = np.zeros(len(claimed))
    rows = np.flatnonzero((np.asarray(claimed) != np.asarray(verifier))
                          & np.array([not p.is_greedy for p in params], dtype=bool))
    if rows.size == 0:
        return out
    sub = [params[i] for i in rows.tolist()]
    idx = torch.as_tensor(rows, device=logits.device)
    temp = torch.tensor([p.effective_temperature for p in sub], dtype=torch.float32, device=logits.device)
    x = logits[idx].float() / temp[:, None]
    tok = lambda a: torch.as_tensor(np.asarray(a)[rows], dtype=torch.long, device=logits.device)  # noqa: E731
    out[rows] = (depth(x, tok(verifier), sub) - depth(x, tok(claimed), sub)).cpu().numpy()
    return out


__all__ = ["DEPTH_CAP", "depth", "depth_shift"]
