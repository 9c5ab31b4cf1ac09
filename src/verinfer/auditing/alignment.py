"""Re-tokenized text aligned with the tokens a provider actually sampled (issue #27, item 0).

A provider that returns text without token ids leaves the audit to re-tokenize it. Sampled tokens are
often not the canonical tokenization of their own text: " the" then "re" re-tokenize as " there". One
merge (or split) shifts every later position by one, and a seeded replay draws its noise per position,
so every later token mismatches; scored as they stand, an honest provider is called INCONSISTENT
(measured on an honest ``llama_cpp.server`` and on ``verinfer serve`` with token ids withheld). DESIGN.md:
"re-tokenization drift is measured and reported separately, never counted as model divergence".

The text does not say which tokenization was sampled; the reference's replay does. At the first
position ``p`` where the re-tokenized id differs from the replay's token ``r``, the mismatch is a
*tokenization break* when the text there begins with ``r``'s own text: the provider may have sampled
``r`` and the tokens after it, and the text cannot tell. The claim is then re-split as
``ids[:p] + [r] + encode(rest of the text)`` and replayed again, until no break is left (at most
``limit`` per sequence). Positions re-split this way are reported as drift and left out of the
verdict: they are neither evidence for nor against the provider. A mismatch the text cannot explain
(the replay's token is not where the text goes) stays a mismatch, scored as model divergence.

A dishonest provider gains nothing it could steer: a break needs the reference's own token to be a
prefix of the provider's text at that position, its position is not scored, and the tokens after it
are compared with the replay as any others (they keep mismatching if the provider's sampling differs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from verinfer.auditing.responses import Claim

LIMIT = 8  # re-splits per sequence; an honest 32-token chat output was seen needing at most one


def resplit(tokenizer, ids: list[int], text: str, position: int, token: int) -> list[int] | None:
    """``ids`` re-split so that ``token`` stands at ``position``, when ``text`` allows it, else None.

    Allowed when the decoded ``ids[:position]`` is a prefix of ``text`` and so is the decoded
    ``ids[:position] + [token]`` with at least one more character (a token that decodes to part of
    a UTF-8 character cannot be placed, nor a special token such as a stop token, whose text the
    returned text never holds). The rest of the text is encoded again as it stands.
    """
    if token == ids[position]:
        return None
    before = tokenizer.decode(ids[:position], skip_special_tokens=False)
    upto = tokenizer.decode(ids[:position] + [token], skip_special_tokens=False)
    if not text.startswith(before) or len(upto) <= len(before) or not text.startswith(upto) \
            or "\ufffd" in upto[len(before):]:
        return None
    out = ids[:position] + [token] + tokenizer.encode(text[len(upto):], add_special_tokens=False)
    return out if out != ids else None


def first_break(tokenizer, claim: Claim, claimed: np.ndarray, replayed: np.ndarray,
                start: int) -> tuple[int, list[int]] | None:
    """The claim's first tokenization break at or after ``start``: (position, re-split ids), or None."""
    for p in np.flatnonzero(claimed[start:] != replayed[start:]) + start:
        ids = resplit(tokenizer, list(claim.output_token_ids), claim.text or "", int(p), int(replayed[p]))
        if ids is not None:
            return int(p), ids
    return None


Replay = Callable[[list[Claim]], list[tuple[np.ndarray, np.ndarray]]]


def align_claims(claims: Sequence[Claim], replay: Replay, tokenizer, limit: int = LIMIT) -> list[Claim]:
    """Re-tokenized claims re-split at every tokenization break the reference's replay reveals.

    ``replay(claims)`` scores claims with the reference and returns, per claim, its claimed ids and
    the replay's tokens by position (score columns ``claimed`` and ``verifier_token``). Only
    re-tokenized claims with text are looked at; each of them comes back with the re-split positions
    in ``drift["realigned"]`` (empty when none). Claims with returned token ids come back unchanged.
    """
    out = list(claims)
    todo = [i for i, c in enumerate(out) if c.source == "retokenized" and c.text and c.output_token_ids]
    aligned, start, last = list(todo), dict.fromkeys(todo, 0), {}
    for i in todo:
        out[i] = replace(out[i], drift={**out[i].drift, "realigned": []})
    while todo:
        changed = []
        for i, (claimed, replayed) in zip(todo, replay([out[i] for i in todo])):
            last[i] = np.asarray(claimed), np.asarray(replayed)
            found = first_break(tokenizer, out[i], *last[i], start[i])
            if found is None:
                continue
            p, ids = found
            c = out[i]
            out[i] = replace(c, output_token_ids=ids, drift={**c.drift, "realigned": c.drift["realigned"] + [p]})
            start[i] = p + 1
            if len(out[i].drift["realigned"]) < limit:
                changed.append(i)
        todo = changed
    for i in aligned:
        out[i] = _cut_at_break(count_mismatch(out[i]), *last.get(i, (None, None)))
    return out


def _cut_at_break(claim: Claim, claimed: np.ndarray | None, replayed: np.ndarray | None) -> Claim:
    """A claim whose count still disagrees with the provider's is known to be misaligned somewhere the
    replay could not repair: its tokens are scored up to and including the first mismatch left (before
    it the alignment holds: a merge or split there would have been a mismatch) and the rest is counted
    as ``drift["unaligned"]``, never as model divergence."""
    if not claim.drift.get("count_mismatch") or claimed is None or len(claimed) != len(claim.output_token_ids):
        return claim
    mismatches = np.flatnonzero(claimed != replayed)
    cut = int(mismatches[0]) + 1 if len(mismatches) else len(claimed)
    return replace(claim, drift={**claim.drift, "unaligned": len(claimed) - cut, "unaligned_from": cut})


def unscored(claims: Sequence[Claim], provider: str) -> dict[str, set[int]]:
    """Positions of each claim's trace (``claim_traces`` ids) left out of the verdict: the re-split ones
    and those after an alignment break the replay could not repair."""
    out = {}
    for c in claims:
        skip = set(c.drift.get("realigned", ())) | set(range(c.drift.get("unaligned_from", len(c.output_token_ids)),
                                                             len(c.output_token_ids)))
        if skip:
            out[f"{provider}/{c.prompt_id}"] = skip
    return out


def count_mismatch(claim: Claim) -> Claim:
    """A re-tokenized claim with ``drift["count_mismatch"]``: 1 when the provider's own output token
    count (``usage.completion_tokens``) disagrees with the (aligned) re-tokenized ids, a sign of a
    broken alignment the replay could not repair; a stop token leaves no text, so a count one higher
    is expected when the output finished with ``stop``. Other claims come back unchanged."""
    reported = claim.served.get("completion_tokens")
    if claim.source != "retokenized" or reported is None:
        return claim
    gap = reported - len(claim.output_token_ids)
    agree = gap == 0 or (gap == 1 and claim.finish_reason == "stop")
    return replace(claim, drift={**claim.drift, "count_mismatch": int(not agree)})
