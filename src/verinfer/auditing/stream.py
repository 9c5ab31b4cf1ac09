"""Streamed responses (``stream: true``) as the one response they stand for.

OpenAI-compatible servers stream server-sent events: ``data: {chunk}`` lines separated by blank
lines and ending with ``data: [DONE]``. A chat chunk's choices carry a ``delta`` (``role``,
``content``), a completion chunk's a ``text`` piece; either may carry ``logprobs`` for its tokens,
``token_ids`` (vLLM's ``return_token_ids``) and, on its last chunk, ``finish_reason``. The prompt's
token ids (chat: top level) and ``usage`` (a final chunk with empty choices, when the server sends
one) come once. ``assemble`` joins the pieces per choice index into the non-streamed shape, so
everything after the client (parsing, drift, verdicts) is the same for both.
"""

from __future__ import annotations

import json
from typing import Any

from verinfer.jsonl import json_object


class StreamError(ValueError):
    """A stream that cannot be read as OpenAI-style server-sent events; the message says why."""


def events(text: str, complete: bool = True) -> list[dict[str, Any]]:
    """The JSON chunks of an event stream, up to ``data: [DONE]`` (required unless ``complete`` is
    False: the chunks of a stream known to be cut off, whose last partial event is left out).

    All events are parsed by one ``json.loads`` of their concatenation (a recorder parses every
    stream it sees; one call per event costs several times more); anything that does not come out as
    exactly one object per event is parsed again event by event, which names the bad one."""
    datas, done = [], False
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(":") or not line.startswith("data:"):
            continue  # blank separators, comments, event/id/retry fields
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            break
        datas.append((n, data))
    try:
        chunks = json.loads("[" + ",".join(d for _, d in datas) + "]")
    except (ValueError, RecursionError):
        chunks = None
    if chunks is None or len(chunks) != len(datas) or not all(isinstance(c, dict) for c in chunks):
        chunks = []
        for n, data in datas:
            try:
                chunks.append(json_object(data, f"event on line {n} ({data[:80]!r})", StreamError))
            except StreamError:
                if complete:
                    raise
                break  # the cut fell inside this event
    for chunk in chunks:
        if "error" in chunk and not chunk.get("choices"):
            raise StreamError(f"the stream reported an error: {str(chunk['error'])[:200]}")
    if not done and complete:
        raise StreamError("the stream ended without 'data: [DONE]' (cut off?)")
    if not chunks:
        raise StreamError("the stream has no data events")
    return chunks


def _extend_logprobs(into: dict, piece: Any) -> None:
    if not isinstance(piece, dict):
        return
    for key, value in piece.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat or completion response from its stream chunks (see the module docstring)."""
    first = chunks[0]
    chat = str(first.get("object", "")).startswith("chat")
    choices: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {k: first[k] for k in ("id", "created", "model") if k in first}
    out["object"] = "chat.completion" if chat else "text_completion"
    for chunk in chunks:
        for key in ("prompt_token_ids", "usage"):
            if chunk.get(key) is not None:
                out[key] = chunk[key]
        for c in chunk.get("choices") or []:
            if not isinstance(c, dict) or not isinstance(c.get("index", 0), int):
                raise StreamError(f"a chunk's choice is malformed: {str(c)[:120]}")
            slot = choices.setdefault(c.get("index", 0), {"index": c.get("index", 0), "text": [], "token_ids": None,
                                                          "logprobs": None, "finish_reason": None, "extra": {}})
            delta = c.get("delta") if chat else c
            piece = (delta or {}).get("content" if chat else "text")
            if piece is not None:
                if not isinstance(piece, str):
                    raise StreamError(f"choice {slot['index']}: the text piece is a {type(piece).__name__}")
                slot["text"].append(piece)
            if isinstance(c.get("token_ids"), list):
                slot["token_ids"] = (slot["token_ids"] or []) + c["token_ids"]
            if c.get("logprobs") is not None:
                slot["logprobs"] = slot["logprobs"] or {}
                _extend_logprobs(slot["logprobs"], c["logprobs"])
            if c.get("finish_reason") is not None:
                slot["finish_reason"] = c["finish_reason"]
            for key in ("prompt_token_ids", "stop_reason", "verinfer_sampling", "verinfer_spec_modes"):
                if c.get(key) is not None:
                    slot["extra"][key] = c[key]
    if not choices:
        raise StreamError("the stream has no choices")
    out["choices"] = []
    for index in sorted(choices):
        s = choices[index]
        text = "".join(s["text"])
        choice: dict[str, Any] = {"index": index, **({"message": {"role": "assistant", "content": text}} if chat
                                                    else {"text": text}),
                                  "logprobs": s["logprobs"], "finish_reason": s["finish_reason"], **s["extra"]}
        if s["token_ids"] is not None:
            choice["token_ids"] = s["token_ids"]
        out["choices"].append(choice)
    return out
