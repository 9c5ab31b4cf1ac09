"""Test helpers: run any ASGI app on a real loopback socket in a background thread; start a real
engine's server (or the seed-rewriting proxy) as a process and wait until it answers."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import httpx
import pytest
import uvicorn

from verinfer.sockets import base_url, bind


@contextmanager
def asgi_in_thread(app, prefix: str = "/v1", port: int = 0):
    """Yield ``http://127.0.0.1:<port>`` + ``prefix`` while ``app`` serves on loopback."""
    sock = bind("127.0.0.1", port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 600  # a hang guard: a loaded machine may take long to start it
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                pytest.fail(f"the test server did not start (thread alive: {thread.is_alive()})")
            time.sleep(0.01)
        yield base_url(sock)[: -len("/v1")] + prefix
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's source port (Linux's default otherwise)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port() -> int:
    """A loopback port that is free now, for a server a test starts as a separate process.

    Chosen at random below the kernel's ephemeral range, never twice in one process. A port from
    ``bind(0)`` lies inside that range, where every outgoing connection of the parallel tests takes
    its source port, and one was taken between the check and the server's own bind ("Address already
    in use", seen in CI); below the range only another server could take it."""
    rng, high = random.SystemRandom(), _ephemeral_low()
    for _ in range(1000):
        port = rng.randrange(10000, high)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free loopback port found in [10000, {high})")


@contextmanager
def serving_process(argv: list[str], log: Path, url: str, env: dict | None = None, ready_s: float = 60):
    """Start ``argv`` (output to ``log``), wait until ``url`` answers 200, yield its pid; stop it afterwards
    (also used by ``benchmarks/gateway_overhead.py``)."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{' '.join(map(str, argv[:4]))} exited with {proc.returncode}: {log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"{' '.join(map(str, argv[:4]))} not ready after {ready_s} s: {log.read_text()[-3000:]}")
            time.sleep(1)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def openai_server(argv: Callable[[int], list[str]], log_dir: Path, env: dict | None = None, ready_s: float = 60):
    """An OpenAI-compatible server started by ``argv(port)`` on a free loopback port (output to
    ``log_dir/server.log``); yields its ``.../v1`` URL once ``/v1/models`` answers."""
    base = f"http://127.0.0.1:{(port := free_port())}"
    with serving_process(argv(port), log_dir / "server.log", f"{base}/v1/models", env, ready_s):
        yield f"{base}/v1"


@contextmanager
def seed_proxy(upstream: str, log_dir: Path, *options: str):
    """``engines/vllm_cpu/seed_proxy.py`` (every request's seed + 1, or what ``options`` say: ``--seed-offset
    0 --set top_k=40``) in front of ``upstream`` (``.../v1``); yields its own ``.../v1`` URL."""
    script = Path(__file__).resolve().parents[1] / "engines" / "vllm_cpu" / "seed_proxy.py"
    argv = lambda port: [sys.executable, str(script), "--upstream", upstream.removesuffix("/v1"),  # noqa: E731
                         "--port", str(port), *options]
    with openai_server(argv, log_dir) as url:
        yield url


def health(client: httpx.Client) -> dict:
    """``GET /health`` of the server ``client`` talks to (its base URL ends in ``/v1``)."""
    return client.get(client.base_url.join("/health")).json()


def until(client: httpx.Client, pred: Callable[[dict], bool], what: str, guard_s: float = 120) -> dict:
    """Poll ``/health`` until ``pred`` holds; ``guard_s`` only stops a broken server from hanging the run."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        h = health(client)
        if pred(h):
            return h
        time.sleep(0.02)
    raise AssertionError(f"server never reached: {what}; last /health: {h}")


def open_request(url: str, path: str, body: dict, headers: dict | None = None,
                 rcvbuf: int | None = None) -> socket.socket:
    """Send a request on a raw socket and return it unread (closing it is a client disconnect);
    ``rcvbuf`` sets the socket's receive buffer (a client that reads nothing fills it)."""
    import json

    u = httpx.URL(url)
    data = json.dumps(body).encode()
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((u.host, u.port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"POST {u.path}{path} HTTP/1.1\r\nHost: {u.host}\r\nContent-Type: application/json\r\n{extra}"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock
