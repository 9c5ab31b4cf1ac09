"""Keep credentials off the terminal and the disk: one redaction used by everything the audit prints,
raises or stores.

Two kinds of secret are removed:

- API keys. An ``Endpoint`` registers the key it reads from its environment variable (``remember``);
  from then on ``redact`` replaces ``Bearer <key>`` and the bare key with ``[REDACTED]`` wherever it
  appears: in raw provider bodies before they are persisted (``responses.jsonl``, ``rejected.jsonl``),
  in error messages, in ``audit.json`` and ``audit.html``. Keys shorter than ``MIN_SECRET_CHARS``
  are only redacted in their ``Bearer <key>`` form, so a toy key such as ``"x"`` cannot erase every
  ``x`` in a paid-for output.
- Credentials in URLs: ``scheme://user:password@host`` becomes ``scheme://[REDACTED]@host`` in any
  string, registered or not; an endpoint's URL password (and the ``user:password`` pair, plain and
  base64 as HTTP basic auth sends it, so an echoed ``Authorization`` header is caught too) is
  registered like a key.
- Query strings. Parameters that carry credentials by name (``api_key``, ``key``, ``token``,
  ``access_token``, ``secret``, ``password``, ``sig``, ``signature``, ...; e.g. ``?api-key=...`` as
  some gateways take it) keep their name and lose their value, in any string. A provider's or
  reference's own URL is trusted with nothing: every parameter of its query, whatever its name
  (``?subscription-key=...``, ``?region=...``), loses its value wherever ``name=value`` follows a
  ``?`` or ``&`` (also ``&amp;`` as HTML writes it), and each value is registered like a key, so a
  bare echo of a value of ``MIN_SECRET_CHARS`` or more is caught too.

The registry is process-wide on purpose: responses are redacted where they are written
(``store.ResponseStore.append``), far from the endpoint that knows the key.
"""

from __future__ import annotations

import base64
import re
import threading
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

REDACTED = "[REDACTED]"
MIN_SECRET_CHARS = 8

_URL_CREDENTIALS = re.compile(r"(?<=://)[^/\s@:'\"<>]+:[^/\s@'\"<>]*@")
_SECRET_PARAMS = ("api_key", "api-key", "apikey", "key", "token", "access_token", "auth", "secret",
                  "password", "passwd", "sig", "signature", "x-api-key", "code")
_lock = threading.Lock()
_secrets: set[str] = set()  # replaced wherever they appear
_bearer: set[str] = set()  # short keys: replaced only after "Bearer "
_pattern: re.Pattern | None = None
_params: set[str] = {n.lower() for n in _SECRET_PARAMS}  # query parameters whose values are replaced


def _query_pattern(names: set[str]) -> re.Pattern:
    """``?name=value`` / ``&name=value`` / ``&amp;name=value`` for any of ``names``, value up to the next
    separator."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(r"(?i)((?:[?&]|&amp;)(?:" + alternatives + r")=)[^&#\s'\"<>]+")


_query_secret = _query_pattern(_params)


def remember(secret: str | None) -> None:
    """Register a secret (an API key, a URL password) so that ``redact`` removes it from now on."""
    global _pattern
    if not secret or not isinstance(secret, str):
        return
    with _lock:
        target = _secrets if len(secret) >= MIN_SECRET_CHARS else _bearer
        if secret in target:
            return
        target.add(secret)
        alternatives = [r"Bearer\s+" + re.escape(s) for s in sorted(_secrets | _bearer, key=len, reverse=True)]
        alternatives += [re.escape(s) for s in sorted(_secrets, key=len, reverse=True)]
        _pattern = re.compile("|".join(alternatives))


def remember_url(url: str) -> None:
    """Register the password (and the ``user:password`` pair) embedded in ``url``, if any, and every
    parameter of its query string: its name (so ``name=value`` is redacted in any string) and its value."""
    global _query_secret
    try:
        parts = urlsplit(url)
    except ValueError:
        return
    for name, value in parse_qsl(parts.query, keep_blank_values=False):
        remember(value)
        remember(quote(value, safe=""))
        for spelling in (name, quote(name, safe="")):
            if spelling and spelling.lower() not in _params:
                with _lock:
                    _params.add(spelling.lower())
                    _query_secret = _query_pattern(_params)
    if parts.password:
        user, password = unquote(parts.username or ""), unquote(parts.password)
        remember(password)
        pair = f"{user}:{password}"
        remember(pair)
        remember(base64.b64encode(pair.encode("utf-8")).decode("ascii"))


def redact_text(text: str) -> str:
    """``text`` with every registered secret and every ``user:password@`` in a URL replaced."""
    if "://" in text:
        text = _URL_CREDENTIALS.sub(REDACTED + "@", text)
    if "=" in text:
        text = _query_secret.sub(lambda m: m.group(1) + REDACTED, text)
    pattern = _pattern
    return pattern.sub(REDACTED, text) if pattern is not None else text


def redact(value: Any) -> Any:
    """A copy of ``value`` with secrets removed from every string in it (dict keys and values, list
    and tuple items); anything else is returned as it is."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {redact(k): redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact(v) for v in value)
    return value
