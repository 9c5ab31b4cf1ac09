"""``verinfer gateway`` on loopback: pass-through equality with talking to the engine directly, no
field the client did not ask for, streams forwarded as they arrive, and the recorder's behaviour
(full queue, failing writes, unrecordable exchanges, kill -9 and SIGTERM of the real command).

The engine here is a small fake OpenAI server (``fake_engine``: vLLM's response shapes, instant),
so these tests need no model; ``test_gateway_verify.py`` runs ``verinfer serve`` behind the gateway
and verifies what it records."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.audit_servers import asgi_in_thread, free_port
from verinfer.production.exchange import (EventSplitter, Exchange, Recording, Unrecordable, claimed_params, prepare,
                                          record, strip_ids, unverifiable_reason, writes_nulls)
from verinfer.production import gateway as gateway_module
from verinfer.production import recorder
from verinfer.production.gateway import Gateway, GatewayConfig, gateway_in_thread
from verinfer.sharded import find_shards
from verinfer.trace import read_traces, write_traces

PROMPT = [1, 9690, 2, 2683]  # fake prompt token ids the fake engine reports
OUTPUT = [504, 3459, 17, 2]


def fake_engine(seen: list | None = None, refuse_ids: bool = False, ids: bool = True, gate: threading.Event | None = None,
                null_style: bool = True) -> FastAPI:
    """vLLM's shapes (``null_style``): fields not asked for are written as null (every optional field of
    a non-streamed response, ``token_ids`` in each stream chunk, ``prompt_token_ids`` in the first),
    and ``/v1/models`` says ``owned_by: vllm``; else (``verinfer serve``) they are left out. ``refuse_ids``: 400 naming
    ``return_token_ids``; ``ids=False``: text only (as llama_cpp.server); ``gate``: the stream waits
    for it after its first event."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model",
                                            "owned_by": "vllm" if null_style else "fake"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if seen is not None:
            seen.append({"body": body, "auth": request.headers.get("authorization")})
        want = ids and body.get("return_token_ids") is True
        choices = [{"index": j, "text": "".join(f"t{t}" for t in OUTPUT), "logprobs": None, "finish_reason": "length",
                    **({"prompt_token_ids": PROMPT if want else None, "token_ids": OUTPUT if want else None}
                       if want or null_style else {})} for j in range(body.get("n", 1))]
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "fake", "choices": choices,
                **({"prompt_logprobs": None} if null_style else {})}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if seen is not None:
            seen.append({"body": body, "auth": request.headers.get("authorization")})
        if refuse_ids and "return_token_ids" in body:
            return JSONResponse({"error": {"message": "return_token_ids: Extra inputs are not permitted",
                                           "type": "BadRequestError", "param": None, "code": 400}}, status_code=400)
        if body.get("temperature", 1) > 2:
            return JSONResponse({"error": {"message": "temperature: must be <= 2", "type": "BadRequestError",
                                           "param": "temperature", "code": 400}}, status_code=400)
        want = ids and body.get("return_token_ids") is True
        n = body.get("n", 1)
        if body.get("stream"):
            async def events():
                head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "fake"}
                first = {**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""}}
                                             for j in range(n)]}
                if want or null_style:
                    first["prompt_token_ids"] = PROMPT if want else None
                yield f"data: {json.dumps(first, separators=(',', ':'))}\n\n"
                if gate is not None:
                    await asyncio.to_thread(gate.wait, 10)
                for k, tok in enumerate(OUTPUT):
                    ids = {"token_ids": [tok] if want else None} if want or null_style else {}
                    choices = [{"index": j, "delta": {"content": f"t{tok}"}, **ids,
                                **({"finish_reason": "stop"} if k == len(OUTPUT) - 1 else {})} for j in range(n)]
                    yield f"data: {json.dumps({**head, 'choices': choices}, separators=(',', ':'))}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        choices = [{"index": j, "message": {"role": "assistant", "content": "".join(f"t{t}" for t in OUTPUT)},
                    "logprobs": None, "finish_reason": "stop"} for j in range(n)]
        out = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake", "choices": choices,
               "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": n * len(OUTPUT)}}
        for c in choices:
            if want:
                c["token_ids"] = OUTPUT
            elif null_style:
                c["token_ids"] = None
        if null_style:
            out["prompt_logprobs"] = None
            out["prompt_token_ids"] = PROMPT if want else None
        elif want:
            out["prompt_token_ids"] = PROMPT
        return out

    return app


def _gateway(upstream, traces, recording, log, write=None, **kw) -> Gateway:
    return Gateway(GatewayConfig(upstream, traces, recording, **kw), log=log or (lambda *a, **k: None), write=write)


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "seed": 3}


# ---------------------------------------------------------------------------------------------------
# pure parts


def test_strip_ids_cuts_only_the_ids_and_keeps_every_other_byte():
    vllm = b'{"id":"x","choices":[{"index":0,"token_ids":[1,2,3],"text":"a \\"token_ids\\":[1]"}],' \
           b'"prompt_logprobs":null,"prompt_token_ids":[4, 5]}'
    assert strip_ids(vllm, null=True) == b'{"id":"x","choices":[{"index":0,"token_ids":null,' \
                                         b'"text":"a \\"token_ids\\":[1]"}],"prompt_logprobs":null,' \
                                         b'"prompt_token_ids":null}'
    chunk = b'data: {"choices":[{"token_ids":[7],"index":0,"delta":{"content":"x"}}],"prompt_token_ids":[1,2]}\n\n'
    assert strip_ids(chunk, null=False) == b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    assert strip_ids(b'{"a":{"token_ids":[1]},"stop_token_ids":[2]}', null=False) == b'{"a":{},"stop_token_ids":[2]}'
    assert writes_nulls({"data": [{"id": "m", "owned_by": "vllm"}]})
    assert not writes_nulls({"data": [{"id": "m", "owned_by": "verinfer"}]}) and not writes_nulls([])


def test_event_splitter_yields_whole_events_only():
    s = EventSplitter()
    assert s.feed(b"data: {") == b""
    assert s.feed(b'"a":1}\n\ndata: {"b"') == b'data: {"a":1}\n\n'
    assert s.feed(b":2}\n\n") == b'data: {"b":2}\n\n'
    assert s.feed(b"data: [DONE]") == b"" and s.flush() == b"data: [DONE]"


def test_prepare_assigns_seeds_to_sampled_requests_only_and_keeps_given_ones():
    raw = json.dumps({"messages": [], "temperature": 0.7}).encode()
    p = prepare(raw, ask_ids=True, seed=42)
    assert p.seed_assigned and p.request["seed"] == 42 and p.ids_added and p.request["return_token_ids"] is True
    kept = prepare(json.dumps({"messages": [], "seed": 5, "return_token_ids": True}).encode(), True, 42)
    assert not kept.seed_assigned and kept.request["seed"] == 5 and not kept.ids_added
    greedy = prepare(json.dumps({"messages": [], "temperature": 0}).encode(), False, 42)
    assert not greedy.seed_assigned and "seed" not in greedy.request
    untouched = b'{"messages": [], "seed": 1}'
    assert prepare(untouched, False, None).body == untouched  # nothing to change: the client's own bytes
    assert prepare(b"not json", True, 1) is None and prepare(b"[1]", True, 1) is None
    filled = prepare(b'{"top_k": 40}', False, None, {"top_k": 0, "min_p": 0})
    assert filled.request == {"top_k": 40, "min_p": 0}


def test_claims_and_unverifiable_reasons():
    assert claimed_params({"temperature": 0}, "vllm", 3).profile == "greedy"
    p = claimed_params({"seed": 10, "top_k": 0, "temperature": 1}, "vllm-cpu", 2)
    assert (p.seed, p.top_k, p.temperature, p.profile) == (12, -1, 1.0, "vllm-cpu")  # choice j: seed + j
    assert "without a seed" in unverifiable_reason({"temperature": 1}, "vllm", 1)
    assert unverifiable_reason({"temperature": 0}, "vllm", 1) is None  # greedy needs no seed
    assert "presence_penalty" in unverifiable_reason({"seed": 1, "presence_penalty": 0.5}, "vllm", 1)
    assert unverifiable_reason({"seed": 1, "presence_penalty": 0}, "vllm", 1) is None
    assert "n=2" in unverifiable_reason({"seed": 1}, "llama.cpp", 2)
    assert unverifiable_reason({"seed": 1}, "vllm-cpu", 2) is None


def _exchange(response: dict | bytes, request: dict | None = None, stream: bool = False) -> Exchange:
    body = response if isinstance(response, bytes) else json.dumps(response).encode()
    return Exchange("r1", "chat", request or dict(CHAT), body, stream, 0.0, 1.0)


def test_record_returned_ids_store_text_and_unrecordable():
    response = {"model": "fake", "prompt_token_ids": PROMPT,
                "choices": [{"index": 0, "message": {"content": "hello"}, "token_ids": OUTPUT, "finish_reason": "stop"}]}
    out = record(_exchange(response), Recording("p", "vllm", "smollm2-135m"))
    (t,) = out.traces
    assert (t.prompt_token_ids, t.output_token_ids, t.model, t.provider) == (PROMPT, OUTPUT, "smollm2-135m", "p")
    assert t.meta["token_source"] == "returned" and t.messages == [{"role": "user", "content": "Hi"}]
    assert t.output_text == "hello" and t.meta["request_time"] == "1970-01-01T00:00:00.000Z"
    private = record(_exchange(response), Recording("p", store_text=False)).traces[0]
    assert private.messages is None and private.output_text is None and private.prompt_text is None
    assert "hello" not in json.dumps(private.to_dict()) and "Hi" not in json.dumps(private.to_dict())
    text_only = {"model": "fake", "choices": [{"index": 0, "message": {"content": "hello"}, "finish_reason": "stop"}]}
    with pytest.raises(Unrecordable, match="no prompt token ids and the gateway has no tokenizer"):
        record(_exchange(text_only), Recording("p"))
    with pytest.raises(Unrecordable, match="not JSON"):
        record(_exchange(b"<html>"), Recording("p"))
    with pytest.raises(Unrecordable, match="without 'data: \\[DONE\\]'"):
        record(_exchange(b'data: {"choices":[]}\n\n', stream=True), Recording("p"))
    unseeded = record(_exchange(response, {**CHAT, "seed": None}), Recording("p"))
    assert not unseeded.traces and "without a seed" in unseeded.unverifiable[0].meta["unverifiable"]


# ---------------------------------------------------------------------------------------------------
# the proxy


def _events(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("data:")]


@pytest.mark.parametrize("null_style", [True, False], ids=["vllm-nulls", "omitted"])
def test_pass_through_equals_the_engine_directly(tmp_path, null_style):
    seen: list = []
    with asgi_in_thread(fake_engine(seen, null_style=null_style)) as engine, \
            gateway_in_thread(_gateway(engine, tmp_path, Recording("fake"), None)) as gw:
        for path, body, headers in [
            ("chat/completions", CHAT, {}),
            ("chat/completions", {**CHAT, "n": 2}, {"Authorization": "Bearer sk-secret-123"}),
            ("chat/completions", {**CHAT, "return_token_ids": True}, {}),  # asked for: kept
            ("chat/completions", {**CHAT, "stream": True, "n": 2}, {}),
            ("chat/completions", {**CHAT, "stream": True, "return_token_ids": True}, {}),
            ("chat/completions", {**CHAT, "temperature": 5}, {}),  # the engine's error, as it is
            ("completions", {"model": "fake", "prompt": "Once upon", "max_tokens": 4, "seed": 3, "n": 2}, {}),
        ]:
            direct = httpx.post(f"{engine}/{path}", json=body, headers=headers, timeout=30)
            proxied = httpx.post(f"{gw}/{path}", json=body, headers=headers, timeout=30)
            assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content), body
            assert proxied.headers["content-type"] == direct.headers["content-type"]
            if not body.get("return_token_ids"):
                assert not re.search(r'token_ids":\[', proxied.text)  # no ids the client did not ask for
            if body.get("stream"):
                assert len(_events(proxied.text)) == len(OUTPUT) + 2
        assert httpx.get(f"{gw}/models").content == httpx.get(f"{engine}/models").content
        assert httpx.get(f"{gw}/nope").status_code == httpx.get(f"{engine}/nope").status_code == 404
        health = httpx.get(gw.removesuffix("/v1") + "/gateway/health").json()
    # what the engine saw: ids asked for, the client's seed kept, the key passed on
    via = [s for s in seen if s["body"].get("return_token_ids") and s["body"]["seed"] == 3]
    assert len(via) >= 7 and any(s["auth"] == "Bearer sk-secret-123" for s in via)
    assert health["requests"] == 9 and health["upstream_errors"] == 2 and health["queue_depth"] >= 0
    traces = [t for p in find_shards(tmp_path) for t in read_traces(p)]
    assert len(traces) == 1 + 2 + 1 + 2 + 1 + 2  # one per choice of every answered generation
    assert all(t.output_token_ids == OUTPUT and t.prompt_token_ids == PROMPT for t in traces)
    completions = sorted((t for t in traces if t.meta["endpoint"] == "completions"), key=lambda t: t.sampling.seed)
    assert [t.sampling.seed for t in completions] == [3, 4] and completions[0].prompt_text == "Once upon"
    assert not any("sk-secret" in p.read_bytes().decode("latin-1") for p in tmp_path.rglob("*.parquet"))


def test_streams_are_forwarded_as_they_arrive(tmp_path):
    """The engine holds its stream after the first event until the client has seen that event through
    the gateway: a gateway that buffered the stream would never deliver it (the gate opens after 10 s
    as a hang guard, and the test then fails)."""
    for ids in (True, False):  # ids cut from whole events, or raw bytes forwarded
        gate = threading.Event()
        with asgi_in_thread(fake_engine(gate=gate)) as engine, \
                gateway_in_thread(_gateway(engine, tmp_path / str(ids), Recording("fake"), None, token_ids=ids)) as gw:
            with httpx.stream("POST", f"{gw}/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                early = not gate.is_set()
                gate.set()
                rest = [line for line in lines if line.startswith("data:")]
        assert early and '"role":"assistant"' in first and rest[-1] == "data: [DONE]"


def test_an_engine_refusing_return_token_ids_never_fails_the_client(tmp_path):
    from verinfer.auditing.run import stop_ids
    from verinfer.models.load import local_dir, resolve
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(local_dir(resolve("smollm2-135m"))), local_files_only=True)
    seen: list = []
    logs: list = []
    with asgi_in_thread(fake_engine(seen, refuse_ids=True)) as engine:
        g = _gateway(engine, tmp_path, Recording("fake", "vllm", "smollm2-135m", tok, frozenset(stop_ids(tok))),
                     lambda level, event, **f: logs.append(event))
        with gateway_in_thread(g) as gw:
            replies = [httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30) for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert sum("return_token_ids" in s["body"] for s in seen) == 1  # refused once, then never asked again
    assert g.counters.ids_refused == 1 and logs.count("token_ids_refused") == 1
    traces = [t for p in find_shards(tmp_path) for t in read_traces(p)]
    assert len(traces) == 3 and {t.meta["token_source"] for t in traces} == {"retokenized"}
    assert {t.meta["prompt_source"] for t in traces} == {"rendered"}  # the chat template, applied here
    assert traces[0].output_token_ids == tok.encode("".join(f"t{t}" for t in OUTPUT), add_special_tokens=False)


def test_unrecordable_exchanges_are_counted_and_logged_and_an_unreachable_engine_is_a_502(tmp_path):
    logs: list = []
    with asgi_in_thread(fake_engine(ids=False)) as engine:
        g = _gateway(engine, tmp_path, Recording("fake"), lambda level, event, **f: logs.append((event, f)))
        with gateway_in_thread(g) as gw:
            assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
    assert g.counters.unrecordable == 1 and g.counters.recorded == 0
    (reason,) = [f["reason"] for e, f in logs if e == "unrecordable"]
    assert "no tokenizer" in reason
    g = _gateway(f"http://127.0.0.1:{free_port()}", tmp_path / "x", Recording("fake"), None)
    with gateway_in_thread(g) as gw:
        r = httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"


def _held_writer():
    """A shard writer that holds each write until released: (entered, release, write)."""
    from verinfer.trace import write_traces

    entered, release = threading.Event(), threading.Event()

    def write(traces, path):
        entered.set()
        release.wait(30)
        return write_traces(traces, path)

    return entered, release, write


def test_a_full_queue_drops_visibly_and_never_holds_the_client(tmp_path):
    entered, release, slow_write = _held_writer()
    logs: list = []
    with asgi_in_thread(fake_engine()) as engine:
        g = _gateway(engine, tmp_path, Recording("fake"), lambda level, event, **f: logs.append(event),
                     write=slow_write, queue_size=1, shard_records=1)
        with gateway_in_thread(g) as gw:
            assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
            assert entered.wait(30)  # the writer holds exchange 1; the queue has room for one more
            codes = [httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code for _ in range(3)]
            health = httpx.get(gw.removesuffix("/v1") + "/gateway/health").json()
            release.set()
    assert codes == [200, 200, 200]
    assert health["dropped"] == 2 and health["exchanges"] == 4 and logs.count("queue_full") == 1
    assert g.counters.recorded == 2 and len(find_shards(tmp_path)) == 2


def _wait(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_failing_disk_stops_recording_answers_503_and_recording_resumes_by_itself(tmp_path, monkeypatch):
    """A full disk: proxying goes on, /gateway/health answers 503 with the reason while nothing is
    recorded, and once there is room again recording resumes without a restart: the record the error
    left in its write-ahead file is sealed into its shard and later exchanges are recorded."""
    monkeypatch.setattr(recorder, "RESUME_SECONDS", 0.2)
    room = threading.Event()

    def disk(traces, path):
        if not room.is_set():
            raise OSError(28, "No space left on device")
        return write_traces(traces, path)

    logs: list = []
    with asgi_in_thread(fake_engine()) as engine:
        g = _gateway(engine, tmp_path, Recording("fake"), lambda level, event, **f: logs.append((event, f)),
                     write=disk, shard_records=1)
        with gateway_in_thread(g) as gw:
            codes = [httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code for _ in range(3)]
            _wait(lambda: g.recorder.stopped is not None)
            codes += [httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code]
            time.sleep(0.5)  # attempts to resume fail while the disk is full
            stopped = httpx.get(gw.removesuffix("/v1") + "/gateway/health")
            room.set()
            _wait(lambda: g.recorder.stopped is None)
            assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
            _wait(lambda: g.counters.recorded == 1)
            resumed = httpx.get(gw.removesuffix("/v1") + "/gateway/health")
    assert codes == [200] * 4
    health = stopped.json()
    assert stopped.status_code == 503 and health["status"] == "recording_stopped" and health["recording"] is False
    assert health["write_errors"] == 1 and health["recorded"] == 0
    assert "No space left" in health["recording_error"] and "No space left" in health["resume_error"]
    assert len(health["reasons"]) == 1 and health["reasons"][0].startswith("recording stopped:")
    assert resumed.status_code == 200 and resumed.json()["status"] == "ok" and resumed.json()["reasons"] == []
    stops = [f for e, f in logs if e == "recording_stopped"]
    assert len(stops) == 1 and "No space left on device" in stops[0]["error"]
    (back,) = [f for e, f in logs if e == "recording_resumed"]
    held = stops[0]["lost_records"]  # parsed before the stop (1-3: however many the writer took at once), kept in the WAL
    assert held >= 1 and back["sealed_records"] == g.counters.recovered == held
    assert health["dropped"] == 4  # those (counted at the stop), and every exchange answered while stopped
    assert sum(len(read_traces(p)) for p in find_shards(tmp_path)) == held + 1 and not list(tmp_path.glob("*.wal"))


def test_a_trace_directory_that_turns_into_a_file_stops_recording(tmp_path):
    """The real failure path (no fake writer): the directory is replaced by a file while running."""
    traces = tmp_path / "traces"
    with asgi_in_thread(fake_engine()) as engine:
        g = _gateway(engine, traces, Recording("fake"), None, shard_records=1)
        with gateway_in_thread(g) as gw:
            traces.rmdir()
            traces.write_text("not a directory")
            assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
            _wait(lambda: g.recorder.stopped is not None)
            assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
            stopped = g.recorder.stopped
            assert httpx.get(gw.removesuffix("/v1") + "/gateway/health").status_code == 503
            traces.unlink()  # the directory is back: recording resumes by itself
            traces.mkdir()
            _wait(lambda: g.recorder.stopped is None, 30 + recorder.RESUME_SECONDS)
            assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
            _wait(lambda: g.counters.recorded == 1)
            assert httpx.get(gw.removesuffix("/v1") + "/gateway/health").status_code == 200
    assert str(traces) in stopped and g.counters.write_errors == 1 and len(find_shards(traces)) == 1


def test_health_is_503_while_the_engine_cannot_be_reached_and_asks_it_when_idle(tmp_path, monkeypatch):
    """No traffic and no engine: /gateway/health asks the engine itself and answers 503 with the reason;
    a proxied answer makes it 200 at once; an engine gone while idle is found by the next probe."""
    monkeypatch.setattr(gateway_module, "PROBE_AFTER_S", 0.0)
    port = free_port()
    g = _gateway(f"http://127.0.0.1:{port}", tmp_path, Recording("fake"), None)
    with gateway_in_thread(g) as gw:
        down = httpx.get(gw.removesuffix("/v1") + "/gateway/health", timeout=30)
        with asgi_in_thread(fake_engine(), port=port):
            assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
            up = httpx.get(gw.removesuffix("/v1") + "/gateway/health", timeout=30)
        gone = httpx.get(gw.removesuffix("/v1") + "/gateway/health", timeout=30)
    assert down.status_code == 503 and down.json()["status"] == "upstream_unreachable"
    assert f"127.0.0.1:{port}" in down.json()["reasons"][0] and down.json()["upstream_error"]
    assert up.status_code == 200 and up.json()["status"] == "ok" and up.json()["upstream_error"] is None
    assert gone.status_code == 503 and gone.json()["status"] == "upstream_unreachable"


def test_own_endpoints_ask_for_the_token_and_proxied_requests_keep_theirs(tmp_path):
    """With a token, /gateway/metrics answers 401 without it and /gateway/health gives only its status;
    proxied requests need no gateway token and carry their own Authorization to the engine."""
    token, seen, app = "a-long-enough-gateway-token", [], fake_engine()

    async def engine(scope, receive, send):
        seen.extend(v for k, v in scope["headers"] if k == b"authorization")
        await app(scope, receive, send)

    with asgi_in_thread(engine) as upstream:
        g = _gateway(upstream, tmp_path, Recording("fake"), None)
        with gateway_in_thread(g, token=token) as gw:
            own = gw.removesuffix("/v1") + "/gateway"
            anonymous = httpx.get(f"{own}/health", timeout=30).json()
            detailed = httpx.get(f"{own}/health", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
            refused = httpx.get(f"{own}/metrics", timeout=30)
            wrong = httpx.get(f"{own}/metrics", auth=("prometheus", token + "x"), timeout=30)
            metrics = httpx.get(f"{own}/metrics", auth=("prometheus", token), timeout=30)
            answer = httpx.post(f"{gw}/chat/completions", json=CHAT, headers={"Authorization": "Bearer engine-key"},
                                timeout=30)
    assert anonymous == {"status": "ok"} and detailed["upstream"] == upstream.removesuffix("/v1")
    assert refused.status_code == wrong.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    assert refused.headers["www-authenticate"].startswith("Basic")
    assert metrics.status_code == 200 and "verinfer_gateway_requests_total" in metrics.text
    assert answer.status_code == 200 and set(seen) == {b"Bearer engine-key"}  # the request (and /v1/models, once)


def test_block_policy_waits_for_room_and_loses_nothing(tmp_path):
    entered, release, slow_write = _held_writer()
    with asgi_in_thread(fake_engine()) as engine:
        g = _gateway(engine, tmp_path, Recording("fake"), None, write=slow_write, queue_size=1, shard_records=1,
                     on_full="block")
        with gateway_in_thread(g) as gw:
            assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
            assert entered.wait(30)
            codes: list = []
            clients = [threading.Thread(target=lambda: codes.append(
                httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=60).status_code)) for _ in range(3)]
            for c in clients:
                c.start()
            release.set()
            for c in clients:
                c.join(60)
    assert codes == [200, 200, 200] and g.counters.dropped == 0 and g.counters.recorded == 4


def test_unverifiable_choices_are_kept_apart_with_the_reason(tmp_path):
    with asgi_in_thread(fake_engine()) as engine:
        g = _gateway(engine, tmp_path, Recording("fake", "llama.cpp"), None)
        with gateway_in_thread(g) as gw:
            for body in ({**CHAT, "seed": None}, {**CHAT, "n": 2}, {**CHAT, "temperature": 0, "seed": None},
                         {**CHAT, "frequency_penalty": 0.5}):
                assert httpx.post(f"{gw}/chat/completions", json=body, timeout=30).status_code == 200
    verifiable = [t for p in find_shards(tmp_path) for t in read_traces(p)]
    aside = [t for p in find_shards(tmp_path / "unverifiable") for t in read_traces(p)]
    assert [t.sampling.profile for t in verifiable] == ["greedy"]  # temperature 0 needs no seed
    reasons = sorted(t.meta["unverifiable"].split(" ")[0] for t in aside)
    assert len(aside) == 4 and g.counters.unverifiable == 4 and g.counters.recorded == 1
    assert reasons == ["n=2", "n=2", "request", "sampled"], reasons


# ---------------------------------------------------------------------------------------------------
# the command


def test_bad_options_are_one_line_errors(tmp_path):
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    (tmp_path / "file").write_text("x")
    for args, phrase in [(["--traces", str(tmp_path / "file")], "file"),
                         (["--traces", str(tmp_path), "--profile", "nope"], "unknown sampler profile 'nope'"),
                         (["--traces", str(tmp_path), "--on-full", "wait"], "--on-full must be one of drop, block"),
                         (["--traces", str(tmp_path), "--store-text", "maybe"], "--store-text must be true or false"),
                         (["--traces", str(tmp_path), "--request-defaults", "[1]"], "expected a JSON object"),
                         (["--traces", str(tmp_path), "--upstream", "localhost:8000"], "must be an http(s) URL"),
                         (["--traces", str(tmp_path), "--host", "0.0.0.0"], "--host 0.0.0.0 is reachable beyond"),
                         (["--traces", str(tmp_path), "--auth-token-env", "VERINFER_NO_SUCH_VARIABLE"],
                          "VERINFER_NO_SUCH_VARIABLE: the variable is unset or empty")]:
        result = CliRunner().invoke(app, ["gateway", "--upstream", "http://127.0.0.1:9", *args])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, (args, result.output)
        assert lines[0].startswith("error:") and phrase in lines[0], (args, result.output)


def _start(engine: str, traces: Path, port: int, log: Path, *extra: str, ready: bool = True) -> subprocess.Popen:
    """The real command on ``port``; with ``ready``, once its recorder parses (profiles and tokenizer
    loaded: before, it journals exchanges raw)."""
    proc = subprocess.Popen([sys.executable, "-m", "verinfer.cli", "gateway", "--upstream", engine, "--port", str(port),
                             "--traces", str(traces), "--shard-records", "2", *extra],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    deadline = time.monotonic() + 60
    while True:
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/gateway/health", timeout=2)
            if health.status_code == 200 and (health.json()["recorder_ready"] or not ready):
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)


def _records(directory: Path) -> int:
    return sum(len(read_traces(p)) for p in directory.glob("*.parquet"))


def _wal_lines(directory: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in directory.glob("*.wal"))


def test_kill_9_loses_nothing_parsed_and_sigterm_writes_the_open_shard(tmp_path):
    """kill -9 after five answers (two shards of two and one record in the open shard's write-ahead file):
    the next gateway seals the write-ahead file into the shard it was to become, logs the count, and the
    five records are all there, once; SIGTERM writes the open shard itself."""
    with asgi_in_thread(fake_engine()) as engine:
        for how in (signal.SIGKILL, signal.SIGTERM):
            traces, port = tmp_path / how.name, free_port()
            proc = _start(engine, traces, port, tmp_path / f"{how.name}.log")
            try:
                for _ in range(5):
                    assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT,
                                      timeout=30).status_code == 200
                with socket.create_connection(("127.0.0.1", port)) as raw:  # uvicorn's own warning, as JSON too
                    raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                    raw.recv(1024)
                deadline = time.monotonic() + 30  # the writer flushes within SYNC_SECONDS of parsing
                while _records(traces) + _wal_lines(traces) < 5 and time.monotonic() < deadline:
                    time.sleep(0.02)
                os.kill(proc.pid, how)
                assert proc.wait(60) is not None
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert len(find_shards(traces)) == 2 + (how == signal.SIGTERM) and _records(traces) == 4 + (how == signal.SIGTERM)
            orphans = list(traces.glob("*.parquet.wal"))
            assert len(orphans) == (how == signal.SIGKILL) and _wal_lines(traces) == (how == signal.SIGKILL)
            # a killed writer's temporary file (a dead pid in its name) goes when the next gateway starts
            stale, live = traces / ".traces-20260101T000000Z-999999999-000001.parquet.999999999.tmp", \
                traces / f".traces-20260101T000000Z-{os.getpid()}-000001.parquet.{os.getpid()}.tmp"
            stale.write_bytes(b"PAR1"), live.write_bytes(b"PAR1")
            logs: list = []
            g = _gateway(engine, traces, Recording("fake"), lambda level, event, **f: logs.append((event, f)))
            g.recorder.close()  # its recorder seals and cleans up at start
            assert not stale.exists() and live.exists()
            live.unlink()
            assert _records(traces) == 5 and len({t.id for p in find_shards(traces) for t in read_traces(p)}) == 5
            assert not [p for p in traces.iterdir() if p.is_file() and p.suffix != ".parquet"]
            sealed = [f for e, f in logs if e == "wal_sealed"]
            assert g.counters.recovered == len(sealed) == (how == signal.SIGKILL)
            if sealed:
                assert sealed[0]["records"] == 1 and sealed[0]["path"] == str(orphans[0]).removesuffix(".wal")
            log = [json.loads(line) for line in (tmp_path / f"{how.name}.log").read_text().splitlines()]
            assert log[0]["event"] == "listening"
            assert any(e.get("logger") == "uvicorn.error" and "Invalid HTTP request" in e["event"] for e in log)
            assert sum(e["event"] == "shard_written" for e in log) == 2 + (how == signal.SIGTERM)
            if how == signal.SIGTERM:
                assert log[-1]["event"] == "gateway_stopped" and log[-1]["recorded"] == 5


def test_workers_share_the_port_record_apart_and_report_as_one(tmp_path):
    """--workers 2: two processes answer on one port, each writes its own shards; /gateway/health sums
    them (and lists each), /gateway/metrics labels each worker; SIGTERM writes every open shard."""
    traces, port = tmp_path / "traffic", free_port()
    with asgi_in_thread(fake_engine()) as engine:
        proc = _start(engine, traces, port, tmp_path / "gateway.log", "--workers", "2", "--shard-records", "1000")
        try:
            with httpx.Client(timeout=30) as http:  # new connections spread over the workers
                codes = [httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=30).status_code
                         for _ in range(24)]
                deadline = time.monotonic() + 30
                while True:
                    health = http.get(f"http://127.0.0.1:{port}/gateway/health").json()
                    # a sibling's counters are published every second
                    if len(health.get("workers", [])) == 2 and health["requests"] == health["exchanges"] == 24 \
                            or time.monotonic() > deadline:  # a request is counted as it comes, its exchange once answered
                        break
                    time.sleep(0.2)
                metrics = http.get(f"http://127.0.0.1:{port}/gateway/metrics").text
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    assert codes == [200] * 24
    assert health["requests"] == 24 and health["exchanges"] == 24 and health["status"] == "ok"
    assert sorted(w["pid"] for w in health["workers"]) == sorted({w["pid"] for w in health["workers"]})
    assert sum(w["requests"] for w in health["workers"]) == 24
    workers = set(re.findall(r'verinfer_gateway_requests_total\{worker="(\d+)"\}', metrics))
    assert workers == {str(w["pid"]) for w in health["workers"]}
    shards = find_shards(traces)
    assert _records(traces) == 24 and {p.name.split("-")[2] for p in shards} <= workers  # each its own shards
    assert len({t.id for p in shards for t in read_traces(p)}) == 24


def test_the_in_engine_middleware_records_what_the_gateway_records(tmp_path):
    """vLLM's ``--middleware`` path, on the fake engine's ASGI app: clients see exactly what the engine
    alone sends (ids they did not ask for cut out, streams too), and the recorder writes the same traces
    the gateway writes for the same requests."""
    from verinfer.production.middleware import RecordingMiddleware
    from verinfer.production.recorder import Counters, Recorder

    bodies = [CHAT, {**CHAT, "stream": True}, {**CHAT, "return_token_ids": True}, {**CHAT, "n": 2, "stream": True},
              {**CHAT, "temperature": 9}]
    direct, through = [], []
    with asgi_in_thread(fake_engine()) as engine:
        for body in bodies:
            direct.append(httpx.post(f"{engine}/chat/completions", json=body, timeout=30))
    rec = Recorder(tmp_path / "mw", Recording("fake"), lambda *a, **k: None, Counters())
    with asgi_in_thread(RecordingMiddleware(fake_engine(), recorder=rec)) as engine:
        for body in bodies:
            through.append(httpx.post(f"{engine}/chat/completions", json=body, timeout=30))
    rec.close()
    for d, t in zip(direct, through):
        assert (t.status_code, t.content) == (d.status_code, d.content)
        assert t.headers.get("content-length") == d.headers.get("content-length")
    with asgi_in_thread(fake_engine()) as engine:
        g = _gateway(engine, tmp_path / "gw", Recording("fake"), None)
        with gateway_in_thread(g) as gw:
            for body in bodies:
                httpx.post(f"{gw}/chat/completions", json=body, timeout=30)

    def claims(directory):
        return sorted((t.prompt_token_ids, t.output_token_ids, repr(t.sampling), t.meta["stream"])
                      for p in find_shards(directory) for t in read_traces(p))
    assert claims(tmp_path / "mw") == claims(tmp_path / "gw") and len(claims(tmp_path / "mw")) == 5
    assert rec.counters.recorded == 5 and rec.counters.exchanges == 4  # the 400 is not an answer


def test_bodies_stream_through_and_generation_bodies_are_capped(tmp_path):
    """A non-generation body passes through as it arrives (its bytes reach the engine unchanged);
    a generation request over --max-body-mb is refused with 413 in OpenAI's shape, before the engine."""
    app = fake_engine()
    got: list = []

    @app.put("/v1/files/{name}")
    async def upload(name: str, request: Request):
        data = await request.body()
        got.append(data)
        return {"name": name, "bytes": len(data)}

    blob = os.urandom(3 * 2**20)
    with asgi_in_thread(app) as engine:
        g = _gateway(engine, tmp_path, Recording("fake"), None, max_body_mb=1)
        with gateway_in_thread(g) as gw:
            r = httpx.put(f"{gw}/files/x", content=blob, timeout=30)
            chunks = httpx.put(f"{gw}/files/y", content=iter([blob[:1000], blob[1000:]]), timeout=30)  # chunked
            big = httpx.post(f"{gw}/chat/completions", json={**CHAT, "pad": "x" * 2**20}, timeout=30)
    assert r.status_code == 200 and r.json() == {"name": "x", "bytes": len(blob)}
    assert chunks.status_code == 200 and got == [blob, blob]
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert g.counters.exchanges == 0
