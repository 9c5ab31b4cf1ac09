"""The sampler, shared by generation and verification.

One visible order, as in vLLM: logits to fp32 -> temperature (with vLLM's clamp) -> min-p ->
top-k / top-p -> ``argmax(x + G)`` over kept tokens (first index wins ties). ``replay`` runs that
order on a block of logits and, when claimed tokens are given, also scores them (Token-DiFR):
generation is ``replay(...).token``; verification reads the rest of the fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verinfer.sampling.filters import kept_set, rank_in_row
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import Profile, RowKeys

INF = float("inf")


@dataclass
class Replay:
    """Per-row outcome of replaying the sampler; the score fields are set only with claims."""

    token: torch.Tensor  # [N] the token the sampler picks
    margin: torch.Tensor | None = None  # [N] fp64, raw-logit units; inf when the claim is filtered
    filter_distance: torch.Tensor | None = None  # [N] raw-logit distance to surviving the filters
    logprob: torch.Tensor | None = None  # [N] log-prob of the claim under the processed distribution
    logit_rank: torch.Tensor | None = None  # [N] claims' rank among raw logits (0 = top)
    gumbel_rank: torch.Tensor | None = None  # [N] claims' rank among kept x + G (0 = sampled)


def _params_tensors(params: list[SamplingParams]):
    temp = torch.tensor([p.effective_temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    return temp, top_k, top_p, min_p


def _segment_argmax(scores: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, n: int):
    """Per-row max of ``scores`` and the smallest column reaching it (first index wins ties)."""
    best = torch.full((n,), -INF, dtype=scores.dtype).scatter_reduce(0, rows, scores, "amax")
    at_best = scores == best[rows]
    big = torch.iinfo(torch.int64).max
    winner = torch.full((n,), big, dtype=torch.int64).scatter_reduce(
        0, rows[at_best], cols[at_best], "amin"
    )
    return best, winner


def replay(
    logits: torch.Tensor,
    params: list[SamplingParams],
    profile: Profile,
    keys: RowKeys,
    claimed: torch.Tensor | None = None,
) -> Replay:
    """Replay the sampler on ``logits`` [N, V] (one row per sampled position).

    All rows must use ``profile``; greedy rows (T < 1e-5 or the greedy profile) take the argmax of
    the raw logits and score margins as ``max(l) - l_claimed``.
    """
    logits = logits.float()
    n, vocab = logits.shape
    greedy = torch.tensor([p.is_greedy or not profile.seeded for p in params], dtype=torch.bool)
    token = torch.empty(n, dtype=torch.int64)
    out = Replay(token=token)
    if claimed is not None:
        claimed = claimed.long()
        out.margin = torch.zeros(n, dtype=torch.float64)
        out.filter_distance = torch.zeros(n, dtype=torch.float64)
        out.logprob = torch.empty(n, dtype=torch.float64)
        out.logit_rank = torch.empty(n, dtype=torch.int64)
        out.gumbel_rank = torch.empty(n, dtype=torch.int64)

    g_idx = greedy.nonzero().squeeze(1)
    if g_idx.numel():
        lg = logits[g_idx]
        view = lg.topk(min(64, vocab), dim=-1).values
        token[g_idx] = lg.argmax(-1)
        if claimed is not None:
            lc = lg.gather(1, claimed[g_idx, None]).squeeze(1)
            out.margin[g_idx] = (view[:, 0] - lc).double()
            out.logprob[g_idx] = (lc - torch.logsumexp(lg, -1)).double()
            rank = rank_in_row(lg, view, lc)
            out.logit_rank[g_idx] = rank
            out.gumbel_rank[g_idx] = rank

    s_idx = (~greedy).nonzero().squeeze(1)
    if s_idx.numel():
        _replay_seeded(logits, params, profile, keys, claimed, s_idx, out)
    return out


def _noised_kept(profile: Profile, keys: RowKeys, kept, floor: torch.Tensor, vocab: int):
    """Noised scores of the kept tokens that can reach ``floor`` (per row), and which those are.

    A kept token whose scaled logit plus the profile's noise bound (with room for the engine's
    rounding) stays below its row's floor cannot be sampled nor outrank a claim at the floor, so
    its noise is never computed: the result is identical to noising every kept token.
    """
    bound = profile.noise_bound(keys).to(kept.values.device)
    reach = kept.values + bound[kept.rows]
    reach = reach + 1e-6 * reach.abs() + 1e-6
    sel = (reach >= floor[kept.rows]).nonzero().squeeze(1)
    rows, cols = kept.rows[sel], kept.cols[sel]
    return sel, profile.noised(keys, rows, cols, kept.values[sel], vocab, kept)


def _replay_seeded(logits, params, profile, keys, claimed, s_idx, out: Replay) -> None:
    sub = [params[i] for i in s_idx.tolist()]
    temp, top_k, top_p, min_p = _params_tensors(sub)
    raw = logits[s_idx]
    x = raw / temp[:, None]
    kept = getattr(profile, "kept_set", kept_set)(x, top_k, top_p, min_p)  # an engine's own filters (sglang)
    pick = s_idx.numpy()
    sub_keys = RowKeys(requests=tuple(keys.requests[i] for i in pick.tolist()), seeds=keys.seeds[pick],
                       positions=keys.positions[pick], steps=keys.steps[pick], params=tuple(sub))
    n = s_idx.numel()
    vocab = logits.shape[1]
    rows_n = torch.arange(n)

    # A first bound on each row's best score from its largest logits (the top view), then only
    # the tokens that can reach it (or the claim's score, when ranking a claim) are noised.
    top = kept.values >= kept.view[kept.rows, -1].double()
    floor = torch.full((n,), -INF, dtype=torch.float64)
    first = profile.noised(sub_keys, kept.rows[top], kept.cols[top], kept.values[top], vocab, kept)
    floor = floor.scatter_reduce(0, kept.rows[top], first, "amax")
    if claimed is not None:
        c = claimed[s_idx]
        xc = x.gather(1, c[:, None]).squeeze(1)
        is_kept = xc >= kept.threshold
        sc = torch.where(is_kept, profile.noised(sub_keys, rows_n, c, xc.double(), vocab, kept),
                         torch.full((n,), -INF, dtype=torch.float64))
        floor = torch.where(is_kept, torch.minimum(floor, sc), floor)
    sel, scores = _noised_kept(profile, sub_keys, kept, floor, vocab)
    best, winner = _segment_argmax(scores, kept.rows[sel], kept.cols[sel], n)
    out.token[s_idx] = winner
    if claimed is None:
        return

    t64 = temp.double()
    margin = (best - sc) * t64
    margin = torch.where(winner == c, torch.zeros_like(margin), margin)
    out.margin[s_idx] = margin
    out.filter_distance[s_idx] = torch.where(
        is_kept, torch.zeros_like(margin), (kept.threshold - xc).double() * t64
    )
    out.logprob[s_idx] = torch.where(is_kept, xc.double() - kept.log_norm, torch.full_like(margin, -INF))
    out.logit_rank[s_idx] = rank_in_row(x, kept.view, xc)  # x = raw / T has the raw logits' order
    # Unnoised kept tokens lie below the claim's score; a filtered claim ranks below every kept token.
    above = (scores > sc[kept.rows[sel]]).long()
    rank = torch.zeros(n, dtype=torch.int64).scatter_add(0, kept.rows[sel], above)
    n_kept = torch.bincount(kept.rows, minlength=n)
    out.gumbel_rank[s_idx] = torch.where(is_kept, rank, n_kept)


def sample(logits: torch.Tensor, params: list[SamplingParams], profile: Profile, keys: RowKeys) -> torch.Tensor:
    """The tokens the provider's sampler emits for ``logits`` [N, V]."""
    return replay(logits, params, profile, keys).token
