"""Judging a provider's sampled traffic without seeds: the ``rank``, ``mmd`` and ``logprobs`` modes.

A provider that ignores seeds cannot be replayed token by token, but its completions are still
draws from its sampling distribution, which an honest provider shares with the reference. Both
modes compare them with the reference's own draws under the claimed temperature, top-k, top-p and
``max_tokens`` (``verinfer.auditing.draws``): ``rank`` ranks one completion per prompt among m
draws by the reference's log-probability and tests the ranks for uniformity (RUT,
``verinfer.auditing.rank``); ``mmd`` runs Model Equality Testing's kernel two-sample test on n
completions per prompt from each side (``verinfer.auditing.mmd``).

Exchangeability is what makes both exact, so both sides are put in the same form first: when a
provider returns only text, its completions are re-tokenized and so are the reference's draws
(``draws.retokenize``: a stop token leaves no text on either side). Empty completions are kept:
dropping them would select draws on one side only. ``logprobs`` needs no draws: it compares the
returned top-k logprobs with the reference's at the same positions (``verinfer.auditing.logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from verinfer.auditing.draws import reference_draws, retokenize, sequence_logprobs, store_path
from verinfer.auditing.logprobs import logprob_verdict, parse_returned, provider_values, reference_values, token_table
from verinfer.auditing.mmd import mmd_verdict
from verinfer.auditing.plan import AuditSpec
from verinfer.auditing.rank import rank_p_values, rank_verdict
from verinfer.auditing.responses import Claim
from verinfer.auditing.store import ResponseStore
from verinfer.stats.verdict import Verdict


@dataclass
class SampledJudgement:
    verdict: Verdict
    prompts: list[dict]  # per prompt: prompt_id, tokens, completions, and rank_quantile (rank mode)


def judge_sampled(claims: Sequence[Claim], spec: AuditSpec, backend, out_dir, fpr: float,
                  on_stage: Callable[[str], None] | None = None) -> SampledJudgement:
    """The verdict on ``claims`` (each prompt's completions, choice order kept) as ``spec.mode`` asks."""
    by_prompt: dict[str, list[Claim]] = {}
    for c in claims:
        by_prompt.setdefault(c.prompt_id, []).append(c)
    groups = sorted(by_prompt.values(), key=lambda cs: cs[0].index)
    params = spec.params(0)
    store = ResponseStore(store_path(out_dir))
    draws = reference_draws(backend, [(cs[0].prompt_id, cs[0].prompt_token_ids) for cs in groups], params,
                            spec.samples, spec.seed, spec.max_tokens, store, batch_size=64, on_stage=on_stage)
    ref = [draws[cs[0].prompt_id] for cs in groups]
    ref = [retokenize(backend.tokenizer, d) if cs[0].source == "retokenized" else d for cs, d in zip(groups, ref)]
    outputs = [[c.output_token_ids for c in cs] for cs in groups]
    tokens = [sum(len(o) for o in outs) for outs in outputs]
    rows = [{"prompt_id": cs[0].prompt_id, "tokens": t, "completions": len(cs)} for cs, t in zip(groups, tokens)]
    if spec.mode == "rank":
        prompts = [cs[0].prompt_token_ids for cs in groups]
        firsts = [outs[0] for outs in outputs]
        if on_stage:
            on_stage(f"scoring {len(firsts)} provider completions and {sum(map(len, ref))} reference draws")
        scores = sequence_logprobs(backend, prompts + [p for p, d in zip(prompts, ref) for _ in d],
                                   firsts + [o for d in ref for o in d], params.temperature)
        observed, rest = scores[: len(firsts)], scores[len(firsts):]
        bounds = np.cumsum([0] + [len(d) for d in ref])
        u = rank_p_values(observed, [rest[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                          np.random.default_rng(spec.seed))
        for row, q, first in zip(rows, u, firsts):
            row.update(rank_quantile=float(q), tokens=len(first))
        verdict = rank_verdict(u, np.array([len(o) for o in firsts]), spec.samples, fpr)
    else:
        verdict = mmd_verdict(outputs, ref, spec.max_tokens, fpr, seed=spec.seed)
    return SampledJudgement(verdict, rows)


def judge_logprobs(claims: Sequence[Claim], records: Sequence[dict], spec: AuditSpec, backend, fpr: float,
                   provider: str, store: ResponseStore) -> SampledJudgement:
    """The ``logprobs`` verdict on each prompt's first completion and its returned top-k logprobs."""
    table = token_table(backend.tokenizer)
    returned = [parse_returned(r, 0, table, c.prompt_id, c.prompt_token_ids,
                               f"provider {provider!r}: {store.path} (prompt {c.prompt_id})")
                for r, c in zip(records, claims)]
    theirs, ours = provider_values(returned), reference_values(backend, returned)
    tokens = np.array([len(r.token_ids) for r in returned])
    rows = [{"prompt_id": r.prompt_id, "tokens": len(r.token_ids), "completions": 1, "unmapped_positions": r.unmapped,
             "mean_abs_logprob_diff": float(np.mean(np.abs(a - b))) if a.size else 0.0}
            for r, a, b in zip(returned, theirs, ours)]
    return SampledJudgement(logprob_verdict(theirs, ours, tokens, fpr), rows)
