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

from tests import cli_app
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


def test_cli_audit_concurrency_zero_is_one_line_and_no_directory(tmp_path):
    out = tmp_path / "audit"
    proc = cli_app.invoke("audit", "run", "-p", "p=http://127.0.0.1:9/v1", "--concurrency", "0", "--n", "1",
                          "-o", str(out))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "concurrency" in lines[0], proc.stderr[-2000:]
    assert not out.exists()


# ---------------------------------------------------------------- 6-12: promises of `verinfer verify`

def invoke(*args):
    """The command line in this process (the model is loaded once per process)."""
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def one_line(result, *fragments):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (result.exit_code,
                                                                                       result.output)
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def toploc_traces(backend):
    from verinfer import api
    from verinfer.commits.trace_commits import CommitSpec

    return api.generate("chitchat", n=2, max_tokens=40, seed=5, commits=CommitSpec(toploc_k=128), backend=backend)


def flip_two_bytes(proof: str) -> str:
    """Two coefficient bits flipped, the proof still well-formed (every coefficient below the modulus bound)."""
    import base64

    raw = bytearray(base64.b64decode(proof))
    for offset in range(3, len(raw), 2):  # the low byte of each big-endian u16 coefficient
        if len([o for o in (offset, offset + 2) if int.from_bytes(raw[o - 1:o + 1], "big") ^ 1 < 65497]) == 2:
            raw[offset] ^= 1
            raw[offset + 2] ^= 1
            return base64.b64encode(bytes(raw)).decode("ascii")
    raise AssertionError("no coefficient to flip")


def test_tampered_toploc_proofs_are_an_invalid_commitment_exit_1(toploc_traces, tmp_path):
    from dataclasses import replace

    from verinfer.trace import write_traces

    honest = write_traces(toploc_traces, tmp_path / "honest.jsonl")
    result = invoke("verify", honest)
    assert result.exit_code == 0 and "TOPLOC: " in result.stdout, result.output
    first = toploc_traces[0]
    toploc = dict(first.fingerprints["toploc"])
    toploc["proofs"] = [flip_two_bytes(toploc["proofs"][0]), *toploc["proofs"][1:]]
    tampered = write_traces([replace(first, fingerprints={**first.fingerprints, "toploc": toploc}),
                             *toploc_traces[1:]], tmp_path / "tampered.jsonl")
    result = invoke("verify", tampered, "--json", tmp_path / "v.json")
    assert result.exit_code == 1, result.output
    assert "invalid commitment" in result.stderr and f"trace {first.id!r}" in result.stderr, result.stderr
    assert "toploc proof fails 1 of" in result.stderr
    summary = json.loads((tmp_path / "v.json").read_text())
    assert summary["consistent"] is False and summary["commits"]["toploc"]["failed_traces"] == [first.id]


@pytest.fixture(scope="module")
def calibrated(backend, tmp_path_factory):
    """A trace file and a calibration of it at batch sizes 1 and 2."""
    from verinfer import api
    from verinfer.trace import write_traces

    root = tmp_path_factory.mktemp("calibrated")
    traces = api.generate("chitchat", n=4, max_tokens=8, seed=11, backend=backend)
    path = write_traces(traces, root / "t.jsonl")
    api.calibrate(api.verify(traces, backend=backend), batch_sizes=(1, 2), fpr=0.2, out=root / "cal.json")
    return path, root / "cal.json"


def test_an_uncalibrated_batch_size_is_refused_before_anything_is_written(calibrated, tmp_path):
    path, cal = calibrated
    one_line(invoke("verify", path, "--calibration", cal, "--verdict-batch", 7, "--scores", tmp_path / "s.parquet"),
             "cal.json", "--verdict-batch 7 was not calibrated (calibrated: 1, 2)")
    assert not list(tmp_path.iterdir())
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part0.jsonl").write_bytes(path.read_bytes())
    one_line(invoke("verify", shards, "--calibration", cal, "--verdict-batch", 7), "--verdict-batch 7 was not calibrated")
    assert [p.name for p in tmp_path.iterdir()] == ["shards"] and len(list(shards.iterdir())) == 1
    result = invoke("verify", path, "--calibration", cal, "--verdict-batch", 2, "--scores", tmp_path / "ok.parquet")
    assert result.exit_code == 0, result.output  # a calibrated size still works


@pytest.mark.parametrize("size", [0, -3])
def test_batch_size_zero_is_bad_input_not_a_verdict_at_another_size(calibrated, tmp_path, size):
    path, cal = calibrated
    one_line(invoke("verify", path, "--calibration", cal, "--verdict-batch", size, "--scores", tmp_path / "s.parquet"),
             f"--verdict-batch must be a positive integer, got {size}")
    one_line(invoke("verify", path, "--verdict-batch", size, "--scores", tmp_path / "s.parquet"), "--verdict-batch")
    assert not list(tmp_path.iterdir())


def commands_with_device():
    """Every command (and subcommand) of the command line that takes --device, as argv prefixes."""
    import typer

    from verinfer.cli.main import app

    found = []

    def walk(command, path):
        if hasattr(command, "commands"):  # a group
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        elif any("--device" in p.opts for p in command.params):
            found.append(path)

    walk(typer.main.get_command(app), [])
    return found


def test_every_device_option_refuses_an_unknown_device_in_one_line(tmp_path):
    commands = commands_with_device()
    assert {"verify", "generate", "serve"} <= {c[0] for c in commands} and ["audit", "run"] in commands
    for command in commands:
        for device, phrase in (("tpu", "not a torch device"), ("cuda:99", "not available")):
            one_line(invoke(*command, "--device", device), f"--device '{device}'", phrase)
    assert not list(tmp_path.iterdir())


def test_jsonl_and_parquet_traces_of_one_stem_get_their_own_scores(calibrated, tmp_path):
    from verinfer.trace import read_traces, write_traces

    jsonl = tmp_path / "t.jsonl"
    jsonl.write_bytes(calibrated[0].read_bytes())
    parquet = write_traces(read_traces(jsonl)[:1], tmp_path / "t.parquet")
    assert invoke("verify", jsonl).exit_code == 0
    first = (tmp_path / "t.scores.parquet").read_bytes()
    assert invoke("verify", parquet).exit_code == 0
    assert (tmp_path / "t.scores.parquet").read_bytes() == first  # not replaced by the second run
    assert (tmp_path / "t.parquet.scores.parquet").exists()


def test_error_messages_name_the_file_and_record(calibrated, tmp_path):
    lines = calibrated[0].read_text().splitlines()
    record = json.loads(lines[1])
    lines[1] = json.dumps({**record, "id": "t\ud800x"})  # json escapes the lone surrogate as \ud800
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    one_line(invoke("verify", bad), "bad.jsonl: record 2 (id 't\\ud800x'): field 'id'", "lone surrogate")
    one_line(invoke("verify", tmp_path / "missing.jsonl", "--scores", tmp_path / "s.parquet"),
             "missing.jsonl: no such file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_a_killed_sharded_runs_temporaries_do_not_survive_the_resume(calibrated, backend, tmp_path):
    from verinfer import sharded
    from verinfer.files import remove_stale_temporaries

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part0.jsonl").write_bytes(calibrated[0].read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a process that has exited: its half-written files are garbage
    stale = [out / f".part0.jsonl.scores.parquet.{dead}.tmp", out / f".part0.jsonl.done.json.{dead}.tmp"]
    live = out / f".part0.jsonl.commits.parquet.{os.getpid()}.tmp"  # a writer still running: left alone
    for p in (*stale, live):
        p.write_bytes(b"PAR1 half a file")
    result = sharded.run_local(sharded.find_shards(shards), out, backend)
    assert result.verified == [str(shards / "part0.jsonl")] and not result.errors
    assert not any(p.exists() for p in stale) and live.exists()
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp")) == [live.name]
    assert remove_stale_temporaries(out / "part0.jsonl.commits.parquet") == []
