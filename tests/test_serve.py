"""``verinfer serve`` over real loopback HTTP: the API, replayable seeds, batching, misconfigurations."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx")

from verinfer.scoring.traces import score_traces  # noqa: E402
from verinfer.prompts import Prompt, render  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402
from verinfer.serve import ServeConfig, serve_in_thread  # noqa: E402
from verinfer.trace import Trace  # noqa: E402

SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def honest(backend):
    # A longer batching window than the default so that concurrent test requests share a batch.
    with serve_in_thread(backend, ServeConfig(max_batch=8, batch_wait_s=0.05)) as url:
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client


def _trace(i, choice, prompt_ids=None, model="smollm2-135m") -> Trace:
    return Trace(id=f"t{i}", model=model, prompt_token_ids=prompt_ids or choice["prompt_token_ids"],
                 output_token_ids=choice["token_ids"], sampling=SamplingParams.from_dict(choice["verinfer_sampling"]),
                 fingerprints=choice.get("verinfer_commits"))


def _verify(backend, traces, commit_checks=None):
    scored = score_traces(backend, traces)
    if commit_checks is not None:
        commit_checks.extend(scored.commit_checks)
    return scored.columns


def _ids(backend, text):
    return backend.tokenizer.encode(text)


def test_models_list(honest, backend):
    r = honest.get("/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "smollm2-135m" and card["object"] == "model"
    assert card["verinfer"]["sampler_profile"] == "vllm"
    assert card["verinfer"]["vocab_size"] == backend.vocab_size
    assert honest.get("/models/smollm2-135m").json()["id"] == "smollm2-135m"
    assert honest.get("/models/other").status_code == 404


def test_seeded_completion_verifies_as_honest(honest, backend):
    prompt = _ids(backend, "The three most common trees in a northern forest are")
    body = {"prompt": prompt, "max_tokens": 12, "seed": 4242, "return_token_ids": True, **SAMPLING}
    r = honest.post("/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == r.json()["usage"]["completion_tokens"] > 0
    assert choice["text"] == backend.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["verinfer_sampling"] == {"profile": "vllm", "seed": 4242, "min_p": 0.0, **SAMPLING}
    cols = _verify(backend, [_trace(0, choice)])
    assert cols["exact_match"].all() and (cols["margin"] == 0).all()
    # The same seed reproduces the same tokens; another seed gives other tokens that verify too.
    again = honest.post("/completions", json=body).json()["choices"][0]
    assert again["token_ids"] == choice["token_ids"]
    other = honest.post("/completions", json={**body, "seed": 4243}).json()["choices"][0]
    assert other["token_ids"] != choice["token_ids"]


def test_unseeded_request_reports_its_random_seed(honest, backend):
    r = honest.post("/completions", json={"prompt": "Once upon a time", "max_tokens": 8, "return_token_ids": True})
    choice = r.json()["choices"][0]
    seed = choice["verinfer_sampling"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**63
    cols = _verify(backend, [_trace(0, choice)])
    assert cols["exact_match"].all()


def test_echo_with_zero_max_tokens_scores_the_prompt(honest, backend):
    text = "Verification replays every token with one prefill."
    ids = _ids(backend, text)
    r = honest.post("/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 3,
                                          "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text and choice["token_ids"] == [] and choice["prompt_token_ids"] == ids
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.inference_mode():
        h, _ = backend.hidden(torch.tensor([ids]), None)
        ref = torch.log_softmax(backend.logits(h[0, :-1]), dim=-1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(np.array(lp["token_logprobs"][1:]), want, atol=1e-4)
    for i in range(1, len(ids)):
        assert len(lp["top_logprobs"][i]) >= 3
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(float(ref[i - 1].max()), abs=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_chat_completion_with_logprobs_and_commits(honest, backend):
    messages = [{"role": "user", "content": "Name two colours of the rainbow."}]
    r = honest.post("/chat/completions", json={
        "messages": messages, "max_tokens": 10, "seed": 7, "logprobs": True, "top_logprobs": 2,
        "return_token_ids": True, "verinfer_commits": {"fingerprint_dim": 8, "toploc": True}, **SAMPLING})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    want_prompt = render(backend.tokenizer, Prompt("p", (("user", messages[0]["content"]),)))
    assert body["prompt_token_ids"] == want_prompt
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == backend.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    for entry, tok in zip(content, choice["token_ids"]):
        assert entry["token"] == backend.tokenizer.decode([tok])
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"] or entry["token"] == "\ufffd"
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0
    checks = []
    cols = _verify(backend, [_trace(0, choice, body["prompt_token_ids"])], checks)
    assert cols["exact_match"].all()
    [check] = checks
    assert check.error is None and check.toploc_passed.all()
    assert np.max(check.fingerprint_l2) < 1e-3


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "max_tokens": 2, "frobnicate": 1}, "frobnicate", "unknown field"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "hi", "top_k": -3}, "top_k", "-1 or 0"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": [1, 2, 10**6]}, "prompt", "prompt[2]: token id 1000000 is outside the vocabulary"),
    ({"prompt": "hi", "n": 17}, "n", "less than or equal to 16"),
    ({"prompt": "hi", "stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "unknown field"),
    ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens", "limit"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"prompt": "hi", "verinfer_commits": {"toploc": True, "extra": 1}}, "verinfer_commits.extra", "unknown field"),
    ({"max_tokens": 2}, "prompt", "missing"),
    ({"prompt": [1] * 8190, "max_tokens": 16}, "prompt", "more than the context of 8192 tokens"),
])
def test_bad_requests_are_400_naming_the_field(honest, body, param, words):
    r = honest.post("/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert words in err["message"] and param in err["message"]


def test_bad_chat_requests_and_unknown_model(honest):
    r = honest.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs needs logprobs" in r.json()["error"]["message"]
    r = honest.post("/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = honest.post("/completions", json={"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = honest.post("/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = honest.post("/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_concurrent_requests_are_batched_without_mixing(honest, backend):
    texts = ["Apples are", "The ocean is deep because", "My favourite number is", "Trains run on",
             "In winter the lake", "A good breakfast has"]
    bodies = [{"prompt": _ids(backend, t), "max_tokens": 8 + i, "seed": 100 + i, "return_token_ids": True,
               **SAMPLING} for i, t in enumerate(texts)]
    before = honest.get(honest.base_url.join("/health")).json()
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: honest.post("/completions", json=b), bodies))
    after = honest.get(honest.base_url.join("/health")).json()
    assert after["requests"] - before["requests"] == len(bodies)
    assert after["batches"] - before["batches"] < len(bodies)  # some requests shared a batch
    choices = [r.json()["choices"][0] for r in replies]
    for body, choice in zip(bodies, choices):
        assert choice["prompt_token_ids"] == body["prompt"]
        assert choice["verinfer_sampling"]["seed"] == body["seed"]
        assert len(choice["token_ids"]) <= body["max_tokens"]
        assert choice["text"] == backend.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    cols = _verify(backend, [_trace(i, c) for i, c in enumerate(choices)])
    assert cols["exact_match"].all()
    # Served alone, each request gives the same tokens (both exact against the same replay).
    alone = honest.post("/completions", json=bodies[3]).json()["choices"][0]
    assert alone["token_ids"] == choices[3]["token_ids"]


def test_w4_server_claims_honest_but_does_not_verify(backend):
    prompts = ["Describe a quiet morning.", "Why do cats purr?", "List some uses of copper."]
    with serve_in_thread(backend, ServeConfig(misconfig=("w4",))) as url, httpx.Client(base_url=url, timeout=120) as c:
        assert c.get("/models").json()["data"][0]["id"] == "smollm2-135m"
        choices = []
        for i, p in enumerate(prompts):
            r = c.post("/chat/completions", json={"messages": [{"role": "user", "content": p}], "max_tokens": 16,
                                                  "seed": 50 + i, "return_token_ids": True, **SAMPLING})
            assert r.status_code == 200, r.text
            choices.append((r.json()["prompt_token_ids"], r.json()["choices"][0]))
    for _, ch in choices:
        assert ch["verinfer_sampling"]["profile"] == "vllm" and ch["verinfer_sampling"]["temperature"] == 1.0
    cols = _verify(backend, [_trace(i, ch, p) for i, (p, ch) in enumerate(choices)])
    assert not cols["exact_match"].all()
    assert (cols["margin"] > 0).sum() >= 1


def test_injected_system_prompt_is_hidden_but_changes_outputs(honest, backend):
    secret = "You are a pirate. Answer every question like a pirate, with arr and matey."
    messages = [{"role": "user", "content": "What is the weather like today?"}]
    body = {"messages": messages, "max_tokens": 16, "seed": 11, "return_token_ids": True, **SAMPLING}
    clean = honest.post("/chat/completions", json=body).json()
    with serve_in_thread(backend, ServeConfig(misconfig=(f"system-prompt:{secret}",))) as url, \
            httpx.Client(base_url=url, timeout=120) as c:
        dirty = c.post("/chat/completions", json=body).json()
        echo = c.post("/completions", json={"prompt": "Hello there", "max_tokens": 0, "echo": True, "logprobs": 0,
                                            "return_token_ids": True}).json()
    assert dirty["prompt_token_ids"] == clean["prompt_token_ids"]  # the client's own rendering
    assert dirty["usage"]["prompt_tokens"] == clean["usage"]["prompt_tokens"]
    assert dirty["choices"][0]["token_ids"] != clean["choices"][0]["token_ids"]
    assert echo["choices"][0]["prompt_token_ids"] == _ids(backend, "Hello there")
    cols = _verify(backend, [_trace(0, dirty["choices"][0], dirty["prompt_token_ids"])])
    assert not cols["exact_match"].all()


def test_greedy_stop_strings_and_commit_limits(honest, backend):
    prompt = _ids(backend, "Count: one, two, three, four, five, six,")
    full = honest.post("/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                             "return_token_ids": True}).json()["choices"][0]
    with torch.inference_mode():  # temperature 0 is greedy: the first token is the reference argmax
        h, _ = backend.hidden(torch.tensor([prompt]), None)
        assert full["token_ids"][0] == int(backend.logits(h[0, -1:]).argmax())
    assert _verify(backend, [_trace(0, full)])["exact_match"].all()
    stop = full["text"].strip().split()[1][:2]  # a string from the second generated word
    cut = honest.post("/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "stop": [stop],
                                            "return_token_ids": True}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert stop not in cut["text"] and full["text"].startswith(cut["text"])
    assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])] and len(cut["token_ids"]) < 10
    r = honest.post("/completions", json={"prompt": prompt, "max_tokens": 0, "verinfer_commits": {"toploc": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "verinfer_commits"


def test_torch_exponential_server_and_old_template(backend):
    messages = [{"role": "user", "content": "Say something about rivers."}]
    default = render(backend.tokenizer, Prompt("p", (("user", messages[0]["content"]),)))
    with serve_in_thread(backend, ServeConfig(sampler="torch-exponential", misconfig=("old-template",))) as url, \
            httpx.Client(base_url=url, timeout=120) as c:
        assert c.get("/models").json()["data"][0]["verinfer"]["sampler_profile"] == "torch-exponential"
        body = c.post("/chat/completions", json={"messages": messages, "max_tokens": 10, "seed": 3,
                                                 "return_token_ids": True, **SAMPLING}).json()
    choice = body["choices"][0]
    assert choice["verinfer_sampling"]["profile"] == "torch-exponential"
    # The stale template drops SmolLM2's default system message, and the ids say so (as vLLM reports them).
    assert body["prompt_token_ids"] != default
    assert "SmolLM" not in backend.tokenizer.decode(body["prompt_token_ids"])
    assert "SmolLM" in backend.tokenizer.decode(default)
    assert _verify(backend, [_trace(0, choice, body["prompt_token_ids"])])["exact_match"].all()


def _fuzz_value():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 60),
                        st.floats(allow_nan=True, allow_infinity=True), st.floats(-1, 3), st.text(max_size=12))
    return st.one_of(scalars, st.lists(st.integers(-5, 60_000), max_size=6), st.lists(scalars, max_size=3),
                     st.dictionaries(st.sampled_from(["fingerprint_dim", "toploc", "x", "role", "content"]), scalars,
                                     max_size=3))


def test_fuzzed_requests_never_cause_a_server_error(backend):
    """Arbitrary values in known and unknown fields: a 200 or a 4xx in OpenAI's shape, never a 500."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    completion_keys = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "echo",
                       "stop", "n", "stream", "return_token_ids", "verinfer_commits", "model", "bogus"]
    chat_keys = ["max_tokens", "max_completion_tokens", "temperature", "top_k", "seed", "logprobs", "top_logprobs",
                 "stop", "verinfer_commits", "return_tokens_as_token_ids", "bogus"]
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                     "content": st.one_of(st.text(max_size=20), _fuzz_value())})
    completion = st.dictionaries(st.sampled_from(completion_keys), _fuzz_value(), max_size=6).map(
        lambda d: {"prompt": "Hi", **d} if "prompt" not in d and len(d) % 2 else d)
    chat = st.tuples(st.lists(message, max_size=3), st.dictionaries(st.sampled_from(chat_keys), _fuzz_value(),
                                                                   max_size=4)).map(lambda t: {"messages": t[0], **t[1]})
    seen: set[int] = set()
    with serve_in_thread(backend, ServeConfig(max_tokens_limit=3)) as url, httpx.Client(base_url=url, timeout=120) as c:
        @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.one_of(completion.map(lambda b: ("/completions", b)), chat.map(lambda b: ("/chat/completions", b))))
        def check(case):
            path, body = case
            r = c.post(path, json=body)
            seen.add(r.status_code)
            assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
            if r.status_code != 200:
                err = r.json()["error"]
                assert err["message"] and err["type"] == "invalid_request_error"
            else:
                assert len(r.json()["choices"]) == 1

        check()
    assert {200, 400} <= seen  # the fuzz reached both the decoder and the validator


def test_echo_with_generation_lists_prompt_then_output_tokens(honest, backend):
    text = "Rivers flow to the"
    ids = _ids(backend, text)
    r = honest.post("/completions", json={"prompt": text, "max_tokens": 4, "echo": True, "logprobs": 1, "seed": 5,
                                          "return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(text) and len(choice["text"]) > len(text)
    assert lp["tokens"] == [f"token_id:{t}" for t in ids + choice["token_ids"]]
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    for tok, top in zip(lp["tokens"][len(ids):], lp["top_logprobs"][len(ids):]):
        assert tok in top and 1 <= len(top) <= 2  # the top-1 plus the chosen token


def test_samplers_that_need_per_request_stream_facts_are_refused_at_start():
    from verinfer.serve.config import ServeConfig

    assert ServeConfig(sampler="vllm-cpu").problems() == []
    (problem,) = ServeConfig(sampler="transformers").problems()
    assert "sampler 'transformers' cannot be served" in problem and "batch_size" in problem
