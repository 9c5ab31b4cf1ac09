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

What the provider *says* it served is recorded apart (``Claim.served``: the model id, the usage
token counts and the number of returned tokens) and checked against the request and the returned
ids (``summarize_served``): another model id than requested, more output tokens than
``max_tokens``, usage counts that disagree with the returned token ids, reported prompt ids or a
``usage.prompt_tokens`` that differ from our rendering of the prompt (the provider tokenized or
templated it otherwise, so the outputs are replayed on another context than it saw: e.g.
``llama_cpp.server`` on code prompts, which returns no prompt ids). Such contradictions are
warnings listed in every report; they do not change the statistical verdict, which rests on the
tokens alone.

A provider that decodes speculatively (``verinfer serve --speculative``) says so in
``verinfer_sampling.speculative`` (``{"draft", "k"}``) and gives each output token's mode in
``verinfer_spec_modes`` (``a``/``r``/``b``, one letter per returned token id); the claim keeps both
(``Claim.speculative``, ``Claim.spec_modes``) so its trace claims them and replays speculatively.
They are taken only with returned token ids (retokenized text has no per-token modes) and refused
(ProviderError naming the field) when malformed.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from verinfer.auditing.client import ProviderError
from verinfer.sampling.params import SamplingParams, speculative_problems
from verinfer.trace import Trace


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
    served: dict[str, Any] = field(default_factory=dict)  # what the provider says it served (served_claims)
    speculative: dict[str, Any] | None = None  # verinfer_sampling.speculative, as the provider reported it
    spec_modes: str | None = None  # verinfer_spec_modes: a / r / b per output token


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


def parse_generation(record: dict[str, Any], tokenizer, stop_ids: set[int], vocab_size: int, where: str,
                     index: int = 0) -> Claim:
    """Choice ``index`` of a stored generation record as a Claim; ProviderError naming the field on
    malformed content."""
    meta, response = record, record["response"]
    choice = response["choices"][index]
    if not isinstance(choice, dict):
        raise ProviderError(f"{where}: choices[{index}] is not an object")
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
    speculative, modes = _speculation(choice, where, ids)
    return Claim(str(meta["prompt_id"]), int(meta["index"]), prompt_ids, output, source, text,
                 choice.get("finish_reason"), drift,
                 served_claims(response, record.get("request") or {}, ids, reported_prompt, index, prompt_ids),
                 speculative, modes)


def _speculation(choice: dict, where: str, ids: list[int] | None) -> tuple[dict | None, str | None]:
    """The speculative claim and per-token modes a choice reports (module docstring), checked."""
    sampling = choice.get("verinfer_sampling")
    spec = sampling.get("speculative") if isinstance(sampling, dict) else None
    modes = choice.get("verinfer_spec_modes")
    if spec is None and modes is None:
        return None, None
    problems = speculative_problems(spec) if spec is not None else \
        ["verinfer_spec_modes given, but verinfer_sampling.speculative claims no speculative decoding"]
    if problems:
        raise ProviderError(f"{where}: {problems[0]}")
    if ids is None:  # modes index returned token ids; without them the text's tokens have none
        return spec, None
    if modes is not None:
        if not isinstance(modes, str) or set(modes) - set("arb"):
            raise ProviderError(f"{where}: field 'verinfer_spec_modes' must be a string of a/r/b letters, "
                                f"got {str(modes)[:60]!r}")
        if len(modes) != len(ids):
            raise ProviderError(f"{where}: field 'verinfer_spec_modes' has {len(modes)} letters for "
                                f"{len(ids)} returned token ids")
    return dict(spec), modes


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def served_claims(response: dict, request: dict, ids: list[int] | None,
                  reported_prompt: list[int] | None, index: int = 0,
                  rendered_prompt: list[int] | None = None) -> dict[str, Any]:
    """What one response says was served, and where that contradicts the request or the returned ids.

    With several choices (``n``), ``usage`` covers them all: it is compared with the token ids of
    every choice and counted with choice 0 only.

    ``problems`` maps a check to a short phrase: ``model`` (another model id than requested),
    ``max_tokens`` (more output tokens than asked for, by the returned ids or by usage),
    ``completion_usage`` / ``prompt_usage`` (usage counts that disagree with the returned output or
    prompt token ids), ``prompt_rendering`` (reported prompt ids, else ``usage.prompt_tokens``, that
    differ from ``rendered_prompt``, ours), ``usage_malformed`` (a usage object whose counts are not
    integers).
    """
    model = response.get("model")
    requested, max_tokens = request.get("model"), _count(request.get("max_tokens"))
    usage = response.get("usage")
    prompt_tokens = completion_tokens = None
    problems: dict[str, str] = {}
    if isinstance(usage, dict):
        prompt_tokens, completion_tokens = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
        if ("prompt_tokens" in usage and prompt_tokens is None) or \
                ("completion_tokens" in usage and completion_tokens is None):
            problems["usage_malformed"] = f"usage counts are not non-negative integers: {str(usage)[:120]}"
    elif usage is not None:
        problems["usage_malformed"] = f"usage is a {type(usage).__name__}, expected an object"
    if model is not None and requested is not None and model != requested:
        problems["model"] = f"served model {str(model)[:120]!r}, requested {requested!r}"
    returned = len(ids) if ids is not None else None
    if index > 0:
        prompt_tokens = completion_tokens = None
    every = [c.get("token_ids") for c in response.get("choices", []) if isinstance(c, dict)]
    returned_all = (sum(len(t) for t in every) if ids is not None and all(isinstance(t, list) for t in every)
                    else returned)
    if max_tokens is not None:
        choices = max(1, len(response.get("choices") or []))  # usage counts every choice (n)
        over = [k for k, limit in ((returned, max_tokens), (completion_tokens, max_tokens * choices))
                if k is not None and k > limit]
        if over:
            problems["max_tokens"] = (f"{max(over)} output tokens"
                                      f"{f' over {choices} choices' if choices > 1 and max(over) == completion_tokens else ''}"
                                      f", max_tokens was {max_tokens}")
    if completion_tokens is not None and returned_all is not None and completion_tokens != returned_all:
        problems["completion_usage"] = f"usage.completion_tokens {completion_tokens}, {returned_all} token ids returned"
    if prompt_tokens is not None and reported_prompt is not None and prompt_tokens != len(reported_prompt):
        problems["prompt_usage"] = (f"usage.prompt_tokens {prompt_tokens}, {len(reported_prompt)} prompt token ids "
                                    "returned")
    if rendered_prompt is not None and index == 0:
        if reported_prompt is not None and list(reported_prompt) != list(rendered_prompt):
            problems["prompt_rendering"] = (f"{len(reported_prompt)} prompt token ids returned, "
                                            f"{len(rendered_prompt)} in the reference's rendering, not the same")
        elif reported_prompt is None and prompt_tokens is not None and prompt_tokens != len(rendered_prompt):
            problems["prompt_rendering"] = (f"usage.prompt_tokens {prompt_tokens}, {len(rendered_prompt)} in the "
                                            "reference's rendering")
    return {"model": model if model is None or isinstance(model, str) else str(model)[:120],
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "returned_tokens": returned, "requested_model": requested, "max_tokens": max_tokens,
            "problems": problems}


CHECKS = {  # check -> what a warning says about the responses where it fails
    "model": "reported another model id than requested",
    "max_tokens": "claimed more output tokens than max_tokens",
    "completion_usage": "reported usage.completion_tokens that disagree with the returned token ids",
    "prompt_usage": "reported usage.prompt_tokens that disagree with the returned prompt token ids",
    "prompt_rendering": "saw another prompt than the reference's rendering of it (another tokenization, chat "
                        "template or system prompt: their outputs are replayed on a context the provider did not "
                        "see)",
    "usage_malformed": "reported a malformed usage object",
}


def summarize_served(claims: list[Claim]) -> dict[str, Any]:
    """What a provider said it served over an audit, with one warning per kind of contradiction.

    Warnings name how many responses contradict the request and give the first example; they are
    reported prominently but leave the verdict, which rests on the verified tokens, unchanged.
    """
    models: dict[str, int] = {}
    for c in claims:
        name = c.served.get("model")
        key = "(not reported)" if name is None else name
        models[key] = models.get(key, 0) + 1

    def total(name: str) -> int | None:
        values = [c.served.get(name) for c in claims]
        return sum(v for v in values if v is not None) if any(v is not None for v in values) else None

    contradictions: dict[str, int] = {}
    warnings: list[str] = []
    for check, what in CHECKS.items():
        hits = [c for c in claims if check in c.served.get("problems", {})]
        if hits:
            contradictions[check] = len(hits)
            example = hits[0]
            warnings.append(f"{len(hits)} of {len(claims)} responses {what} (prompt {example.prompt_id}: "
                            f"{example.served['problems'][check]})")
    first = claims[0].served if claims else {}
    return {"requested_model": first.get("requested_model"), "max_tokens": first.get("max_tokens"),
            "responses": len(claims),
            "models": models, "prompt_tokens": total("prompt_tokens"), "completion_tokens": total("completion_tokens"),
            "usage_reported": sum(c.served.get("completion_tokens") is not None for c in claims),
            "returned_tokens": total("returned_tokens"), "contradictions": contradictions, "warnings": warnings}


DRIFT_CHECKS = {  # drift name -> what it counts (a sequence's value: tokens, or 1 when it fails)
    "prompt_mismatch": "prompt ids the provider reported that differ from our rendering",
    "retokenize_mismatch": "returned ids that re-tokenizing the returned text does not give",
    "decode_mismatch": "returned ids that do not decode to the returned text",
    "round_trip_mismatch": "re-tokenized text that does not decode back to itself",
    "realigned": "re-tokenized positions re-split where the text allowed the reference's token, or edited to "
                 "agree with the provider's usage count (verinfer.auditing.alignment; left out of the verdict)",
    "count_mismatch": "re-tokenized outputs whose token count still disagrees with the provider's usage count",
    "unaligned": "tokens of such an output past where its alignment is known to hold (bytes its text lost, or its "
                 "first mismatch), left out of the verdict",
}


def summarize_drift(claims: list[Claim]) -> dict[str, Any]:
    """Counts of tokenization drift over an audit, separate from any model divergence."""
    out: dict[str, Any] = {"sequences": len(claims),
                           "ids_returned": sum(c.source == "returned" for c in claims),
                           "retokenized": sum(c.source == "retokenized" for c in claims)}
    for name in DRIFT_CHECKS:
        values = [len(v) if isinstance(v, list) else v for c in claims if (v := c.drift.get(name)) is not None]
        if values:
            out[name] = {"checked": len(values), "sequences": sum(v > 0 for v in values), "total": int(sum(values))}
    return out


def claim_traces(claims: Sequence[Claim], provider: str, model_id: str,
                 params: Callable[[int], SamplingParams]) -> list[Trace]:
    """Traces claiming the reference model and the audit's sampling parameters, plus the speculative
    decoding (draft, k and per-token modes) the provider reported, which the verifier replays."""
    return [Trace.of_output(f"{provider}/{c.prompt_id}", model_id, c.prompt_token_ids, c.output_token_ids,
                            params(c.index).with_(speculative=c.speculative) if c.speculative else params(c.index),
                            output_text=c.text, provider=provider,
                            meta={"token_source": c.source, "finish_reason": c.finish_reason},
                            spec_modes=c.spec_modes if c.speculative else None)
            for c in claims]
