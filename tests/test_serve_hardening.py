"""``verinfer serve`` under hostile or unlucky traffic, over real loopback HTTP.

One bad request never fails another: bounds at the boundary (400 naming the field), isolation in
the scheduler (a request that fails inside the model fails alone), abandoned requests stop costing
the scheduler, the queue times out, the prefill budget bounds the running batch, and a schema fuzz
(schemathesis, against the server's own OpenAPI document) finds no 5xx.

Tests that need the scheduler in a known state gate its decoding steps (``Gate``): a step holding
a row with the gate's seed waits until the test opens the gate, so other requests queue behind it
deterministically, and the rows of every step are recorded.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import threading

import pytest
import torch

import httpx
import verinfer.serve.batch as batch_module
import verinfer.serve.jobs as jobs_module
from verinfer.serve import ServeConfig, serve_in_thread
from tests.audit_servers import health as _health, open_request as _open_request, until

GATE_SEED = 777_000
POISON_SEED = 666_000
HANG_GUARD_S = 120  # only stops a broken server from hanging the run; no assertion depends on it


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _root(url: str) -> str:
    return url.removesuffix("/v1")


def _until(client: httpx.Client, pred, what: str) -> dict:
    return until(client, pred, what, HANG_GUARD_S)


def _body(prompt, max_tokens=4, seed=1, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "temperature": 1.0, "return_token_ids": True,
            **extra}


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


class Gate:
    """Wraps ``RunningBatch.sample`` (each decoding step): records the rows of every step; holds a
    step with a ``GATE_SEED`` row until ``open``; raises inside the step where a ``POISON_SEED`` row
    samples its second token (alone or not)."""

    def __init__(self, monkeypatch):
        real = batch_module.RunningBatch.sample
        self.steps: list[list[tuple[int, int]]] = []  # per step: (seed, prompt length) of each row
        self.opened = threading.Event()

        def sample(batch):
            rows = [(r.job.request.params.seed, r.job.prompt_len, len(r.tokens)) for r in batch.rows]
            self.steps.append([(seed, n) for seed, n, _ in rows])
            if any(seed == GATE_SEED for seed, _, _ in rows):
                assert self.opened.wait(HANG_GUARD_S)
            if any(seed == POISON_SEED and k == 1 for seed, _, k in rows):
                raise RuntimeError("poisoned row")
            return real(batch)

        monkeypatch.setattr(batch_module.RunningBatch, "sample", sample)

    def open(self):
        self.opened.set()

    def seeds(self) -> list[list[int]]:
        return [[s for s, _ in step] for step in self.steps]


# -- schema fuzzing ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_server(backend):
    with serve_in_thread(backend, ServeConfig(max_tokens_limit=1, batch_wait_s=0.0)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        yield url, client


@pytest.fixture(scope="module")
def fuzz_run(fuzz_server, tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """schemathesis's own runner (its command line) against the server's OpenAPI document: boundary
    values of every field (coverage phase) plus a few random valid and invalid bodies per operation,
    every exchange recorded in a HAR file. Run as a process of its own, outside pytest's node ids
    (schemathesis's pytest integration rewrites them, and under load it once ended in an
    AttributeError that hid what the fuzz found); its report names every failing case."""
    url, _ = fuzz_server
    har = tmp_path_factory.mktemp("fuzz") / "fuzz.har"
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", _root(url) + "/openapi.json",
                          "--checks", "not_a_server_error", "--mode", "all", "--max-examples", "6",
                          "--phases", "examples,coverage,fuzzing", "--generation-deterministic",
                          "--request-timeout", str(HANG_GUARD_S),
                          "--report", "har", "--report-har-path", str(har)],
                         capture_output=True, text=True, timeout=1800, cwd=har.parent)  # its cache stays there
    entries = json.loads(har.read_text())["log"]["entries"] if har.exists() else []
    return run, entries


def test_schema_fuzz_never_gets_a_server_error(fuzz_run):
    run, entries = fuzz_run
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert entries, (run.stdout + run.stderr)[-3000:]
    for e in entries:
        status, body = e["response"]["status"], e["response"]["content"].get("text") or ""
        where = (e["request"]["method"], e["request"]["url"], (e["request"].get("postData") or {}).get("text"))
        assert status < 500, (where, status, body[:500])
        if status >= 400 and status != 413:  # every error in OpenAI's shape
            err = json.loads(body)["error"]
            assert err["message"] and err["type"] in ("invalid_request_error", "server_error"), (where, body[:500])


def test_server_is_healthy_after_the_fuzz(fuzz_run, fuzz_server, backend):
    _, entries = fuzz_run
    _, client = fuzz_server
    r = client.post("/completions", json=_body(backend.tokenizer.encode("After the storm"), max_tokens=1))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) >= 1
    h = _health(client)
    assert h["status"] == "ok" and h["failed"] == 0 and h["queued"] == 0
    statuses = {e["response"]["status"] for e in entries}
    assert 400 in statuses and 200 in statuses  # the fuzz reached both the validator and the model
    assert h["requests"] > 1  # fuzzed bodies were decoded, not only refused


# -- the inputs that used to be 500 -------------------------------------------------------------------

FORMER_500 = [
    ("/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "top_k": 2**70}).encode(), "top_k", "less than"),
    ("/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "seed": 2**64}).encode(), "seed", "less than"),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
     "messages[0].content", "surrogate"),
    ("/completions", b'{"prompt": "hi", "stop": ["ok", "\\udfff"]}', "stop[1]", "surrogate"),
    ("/completions", b"[" * 100_000 + b"]" * 100_000, None, "nests 100000 levels"),
    ("/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens", "5000 digits"),
    ("/completions", b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", "temperature", "401 digits"),
    ("/completions", b'{"prompt": "hi", "temperature": 1' + b"0" * 39 + b"}", "temperature", "less than or equal"),
    ("/completions", b'{"prompt": "hi", "verinfer_commits": {"toploc": true, "fingerprint_stride": ' +
     str(2**70).encode() + b"}}", "verinfer_commits.fingerprint_stride", "less than or equal"),
    ("/completions", b'{"prompt": "\xff\xfe"}', None, "not valid UTF-8"),
]


@pytest.mark.parametrize("path, raw, param, words", FORMER_500, ids=[
    "top_k-2**70", "seed-2**64", "lone-surrogate", "surrogate-in-stop", "nested-100000", "int-5000-digits",
    "float-401-digits", "temperature-1e39", "stride-2**70", "not-utf8"])
def test_former_server_errors_are_400_naming_the_field(fuzz_server, path, raw, param, words):
    _, client = fuzz_server
    err = _error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert words in err["message"]


def test_oversized_body_is_413_and_a_bad_request_spares_its_batch(fuzz_server, backend):
    _, client = fuzz_server
    big = json.dumps({"prompt": "a" * (2 << 20)}).encode()
    err = _error(client.post("/completions", content=big, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large"
    # The top_k that used to overflow while the batch tensor was built, sent among good requests.
    ids = backend.tokenizer.encode("The river bends")
    bodies = [_body(ids, 1, seed=10 + i) for i in range(3)] + [_body(ids, 1, seed=13, top_k=2**70)]
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: client.post("/completions", json=b), bodies))
    assert [r.status_code for r in replies] == [200, 200, 200, 400]


# -- isolation ------------------------------------------------------------------------------------

def test_a_request_failing_inside_the_model_fails_alone(backend, monkeypatch):
    gate = Gate(monkeypatch)
    ids = backend.tokenizer.encode("Our village has a small bakery that")
    seeds = [21, 22, POISON_SEED, 23]
    with serve_in_thread(backend, ServeConfig(max_batch=8, batch_wait_s=0.0)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client, cf.ThreadPoolExecutor(5) as pool:
        blocker = pool.submit(client.post, "/completions", json=_body(ids, 2, seed=GATE_SEED))
        _until(client, lambda h: len(gate.steps) == 1, "the gated step started")
        futures = [pool.submit(client.post, "/completions", json=_body(ids, 3, seed=s)) for s in seeds]
        _until(client, lambda h: h["queued"] == len(seeds), "all requests queued behind the gate")
        gate.open()
        replies = [f.result() for f in futures]
        assert blocker.result().status_code == 200
        alone = {s: client.post("/completions", json=_body(ids, 3, seed=s)).json()["choices"][0]["token_ids"]
                 for s in seeds if s != POISON_SEED}
        h = _health(client)
    assert any(POISON_SEED in step and len(step) > 1 for step in gate.seeds())  # it shared steps with others
    for s, r in zip(seeds, replies):
        if s == POISON_SEED:
            err = _error(r, 500)
            assert err["type"] == "server_error" and "poisoned row" in err["message"]
        else:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == alone[s]
    assert h["failed"] == 1


# -- abandoned and waiting requests -------------------------------------------------------------------

def test_a_disconnected_client_stops_costing_the_worker(backend, monkeypatch):
    monkeypatch.setattr(backend, "stop_ids", lambda: set())  # no early stop: only the disconnect can end it
    ids = backend.tokenizer.encode("A long story about the sea, the wind and the ships. " * 20)
    asked = 4000
    with serve_in_thread(backend, ServeConfig(max_tokens_limit=asked, batch_wait_s=0.0)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        sock = _open_request(url, "/completions", _body(ids, asked, seed=5))
        _until(client, lambda h: h["decode_steps"] >= 3, "the long request is decoding")
        sock.close()
        h = _until(client, lambda h: h["abandoned"] == 1 and h["queued"] == 0, "the request was abandoned")
        spent = h["decode_steps"]
        r = client.post("/completions", json=_body(backend.tokenizer.encode("Next please"), 3, seed=6))
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        after = _health(client)
    assert spent < asked  # the worker stopped decoding the abandoned row long before its max_tokens
    assert after["requests"] == 1 and after["decode_steps"] == spent + 3


def test_a_client_leaving_a_live_stream_stops_costing_the_worker(backend, monkeypatch):
    """The same with ``stream: true``: tokens were already being sent when the client left."""
    monkeypatch.setattr(backend, "stop_ids", lambda: set())
    ids = backend.tokenizer.encode("A long story about the sea, the wind and the ships. " * 20)
    asked = 4000
    with serve_in_thread(backend, ServeConfig(max_tokens_limit=asked, batch_wait_s=0.0)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        with httpx.stream("POST", f"{url}/completions", json={**_body(ids, asked, seed=5), "stream": True},
                          timeout=HANG_GUARD_S) as r:
            for line in r.iter_lines():
                if '"token_ids":[' in line:
                    break  # a token arrived while the request decodes: leave
        h = _until(client, lambda h: h["abandoned"] == 1 and h["queued"] == 0, "the streamed request was abandoned")
    assert h["decode_steps"] < asked


def test_a_client_leaving_during_a_long_prefill_stops_it_between_chunks(backend, monkeypatch):
    """A long prompt is prefilled in chunks; once its client is gone, the next chunk never runs."""
    chunk = 128
    ids = backend.tokenizer.encode("A long story about the sea, the wind and the ships. " * 50)[:5 * chunk]
    first_chunk, abandoned = threading.Event(), threading.Event()
    widths: list[int] = []
    real_hidden, real_abandon = type(backend).hidden, jobs_module.Job.abandon

    def hidden(self, input_ids, attention_mask, position_ids=None, cache=None):
        widths.append(input_ids.shape[1])
        out = real_hidden(self, input_ids, attention_mask, position_ids, cache)
        if len(widths) == 1:  # hold the prefill after its first chunk until the handler gives up
            first_chunk.set()
            assert abandoned.wait(HANG_GUARD_S)
        return out

    def abandon(job):
        dropped = real_abandon(job)
        abandoned.set()
        return dropped

    monkeypatch.setattr(type(backend), "hidden", hidden)  # on the class: copies of the backend keep theirs
    monkeypatch.setattr(jobs_module.Job, "abandon", abandon)
    config = ServeConfig(batch_wait_s=0.0, prefill_chunk_tokens=chunk)
    with serve_in_thread(backend, config) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client:
        sock = _open_request(url, "/completions", _body(ids, 8, seed=5))
        assert first_chunk.wait(HANG_GUARD_S)
        sock.close()
        h = _until(client, lambda h: h["abandoned"] == 1 and h["queued"] == 0, "the prefill was abandoned")
        prefill_calls = len(widths)
        r = client.post("/completions", json=_body(backend.tokenizer.encode("Next please"), 3, seed=6))
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    assert len(ids) == 5 * chunk and widths[0] == chunk
    assert prefill_calls == 1  # chunks 2 to 5 never ran
    assert h["decode_steps"] == 0 and h["requests"] == 0


def test_chunked_prefill_decodes_as_one_pass_does(backend):
    """Chunked prefill (left padding across chunk edges) gives the one-pass tokens and hidden rows
    up to fp32 summation order; ``between_chunks`` runs once per chunk edge."""
    from verinfer.sampling.params import SamplingParams
    from verinfer.sampling.profiles import get_profile
    from verinfer.simulate.generate import Request, decode_batch

    texts = ["The harbour at dawn was quiet, and the fishermen " * 6, "Tell me a joke.", "Rain again " * 9]
    batch = [Request(f"r{i}", tuple(backend.tokenizer.encode(t)), SamplingParams(profile="greedy", temperature=0.0))
             for i, t in enumerate(texts)]
    profiles = {"greedy": get_profile("greedy")}
    width = max(len(r.prompt_token_ids) for r in batch)
    edges = []
    one = decode_batch(backend, batch, 6, set(), profiles, capture=True)
    chunked = decode_batch(backend, batch, 6, set(), profiles, capture=True, prefill_chunk=16,
                           between_chunks=lambda: edges.append(1))
    assert len(edges) == -(-width // 16) - 1
    for a, b in zip(one, chunked):
        assert a.tokens == b.tokens
        assert a.rows.shape == b.rows.shape
        assert torch.allclose(a.rows, b.rows, atol=1e-3, rtol=0)


def test_an_abandoned_row_leaves_the_batch_and_the_others_decode_as_alone(backend, monkeypatch):
    """``decode_batch(gone=)``: a row whose client left is dropped from the KV cache at the next
    step (the model then runs on the remaining rows only); the rows that stay emit the tokens they
    emit alone, and the abandoned one keeps the tokens it had."""
    from verinfer.sampling.params import SamplingParams
    from verinfer.simulate.generate import Request, decode_batch

    texts = {"a": "The harbour at dawn was quiet, and", "b": "Tell me a joke about", "c": "Rain again, said the"}
    batch = [Request(k, tuple(backend.tokenizer.encode(t)), SamplingParams(profile="vllm", seed=7 + i, top_k=0,
                                                                           top_p=1.0))
             for i, (k, t) in enumerate(texts.items())]
    real_hidden = type(backend).hidden
    rows_per_call: list[int] = []

    def hidden(self, input_ids, attention_mask, position_ids=None, cache=None):
        rows_per_call.append(input_ids.shape[0])
        return real_hidden(self, input_ids, attention_mask, position_ids, cache)

    steps = []
    monkeypatch.setattr(type(backend), "hidden", hidden)
    out = decode_batch(backend, batch, 10, set(), {}, token_hook=lambda lg, t, rq, step: steps.append(step) or t,
                       gone=lambda rid: rid == "b" and len(steps) >= 4)
    assert rows_per_call == [3] * 4 + [2] * 6  # prefill and 3 decode steps with b, then 6 without it
    alone = {r.id: decode_batch(backend, [r], 10, set(), {})[0].tokens for r in batch}
    assert out[0].tokens == alone["a"] and out[2].tokens == alone["c"] and len(alone["a"]) == 10
    assert out[1].tokens == alone["b"][:4]


def test_a_queued_request_whose_client_left_is_dropped(backend, monkeypatch):
    gate = Gate(monkeypatch)
    abandoned = threading.Event()
    real_abandon = jobs_module.Job.abandon

    def abandon(job):
        dropped = real_abandon(job)
        abandoned.set()
        return dropped

    monkeypatch.setattr(jobs_module.Job, "abandon", abandon)
    ids = backend.tokenizer.encode("Once upon a time")
    with serve_in_thread(backend, ServeConfig(batch_wait_s=0.0)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client, cf.ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(client.post, "/completions", json=_body(ids, 2, seed=GATE_SEED))
        _until(client, lambda h: len(gate.steps) == 1, "the gated step started")
        sock = _open_request(url, "/completions", _body(ids, 2, seed=31))
        _until(client, lambda h: h["queued"] == 1, "the second request is queued")
        sock.close()
        assert abandoned.wait(HANG_GUARD_S)  # the handler saw its client leave
        gate.open()
        assert blocker.result().status_code == 200
        h = _until(client, lambda h: h["abandoned"] == 1 and h["queued"] == 0, "the queued request was dropped")
    assert 31 not in sum(gate.seeds(), [])  # never decoded
    assert h["requests"] == 1


def test_queue_timeout_is_503_and_the_job_never_runs(backend, monkeypatch):
    gate = Gate(monkeypatch)
    ids = backend.tokenizer.encode("Once upon a time")
    with serve_in_thread(backend, ServeConfig(queue_timeout_s=0.3, batch_wait_s=0.0)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client, cf.ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(client.post, "/completions", json=_body(ids, 2, seed=GATE_SEED))
        _until(client, lambda h: len(gate.steps) == 1, "the gated step started")
        err = _error(client.post("/completions", json=_body(ids, 2, seed=41)), 503)  # waits while the gate is shut
        gate.open()
        assert blocker.result().status_code == 200
        h = _until(client, lambda h: h["queued"] == 0 and h["expired"] == 1, "the expired job left the queue")
        assert client.post("/completions", json=_body(ids, 2, seed=42)).status_code == 200
    assert err["code"] == "queue_timeout" and err["type"] == "server_error"
    assert 41 not in sum(gate.seeds(), [])
    assert h["requests"] == 1


def test_prefill_budget_splits_batches_and_long_prompts_are_400(backend, monkeypatch):
    gate = Gate(monkeypatch)
    ids = backend.tokenizer.encode("one two three four five six seven eight nine ten " * 4)[:40]
    config = ServeConfig(max_batch=8, batch_wait_s=0.0, max_batch_prompt_tokens=100, max_prompt_tokens=150)
    with serve_in_thread(backend, config) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S) as client, \
            cf.ThreadPoolExecutor(4) as pool:
        blocker = pool.submit(client.post, "/completions", json=_body(ids[:5], 2, seed=GATE_SEED))
        _until(client, lambda h: len(gate.steps) == 1, "the gated step started")
        futures = [pool.submit(client.post, "/completions", json=_body(ids, 2, seed=50 + i)) for i in range(3)]
        _until(client, lambda h: h["queued"] == 3, "three requests queued behind the gate")
        gate.open()
        assert blocker.result().status_code == 200 and all(f.result().status_code == 200 for f in futures)
        # Over the budget on its own: runs alone. Over max_prompt_tokens or the context: 400 naming the field.
        assert client.post("/completions", json=_body(ids * 3, 2, seed=60)).status_code == 200
        long_prompt = _error(client.post("/completions", json=_body(ids * 4, 2)), 400)
        long_chat = _error(client.post("/chat/completions", json={
            "messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 2}), 400)
    for step in gate.steps:  # rows x longest prompt within the budget, or a row alone
        assert len(step) == 1 or len(step) * max(n for _, n in step) <= 100, step
    forties = [sum(n == 40 for _, n in step) for step in gate.steps]
    assert max(forties) == 2  # two 40-token prompts fit 100 and decoded together; a third waited
    over = [step for step in gate.steps if any(n == 120 for _, n in step)]
    assert over and all(len(step) == 1 for step in over)  # over the budget on its own: ran, alone
    assert long_prompt["param"] == "prompt" and "at most 150" in long_prompt["message"]
    assert long_chat["param"] == "messages" and "at most 150" in long_chat["message"]


def test_prompt_longer_than_the_context_is_400(fuzz_server, backend):
    _, client = fuzz_server  # the model's context: 8192 tokens
    err = _error(client.post("/completions", json={"prompt": [1] * 8193, "max_tokens": 0}), 400)
    assert err["param"] == "prompt" and "8193 tokens" in err["message"] and "at most 8192" in err["message"]
    err = _error(client.post("/chat/completions", json={"messages": [{"role": "user", "content": "word " * 9000}]}),
                 400)
    assert err["param"] == "messages" and "at most 8192" in err["message"]
    with serve_in_thread(backend, ServeConfig(max_model_len=64)) as url, httpx.Client(base_url=url) as small:
        # Exactly the context, scored with no new tokens, fits; one token more does not.
        r = small.post("/completions", json={"prompt": [1] * 64, "max_tokens": 0, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == []
        err = _error(small.post("/completions", json={"prompt": [1] * 65, "max_tokens": 0}), 400)
        assert err["param"] == "prompt" and "at most 64" in err["message"]
        err = _error(small.post("/completions", json={"prompt": [1] * 60, "max_tokens": 5}), 400)
        assert err["param"] == "prompt" and "context of 64" in err["message"]
