"""An OpenAI-compatible HTTP client for audits: bounded concurrency, timeouts, retries, persistence.

Transient failures (connection errors, timeouts, 5xx, 429) are retried with exponential backoff
and full jitter, honouring ``Retry-After``; anything else stops the audit with one line naming the
provider, the endpoint and what was wrong. Every accepted response is written to the provider's
``ResponseStore`` (fsync'd) before the caller sees it, and requests already in the store are never
sent again. Responses that are not JSON or lack the fields every caller needs are kept in a
``rejected.jsonl`` beside the store (they were paid for) and reported. The API key is read from
an environment variable at request time and only ever placed in the ``Authorization`` header; it
and any ``user:password@`` in the base URL are registered with ``verinfer.auditing.secrets`` so that
error messages, stored responses and reports never contain them.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

import httpx

from verinfer.auditing.pacing import OVERLOADED, Pacer
from verinfer.auditing.secrets import redact, redact_text, remember, remember_url
from verinfer.auditing.store import ResponseStore, request_key
from verinfer.auditing.stream import StreamError, assemble, events

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class ProviderError(ValueError):
    """A provider that cannot be audited as asked; the message names the provider and what failed.

    A ValueError, like every other input error, so the command line reports it as one line. The
    message is redacted (``verinfer.auditing.secrets``): a provider that echoes the key in an error
    body does not get it printed."""

    def __init__(self, message: str):
        super().__init__(redact_text(str(message)))


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI-compatible endpoint: a name for reports, its base URL (ending in ``/v1``), the
    model id it serves, and the environment variable holding its API key (unset: no key sent)."""

    name: str
    base_url: str
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"

    def __post_init__(self):
        remember_url(self.base_url)
        self.api_key()

    def api_key(self) -> str | None:
        """The key from the environment (registered for redaction), or None."""
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        remember(key)
        return key or None

    def headers(self) -> dict[str, str]:
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def display_url(self) -> str:
        """The base URL as reports and messages show it: without ``user:password@``."""
        return redact_text(self.base_url)

    def url(self, path: str) -> str:
        """The request URL for ``path``: joined to the base URL's path, before its query string."""
        parts = urlsplit(self.base_url)
        return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + path.lstrip("/"), fragment=""))


ENDPOINT_FIELDS = {"name": True, "url": True, "model": False, "api_key_env": False}  # field -> required


def endpoints_from_file(path: str | os.PathLike, model: str, api_key_env: str | None) -> list[Endpoint]:
    """Endpoints from a JSON list of ``{name, url, model?, api_key_env?}`` objects.

    Anything else (not JSON, not a list, an entry that is not an object, a missing, unknown or
    non-string field, a URL that is not http(s)) is a ``ValueError`` naming the file and the entry.
    """
    what = "a JSON list of {name, url, model?, api_key_env?} objects"
    try:
        entries = json.loads(open(path, encoding="utf-8").read())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                         f"expected {what}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; expected {what}") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected {what}, got a JSON {type(entries).__name__}")
    out = []
    for i, entry in enumerate(entries):
        where = f"{path}: entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object {{name, url, model?, api_key_env?}}, "
                             f"got a JSON {type(entry).__name__}")
        if isinstance(entry.get("name"), str):
            where += f" ({entry['name']!r})"
        unknown = sorted(set(entry) - set(ENDPOINT_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                             f"expected {', '.join(ENDPOINT_FIELDS)}")
        for name, required in ENDPOINT_FIELDS.items():
            if name not in entry:
                if required:
                    raise ValueError(f"{where}: field {name!r} is missing")
                continue
            value = entry[name]
            if not (isinstance(value, str) and value) and not (name == "api_key_env" and value is None):
                raise ValueError(f"{where}: field {name!r} must be a non-empty string, got "
                                 f"{redact_text(json.dumps(value))[:80]}")
        if not entry["url"].startswith(("http://", "https://")):
            raise ValueError(f"{where}: field 'url' must be an http(s) base URL ending in /v1, got "
                             f"{redact_text(entry['url'])[:120]!r}")
        out.append(Endpoint(entry["name"], entry["url"], entry.get("model", model),
                            entry.get("api_key_env", api_key_env)))
    return out


@dataclass(frozen=True)
class Call:
    """One request to make: endpoint path, JSON body, and metadata stored with the response."""

    path: str
    body: dict[str, Any]
    meta: dict[str, Any]

    @property
    def key(self) -> str:
        return request_key(self.path, self.body)


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how much the client waits for a provider, and how often it tries again.

    ``timeout_s`` bounds each network operation (connect, each read, write), so a provider that
    trickles bytes (an endless event stream, a comment every few seconds) never trips it;
    ``deadline_s`` bounds a whole attempt, from sending the request to the body's last byte, and
    ``max_response_bytes`` the body read into memory. A response cut short by either is kept as
    rejected (its head, like every rejected body) and stops the audit without a retry: asking again
    would pay for the same endless answer."""

    retries: int = 4  # extra attempts after the first
    backoff_s: float = 0.5  # base of the exponential backoff
    max_backoff_s: float = 30.0
    timeout_s: float = 120.0  # per network operation (connect, read, write, pool)
    deadline_s: float = 600.0  # per attempt, request sent to last byte received
    max_response_bytes: int = 64 * 2**20  # decoded body bytes read per response

    def problems(self) -> list[str]:
        out = [f"{name} must be > 0, got {value}" for name, value in
               (("timeout", self.timeout_s), ("deadline", self.deadline_s), ("max response size", self.max_response_bytes))
               if not value > 0]
        return out + ([f"retries must be >= 0, got {self.retries}"] if self.retries < 0 else [])

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Full-jitter exponential backoff, or the server's Retry-After when it says more."""
        jittered = random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2**attempt))
        return min(max(jittered, retry_after or 0.0), max(self.max_backoff_s, 1.0) * 4)


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when else None


def has_choices(response: Any) -> str | None:
    """The shape every completion or chat response must have; a problem phrase, or None."""
    if not isinstance(response, dict):
        return f"the body is a JSON {type(response).__name__}, expected an object"
    if "error" in response and "choices" not in response:
        return f"it returned an error object: {str(response['error'])[:200]}"
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "field 'choices' is missing or not a non-empty list of objects"
    return None


class ProviderClient:
    """Sends ``Call``s to one endpoint, at most ``concurrency`` at a time, persisting each response."""

    def __init__(self, endpoint: Endpoint, store: ResponseStore, concurrency: int = 4,
                 policy: RetryPolicy = RetryPolicy(), check: Callable[[Any], str | None] = has_choices,
                 transport: httpx.AsyncBaseTransport | None = None, on_retry: Callable[[str], None] | None = None):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if policy.problems():
            raise ValueError(policy.problems()[0])
        self.endpoint, self.store, self.concurrency, self.policy, self.check = endpoint, store, concurrency, policy, check
        self.transport = transport
        self.on_retry = on_retry  # hears each timeout or failure that is retried, as it happens
        # in flight: at most `concurrency`, halved while the server cannot keep up (verinfer.auditing.pacing)
        self.pacer = Pacer(concurrency, policy.timeout_s / 2,
                           on_change=(lambda what: on_retry(f"{endpoint.name}: {what}")) if on_retry else None)
        self.rejected = ResponseStore(store.path.with_name("rejected.jsonl"))
        self.sent = 0  # HTTP attempts made by this client (retries included)

    def fetch(self, calls: Sequence[Call], on_done: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
        """Stored records for ``calls`` (in order), requesting only those not stored yet."""
        missing = list({c.key: c for c in calls if c.key not in self.store}.values())
        if missing:
            asyncio.run(self._fetch_all(missing, on_done))
        return [self.store.get(c.key) for c in calls]

    async def _fetch_all(self, calls: list[Call], on_done) -> None:
        failed: list[BaseException] = []
        limits = httpx.Limits(max_connections=self.concurrency)
        timeout = httpx.Timeout(self.policy.timeout_s)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=self.transport) as http:
            async def one(call: Call) -> None:
                try:
                    stored = await self._fetch_one(http, call, failed)
                except ProviderError as exc:
                    failed.append(exc)
                    return
                if on_done and stored:
                    on_done(1)

            await asyncio.gather(*(one(c) for c in calls))
        if failed:
            raise failed[0]

    async def _fetch_one(self, http: httpx.AsyncClient, call: Call, failed: list[BaseException]) -> bool:
        """One call, retried as the policy says; each attempt waits for a place under the pacer's limit
        (none is sent once another call has failed the audit: it could not finish). Whether it was stored."""
        url = self.endpoint.url(call.path)
        where = f"provider {self.endpoint.name!r} ({redact_text(url)})"
        attempt = 0
        while True:
            retry_after, problem = None, None
            sent = await self.pacer.acquire()
            if failed:  # stop paying for more once the audit cannot finish
                await self.pacer.release()
                return False
            self.sent += 1
            try:
                started = time.monotonic()
                resp, cut, head_s = await self._receive(http, url, call)
                elapsed = time.monotonic() - started
            except httpx.TimeoutException:
                problem = f"timed out after {self.policy.timeout_s:g} s"
                self.pacer.failed(sent, "time-outs")
            except httpx.TransportError as exc:
                problem = f"connection failed ({type(exc).__name__}: {redact_text(str(exc))[:120] or 'no detail'})"
            else:
                if resp is not None and resp.status_code in OVERLOADED:
                    self.pacer.failed(sent, f"HTTP {resp.status_code}")
                elif head_s is not None:  # how long the server kept it before answering: its queue shows here
                    self.pacer.answered(sent, head_s)
            finally:
                await self.pacer.release()
            if problem is None:
                if cut is not None:  # kept (paid for) and final: a retry would get the same endless answer
                    text = redact_text(resp.text)[:100_000] if resp is not None else ""
                    self.rejected.append(call.key, call.path, call.body, text, **call.meta, cut=cut,
                                         status=resp.status_code if resp is not None else None,
                                         received_bytes=len(resp.content) if resp is not None else 0,
                                         elapsed_s=round(elapsed, 4), attempts=attempt + 1, received_at=time.time())
                    raise ProviderError(f"{where}: request {call.key} ({_describe(call)}): {cut}; what was received "
                                        f"is kept in {self.rejected.path}")
                if resp.status_code == 200:
                    break
                problem = f"HTTP {resp.status_code}: {_error_text(resp)}"
                if resp.status_code not in RETRY_STATUS:
                    raise ProviderError(f"{where}: request {call.key} ({_describe(call)}) was refused: {problem}")
                retry_after = retry_after_seconds(resp.headers.get("retry-after"))
            if attempt >= self.policy.retries:
                raise ProviderError(f"{where}: request {call.key} ({_describe(call)}) failed after "
                                    f"{attempt + 1} attempt(s): {problem}")
            delay = self.policy.delay(attempt, retry_after)
            if self.on_retry is not None:
                self.on_retry(f"{self.endpoint.name}: request {call.key} ({_describe(call)}): {problem}; "
                              f"retry {attempt + 1} of {self.policy.retries} in {delay:.1f} s")
            await asyncio.sleep(delay)
            attempt += 1
        meta = {**call.meta, "elapsed_s": round(elapsed, 4), "attempts": attempt + 1, "received_at": time.time()}
        try:  # redacted before anything is cut short, so no prefix of a key survives
            if call.body.get("stream"):  # server-sent events, joined into one response (verinfer.auditing.stream)
                chunks = events(resp.text)
                payload = redact(assemble(chunks))
                meta["stream_chunks"] = len(chunks)
            else:
                payload = redact(resp.json())
        except StreamError as exc:
            self.rejected.append(call.key, call.path, call.body, redact_text(resp.text)[:100_000], **meta)
            raise ProviderError(f"{where}: request {call.key} ({_describe(call)}): the event stream is malformed: "
                                f"{redact_text(str(exc))}; kept in {self.rejected.path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            text = redact_text(resp.text)
            self.rejected.append(call.key, call.path, call.body, text[:100_000], **meta)
            raise ProviderError(f"{where}: request {call.key} ({_describe(call)}): the response is not JSON "
                                f"(starts {text[:60]!r}); kept in {self.rejected.path}") from None
        problem = self.check(payload)
        if problem:
            self.rejected.append(call.key, call.path, call.body, payload, **meta)
            raise ProviderError(f"{where}: request {call.key} ({_describe(call)}): malformed response: {problem}; "
                                f"kept in {self.rejected.path}")
        self.store.append(call.key, call.path, call.body, payload, **meta)
        return True


    async def _receive(self, http: httpx.AsyncClient, url: str,
                       call: Call) -> tuple[httpx.Response | None, str | None, float | None]:
        """The response with at most ``max_response_bytes`` of its body, read as it streams in; why it
        was cut short (the deadline passed, or the body is larger), or None when it is whole; and the
        seconds until its status line came (None when it did not). The response is None only when the
        deadline passed before the status line arrived."""
        limit, received, head, head_s = self.policy.max_response_bytes, bytearray(), None, None
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.policy.deadline_s):
                # The key lets a server that keeps results per key (``verinfer serve``) hand a retry the
                # decoding its timed-out attempt started, instead of starting again.
                headers = {**self.endpoint.headers(), "Idempotency-Key": call.key}
                async with http.stream("POST", url, json=call.body, headers=headers) as head:
                    head_s = time.monotonic() - started
                    async for chunk in head.aiter_bytes():
                        received += chunk
                        if len(received) > limit:
                            del received[limit:]
                            return _with_body(head, received), (f"the response is larger than the limit of "
                                                                f"{limit:,} bytes"), head_s
        except TimeoutError:  # asyncio's deadline (httpx's own timeouts are httpx.TimeoutException)
            return (None if head is None else _with_body(head, received),
                    f"no complete response within the deadline of {self.policy.deadline_s:g} s "
                    f"({len(received):,} bytes received)", head_s)
        return _with_body(head, received), None, head_s


def _with_body(resp: httpx.Response, body: bytes | bytearray) -> httpx.Response:
    """A finished response carrying ``body`` (already decoded) as its content, for ``.text`` and ``.json()``."""
    headers = [(k, v) for k, v in resp.headers.multi_items()
               if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
    return httpx.Response(resp.status_code, headers=headers, content=bytes(body), request=resp.request)


def _describe(call: Call) -> str:
    return ", ".join(f"{k} {v}" for k, v in call.meta.items() if k in ("prompt_id", "kind")) or call.path


def _error_text(resp: httpx.Response) -> str:
    """The gist of an error body, redacted before it is shortened."""
    try:
        body = redact(resp.json())
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message", body["error"]))[:200]
        return json.dumps(body)[:200]
    except (json.JSONDecodeError, UnicodeDecodeError):
        return redact_text(resp.text)[:200] or resp.reason_phrase
