"""Responses as OpenAI-style server-sent events (``stream: true``).

Live (``LiveChoice``, ``token_chunk``): each token is sent as soon as the scheduler has decoded it
(batching is unchanged), its text piece from vLLM's incremental detokenization (decode a window
of tokens with and without the newest; hold back an incomplete UTF-8 sequence), then the final
chunks once the request is finished. Requests whose text could still be cut or rewritten (stop
strings, echo) or that decode in verified blocks (speculative decoding) are sent once finished
(``stream_chunks``). Both shapes are the same as vLLM's: one
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
from typing import Any, AsyncIterator, Iterator

from verinfer.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from verinfer.serve.jobs import TokenLogprobs

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
    head = chunk_head(body)
    if chat:
        yield role_chunk(head, [c["index"] for c in body["choices"]], body.get("prompt_token_ids"))
    for choice, parts in zip(body["choices"], pieces):
        for k, piece in enumerate(parts):
            yield token_chunk(head, choice["index"], piece, _token_logprobs(choice["logprobs"], k, chat),
                              choice["token_ids"][k: k + 1] if "token_ids" in choice else None,
                              choice.get("prompt_token_ids") if k == 0 else None)
        yield {**head, "choices": [last_chunk(choice, chat, prompt_ids=not parts)]}
    if include_usage:
        yield {**head, "choices": [], "usage": body["usage"]}


def chunk_head(body: dict[str, Any]) -> dict[str, Any]:
    """The fields every chunk of ``body`` (a chat or completion response) repeats."""
    chat = body["object"].startswith("chat.completion")
    return {"id": body["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body["created"], "model": body["model"]}


def last_chunk(choice: dict[str, Any], chat: bool, prompt_ids: bool) -> dict[str, Any]:
    """A choice's closing chunk: finish reason and verinfer's fields (completions: the prompt's ids
    when no earlier chunk of the choice carried them)."""
    last: dict[str, Any] = {"index": choice["index"], "logprobs": None, "finish_reason": choice["finish_reason"],
                            "stop_reason": choice["stop_reason"], "verinfer_sampling": choice["verinfer_sampling"]}
    if chat:
        last["delta"] = {}
    else:
        last["text"] = ""
    if prompt_ids and not chat and "prompt_token_ids" in choice:
        last["prompt_token_ids"] = choice["prompt_token_ids"]
    for key in ("verinfer_commits", "verinfer_spec_modes"):
        if key in choice:
            last[key] = choice[key]
    return last


class LiveChoice:
    """One choice's text as its tokens arrive (vLLM's ``detokenize_incrementally``: decode the tokens
    from ``prefix_at`` with and without those from ``read_at``; the difference is new text unless it
    ends in an incomplete UTF-8 sequence). ``sent`` is the text sent so far."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_at = self.read_at = 0
        self.sent = ""
        self.offset = 0  # completions' text_offset: total length of the token strings so far

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def piece(self, token: int) -> str:
        """The text that ``token`` completes (possibly empty)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix_at:self.read_at])
        after = self._decode(self.tokens[self.prefix_at:])
        if len(after) <= len(before) or after.endswith(HELD):
            return ""
        self.prefix_at, self.read_at = self.read_at, len(self.tokens)
        self.sent += after[len(before):]
        return after[len(before):]

    def logprobs(self, text: TokenText, lp: TokenLogprobs | None, chat: bool) -> dict | None:
        """The logprobs field of this choice's next token chunk (completions: offsets run on)."""
        if lp is None:
            return None
        if chat:
            return chat_logprobs(text, [lp])
        out = completion_logprobs(text, [lp])
        out["text_offset"] = [self.offset]
        self.offset += len(out["tokens"][0])
        return out

    def rest(self, text: str) -> str:
        """What the finished ``text`` adds to what was sent (held-back bytes, decoding at the end)."""
        return text[len(self.sent):] if text.startswith(self.sent) else ""


def role_chunk(head: dict[str, Any], indices: list[int], prompt_ids: list[int] | None) -> dict[str, Any]:
    """A chat stream's first chunk: the assistant role for every choice (and the prompt's ids)."""
    first = {**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for j in indices]}
    if prompt_ids is not None:
        first["prompt_token_ids"] = prompt_ids
    return first


def token_chunk(head: dict[str, Any], index: int, piece: str, logprobs: dict | None,
                token_ids: list[int] | None, prompt_ids: list[int] | None) -> dict[str, Any]:
    """A chunk carrying text: one token's piece with its id and logprobs, or text alone (no ids);
    ``prompt_ids`` go on completions' first chunk of a choice."""
    chat = head["object"] == "chat.completion.chunk"
    c: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": None}
    if chat:
        c["delta"] = {"content": piece}
    else:
        c["text"] = piece
        if prompt_ids is not None:
            c["prompt_token_ids"] = prompt_ids
    if token_ids is not None:
        c["token_ids"] = token_ids
    return {**head, "choices": [c]}


def sse(chunks: Iterator[dict[str, Any]]) -> Iterator[str]:
    """Server-sent events: ``data: <json>`` per chunk, then ``data: [DONE]``."""
    for chunk in chunks:
        yield event(chunk)
    yield DONE


async def sse_live(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """``sse`` for chunks produced while the request decodes."""
    async for chunk in chunks:
        yield event(chunk)
    yield DONE


def event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
