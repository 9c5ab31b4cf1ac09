"""Token-DiFR for speculative decoding (DiFR appendix F): score each token by the mode that produced it.

A seeded speculative trace is a deterministic function of the target, the draft model, the seed
and k, so one prefill of each model over prompt + output gives every quantity the sampler used
(``sampling/speculative.py``). Per output token at position ``pos`` (mode from ``spec_modes``, or
reconstructed when the provider recorded none):

- ``a`` (accepted draft): the claim must be the draft's proposal (the Gumbel argmax of the draft's
  tempered logits with the salted noise) and pass the acceptance test. ``margin`` = the draft's
  Gumbel margin for the claim + ``T * max(0, -slack)``, where ``slack = log p - log u - log q`` of
  the claim (``accept_slack``): how far the claim is from being proposed, plus how far the test was
  from accepting it.
- ``r`` (resampled): the verifier's own proposal ``d`` must be rejected, and the claim must be the
  Gumbel argmax of the residual ``max(p - q, 0)`` at ``pos``. ``margin`` = the residual's Gumbel
  margin for the claim + ``T * max(0, slack_d)`` (``accept_slack`` is ``slack_d``), minimised over
  the draft's two best proposals, the runner-up paying the draft margin that separates them (benign
  noise can change which token the draft proposed, and the residual of the wrong one has no mass at
  the provider's proposal).
- ``b`` (bonus): plain vLLM sampling from the target; ``margin`` is the ordinary Gumbel margin.

Margins are in raw-logit units like the plain scores (Gumbel margins of tempered logits times T),
so calibration, pooling and verdicts are shared. Without recorded modes a step is read greedily
from the claims: after k accepted drafts comes the bonus; otherwise a claim equal to the verifier's
proposal is an accepted draft and any other claim a resample (a resample never equals the rejected
draft, whose residual mass is 0). ``verifier_token`` is what the verifier's sampler emits at the
row given the claimed prefix: the proposal if it passes, else the residual's winner. Greedy
speculative decoding emits exactly the greedy tokens, so greedy traces are scored as greedy.
"""

from __future__ import annotations

import numpy as np
import torch

from verinfer.sampling.speculative import (acceptance_slack, draft_scaled, first_argmax, noised_row,
                                           processed_logits, residual_logits, row_normalizers)
from verinfer.trace import Trace


def _margin(scores: np.ndarray, token: int, temperature: float) -> float:
    """Gumbel margin of ``token`` in raw-logit units (inf when it cannot win: ``-inf`` score)."""
    return float((scores.max() - scores[token]) * temperature)


def _rank(scores: np.ndarray, token: int) -> int:
    return int((scores > scores[token]).sum()) if np.isfinite(scores[token]) else int(np.isfinite(scores).sum())


def _resample_margin(trow, drow, dscores, claim, seed, pos, T, fp64, first, norms, hypotheses: int = 2):
    """Margin of a resampled claim: the cheapest explanation over the draft's top proposals.

    The provider rejected *its* proposal; benign noise can move the draft's Gumbel argmax, so the
    runner-up proposal is also tried, at the cost of the draft margin that separates it from the
    verifier's proposal (a claim equal to the verifier's proposal is otherwise impossible: the
    residual of a rejected draft has no mass there). Returns (margin, slack of the rejected
    proposal, the claim's rank in that residual).
    """
    top = np.argpartition(-dscores, hypotheses)[:hypotheses]
    top = top[np.argsort(-dscores[top], kind="stable")]
    best = (np.inf, first[1], int(np.isfinite(trow).sum()))  # stays when the claim is filtered by the target
    for d in top.tolist():
        flip = float((dscores[top[0]] - dscores[d]) * T)
        if flip >= best[0]:
            break
        if d == first[0]:
            slack, residual = first[1], first[2]
        else:
            slack, residual = acceptance_slack(trow, drow, d, seed, pos, T, norms), None
        if residual is None:
            residual = noised_row(residual_logits(trow, drow, d, T, norms), seed, pos, fp64)
        margin = flip + _margin(residual, claim, T) + T * max(0.0, slack)
        if margin < best[0]:
            best = (margin, slack, _rank(residual, claim))
    return best


def score_trace(trace: Trace, target_logits: torch.Tensor, draft_logits: torch.Tensor,
                processed: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-token columns for one speculative trace.

    ``target_logits`` / ``draft_logits`` [n, V]: raw logits of the rows predicting each output
    token; ``processed``: the target rows as the rejection sampler sees them
    (``sampling.speculative.processed_logits``).
    """
    p = trace.sampling
    T, seed, fp64, k = p.effective_temperature, p.seed, p.fp64_gumbel, int(p.speculative["k"])
    out = trace.output_token_ids
    n = len(out)
    start = len(trace.prompt_token_ids) - 1
    cols = {"verifier_token": np.empty(n, np.int64), "margin": np.empty(n), "accept_slack": np.full(n, np.nan),
            "gumbel_rank": np.empty(n, np.int64), "spec_mode": np.empty(n, dtype=object)}
    recorded = trace.spec_modes
    run = 0  # accepted drafts so far in the current step (for reading modes from the claims)
    for t in range(n):
        pos, claim = start + t, out[t]
        trow = processed[t].numpy()
        mode = recorded[t] if recorded is not None else ("b" if run == k else None)
        if mode == "b":
            scores = noised_row(trow, seed, pos, fp64)
            cols["verifier_token"][t] = first_argmax(scores)
            cols["margin"][t] = _margin(scores, claim, T)
            cols["gumbel_rank"][t] = _rank(scores, claim)
            cols["spec_mode"][t] = "b"
            run = 0
            continue
        drow = draft_logits[t].numpy()
        norms = row_normalizers(trow, drow, T)  # shared by every acceptance test and residual at the row
        dscores = noised_row(draft_scaled(drow, T), seed, pos, fp64, draft=True)
        proposal = first_argmax(dscores)
        if mode is None:
            mode = "a" if claim == proposal else "r"
        slack_d = acceptance_slack(trow, drow, proposal, seed, pos, T, norms)
        residual = None
        if slack_d > 0:
            cols["verifier_token"][t] = proposal
        else:
            residual = noised_row(residual_logits(trow, drow, proposal, T, norms), seed, pos, fp64)
            cols["verifier_token"][t] = first_argmax(residual)
        if mode == "a":
            slack = slack_d if claim == proposal else acceptance_slack(trow, drow, claim, seed, pos, T, norms)
            cols["margin"][t] = _margin(dscores, claim, T) + T * max(0.0, -slack)
            cols["accept_slack"][t] = slack
            cols["gumbel_rank"][t] = _rank(dscores, claim)
            run += 1
        else:
            margin, slack, rank = _resample_margin(trow, drow, dscores, claim, seed, pos, T, fp64,
                                                   (proposal, slack_d, residual), norms)
            cols["margin"][t], cols["accept_slack"][t], cols["gumbel_rank"][t] = margin, slack, rank
            run = 0
        cols["spec_mode"][t] = mode
    return cols


def score_columns(trace: Trace, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> dict[str, np.ndarray]:
    """Every score column (``token_difr.SCORE_COLUMNS``) for one speculative trace."""
    p = trace.sampling
    processed = processed_logits(target_logits, p)
    cols = score_trace(trace, target_logits, draft_logits, processed)
    claimed = torch.tensor(trace.output_token_ids, dtype=torch.long)
    xc = processed.gather(1, claimed[:, None]).squeeze(1)
    kept_floor = processed.masked_fill(~torch.isfinite(processed), float("inf")).min(-1).values
    raw_scaled = target_logits.float().gather(1, claimed[:, None]).squeeze(1) / p.effective_temperature
    n = len(claimed)
    cols["claimed"] = claimed.numpy()
    cols["exact_match"] = cols["verifier_token"] == cols["claimed"]
    cols["filter_distance"] = torch.where(torch.isfinite(xc), torch.zeros_like(xc),
                                          (kept_floor - raw_scaled) * p.effective_temperature).double().numpy()
    cols["filtered"] = ~torch.isfinite(xc).numpy()
    cols["cross_entropy"] = -(xc.double() - torch.logsumexp(processed.double(), -1)).numpy()
    lc = target_logits.float().gather(1, claimed[:, None])
    cols["logit_rank"] = (target_logits.float() > lc).sum(-1).numpy().astype(np.int64)
    cols["ipt_distance"] = np.full(n, np.nan)
    cols["trace_id"] = np.array([trace.id] * n, dtype=object)
    cols["position"] = np.arange(n, dtype=np.int64)
    return cols
