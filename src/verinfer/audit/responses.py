"""From a provider's response to claimed token ids, with tokenization drift measured on the side.

Token ids are the currency: when the provider returns them (vLLM's ``return_token_ids``) they are
what gets verified. Otherwise the returned text is re-tokenized with the reference tokenizer.
Re-tokenization is lossy in known ways (a greedy output is not always the canonical tokenization
of its text; a stop token leaves no text), so every mismatch it could cause is counted as
*tokenization drift* and reported apart from model divergence:

- ``retokenize_mismatch``: tokens by which ``encode(text)`` differs from the returned ids (both given);
- ``decode_mismatch``: the returned ids do not decode to the returned text;
- ``round_trip_mismatch``: without ids, ``decode(encode(text)) != text``;
- ``prompt_mismatch``: the provider's reported prompt ids differ from our rendering of the prompt
  (another chat template or system prompt; only seen when the provider reports them truthfully).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from verinfer.audit.client import ProviderError


@dataclass
class Claim:
    """One provider output, as the audit will verify it."""

    prompt_id: str
    index: int
    prompt_token_ids: list[int]  # our rendering: what the provider was asked to continue
    output_token_ids: list[int]
    source: str  # "returned" or "retokenized"
    text: str | None
    finish_reason: str | None
    drift: dict[str, Any] = field(default_factory=dict)


def _token_diff(a: list[int], b: list[int]) -> int:
    """Tokens in either list not covered by the longest common blocks (0 when equal)."""
    if a == b:
        return 0
    matched = sum(block.size for block in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks())
    return len(a) + len(b) - 2 * matched


def _field(choice: dict, response: dict, name: str) -> Any:
    """vLLM puts token ids on the choice (completions) or the response (chat prompt ids)."""
    return choice.get(name, response.get(name))


def _ids(value: Any, where: str, name: str, vocab_size: int) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProviderError(f"{where}: field {name!r} must be a list of integers")
    bad = [(i, t) for i, t in enumerate(value) if not 0 <= t < vocab_size]
    if bad:
        raise ProviderError(f"{where}: {name}[{bad[0][0]}]: token id {bad[0][1]} is outside the vocabulary "
                            f"[0, {vocab_size}) of the reference tokenizer (does the provider use another one?)")
    return value


def parse_generation(record: dict[str, Any], tokenizer, stop_ids: set[int], vocab_size: int, where: str) -> Claim:
    """A stored generation record as a Claim; ProviderError naming the field on malformed content."""
    meta, response = record, record["response"]
    choice = response["choices"][0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    if text is not None and not isinstance(text, str):
        raise ProviderError(f"{where}: the output text must be a string, got {type(text).__name__}")
    ids = _ids(_field(choice, response, "token_ids"), where, "token_ids", vocab_size)
    reported_prompt = _ids(_field(choice, response, "prompt_token_ids"), where, "prompt_token_ids", vocab_size)
    if ids is None and text is None:
        raise ProviderError(f"{where}: the response has neither output token ids nor text "
                            "('choices[0].token_ids', 'choices[0].message.content' / 'choices[0].text')")
    prompt_ids = list(meta["prompt_token_ids"])
    drift: dict[str, Any] = {}
    if reported_prompt is not None:
        drift["prompt_mismatch"] = _token_diff(reported_prompt, prompt_ids)
    if ids is not None:
        source, output = "returned", list(ids)
        if text is not None:
            body = list(ids)
            while body and body[-1] in stop_ids:
                body.pop()
            drift["retokenize_mismatch"] = _token_diff(tokenizer.encode(text, add_special_tokens=False), body)
            drift["decode_mismatch"] = int(tokenizer.decode(body, skip_special_tokens=True) != text)
    else:
        source, output = "retokenized", tokenizer.encode(text, add_special_tokens=False)
        drift["round_trip_mismatch"] = int(tokenizer.decode(output, skip_special_tokens=False) != text)
    return Claim(str(meta["prompt_id"]), int(meta["index"]), prompt_ids, output, source, text,
                 choice.get("finish_reason"), drift)


def summarize_drift(claims: list[Claim]) -> dict[str, Any]:
    """Counts of tokenization drift over an audit, separate from any model divergence."""
    out: dict[str, Any] = {"sequences": len(claims),
                           "ids_returned": sum(c.source == "returned" for c in claims),
                           "retokenized": sum(c.source == "retokenized" for c in claims)}
    for name in ("prompt_mismatch", "retokenize_mismatch", "decode_mismatch", "round_trip_mismatch"):
        values = [c.drift[name] for c in claims if name in c.drift]
        if values:
            out[name] = {"checked": len(values), "sequences": sum(v > 0 for v in values), "total": int(sum(values))}
    return out
