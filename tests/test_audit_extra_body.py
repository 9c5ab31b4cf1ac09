"""``extra_body`` / ``--extra-body``: more fields in every generation request, for servers whose
defaults sample otherwise when a knob is left out (llama-cpp-python's server: top-k 40, min-p 0.05,
repeat penalty 1.1). Fields the audit sets itself keep the audit's values."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from typer.testing import CliRunner

from tests.audit_servers import asgi_in_thread
from verinfer.auditing.plan import AuditSpec, generation_calls
from verinfer.prompts import load_prompts

LLAMA = {"top_k": 0, "min_p": 0, "repeat_penalty": 1}


@pytest.fixture(scope="module")
def prompts():
    return load_prompts("chitchat", 2, seed=0)


def test_extra_fields_fill_gaps_and_the_claim_wins(backend, prompts):
    spec = AuditSpec(mode="seeded", profile="llama.cpp", top_k=50, top_p=0.95, seed=7,
                     extra_body={**LLAMA, "seed": 99, "temperature": 0.2, "model": "x"})
    body = generation_calls(spec, prompts, backend.tokenizer, "m")[1].body
    assert body["repeat_penalty"] == 1 and body["min_p"] == 0  # not claimed: sent as given
    assert (body["top_k"], body["seed"], body["temperature"], body["model"]) == (50, 8, 1.0, "m")  # claimed
    greedy = generation_calls(AuditSpec(extra_body=LLAMA), prompts, backend.tokenizer, "m")[0].body
    assert greedy["repeat_penalty"] == 1 and greedy["temperature"] == 0.0 and "seed" not in greedy
    assert "repeat_penalty" not in generation_calls(AuditSpec(), prompts, backend.tokenizer, "m")[0].body


def test_extra_body_must_be_a_json_object():
    assert AuditSpec(extra_body=[1, 2]).problems() == ["extra_body must be a JSON object, got '[1, 2]'"]
    assert "JSON-serializable" in AuditSpec(extra_body={"x": object()}).problems()[0]
    assert AuditSpec(extra_body={}).problems() == []


def test_cli_sends_extra_body_and_refuses_bad_json(tmp_path, prompts):
    from verinfer.cli.main import app

    seen = []
    server = FastAPI()

    @server.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append(await request.json())
        return {"model": "smollm2-135m", "choices": [{"index": 0, "finish_reason": "length",
                                                      "message": {"role": "assistant", "content": "Hello"}}]}

    runner = CliRunner()
    bad = runner.invoke(app, ["audit", "run", "-p", "x=http://127.0.0.1:9/v1", "--extra-body", "[1]",
                              "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "--extra-body: expected a JSON object, got list" in bad.output
    with asgi_in_thread(server) as url:
        result = runner.invoke(app, ["audit", "run", "-p", f"x={url}", "--n", "2", "--max-tokens", "4",
                                     "--api-key-env", "VERINFER_NO_SUCH_KEY", "--out", str(tmp_path / "a"),
                                     "--extra-body", '{"repeat_penalty": 1, "temperature": 0.5}'])
    assert result.exit_code in (0, 1), result.output
    assert len(seen) == 2 and all(b["repeat_penalty"] == 1 and b["temperature"] == 0.0 for b in seen)
