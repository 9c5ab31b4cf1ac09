"""A provider's re-tokenized outputs aligned with the reference's replay before they are judged.

The re-split itself is ``verinfer.scoring.alignment`` (why, and why a dishonest provider gains
nothing). Here the audit adds what only a provider's response tells: its own output token count
(``usage.completion_tokens``), which the alignment repairs by the likeliest edit when the replay
shows no break. An output whose count still disagrees after alignment is misaligned somewhere
neither could repair: it is scored up to where its alignment is known to hold (before bytes its
text lost, or up to its first remaining mismatch) and the rest is counted as drift
(``unaligned``), never as model divergence.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from verinfer.auditing.responses import Claim
from verinfer.scoring.alignment import LIMIT, Aligned, align, lost_bytes_tail, occurrences


def align_claims(claims: Sequence[Claim], replay: Callable[[list[Claim]], list[dict[str, np.ndarray]]],
                 tokenizer, limit: int = LIMIT) -> list[Claim]:
    """Re-tokenized claims with text re-split where the replay reveals a tokenization break.

    ``replay(claims)`` scores claims with the reference and returns, per claim, its score columns by
    position (``claimed``, ``verifier_token``, ``cross_entropy``). Each re-tokenized claim comes back with ``drift["realigned"]``
    (re-split positions, possibly none), ``drift["count_mismatch"]`` where the provider reported a
    count, and ``drift["unaligned"]`` / ``["unaligned_from"]`` when that count still disagrees.
    Claims with returned token ids come back unchanged.
    """
    out = list(claims)
    which = [i for i, c in enumerate(out) if c.source == "retokenized" and c.text and c.output_token_ids]
    if not which:
        return out

    def replay_ids(ids: list[list[int]], todo: list[int]):
        return replay([replace(out[which[k]], output_token_ids=i, prompt_id=out[which[k]].prompt_id + tag)
                       for k, i, tag in zip(todo, ids, occurrences(todo))])

    for i, a in zip(which, align([(out[i].output_token_ids, out[i].text) for i in which], replay_ids, tokenizer,
                                 limit, [reported_counts(out[i]) for i in which])):
        c = replace(out[i], output_token_ids=a.ids, drift={**out[i].drift, "realigned": a.realigned})
        out[i] = _cut_at_break(count_mismatch(c), a, tokenizer)
    return out


def _cut_at_break(claim: Claim, aligned: Aligned, tokenizer) -> Claim:
    """A claim scored only up to where its alignment is known to hold, the rest counted as ``unaligned``
    from ``unaligned_from``: before the bytes its text lost when it ends inside a character
    (``lost_bytes_tail``), else, when its count still disagrees with usage, up to and including its first
    remaining mismatch (before it the alignment holds: a merge or split there would have been a mismatch)."""
    if len(aligned.claimed) != len(claim.output_token_ids):
        return claim
    cut = lost_bytes_tail(tokenizer, claim.output_token_ids, claim.text, reported_counts(claim))
    if cut is None:
        if not claim.drift.get("count_mismatch"):
            return claim
        mismatches = np.flatnonzero(aligned.claimed != aligned.replayed)
        cut = int(mismatches[0]) + 1 if len(mismatches) else len(aligned.claimed)
    if cut >= len(aligned.claimed):
        return claim
    return replace(claim, drift={**claim.drift, "unaligned": len(aligned.claimed) - cut, "unaligned_from": cut})


def unscored(claims: Sequence[Claim], provider: str) -> dict[str, set[int]]:
    """Positions of each claim's trace (``claim_traces`` ids) left out of the verdict: the re-split ones
    and those after an alignment break the replay could not repair."""
    out = {}
    for c in claims:
        n = len(c.output_token_ids)
        skip = set(c.drift.get("realigned", ())) | set(range(c.drift.get("unaligned_from", n), n))
        if skip:
            out[f"{provider}/{c.prompt_id}"] = skip
    return out


def reported_counts(claim: Claim) -> tuple[int, ...]:
    """The output token counts the provider's ``usage.completion_tokens`` allows for this claim's text: the
    count, and one less when the output stopped (a stop token leaves no text); none when not reported."""
    reported = claim.served.get("completion_tokens")
    if reported is None:
        return ()
    return (reported, reported - 1) if claim.finish_reason == "stop" else (reported,)


def count_mismatch(claim: Claim) -> Claim:
    """A re-tokenized claim with ``drift["count_mismatch"]``: 1 when the provider's own output token
    count (``usage.completion_tokens``) disagrees with the (aligned) re-tokenized ids; a stop token
    leaves no text, so a count one higher is expected when the output finished with ``stop``. Other
    claims come back unchanged."""
    counts = reported_counts(claim)
    if claim.source != "retokenized" or not counts:
        return claim
    return replace(claim, drift={**claim.drift, "count_mismatch": int(len(claim.output_token_ids) not in counts)})
