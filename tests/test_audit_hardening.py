"""Audit hardening: secrets never reach the terminal or the disk, what providers say they served is
checked against the request, malformed providers files are one-line errors, reports are written
atomically. Fake providers on real loopback HTTP; the end-to-end runs go through the command line."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tests.audit_servers import asgi_in_thread
from tests.cli_app import invoke
from verinfer.auditing.client import Call, Endpoint, ProviderClient, ProviderError, RetryPolicy, endpoints_from_file
from verinfer.auditing.responses import parse_generation, summarize_served
from verinfer.auditing.secrets import REDACTED, redact, redact_text, remember, remember_url
from verinfer.auditing.store import ResponseStore

KEY = "sk-verinfer-hardening-" + "7f3a9c1e5b2d8046"
PASSWORD = "hunter2-Pa55word-xyz"
USER = "alice"
BASIC = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
SUBSCRIPTION = "sub-3e8f0a6d91c2"  # a query-string secret under a name no list knows
SECRETS = (KEY, PASSWORD, BASIC, SUBSCRIPTION)
GOOD = {"model": "m", "choices": [{"message": {"role": "assistant", "content": "hi"}, "token_ids": [1, 2]}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def leaks(text: str | bytes) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [s for s in SECRETS if s.encode() in data]


def files_with_secrets(root) -> dict[str, list[str]]:
    return {str(p): leaks(p.read_bytes()) for p in root.rglob("*") if p.is_file() and leaks(p.read_bytes())}


# ---------------------------------------------------------------- redaction itself

def test_redact_removes_keys_bearer_and_url_credentials_everywhere():
    remember(KEY)
    remember_url(f"http://{USER}:{PASSWORD}@example.invalid/v1")
    value = {"id": f"x-{KEY}", "nested": [f"Authorization: Bearer {KEY}", ("t", f"Basic {BASIC}")],
             KEY: 1, "url": f"see https://{USER}:{PASSWORD}@host:8000/v1/chat", "ids": [1, 2, 3], "n": 4.5}
    out = redact(value)
    assert not leaks(json.dumps(out))
    assert out["nested"][0] == f"Authorization: {REDACTED}" and out["ids"] == [1, 2, 3] and out["n"] == 4.5
    assert out["url"] == f"see https://{REDACTED}@host:8000/v1/chat"
    assert REDACTED in out  # dict keys too
    # credentials in any URL are removed even when nobody registered them
    assert redact_text("ftp://bob:pw@h/x and http://h/no-creds") == f"ftp://{REDACTED}@h/x and http://h/no-creds"


def test_short_keys_are_only_redacted_after_bearer():
    remember("abc")  # a toy key must not erase every 'abc' in a paid-for output
    assert redact_text("Bearer abc said abcdef") == f"{REDACTED} said abcdef"


# ---------------------------------------------------------------- the client and the store

def echo_app():
    """Echoes the Authorization header back: in a 401 body, in a 200 body, in non-JSON and malformed bodies."""
    app = FastAPI()
    app.state.auth = []

    @app.post("/{mode}/v1/chat/completions")
    async def chat(mode: str, request: Request):
        auth = request.headers.get("authorization")
        app.state.auth.append(auth)
        if mode == "deny":
            return JSONResponse({"error": {"message": f"invalid credentials {auth}"}}, status_code=401)
        if mode == "deny-long":  # the key sits where a 200-character cut would split it
            return PlainTextResponse("x" * 185 + f" {auth} trailing", status_code=403)
        if mode == "text":
            return PlainTextResponse(f"<html>debug: {auth}</html>")
        if mode == "malformed":
            return JSONResponse({"error": f"what we got: {auth}"})
        return JSONResponse({**GOOD, "id": f"chatcmpl-{auth}", "debug": {"headers": {"authorization": auth}}})

    return app


def one_call(i=0):
    return [Call("chat/completions", {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]},
                 {"kind": "generate", "prompt_id": f"p{i}"})]


def client_for(url, tmp_path):
    return ProviderClient(Endpoint("prov", url, "m", "VERINFER_HARDENING_KEY"),
                          ResponseStore(tmp_path / "prov" / "responses.jsonl"), concurrency=1,
                          policy=RetryPolicy(retries=0, backoff_s=0.01, timeout_s=10))


@pytest.mark.parametrize("mode, fragment", [("deny", "HTTP 401"), ("deny-long", "HTTP 403"),
                                            ("text", "not JSON"), ("malformed", "malformed response")])
def test_errors_and_rejected_bodies_never_carry_the_key(tmp_path, monkeypatch, mode, fragment):
    monkeypatch.setenv("VERINFER_HARDENING_KEY", KEY)
    app = echo_app()
    with asgi_in_thread(app, prefix=f"/{mode}/v1") as url:
        with pytest.raises(ProviderError) as exc:
            client_for(url, tmp_path).fetch(one_call())
    assert app.state.auth == [f"Bearer {KEY}"]  # the provider did get the key, and echoed it
    message = str(exc.value)
    assert fragment in message and not leaks(message), message
    assert KEY[:10] not in message  # not even the start of a key cut short
    if mode in ("deny", "text", "malformed"):
        assert REDACTED in message
    assert not files_with_secrets(tmp_path)
    if mode in ("text", "malformed"):  # kept, because paid for, but redacted
        assert REDACTED in (tmp_path / "prov" / "rejected.jsonl").read_text()


def test_stored_responses_are_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("VERINFER_HARDENING_KEY", KEY)
    app = echo_app()
    with asgi_in_thread(app, prefix="/ok/v1") as url:
        records = client_for(url, tmp_path).fetch(one_call())
    assert app.state.auth == [f"Bearer {KEY}"]
    assert records[0]["response"]["id"] == f"chatcmpl-{REDACTED}"
    assert records[0]["response"]["choices"] == GOOD["choices"]  # nothing else touched
    assert not files_with_secrets(tmp_path)
    assert ResponseStore(tmp_path / "prov" / "responses.jsonl").records()[0]["response"]["debug"] == {
        "headers": {"authorization": REDACTED}}


def test_the_store_redacts_whatever_it_is_given(tmp_path):
    remember(KEY)
    store = ResponseStore(tmp_path / "r.jsonl")
    store.append("k", "chat/completions", {"model": "m"}, {"echo": f"Bearer {KEY}"}, note=f"u http://{USER}:x@h/v1")
    assert not files_with_secrets(tmp_path) and "x@h" not in (tmp_path / "r.jsonl").read_text()
    assert ResponseStore(tmp_path / "r.jsonl").get("k")["response"] == {"echo": REDACTED}
    assert store.get("k")["note"] == f"u http://{REDACTED}@h/v1"


def test_url_credentials_stay_out_of_errors(tmp_path):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    c = ProviderClient(Endpoint("prov", f"http://{USER}:{PASSWORD}@127.0.0.1:{port}/v1", "m", None),
                       ResponseStore(tmp_path / "r.jsonl"), policy=RetryPolicy(retries=0, timeout_s=5))
    with pytest.raises(ProviderError) as exc:
        c.fetch(one_call())
    assert "connection failed" in str(exc.value) and f"127.0.0.1:{port}" in str(exc.value)
    assert not leaks(str(exc.value)) and f"http://{REDACTED}@127.0.0.1:{port}" in str(exc.value)
    assert c.endpoint.display_url == f"http://{REDACTED}@127.0.0.1:{port}/v1"



def test_query_string_credentials_stay_out_of_errors_and_echoes(tmp_path):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    secret = "qs-secret-7f3a9c1e"
    c = ProviderClient(Endpoint("prov", f"http://127.0.0.1:{port}/v1?api-key={secret}&region=eu", "m", None),
                       ResponseStore(tmp_path / "r.jsonl"), policy=RetryPolicy(retries=0, timeout_s=5))
    with pytest.raises(ProviderError) as exc:
        c.fetch(one_call())
    assert secret not in str(exc.value) and secret not in c.endpoint.display_url
    assert f"region={REDACTED}" in c.endpoint.display_url  # every value of the endpoint's query, whatever its name
    # a provider echoing the value elsewhere (no parameter name around it) is caught by registration
    assert redact_text(f"you sent {secret}") == f"you sent {REDACTED}"
    assert redact_text("https://h/v1?token=abc&monkey=1") == f"https://h/v1?token={REDACTED}&monkey=1"

# ---------------------------------------------------------------- what the provider says it served

def record(response, max_tokens=4, model="m", prompt_ids=(5, 6, 7)):
    return {"prompt_id": "p0", "index": 0, "prompt_token_ids": list(prompt_ids),
            "request": {"model": model, "max_tokens": max_tokens}, "response": response}


def claim(response, **kw):
    return parse_generation(record(response, **kw), None, set(), 1000, "provider 'x'")


def chat(ids, model="m", usage=None, prompt_ids=None):
    out = {"model": model, "choices": [{"message": {"content": None}, "token_ids": ids}]}
    if usage is not None:
        out["usage"] = usage
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    return out


def test_truthful_claims_raise_no_warning():
    c = claim(chat([1, 2, 3], usage={"prompt_tokens": 3, "completion_tokens": 3}, prompt_ids=[5, 6, 7]))
    assert c.served["problems"] == {} and c.served["model"] == "m" and c.served["returned_tokens"] == 3
    s = summarize_served([c, c])
    assert s["warnings"] == [] and s["models"] == {"m": 2} and s["completion_tokens"] == 6
    assert s["returned_tokens"] == 6 and s["requested_model"] == "m" and s["max_tokens"] == 4


@pytest.mark.parametrize("response, check, phrase", [
    (chat([1, 2], model="gpt-4-turbo"), "model", "served model 'gpt-4-turbo', requested 'm'"),
    (chat([1, 2, 3, 4, 5, 6]), "max_tokens", "6 output tokens, max_tokens was 4"),
    (chat([1, 2], usage={"prompt_tokens": 3, "completion_tokens": 9}), "max_tokens", "9 output tokens"),
    (chat([1, 2], usage={"prompt_tokens": 3, "completion_tokens": 3}), "completion_usage",
     "usage.completion_tokens 3, 2 token ids returned"),
    (chat([1, 2], usage={"prompt_tokens": 40, "completion_tokens": 2}, prompt_ids=[5, 6, 7]), "prompt_usage",
     "usage.prompt_tokens 40, 3 prompt token ids returned"),
    # the provider saw another prompt than ours (issue #41 item 5: llama.cpp on code prompts, and nothing warned)
    (chat([1, 2], usage={"prompt_tokens": 4, "completion_tokens": 2}), "prompt_rendering",
     "usage.prompt_tokens 4, 3 in the reference's rendering"),
    (chat([1, 2], prompt_ids=[5, 6, 8]), "prompt_rendering",
     "3 prompt token ids returned, 3 in the reference's rendering, not the same"),
    (chat([1, 2], usage={"prompt_tokens": "3", "completion_tokens": 2}), "usage_malformed", "not non-negative"),
    (chat([1, 2], usage=[3, 2]), "usage_malformed", "usage is a list"),
])
def test_contradictions_become_warnings(response, check, phrase):
    c = claim(response)
    assert check in c.served["problems"] and phrase in c.served["problems"][check], c.served
    honest = claim(chat([1, 2], usage={"prompt_tokens": 3, "completion_tokens": 2}))
    s = summarize_served([honest, c, honest])
    assert s["contradictions"] == {k: 1 for k in c.served["problems"]}
    line = next(w for w in s["warnings"] if phrase in w)
    assert line.startswith("1 of 3 responses") and "prompt p0" in line


# ---------------------------------------------------------------- providers files

@pytest.mark.parametrize("content, fragments", [
    ('[{"name": 5, "url": "http://h/v1"}]', ["entry 0", "field 'name' must be a non-empty string, got 5"]),
    ('[{"name": "a", "url": "http://h/v1"}, "b"]', ["entry 1", "expected an object", "got a JSON str"]),
    ('[{"name": "a"}]', ["entry 0 ('a')", "field 'url' is missing"]),
    ('[{"name": "a", "url": "ftp://h/v1"}]', ["entry 0 ('a')", "http(s) base URL"]),
    ('[{"name": "a", "url": "http://h/v1", "api_key": "sk-1"}]', ["unknown field(s) 'api_key'"]),
    ('[{"name": "a", "url": "http://h/v1", "model": ["m"]}]', ["field 'model' must be a non-empty string"]),
    ('{"name": "a", "url": "http://h/v1"}', ["expected a JSON list", "got a JSON dict"]),
    ('[{"name": "a",', ["not valid JSON", "line 1"]),
])
def test_malformed_providers_files_name_the_file_and_entry(tmp_path, content, fragments):
    path = tmp_path / "providers.json"
    path.write_text(content)
    with pytest.raises(ValueError) as exc:
        endpoints_from_file(path, "default-model", "OPENAI_API_KEY")
    assert str(exc.value).startswith(f"{path}: ") and "\n" not in str(exc.value)
    for f in fragments:
        assert f in str(exc.value), str(exc.value)


def test_providers_file_defaults(tmp_path):
    path = tmp_path / "providers.json"
    path.write_text('[{"name": "a", "url": "http://h/v1"}, '
                    '{"name": "b", "url": "https://h/v1", "model": "x", "api_key_env": null}]')
    a, b = endpoints_from_file(path, "default-model", "MY_KEY")
    assert (a.name, a.model, a.api_key_env) == ("a", "default-model", "MY_KEY")
    assert (b.name, b.model, b.api_key_env) == ("b", "x", None)


# ---------------------------------------------------------------- end to end, through the command line

def proxy_app(upstream: str):
    """In front of an honest server: ``echo`` returns the Authorization header inside a 200 body,
    ``deny`` in a 401 body, ``liar`` misreports the model id and the usage (the tokens stay honest)."""
    app = FastAPI()
    app.state.auth = []

    @app.post("/{mode}/v1/{path:path}")
    async def forward(mode: str, path: str, request: Request):
        auth = request.headers.get("authorization")
        app.state.auth.append((mode, auth))
        if mode == "deny":
            return JSONResponse({"error": {"message": f"bad key: {auth}", "type": "invalid_request_error"}},
                                status_code=401)
        body = await request.json()
        async with httpx.AsyncClient(timeout=300) as http:
            r = await http.post(f"{upstream}/{path}", json=body)
        out = r.json()
        if mode == "echo":
            out["id"] = f"chatcmpl-{auth}"
            out["system_fingerprint"] = f"you sent {auth} to {request.url}"
        elif mode == "liar":
            out["model"] = "gpt-4-turbo"
            out["usage"]["completion_tokens"] = body["max_tokens"] + 5
            out["usage"]["prompt_tokens"] += 7
        return JSONResponse(out, status_code=r.status_code)

    return app


@pytest.fixture(scope="module")
def proxy(backend):
    from verinfer.serve import ServeConfig, serve_in_thread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared
    with contextlib.ExitStack() as stack:
        honest = stack.enter_context(serve_in_thread(backend, ServeConfig(max_batch=8)))
        app = proxy_app(honest)
        base = stack.enter_context(asgi_in_thread(app, prefix=""))
        yield app, base, honest
    torch.set_num_threads(threads)


def cli(*args, key: str | None = KEY):
    env = {k: v for k, v in os.environ.items() if k in ("HOME", "PATH", "VERINFER_CACHE", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", COLUMNS="200", OMP_NUM_THREADS="1", **({"VERINFER_HARDENING_KEY": key} if key else {}))
    return subprocess.run([sys.executable, "-m", "verinfer.cli", "audit", "run", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_cli_audit_keeps_secrets_off_terminal_and_disk_and_warns_about_misreports(proxy, tmp_path):
    app, base, _ = proxy
    host = base.split("://", 1)[1]
    out = tmp_path / "audit"
    proc = cli("-p", f"echo={base}/echo/v1", "-p", f"creds=http://{USER}:{PASSWORD}@{host}/echo/v1",
               "-p", f"liar={base}/liar/v1", "-p", f"query={base}/echo/v1?subscription-key={SUBSCRIPTION}",
               "--api-key-env", "VERINFER_HARDENING_KEY",
               "--n", "3", "--max-tokens", "6", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    sent = {mode: {a for m, a in app.state.auth if m == mode} for mode in ("echo", "liar")}
    assert f"Bearer {KEY}" in sent["echo"] and f"Basic {BASIC}" in sent["echo"]  # both were echoed back
    assert not leaks(proc.stdout) and not leaks(proc.stderr), (leaks(proc.stdout), leaks(proc.stderr))
    assert not files_with_secrets(out)
    assert (out / "echo" / "responses.jsonl").read_text().count(f"chatcmpl-{REDACTED}") == 3
    assert (out / "creds" / "responses.jsonl").read_text().count(f"chatcmpl-Basic {REDACTED}") == 3

    doc = json.loads((out / "audit.json").read_text())
    providers = {p["name"]: p for p in doc["providers"]}
    assert providers["creds"]["base_url"] == f"http://{REDACTED}@{host}/echo/v1"
    assert providers["query"]["base_url"] == f"{base}/echo/v1?subscription-key={REDACTED}"
    assert (out / "query" / "responses.jsonl").read_text().count(f"/echo/v1/chat/completions?subscription-key="
                                                                 f"{REDACTED}") == 3
    for name in ("echo", "creds", "query"):  # truthful claims: no warnings
        assert providers[name]["warnings"] == [] and providers[name]["served"]["returned_tokens"] > 0
    liar = providers["liar"]
    assert liar["served"]["models"] == {"gpt-4-turbo": 3}
    assert set(liar["served"]["contradictions"]) == {"model", "max_tokens", "completion_usage", "prompt_usage"}
    assert any("'gpt-4-turbo'" in w for w in liar["warnings"]) and len(liar["warnings"]) == 4
    assert all(p["prompt_id"] and p["served"]["model"] == "gpt-4-turbo" for p in liar["prompts"])
    # the tokens are honest: the warnings leave the statistical verdict alone
    assert all(p["verdict"]["consistent"] for p in doc["providers"]), [p["verdict"]["text"] for p in doc["providers"]]

    warnings = [line for line in proc.stdout.splitlines() if "warning:" in line]
    assert len(warnings) == 4 and any("gpt-4-turbo" in w for w in warnings), proc.stdout
    html = (out / "audit.html").read_text()
    assert html.count('class="warning"') == 4 and "gpt-4-turbo (3)" in html
    assert f"http://{REDACTED}@{host}/echo/v1" in html


def test_cli_401_echoing_the_key_is_one_redacted_line(proxy, tmp_path):
    app, base, _ = proxy
    out = tmp_path / "audit"
    proc = cli("-p", f"deny={base}/deny/v1", "--api-key-env", "VERINFER_HARDENING_KEY", "--n", "2",
               "--max-tokens", "4", "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("deny", f"Bearer {KEY}") in app.state.auth
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "HTTP 401" in lines[0] and f"bad key: {REDACTED}" in lines[0], proc.stderr
    assert not leaks(proc.stdout) and not leaks(proc.stderr) and not files_with_secrets(out)


def test_cli_providers_file_with_a_non_string_name(tmp_path):
    path = tmp_path / "providers.json"
    path.write_text(json.dumps([{"name": 7, "url": "http://127.0.0.1:9/v1"}]))
    proc = invoke("audit", "run", "--providers-file", str(path), "--out", str(tmp_path / "audit"))  # in this process
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert str(path) in lines[0] and "entry 0" in lines[0] and "'name'" in lines[0]


# ---------------------------------------------------------------- atomic reports

def test_failed_report_write_leaves_the_previous_report_intact(proxy, backend, tmp_path, monkeypatch):
    from verinfer.auditing.bands import find_bands
    from verinfer.auditing.plan import AuditSpec
    from verinfer.auditing.reference import LocalReference
    from verinfer.auditing.report import write_reports
    from verinfer.auditing.run import run_audit
    from verinfer.files import OutputError
    from verinfer.prompts import load_prompts

    _, _, honest = proxy
    spec = AuditSpec(mode="greedy", max_tokens=4)
    result = run_audit([Endpoint("honest", honest, backend.model_id, None)], load_prompts("chitchat", 2, seed=1),
                       spec, LocalReference(backend), tmp_path, bands=find_bands(backend.model_id, spec.signature()))
    previous = '{"previous": "report"}'
    (tmp_path / "audit.json").write_text(previous)

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OutputError) as exc:
        write_reports(result, backend.tokenizer)
    assert "audit.json" in str(exc.value) and "No space left on device" in str(exc.value)
    assert (tmp_path / "audit.json").read_text() == previous
    assert not (tmp_path / "audit.html").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no half-written leftovers
    monkeypatch.undo()
    json_path, html_path = write_reports(result, backend.tokenizer)
    assert json.loads(json_path.read_text())["providers"][0]["name"] == "honest" and html_path.exists()
