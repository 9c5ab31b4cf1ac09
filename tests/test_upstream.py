"""The gateway's upstream client (``verinfer.production.upstream``) against a raw asyncio server that
writes exactly the bytes each case needs: framing (content-length, chunked, read to close, HEAD,
204), kept-alive connections reused (counted by the server), a kept-alive connection the engine
closed retried once on a new one, an engine that stalls (timeout) or dies inside its answer
(``UpstreamError``), chunked request bodies, and https refused without a certificate it trusts."""

from __future__ import annotations

import asyncio

import pytest

from verinfer.production.upstream import Upstream, UpstreamError


class RawServer:
    """Answers each request with ``answer(request_bytes) -> bytes | None`` (None: close without a word);
    ``close_after`` closes the connection after that many answers. Counts connections."""

    def __init__(self, answer, close_after: int | None = None):
        self.answer, self.close_after, self.connections, self.requests = answer, close_after, 0, []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = b""
                lower = head.lower()
                if b"content-length:" in lower:
                    n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
                    body = await reader.readexactly(n)
                elif b"transfer-encoding: chunked" in lower:
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                        body += (await reader.readexactly(size + 2))[:-2]
                        if size == 0:
                            break
                self.requests.append(head + body)
                out = self.answer(head + body)
                if out is None:
                    break
                if asyncio.iscoroutine(out):
                    out = await out
                writer.write(out)
                await writer.drain()
                answered += 1
                if self.close_after is not None and answered >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def ok(body: bytes = b'{"ok":true}') -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def chunked(pieces: list[bytes], end: bool = True) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    out += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return out + (b"0\r\n\r\n" if end else b"")


def run(coro):
    return asyncio.run(coro)


def test_content_length_chunked_and_kept_alive_connections_are_reused():
    server_box = {}

    async def outer():
        answers = iter([ok(), chunked([b"data: 1\n\n", b"data: [DONE]\n\n"])] * 5)
        server = RawServer(lambda req: next(answers))
        async with server as base:
            up = Upstream(base, 5)
            for i in range(10):
                r = await up.request("POST", "/v1/x?a=1", [(b"content-type", b"application/json")], b'{"i":%d}' % i)
                body = await r.read()
                await r.aclose()
                assert r.status == 200
                assert body == (b'{"ok":true}' if i % 2 == 0 else b"data: 1\n\ndata: [DONE]\n\n")
            await up.close()
        server_box["s"] = server

    run(outer())
    server = server_box["s"]
    assert server.connections == 1 and len(server.requests) == 10
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x?a=1 HTTP/1.1\r\nhost: 127.0.0.1:") and first.endswith(b'\r\n\r\n{"i":0}')
    assert b"content-length: 7\r\n" in first


def test_a_kept_alive_connection_closed_by_the_engine_is_retried_once_on_a_new_one():
    async def main():
        server = RawServer(lambda req: ok(), close_after=1)  # the engine closes after each answer, unannounced
        async with server as base:
            up = Upstream(base, 5)
            for _ in range(3):
                r = await up.request("POST", "/v1/x", [], b"{}")
                assert await r.read() == b'{"ok":true}'
                await r.aclose()
                await asyncio.sleep(0.05)  # the close reaches us
        return server

    server = run(main())
    assert server.connections == 3 and len(server.requests) == 3  # never sent twice


def test_read_to_close_head_and_204_bodies():
    async def main():
        answers = {b"GET /close": b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it",
                   b"HEAD /head": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
                   b"GET /empty": b"HTTP/1.1 204 No Content\r\n\r\n"}
        async with RawServer(lambda req: answers[req.split(b" HTTP")[0]], close_after=1) as base:
            up = Upstream(base, 5)
            out = []
            for method, path in (("GET", "/close"), ("HEAD", "/head"), ("GET", "/empty")):
                r = await up.request(method, path, [])
                out.append((r.status, await r.read(), r.header(b"content-length")))
                await r.aclose()
            return out

    assert run(main()) == [(200, b"all of it", None), (200, b"", b"5"), (204, b"", None)]


def test_an_engine_that_dies_inside_its_answer_or_stalls_is_an_upstream_error():
    async def stall(req):
        await asyncio.sleep(5)
        return ok()

    async def main():
        async with RawServer(lambda req: chunked([b"data: 1\n\n"], end=False), close_after=1) as base:
            r = await Upstream(base, 5).request("POST", "/v1/x", [], b"{}")
            pieces = []
            with pytest.raises(UpstreamError, match="closed the connection before the end"):
                async for piece in r:
                    pieces.append(piece)
            assert pieces == [b"data: 1\n\n"]
        async with RawServer(stall) as base:
            with pytest.raises(UpstreamError, match="within 0.3 s"):
                await Upstream(base, 0.3).request("POST", "/v1/x", [], b"{}")
        async with RawServer(lambda req: b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\nshort", close_after=1) as base:
            r = await Upstream(base, 5).request("GET", "/", [])
            with pytest.raises(UpstreamError):
                await r.read()
        async with RawServer(lambda req: b"NOT HTTP AT ALL\r\n\r\n") as base:
            with pytest.raises(UpstreamError, match="malformed"):
                await Upstream(base, 5).request("GET", "/", [])
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match=f"cannot connect to 127.0.0.1:{port}"):
            await Upstream(f"http://127.0.0.1:{port}", 5).request("GET", "/", [])

    run(main())


def test_a_streamed_request_body_is_sent_chunked():
    async def body():
        for piece in (b'{"a":', b"", b"1}"):
            yield piece

    async def main():
        server = RawServer(lambda req: ok())
        async with server as base:
            r = await Upstream(base, 5).request("PUT", "/files", [], body())
            await r.read()
            await r.aclose()
        return server

    server = run(main())
    assert b"transfer-encoding: chunked\r\n" in server.requests[0] and server.requests[0].endswith(b'{"a":1}')


def test_only_http_and_https_upstreams():
    for bad in ("ftp://x", "localhost:8000", "http://"):
        with pytest.raises(ValueError, match="http"):
            Upstream(bad, 5)
