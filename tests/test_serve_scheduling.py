"""``verinfer serve`` schedules continuously (``serve.scheduler``): rows join and leave the running
batch at step boundaries, so a request's own siblings never starve it, a long request never holds a
short one, a client that stops reading a stream is dropped, and a retried request with an
``Idempotency-Key`` finds its work instead of redoing it. Every check waits for server state
(``/health``), never for a duration; ``HANG_GUARD_S`` only stops a broken server from hanging the run.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from verinfer.sampling.params import SamplingParams
from verinfer.scoring.traces import score_traces
from verinfer.serve import ServeConfig, serve_in_thread
from verinfer.trace import Trace
from tests.audit_servers import health as _health, open_request as _open_request, until

HANG_GUARD_S = 300


def _until(client, pred, what: str) -> dict:
    return until(client, pred, what, HANG_GUARD_S)
SPEC = "layers:24:2"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _traces(choices: list[dict], model: str) -> list[Trace]:
    return [Trace(id=f"t{c['index']}", model=model, prompt_token_ids=c["prompt_token_ids"],
                  output_token_ids=c["token_ids"], sampling=SamplingParams.from_dict(c["verinfer_sampling"]),
                  spec_modes=c.get("verinfer_spec_modes")) for c in choices]


def test_sixteen_choices_with_the_default_batch_size_verify_exactly(backend):
    """Issue 27.1: rows 9 to 16 wait for slots behind rows 1 to 8 of the same request; they used to
    expire in the queue (503). The queue timeout applies to the request's first row. A short queue
    timeout (0.2 s, where rows 9 to 16 wait for 32 decode steps of rows 1 to 8) keeps the case small."""
    body = {"prompt": "List some fruits.", "max_tokens": 32, "seed": 11, "n": 16, "return_token_ids": True}
    with serve_in_thread(backend, ServeConfig(queue_timeout_s=0.2)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        r = client.post("/completions", json=body)
        assert r.status_code == 200, r.text
        alone = client.post("/completions", json={**body, "n": 1, "seed": 26}).json()["choices"][0]
        h = _health(client)
    choices = r.json()["choices"]
    assert [c["verinfer_sampling"]["seed"] for c in choices] == list(range(11, 27))
    assert h["max_batch"] == 8 and h["largest_batch"] == 8 and h["expired"] == 0
    assert alone["token_ids"] == choices[15]["token_ids"]  # the 16th row decodes as it does alone
    cols = score_traces(backend, _traces(choices, backend.model_id)).columns
    assert cols["exact_match"].all() and len(cols["exact_match"]) == sum(len(c["token_ids"]) for c in choices)


def test_sixteen_speculative_choices_batch_with_each_other(backend):
    """Issue 27.1 on ``--speculative``: speculative rows take slots and step beside each other."""
    body = {"prompt": "List some fruits.", "max_tokens": 4, "seed": 11, "n": 16, "temperature": 0.7,
            "return_token_ids": True}
    with serve_in_thread(backend, ServeConfig(speculative=SPEC)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        r = client.post("/completions", json=body)
        assert r.status_code == 200, r.text
        alone = client.post("/completions", json={**body, "n": 1, "seed": 20}).json()["choices"][0]
        h = _health(client)
    choices = r.json()["choices"]
    assert len(choices) == 16 and h["spec_requests"] == 17 and h["expired"] == 0
    for c in choices:
        assert len(c["verinfer_spec_modes"]) == len(c["token_ids"]) > 0
    assert (alone["token_ids"], alone["verinfer_spec_modes"]) == (choices[9]["token_ids"],
                                                                   choices[9]["verinfer_spec_modes"])
    from verinfer.scoring.token_difr import verify_traces

    assert all(b.columns["exact_match"].all() for b in verify_traces(backend, _traces(choices, backend.model_id)))


@pytest.fixture
def endless(backend, monkeypatch):
    """The backend with no stop token: only max_tokens, a disconnect or a drop ends a request."""
    monkeypatch.setattr(backend, "stop_ids", lambda: set())
    return backend


def test_a_short_request_is_not_held_by_a_long_stream_nobody_reads(endless):
    """Issue 27.2: a stream of n = 4 and 1,024 tokens whose client stops reading; a request sent
    after it is answered while it still runs (static batching held it until the long one ended)."""
    long_body = {"prompt": "Tell me a long story about the sea.", "max_tokens": 1024, "n": 4, "seed": 3,
                 "stream": True}
    with serve_in_thread(endless, ServeConfig()) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        sock = _open_request(url, "/completions", long_body)
        try:
            _until(client, lambda h: h["running"] == 4 and h["decode_steps"] >= 2, "the long stream is decoding")
            r = client.post("/completions", json={"prompt": "Hi", "max_tokens": 4, "seed": 5,
                                                  "return_token_ids": True})
            h = _health(client)
        finally:
            sock.close()
        _until(client, lambda h: h["running"] == 0, "the long stream ended")
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
    assert h["requests"] == 1  # the short request only: the long one had not ended
    assert h["decode_steps"] < 1024


def test_a_client_that_stops_reading_is_dropped_after_the_send_buffer(endless, monkeypatch):
    """Issue 27.2: once ``stream_buffer_events`` decoded chunks wait for a client that does not read
    (beyond the OS socket buffers, kept small here as on a slow link), its rows leave the batch and
    its connection is closed."""
    from verinfer.serve import runner

    real_bind = runner.bind

    def small_send_buffer(host, port):  # accepted sockets inherit it (and lose send-buffer autotuning)
        sock = real_bind(host, port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        return sock

    monkeypatch.setattr(runner, "bind", small_send_buffer)
    body = {"prompt": "Tell me a long story about the sea.", "max_tokens": 1024, "n": 4, "seed": 3, "stream": True,
            "logprobs": 20, "return_token_ids": True}
    with serve_in_thread(endless, ServeConfig(stream_buffer_events=8)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        sock = _open_request(url, "/completions", body, rcvbuf=4096)
        try:
            h = _until(client, lambda h: h["dropped_streams"] == 1 and h["abandoned"] == 4, "the stream was dropped")
        finally:
            sock.close()
        after = client.post("/completions", json={"prompt": "Hi", "max_tokens": 2, "seed": 5})
    assert h["requests"] == 0
    assert h["decode_steps"] < 1024  # stopped long before its length
    assert after.status_code == 200


def test_a_retried_request_finds_its_result_by_idempotency_key(endless):
    """Issue 27.16: a client that times out and retries with the same ``Idempotency-Key`` gets the
    decoding its first attempt started (it went on while nobody waited), not a fresh one."""
    body = {"prompt": "Once upon a time", "max_tokens": 48, "seed": 9, "return_token_ids": True}
    key = {"Idempotency-Key": "audit-0001"}
    with serve_in_thread(endless, ServeConfig()) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        sock = _open_request(url, "/completions", body, key)
        _until(client, lambda h: h["decode_steps"] >= 2, "the first attempt is decoding")
        sock.close()  # the client gave up
        _until(client, lambda h: h["detached"] == 1, "the server saw the client leave")
        retry = client.post("/completions", json=body, headers=key)
        h = _health(client)
        other_body = client.post("/completions", json={**body, "max_tokens": 47}, headers=key)
        fresh = client.post("/completions", json=body)  # no key: decoded again
        bad_key = client.post("/completions", json=body, headers={"Idempotency-Key": "bad key"})
    assert retry.status_code == 200, retry.text
    assert h["abandoned"] == 0 and h["requests"] == 1 and h["reused_results"] == 1
    assert h["decode_steps"] == 48  # one decoding for both attempts
    assert retry.json()["choices"][0]["token_ids"] == fresh.json()["choices"][0]["token_ids"]
    assert other_body.status_code == 422 and other_body.json()["error"]["code"] == "idempotency_key_reused"
    assert bad_key.status_code == 400 and bad_key.json()["error"]["param"] == "Idempotency-Key"


def test_the_audit_client_reports_retries_and_resends_the_same_key(tmp_path):
    """Issue 27.16, the client's side: every attempt of one request carries the same ``Idempotency-Key``
    (its store key), and each timeout that is retried is reported as it happens."""
    from verinfer.auditing.client import Call, Endpoint, ProviderClient, RetryPolicy
    from verinfer.auditing.store import ResponseStore

    keys, heard = [], []

    def provider(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("idempotency-key"))
        if len(keys) == 1:
            raise httpx.ReadTimeout("no answer yet", request=request)
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "ok"}]})

    call = Call("/completions", {"prompt": "Hi", "max_tokens": 2, "seed": 1}, {"prompt_id": "p0"})
    client = ProviderClient(Endpoint("slow", "http://127.0.0.1:9/v1", "m", None), ResponseStore(tmp_path / "r.jsonl"),
                            policy=RetryPolicy(backoff_s=0.0), transport=httpx.MockTransport(provider),
                            on_retry=heard.append)
    [record] = client.fetch([call])
    assert record["response"]["choices"][0]["text"] == "ok"
    assert keys == [call.key, call.key]
    paced, line = heard  # the timeout halves the requests in flight (verinfer.auditing.pacing), then the retry
    assert paced == "slow: concurrency lowered to 2 (time-outs)"
    assert line.startswith(f"slow: request {call.key} (prompt_id p0): timed out") and "retry 1 of 4" in line
