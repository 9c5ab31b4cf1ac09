"""A long-running process's own HTTP endpoint, served on a thread beside its work: the monitor's
``/metrics`` (``verinfer monitor --metrics-port``) and ``/health``; ``asgi_in_thread`` also runs the
gateway in tests and benchmarks. Access follows ``verinfer.production.access`` (loopback unless a token
is given; with one, ``/metrics`` asks for it and ``/health`` shows anyone only its status).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any, Callable, Iterator

from verinfer.production.access import authorized, unauthorized_body


def exporter_app(scrape: Callable[[], tuple[bytes, str]], health: Callable[[], tuple[int, dict[str, Any]]],
                 token: str | None = None, service: str = "monitor"):
    """Plain ASGI: ``GET /metrics`` (``scrape``: body and content type) and ``GET /health`` (``health``:
    status code and JSON); anything else 404."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        allowed = token is None or authorized(
            next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None), token)
        path, headers = scope["path"], [(b"content-type", b"application/json")]
        if scope["method"] != "GET" or path not in ("/metrics", "/health"):
            status, body = 404, json.dumps({"error": {"message": f"{path}: not found (/metrics, /health)",
                                                      "type": "invalid_request_error", "code": "not_found"}}).encode()
        elif path == "/health":
            status, doc = health()
            body = json.dumps(doc if allowed else {"status": doc.get("status")}, default=str).encode()
        elif not allowed:
            status, body = 401, json.dumps(unauthorized_body(service)).encode()
            headers.append((b"www-authenticate", f'Basic realm="verinfer {service}"'.encode()))
        else:
            body, content_type = scrape()
            status, headers = 200, [(b"content-type", content_type.encode())]
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


@contextlib.contextmanager
def asgi_in_thread(app, sock: socket.socket, lifespan: str = "off", log_config: dict | None = None) -> Iterator[None]:
    """Serve ``app`` on the bound ``sock`` in a daemon thread (uvicorn) until the block ends, which
    shuts it down as SIGTERM would (graceful: a lifespan's shutdown runs)."""
    import uvicorn

    extra = {"log_config": log_config} if log_config is not None else {}
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan,
                                           timeout_graceful_shutdown=30, **extra))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="verinfer-http", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        yield
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


__all__ = ["asgi_in_thread", "exporter_app"]
