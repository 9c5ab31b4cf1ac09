"""The sampler, shared by generation and verification.

One visible order, as in vLLM: logits to fp32 -> temperature (with vLLM's clamp) -> min-p ->
top-k / top-p -> ``argmax(x + G)`` over kept tokens (first index wins ties). ``replay`` runs that
order on a block of logits and, when claimed tokens are given, also scores them (Token-DiFR):
generation is ``replay(...).token``; verification reads the rest of the fields.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from verinfer.sampling import inverse_cdf
from verinfer.sampling.depth import depth_shift
from verinfer.sampling.filters import kept_set, rank_in_row, row_count
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import Profile, RowKeys
from verinfer.sampling.replay import Replay

INF = float("inf")
ROW_CHUNK = 16  # rows replayed together: [16, V] temporaries stay in cache (3x faster than 512 rows)


def _params_tensors(params: list[SamplingParams], device: torch.device):
    temp = torch.tensor([p.effective_temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return temp, top_k, top_p, min_p


def _segment_argmax(scores: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, n: int):
    """Per-row max of ``scores`` and the smallest column reaching it (first index wins ties)."""
    best = torch.full((n,), -INF, dtype=scores.dtype, device=scores.device).scatter_reduce(0, rows, scores, "amax")
    at_best = scores == best[rows]
    big = torch.iinfo(torch.int64).max
    winner = torch.full((n,), big, dtype=torch.int64, device=scores.device).scatter_reduce(
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
    dev = logits.device
    greedy = torch.tensor([p.is_greedy or not profile.seeded for p in params], dtype=torch.bool, device=dev)
    token = torch.empty(n, dtype=torch.int64, device=dev)
    out = Replay(token=token)
    if claimed is not None:
        claimed = claimed.long().to(dev)
        out.margin = torch.zeros(n, dtype=torch.float64, device=dev)
        out.filter_distance = torch.zeros(n, dtype=torch.float64, device=dev)
        out.logprob = torch.empty(n, dtype=torch.float64, device=dev)
        out.logit_rank = torch.empty(n, dtype=torch.int64, device=dev)
        out.gumbel_rank = torch.empty(n, dtype=torch.int64, device=dev)
        out.depth_shift = torch.zeros(n, dtype=torch.float64, device=dev)  # greedy rows keep 0

    seeded = profile.replay_order(params, keys, (~greedy).nonzero().squeeze(1), vocab)
    for idx, replay_rows in ((greedy.nonzero().squeeze(1), _replay_greedy), (seeded, _replay_seeded)):
        for a in range(0, idx.numel(), ROW_CHUNK):
            replay_rows(logits, params, profile, keys, claimed, idx[a:a + ROW_CHUNK], out)
    return out


def _replay_greedy(logits, params, profile, keys, claimed, g_idx, out: Replay) -> None:
    """Greedy rows: argmax of the raw logits; the margin is ``max(l) - l_claimed``."""
    lg = logits[g_idx]
    view = lg.topk(min(64, lg.shape[1]), dim=-1).values
    out.token[g_idx] = lg.argmax(-1)
    if claimed is not None:
        lc = lg.gather(1, claimed[g_idx, None]).squeeze(1)
        out.margin[g_idx] = (view[:, 0] - lc).double()
        out.logprob[g_idx] = (lc - torch.logsumexp(lg, -1)).double()
        rank = rank_in_row(lg, view, lc)
        out.logit_rank[g_idx] = rank
        out.gumbel_rank[g_idx] = rank


def _replay_seeded(logits, params, profile, keys, claimed, s_idx, out: Replay) -> None:
    """Seeded rows: the winner of ``x + G`` over kept tokens, noising only tokens that can matter.

    Rows whose kept set fits the top view are noised from it. A wider row (no filter, broad top-p)
    first takes the best noised score of its view as a floor (lowered to the claim's score when
    ranking a claim), and the profile noises only the kept tokens that can reach that floor
    (``Profile.noised_dense_above``). Every token left out provably scores below the floor, so the
    winner, margin and ranks are those of noising the whole row.
    """
    if getattr(profile, "inverse_cdf", False):  # inverse-CDF engines (llama.cpp): sampling/inverse_cdf.py
        return inverse_cdf.replay_into(logits, params, profile, keys, claimed, s_idx, out)
    sub = [params[i] for i in s_idx.tolist()]
    temp, top_k, top_p, min_p = _params_tensors(sub, logits.device)
    x = logits[s_idx]
    if bool((temp != 1.0).any()):
        x = x / temp[:, None]
    kept = getattr(profile, "kept_set", kept_set)(x, top_k, top_p, min_p)  # an engine's own filters (sglang)
    pick = s_idx.cpu().numpy()
    sub_keys = RowKeys(requests=tuple(keys.requests[i] for i in pick.tolist()), seeds=keys.seeds[pick],
                       positions=keys.positions[pick], steps=keys.steps[pick], params=tuple(sub))
    n, vocab = x.shape

    r1, j1 = kept.in_view().nonzero(as_tuple=True)
    c1, v1 = kept.view_ids[r1, j1], kept.view[r1, j1].double()
    s1 = profile.noised(sub_keys, r1, c1, v1, vocab, kept)
    floor = torch.full((n,), -INF, dtype=torch.float64, device=x.device).scatter_reduce(0, r1, s1, "amax")
    if claimed is not None:
        c = claimed[s_idx]
        xc = x.gather(1, c[:, None]).squeeze(1)
        is_kept = xc >= kept.threshold
        sc = torch.full((n,), -INF, dtype=torch.float64, device=x.device)
        k_idx = is_kept.nonzero().squeeze(1)
        sc[k_idx] = profile.noised(sub_keys, k_idx, c[k_idx], xc[k_idx].double(), vocab, kept)
        floor = torch.where(is_kept, torch.minimum(floor, sc), floor)

    wide = (~kept.inside).nonzero().squeeze(1)
    narrow_pair = kept.inside[r1]
    rows, cols, scores = [r1[narrow_pair]], [c1[narrow_pair]], [s1[narrow_pair]]
    x_wide = x if wide.numel() == n else x[wide]
    if wide.numel():
        wr, wc, ws = profile.noised_dense_above(sub_keys, wide, x_wide, kept.threshold[wide], floor[wide], kept)
        rows.append(wide[wr]), cols.append(wc), scores.append(ws)
    rows_t, cols_t, scores_t = torch.cat(rows), torch.cat(cols), torch.cat(scores)
    best, winner = _segment_argmax(scores_t, rows_t, cols_t, n)
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
    # Tokens left unnoised score below the claim; a filtered claim ranks below every kept token.
    above = (scores_t > sc[rows_t]).long()
    rank = torch.zeros(n, dtype=torch.int64, device=x.device).scatter_add(0, rows_t, above)
    n_kept = row_count(kept.in_view())
    count = (~kept.inside & ~is_kept).nonzero().squeeze(1)  # wide rows whose claim was filtered (rare)
    if count.numel():
        n_kept[count] = row_count(x[count] >= kept.threshold[count, None])
    out.gumbel_rank[s_idx] = torch.where(is_kept, rank, n_kept)
    out.depth_shift[s_idx] = depth_shift(x, winner, c, sub, kept.view, kept.base_norm)


def sample(logits: torch.Tensor, params: list[SamplingParams], profile: Profile, keys: RowKeys) -> torch.Tensor:
    """The tokens the provider's sampler emits for ``logits`` [N, V]."""
    return replay(logits, params, profile, keys).token


def picks_at_offsets(logits: torch.Tensor, params: list[SamplingParams], profile: Profile, keys: RowKeys,
                     offsets: Sequence[int]) -> torch.Tensor:
    """The sampler's picks [len(offsets), N] with every row's position moved by each offset: what a
    position-keyed engine (``Profile.position_keyed``) emits for prompts that much longer. The filters
    do not depend on the position, so the kept sets are taken once and only the noise is drawn again;
    rows whose kept set is wider than its top view are left out (-1): the offsets are screened on the
    filtered rows, which cost a few dozen draws each."""
    n, vocab = logits.shape
    out = torch.full((len(offsets), n), -1, dtype=torch.int64, device=logits.device)
    temp, top_k, top_p, min_p = _params_tensors(params, logits.device)
    x = logits.float()
    if bool((temp != 1.0).any()):
        x = x / temp[:, None]
    kept = getattr(profile, "kept_set", kept_set)(x, top_k, top_p, min_p)
    rows = kept.inside.nonzero().squeeze(1)
    if not rows.numel():
        return out
    r1, j1 = (kept.in_view() & kept.inside[:, None]).nonzero(as_tuple=True)
    c1, v1 = kept.view_ids[r1, j1], kept.view[r1, j1].double()
    for i, d in enumerate(offsets):
        moved = keys.moved(d) if keys.params else replace(keys.moved(d), params=tuple(params))
        _, winner = _segment_argmax(profile.noised(moved, r1, c1, v1, vocab, kept), r1, c1, n)
        out[i, rows] = winner[rows]
    return out
