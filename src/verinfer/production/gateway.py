"""``verinfer gateway``: an OpenAI-compatible reverse proxy that records what an engine serves.

Every request goes to the upstream engine (``httpx.AsyncClient``, connections kept alive) and its
answer comes back unchanged: the status, the body (streams forwarded piece by piece as they arrive,
never buffered first), the headers but hop-by-hop ones. ``Authorization`` reaches the engine and is
never recorded. Generation requests (``POST /v1/chat/completions`` and ``/v1/completions``) are
changed only as ``verinfer.production.exchange.prepare`` says (a seed for sampled requests without
one, with ``assign_seeds``; ``return_token_ids``, whose ids are cut from the answer unless the client
asked for them) and handed, once answered with 200, to the recorder
(``verinfer.production.recorder``), which parses and writes them on its own thread. A stream is
read from the engine by a task of its own (``Gateway._pump``) to its end, whether or not the client
is still there, so every answered stream is recorded or counted; one the engine cuts off ends the
client's stream with an error event (OpenAI's shape) and is recorded as unverifiable. Generation
request bodies are read up to ``--max-body-mb`` (413 beyond); other bodies stream through.

An engine that refuses the added ``return_token_ids`` (a 4xx whose body names it) gets the request
again without it, once, and the gateway stops asking that engine for ids (then the recorder
re-tokenizes); so no client ever sees an error the gateway caused. An engine that cannot be reached
answers 502 in OpenAI's error shape. ``GET /gateway/health`` reports the upstream, the recorder's
state and every counter (``recorder.Counters``); ``GET /gateway/metrics`` gives the counters to
Prometheus. Logs are JSON lines on stderr (``json_log``);
shutdown (SIGTERM or SIGINT, through uvicorn's lifespan) writes the open shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from verinfer.production.exchange import (ENDPOINTS, SEED_RANGE, EventSplitter, Exchange, Prepared, Recording,
                                          iso, prepare, strip_ids, without_ids_request, writes_nulls)
from verinfer.production.recorder import FSYNC, POLICIES, Counters, Recorder

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}
NOT_FORWARDED_BACK = HOP_BY_HOP | {"content-encoding", "date", "server"}  # uvicorn sets date and server
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclass(frozen=True)
class GatewayConfig:
    upstream: str  # the engine's base URL (a trailing /v1 is dropped; client paths are appended)
    traces: Path
    recording: Recording
    assign_seeds: bool = False
    token_ids: bool = True  # ask the engine for token ids (return_token_ids)
    defaults: dict[str, Any] = field(default_factory=dict)  # request fields filled in when absent
    shard_records: int = 1000
    shard_seconds: float = 60.0
    queue_size: int = 10000
    on_full: str = "drop"
    timeout_s: float = 600.0  # per upstream request (connect, read, write, pool)
    access_log: bool = False
    max_body_mb: float = 64.0  # a generation request larger is refused (413); a larger answer is not recorded
    fsync: str = "second"  # the recorder's policy (recorder.FSYNC)

    def problems(self) -> list[str]:
        out = []
        if not self.upstream.startswith(("http://", "https://")):
            out.append(f"--upstream must be an http(s) URL, got {self.upstream!r}")
        if self.on_full not in POLICIES:
            out.append(f"--on-full must be one of {', '.join(POLICIES)}, got {self.on_full!r}")
        if self.shard_records < 1:
            out.append(f"--shard-records must be at least 1, got {self.shard_records}")
        if not self.shard_seconds > 0:
            out.append(f"--shard-seconds must be > 0, got {self.shard_seconds}")
        if self.queue_size < 1:
            out.append(f"--queue-size must be at least 1, got {self.queue_size}")
        if not self.timeout_s > 0:
            out.append(f"--timeout must be > 0, got {self.timeout_s}")
        if not self.max_body_mb > 0:
            out.append(f"--max-body-mb must be > 0, got {self.max_body_mb}")
        if self.fsync not in FSYNC:
            out.append(f"--fsync must be one of {', '.join(FSYNC)}, got {self.fsync!r}")
        return out

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def base(self) -> str:
        return self.upstream.rstrip("/").removesuffix("/v1")


class _JsonLines(logging.Formatter):
    def format(self, r: logging.LogRecord) -> str:
        return json.dumps({"ts": iso(r.created), "level": r.levelname.lower(), "event": r.getMessage(),
                           **getattr(r, "fields", {})}, default=str)


def json_log(stream=None) -> Callable[..., None]:
    """``log(level, event, **fields)``: one JSON object per line on ``stream`` (stderr by default)."""
    logger = logging.getLogger("verinfer.gateway")
    if not logger.handlers:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(_JsonLines())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False

    def log(level: str, event: str, **fields: Any) -> None:
        logger.log(getattr(logging, level.upper()), event, extra={"fields": fields})
    return log


def _ends_done(seen: bytearray) -> bool:
    """Whether an event stream ends with ``data: [DONE]`` (its last event, before trailing blank lines)."""
    return seen[-64:].rstrip().endswith(b"[DONE]")


def _error_event(message: str) -> bytes:
    """An error in OpenAI's stream shape (its client raises ``APIError`` on it); the blank line first
    ends an event the cut may have left open."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "upstream_broke_off"}}
    return b"\n\ndata: " + json.dumps(body).encode() + b"\n\n"


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)


class Gateway:
    """The proxy's state: the upstream client, the recorder, the counters."""

    def __init__(self, config: GatewayConfig, log: Callable[..., None] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, write=None):
        problems = config.problems()
        if problems:
            raise ValueError(problems[0])
        self.config, self.log, self.counters = config, log or json_log(), Counters()
        self.ask_ids = config.token_ids
        self.null_ids: bool | None = None  # how the engine writes unasked fields (exchange.writes_nulls), once known
        self.transport = transport
        self.http: httpx.AsyncClient | None = None
        kw = {"write": write} if write is not None else {}
        self.recorder = Recorder(config.traces, config.recording, self.log, self.counters, config.shard_records,
                                 config.shard_seconds, config.queue_size, config.on_full, fsync=config.fsync, **kw)
        self.pumps: set[asyncio.Task] = set()  # streams being read to their end (``_pump``)

    async def start(self) -> None:
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.config.timeout_s), transport=self.transport,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.log("info", "gateway_started", upstream=self.config.base, traces=str(self.config.traces),
                 profile=self.config.recording.profile, assign_seeds=self.config.assign_seeds,
                 store_text=self.config.recording.store_text, model=self.config.recording.model)

    async def stop(self) -> None:
        if self.pumps:  # streams still being read: let them finish (within the upstream timeout) and record
            self.log("info", "draining_streams", streams=len(self.pumps))
            await asyncio.wait(set(self.pumps), timeout=self.config.timeout_s)
        if self.http is not None:
            await self.http.aclose()
        await asyncio.to_thread(self.recorder.close)
        self.log("info", "gateway_stopped", **self.counters.snapshot())

    def health(self) -> dict[str, Any]:
        return {"status": "ok" if not self.recorder.stopped else "recording_stopped", "upstream": self.config.base,
                "traces": str(self.config.traces), "recording": not self.recorder.stopped,
                "recording_error": self.recorder.stopped, "token_ids_from_upstream": self.ask_ids,
                **self.counters.snapshot()}

    @staticmethod
    def _headers(request: Request) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        out["accept-encoding"] = "identity"  # bodies are recorded as the engine sent them
        return out

    @staticmethod
    def _back(resp: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in resp.headers.items() if k.lower() not in NOT_FORWARDED_BACK}

    async def _send(self, method: str, url: str, body: bytes | AsyncIterator[bytes],
                    headers: dict[str, str]) -> httpx.Response | None:
        try:
            return await self.http.send(self.http.build_request(method, url, content=body, headers=headers),
                                        stream=True)
        except httpx.HTTPError as exc:
            self.counters.add(upstream_unreachable=1)
            self.log("error", "upstream_unreachable", url=url, error=f"{type(exc).__name__}: {exc}")
            return None

    async def _learn_style(self, headers: dict[str, str]) -> None:
        """Ask the engine's ``/v1/models`` once how it writes fields it was not asked for."""
        try:
            resp = await self.http.get(f"{self.config.base}/v1/models", headers=headers)
            if resp.status_code == 200:
                self.null_ids = writes_nulls(resp.json())
                self.log("info", "upstream_style", unasked_fields="null" if self.null_ids else "omitted")
        except (httpx.HTTPError, ValueError) as exc:  # unknown for now: removed, asked again next time
            self.log("warning", "upstream_style_unknown", error=f"{type(exc).__name__}: {exc}")

    async def _body(self, request: Request) -> bytes | None:
        """A generation request's body (parsed and changed, so read whole), None beyond ``--max-body-mb``."""
        cap, declared = self.config.max_body_bytes, request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def handle(self, request: Request, path: str) -> Response:
        self.counters.add(requests=1)
        started = time.monotonic()
        url = f"{self.config.base}/{path}" + (f"?{request.url.query}" if request.url.query else "")
        headers = self._headers(request)
        kind = ENDPOINTS.get(path.removeprefix("v1/")) if request.method == "POST" and path.startswith("v1/") else None
        prepared = None
        raw: bytes | AsyncIterator[bytes] = b""
        if kind is None and ("content-length" in request.headers or "transfer-encoding" in request.headers):
            raw = request.stream()  # passed through as it arrives, never held whole
            if "content-length" in request.headers:
                headers["content-length"] = request.headers["content-length"]
        elif kind is not None:
            raw = await self._body(request)
            if raw is None:
                return self._done(request, path, 413, started, _error(
                    413, f"the request body is larger than the gateway's --max-body-mb "
                         f"({self.config.max_body_mb:g} MiB)", "request_too_large"))
            seed = secrets.randbelow(SEED_RANGE) if self.config.assign_seeds else None
            prepared = prepare(raw, self.ask_ids, seed, self.config.defaults)
            if prepared is not None and prepared.ids_added and self.null_ids is None:
                await self._learn_style(headers)
        requested_at = time.time()
        resp = await self._send(request.method, url, prepared.body if prepared else raw, headers)
        if resp is not None and prepared is not None and prepared.ids_added and 400 <= resp.status_code < 500:
            body = await resp.aread()
            await resp.aclose()
            if b"return_token_ids" in body:  # the engine refuses the field we added: never the client's problem
                self.ask_ids = False
                self.counters.add(ids_refused=1)
                self.log("warning", "token_ids_refused", upstream=self.config.base, status=resp.status_code,
                         detail="retried without return_token_ids; outputs are re-tokenized from now on")
                prepared = without_ids_request(prepared)
                resp = await self._send(request.method, url, prepared.body, headers)
            else:
                self.counters.add(upstream_errors=1)
                return self._done(request, path, resp.status_code, started,
                                  Response(body, status_code=resp.status_code, headers=self._back(resp)))
        if resp is None:
            return self._done(request, path, 502, started,
                              _error(502, f"the upstream engine {self.config.base} cannot be reached", "upstream_unreachable"))
        if resp.status_code >= 400:
            self.counters.add(upstream_errors=1)
        record = prepared is not None and resp.status_code == 200
        if prepared is not None and prepared.request.get("stream") is True and resp.status_code == 200:
            return self._done(request, path, resp.status_code, started, StreamingResponse(
                self._stream(resp, prepared, kind, requested_at), status_code=resp.status_code,
                headers=self._back(resp)))
        try:
            body = await resp.aread()
        except httpx.HTTPError as exc:
            self.counters.add(upstream_unreachable=1)
            self.log("error", "upstream_broke_off", url=url, error=f"{type(exc).__name__}: {exc}")
            return _error(502, f"the upstream engine {self.config.base} broke off its answer", "upstream_unreachable")
        finally:
            await resp.aclose()
        if record and len(body) > self.config.max_body_bytes:
            self.counters.add(exchanges=1, unrecordable=1)
            self.log("warning", "unrecordable", reason=f"the answer is larger than --max-body-mb "
                                                       f"({self.config.max_body_mb:g} MiB)")
        elif record:
            await self._submit(Exchange(uuid.uuid4().hex, kind, prepared.request, body, False, requested_at,
                                        time.time(), prepared.seed_assigned))
            if prepared.ids_added:
                body = strip_ids(body, bool(self.null_ids))
        return self._done(request, path, resp.status_code, started,
                          Response(body, status_code=resp.status_code, headers=self._back(resp)))

    def _stream(self, resp: httpx.Response, prepared: Prepared, kind: str,
                 requested_at: float) -> AsyncIterator[bytes]:
        """The client's side of a stream: what ``_pump`` forwards. The pump is a task of its own, so a
        client that leaves (Starlette cancels this generator) does not stop the engine's answer from
        being read to its end and recorded (REFERENCE.md section 9: the ``openai`` client closes at
        ``finish_reason``, often before the engine closes the stream)."""
        out: asyncio.Queue[bytes | None] = asyncio.Queue()
        listening = [True]
        task = asyncio.create_task(self._pump(resp, prepared, kind, requested_at, out, listening))
        self.pumps.add(task)
        task.add_done_callback(self.pumps.discard)

        async def forward() -> AsyncIterator[bytes]:
            finished = False
            try:
                while (piece := await out.get()) is not None:
                    yield piece
                finished = True
            finally:
                if not finished:
                    listening[0] = False
                    self.counters.add(clients_left=1)
        return forward()

    async def _pump(self, resp: httpx.Response, prepared: Prepared, kind: str, requested_at: float,
                    out: asyncio.Queue, listening: list[bool]) -> None:
        """Read the engine's stream to its end (bounded by ``--timeout`` per read and ``--max-body-mb``),
        pass its events on (whole events when ids are cut out), keep a copy and record it. A stream that
        ends without ``[DONE]`` (the engine died) ends the client's with an error event in OpenAI's
        shape, and its choices are recorded as unverifiable with the reason."""
        seen = bytearray()
        splitter = EventSplitter() if prepared.ids_added else None
        null, cut, kept = bool(self.null_ids), None, True
        try:
            async for piece in resp.aiter_bytes():
                if kept and len(seen) + len(piece) <= self.config.max_body_bytes:
                    seen += piece
                elif kept:
                    kept = False
                    seen = bytearray()
                if not listening[0]:
                    continue
                if splitter is None:
                    out.put_nowait(piece)
                elif (whole := splitter.feed(piece)):
                    out.put_nowait(strip_ids(whole, null))
            if splitter is not None and listening[0] and (rest := splitter.flush()):
                out.put_nowait(strip_ids(rest, null))
            if kept and not _ends_done(seen):
                cut = "the engine closed the stream without 'data: [DONE]'"
        except httpx.HTTPError as exc:
            cut = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except asyncio.CancelledError:
            cut = "the gateway shut down before the engine finished"
            raise
        finally:
            await resp.aclose()
            if cut:
                self.counters.add(streams_cut=1)
                self.log("error", "stream_cut", upstream=self.config.base, error=cut,
                         detail="the client got an error event; the choices are recorded as unverifiable")
                out.put_nowait(_error_event(f"the upstream engine {self.config.base} broke off its answer: {cut}"))
            out.put_nowait(None)
            if not kept:
                self.counters.add(exchanges=1, unrecordable=1)
                self.log("warning", "unrecordable", reason=f"the stream is larger than --max-body-mb "
                                                           f"({self.config.max_body_bytes / 2**20:g} MiB)")
            else:
                await self._submit(Exchange(uuid.uuid4().hex, kind, prepared.request, bytes(seen), True,
                                            requested_at, time.time(), prepared.seed_assigned, cut))

    async def _submit(self, ex: Exchange) -> None:
        if self.config.on_full == "block":
            await asyncio.to_thread(self.recorder.submit, ex)
        else:
            self.recorder.submit(ex)

    def _done(self, request: Request, path: str, status: int, started: float, response: Response) -> Response:
        if self.config.access_log:
            self.log("info", "request", method=request.method, path=f"/{path}", status=status,
                     ms=round((time.monotonic() - started) * 1000, 2))
        return response


def create_app(gateway: Gateway) -> FastAPI:
    """The gateway's ASGI app: ``/gateway/health``, ``/gateway/metrics`` (Prometheus), everything else proxied."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="verinfer gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/gateway/health")
    async def health() -> dict:
        return gateway.health()

    @app.get("/gateway/metrics")
    async def metrics() -> Response:  # /metrics itself is the engine's (vLLM serves one): proxied
        from verinfer.production.metrics import exposition, gateway_metrics

        body, content_type = exposition(lambda: gateway_metrics(gateway.counters.snapshot()))
        return Response(body, media_type=content_type)

    @app.api_route("/{path:path}", methods=METHODS)
    async def proxy(request: Request, path: str) -> Response:
        return await gateway.handle(request, path)

    app.state.gateway = gateway
    return app


@contextlib.contextmanager
def gateway_in_thread(gateway: Gateway, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``gateway`` on a real socket in a background thread (tests, benchmarks); yields its base
    URL ending in ``/v1``. Leaving the block shuts it down as SIGTERM would (the open shard is written)."""
    import uvicorn

    from verinfer.sockets import base_url, bind

    sock = bind(host, port)
    server = uvicorn.Server(uvicorn.Config(create_app(gateway), log_level="warning", access_log=False,
                                          lifespan="on", timeout_graceful_shutdown=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="verinfer-gateway-http",
                              daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        yield base_url(sock)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
