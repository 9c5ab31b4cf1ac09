"""Run the provider server in a background thread on a real loopback socket (tests, demo, audits).

    from verinfer.serve import ServeConfig, serve_in_thread

    with serve_in_thread(backend, ServeConfig(misconfig=("w4",))) as base_url:
        httpx.post(f"{base_url}/completions", json={...})   # base_url == "http://127.0.0.1:<port>/v1"

The socket is bound before the thread starts (port 0 picks a free one), so the URL is valid as
soon as it is yielded; leaving the block stops uvicorn, drains the model's schedulers and joins them.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn

from verinfer.models.backend import Backend
from verinfer.serve.app import ServedModel, create_app
from verinfer.serve.config import ServeConfig
from verinfer.sockets import base_url, bind


@contextmanager
def serve_in_thread(backend: Backend, config: ServeConfig = ServeConfig(), startup_timeout: float = 120.0
                    ) -> Iterator[str]:
    """Serve ``backend`` as configured until the block exits; yields the base URL ending in ``/v1``.

    ``config.host``/``config.port`` choose the socket (default: 127.0.0.1 and a free port). The
    misconfigured model (if any) is built before the server accepts connections.
    """
    served = ServedModel(backend, config)
    app = create_app(backend, config, served)
    sock = bind(config.host, config.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                          timeout_graceful_shutdown=30))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # surfaced to the caller below
            errors.append(exc)

    thread = threading.Thread(target=run, name="verinfer-serve-http", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if errors or not thread.is_alive():
                raise RuntimeError(f"the server did not start: {errors[0] if errors else 'thread exited'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {startup_timeout:g} s")
            time.sleep(0.01)
        yield base_url(sock)
    finally:
        server.should_exit = True
        thread.join(60)
        for s in served.schedulers:
            s.close()
        sock.close()
