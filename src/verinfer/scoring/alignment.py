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

A replay with another seed than the provider's (a seed-rewriting proxy) reveals no break: its tokens
differ from the first position on. When the provider reported its own token count and the text's
tokenization still disagrees with it, the count is repaired by the likeliest single edit: each way to
split one token into two (or merge two into one) that keeps the text is replayed, and the one whose
tokens the reference finds likeliest (the least total cross-entropy: the provider's sampler, not the
tokenizer, chose the tokens) is kept, its edited positions unscored (at most ``EDITS`` per output).
Without it such an output was scored only up to its first mismatch: 7.9% of a proxy's tokens were cut
(RESULTS.md section 28).

Used by the audit (``verinfer.auditing.alignment``: claims from a provider's responses) and by
``verinfer.api.verify`` (traces whose ``meta.token_source`` is ``retokenized``, as the gateway records
text-only engines).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

LIMIT = 8  # re-splits per output; an honest 32-token chat output was seen needing at most one
EDITS = 2  # count repairs per output: each leaves two positions unscored, so a provider misreporting
# its counts gains at most four unscored tokens an output
EDIT_CANDIDATES = 256  # replays one repair may cost (a 22-token sentence and 35 tokens of code offered 53 and 45); an
# output offering more (a long one) is not repaired: it is cut at its first mismatch as before


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


def count_edits(tokenizer, ids: list[int], text: str, longer: bool) -> list[tuple[list[int], list[int]]]:
    """Every tokenization of ``text`` one token longer (``longer``: one token split in two) or shorter
    (two adjacent tokens merged into one) than ``ids``, each with the positions it changed.

    Only edits that keep the decoded text exactly, with each new token a single token of the
    vocabulary (the re-encoded piece), are offered: the provider's sampler may have chosen any of
    them, the text cannot say which. None for a text that lost bytes (a replacement character: its
    count cannot be matched: ``lost_bytes_tail``) or that ``ids`` do not spell."""
    if "\ufffd" in text or tokenizer.decode(ids, skip_special_tokens=False) != text:
        return []

    def single(piece: str) -> int | None:
        got = tokenizer.encode(piece, add_special_tokens=False)
        return got[0] if len(got) == 1 and tokenizer.decode(got, skip_special_tokens=False) == piece else None

    out = []
    if longer:
        for j, t in enumerate(ids):
            s = tokenizer.decode([t], skip_special_tokens=False)
            for k in range(1, len(s)):
                a, b = single(s[:k]), single(s[k:])
                if a is not None and b is not None:
                    edited = ids[:j] + [a, b] + ids[j + 1:]
                    if tokenizer.decode(edited, skip_special_tokens=False) == text:
                        out.append((edited, [j, j + 1]))
    else:
        for j in range(len(ids) - 1):
            z = single(tokenizer.decode(ids[j:j + 2], skip_special_tokens=False))
            if z is not None:
                edited = ids[:j] + [z] + ids[j + 2:]
                if tokenizer.decode(edited, skip_special_tokens=False) == text:
                    out.append((edited, [j]))
    return out


def likeliest_edit(tokenizer, ids: list[int], text: str, counts: Sequence[int], score: Callable[[list[list[int]]],
                   list[float]]) -> tuple[list[int], list[int]] | None:
    """The edit of ``ids`` toward the nearest of ``counts`` whose tokens the reference finds likeliest:
    (edited ids, changed positions), or None when the count agrees, no edit keeps the text or more than
    ``EDIT_CANDIDATES`` do.
    ``score(candidates)``: each candidate's total cross-entropy under the reference (lower: likelier)."""
    want = min(counts, key=lambda c: abs(c - len(ids)))
    if want == len(ids):
        return None
    candidates = count_edits(tokenizer, ids, text, longer=want > len(ids))
    if not candidates or len(candidates) > EDIT_CANDIDATES:
        return None
    nats = np.asarray(score([c for c, _ in candidates]), dtype=np.float64)
    if not np.isfinite(nats).any():
        return None
    return candidates[int(np.argmin(np.where(np.isfinite(nats), nats, np.inf)))]


def lost_bytes_tail(tokenizer, ids: Sequence[int], text: str, counts: Sequence[int] = ()) -> int | None:
    """How many of ``ids`` to score when ``text`` ends inside a character, else None.

    An output cut at its token limit inside a multi-byte character (an emoji's first bytes) ends in
    U+FFFD: the bytes the provider sampled there are lost, and re-tokenizing the replacement character
    gives other tokens, mismatches an honest provider did not make. The tokens from the character before
    it on (a byte-level token may join it to the lost bytes) are left unscored, when ``counts`` (the
    provider's own, when known) leave that tail a plausible number of tokens: one to one per byte, at
    most three per lost character. Only a trailing run counts: a replacement character inside the text
    could be steered to leave everything after it unscored."""
    lost = len(text.rstrip("\ufffd"))
    if lost == len(text):
        return None
    keep = max(lost - 1, 0)
    lo, hi = 0, len(ids)  # the most tokens whose text ends by ``keep`` (a prefix's text only grows)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tokenizer.decode(list(ids[:mid]), skip_special_tokens=False)) <= keep else (lo, mid - 1)
    prefix = tokenizer.decode(list(ids[:lo]), skip_special_tokens=False)
    if not text.startswith(prefix):
        return None
    most = sum(3 if ch == "\ufffd" else len(ch.encode("utf-8")) for ch in text[len(prefix):])
    return lo if not counts or any(1 <= c - lo <= most for c in counts) else None


def occurrences(which: Sequence[int]) -> list[str]:
    """A suffix per entry of ``which`` that tells repeated outputs apart (candidate tokenizations of one
    output replayed side by side): empty for an output named once, ``~k`` for each of several."""
    many = {i for i, n in Counter(which).items() if n > 1}
    seen: dict[int, int] = {}
    out = []
    for i in which:
        if i in many:
            seen[i] = seen.get(i, -1) + 1
            out.append(f"~{seen[i]}")
        else:
            out.append("")
    return out


@dataclass
class Aligned:
    """One output after alignment: its ids, the positions left unscored (re-split or edited to agree
    with the provider's count), and its last replay (claimed ids and the replay's tokens by position,
    for the ids as they now stand)."""

    ids: list[int]
    realigned: list[int]
    claimed: np.ndarray
    replayed: np.ndarray


Replay = Callable[[list[list[int]], list[int]], list[dict[str, np.ndarray]]]


def align(outputs: Sequence[tuple[list[int], str]], replay: Replay, tokenizer, limit: int = LIMIT,
          counts: Sequence[Sequence[int]] | None = None) -> list[Aligned]:
    """Each (re-tokenized ids, text) re-split at every tokenization break the reference's replay reveals,
    then, where its count still disagrees with its provider's, edited by the likeliest count repair.

    ``replay(ids_list, which)`` scores the outputs numbered ``which`` with the ids given and returns,
    per entry, its score columns (``claimed``, ``verifier_token``, ``cross_entropy`` by position); an
    output named several times in ``which`` is one candidate tokenization per entry, each scored on its
    own (``occurrences`` tells them apart). Only outputs that changed are replayed again. ``counts``:
    per output, the token counts its provider's report allows (``first_break``), or none known.
    """
    ids = [list(i) for i, _ in outputs]
    realigned: list[list[int]] = [[] for _ in outputs]
    last: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * len(outputs)
    start, breaks, edits = [0] * len(outputs), [0] * len(outputs), [0] * len(outputs)
    todo = [i for i, (o, text) in enumerate(outputs) if o and text]
    while todo:
        changed = []
        for i, got in zip(todo, replay([ids[i] for i in todo], todo)):
            last[i] = np.asarray(got["claimed"]), np.asarray(got["verifier_token"])
            allowed = counts[i] if counts else ()
            found = first_break(tokenizer, ids[i], outputs[i][1], *last[i], start[i], allowed) \
                if breaks[i] < limit else None
            if found is not None:
                p, ids[i] = found
                realigned[i].append(p)
                start[i], breaks[i] = p + 1, breaks[i] + 1
                changed.append(i)  # replayed again: its last replay is of the ids as they now stand
                continue
            if allowed and edits[i] < EDITS:
                edit = likeliest_edit(tokenizer, ids[i], outputs[i][1], allowed, lambda cands, i=i: [
                    float(np.sum(g["cross_entropy"])) for g in replay(cands, [i] * len(cands))])
                if edit is not None:
                    ids[i], where = edit
                    edits[i] += 1
                    realigned[i] = sorted({p + (len(ids[i]) - len(last[i][0]) if p > where[0] else 0)
                                           for p in realigned[i]} | set(where))
                    start[i] = where[-1] + 1
                    changed.append(i)
        todo = changed
    return [Aligned(ids[i], realigned[i], *last[i]) for i in range(len(outputs))]


def keep_rows(columns: dict[str, np.ndarray], skip: dict[str, set[int]]) -> dict[str, np.ndarray]:
    """Score rows without the positions ``skip`` names per trace id (re-split, or past a break)."""
    if not skip:
        return columns
    keep = np.array([int(p) not in skip.get(t, ()) for t, p in zip(columns["trace_id"], columns["position"])], bool)
    return {k: np.asarray(v)[keep] for k, v in columns.items()}
