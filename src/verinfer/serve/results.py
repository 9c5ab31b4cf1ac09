"""Results kept per ``Idempotency-Key``, so that a retried request finds its work instead of redoing it.

An audit on a busy machine used to make no progress: the client's timeout abandoned each request,
the server dropped it, and the retry started from zero. A request that sends an
``Idempotency-Key`` header (as Stripe's and the IETF draft's idempotent POST do; the audit client
sends one per request) is decoded once per key: its decoding goes on when its client leaves
(counted as ``detached`` in ``/health``), a request with the same key joins the decoding still
running or gets the finished result, and the result is kept for ``ttl_s`` after it finished (at
most ``max_kept`` results; the oldest finished go first). The same key with another body is
refused (422, ``idempotency_key_reused``); a decoding that failed is forgotten, so a retry starts
afresh. Requests without the header are not affected: an abandoned one still stops at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from verinfer.serve.protocol import APIError

MAX_KEY_CHARS = 255


@dataclass
class _Kept:
    fingerprint: str
    task: asyncio.Future
    finished_at: float | None = None


def check_key(value: str | None) -> str | None:
    """The header's value, or None when absent; 400 naming the header when it is unusable."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_KEY_CHARS or not all(33 <= ord(c) <= 126 for c in value):
        raise APIError(f"Idempotency-Key: give 1 to {MAX_KEY_CHARS} visible ASCII characters", "Idempotency-Key")
    return value


class Results:
    """The decodings (asyncio tasks) and results kept per key, on the server's event loop."""

    def __init__(self, ttl_s: float, max_kept: int):
        self.ttl_s, self.max_kept = ttl_s, max_kept
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self.reused = 0  # requests that joined a decoding or got a result kept for their key
        self.detached = 0  # requests whose client left while their keyed decoding went on

    def __len__(self) -> int:
        return len(self._kept)

    def task(self, key: str, fingerprint: str, start: Callable[[], Awaitable[Any]]) -> asyncio.Future:
        """The decoding for ``key``: the one running or finished, or ``start()`` begun now."""
        self._evict(time.monotonic())
        kept = self._kept.get(key)
        if kept is not None:
            if kept.fingerprint != fingerprint:
                raise APIError("Idempotency-Key: this key was used with another request body; use a new key",
                               "Idempotency-Key", 422, code="idempotency_key_reused")
            self.reused += 1
            return kept.task
        task = asyncio.ensure_future(start())
        self._kept[key] = kept = _Kept(fingerprint, task)

        def finished(t: asyncio.Future) -> None:
            if t.cancelled() or t.exception() is not None:  # a retry starts afresh
                if self._kept.get(key) is kept:
                    del self._kept[key]
            else:
                kept.finished_at = time.monotonic()

        task.add_done_callback(finished)
        return task

    async def wait(self, task: asyncio.Future, gone: Callable[[], Awaitable[bool]], poll_s: float) -> Any:
        """``task``'s result; when ``gone()`` says the client left, stop waiting (the task goes on)."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await gone():
                self.detached += 1
                raise APIError("the client disconnected", status=499, code="client_disconnected")

    def _evict(self, now: float) -> None:
        for key in [k for k, e in self._kept.items() if e.finished_at is not None and now - e.finished_at > self.ttl_s]:
            del self._kept[key]
        finished = [k for k, e in self._kept.items() if e.finished_at is not None]
        for key in finished[: max(0, len(self._kept) - self.max_kept + 1)]:
            del self._kept[key]
