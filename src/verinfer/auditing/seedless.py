"""Judging a provider's sampled traffic without seeds: the ``surprise``, ``rank``, ``mmd`` and
``logprobs`` modes.

A provider that ignores seeds cannot be replayed token by token, but its completions are still
draws from its sampling distribution, which an honest provider shares with the reference. Every
completion is scored by the reference's log-probability minus its expectation under the claimed
temperature, top-k, top-p (``draws.completion_scores``: one prefill). ``surprise`` judges that
sum by a test martingale built from the reference's distribution at each position, no draws
(``verinfer.auditing.surprise``: exact at every size); ``rank`` ranks it among m reference draws
of the completion's own and tests the ranks for uniformity (RUT with a centred score,
``verinfer.auditing.rank``); ``mmd`` runs Model Equality Testing's kernel
two-sample test on n completions per prompt from each side (``verinfer.auditing.mmd``). RESULTS.md
section 21 measures their power side by side.

Exchangeability is what makes rank and mmd exact, so both sides are put in the same form first:
when a provider returns only text, its completions are re-tokenized and so are the reference's
draws (``draws.retokenize``: a stop token leaves no text on either side). Empty completions are
kept: dropping them would select draws on one side only. ``logprobs`` needs no draws: it compares
the returned top-k logprobs with the reference's at the same positions (``verinfer.auditing.logprobs``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from verinfer.auditing.bands import Bands
from verinfer.auditing.draws import completion_scores, reference_draws, retokenize, store_path
from verinfer.auditing.logprobs import (GAP_STATISTIC, ReferenceValues, ReturnedLogprobs, gap_rows, logprob_verdict,
                                       parse_returned, position_gaps, provider_values, reference_values, token_table)
from verinfer.auditing.mmd import mmd_verdict
from verinfer.auditing.plan import AuditSpec
from verinfer.auditing.progress import StageProgress
from verinfer.auditing.rank import rank_p_values, rank_score, rank_verdict, split
from verinfer.auditing.remote_reference import remote_completion_scores, remote_draws, remote_values
from verinfer.auditing.responses import Claim
from verinfer.auditing.store import ResponseStore
from verinfer.auditing.surprise import TILTS, surprise_verdict, surprise_z
from verinfer.stats.verdict import Verdict, pooled_verdict


@dataclass
class SampledJudgement:
    verdict: Verdict
    prompts: list[dict]  # per prompt: prompt_id, tokens, completions, and rank_quantile (rank mode)


def judge_sampled(claims: Sequence[Claim], spec: AuditSpec, backend, out_dir, fpr: float,
                  on_stage: Callable[[str], None] | None = None, remote=None,
                  on_block: Callable | None = None) -> SampledJudgement:
    """The verdict on ``claims`` (each prompt's completions, choice order kept) as ``spec.mode`` asks.

    ``rank`` judges every completion (all ``n`` of each prompt), each against its own ``samples``
    reference draws; ``surprise`` judges every completion against the reference's own distribution (no
    draws); ``mmd`` compares each prompt's n completions with n reference draws. With
    ``remote`` (an ``ApiReference``) the draws and scores come from that API instead of ``backend``
    (``verinfer.auditing.remote_reference``). ``on_block(block, judged)`` sees each block of surprise's
    prefill (``draws.completion_scores``) and the claims its sequences are, in order."""
    by_prompt: dict[str, list[Claim]] = {}
    for c in claims:
        by_prompt.setdefault(c.prompt_id, []).append(c)
    groups = sorted(by_prompt.values(), key=lambda cs: cs[0].index)
    params = spec.params(0)
    store = ResponseStore(store_path(out_dir))
    outputs = [[c.output_token_ids for c in cs] for cs in groups]
    rows = [{"prompt_id": cs[0].prompt_id, "tokens": sum(len(o) for o in outs), "completions": len(cs)}
            for cs, outs in zip(groups, outputs)]
    same_form = (lambda c, d: retokenize((remote or backend).tokenizer, d) if c.source == "retokenized" else d)
    if remote is None:
        draw = lambda entries: reference_draws(backend, entries, params, spec.samples, spec.seed,  # noqa: E731
                                               spec.max_tokens, store, on_stage=on_stage)
    else:
        draw = lambda entries: remote_draws(remote, entries, params, spec.samples, spec.seed,  # noqa: E731
                                            spec.max_tokens, on_stage)
    if spec.mode == "mmd":
        draws = draw([(cs[0].prompt_id, cs[0].prompt_token_ids) for cs in groups])
        ref = [same_form(cs[0], d) for cs, d in zip(groups, draws)]
        return SampledJudgement(mmd_verdict(outputs, ref, spec.max_tokens, fpr, seed=spec.seed), rows)
    judged = [c for cs in groups for c in cs]  # every completion (each with draws of its own for rank)
    if spec.mode == "surprise":  # no draws: the reference's own distribution at each position (a reference
        # API, which returns only its top logprobs, is refused before any request: ``auditing.run``)
        progress = StageProgress(on_stage, "surprise: scoring", sum(len(c.output_token_ids) for c in judged), "tokens")

        def seen(block) -> None:
            progress.advance(len(block.items))
            if on_block is not None:
                on_block(block, judged)

        scores = completion_scores(backend, [c.prompt_token_ids for c in judged], [c.output_token_ids for c in judged],
                                   params, tilts=TILTS, on_block=seen)
        at = np.cumsum([0] + [len(cs) for cs in groups])
        for row, a, b in zip(rows, at[:-1], at[1:]):
            row["surprise_z"] = surprise_z(scores[a:b])
        return SampledJudgement(surprise_verdict(scores, fpr), rows)
    draws = draw([(c.prompt_id, c.prompt_token_ids) for c in judged])
    ref = [same_form(c, d) for c, d in zip(judged, draws)]
    if on_stage:
        on_stage(f"scoring {len(judged)} provider completions and {sum(map(len, ref))} reference draws")
    prompts = [c.prompt_token_ids for c in judged]
    ins, outs = prompts + [p for p, d in zip(prompts, ref) for _ in d], [c.output_token_ids for c in judged] + [
        o for d in ref for o in d]
    progress = StageProgress(on_stage, "rank: scoring", sum(map(len, outs)), "tokens")
    scores = (completion_scores(backend, ins, outs, params, on_block=lambda block: progress.advance(len(block.items)))
              if remote is None else remote_completion_scores(remote, ins, outs, params))
    u = rank_p_values(rank_score(scores[: len(judged)]),
                      split(rank_score(scores[len(judged):]), [len(d) for d in ref]),
                      np.random.default_rng(spec.seed))
    at = np.cumsum([0] + [len(cs) for cs in groups])
    for row, a, b in zip(rows, at[:-1], at[1:]):
        row["rank_quantiles"] = [float(q) for q in u[a:b]]
        row["rank_quantile"] = float(np.mean(u[a:b]))
    verdict = rank_verdict(u, np.array([len(c.output_token_ids) for c in judged]), spec.samples, fpr)
    return SampledJudgement(verdict, rows)


def returned_logprobs_of(claims: Sequence[Claim], records: Sequence[dict], table: dict[str, int], provider: str,
                         store: ResponseStore) -> list[ReturnedLogprobs]:
    """Each prompt's first completion's returned top-k logprobs, mapped to reference token ids (``table``:
    ``logprobs.token_table``)."""
    return [parse_returned(r, 0, table, c.prompt_id, c.prompt_token_ids,
                           f"provider {provider!r}: {store.path} (prompt {c.prompt_id})")
            for r, c in zip(records, claims)]


def judge_logprobs(claims: Sequence[Claim], records: Sequence[dict], spec: AuditSpec, backend, fpr: float,
                   provider: str, store: ResponseStore, remote=None,
                   sink: ReferenceValues | None = None, bands: Bands | None = None) -> SampledJudgement:
    """The ``logprobs`` verdict on each prompt's first completion and its returned top-k logprobs.

    With logprob-gap ``bands`` (``auditing.bands``; shipped for the bundled model) and a local reference:
    the paired test, the mean clipped gap between each returned value and the reference's for the same
    token at the same position, against honest fp32 and bf16 providers' gaps (``pooled_verdict``).
    Without them, or against a reference API's prompt logprobs (``remote``:
    ``remote_reference.remote_values``, whose values for alternatives outside its top 20 are bounds,
    not values to pair): the unpaired KS test (LOGIC). ``sink``: the reference values another prefill
    already filled (``auditing.auto``)."""
    table = token_table((remote or backend).tokenizer) if sink is None else {}
    returned = sink.returned if sink is not None else returned_logprobs_of(claims, records, table, provider, store)
    if remote is None:
        theirs, ours, bounded = provider_values(returned), reference_values(backend, returned, sink), [0] * len(returned)
    else:
        theirs, ours, bounded = remote_values(remote, returned, table)
    tokens = np.array([len(r.token_ids) for r in returned])
    rows = [{"prompt_id": r.prompt_id, "tokens": len(r.token_ids), "completions": 1, "unmapped_positions": r.unmapped,
             "mean_abs_logprob_diff": float(np.mean(np.abs(a - b))) if a.size else 0.0, "bounded_alternatives": d}
            for r, a, b, d in zip(returned, theirs, ours, bounded)]
    if bands is None or remote is not None:
        verdict = logprob_verdict(theirs, ours, tokens, fpr)
        if remote is None:
            verdict = replace(verdict, method=f"{verdict.method}; no logprob-gap bands for this model and settings "
                              "(`verinfer audit bands --mode logprobs` builds them) judge the paired gap")
        return SampledJudgement(verdict, rows)
    gaps = position_gaps(returned, theirs, ours)
    for row, g in zip(rows, gaps):
        row["mean_logprob_gap"] = float(g.mean()) if g.size else 0.0
    seq = gap_rows([g for g in gaps if g.size], bands.clip)
    return SampledJudgement(pooled_verdict(seq, bands.honest_bands(), fpr, all_bands=bands.labelled(),
                                           source=bands.source, clip=bands.clip, statistic=GAP_STATISTIC), rows)
