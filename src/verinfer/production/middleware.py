"""The recorder inside the engine: an ASGI middleware for vLLM's OpenAI server, no proxy hop at all.

    VERINFER_TRACES=traffic/ vllm serve MODEL --middleware verinfer.production.middleware.RecordingMiddleware

vLLM adds a middleware class given by import path with ``app.add_middleware`` (``--middleware``,
read in vLLM 0.32's ``entrypoints/launchers/cli_args.py``); it runs in the engine's API-server
process and sees every request and response as ASGI messages. This one records exactly what the
gateway (``verinfer.production.gateway``) records, with the same pieces: ``exchange.prepare`` (a seed
for sampled requests without one when asked, ``return_token_ids`` so the engine's own ids are kept),
``exchange.strip_ids`` (the ids the client did not ask for are cut out, so clients see what they
would see without it; vLLM writes unasked fields as ``null``), and the gateway's ``Recorder`` (write-
ahead file, rotating shards, unverifiable choices apart, counters). A stream that ends without
``[DONE]`` (the client left and vLLM aborted the request, or the engine failed) is recorded as
unverifiable with the reason.

Configuration is by environment, since vLLM constructs the class with the app alone:
``VERINFER_TRACES`` (required: the shard directory), ``VERINFER_PROFILE`` (default ``vllm``; the
CPU build: ``vllm-cpu``), ``VERINFER_PROVIDER`` (default ``vllm``), ``VERINFER_MODEL`` (the claimed
model id; default the id vLLM reports), ``VERINFER_ASSIGN_SEEDS`` (``1``: seed sampled requests that
have none), ``VERINFER_STORE_TEXT`` (``0``: token ids only), ``VERINFER_SHARD_RECORDS`` (1000),
``VERINFER_SHARD_SECONDS`` (60), ``VERINFER_FSYNC`` (``second``). Each API-server process has its own
recorder (names carry the pid); its counters are logged at exit.
"""

from __future__ import annotations

import atexit
import os
import secrets
import time
import uuid
from pathlib import Path

from verinfer.production.exchange import (ENDPOINTS, SEED_RANGE, EventSplitter, Exchange, Recording, ends_done,
                                          prepare, strip_ids)
from verinfer.production.gateway import ClientGone, read_body
from verinfer.production.logs import json_log
from verinfer.production.recorder import Counters, Recorder

ENV = "VERINFER_"


_log = json_log()  # JSON lines on stderr, as the gateway logs (vLLM's own log stays its own)


def recorder_from_env(env: dict[str, str] | None = None) -> Recorder:
    """The recorder the environment describes (module docstring); a ValueError names what is wrong."""
    env = os.environ if env is None else env
    traces = env.get(f"{ENV}TRACES")
    if not traces:
        raise ValueError(f"{ENV}TRACES is not set: the directory the in-engine recorder writes shards into")
    recording = Recording(env.get(f"{ENV}PROVIDER", "vllm"), env.get(f"{ENV}PROFILE", "vllm"),
                          env.get(f"{ENV}MODEL") or None, store_text=env.get(f"{ENV}STORE_TEXT", "1") != "0")
    return Recorder(Path(traces), recording, _log, Counters(), int(env.get(f"{ENV}SHARD_RECORDS", "1000")),
                    float(env.get(f"{ENV}SHARD_SECONDS", "60")), fsync=env.get(f"{ENV}FSYNC", "second"))


class RecordingMiddleware:
    """``--middleware verinfer.production.middleware.RecordingMiddleware`` (module docstring)."""

    def __init__(self, app, recorder: Recorder | None = None, assign_seeds: bool | None = None):
        self.app = app
        self.recorder = recorder or recorder_from_env()
        self.assign_seeds = os.environ.get(f"{ENV}ASSIGN_SEEDS") == "1" if assign_seeds is None else assign_seeds
        if recorder is None:
            atexit.register(self.close)

    def close(self) -> None:
        self.recorder.close()
        _log("info", "recorder_stopped", **self.recorder.counters.snapshot())

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        kind = ENDPOINTS.get(path.removeprefix("/v1/")) if scope.get("method") == "POST" and \
            path.startswith("/v1/") else None
        if kind is None:
            return await self.app(scope, receive, send)
        try:
            raw = await read_body(receive)
        except ClientGone:
            return  # the client left before its request was whole
        seed = secrets.randbelow(SEED_RANGE) if self.assign_seeds else None
        prepared = prepare(raw, True, seed)
        if prepared is None:  # not a JSON object: the engine answers it
            return await self.app(scope, _replay(raw, receive), send)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": headers + [(b"content-length", str(len(prepared.body)).encode())]}
        requested_at, stream = time.time(), prepared.request.get("stream") is True
        seen, status, start = bytearray(), [0], []
        splitter = EventSplitter() if stream and prepared.ids_added else None

        async def watch(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if stream:
                    return await send(message)
                start.append(message)  # held: the body's length changes when ids are cut out
                return None
            if message["type"] != "http.response.body":
                return await send(message)
            body, more = message.get("body", b""), message.get("more_body", False)
            seen.extend(body)
            strip = prepared.ids_added and status[0] == 200
            if stream:
                if splitter is not None and strip:
                    body = strip_ids(splitter.feed(body) + (b"" if more else splitter.flush()), True)
                await send({**message, "body": body})
            elif not more:  # a plain answer is sent whole, its length as cut
                body = strip_ids(bytes(seen), True) if strip else bytes(seen)
                head = start.pop()
                await send({**head, "headers": [(k, v) for k, v in head["headers"] if k != b"content-length"] +
                            [(b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            if not more:
                self._done(prepared, kind, bytes(seen), stream, status[0], requested_at)
                status[0] = -1  # recorded

        try:
            await self.app(scope, _replay(prepared.body, receive), watch)
        finally:
            if status[0] == 200:  # the app stopped before the end (the client left, or it failed)
                self._done(prepared, kind, bytes(seen), stream, 200, requested_at, cut="the response ended early")

    def _done(self, prepared, kind: str, body: bytes, stream: bool, status: int, requested_at: float,
              cut: str | None = None) -> None:
        if status != 200:
            return
        if stream and cut is None and not ends_done(body):
            cut = "the engine closed the stream without 'data: [DONE]'"
        if cut:
            self.recorder.counters.add(streams_cut=1)
        self.recorder.submit(Exchange(uuid.uuid4().hex, kind, prepared.request, body, stream, requested_at,
                                      time.time(), prepared.seed_assigned, cut))


def _replay(body: bytes, receive):
    """A ``receive`` that gives the (changed) body once, then whatever the client sends (disconnect)."""
    sent = [False]

    async def replay():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


__all__ = ["RecordingMiddleware", "recorder_from_env"]
