"""Token-DiFR: replay each trace with one prefill and score every claimed token.

Per-token scores (one row per output token, higher = more divergent unless noted):
    exact_match     the verifier's sampler picks the claimed token (1) or not (0)
    margin          Gumbel-max margin in raw-logit units (DiFR eq. 1 times T); inf if the claim is filtered
    filter_distance raw-logit distance the claim is below the filter threshold (0 when kept): a finite
                    companion to the infinite margin
    cross_entropy   -log p(claim) under the verifier's processed (filtered, tempered) distribution
    logit_rank      the claim's rank among the raw logits (0 = top)
    gumbel_rank     the claim's rank among kept x + G (0 = the sampled token)
    ipt_distance    inverse-CDF profiles (llama.cpp) only, else NaN: how far the replayed uniform lies
                    outside the claim's CDF interval (DiFR appendix B; 0 = picked); ``margin`` equals it there
    spec_mode       speculative traces only (``scoring/speculative.py``), else null: a accepted draft,
                    r resampled after a rejection, b bonus
    accept_slack    speculative traces only, else NaN: ``log p - log u - log q`` of the acceptance test
                    at the row (of the claim for ``a``, of the verifier's rejected proposal for ``r``)
    depth_shift     at mismatches, how much deeper in the claimed sampler's kept set the verifier's token
                    lies than the claim (``sampling/depth.py``, from the replay; > 0: the provider looks narrower or
                    colder than claimed); 0 at matches, for greedy rows and for speculative traces
The likelihood variant (DiFR appendix A) is derived from the margin by ``likelihood``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from scipy.special import log_ndtr

from verinfer.models.backend import Backend
from verinfer.models.derived import draft_backend
from verinfer.sampling.profiles import Profile, RowKeys, get_profile
from verinfer.sampling.sampler import replay
from verinfer.scoring import speculative
from verinfer.sampling.speculative import is_speculative
from verinfer.trace import Trace

SCORE_COLUMNS = ("trace_id", "position", "claimed", "verifier_token", "exact_match", "margin",
                 "filter_distance", "filtered", "cross_entropy", "logit_rank", "gumbel_rank", "ipt_distance",
                 "spec_mode", "accept_slack", "depth_shift")


def likelihood(margin: np.ndarray, sigma: float = 1.0) -> np.ndarray:
    """-log P(Gaussian logit noise of std ``sigma`` explains a gap of ``margin``), 0 at margin 0.

    DiFR appendix A's likelihood score, shifted by log 2 so exact tokens score 0:
    ``-log(2 * Phi(-margin / sigma))``; infinite margins stay infinite.
    """
    z = np.asarray(margin, dtype=np.float64) / sigma
    return -(np.log(2.0) + log_ndtr(-z))


@dataclass
class ScoreBlock:
    """Scores for a block of rows, as numpy columns named as in SCORE_COLUMNS."""

    columns: dict[str, np.ndarray]
    items: np.ndarray  # index of each row's trace in the caller's list
    hidden: torch.Tensor  # [R, D] verifier hidden states (for activation commits)


def _keys(traces: Sequence[Trace], items: np.ndarray, steps: np.ndarray) -> RowKeys:
    return RowKeys(
        requests=tuple(traces[i].id for i in items),
        seeds=np.array([traces[i].sampling.seed for i in items], dtype=object),
        positions=np.array([len(traces[i].prompt_token_ids) - 1 for i in items], dtype=np.int64) + steps,
        steps=steps.astype(np.int64),
    )


def score_block(logits: torch.Tensor, items: np.ndarray, steps: np.ndarray, traces: Sequence[Trace],
                profiles: dict[str, Profile]) -> dict[str, np.ndarray]:
    """Token-DiFR scores for rows of logits; rows may mix traces and sampler profiles."""
    n = len(items)
    claimed = torch.tensor([traces[i].output_token_ids[k] for i, k in zip(items, steps)], dtype=torch.long,
                           device=logits.device)
    cols = {
        "verifier_token": np.empty(n, np.int64), "margin": np.empty(n), "filter_distance": np.empty(n),
        "cross_entropy": np.empty(n), "logit_rank": np.empty(n, np.int64), "gumbel_rank": np.empty(n, np.int64),
        "ipt_distance": np.full(n, np.nan), "spec_mode": np.full(n, None, dtype=object),
        "accept_slack": np.full(n, np.nan), "depth_shift": np.empty(n),
    }
    groups: dict[str, list[int]] = defaultdict(list)
    for r, i in enumerate(items):
        groups[traces[i].sampling.profile].append(r)
    for name, rows in groups.items():
        idx = np.asarray(rows)
        profile = profiles.setdefault(name, get_profile(name))
        pick = torch.as_tensor(idx, device=logits.device)
        block = logits if idx.size == n else logits[pick]  # one group: no [rows, V] copy
        out = replay(block, [traces[i].sampling for i in items[idx]], profile,
                     _keys(traces, items[idx], steps[idx]), claimed=claimed[pick])
        # The only transfer from the logits' device: one value per token and column.
        cols["verifier_token"][idx] = out.token.cpu().numpy()
        cols["margin"][idx] = out.margin.cpu().numpy()
        cols["filter_distance"][idx] = out.filter_distance.cpu().numpy()
        cols["cross_entropy"][idx] = -out.logprob.cpu().numpy()
        cols["logit_rank"][idx] = out.logit_rank.cpu().numpy()
        cols["gumbel_rank"][idx] = out.gumbel_rank.cpu().numpy()
        cols["depth_shift"][idx] = out.depth_shift.cpu().numpy()
        if getattr(out, "ipt_distance", None) is not None:  # inverse-CDF profiles (sampling/inverse_cdf.py)
            cols["ipt_distance"][idx] = out.ipt_distance.cpu().numpy()
    cols["claimed"] = claimed.cpu().numpy()
    cols["exact_match"] = cols["verifier_token"] == cols["claimed"]
    cols["filtered"] = np.isinf(cols["margin"]) & (cols["filter_distance"] > 0)
    cols["trace_id"] = np.array([traces[i].id for i in items], dtype=object)
    cols["position"] = steps.astype(np.int64)
    return {k: cols[k] for k in SCORE_COLUMNS}


def verify_traces(
    backend: Backend,
    traces: Sequence[Trace],
    token_budget: int = 4096,
    row_block: int = 512,
    on_rows: Callable[[int], None] | None = None,
    on_sequence_hidden: Callable[[int, torch.Tensor], None] | None = None,
) -> Iterator[ScoreBlock]:
    """Stream Token-DiFR scores for every output token of ``traces`` (one prefill per trace).

    ``on_sequence_hidden(i, h)`` receives trace i's hidden states from the same prefill, for
    checking activation commits without a second forward pass.
    """
    spec = [i for i, t in enumerate(traces) if is_speculative(t.sampling)]
    plain = np.array([i for i, t in enumerate(traces) if not is_speculative(t.sampling)], dtype=np.int64)
    if plain.size:
        yield from _verify_plain(backend, traces, plain, token_budget, row_block, on_rows, on_sequence_hidden)
    if spec:
        yield from _verify_speculative(backend, traces, spec, token_budget, row_block, on_rows, on_sequence_hidden)


def _verify_plain(backend, traces, subset: np.ndarray, token_budget, row_block, on_rows,
                  on_sequence_hidden) -> Iterator[ScoreBlock]:
    """Traces replayed row by row with their profile (everything but speculative decoding)."""
    sequences = [traces[i].prompt_token_ids + traces[i].output_token_ids for i in subset]
    starts = [len(traces[i].prompt_token_ids) for i in subset]
    profiles: dict[str, Profile] = {}
    hook = None if on_sequence_hidden is None else (lambda j, h: on_sequence_hidden(int(subset[j]), h))
    for block in backend.prefill(sequences, starts, token_budget=token_budget, row_block=row_block,
                                 on_sequence_hidden=hook, on_device=True):
        items, steps = subset[block.items.numpy()], block.steps.numpy()
        cols = score_block(block.logits, items, steps, traces, profiles)
        for i in np.unique(items[steps == np.array([len(traces[j].output_token_ids) - 1 for j in items])]):
            for profile in profiles.values():
                profile.forget(traces[i].id)
        if on_rows:
            on_rows(len(items))
        yield ScoreBlock(cols, items, block.hidden)


def _rows(backend: Backend, trace: Trace, token_budget: int, row_block: int, hook=None):
    """One trace's output rows from one prefill: (raw logits [n, V], hidden [n, D])."""
    blocks = list(backend.prefill([trace.prompt_token_ids + trace.output_token_ids], [len(trace.prompt_token_ids)],
                                  token_budget=token_budget, row_block=row_block, on_sequence_hidden=hook))
    return torch.cat([b.logits for b in blocks]), torch.cat([b.hidden for b in blocks])


def _verify_speculative(backend, traces, subset: list[int], token_budget, row_block, on_rows,
                        on_sequence_hidden) -> Iterator[ScoreBlock]:
    """Speculative traces: a target and a draft prefill per trace, scored by mode (DiFR appendix F)."""
    drafts: dict[str, Backend] = {}
    for i in subset:
        t = traces[i]
        name = t.sampling.speculative["draft"]
        draft = drafts.setdefault(name, draft_backend(backend, name))
        hook = None if on_sequence_hidden is None else (lambda _, h, i=i: on_sequence_hidden(i, h))
        target_logits, hidden = _rows(backend, t, token_budget, row_block, hook)
        draft_logits, _ = _rows(draft, t, token_budget, row_block)
        cols = speculative.score_columns(t, target_logits, draft_logits)
        cols.setdefault("depth_shift", np.zeros(len(t.output_token_ids)))  # no shape score for speculative rows
        if on_rows:
            on_rows(len(t.output_token_ids))
        yield ScoreBlock({k: cols[k] for k in SCORE_COLUMNS}, np.full(len(t.output_token_ids), i), hidden)
