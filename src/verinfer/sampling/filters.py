"""Logit filters (temperature, min-p, top-k, top-p) as per-row keep thresholds.

Every filter in vLLM's order keeps exactly the tokens whose scaled logit ``x`` is at least some
value, so a row's whole filter chain is one threshold ``tau``: token j survives iff ``x_j >= tau``.
That representation is exact, makes the finite distance-to-filter of a filtered token a
subtraction, and lets the common case (top-k, or top-p with most mass in a few tokens) work on a
``topk`` of the row instead of a full-vocabulary sort (which costs as much as the forward pass).

Semantics (vLLM, REFERENCE.md 1.2): min-p masks ``x < max(x) + log(min_p)``; top-k keeps the k-th
largest value and everything tied with it; top-p is computed over the tokens that min-p and top-k
kept, masking a token when the ascending cumulative softmax up to and including it is
``<= 1 - p`` (equivalently: keeping it when the descending cumulative mass *before* it is ``< p``),
the largest token always kept. Tokens tied with the top-p boundary value are all kept (vLLM's
unstable sort decides among them arbitrarily). Cumulative sums run in fp64 here and fp32 in vLLM:
they can disagree only when a boundary's cumulative mass lies within fp32 rounding of ``1 - p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit
from torch.nn.utils.rnn import pad_sequence

NEG_INF = float("-inf")


@dataclass(frozen=True)
class KeptSet:
    """The tokens a row's filters keep, as a threshold, with the row's largest logits at hand."""

    threshold: torch.Tensor  # [N] fp32: token j is kept iff x_j >= threshold (-inf: no filtering)
    log_norm: torch.Tensor  # [N] fp64: logsumexp of x over the kept tokens
    view: torch.Tensor  # [N, W] the row's W largest x, descending (for ranks without a full pass)
    view_ids: torch.Tensor  # [N, W] their token ids
    inside: torch.Tensor  # [N] bool: every kept token is in the view (else the row keeps more than W)
    # [N] fp64: logsumexp of x over the tokens min-p and top-k keep, before top-p (what top-p's masses and
    # the sampler-shape depth are relative to); None where the filters are an engine's own (sglang)
    base_norm: torch.Tensor | None = None

    def in_view(self) -> torch.Tensor:
        """[N, W] which view entries are kept."""
        return self.view >= self.threshold[:, None]


def masked_logsumexp(x: torch.Tensor, threshold: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """logsumexp of the entries ``>= threshold`` from fp32 exponentials of ``x - max`` and torch's
    fp32 cascade sum (relative error ~1e-7, as the engines' own fp32 softmax): an fp64 copy of the
    whole row cost more than the rest of the scoring. In place on the one temporary: a second fresh
    [rows, V] buffer costs more in page faults than the exponentials themselves on the CPU."""
    e = (x - row_max[:, None]).exp_()
    if bool(torch.isfinite(threshold).any()):
        e.masked_fill_(x < threshold[:, None], 0.0)
    return row_max.double() + torch.log(e.sum(-1).double())


def _block_kept(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, width: int,
                base_norm: torch.Tensor | None = None,
                view: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Thresholds for a block using a top-``width`` view; flags rows that need a wider view.

    ``base_norm`` is the rows' log-normalizer before top-p when a narrower view already computed it
    (it does not depend on the view), so widening never repeats the full-row pass. ``view`` is what
    ``_top_p_views`` gives: every token at or above a per-row edge, sorted descending and padded
    with -inf, and each row's smallest real value (rows without top-k only).
    """
    n, vocab = x.shape
    k_on = (top_k > 0) & (top_k < vocab)
    if view is None:
        width = min(vocab, max(width, int(top_k[k_on].max()) + 1 if bool(k_on.any()) else 0))
        top_vals, top_ids = x.topk(width, dim=-1)  # sorted descending
        last = top_vals[:, -1]
    else:
        top_vals, top_ids, last = view  # padding (-inf) is never kept unless the real tokens fall short of p:
        width = top_vals.shape[1]  # then every pad is kept, n_keep == width and the row is widened
    full_view = width == vocab

    tau = torch.full((n,), NEG_INF, dtype=x.dtype, device=x.device)
    m_on = min_p > 0
    if bool(m_on.any()):
        tau = torch.where(m_on, top_vals[:, 0] + torch.log(min_p.clamp_min(1e-45)).to(x.dtype), tau)
    if bool(k_on.any()):
        kth = top_vals.gather(1, (top_k.clamp(1, width) - 1)[:, None]).squeeze(1)
        tau = torch.where(k_on, torch.maximum(tau, kth), tau)

    # Whether every token >= tau is inside the top-`width` view.
    inside = torch.ones(n, dtype=torch.bool, device=x.device) if full_view else last < tau
    log_norm = torch.empty(n, dtype=torch.float64, device=x.device)
    in_view = top_vals >= tau[:, None]
    log_norm[inside] = torch.logsumexp(top_vals[inside].double().masked_fill(~in_view[inside], NEG_INF), dim=-1)
    if bool((~inside).any()):
        log_norm[~inside] = (base_norm[~inside] if base_norm is not None
                             else masked_logsumexp(x[~inside], tau[~inside], top_vals[~inside, 0]))
    base_norm = log_norm.clone()

    needs_wider = torch.zeros(n, dtype=torch.bool, device=x.device)
    p_on = top_p < 1
    if bool(p_on.any()):
        probs = torch.exp(top_vals.double() - log_norm[:, None]).masked_fill(~in_view, 0.0)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = (mass_before < top_p.double()[:, None]) & in_view
        keep[:, 0] = True
        n_keep = row_count(keep)
        tau_p = top_vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)
        # If top-p keeps the whole view while more tokens pass tau, the view was too narrow.
        needs_wider = p_on & ~inside & (n_keep == width)
        tau = torch.where(p_on, torch.maximum(tau, tau_p), tau)
        changed = p_on & ~needs_wider
        if bool(changed.any()):
            inside = inside | changed
            in_view = top_vals >= tau[:, None]
            log_norm[changed] = torch.logsumexp(
                top_vals[changed].double().masked_fill(~in_view[changed], NEG_INF), dim=-1
            )
    return tau, log_norm, inside, needs_wider, top_vals, top_ids, base_norm


@njit(cache=True)
def _mass_by_bin(x, top, log_norm, bins, scale):
    """[R, bins] fp64 probability mass of each row's tokens by bin of ``(top - x) * scale`` (bin 0 holds
    the maximum; tokens past the last bin are left out), from fp32 ``exp(x - log_norm)``."""
    n, v = x.shape
    out = np.zeros((n, bins), dtype=np.float64)
    for r in range(n):
        t, ln = top[r], log_norm[r]
        for j in range(v):
            d = (t - x[r, j]) * scale
            if d < bins:
                out[r, int(d)] += np.exp(x[r, j] - ln)
    return out


def _top_p_views(x: torch.Tensor, top: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor, bins: int = 512,
                 span: float = 64.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views meant to hold each row's whole top-p set: the tokens at or above the highest edge of a
    probability-weighted histogram (``bins`` bins over the ``span`` logits below the row's maximum)
    whose mass from the top exceeds ``p``, sorted descending, padded with -inf to the longest row
    ([R, K] values and ids), and each row's smallest real value. One vectorized pass and a sort of
    each row's K tokens replace a top-k of thousands over the whole vocabulary; ``_block_kept``
    computes the threshold from the view exactly, and a view that top-p fills after all is widened
    again, so a poor estimate costs time, never correctness."""
    n = x.shape[0]
    if x.device.type == "cpu":  # one compiled pass, no [R, V] temporaries (the int64 bins below cost most on a CPU)
        mass = torch.from_numpy(_mass_by_bin(np.ascontiguousarray(x.numpy()), top.numpy(),
                                             log_norm.float().numpy(), bins, np.float32(bins / span))).cumsum(1)
    else:
        probs = torch.exp(x - log_norm.float()[:, None])
        bin_of = ((top[:, None] - x) * (bins / span)).long().clamp_(0, bins)  # bin 0 holds the maximum
        mass = torch.zeros(n, bins + 1, device=x.device).scatter_add_(1, bin_of, probs)[:, :bins].cumsum(1)
    reach = mass > top_p[:, None] + 1e-4
    first = reach.float().argmax(1)
    edge = torch.where(reach.any(1), top - span * (first + 1).float() / bins, torch.full_like(top, NEG_INF))
    vals, ids = [], []
    for row, e in zip(x, edge.tolist()):
        at = (row >= e).nonzero().squeeze(1)
        v, order = row[at].sort(descending=True)
        vals.append(v), ids.append(at[order])
    last = torch.stack([v[-1] for v in vals])
    return pad_sequence(vals, batch_first=True, padding_value=NEG_INF), pad_sequence(ids, batch_first=True), last


def kept_set(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, width: int = 64
) -> KeptSet:
    """Apply min-p, top-k and top-p (in that order) to scaled logits ``x`` [N, V] fp32.

    Rows whose top-p set does not fit in a top-``width`` view are redone on a 16x wider view, and
    so on up to a full sort, so the result is exact whatever the parameters while the common cases
    (top-k, peaked top-p) never sort the vocabulary. The kept tokens are never listed: rows whose
    kept set fits the view are read from it, wider rows from ``x >= threshold``.
    """
    n, vocab = x.shape
    tau, log_norm, inside, wider, top_vals, top_ids, base_norm = _block_kept(x, top_k, top_p, min_p, width)
    idx = wider.nonzero().squeeze(1)
    w = width
    no_k = (top_k[idx] <= 0) | (top_k[idx] >= vocab)  # a view sized by mass may hold fewer than k tokens
    if bool(no_k.any()):  # first retry: each row on a view just wide enough for its top-p mass (no wide sort)
        later, idx = idx[~no_k], idx[no_k]
        xs = x[idx]
        t2, l2, _, again, _, _, _ = _block_kept(xs, top_k[idx], top_p[idx], min_p[idx], width, base_norm[idx],
                                                _top_p_views(xs, top_vals[idx, 0], base_norm[idx], top_p[idx]))
        done = idx[~again]
        tau[done], log_norm[done] = t2[~again], l2[~again]
        inside[done] = top_vals[done, -1] < tau[done]
        idx = torch.cat([later, idx[again]])
    while idx.numel():
        w = min(vocab, w * 16)
        t2, l2, _, again, _, _, _ = _block_kept(x[idx], top_k[idx], top_p[idx], min_p[idx], w, base_norm[idx])
        done = idx[~again]
        tau[done], log_norm[done] = t2[~again], l2[~again]
        inside[done] = top_vals[done, -1] < tau[done]  # usually False: fall through to the full-row mask
        idx = idx[again]

    return KeptSet(tau, log_norm, top_vals, top_ids, inside, base_norm)


def row_count(mask: torch.Tensor) -> torch.Tensor:
    """Per-row count of the true entries of ``mask`` [..., V], as int64. Summed in int32 (exact below 2^31
    entries): torch's default int64 sum of booleans is far slower on a CPU, and on 262k-entry rows it
    was a leading cost of scoring a deep claim (RESULTS.md section 39)."""
    return mask.sum(-1, dtype=torch.int32).long()


def rank_in_row(x: torch.Tensor, view: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """How many entries of each row of ``x`` exceed ``value``, using the sorted top view when it suffices."""
    rank = row_count(view > value[:, None])
    outside = (value < view[:, -1]).nonzero().squeeze(1)
    if outside.numel():
        rank[outside] = row_count(x[outside] > value[outside, None])
    return rank
