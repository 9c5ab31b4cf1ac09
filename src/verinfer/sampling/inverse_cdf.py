"""Inverse-CDF (inverse probability transform) replay and the DiFR paper's IPT score.

Some engines draw one uniform ``u`` per sampled token and return the first candidate whose
cumulative probability reaches ``u`` (llama.cpp's ``dist`` sampler; DiFR paper, Appendix B,
Algorithm 4). The Gumbel margin does not apply; the score is how far the replayed ``u`` falls from
the claimed token's interval ``[F(t-1), F(t)]`` on the verifier's CDF (``ipt_distance``, in
probability units, 0 when the replay picks the claim), and the paper's Token-IPT-DiFR likelihood
``-log(Phi((b - u) / s) - Phi((a - u) / s) + eps)`` (``ipt_likelihood``).

A profile opts in with ``inverse_cdf = True`` and provides ``uniforms(keys)`` (one ``u`` per row)
``candidate_order(kept_x, kept_ids, params)`` (the order the engine accumulates in) and
``sorts_candidates(params)`` (false: id order, so an unfiltered row is walked as is). The kept set and
temperature are the shared ones (``filters.py``). ``replay`` returns the shared ``Replay`` with
``margin`` set to ``ipt_distance`` (so exact rows score 0 and every consumer of margins works;
calibrations never mix profiles) and an extra ``ipt_distance`` attribute.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import ndtr

from verinfer.sampling.depth import depth_shift
from verinfer.sampling.filters import kept_set, rank_in_row, row_count
from verinfer.sampling.profiles.base import RowKeys
from verinfer.sampling.replay import Replay

INF = float("inf")


def ipt_likelihood(u: np.ndarray, lo: np.ndarray, hi: np.ndarray, sigma: float = 1e-3, eps: float = 1e-12):
    """DiFR Appendix B: ``-log(Phi((hi - u)/sigma) - Phi((lo - u)/sigma) + eps)`` (Gaussian kernel on u)."""
    u, lo, hi = (np.asarray(a, dtype=np.float64) for a in (u, lo, hi))
    mass = ndtr((hi - u) / sigma) - ndtr((lo - u) / sigma)
    return -np.log(np.clip(mass, 0.0, 1.0) + eps)


def replay_into(logits, params, profile, keys, claimed, s_idx: torch.Tensor, out) -> None:
    """Fill the shared ``Replay`` ``out`` at rows ``s_idx`` (the sampler's dispatch for inverse-CDF profiles)."""
    pick = s_idx.cpu().numpy()
    sub_params = [params[i] for i in pick.tolist()]
    sub_keys = RowKeys(requests=tuple(keys.requests[i] for i in pick.tolist()), seeds=keys.seeds[pick],
                       positions=keys.positions[pick], steps=keys.steps[pick], params=tuple(sub_params))
    dev = logits.device
    # a serial CDF walk per row (llama.cpp is a CPU engine): the rows come to the CPU
    sub = replay(logits[s_idx].cpu(), sub_params, profile, sub_keys, None if claimed is None else claimed[s_idx].cpu())
    out.token[s_idx] = sub.token.to(dev)
    if claimed is None:
        return
    for name in ("margin", "filter_distance", "logprob", "logit_rank", "gumbel_rank", "depth_shift"):
        getattr(out, name)[s_idx] = getattr(sub, name).to(dev)
    if getattr(out, "ipt_distance", None) is None:
        out.ipt_distance = torch.full((logits.shape[0],), float("nan"), dtype=torch.float64, device=dev)
    out.ipt_distance[s_idx] = sub.ipt_distance.to(dev)


def replay(logits: torch.Tensor, params, profile, keys, claimed: torch.Tensor | None = None):
    """Replay an inverse-CDF sampler on ``logits`` [N, V]; all rows seeded (greedy rows are the caller's)."""
    logits = logits.float()
    n, vocab = logits.shape
    temp = torch.tensor([p.effective_temperature for p in params], dtype=torch.float32, device="cpu")
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device="cpu")
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device="cpu")
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device="cpu")
    x = logits / temp[:, None]
    kept = kept_set(x, top_k, top_p, min_p)
    u = np.asarray(profile.uniforms(keys), dtype=np.float64)
    token = torch.empty(n, dtype=torch.int64, device="cpu")
    lo = np.full(n, np.nan)
    hi = np.full(n, np.nan)
    pick_pos = np.zeros(n, dtype=np.int64)
    claim_pos = np.full(n, -1, dtype=np.int64)
    for r in range(n):
        if kept.threshold[r] == -INF and not profile.sorts_candidates(params[r]):
            ids, xs = None, x[r]  # every token, in id order: position = token id
        else:
            ids = (x[r] >= kept.threshold[r]).nonzero().squeeze(1)
            ids = ids[profile.candidate_order(x[r, ids], ids, params[r])]
            xs = x[r, ids]
        p = torch.exp(xs - xs.max()).double()  # the engine's fp32 expf, summed in double
        cum = torch.cumsum(p, 0)
        total = float(cum[-1])
        at = torch.tensor([u[r] * total], dtype=torch.float64, device="cpu")
        i = int(torch.searchsorted(cum, at, right=False)[0])
        i = min(i, xs.numel() - 1)
        pick_pos[r] = i
        token[r] = i if ids is None else ids[i]
        if claimed is not None:
            where = claimed[r:r + 1, None] if ids is None else (ids == claimed[r]).nonzero()
            if where.numel():
                j = int(where[0, 0])
                claim_pos[r] = j
                lo[r] = (float(cum[j - 1]) if j else 0.0) / total
                hi[r] = float(cum[j]) / total
    out = Replay(token=token)
    if claimed is None:
        return out
    claimed = claimed.long()
    is_kept = torch.from_numpy(claim_pos >= 0)
    dist = np.where(claim_pos >= 0, np.maximum(np.maximum(lo - u, u - hi), 0.0), INF)
    dist = np.where(token.numpy() == claimed.numpy(), 0.0, dist)
    xc = x.gather(1, claimed[:, None]).squeeze(1)
    t64 = temp.double()
    out.margin = torch.from_numpy(dist)
    out.filter_distance = torch.where(is_kept, torch.zeros(n, dtype=torch.float64, device="cpu"),
                                      (kept.threshold - xc).double() * t64)
    out.logprob = torch.where(is_kept, xc.double() - kept.log_norm,
                              torch.full((n,), -INF, dtype=torch.float64, device="cpu"))
    out.logit_rank = rank_in_row(x, kept.view, xc)
    # Candidates between the claim and the pick in the engine's order (0 = the claim was picked).
    n_kept = row_count(x >= kept.threshold[:, None])
    out.gumbel_rank = torch.where(is_kept, torch.from_numpy(np.abs(claim_pos - pick_pos)), n_kept)
    out.depth_shift = depth_shift(x, token, claimed, params, kept.view, kept.base_norm)
    out.ipt_distance = out.margin.clone()
    out.ipt_interval = (lo, hi, u)
    return out
