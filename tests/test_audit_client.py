"""The audit's HTTP client over real loopback HTTP: retries, Retry-After, timeouts, malformed
responses, persistence before use, resuming without repeated requests, API keys kept off disk."""

import json
import socket
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tests.audit_servers import asgi_in_thread
from verinfer.auditing.client import Call, Endpoint, ProviderClient, ProviderError, RetryPolicy, retry_after_seconds
from verinfer.auditing.store import ResponseStore, request_key
from verinfer.stats.verdict import holm

GOOD = {"choices": [{"message": {"role": "assistant", "content": "hi"}, "token_ids": [1, 2]}]}


def flaky_app(script: list):
    """Answers each POST with the next scripted (status, body, headers), then GOOD forever; counts calls."""
    app = FastAPI()
    app.state.calls = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        app.state.calls.append({"body": await request.json(), "auth": request.headers.get("authorization")})
        if not script:
            return JSONResponse(GOOD)
        status, body, headers = script.pop(0)
        if status == "sleep":
            import asyncio

            await asyncio.sleep(body)
            return JSONResponse(GOOD)
        if isinstance(body, str):
            return PlainTextResponse(body, status_code=status, headers=headers)
        return JSONResponse(body, status_code=status, headers=headers)

    return app


def calls(n=3):
    return [Call("chat/completions", {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]},
                 {"kind": "generate", "prompt_id": f"p{i}"}) for i in range(n)]


def client(url, tmp_path, concurrency=2, **policy):
    store = ResponseStore(tmp_path / "prov" / "responses.jsonl")
    policy = {"retries": 3, "backoff_s": 0.01, "timeout_s": 5.0, **policy}
    return ProviderClient(Endpoint("prov", url, "m", "VERINFER_TEST_KEY"), store, concurrency=concurrency,
                          policy=RetryPolicy(**policy))


def test_retries_5xx_and_429_and_honours_retry_after(tmp_path):
    app = flaky_app([(503, {"error": {"message": "overloaded"}}, {}), (429, {"error": "slow down"}, {"Retry-After": "1"})])
    with asgi_in_thread(app) as url:
        c = client(url, tmp_path)
        started = time.monotonic()
        records = c.fetch(calls(1))
        assert time.monotonic() - started >= 1.0  # waited as long as Retry-After said
    assert records[0]["response"] == GOOD and records[0]["attempts"] == 3
    assert len(app.state.calls) == 3 and c.sent == 3


def test_client_errors_are_not_retried_and_name_the_provider(tmp_path):
    app = flaky_app([(400, {"error": {"message": "unknown field 'return_token_ids'"}}, {})])
    with asgi_in_thread(app) as url:
        with pytest.raises(ProviderError) as exc:
            client(url, tmp_path).fetch(calls(1))
    text = str(exc.value)
    assert "provider 'prov'" in text and "HTTP 400" in text and "unknown field 'return_token_ids'" in text
    assert "\n" not in text and len(app.state.calls) == 1


@pytest.mark.parametrize("body, fragment", [
    ("<html>bad gateway</html>", "the response is not JSON"),
    ({"id": "x", "object": "chat.completion"}, "field 'choices' is missing"),
    ([1, 2, 3], "expected an object"),
])
def test_malformed_responses_are_kept_and_reported(tmp_path, body, fragment):
    # the first two requests succeed, the third gets garbage: the good ones stay stored
    app = flaky_app([])
    with asgi_in_thread(app) as url:
        c = client(url, tmp_path, concurrency=1)
        c.fetch(calls(2))
        app2 = flaky_app([(200, body, {})])
        with asgi_in_thread(app2) as url2:
            c2 = client(url2, tmp_path)
            with pytest.raises(ProviderError) as exc:
                c2.fetch(calls(3))
    assert fragment in str(exc.value) and "rejected.jsonl" in str(exc.value)
    assert len(ResponseStore(tmp_path / "prov" / "responses.jsonl")) == 2
    rejected = [json.loads(line) for line in (tmp_path / "prov" / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == 1 and rejected[0]["request"]["messages"][0]["content"] == "q2"


def test_timeouts_retry_then_fail_clearly_keeping_what_arrived(tmp_path):
    app = flaky_app([("sleep", 3.0, {}), ("sleep", 3.0, {})])
    with asgi_in_thread(app) as url:
        c = client(url, tmp_path, concurrency=1, retries=1, timeout_s=0.3)
        with pytest.raises(ProviderError) as exc:
            c.fetch(calls(1))
    assert "timed out after 0.3 s" in str(exc.value) and "failed after 2 attempt(s)" in str(exc.value)


def test_unreachable_endpoint(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(ProviderError) as exc:
        client(f"http://127.0.0.1:{port}/v1", tmp_path, retries=1).fetch(calls(1))
    assert "connection failed" in str(exc.value) and f"127.0.0.1:{port}" in str(exc.value)


def test_resume_sends_only_missing_requests_and_keeps_the_key_off_disk(tmp_path, monkeypatch):
    secret = "sk-test-" + "x" * 20
    monkeypatch.setenv("VERINFER_TEST_KEY", secret)
    app = flaky_app([])
    with asgi_in_thread(app) as url:
        client(url, tmp_path).fetch(calls(2))
        assert len(app.state.calls) == 2
        again = client(url, tmp_path)
        records = again.fetch(calls(5))
    assert len(app.state.calls) == 5 and again.sent == 3  # only the three new ones
    assert [r["prompt_id"] for r in records] == [f"p{i}" for i in range(5)]
    assert all(c["auth"] == f"Bearer {secret}" for c in app.state.calls)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text()


def test_store_survives_a_write_cut_off_mid_line(tmp_path):
    store = ResponseStore(tmp_path / "r.jsonl")
    store.append("k1", "p", {"a": 1}, GOOD)
    with open(tmp_path / "r.jsonl", "ab") as fh:
        fh.write(b'{"format": "verinfer.audit.response/1", "key": "k2", "resp')  # killed mid-write
    again = ResponseStore(tmp_path / "r.jsonl")
    assert "k1" in again and "k2" not in again and again.damaged_lines == 1
    again.append("k2", "p", {"a": 2}, GOOD)
    third = ResponseStore(tmp_path / "r.jsonl")
    assert "k1" in third and "k2" in third and third.damaged_lines == 1


def test_request_key_is_stable_and_content_addressed():
    assert request_key("chat/completions", {"a": 1, "b": [1, 2]}) == request_key("chat/completions", {"b": [1, 2], "a": 1})
    assert request_key("chat/completions", {"a": 1}) != request_key("completions", {"a": 1})
    assert request_key("completions", {"seed": 1}) != request_key("completions", {"seed": 2})


def test_retry_after_parsing():
    assert retry_after_seconds("2") == 2.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    before = time.time()
    target = int(before) + 30  # an HTTP date has whole seconds
    seconds = retry_after_seconds(time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(target)))
    assert target - time.time() <= seconds <= target - before  # bounds that hold however long the call took


def test_holm_adjustment():
    # textbook example: p = (0.01, 0.04, 0.03, 0.005) -> (0.03, 0.06, 0.06, 0.02)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5]) == [0.5] and max(holm([0.9, 0.8])) <= 1.0


def test_pacer_halves_once_per_wave_and_raises_after_a_limits_worth_of_answers_in_time():
    from verinfer.auditing.pacing import Pacer, pacing_warning

    now = [0.0]
    said = []
    p = Pacer(8, slow_s=1.0, on_change=said.append, clock=lambda: now[0])
    wave = 0.0  # eight requests sent before anything went wrong
    now[0] = 5.0
    for _ in range(8):  # they all time out: one decrease, not eight
        p.failed(wave, "time-outs")
    assert p.limit == 4 and p.decreases == 1 and p.reasons == {"time-outs": 1}
    now[0] = 6.0
    p.answered(5.5, 2.0)  # sent after the decrease and still slow: halves again
    assert p.limit == 2 and said == ["concurrency lowered to 4 (time-outs)",
                                     "concurrency lowered to 2 (answers slower than 1 s)"]
    p.answered(6.5, 0.1)  # one in time at limit 2: not yet
    assert p.limit == 2
    p.failed(6.2, "HTTP 503")  # sent after the last decrease: counts
    assert p.limit == 1 and p.lowest == 1
    p.failed(7.0, "HTTP 503")  # at one request in flight it cannot go lower, but it is counted
    assert p.limit == 1 and p.reasons == {"time-outs": 1, "answers slower than 1 s": 1, "HTTP 503": 2}
    for limit in (2, 3):  # additive increase: after `limit` answers in time
        for _ in range(limit - 1):
            p.answered(9.0, 0.1)
        assert p.limit == limit
    summary = p.summary()
    assert summary == {"asked": 8, "lowest": 1, "final": 3, "decreases": 3, "reasons": p.reasons}
    assert "concurrency was lowered to 1 and ended at 3" in pacing_warning(summary)
    assert pacing_warning(Pacer(4, 1.0).summary()) is None
    with pytest.raises(ValueError):
        Pacer(0, 1.0)


def queue_app(service_s: float):
    """A server that generates one answer at a time (``service_s`` each), as a small engine does: requests
    wait in its queue, and one the client gave up on is generated all the same."""
    import asyncio

    app, lock = FastAPI(), asyncio.Lock()
    app.state.generated = 0

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.json()
        async with lock:
            await asyncio.sleep(service_s)
            app.state.generated += 1
        return JSONResponse(GOOD)

    return app


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_server_slower_than_the_concurrency_asked_gets_fewer_requests_in_flight(tmp_path, adaptive, monkeypatch):
    """Issue #42 item 4: at ``--concurrency 8`` a server that answers one request at a time made
    requests wait past the timeout, and each one timed out was generated again. Adapted, the client
    lowers its concurrency and every request is answered; a fixed concurrency (the pacer's decrease
    switched off: the old client) exhausts its retries on the same server."""
    from verinfer.auditing import pacing

    if not adaptive:
        monkeypatch.setattr(pacing.Pacer, "failed", lambda self, sent, reason: None)
        monkeypatch.setattr(pacing.Pacer, "answered", lambda self, sent, elapsed_s: None)
    app = queue_app(0.2)
    said = []
    with asgi_in_thread(app) as url:
        c = client(url, tmp_path / str(adaptive), concurrency=8, retries=2, timeout_s=0.7)
        c.on_retry = said.append
        c.pacer.on_change = said.append
        if adaptive:
            records = c.fetch(calls(12))
            assert all(r["response"] == GOOD for r in records)
            summary = c.pacer.summary()
            print(f"\n{c.sent} attempts for 12 requests; {summary}")
            # it settles where the server answers within half the timeout: 0.2 s each, so at most 2 in flight
            assert summary["decreases"] >= 1 and summary["final"] <= 2
            assert c.sent < 12 * 3  # fewer than the retries allow: the fixed client below spends them all
            assert any("concurrency lowered to 4" in s for s in said)
        else:
            with pytest.raises(ProviderError, match="timed out"):
                c.fetch(calls(12))


def test_one_client_fetches_again_in_a_new_event_loop(tmp_path):
    """Each ``fetch`` runs its own event loop; the pacer's waiting place follows it."""
    app = flaky_app([])
    with asgi_in_thread(app) as url:
        c = client(url, tmp_path)
        c.fetch(calls(2))
        c.fetch(calls(4))
    assert len(app.state.calls) == 4 and c.pacer.active == 0
