"""A finished response as OpenAI-style server-sent events (``stream: true``).

The server decodes a request whole (batching is unchanged) and then sends it as vLLM does: one
``chat.completion.chunk`` / ``text_completion`` chunk per output token and choice, carrying the
token's text piece (``delta.content`` or ``text``), its ``token_ids`` entry and logprobs when asked
for, then a last chunk per choice with ``finish_reason`` (and ``verinfer_sampling``, and
``verinfer_spec_modes`` for a speculatively decoded choice: the whole string), an optional
usage chunk with no choices (``stream_options.include_usage``), and ``data: [DONE]``. Chat puts
``prompt_token_ids`` on the first chunk, completions on each choice's first chunk. Joining the
pieces gives back the non-streamed response (``verinfer.auditing.stream.assemble`` does).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

HELD = "\ufffd"  # an incomplete UTF-8 sequence decodes to this: wait for the next token


def text_pieces(tokenizer, tokens: list[int], text: str) -> list[str]:
    """Each token's share of ``text`` (the output after stop strings), joining back to ``text``."""
    pieces, sent = [], 0
    for k in range(1, len(tokens) + 1):
        prefix = tokenizer.decode(tokens[:k], skip_special_tokens=True)[: len(text)]
        if k < len(tokens) and prefix.endswith(HELD):
            pieces.append("")
            continue
        pieces.append(prefix[sent:] if prefix.startswith(text[:sent]) else "")
        sent = max(sent, len(prefix)) if prefix.startswith(text[:sent]) else sent
    if pieces:
        pieces[-1] += text[sent:]
    return pieces


def _token_logprobs(logprobs: dict | None, k: int, chat: bool) -> dict | None:
    if logprobs is None:
        return None
    if chat:
        return {"content": logprobs["content"][k: k + 1]}
    return {key: logprobs[key][k: k + 1] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def stream_chunks(body: dict[str, Any], pieces: list[list[str]], include_usage: bool) -> Iterator[dict[str, Any]]:
    """The chunks of ``body`` (a full chat or completion response); ``pieces[j]``: choice j's text pieces."""
    chat = body["object"] == "chat.completion"
    head = {"id": body["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body["created"], "model": body["model"]}
    if chat:
        first = {**head, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None} for c in body["choices"]]}
        if "prompt_token_ids" in body:
            first["prompt_token_ids"] = body["prompt_token_ids"]
        yield first
    for choice, parts in zip(body["choices"], pieces):
        for k, piece in enumerate(parts):
            c: dict[str, Any] = {"index": choice["index"], "logprobs": _token_logprobs(choice["logprobs"], k, chat),
                                 "finish_reason": None}
            if chat:
                c["delta"] = {"content": piece}
            else:
                c["text"] = piece
                if k == 0 and "prompt_token_ids" in choice:
                    c["prompt_token_ids"] = choice["prompt_token_ids"]
            if "token_ids" in choice:
                c["token_ids"] = choice["token_ids"][k: k + 1]
            yield {**head, "choices": [c]}
        last: dict[str, Any] = {"index": choice["index"], "logprobs": None, "finish_reason": choice["finish_reason"],
                                "stop_reason": choice["stop_reason"], "verinfer_sampling": choice["verinfer_sampling"]}
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        if not parts and not chat and "prompt_token_ids" in choice:
            last["prompt_token_ids"] = choice["prompt_token_ids"]
        for key in ("verinfer_commits", "verinfer_spec_modes"):
            if key in choice:
                last[key] = choice[key]
        yield {**head, "choices": [last]}
    if include_usage:
        yield {**head, "choices": [], "usage": body["usage"]}


def sse(chunks: Iterator[dict[str, Any]]) -> Iterator[str]:
    """Server-sent events: ``data: <json>`` per chunk, then ``data: [DONE]``."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"
