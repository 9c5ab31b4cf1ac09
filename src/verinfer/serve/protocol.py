"""Request bodies of the OpenAI-compatible API, validated strictly, and errors in OpenAI's shape.

Unknown fields are refused (``extra="forbid"``) so a typo or an unsupported option never silently
means a default; every error names the field (``param``) and says what is wrong with it.
Field names, defaults and ranges follow OpenAI and vLLM: ``top_k`` -1 or 0 disables it (as does
any value at or above the vocabulary size), ``temperature`` 0 is greedy, ``return_token_ids`` is
vLLM's extension, ``verinfer_commits`` ours. Every number has bounds: integers that reach the
sampler fit int64, so no value can fail while a batch's tensors are built.

``decode_body`` turns raw bytes into the JSON value ``parse`` validates, refusing what would make
parsing itself fail or explode: bodies that are not UTF-8, nesting deeper than ``MAX_DEPTH``
(checked by a linear scan before parsing), lone UTF-16 surrogates (``"\\ud800"``, which no tokenizer
or response can encode), and integers of more than ``MAX_INT_DIGITS`` digits (parsed into a
placeholder that validation then refuses, naming the field).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

INT64 = 2**63
MAX_LOGPROBS = 20
MAX_N = 16  # completions per request (Model Equality Testing uses about 10 per prompt)
MAX_DEPTH = 32  # our bodies nest 4 deep (messages[i].content[j].text)
MAX_INT_DIGITS = 40  # every integer field is bounded far below this


class APIError(Exception):
    """An error the API returns as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CommitsRequest(_Strict):
    """``verinfer_commits``: activation commits to attach (see ``verinfer.commits.trace_commits``)."""

    fingerprint_dim: int = Field(0, ge=0, le=2**20)
    fingerprint_precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    fingerprint_stride: int = Field(1, ge=1, le=2**20)
    toploc: bool = False

    @model_validator(mode="after")
    def _some(self) -> "CommitsRequest":
        if not self.fingerprint_dim and not self.toploc:
            raise ValueError("asks for no commit: set fingerprint_dim > 0 and/or toploc: true")
        return self


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices (OpenAI)."""

    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, lt=INT64, json_schema_extra={"minimum": -1})
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    verinfer_commits: CommitsRequest | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``null`` for a field with a default means the default (as vLLM and many clients treat it)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default is not None)}
        return data

    @field_validator("temperature", "top_p", "min_p", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"must be a number, got {v!r}")
        try:
            return float(v)
        except OverflowError:
            raise ValueError(f"must be a number in the float range, got an integer of {len(str(abs(v)))} digits") from None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"must be -1 or 0 (disabled) or a positive integer, got {v}")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is None:
            return None
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops


_PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]}


class CompletionRequest(_Sampling):
    prompt: Any = Field(json_schema_extra=_PROMPT_SCHEMA)
    max_tokens: int = Field(16, ge=0, lt=INT64)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _echo(self) -> "CompletionRequest":
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream: true; send stream: false to echo the prompt")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, str):
            if not v:
                raise ValueError("must be a non-empty string or a non-empty list of token ids")
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(t, (str, list)) for t in v):
            raise ValueError("batched prompts are not supported: send one prompt (a string or a list of "
                             "token ids) per request")
        raise ValueError(f"must be a non-empty string or a non-empty list of token ids, got {type(v).__name__}")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, lt=INT64)
    max_completion_tokens: int | None = Field(None, ge=0, lt=INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _consistent(self) -> "ChatRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def _message(err: dict) -> str:
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] == "extra_forbidden":
        return "unknown field (not supported by this server)"
    if err["type"] == "missing":
        return "required field is missing"
    got = err.get("input")
    if err["type"] not in ("value_error", "assertion_error") and not isinstance(got, (dict, list)):
        msg += f" (got {got!r})"
    return msg


class HugeInt:
    """A JSON integer of more than ``MAX_INT_DIGITS`` digits: kept as a placeholder, refused by validation."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _parse_int(text: str) -> int | HugeInt:
    return int(text) if len(text) <= MAX_INT_DIGITS else HugeInt(text)


def nesting_depth(raw: bytes) -> int:
    """The deepest ``[``/``{`` nesting of a JSON text (UTF-8), outside strings, in one vectorized pass.

    A quote is a string delimiter unless an odd run of backslashes precedes it. Exact for valid
    JSON; for invalid JSON it bounds the nesting the parser can reach before it finds the error.
    """
    a = np.frombuffer(raw, dtype=np.uint8)
    if not a.size:
        return 0
    idx = np.arange(a.size)
    backslash = a == ord("\\")
    last_other = np.maximum.accumulate(np.where(backslash, -1, idx))  # last non-backslash at or before i
    run_before = np.empty(a.size, dtype=np.int64)
    run_before[0] = 0
    run_before[1:] = idx[:-1] - last_other[:-1]  # backslashes right before i
    quote = (a == ord('"')) & (run_before % 2 == 0)
    inside = np.cumsum(quote) % 2 == 1  # within a string (an opening quote counts as inside)
    step = np.zeros(a.size, dtype=np.int64)
    step[(a == ord("[")) | (a == ord("{"))] = 1
    step[(a == ord("]")) | (a == ord("}"))] = -1
    step[inside] = 0
    return int(np.cumsum(step).max(initial=0))


def _bad_string(value: Any, loc: tuple = ()) -> tuple | None:
    """Where a string (or key) that cannot be UTF-8 encoded (a lone surrogate) sits, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return loc
    elif isinstance(value, dict):
        for k, v in value.items():
            if _bad_string(k) is not None:
                return (*loc, k.encode("utf-8", "backslashreplace").decode("ascii"))
            found = _bad_string(v, (*loc, k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _bad_string(v, (*loc, i))
            if found is not None:
                return found
    return None


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body; APIError (400) for what is not UTF-8 JSON we can take."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"request body is not valid UTF-8 ({exc})") from None
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise APIError(f"request body nests {depth} levels deep; at most {MAX_DEPTH} are accepted")
    try:
        data = json.loads(text, parse_int=_parse_int)
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise APIError(f"request body is not valid JSON ({exc})") from None
    where = _bad_string(data)
    if where is not None:
        param = _param(where)
        raise APIError(f"{param or 'request body'}: the text contains a lone UTF-16 surrogate (e.g. \"\\ud800\"), "
                       "which is not valid Unicode", param)
    return data


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON body; APIError (400) naming the first bad field, with all problems listed."""
    if not isinstance(data, dict):
        raise APIError(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # Keep the most specific error per field (unions report one per alternative).
        seen: dict[str | None, str] = {}
        for e in errors:
            loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "list"))))
            seen.setdefault(_param(loc), _message(e))
        message = "; ".join(f"{p}: {m}" if p else m for p, m in seen.items())
        raise APIError(message, param=next(iter(seen))) from None
