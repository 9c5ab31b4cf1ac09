"""Alerts: a webhook called when a series' verdict changes, found by polling the verification history.

The monitor only writes windows; a dashboard process polls them (``Alerter.poll``), so verification
is never blocked or slowed by an alert. A *change* is a window whose verdict (CONSISTENT /
INCONSISTENT) differs from the series' previous verdict (``views.mark_changes``' rule), and a series
first seen INCONSISTENT. Each change is alerted once: the last verdict seen per series and the alerts
not yet delivered are kept in a small JSON state file (written atomically), so a restarted dashboard
neither repeats a delivered one nor loses one. Without a state file the first poll only takes each
series' current verdict (a start does not alert on history).

Delivery runs on its own thread, strictly in the order the changes were found (so a receiver never
sees a series' older verdict after a newer one): the oldest undelivered alert is POSTed until it is
delivered, retried with exponential backoff (1 s, 2 s, 4 s, ... capped at ``max_backoff_s``) on a
network error or a 5xx / 429, for as long as it takes: a receiver that comes back gets every alert,
in order, without a restart. A 4xx other than 429 is a refusal: logged, counted, not retried (the
next alert goes on). Every delivery, retry and refusal is logged (JSON lines) and counted
(``alert_metrics``: pending, oldest pending age, delivered, refused, failed attempts). The body is
verinfer's JSON (``alert_body``) or Alertmanager's webhook shape (``shape="alertmanager"``:
``firing`` for INCONSISTENT, ``resolved`` when a series is CONSISTENT again); with a ``secret`` each
POST carries ``X-Verinfer-Signature-256: sha256=<hex>``, the HMAC-SHA256 of the exact body bytes
(as GitHub signs its webhooks). The webhook URL is never logged beyond its scheme and host (it often
carries a token).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
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
from verinfer.production.logs import json_log
from verinfer.production.store import Window

_log = json_log("verinfer.alerts")
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


SHAPES = ("verinfer", "alertmanager")
SIGNATURE_HEADER = "X-Verinfer-Signature-256"


def signature(secret: str, body: bytes) -> str:
    """The signature header's value: ``sha256=`` and the hex HMAC-SHA256 of ``body`` under ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def alertmanager_body(alert: dict[str, Any]) -> dict[str, Any]:
    """``alert_body``'s change in the webhook shape Alertmanager sends its receivers (version 4): one
    alert, ``firing`` while the series is INCONSISTENT, ``resolved`` when it is CONSISTENT again."""
    firing = alert["verdict"] == "INCONSISTENT"
    labels = {"alertname": "VerinferInconsistent", "provider": alert["provider"], "model": alert["model"],
              "profile": alert["profile"], "window_seconds": str(alert["window_seconds"])}
    annotations = {"summary": f"{alert['provider']} {alert['model']} ({alert['profile']}): {alert['verdict']}"
                              f" (was {alert['previous'] or 'unseen'})", "description": alert.get("note") or ""}
    status = "firing" if firing else "resolved"
    fingerprint = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
    return {"version": "4", "groupKey": f"verinfer:{fingerprint}", "truncatedAlerts": 0, "status": status,
            "receiver": "verinfer", "groupLabels": {"alertname": labels["alertname"]}, "commonLabels": labels,
            "commonAnnotations": annotations, "externalURL": alert["link"].rsplit("/window/", 1)[0],
            "alerts": [{"status": status, "labels": labels, "annotations": annotations,
                        "startsAt": alert["window"]["start"],
                        "endsAt": "0001-01-01T00:00:00Z" if firing else alert["window"]["start"],
                        "generatorURL": alert["link"], "fingerprint": fingerprint}]}


class Alerter:
    """Polls for verdict changes and posts each once, in order, to ``url``."""

    def __init__(self, engine: Engine, url: str, state_file: Path, link: Callable[[int], str], *,
                 shape: str = "verinfer", secret: str | None = None, backoff_s: float = 1.0,
                 max_backoff_s: float = 300.0, timeout_s: float = 10.0):
        if shape not in SHAPES:
            raise ValueError(f"--alert-format must be one of {', '.join(SHAPES)}, got {shape!r}")
        self.engine, self.url, self.state_file, self.link = engine, url, Path(state_file), link
        self.shape, self.secret = shape, secret
        self.backoff_s, self.max_backoff_s, self.timeout_s = backoff_s, max_backoff_s, timeout_s
        self.seen: dict[str, Seen] = {}
        self.pending: list[dict] = []  # detected, not yet delivered, oldest first: sent in this order
        self.delivered = 0
        self.refused = 0  # answered 4xx (not 429): not retried
        self.failed_attempts = 0  # attempts that will be retried (network error, 5xx, 429)
        self.pending_since: float | None = None  # wall time since when alerts have been waiting (none: None)
        self._baseline = True
        self._lock = threading.Lock()
        self._saving = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._load()
        if self.pending:  # undelivered before a restart: sent first
            self.pending_since = time.time()
        self._sender = threading.Thread(target=self._send_loop, name="verinfer-alerts", daemon=True)
        self._sender.start()

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
        """Write the state file (the poll and the sender both do: one at a time, or their writes of one
        temporary name collide and the second rename fails)."""
        with self._saving:
            with self._lock:
                doc = {"format": FORMAT, "seen": {k: asdict(v) for k, v in self.seen.items()},
                       "pending": list(self.pending)}
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
            found.sort(key=lambda a: (a["window"]["start"], a["window"]["id"]))  # oldest change first
            with self._lock:
                if not self.pending:
                    self.pending_since = time.time()
                self.pending += found
        self._save()
        self._wake.set()
        return found

    def _series(self, s: Session, key: views.Key) -> list[dict]:
        sid = series_id(key)
        seen = self.seen.get(sid)
        decided = select(Window).where(key.where(), Window.verdict.in_(views.VERDICTS))
        if seen is None and self._baseline:
            latest = views.last_decided(s, key)
            if latest is not None:
                with self._lock:  # the sender's _save reads it
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
            with self._lock:
                self.seen[sid] = Seen(w.verdict, w.id, w.start_time.isoformat())
        return out

    # -- delivery -------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            delay = self.backoff_s
            while not self._stop.is_set():
                self._wake.clear()
                with self._lock:
                    head = self.pending[0] if self.pending else None
                if head is None:
                    self._wake.wait(1.0)
                    continue
                try:
                    outcome = self._post(client, head)
                except Exception as exc:  # a bug must not stop delivery for good: logged, retried like a 5xx
                    _log("error", "alert_error", error=f"{type(exc).__name__}: {exc}")
                    outcome = None
                if outcome is None:  # retried, after a wait, for as long as it takes
                    self.failed_attempts += 1
                    if self._stop.wait(delay):
                        return
                    delay = min(delay * 2, self.max_backoff_s)
                    continue
                with self._lock:
                    self.pending.pop(0)
                    if not self.pending:
                        self.pending_since = None
                    self.delivered += outcome
                    self.refused += not outcome
                self._save()
                delay = self.backoff_s

    def _post(self, client: httpx.Client, alert: dict) -> bool | None:
        """One attempt: True delivered, False refused (a 4xx but 429), None to be retried."""
        body = json.dumps(alertmanager_body(alert) if self.shape == "alertmanager" else alert).encode()
        headers = {"content-type": "application/json"}
        if self.secret:
            headers[SIGNATURE_HEADER] = signature(self.secret, body)
        where = dict(receiver=webhook_host(self.url), provider=alert["provider"], model=alert["model"],
                     previous=alert["previous"], verdict=alert["verdict"], window=alert["window"]["id"])
        try:
            resp = client.post(self.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            _log("warning", "alert_retry", reason=type(exc).__name__, pending=len(self.pending), **where)
            return None
        if resp.status_code < 300:
            _log("info", "alert_delivered", status=resp.status_code, **where)
            return True
        if 400 <= resp.status_code < 500 and resp.status_code != 429:
            _log("error", "alert_refused", status=resp.status_code, detail="not retried", **where)
            return False
        _log("warning", "alert_retry", reason=f"HTTP {resp.status_code}", pending=len(self.pending), **where)
        return None

    def stats(self) -> dict[str, float]:
        """What ``alert_metrics`` exports."""
        with self._lock:
            return {"pending": len(self.pending), "delivered": self.delivered, "refused": self.refused,
                    "failed_attempts": self.failed_attempts,
                    "backlog_seconds": time.time() - self.pending_since if self.pending_since else 0.0}

    def run(self, every_s: float, stop: threading.Event) -> None:
        """Poll every ``every_s`` seconds until ``stop`` is set (a failed poll is logged, not fatal)."""
        while not stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a busy or unreachable database: try next time
                _log("warning", "alert_poll_failed", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            stop.wait(every_s)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._sender.join(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """True once every alert found was delivered or refused (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self.pending:
                    return True
            time.sleep(0.02)
        return False


__all__ = ["Alerter", "alert_body", "alertmanager_body", "signature", "webhook_host"]
