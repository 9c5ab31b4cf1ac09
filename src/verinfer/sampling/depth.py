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
Computed by the sampler's replay (``sampler.replay``, ``inverse_cdf.replay``) for its mismatched
rows, for both tokens of a row at once, from the top view of the row its filters already took
(issue #40: two full-vocabulary fp64 passes per token had made scoring an off-policy claim 2.5-4x
slower). A token inside the view is placed from the view alone; only a row with a token below its
view, or without top-k (whose normalizer spans the row), reads the row again, in fp32 as the
sampler's own normalizer does.
"""

from __future__ import annotations

from typing import Sequence

import torch

from verinfer.sampling.filters import masked_logsumexp, row_count
from verinfer.sampling.params import SamplingParams

DEPTH_CAP = 2.0  # a claim twice as deep as the claimed boundary allows counts no more than at 2x
VIEW = 64  # the row's largest logits at hand when no view is given (the kept set's width)


def depth(x: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams],
          view: torch.Tensor | None = None, rows: torch.Tensor | None = None,
          log_z: torch.Tensor | None = None) -> torch.Tensor:
    """Depth of ``tokens`` ([M], or [M, J] for J tokens per row) in M rows of tempered logits ``x``
    (all of ``x`` [M, V], or its ``rows``, read without copying the block) under each row's claimed
    filters (module docstring). ``view``: those rows' largest values, descending (``KeptSet.view``),
    when the caller has them; taken here when not, or too narrow. ``log_z``: those rows' log-normalizer
    over the tokens min-p and top-k keep (``KeptSet.base_norm``), when the caller has it: a row without
    top-k then needs no pass over its vocabulary here unless a token lies below its view."""
    one = tokens.dim() == 1
    tokens = tokens[:, None] if one else tokens
    rows = torch.arange(x.shape[0], device=x.device) if rows is None else rows
    m, vocab = tokens.shape[0], x.shape[1]
    dev = x.device
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
    top_p = torch.tensor([min(max(p.top_p, 1e-9), 1.0) for p in params], dtype=torch.float64, device=dev)
    min_p = torch.tensor([max(p.min_p, 0.0) for p in params], dtype=torch.float64, device=dev)
    k_on, m_on = (top_k > 0) & (top_k < vocab), min_p > 0
    width = min(vocab, max(VIEW, int(top_k[k_on].max()) + 1 if bool(k_on.any()) else 0))
    vals = view if view is not None and view.shape[1] >= width else x[rows].topk(width, dim=-1).values  # descending
    width = vals.shape[1]
    row_max = vals[:, 0]
    tau = torch.where(m_on, row_max + torch.log(min_p.clamp_min(1e-45)).to(x.dtype),
                      torch.full((m,), float("-inf"), dtype=x.dtype, device=dev))
    if bool(k_on.any()):
        kth = vals.gather(1, (top_k.clamp(1, width) - 1)[:, None]).squeeze(1)
        tau = torch.where(k_on, torch.maximum(tau, kth), tau)
    # log of the normalizer over the tokens min-p and top-k keep: from the view when they all lie in it
    inside = vals[:, -1] < tau if width < vocab else torch.ones(m, dtype=torch.bool, device=dev)
    kept_v = vals >= tau[:, None]
    if log_z is None:
        log_z = torch.empty(m, dtype=torch.float64, device=dev)
        log_z[inside] = torch.logsumexp(vals[inside].double().masked_fill(~kept_v[inside], float("-inf")), dim=-1)
        wide = (~inside).nonzero().squeeze(1)
        if wide.numel():
            log_z[wide] = masked_logsumexp(x[rows[wide]], tau[wide], row_max[wide])

    xt = x[rows[:, None], tokens]  # [M, J]
    above = vals[:, None, :] > xt[:, :, None]  # [M, J, W]
    rank = row_count(above)
    p_view = torch.exp(vals.double() - log_z[:, None]).masked_fill(~kept_v, 0.0)
    mass = (p_view[:, None, :] * above).sum(-1)
    below = (xt < vals[:, -1:]).nonzero(as_tuple=True)  # tokens with some larger logits outside the view
    if below[0].numel():
        r, xb = below[0], xt[below]
        xr = x[rows[r]]
        above_t = xr > xb[:, None]
        rank[below] = row_count(above_t)
        before = torch.ones(r.numel(), dtype=torch.float64, device=dev)  # a filtered token: all kept mass
        kept_t = (xb >= tau[r]).nonzero().squeeze(1)  # is before it
        if kept_t.numel():
            # The mass before the token: exponentials of the kept tokens above it only (a deep claim
            # has a few thousand of them in a row of 262k), summed in fp64.
            rk, sel = r[kept_t], above_t[kept_t]
            if bool(torch.isfinite(tau[rk]).any()):
                sel = sel & (xr[kept_t] >= tau[rk, None])
            i, j = sel.nonzero(as_tuple=True)
            e = torch.exp(xr[kept_t[i], j] - row_max[rk[i]]).double()
            total = torch.zeros(kept_t.numel(), dtype=torch.float64, device=dev).index_add_(0, i, e)
            before[kept_t] = torch.exp(row_max[rk].double() - log_z[rk]) * total
        mass[below] = before
    d = mass / top_p[:, None]
    d = torch.where(k_on[:, None], torch.maximum(d, rank.double() / top_k.clamp_min(1).double()[:, None]), d)
    d = torch.where(m_on[:, None], torch.maximum(d, min_p[:, None] * torch.exp((row_max[:, None] - xt).double())), d)
    d = d.clamp(0.0, DEPTH_CAP)
    return d[:, 0] if one else d


def depth_shift(x: torch.Tensor, verifier: torch.Tensor, claimed: torch.Tensor, params: Sequence[SamplingParams],
                view: torch.Tensor | None = None, log_z: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row ``depth(verifier) - depth(claim)`` [N] fp64 for rows of tempered logits ``x`` [N, V]:
    0 where they agree and for greedy rows, whose sampler has no filter or temperature to deviate.
    ``view`` and ``log_z``: the rows' ``KeptSet.view`` and ``KeptSet.base_norm`` where the caller has them."""
    out = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    greedy = torch.tensor([p.is_greedy for p in params], dtype=torch.bool, device=x.device)
    rows = ((verifier != claimed) & ~greedy).nonzero().squeeze(1)
    if rows.numel():
        d = depth(x, torch.stack([verifier[rows], claimed[rows]], 1), [params[i] for i in rows.tolist()],
                  None if view is None else view[rows], rows, None if log_z is None else log_z[rows])
        out[rows] = d[:, 0] - d[:, 1]
    return out


__all__ = ["DEPTH_CAP", "depth", "depth_shift"]
