"""One proxied exchange (a client's request and the engine's response) as verifiable traces; pure.

The gateway (``verinfer.production.gateway``) changes a request in two ways only, both recorded:

- ``prepare``: a sampled request without a seed gets one when seeds are assigned (``seed_assigned``
  in the trace's meta), and ``return_token_ids: true`` is added when the client did not ask for it,
  so that vLLM returns the prompt and output token ids it really used (vLLM's extension, also
  served by ``verinfer serve``). Operator ``defaults`` fill fields a request leaves out (an engine
  whose own defaults differ from OpenAI's, like llama-cpp-python's top-k 40, then samples with
  values the trace can claim).
- ``strip_ids``: the ids the client did not ask for are cut out of the response bytes (and of
  each event of a stream) textually, so everything else reaches the client byte for byte. vLLM
  writes the fields it was not asked for as ``null`` (its non-streamed responses dump every field;
  its stream chunks set ``token_ids`` and the first chunk's ``prompt_token_ids`` explicitly, read in
  vLLM 0.32's ``chat_completion/serving.py`` and ``completion/serving.py``), so for vLLM (its
  ``/v1/models`` says ``owned_by: vllm``) the ids become ``null``; servers that omit unasked fields
  (``verinfer serve``) get them removed.

``record`` turns an exchange into traces, one per choice, with the parsers the audit uses
(``verinfer.auditing.stream.assemble`` for streams, ``verinfer.auditing.responses.parse_generation``
for each choice, ``verinfer.auditing.responses.claim_traces`` for the claim): returned ids when the
engine gives them (``token_source: returned``), else the text re-tokenized with the claimed model's
tokenizer (``retokenized``; the prompt rendered with its chat template; ``meta.drift`` counts what the
round trip loses). A trailing stop token is
kept as the engine returned it, as ``verinfer audit`` does (``verinfer verify`` scores it like any
token); re-tokenized text has none. Choice j of an ``n > 1`` request claims ``seed + j``: vLLM
seeds its children that way (REFERENCE.md sections 1.2 and 8); for other profiles such choices are
unverifiable. Choices the verifier cannot replay (sampled without a seed, penalties, logit bias,
structured output, an empty output, a stream the engine cut off before ``[DONE]``) become traces
marked ``meta.unverifiable`` with the reason,
kept apart by the recorder; an exchange that yields no trace at all raises ``Unrecordable``.

The sampler profiles (torch, numba) are imported where a claim is checked, not with this module, so
the gateway listens within a second or two; its recorder imports them on its own thread at start.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from verinfer.auditing.client import ProviderError, has_choices
from verinfer.auditing.responses import claim_traces
from verinfer.auditing.responses import parse_generation
from verinfer.auditing.stream import StreamError, assemble, events
from verinfer.production.logs import iso
from verinfer.prompts import Prompt, render
from verinfer.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from verinfer.sampling.profile_names import canonical_profile
from verinfer.trace import Trace

ENDPOINTS = {"chat/completions": "chat", "completions": "completions"}  # path under /v1 -> kind
CHILD_SEEDS = {"vllm", "vllm-v1", "vllm-v1-cuda", "vllm-cpu"}  # choice j of n uses seed + j (REFERENCE 1.2, 8)
SEED_RANGE = 2**31  # assigned seeds fit every engine's seed type (llama.cpp takes 32 bits)
# Request fields that change sampling in ways no profile replays, with their neutral values.
UNREPLAYED: dict[str, Any] = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
                              "repeat_penalty": 1, "logit_bias": None, "min_tokens": 0, "typical_p": 1,
                              "tfs_z": 1, "mirostat_mode": 0, "bad_words": None, "allowed_token_ids": None,
                              "response_format": None, "guided_json": None, "guided_regex": None,
                              "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
                              "grammar": None}


class Unrecordable(ValueError):
    """An exchange that yields no trace; the message says why (counted and logged, never dropped silently)."""


@dataclass(frozen=True)
class Prepared:
    """A request as the gateway forwards it."""

    body: bytes  # what goes upstream (the client's own bytes when nothing changed)
    request: dict[str, Any]  # the forwarded request, parsed
    seed_assigned: bool
    ids_added: bool  # return_token_ids added by the gateway: strip the ids from the response


def is_sampled(request: Mapping[str, Any]) -> bool:
    """Whether the engine samples (temperature absent means OpenAI's default of 1)."""
    t = request.get("temperature")
    return not (isinstance(t, (int, float)) and not isinstance(t, bool) and t < GREEDY_TEMPERATURE)


def prepare(raw: bytes, ask_ids: bool, seed: int | None, defaults: Mapping[str, Any] | None = None) -> Prepared | None:
    """The request to forward: ``defaults`` for absent fields, ``seed`` (None: none assigned) for a
    sampled request without one, ``return_token_ids`` when ``ask_ids``. None for a body that is not a
    JSON object (forwarded as it is; the engine answers it)."""
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    changed = False
    for key, value in (defaults or {}).items():
        if request.get(key) is None:
            request[key], changed = value, True
    assigned = seed is not None and request.get("seed") is None and is_sampled(request)
    if assigned:
        request["seed"], changed = seed, True
    added = ask_ids and request.get("return_token_ids") is not True
    if added:
        request["return_token_ids"], changed = True, True
    body = json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode() if changed else raw
    return Prepared(body, request, assigned, added)


def without_ids_request(prepared: Prepared) -> Prepared:
    """The same request without the ``return_token_ids`` the gateway added (an engine refused it)."""
    request = {k: v for k, v in prepared.request.items() if k != "return_token_ids"}
    return Prepared(json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode(), request,
                    prepared.seed_assigned, False)


_IDS = rb'"(?:prompt_)?token_ids"\s*:\s*\[[0-9,\s]*\]'
_AFTER = re.compile(rb",\s*" + _IDS)  # "...,"token_ids":[...]"
_BEFORE = re.compile(_IDS + rb"\s*,?")  # first (or only) key of its object
_NULL = re.compile(rb'("(?:prompt_)?token_ids"\s*:\s*)\[[0-9,\s]*\]')


def strip_ids(data: bytes, null: bool) -> bytes:
    """``data`` without the ``token_ids`` / ``prompt_token_ids`` lists: ``null`` in their place
    (vLLM) or the keys removed (module docstring); every other byte unchanged. A quote inside a JSON
    string is escaped, so the pattern only meets object keys."""
    if null:
        return _NULL.sub(rb"\1null", data)
    return _BEFORE.sub(b"", _AFTER.sub(b"", data))


def writes_nulls(models: object) -> bool:
    """Whether an engine writes unasked fields as ``null``, from its ``/v1/models`` answer (vLLM's
    model cards say ``owned_by: vllm``)."""
    data = models.get("data") if isinstance(models, dict) else None
    return isinstance(data, list) and any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in data)


class EventSplitter:
    """Cuts a byte stream of server-sent events at event boundaries, so each complete event can be
    rewritten (``strip_ids``) and forwarded as soon as it is whole."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, piece: bytes) -> bytes:
        data = self.pending + piece
        cut = max(data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n"))
        if cut < 0:
            self.pending = data
            return b""
        end = cut + (4 if data.startswith(b"\r\n\r\n", cut) else 2)
        self.pending = data[end:]
        return data[:end]

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest


def ends_done(seen: bytes | bytearray) -> bool:
    """Whether an event stream ends with ``data: [DONE]`` (its last event, before trailing blank lines):
    one that does not was cut off."""
    return seen[-64:].rstrip().endswith(b"[DONE]")


def stream_error_event(message: str) -> bytes:
    """An error in OpenAI's stream shape (its client raises ``APIError`` on it); the blank line first
    ends an event the cut may have left open."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "upstream_broke_off"}}
    return b"\n\ndata: " + json.dumps(body).encode() + b"\n\n"


@dataclass
class Exchange:
    """What the request path hands to the recorder: cheap to build, parsed later off the path."""

    request_id: str
    endpoint: str  # "chat" or "completions"
    request: dict[str, Any]  # as forwarded upstream
    response: bytes  # the engine's body (all events of a stream), before any stripping
    stream: bool
    requested_at: float  # epoch seconds
    responded_at: float
    seed_assigned: bool = False
    cut: str | None = None  # why the engine's stream ended before ``[DONE]`` (None: complete)

    def to_json(self) -> str:
        """One line of the recorder's journal (the response's bytes kept exactly: surrogate escapes)."""
        return json.dumps({**self.__dict__, "response": self.response.decode("utf-8", "surrogateescape")})

    @classmethod
    def from_json(cls, line: str) -> "Exchange":
        d = json.loads(line)
        return cls(**{**d, "response": d["response"].encode("utf-8", "surrogateescape")})


@dataclass(frozen=True)
class Recording:
    """How exchanges become traces: the claim the gateway records for every one."""

    provider: str
    profile: str = "vllm"
    model: str | None = None  # claimed model id; None: the id the engine reports
    tokenizer: Any = None  # the claimed model's tokenizer (re-tokenization); None: returned ids only
    stop_ids: frozenset[int] = frozenset()
    store_text: bool = True  # False: token ids only (no messages, no text)
    # (tokenizer, stop_ids) loaded when the recorder starts, on its thread, not before the gateway listens
    load: Callable[[], tuple[Any, frozenset[int]]] | None = None

    def loaded(self) -> "Recording":
        """This recording with its tokenizer loaded (itself when there is nothing to load)."""
        if self.load is None:
            return self
        tokenizer, stop_ids = self.load()
        return replace(self, tokenizer=tokenizer, stop_ids=stop_ids, load=None)


@dataclass
class Recorded:
    traces: list[Trace] = field(default_factory=list)  # verifiable
    unverifiable: list[Trace] = field(default_factory=list)  # meta["unverifiable"] says why


def _response(ex: Exchange) -> dict[str, Any]:
    try:
        text = ex.response.decode("utf-8")
        response = assemble(events(text, complete=ex.cut is None)) if ex.stream else json.loads(text)
    except StreamError as exc:
        raise Unrecordable(f"the event stream cannot be read: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Unrecordable(f"the response is not JSON ({str(exc)[:80]})") from None
    problem = has_choices(response)
    if problem:
        raise Unrecordable(f"the response cannot be recorded: {problem}")
    return response


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _messages(request: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = request.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise Unrecordable("the request's 'messages' is not a list of objects")
    return [{"role": str(m.get("role")), "content": _text(m.get("content"))} for m in messages]


def _prompt_ids(ex: Exchange, response: dict[str, Any], rec: Recording) -> tuple[list[int], str]:
    """The prompt the engine saw: its own ids (chat: top level, completions: each choice, as
    ``responses.parse_generation`` reads them), else the request's ids, else our rendering."""
    first = response["choices"][0]
    reported = first.get("prompt_token_ids", response.get("prompt_token_ids"))
    if isinstance(reported, list) and reported:
        return reported, "returned"
    prompt = ex.request.get("prompt")
    if ex.endpoint == "completions" and isinstance(prompt, list) and prompt and \
            all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt, "request"
    if rec.tokenizer is None:
        raise Unrecordable("the engine returned no prompt token ids and the gateway has no tokenizer "
                           "(start it with --model)")
    if ex.endpoint == "chat":
        pairs = tuple((m["role"], m["content"]) for m in _messages(ex.request))
        return render(rec.tokenizer, Prompt("request", pairs)), "rendered"
    if not isinstance(prompt, str) or not prompt:
        raise Unrecordable("the request's 'prompt' is neither a string nor a list of token ids")
    return rec.tokenizer.encode(prompt), "rendered"


def _number(request: Mapping[str, Any], name: str, default: float) -> Any:
    """The field, or ``default`` when absent; integers as floats where the default is one (what the
    engine does), anything else as sent (``params_problems`` then names it)."""
    value = request.get(name)
    if value is None:
        return default
    return float(value) if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool) \
        else value


def claimed_params(request: Mapping[str, Any], profile: str, index: int) -> SamplingParams:
    """What choice ``index`` claims: greedy at temperature 0, else ``profile`` with the request's
    knobs (OpenAI's defaults where absent) and seed + index (None without a seed)."""
    if not is_sampled(request):
        return SamplingParams(profile="greedy", temperature=0.0)
    seed = request.get("seed")
    top_k = _number(request, "top_k", -1)
    return SamplingParams(profile=profile, temperature=_number(request, "temperature", 1.0),
                          top_k=-1 if top_k == 0 else top_k, top_p=_number(request, "top_p", 1.0),
                          min_p=_number(request, "min_p", 0.0),
                          seed=seed + index if isinstance(seed, int) and not isinstance(seed, bool) else None)


def unverifiable_reason(request: Mapping[str, Any], profile: str, choices: int) -> str | None:
    """Why no choice of this request can be replayed (None: they can)."""
    for name, neutral in UNREPLAYED.items():
        value = request.get(name)
        if value is not None and value != neutral and value not in ({}, []):
            return f"request field {name}={json.dumps(value)[:60]} changes sampling in a way no profile replays"
    if not is_sampled(request):
        return None
    if request.get("seed") is None:
        return "sampled without a seed (start the gateway with --assign-seeds)"
    canonical = canonical_profile(profile)
    if choices > 1 and canonical not in CHILD_SEEDS:
        return (f"n={choices} with one seed: how profile {canonical!r} seeds choices after the first is not "
                f"known (vLLM profiles: seed + j)")
    return None


def record(ex: Exchange, rec: Recording) -> Recorded:
    """Traces for every choice of ``ex`` (module docstring); Unrecordable when there are none."""
    from verinfer.sampling.profiles import params_problems  # torch: off the gateway's start (module docstring)

    response = _response(ex)
    prompt, prompt_source = _prompt_ids(ex, response, rec)
    # The text goes to the parser only to be re-tokenized: with returned ids (or no tokenizer) it is
    # left out, which skips the audit's text-drift measures (a tokenizer pass per choice, off the
    # request path but on the gateway's CPU) and keeps the text for the trace.
    texts = [_choice_text(c) for c in response["choices"]]
    parsed = {**response, "choices": [
        {k: v for k, v in c.items() if k not in ("text", "message")}
        if isinstance(c, dict) and (rec.tokenizer is None or isinstance(c.get("token_ids"), list)) else c
        for c in response["choices"]]}
    vocab = len(rec.tokenizer) if rec.tokenizer is not None else 2**63
    claims = []
    for i in range(len(response["choices"])):
        where = f"request {ex.request_id} choice {i}"
        stored = {"prompt_id": f"{ex.request_id}/{i}", "index": i, "prompt_token_ids": prompt,
                  "response": parsed, "request": ex.request}
        try:
            claim = parse_generation(stored, rec.tokenizer, set(rec.stop_ids), vocab, where, i)
        except ProviderError as exc:
            raise Unrecordable(str(exc)) from None
        except (KeyError, TypeError, AttributeError) as exc:
            raise Unrecordable(f"{where}: malformed choice ({type(exc).__name__}: {exc})") from None
        claim.text = texts[i]
        claims.append(claim)
    model = rec.model or str(response.get("model") or ex.request.get("model") or "unknown")
    traces = claim_traces(claims, rec.provider, model, lambda i: claimed_params(ex.request, rec.profile, i))
    reason = unverifiable_reason(ex.request, rec.profile, len(claims))
    messages = _messages(ex.request) if rec.store_text and ex.endpoint == "chat" else None
    prompt_text = ex.request.get("prompt") if rec.store_text and isinstance(ex.request.get("prompt"), str) else None
    out = Recorded()
    for claim, trace in zip(claims, traces):
        meta = {**trace.meta, "request_id": ex.request_id, "upstream_id": response.get("id"),
                "endpoint": ex.endpoint, "stream": ex.stream, "request_time": iso(ex.requested_at),
                "response_time": iso(ex.responded_at), "prompt_source": prompt_source,
                "seed_assigned": ex.seed_assigned, "served_model": response.get("model")}
        if claim.drift:
            meta["drift"] = claim.drift
        problems = params_problems(trace.sampling)
        cut = f"the engine's stream was cut off ({ex.cut}): the output is incomplete" if ex.cut else None
        why = cut or reason or (f"sampling: {problems[0]}" if problems else None) or \
            (None if claim.output_token_ids else "empty output: nothing to verify")
        if why:
            meta["unverifiable"] = why
        trace = replace(trace, meta=meta, messages=messages, prompt_text=prompt_text,
                        output_text=trace.output_text if rec.store_text else None)
        (out.unverifiable if why else out.traces).append(trace)
    return out


def _choice_text(choice: Any) -> str | None:
    if not isinstance(choice, dict):
        return None
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else None
