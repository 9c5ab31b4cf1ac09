"""``verinfer serve`` with ``stream: true`` and ``n > 1``: server-sent events that join back into the
non-streamed response, n completions per request (seed + j per choice), and the greedy-only cheat
(``greedy-honest:w4``) serving greedy requests honestly and sampled ones from 4-bit weights."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from verinfer.auditing.stream import StreamError, assemble, events
from verinfer.serve import ServeConfig, serve_in_thread
from verinfer.serve.config import parse_misconfig
from verinfer.serve.stream import text_pieces

CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 10, "seed": 7,
        "temperature": 1.0, "return_token_ids": True}


@pytest.fixture(scope="module")
def servers(backend):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with serve_in_thread(backend, ServeConfig(max_batch=8)) as honest, \
            serve_in_thread(backend, ServeConfig(misconfig=("greedy-honest:w4",), max_batch=8)) as cheat:
        yield {"honest": honest, "cheat": cheat}
    torch.set_num_threads(threads)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{url}/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("path,extra", [("chat/completions", {"logprobs": True, "top_logprobs": 2}),
                                        ("completions", {"logprobs": 2})])
def test_stream_joins_back_into_the_response(servers, path, extra):
    body = {**CHAT, **extra}
    if path == "completions":
        body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "Name three colours:"}
    plain = _post(servers["honest"], path, body).json()
    streamed = _post(servers["honest"], path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = events(streamed.text)
    assert len(chunks) >= len(plain["choices"][0]["token_ids"])  # one chunk per token at least
    joined = assemble(chunks)
    for key in ("model", "usage"):
        assert joined[key] == plain[key]
    a, b = joined["choices"][0], plain["choices"][0]
    assert a["token_ids"] == b["token_ids"]  # same seed, same tokens
    assert (a.get("message") or {}).get("content", a.get("text")) == (b.get("message") or {}).get("content", b.get("text"))
    assert a["finish_reason"] == b["finish_reason"]
    assert a["verinfer_sampling"] == b["verinfer_sampling"]
    assert a["logprobs"] == b["logprobs"]  # chat: content entries; completions: tokens, tops and text offsets


def test_n_completions_use_seed_plus_j(servers):
    several = _post(servers["honest"], "chat/completions", {**CHAT, "n": 3}).json()
    assert [c["index"] for c in several["choices"]] == [0, 1, 2]
    assert [c["verinfer_sampling"]["seed"] for c in several["choices"]] == [7, 8, 9]
    assert several["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in several["choices"])
    second = _post(servers["honest"], "chat/completions", {**CHAT, "seed": 8}).json()
    assert second["choices"][0]["token_ids"] == several["choices"][1]["token_ids"]


def test_stream_and_n_are_validated(servers):
    for body, field in [({**CHAT, "n": 0}, "n"), ({**CHAT, "n": 17}, "n"),
                        ({**CHAT, "stream_options": {"include_usage": True}}, None)]:
        r = httpx.post(f"{servers['honest']}/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        if field:
            assert r.json()["error"]["param"] == field
    r = httpx.post(f"{servers['honest']}/completions", json={"prompt": "Hi", "echo": True, "stream": True}, timeout=60)
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_greedy_honest_cheat_is_honest_only_at_temperature_zero(servers):
    greedy = {**CHAT, "temperature": 0.0, "max_tokens": 8}
    assert (_post(servers["cheat"], "chat/completions", greedy).json()["choices"][0]["token_ids"]
            == _post(servers["honest"], "chat/completions", greedy).json()["choices"][0]["token_ids"])
    sampled = {**CHAT, "n": 2, "max_tokens": 8}  # same seeds: the honest model would give the same tokens
    cheat = [c["token_ids"] for c in _post(servers["cheat"], "chat/completions", sampled).json()["choices"]]
    honest = [c["token_ids"] for c in _post(servers["honest"], "chat/completions", sampled).json()["choices"]]
    assert cheat != honest


def test_greedy_honest_needs_a_variant():
    with pytest.raises(ValueError, match="greedy-honest:VARIANT"):
        parse_misconfig("greedy-honest:")
    with pytest.raises(ValueError, match="unknown variant"):
        parse_misconfig("greedy-honest:w3000")
    assert parse_misconfig("greedy-honest:w4").greedy_honest


def test_text_pieces_join_back(backend):
    tok = backend.tokenizer
    ids = tok.encode("Café ☕ déjà vu, naïve 🙂!", add_special_tokens=False)
    text = tok.decode(ids, skip_special_tokens=True)
    pieces = text_pieces(tok, ids, text)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    cut = text[:7]  # a stop string cut the text short
    assert "".join(text_pieces(tok, ids, cut)) == cut


@pytest.mark.parametrize("stream,problem", [
    ("data: {\"choices\": []}\n\n", "DONE"),
    ("data: [DONE]\n\n", "no data"),
    ("data: {not json}\n\ndata: [DONE]\n\n", "not JSON"),
    ("data: {\"error\": {\"message\": \"overloaded\"}}\n\ndata: [DONE]\n\n", "overloaded"),
])
def test_malformed_streams_are_named(stream, problem):
    with pytest.raises(StreamError, match=problem):
        assemble(events(stream))


def test_stream_sends_tokens_while_the_request_is_still_decoding(backend, monkeypatch):
    """The scheduler is held after its third decoding step until the client has read a token's chunk:
    a server that streamed only finished responses would leave it waiting until its timeout."""
    from verinfer.serve import batch as batch_module

    release, held_too_long, steps = threading.Event(), [], []
    original = batch_module.RunningBatch.step

    def held(self):
        out = original(self)
        steps.append(1)
        if len(steps) == 3:
            held_too_long.append(not release.wait(timeout=30))
        return out

    monkeypatch.setattr(batch_module.RunningBatch, "step", held)
    body = {**CHAT, "max_tokens": 12, "logprobs": True, "top_logprobs": 2, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with serve_in_thread(backend, ServeConfig(max_batch=4)) as url:
        lines = []
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if not release.is_set() and '"token_ids":[' in line:
                    release.set()  # a token arrived before the worker went past step 3
        release.set()
        plain = _post(url, "chat/completions", {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert held_too_long[0] is False  # the streamed request's third step was released by its client
    joined = assemble(events("\n".join(lines)))
    plain = plain.json()
    assert joined["usage"] == plain["usage"]
    for a, b in zip(joined["choices"], plain["choices"]):
        assert a["token_ids"] == b["token_ids"] and a["message"]["content"] == b["message"]["content"]
        assert a["logprobs"]["content"] == b["logprobs"]["content"]
        assert a["finish_reason"] == b["finish_reason"] and a["verinfer_sampling"] == b["verinfer_sampling"]


def test_stop_strings_stream_the_finished_response(servers):
    """Text already sent cannot be cut at a stop string, so such requests stream once finished."""
    body = {**CHAT, "max_tokens": 16, "stop": [" and"]}
    plain = _post(servers["honest"], "chat/completions", body).json()
    joined = assemble(events(_post(servers["honest"], "chat/completions", {**body, "stream": True}).text))
    assert joined["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert joined["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


def test_concurrent_live_streams_each_join_back_into_their_response(servers):
    """Streams decoded in one batch: every token reaches its own stream, none is lost or repeated."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{**CHAT, "seed": 20 + s, "max_tokens": 14, "n": 2} for s in range(4)]
    with ThreadPoolExecutor(4) as pool:
        streamed = list(pool.map(lambda b: _post(servers["honest"], "chat/completions", {**b, "stream": True}).text,
                                 bodies))
    for body, text in zip(bodies, streamed):
        plain = _post(servers["honest"], "chat/completions", body).json()
        joined = assemble(events(text))
        for a, b in zip(joined["choices"], plain["choices"]):
            assert a["token_ids"] == b["token_ids"] and a["message"]["content"] == b["message"]["content"]
