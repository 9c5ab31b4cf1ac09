"""The gateway's client for its one upstream engine: HTTP/1.1 with kept-alive connections, on asyncio
streams and httptools (the C parser uvicorn uses).

Why not httpx: on the gateway's hot path httpx's layers (auth and redirect handling, httpcore's pool
and h11 state machine, anyio streams) cost more CPU per proxied request than the engine's own
serving of it against a fast engine (``benchmarks/gateway_overhead.py``, RESULTS section 25); a
proxy to one origin needs none of them. What this client does, and nothing else: one origin
(``http://``, or ``https://`` with the system's certificates), a request line and headers written as given plus ``host`` and the body's
framing (``content-length`` for bytes, chunked for a stream), the response parsed by httptools
(content-length, chunked or read-to-close bodies), ``--timeout`` per connect and per read, idle
connections reused while the engine keeps them alive. A kept-alive connection the engine closed in
the meantime is retried once on a new one (nothing of the request was answered). Every failure is an
``UpstreamError`` naming what broke.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import AsyncIterator
from urllib.parse import urlsplit

import httptools

CHUNK = 65536
NO_BODY = {204, 304}


class UpstreamError(Exception):
    """The engine could not be reached, or broke off (reset, timed out, malformed answer)."""


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing for ``timeout`` seconds."""


class _Parsed:
    """httptools' callbacks for one response."""

    def __init__(self) -> None:
        self.parser = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.keep_alive = False  # read when the headers are in: llhttp resets it once the message is complete
        self.body: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class Response:
    """An engine's answer: ``status`` and ``headers`` at once, the body by ``read`` or by iteration
    (pieces as they arrive); ``aclose`` gives the connection back when the body was read to its end."""

    def __init__(self, pool: "Upstream", conn: _Connection, parser, parsed: _Parsed, head_only: bool):
        self.pool, self.conn, self.parser, self.parsed = pool, conn, parser, parsed
        self.status: int = parser.get_status_code()
        self.headers = parsed.headers
        self.keep_alive = parsed.keep_alive
        framed = any(n.lower() in (b"content-length", b"transfer-encoding") for n, _ in parsed.headers)
        self.complete = head_only or self.status in NO_BODY or 100 <= self.status < 200 or parsed.done
        self.to_close = not framed and not self.complete  # the body ends when the engine closes
        if head_only:
            self.keep_alive = False  # the parser would wait for a body a HEAD answer does not have

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n.lower() == name), None)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        parsed = self.parsed
        if parsed.body:
            pieces, parsed.body = parsed.body, []
            yield b"".join(pieces)
        while not self.complete:
            data = await self.pool.read(self.conn)
            if not data:
                if self.to_close:
                    self.complete = True
                    break
                raise UpstreamError("the engine closed the connection before the end of its answer")
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                raise UpstreamError(f"malformed answer from the engine: {exc}") from None
            self.complete = parsed.done
            if parsed.body:
                pieces, parsed.body = parsed.body, []
                yield b"".join(pieces)

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self])

    async def aclose(self) -> None:
        if self.conn is None:
            return
        conn, self.conn = self.conn, None
        if self.complete and self.keep_alive and not self.to_close:
            self.pool.release(conn)
        else:
            conn.close()


class Upstream:
    """Kept-alive connections to one origin (``base``: ``http://host:port``)."""

    def __init__(self, base: str, timeout: float, max_idle: int = 256):
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the upstream must be an http(s):// URL with a host, got {base!r}")
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = parts.netloc.rsplit("@", 1)[-1].encode()
        self.timeout, self.max_idle = timeout, max_idle
        self.idle: list[_Connection] = []

    async def read(self, conn: _Connection) -> bytes:
        """The next bytes from the engine, at most ``timeout`` seconds away (an engine that stalls
        longer has its connection cut: an ``UpstreamError``)."""
        loop = asyncio.get_running_loop()
        expired = []
        timer = loop.call_later(self.timeout, lambda: (expired.append(True), conn.writer.transport.abort()))
        try:
            return await conn.reader.read(CHUNK)
        except (OSError, asyncio.IncompleteReadError) as exc:
            if expired:
                raise UpstreamTimeout(f"no answer from the engine within {self.timeout:g} s") from None
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        finally:
            timer.cancel()
            if expired:
                raise UpstreamTimeout(f"no answer from the engine within {self.timeout:g} s")

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, ssl=self.tls),
                                                    self.timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(f"connecting to {self.host}:{self.port} took over {self.timeout:g} s") from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        return _Connection(reader, writer)

    def release(self, conn: _Connection) -> None:
        if len(self.idle) < self.max_idle and conn.usable():
            self.idle.append(conn)
        else:
            conn.close()

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: bytes | AsyncIterator[bytes] = b"") -> Response:
        """Send a request (``target``: path and query) and return its response once its headers are in."""
        head = [f"{method} {target} HTTP/1.1\r\n".encode(), b"host: ", self.host_header, b"\r\n"]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        streamed = not isinstance(body, (bytes, bytearray))
        head.append(b"transfer-encoding: chunked\r\n\r\n" if streamed else b"content-length: %d\r\n\r\n" % len(body))
        head = b"".join(head)
        while self.idle:
            conn = self.idle.pop()
            if not conn.usable():
                conn.close()
                continue
            try:
                return await self._exchange(conn, method, head, body, streamed)
            except _Unanswered:
                conn.close()
                if streamed:  # the body was consumed: it cannot be sent again
                    raise UpstreamError("the engine closed a kept-alive connection as the request was sent") from None
        try:
            return await self._exchange(await self._connect(), method, head, body, streamed)
        except _Unanswered as exc:
            raise UpstreamError(str(exc)) from None

    async def _exchange(self, conn: _Connection, method: str, head: bytes, body, streamed: bool) -> Response:
        try:
            if streamed:
                conn.writer.write(head)
                async for piece in body:
                    if piece:
                        conn.writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                conn.writer.write(b"0\r\n\r\n")
            else:
                conn.writer.write(head + body if len(body) < CHUNK else head)
                if len(body) >= CHUNK:
                    conn.writer.write(body)
            if conn.writer.transport.get_write_buffer_size() > CHUNK:
                await conn.writer.drain()
        except OSError as exc:
            conn.close()
            raise _Unanswered(f"the engine closed the connection: {exc}") from None
        parsed = _Parsed()
        parser = parsed.parser = httptools.HttpResponseParser(parsed)
        received = False
        while not parsed.headers_done:
            try:
                data = await self.read(conn)
            except UpstreamTimeout:
                conn.close()
                raise
            except UpstreamError:
                conn.close()
                if not received:
                    raise _Unanswered("the engine closed the connection before answering") from None
                raise
            if not data:
                conn.close()
                if not received:
                    raise _Unanswered("the engine closed the connection before answering")
                raise UpstreamError("the engine closed the connection inside its answer's headers")
            received = True
            try:
                parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                conn.close()
                raise UpstreamError("the engine switched protocols (not proxied)") from None
            except httptools.HttpParserError as exc:
                conn.close()
                raise UpstreamError(f"malformed answer from the engine: {exc}") from None
        return Response(self, conn, parser, parsed, method == "HEAD")

    async def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle = []


class _Unanswered(Exception):
    """Nothing of the request was answered (a kept-alive connection closed under it)."""
