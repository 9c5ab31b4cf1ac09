"""Alerts: a webhook called when a series' verdict changes, found by polling the verification history.

The monitor only writes windows; a dashboard process polls them (``Alerter.poll``), so verification
is never blocked or slowed by an alert. A *change* is a window whose verdict (CONSISTENT /
INCONSISTENT) differs from the series' previous verdict (``views.mark_changes``' rule), and a series
first seen INCONSISTENT. Each change is alerted once: the last verdict seen per series and the alerts
not yet delivered (or given up on) are kept in a small JSON state file (written atomically), so a
restarted dashboard neither repeats a delivered one nor loses one. Without a state file the first
poll only takes each series' current verdict (a start does not alert on history).

Delivery runs on its own thread: a JSON POST per change, retried with exponential backoff (1 s, 2 s,
4 s, ... capped, for ``retries`` attempts) on a network error or a 5xx / 429; a 4xx other than 429 is
not retried. The webhook URL is never logged beyond its scheme and host (it often carries a token).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from verinfer.files import write_atomic
from verinfer.production import views
from verinfer.production.store import Window

log = logging.getLogger("verinfer.alerts")
FORMAT = "verinfer.alerts/1"


def webhook_host(url: str) -> str:
    """What may be logged of a webhook URL: scheme and host."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}{f':{parts.port}' if parts.port else ''}"


def series_id(key: views.Key) -> str:
    return json.dumps([key.provider, key.model, key.profile, key.seconds])


@dataclass
class Seen:
    """The last verdict window seen in a series."""

    verdict: str
    window: int
    start: str  # ISO-8601 UTC


def alert_body(key: views.Key, w: Window, previous: str | None, link: str) -> dict[str, Any]:
    """The webhook's JSON: who, which window, the new verdict and the one it replaces."""
    return {"event": "verdict_changed", "provider": key.provider, "model": key.model, "profile": key.profile,
            "window_seconds": key.seconds,
            "window": {"id": w.id, "start": w.start_time.isoformat() + "Z", "end": w.end_time.isoformat() + "Z",
                       "tokens": w.tokens, "traces": w.traces},
            "verdict": w.verdict, "previous": previous, "p_value": w.p_value, "note": w.note, "link": link}


class Alerter:
    """Polls for verdict changes and posts each once to ``url``."""

    def __init__(self, engine: Engine, url: str, state_file: Path, link: Callable[[int], str], *,
                 retries: int = 8, backoff_s: float = 1.0, max_backoff_s: float = 60.0, timeout_s: float = 10.0):
        self.engine, self.url, self.state_file, self.link = engine, url, Path(state_file), link
        self.retries, self.backoff_s, self.max_backoff_s, self.timeout_s = retries, backoff_s, max_backoff_s, timeout_s
        self.seen: dict[str, Seen] = {}
        self.pending: list[dict] = []  # detected, not yet delivered
        self.delivered = 0
        self.failed = 0
        self._baseline = True
        self._lock = threading.Lock()
        self._queue: queue.Queue[dict | None] = queue.Queue()
        self._stop = threading.Event()
        self._load()
        self._sender = threading.Thread(target=self._send_loop, name="verinfer-alerts", daemon=True)
        self._sender.start()
        for body in list(self.pending):  # undelivered before a restart
            self._queue.put(body)

    # -- state ----------------------------------------------------------------------------------------

    def _load(self) -> None:
        if not self.state_file.exists():
            return
        try:
            data = json.loads(self.state_file.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            self.seen = {k: Seen(**v) for k, v in data["seen"].items()}
            self.pending = list(data["pending"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--alert-state {self.state_file}: not a {FORMAT} file ({exc})") from None
        self._baseline = False

    def _save(self) -> None:
        with self._lock:
            doc = {"format": FORMAT, "seen": {k: asdict(v) for k, v in self.seen.items()}, "pending": self.pending}
        write_atomic(self.state_file, json.dumps(doc, indent=1))

    # -- detection ------------------------------------------------------------------------------------

    def poll(self) -> list[dict]:
        """Find changes since the last poll, queue them for delivery; the alerts queued."""
        found: list[dict] = []
        with Session(self.engine) as s:
            for key, *_ in views.keys(s, views.Filters()):
                found += self._series(s, key)
        self._baseline = False
        if found:
            with self._lock:
                self.pending += found
        self._save()
        for body in found:
            self._queue.put(body)
        return found

    def _series(self, s: Session, key: views.Key) -> list[dict]:
        sid = series_id(key)
        seen = self.seen.get(sid)
        decided = select(Window).where(key.where(), Window.verdict.in_(views.VERDICTS))
        if seen is None and self._baseline:
            latest = views.last_decided(s, key)
            if latest is not None:
                self.seen[sid] = Seen(latest.verdict, latest.id, latest.start_time.isoformat())
            return []
        if seen is not None:
            decided = decided.where(Window.start_time >= dt.datetime.fromisoformat(seen.start))
        out = []
        last = seen.verdict if seen is not None else None
        for w in s.scalars(decided.order_by(Window.start_time)).all():
            if w.verdict != last and (last is not None or w.verdict == "INCONSISTENT"):
                out.append(alert_body(key, w, last, self.link(w.id)))
            last = w.verdict
            self.seen[sid] = Seen(w.verdict, w.id, w.start_time.isoformat())
        return out

    # -- delivery -------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                body = self._queue.get()
                try:
                    if body is None:
                        return
                    ok = self._deliver(client, body)
                    with self._lock:
                        if ok and body in self.pending:  # one given up on stays pending: sent again on restart
                            self.pending.remove(body)
                        self.delivered += ok
                        self.failed += not ok
                    self._save()
                finally:
                    self._queue.task_done()

    def _deliver(self, client: httpx.Client, body: dict) -> bool:
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                resp = client.post(self.url, json=body)
                if resp.status_code < 300:
                    log.info("alert delivered to %s: %s %s -> %s", webhook_host(self.url), body["provider"],
                             body["previous"], body["verdict"])
                    return True
                if 400 <= resp.status_code < 500 and resp.status_code != 429:
                    log.warning("alert refused by %s (HTTP %d); not retried", webhook_host(self.url), resp.status_code)
                    return False
                reason = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                reason = type(exc).__name__
            if attempt < self.retries:
                log.warning("alert to %s failed (%s), attempt %d of %d; retrying in %.1f s",
                            webhook_host(self.url), reason, attempt, self.retries, delay)
                if self._stop.wait(delay):
                    return False
                delay = min(delay * 2, self.max_backoff_s)
        log.error("alert to %s not delivered after %d attempts (kept in %s)", webhook_host(self.url), self.retries,
                  self.state_file)
        return False

    def run(self, every_s: float, stop: threading.Event) -> None:
        """Poll every ``every_s`` seconds until ``stop`` is set (a failed poll is logged, not fatal)."""
        while not stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a busy or unreachable database: try next time
                log.warning("alert poll failed: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            stop.wait(every_s)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._queue.put(None)
        self._sender.join(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """True once every queued alert was delivered or given up on (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._queue.unfinished_tasks:
                return True
            time.sleep(0.02)
        return False


__all__ = ["Alerter", "alert_body", "webhook_host"]
