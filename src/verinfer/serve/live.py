"""Live streams: server-sent events sent while the scheduler decodes (``stream.LiveChoice``), closed
by the finished response's last chunks; and the bound on what a client that stops reading costs.

Failures before the first token answer with their own status; a failure after it ends the stream
with an error event. A client that leaves abandons the request's rows. A client that stays but does
not read is dropped once ``stream_buffer_events`` decoded chunks wait for it beyond the OS socket
buffers: its rows leave the batch at the next step and its connection is closed (``/health``
counts ``dropped_streams``), so a stalled reader never holds a slot for its whole length.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from verinfer.serve.logprobs import TokenText
from verinfer.serve.prompting import PromptIds
from verinfer.serve.protocol import APIError
from verinfer.serve.served import ServedModel
from verinfer.serve.stream import LiveChoice, last_chunk, role_chunk, sse_live, token_chunk


class DroppableStream(StreamingResponse):
    """A streaming response that gives up on its client when ``dropped`` is set: the send waiting
    for the client to read is cancelled and the connection closed (the ASGI server closes a
    connection whose response never completed)."""

    def __init__(self, content: AsyncIterator[str], dropped: asyncio.Event):
        super().__init__(content, media_type="text/event-stream")
        self.dropped = dropped

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        give_up = asyncio.ensure_future(self.dropped.wait())
        try:
            async for chunk in self.body_iterator:
                sending = asyncio.ensure_future(send({"type": "http.response.body", "body": chunk.encode("utf-8"),
                                                      "more_body": True}))
                await asyncio.wait({sending, give_up}, return_when=asyncio.FIRST_COMPLETED)
                if not sending.done():
                    sending.cancel()
                    return
                sending.result()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            give_up.cancel()


async def stream_live(served: ServedModel, req, build: Callable[[list], dict[str, Any]], head: dict[str, Any],
                      prompt: PromptIds, max_tokens: int, logprobs: int | None,
                      client: Request | None) -> DroppableStream:
    """The live stream of ``req`` (module docstring)."""
    loop = asyncio.get_running_loop()
    heard: asyncio.Queue = asyncio.Queue()
    dropped = asyncio.Event()
    limit = served.config.stream_buffer_events
    task: asyncio.Future | None = None

    def deliver(item) -> None:  # on the loop
        heard.put_nowait(item)
        if heard.qsize() > limit and not dropped.is_set():
            dropped.set()
            served.dropped_streams += 1
            print(f"verinfer serve: dropped a stream whose client stopped reading ({heard.qsize()} chunks unsent)",
                  file=sys.stderr)
            if task is not None and not task.done():
                task.cancel()  # ``ServedModel.wait`` abandons the rows

    def on_token(j: int, i: int, token: int, lp) -> None:  # the scheduler's thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
            loop.call_soon_threadsafe(deliver, (j, i, token, lp))

    task = asyncio.ensure_future(served.run(req, prompt, max_tokens, logprobs, None, client, on_token))
    nxt = asyncio.ensure_future(heard.get())
    await asyncio.wait({task, nxt}, return_when=asyncio.FIRST_COMPLETED)
    if not nxt.done() and task.exception() is not None:
        nxt.cancel()
        task.result()  # raises: the status of an ordinary failure, before any byte is sent
    chat = head["object"] == "chat.completion.chunk"
    text = TokenText(served.tokenizer, req.return_tokens_as_token_ids)
    usage = req.stream_options is not None and req.stream_options.include_usage

    async def chunks():
        nonlocal nxt
        choices = [LiveChoice(served.tokenizer) for _ in range(req.n)]
        try:
            if chat:
                yield role_chunk(head, list(range(req.n)), list(prompt.reported) if req.return_token_ids else None)
            while True:
                if not nxt.done() and heard.empty():
                    await asyncio.wait({task, nxt}, return_when=asyncio.FIRST_COMPLETED)
                if nxt.done():
                    j, i, token, lp = nxt.result()
                    nxt = asyncio.ensure_future(heard.get())
                elif not heard.empty():  # queued while the getter had not run yet
                    j, i, token, lp = heard.get_nowait()
                else:  # finished, and everything it decoded was heard
                    break
                live = choices[j]
                if i < len(live.tokens):  # decoded again alone after a failure: already sent
                    continue
                first_ids = list(prompt.reported) if not chat and i == 0 and req.return_token_ids else None
                yield token_chunk(head, j, live.piece(token), live.logprobs(text, lp, chat),
                                  [token] if req.return_token_ids else None, first_ids)
            try:
                body = build(task.result())
            except (APIError, asyncio.CancelledError) as exc:
                if isinstance(exc, APIError):
                    yield exc.body()
                return
            for choice, live in zip(body["choices"], choices):
                rest = live.rest(choice["message"]["content"] if chat else choice["text"])
                if rest:
                    yield token_chunk(head, choice["index"], rest, None, None, None)
                yield {**head, "choices": [last_chunk(choice, chat, prompt_ids=not live.tokens)]}
            if usage:
                yield {**head, "choices": [], "usage": body["usage"]}
        finally:
            nxt.cancel()
            if not task.done():
                task.cancel()  # the client left: ``ServedModel.wait`` abandons the rows

    return DroppableStream(sse_live(chunks()), dropped)
