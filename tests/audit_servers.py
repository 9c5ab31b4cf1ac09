"""Test helpers: run any ASGI app on a real loopback socket in a background thread."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import uvicorn

from verinfer.serve.runner import base_url, bind


@contextmanager
def asgi_in_thread(app, prefix: str = "/v1"):
    """Yield ``http://127.0.0.1:<port>`` + ``prefix`` while ``app`` serves on loopback."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        yield base_url(sock)[: -len("/v1")] + prefix
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
