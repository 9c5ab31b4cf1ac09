"""Hardening, round two (issue #27, items 3-13 and the small parts of 18): each test reproduces one
defect found by a hostile provider, a malformed file or an unlucky user, and fails on the code
before its fix. Fake providers serve on real loopback HTTP (``tests.audit_servers.asgi_in_thread``)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.audit_servers import asgi_in_thread
from verinfer.auditing.client import Call, Endpoint, ProviderClient, ProviderError, RetryPolicy
from verinfer.auditing.secrets import REDACTED, redact_text
from verinfer.auditing.store import ResponseStore

GOOD = {"model": "m", "choices": [{"message": {"role": "assistant", "content": "hi"}, "token_ids": [1, 2]}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
CHUNK = {"object": "chat.completion.chunk", "model": "m",
         "choices": [{"index": 0, "delta": {"content": "tok "}, "token_ids": [7]}]}


def calls(n=1, stream=False):
    return [Call("chat/completions", {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}],
                                      **({"stream": True} if stream else {})},
                 {"kind": "generate", "prompt_id": f"p{i}"}) for i in range(n)]


def client(url, tmp_path, **policy):
    return ProviderClient(Endpoint("prov", url, "m", None), ResponseStore(tmp_path / "prov" / "responses.jsonl"),
                          concurrency=1, policy=RetryPolicy(**{"retries": 0, "backoff_s": 0.01, "timeout_s": 30,
                                                               **policy}))


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


# ---------------------------------------------------------------- 3, 4: query strings of provider URLs

def url_echo_app():
    """Answers at ``/v1/chat/completions`` only, echoing the URL it was called at (query included)."""
    app = FastAPI()
    app.state.urls = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        app.state.urls.append(str(request.url))
        return JSONResponse({**GOOD, "id": f"chatcmpl {request.url}", "system_fingerprint": request.url.query})

    return app


def test_a_base_url_with_a_query_string_is_joined_before_the_query():
    e = Endpoint("p", "https://h.example/openai/v1?api-version=2024-06&x=1", "m", None)
    assert e.url("chat/completions") == "https://h.example/openai/v1/chat/completions?api-version=2024-06&x=1"
    assert Endpoint("p", "http://h/v1/", "m", None).url("/completions") == "http://h/v1/completions"


def test_every_query_value_of_a_provider_url_stays_off_disk_and_out_of_messages(tmp_path):
    secret, short = "subscr-9d41c0e7b2aa", "eu-w3"
    app = url_echo_app()
    with asgi_in_thread(app, prefix="/v1") as url:
        c = client(f"{url}?subscription-key={secret}&region={short}", tmp_path)
        assert c.endpoint.display_url == f"{url}?subscription-key={REDACTED}&region={REDACTED}"
        c.fetch(calls())
    assert app.state.urls == [f"{url}/chat/completions?subscription-key={secret}&region={short}"]  # item 4 live
    stored = (tmp_path / "prov" / "responses.jsonl").read_text()
    assert secret not in stored and f"region={short}" not in stored and stored.count(REDACTED) == 4
    # wherever the URL turns up later: a report (HTML escapes '&'), an error, a bare echo of a long value
    assert redact_text(f"at {url}?a=1&amp;subscription-key={secret}&amp;region={short}") == \
        f"at {url}?a=1&amp;subscription-key={REDACTED}&amp;region={REDACTED}"
    assert redact_text(f"your key was {secret}.") == f"your key was {REDACTED}."
    port = dead_port()
    with pytest.raises(ProviderError) as exc:
        client(f"http://127.0.0.1:{port}/v1?subscription-key={secret}", tmp_path / "refused").fetch(calls())
    assert secret not in str(exc.value) and f"subscription-key={REDACTED}" in str(exc.value)


# ---------------------------------------------------------------- 5: deadline and size limit per request

def hostile_app():
    """Providers that never finish: an endless event stream, a huge JSON body, a comment every 0.2 s."""
    app = FastAPI()

    @app.post("/{mode}/v1/chat/completions")
    async def chat(mode: str):
        async def endless_events():
            while True:
                yield f"data: {json.dumps(CHUNK)}\n\n".encode()
                await asyncio.sleep(0.001)

        async def huge_json():
            yield b'{"model": "m", "choices": [{"message": {"content": "'
            for _ in range(2_000):  # 8 MB unless the client hangs up first
                yield b"a" * 4096
            yield b'"}}]}'

        async def comments():
            yield f"data: {json.dumps(CHUNK)}\n\n".encode()
            while True:
                await asyncio.sleep(0.2)
                yield b": keep-alive\n\n"

        body = {"endless": endless_events, "huge": huge_json, "comments": comments}[mode]()
        return StreamingResponse(body, media_type="application/json" if mode == "huge" else "text/event-stream")

    return app


@pytest.fixture(scope="module")
def hostile():
    with asgi_in_thread(hostile_app(), prefix="") as base:
        yield base


@pytest.mark.parametrize("mode, stream, policy, phrase", [
    ("endless", True, {"max_response_bytes": 50_000}, "larger than the limit of 50,000 bytes"),
    ("huge", False, {"max_response_bytes": 100_000}, "larger than the limit of 100,000 bytes"),
    ("comments", True, {"deadline_s": 1.0, "timeout_s": 30}, "no complete response within the deadline of 1 s"),
    ("endless", True, {"deadline_s": 1.0, "max_response_bytes": 2**40}, "no complete response within the deadline"),
])
def test_a_response_that_never_ends_is_cut_kept_as_rejected_and_stops_the_audit(hostile, tmp_path, mode, stream,
                                                                                policy, phrase):
    c = client(f"{hostile}/{mode}/v1", tmp_path, **policy)
    with pytest.raises(ProviderError) as exc:
        c.fetch(calls(stream=stream))
    message = str(exc.value)
    assert phrase in message and "rejected.jsonl" in message and "\n" not in message, message
    assert c.sent == 1  # not retried: asking again would pay for the same endless answer
    [kept] = ResponseStore(tmp_path / "prov" / "rejected.jsonl").records()
    assert kept["cut"] in message and kept["status"] == 200 and kept["response"]
    limit = policy.get("max_response_bytes")
    if limit is not None and limit < 2**40:  # the body read into memory stops at the limit
        assert kept["received_bytes"] == limit
    assert kept["response"].startswith("data: {" if stream else '{"model": "m"')
    assert not (tmp_path / "prov" / "responses.jsonl").exists()


def test_the_limits_are_checked_before_any_request():
    for policy, phrase in (({"deadline_s": 0}, "deadline must be > 0"),
                           ({"max_response_bytes": 0}, "max response size must be > 0"),
                           ({"retries": -1}, "retries must be >= 0")):
        with pytest.raises(ValueError, match=phrase):
            ProviderClient(Endpoint("p", "http://h/v1", "m", None), ResponseStore("unused.jsonl"),
                           policy=RetryPolicy(**policy))


# ---------------------------------------------------------------- 13: a failed audit leaves no empty -o

def test_an_audit_that_fails_before_storing_anything_leaves_no_directory(backend, tmp_path):
    from verinfer import api

    out = tmp_path / "audit"
    with pytest.raises(ValueError, match="concurrency must be a positive integer"):
        api.audit({"p": "http://127.0.0.1:9/v1"}, out=out, n=1, max_tokens=2, concurrency=0, backend=backend)
    assert not out.exists()
    port = dead_port()
    with pytest.raises(ProviderError, match="connection failed"):
        api.audit({"p": f"http://127.0.0.1:{port}/v1"}, out=out, n=1, max_tokens=2, retries=0, backend=backend)
    assert not out.exists()


def cli(*args):
    env = {k: v for k, v in os.environ.items() if k in ("HOME", "PATH", "VERINFER_CACHE", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", COLUMNS="200", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "verinfer.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_cli_audit_concurrency_zero_is_one_line_and_no_directory(tmp_path):
    out = tmp_path / "audit"
    proc = cli("audit", "run", "-p", "p=http://127.0.0.1:9/v1", "--concurrency", "0", "--n", "1", "-o", str(out))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "concurrency" in lines[0], proc.stderr[-2000:]
    assert not out.exists()
