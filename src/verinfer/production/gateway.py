"""``verinfer gateway``: an OpenAI-compatible reverse proxy that records what an engine serves.

Every request goes to the upstream engine (``verinfer.production.upstream``: the gateway's own
kept-alive HTTP/1.1 client) and its answer comes back unchanged: the status, the body (streams
forwarded piece by piece as they arrive, never buffered first), the headers but hop-by-hop ones.
``Authorization`` reaches the engine and is never recorded. The app is plain ASGI on uvicorn (no
framework layer on the hot path). Generation requests (``POST /v1/chat/completions`` and
``/v1/completions``) are changed only as ``verinfer.production.exchange.prepare`` says (a seed for
sampled requests without one, with ``assign_seeds``; ``return_token_ids``, whose ids are cut from the
answer unless the client asked for them) and handed, once answered with 200, to the recorder
(``verinfer.production.recorder``), which parses and writes them on its own thread. A stream is read
from the engine to its end by its handler whether or not the client is still there (uvicorn drops
what is sent to a client that left), so every answered stream is recorded or counted; one the engine
cuts off ends the client's stream with an error event (OpenAI's shape) and is recorded as
unverifiable. Generation request bodies are read up to ``--max-body-mb`` (413 beyond); other bodies
stream through. ``--workers``: several processes on one port, each with its own recorder, publishing
their counters for one ``/gateway/health`` (``Gateway.workers``).

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
import os
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator
from urllib.parse import urlsplit


from verinfer.files import running, write_atomic
from verinfer.production.access import authorized, unauthorized_body
from verinfer.production.logs import json_log
from verinfer.production.exchange import (ENDPOINTS, SEED_RANGE, EventSplitter, Exchange, Prepared, Recording,
                                          ends_done, prepare, stream_error_event, strip_ids, without_ids_request,
                                          writes_nulls)
from verinfer.production.recorder import FSYNC, POLICIES, Counters, Recorder
from verinfer.production.upstream import Response, Upstream, UpstreamError

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}
NOT_FORWARDED_BACK = HOP_BY_HOP | {"content-encoding", "date", "server"}  # uvicorn sets date and server
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
PROBE_AFTER_S = 5.0  # /gateway/health asks the engine itself when it has not been heard from for this long
PROBE_TIMEOUT_S = 3.0  # ... and waits this long for any answer (any HTTP status means it is reachable)


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
    workers: int = 1  # processes sharing the port (--workers), each with its own recorder
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
        if self.workers < 1:
            out.append(f"--workers must be at least 1, got {self.workers}")
        return out

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def base(self) -> str:
        return self.upstream.rstrip("/").removesuffix("/v1")


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


async def read_body(receive, cap: float = float("inf"), declared: bytes | None = None) -> bytes | None:
    """An ASGI request's body read whole (the gateway and the in-engine middleware parse and change a
    generation request); None beyond ``cap`` bytes (``declared``: its content-length, refused at once)."""
    if declared is not None and declared.isdigit() and int(declared) > cap:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _json(status: int, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return status, [(b"content-type", b"application/json")], json.dumps(body).encode()


def _error(status: int, message: str, code: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return _json(status, {"error": {"message": message, "type": "server_error", "param": None, "code": code}})


class Gateway:
    """The proxy's state: the upstream client, the recorder, the counters; ``handle`` is the ASGI
    request handler (plain ASGI on uvicorn: no framework layer on the hot path)."""

    def __init__(self, config: GatewayConfig, log: Callable[..., None] | None = None, write=None):
        problems = config.problems()
        if problems:
            raise ValueError(problems[0])
        self.config, self.log, self.counters = config, log or json_log(), Counters()
        self.ask_ids = config.token_ids
        self.null_ids: bool | None = None  # how the engine writes unasked fields (exchange.writes_nulls), once known
        self.upstream = Upstream(config.base, config.timeout_s)
        self.prefix = urlsplit(config.base).path.rstrip("/")
        kw = {"write": write} if write is not None else {}
        self.recorder = Recorder(config.traces, config.recording, self.log, self.counters, config.shard_records,
                                 config.shard_seconds, config.queue_size, config.on_full, fsync=config.fsync, **kw)
        self.probe = Upstream(config.base, PROBE_TIMEOUT_S)  # /gateway/health's own connection to the engine
        self.heard: tuple[float, str | None] = (-PROBE_AFTER_S, None)  # (monotonic time, error or None): the
        # engine's last answer or failure, on any request
        self.streams = 0  # streams being read from the engine now
        self.states = Path(config.traces) / ".gateway-workers"  # each worker's published state (``workers``)
        self.publisher: asyncio.Task | None = None

    async def start(self) -> None:
        if self.config.workers > 1:
            self.publisher = asyncio.ensure_future(self._publish())
        self.log("info", "gateway_started", upstream=self.config.base, traces=str(self.config.traces),
                 profile=self.config.recording.profile, assign_seeds=self.config.assign_seeds,
                 store_text=self.config.recording.store_text, model=self.config.recording.model)

    async def stop(self) -> None:
        if self.publisher is not None:
            self.publisher.cancel()
            (self.states / f"{os.getpid()}.json").unlink(missing_ok=True)
        await self.upstream.close()
        await self.probe.close()
        await asyncio.to_thread(self.recorder.close)
        self.log("info", "gateway_stopped", **self.counters.snapshot())

    def own_health(self) -> dict[str, Any]:
        """This process's state and counters."""
        r = self.recorder
        return {"status": "ok" if not r.stopped else "recording_stopped", "upstream": self.config.base,
                "traces": str(self.config.traces), "recording": not r.stopped, "recording_error": r.stopped,
                "resume_error": r.retry_error, "recorder_ready": r.ready, "upstream_error": self.heard[1],
                "token_ids_from_upstream": self.ask_ids, "pid": os.getpid(), **self.counters.snapshot()}

    def workers(self) -> list[dict[str, Any]]:
        """Every live worker's ``own_health`` (``--workers``: each publishes its own into
        ``<traces>/.gateway-workers/<pid>.json`` every second; this one's is read live)."""
        own = self.own_health()
        if self.config.workers == 1:
            return [own]
        out = [own]
        for path in sorted(self.states.glob("*.json")):
            pid = path.stem
            if not pid.isdigit() or int(pid) == own["pid"] or not running(int(pid)):
                continue
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(path.read_text()))
        return out

    def health(self) -> dict[str, Any]:
        """One answer for the whole gateway: the sums of every worker's counters, recording only if every
        worker records, and each worker's own state under ``workers`` when there are several."""
        workers = self.workers()
        if len(workers) == 1:
            return workers[0]
        total = {**workers[0], "pid": None}
        for name in Counters().snapshot():
            total[name] = sum(w.get(name, 0) for w in workers)
        stopped = [w for w in workers if not w["recording"]]
        total.update(status="recording_stopped" if stopped else "ok", recording=not stopped,
                     recording_error="; ".join(f"worker {w['pid']}: {w['recording_error']}" for w in stopped) or None,
                     recorder_ready=all(w["recorder_ready"] for w in workers), workers=workers)
        return total

    async def checked_health(self) -> tuple[int, dict[str, Any]]:
        """``/gateway/health``: 200 while every worker records and the engine answers, else 503 with the
        reasons (``status``: ``recording_stopped`` before ``upstream_unreachable``). The engine is asked
        (``GET /v1/models``, any status will do) when no request has heard from it for ``PROBE_AFTER_S``;
        a gateway still loading its recorder is ok (exchanges are journaled meanwhile)."""
        if time.monotonic() - self.heard[0] >= PROBE_AFTER_S:
            try:
                resp = await self.probe.request("GET", f"{self.prefix}/v1/models", [(b"accept-encoding", b"identity")])
                await resp.read()
                await resp.aclose()
                self.heard = (time.monotonic(), None)
            except UpstreamError as exc:
                self.heard = (time.monotonic(), str(exc))
        health = self.health()
        health["upstream_error"] = self.heard[1]
        reasons = [f"recording stopped: {health['recording_error']}"] if not health["recording"] else []
        if self.heard[1]:
            reasons.append(f"the upstream engine {self.config.base} cannot be reached: {self.heard[1]}")
        health["status"] = "ok" if not reasons else "recording_stopped" if not health["recording"] \
            else "upstream_unreachable"
        health["reasons"] = reasons
        return (503 if reasons else 200), health

    async def _publish(self) -> None:
        """Write this worker's state for its siblings' ``/gateway/health`` and ``/gateway/metrics``."""
        self.states.mkdir(parents=True, exist_ok=True)
        path = self.states / f"{os.getpid()}.json"
        while True:
            with contextlib.suppress(OSError):
                write_atomic(path, json.dumps(self.own_health()), durable=False)
            await asyncio.sleep(1.0)

    @staticmethod
    def _forwarded(scope: dict) -> list[tuple[bytes, bytes]]:
        out = [(k, v) for k, v in scope["headers"] if k.lower().decode("latin-1") not in HOP_BY_HOP]
        out.append((b"accept-encoding", b"identity"))  # bodies are recorded as the engine sent them
        return out

    @staticmethod
    def _back(resp: Response) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in resp.headers if k.lower().decode("latin-1") not in NOT_FORWARDED_BACK]

    async def _send(self, method: str, target: str, body: bytes | AsyncIterator[bytes],
                    headers: list[tuple[bytes, bytes]]) -> Response | None:
        try:
            resp = await self.upstream.request(method, target, headers, body)
            self.heard = (time.monotonic(), None)
            return resp
        except UpstreamError as exc:
            self.heard = (time.monotonic(), str(exc))
            self.counters.add(upstream_unreachable=1)
            self.log("error", "upstream_unreachable", url=f"{self.config.base}{target}", error=str(exc))
            return None

    async def _learn_style(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Ask the engine's ``/v1/models`` once how it writes fields it was not asked for."""
        try:
            resp = await self.upstream.request("GET", f"{self.prefix}/v1/models",
                                               [(k, v) for k, v in headers if k.lower() != b"content-type"])
            body = await resp.read()
            await resp.aclose()
            if resp.status == 200:
                self.null_ids = writes_nulls(json.loads(body))
                self.log("info", "upstream_style", unasked_fields="null" if self.null_ids else "omitted")
        except (UpstreamError, ValueError) as exc:  # unknown for now: removed, asked again next time
            self.log("warning", "upstream_style_unknown", error=f"{type(exc).__name__}: {exc}")

    @staticmethod
    async def _body_stream(receive) -> AsyncIterator[bytes]:
        """A request body passed through as it arrives, never held whole."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise UpstreamError("the client disconnected while sending its request")
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body"):
                return

    async def handle(self, scope: dict, receive, send) -> None:
        self.counters.add(requests=1)
        started = time.monotonic()
        method, path = scope["method"], scope["path"]
        query = scope.get("query_string", b"")
        target = self.prefix + (scope.get("raw_path") or path.encode()).decode("latin-1")
        if query:
            target += "?" + query.decode("latin-1")
        headers = self._forwarded(scope)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        chunked = any(k == b"transfer-encoding" for k, _ in scope["headers"])
        kind = ENDPOINTS.get(path.removeprefix("/v1/")) if method == "POST" and path.startswith("/v1/") else None
        prepared = None
        try:
            if kind is None:
                small = declared is not None and declared.isdigit() and int(declared) <= 2**20
                raw = await read_body(receive, self.config.max_body_bytes, declared) \
                    if small or not (declared or chunked) else \
                    self._body_stream(receive)
            else:
                raw = await read_body(receive, self.config.max_body_bytes, declared)
        except ClientGone:
            return
        if raw is None:
            return await self._reply(send, method, path, started, *_error(
                413, f"the request body is larger than the gateway's --max-body-mb ({self.config.max_body_mb:g} MiB)",
                "request_too_large"))
        if kind is not None:
            seed = secrets.randbelow(SEED_RANGE) if self.config.assign_seeds else None
            prepared = prepare(raw, self.ask_ids, seed, self.config.defaults)
            if prepared is not None and prepared.ids_added and self.null_ids is None:
                await self._learn_style(headers)
        requested_at = time.time()
        resp = await self._send(method, target, prepared.body if prepared else raw, headers)
        if resp is not None and prepared is not None and prepared.ids_added and 400 <= resp.status < 500:
            body = await self._read(resp)
            if body is not None and b"return_token_ids" in body:  # the engine refuses what we added: never the client's problem
                self.ask_ids = False
                self.counters.add(ids_refused=1)
                self.log("warning", "token_ids_refused", upstream=self.config.base, status=resp.status,
                         detail="retried without return_token_ids; outputs are re-tokenized from now on")
                prepared = without_ids_request(prepared)
                resp = await self._send(method, target, prepared.body, headers)
            elif body is not None:
                self.counters.add(upstream_errors=1)
                return await self._reply(send, method, path, started, resp.status, self._back(resp), body)
            else:
                resp = None
        if resp is None:
            return await self._reply(send, method, path, started, *_error(
                502, f"the upstream engine {self.config.base} cannot be reached", "upstream_unreachable"))
        if resp.status >= 400:
            self.counters.add(upstream_errors=1)
        if prepared is not None and prepared.request.get("stream") is True and resp.status == 200:
            return await self._stream(receive, send, resp, prepared, kind, requested_at, method, path, started)
        if prepared is None:  # not a generation: passed through as it arrives
            return await self._pass(send, resp, method, path, started)
        body = await self._read(resp)
        if body is None:
            return await self._reply(send, method, path, started, *_error(
                502, f"the upstream engine {self.config.base} broke off its answer", "upstream_unreachable"))
        if resp.status == 200 and len(body) > self.config.max_body_bytes:
            self.counters.add(exchanges=1, unrecordable=1)
            self.log("warning", "unrecordable", reason=f"the answer is larger than --max-body-mb "
                                                       f"({self.config.max_body_mb:g} MiB)")
        elif resp.status == 200:
            await self._submit(Exchange(uuid.uuid4().hex, kind, prepared.request, body, False, requested_at,
                                        time.time(), prepared.seed_assigned))
            if prepared.ids_added:
                body = strip_ids(body, bool(self.null_ids))
        return await self._reply(send, method, path, started, resp.status, self._back(resp), body)

    async def _read(self, resp: Response) -> bytes | None:
        """A whole answer, or None (counted and logged) when the engine breaks it off."""
        try:
            return await resp.read()
        except UpstreamError as exc:
            self.counters.add(upstream_unreachable=1)
            self.log("error", "upstream_broke_off", upstream=self.config.base, error=str(exc))
            return None
        finally:
            await resp.aclose()

    async def _reply(self, send, method: str, path: str, started: float, status: int,
                     headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        self._done(method, path, status, started)

    async def _pass(self, send, resp: Response, method: str, path: str, started: float) -> None:
        """Any other answer, piece by piece (a broken one ends the client's connection early)."""
        length = resp.header(b"content-length")
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": self._back(resp) + ([(b"content-length", length)] if length is not None else [])})
        try:
            async for piece in resp:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        except UpstreamError as exc:
            self.counters.add(upstream_unreachable=1)
            self.log("error", "upstream_broke_off", upstream=self.config.base, error=str(exc))
        finally:
            await resp.aclose()
        await send({"type": "http.response.body", "body": b""})
        self._done(method, path, resp.status, started)

    async def _stream(self, receive, send, resp: Response, prepared: Prepared, kind: str, requested_at: float,
                      method: str, path: str, started: float) -> None:
        """Forward the engine's events as they arrive (whole events when ids are cut out), keep a copy,
        and read the engine's stream to its end whether or not the client is still there (uvicorn
        drops what is sent to a client that left; REFERENCE.md section 9: the ``openai`` client closes
        at ``finish_reason``, often before the engine's ``[DONE]``). A stream that ends without
        ``[DONE]`` (the engine died) ends the client's with an error event in OpenAI's shape, and its
        choices are recorded as unverifiable with the reason. Bounded by ``--timeout`` per read and,
        for the copy, ``--max-body-mb``."""
        self.streams += 1
        left = asyncio.ensure_future(receive())  # completes with http.disconnect when the client leaves
        seen = bytearray()
        splitter = EventSplitter() if prepared.ids_added else None
        null, cut, kept = bool(self.null_ids), None, True
        await send({"type": "http.response.start", "status": 200, "headers": self._back(resp)})
        try:
            async for piece in resp:
                if kept and len(seen) + len(piece) <= self.config.max_body_bytes:
                    seen += piece
                elif kept:
                    kept, seen = False, bytearray()
                if left.done():
                    continue
                if splitter is not None:
                    piece = splitter.feed(piece)
                    if not piece:
                        continue
                    piece = strip_ids(piece, null)
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            if splitter is not None and not left.done() and (rest := splitter.flush()):
                await send({"type": "http.response.body", "body": strip_ids(rest, null), "more_body": True})
            if kept and not ends_done(seen):
                cut = "the engine closed the stream without 'data: [DONE]'"
        except UpstreamError as exc:
            cut = str(exc)
        finally:
            await resp.aclose()
            self.streams -= 1
            gone = left.done() and not left.cancelled() and left.result().get("type") == "http.disconnect"
            if not left.done():
                left.cancel()
            if gone:
                self.counters.add(clients_left=1)
            if cut:
                self.counters.add(streams_cut=1)
                self.log("error", "stream_cut", upstream=self.config.base, error=cut,
                         detail="the client got an error event; the choices are recorded as unverifiable")
            if not kept:
                self.counters.add(exchanges=1, unrecordable=1)
                self.log("warning", "unrecordable", reason=f"the stream is larger than --max-body-mb "
                                                           f"({self.config.max_body_mb:g} MiB)")
            else:
                await self._submit(Exchange(uuid.uuid4().hex, kind, prepared.request, bytes(seen), True,
                                            requested_at, time.time(), prepared.seed_assigned, cut))
        end = stream_error_event(f"the upstream engine {self.config.base} broke off its answer: {cut}") if cut else b""
        await send({"type": "http.response.body", "body": end})
        self._done(method, path, 200, started)

    async def _submit(self, ex: Exchange) -> None:
        if self.config.on_full == "block":
            await asyncio.to_thread(self.recorder.submit, ex)
        else:
            self.recorder.submit(ex)

    def _done(self, method: str, path: str, status: int, started: float) -> None:
        if self.config.access_log:
            self.log("info", "request", method=method, path=path, status=status,
                     ms=round((time.monotonic() - started) * 1000, 2))


def create_app(gateway: Gateway, token: str | None = None):
    """The gateway's ASGI app: ``/gateway/health``, ``/gateway/metrics`` (Prometheus), everything else
    proxied; the lifespan starts and stops the gateway (the open shard is written on shutdown). With
    ``token`` (``verinfer.production.access``) ``/gateway/metrics`` asks for it and ``/gateway/health``
    shows only its status (and its 200 or 503) without it; proxied requests carry the client's own
    ``Authorization`` to the engine, as ever."""

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await gateway.start()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await gateway.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in ("/gateway/health", "/gateway/metrics") and scope["method"] == "GET":
            return await _own_route(gateway, token, scope, send)
        await gateway.handle(scope, receive, send)

    app.gateway = gateway
    return app


async def _own_route(gateway: Gateway, token: str | None, scope: dict, send) -> None:
    """``/gateway/health`` and ``/gateway/metrics`` (``/metrics`` itself is the engine's: proxied)."""
    path, started = scope["path"], time.monotonic()
    allowed = token is None or authorized(
        next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None), token)
    if path == "/gateway/health":
        status, health = await gateway.checked_health()
        return await gateway._reply(send, "GET", path, started, *_json(status, health if allowed
                                                                       else {"status": health["status"]}))
    if not allowed:
        status, headers, body = _json(401, unauthorized_body("gateway"))
        return await gateway._reply(send, "GET", path, started, status,
                                    [*headers, (b"www-authenticate", b'Basic realm="verinfer gateway"')], body)
    from verinfer.production.metrics import exposition, gateway_metrics

    snapshots = {str(w["pid"]): {k: w.get(k, 0) for k in Counters().snapshot()} for w in gateway.workers()}
    body, content_type = exposition(lambda: gateway_metrics(snapshots))
    await gateway._reply(send, "GET", path, started, 200, [(b"content-type", content_type.encode())], body)


@contextlib.contextmanager
def gateway_in_thread(gateway: Gateway, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> Iterator[str]:
    """Serve ``gateway`` on a real socket in a background thread (tests, benchmarks); yields its base
    URL ending in ``/v1``. Leaving the block shuts it down as SIGTERM would (the open shard is written)."""
    from verinfer.production.exporter import asgi_in_thread
    from verinfer.sockets import base_url, bind

    sock = bind(host, port)
    url = base_url(sock)
    with asgi_in_thread(create_app(gateway, token), sock, lifespan="on"):
        yield url
