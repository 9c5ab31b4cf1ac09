"""Re-tokenized text aligned with the tokens a provider actually sampled (issue #27, item 0).

A provider that returns text without token ids leaves the verifier to re-tokenize it. Sampled tokens
are often not the canonical tokenization of their own text: " the" then "re" re-tokenize as " there".
One merge (or split) shifts every later position by one, and a seeded replay draws its noise per
position, so every later token mismatches; scored as they stand, an honest provider is called
INCONSISTENT (measured on an honest ``llama_cpp.server`` and on ``verinfer serve`` with token ids
withheld, RESULTS.md section 9). DESIGN.md: "re-tokenization drift is measured and reported
separately, never counted as model divergence".

The text does not say which tokenization was sampled; the reference's replay does. At the first
position ``p`` where the re-tokenized id differs from the replay's token ``r``, the mismatch is a
*tokenization break* when the text there begins with ``r``'s own text: the provider may have sampled
``r`` and the tokens after it, and the text cannot tell. The output is then re-split as
``ids[:p] + [r] + encode(rest of the text)`` and replayed again, until no break is left (at most
``LIMIT`` per output). Positions re-split this way are drift, left out of the verdict: neither
evidence for nor against the provider. A mismatch the text cannot explain (the replay's token is not
where the text goes) stays a mismatch, scored as model divergence.

A dishonest provider gains nothing it could steer: a break needs the reference's own token to be a
prefix of the provider's text at that position, that position is not scored, and the tokens after it
are compared with the replay as any others (a seed-rewriting proxy stays INCONSISTENT).

Used by the audit (``verinfer.auditing.alignment``: claims from a provider's responses) and by
``verinfer.api.verify`` (traces whose ``meta.token_source`` is ``retokenized``, as the gateway records
text-only engines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

LIMIT = 8  # re-splits per output; an honest 32-token chat output was seen needing at most one


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


def first_break(tokenizer, ids: list[int], text: str, claimed: np.ndarray, replayed: np.ndarray,
                start: int, counts: Sequence[int] = ()) -> tuple[int, list[int]] | None:
    """The first tokenization break at or after ``start``: (position, re-split ids), or None.

    ``counts``: the token counts the provider's own report allows (``usage.completion_tokens``; one
    less when a stop token left no text). A re-split that takes the count further from them is no
    break: the provider's tokenization already had that many tokens, and the replay's token is a
    prefix of the text by chance (a wrong seed's token often is: " the" where " there" was served),
    so the mismatch stays a mismatch, scored, and the output keeps its alignment."""
    far = (lambda n: min(abs(n - c) for c in counts)) if counts else (lambda n: 0)  # noqa: E731
    for p in np.flatnonzero(claimed[start:] != replayed[start:]) + start:
        out = resplit(tokenizer, list(ids), text, int(p), int(replayed[p]))
        if out is not None and far(len(out)) <= far(len(ids)):
            return int(p), out
    return None


@dataclass
class Aligned:
    """One output after alignment: its ids, the re-split positions, and its last replay
    (claimed ids and the replay's tokens by position, for the ids as they now stand)."""

    ids: list[int]
    realigned: list[int]
    claimed: np.ndarray
    replayed: np.ndarray


Replay = Callable[[list[list[int]], list[int]], list[tuple[np.ndarray, np.ndarray]]]


def align(outputs: Sequence[tuple[list[int], str]], replay: Replay, tokenizer, limit: int = LIMIT,
          counts: Sequence[Sequence[int]] | None = None) -> list[Aligned]:
    """Each (re-tokenized ids, text) re-split at every tokenization break the reference's replay reveals.

    ``replay(ids_list, which)`` scores the outputs numbered ``which`` with the ids given and returns,
    per output, its claimed ids and the replay's tokens by position (score columns ``claimed`` and
    ``verifier_token``). Only outputs that changed are replayed again. ``counts``: per output, the
    token counts its provider's report allows (``first_break``), or none known.
    """
    ids = [list(i) for i, _ in outputs]
    realigned: list[list[int]] = [[] for _ in outputs]
    last: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * len(outputs)
    start = [0] * len(outputs)
    todo = [i for i, (o, text) in enumerate(outputs) if o and text]
    while todo:
        changed = []
        for i, (claimed, replayed) in zip(todo, replay([ids[i] for i in todo], todo)):
            last[i] = np.asarray(claimed), np.asarray(replayed)
            found = first_break(tokenizer, ids[i], outputs[i][1], *last[i], start[i], counts[i] if counts else ())
            if found is None:
                continue
            p, ids[i] = found
            realigned[i].append(p)
            start[i] = p + 1
            if len(realigned[i]) < limit:
                changed.append(i)
        todo = changed
    return [Aligned(ids[i], realigned[i], *last[i]) for i in range(len(outputs))]


def keep_rows(columns: dict[str, np.ndarray], skip: dict[str, set[int]]) -> dict[str, np.ndarray]:
    """Score rows without the positions ``skip`` names per trace id (re-split, or past a break)."""
    if not skip:
        return columns
    keep = np.array([int(p) not in skip.get(t, ()) for t, p in zip(columns["trace_id"], columns["position"])], bool)
    return {k: np.asarray(v)[keep] for k, v in columns.items()}
