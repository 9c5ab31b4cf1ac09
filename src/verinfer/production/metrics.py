"""Prometheus metrics (prometheus-client, text exposition format): the verification history for the
dashboard's ``/metrics``, and the gateway's own counters for its ``/gateway/metrics``.

Both are custom collectors read at scrape time (nothing is kept in process state that could drift
from the database or from ``recorder.Counters``), registered in their own ``CollectorRegistry``.
Names follow Prometheus conventions: ``verinfer_`` prefix, ``_total`` counters, base units
(``_seconds``, ``_timestamp_seconds``), one label set per series: provider, model, profile and window
length (``window_seconds``). The verdict is a state set: ``verinfer_verdict{verdict=...}`` is 1 for
the series' current state (``CONSISTENT``, ``INCONSISTENT`` or ``none``: no verdict, e.g. too few tokens)
and 0 for the others, so ``verinfer_verdict{verdict="INCONSISTENT"} == 1`` is an alert rule. The
latest scheduled audit per provider/model/profile is ``verinfer_audit_verdict`` (the same state set),
``verinfer_audit_p_value`` and ``verinfer_audit_last_timestamp_seconds``.
"""

from __future__ import annotations

import calendar
import datetime as dt
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import and_, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from verinfer.production import views
from verinfer.production.store import AuditResult, Shard, utcnow

LABELS = ["provider", "model", "profile", "window_seconds"]
UNJUDGED = "UNJUDGED"  # no verdict (uncalibrated, or nothing verified): upper-case beside the verdicts
STATES = (*views.VERDICTS, UNJUDGED)

# recorder.Counters field -> (metric name without the verinfer_gateway_ prefix, help)
GATEWAY = {
    "requests": ("requests_total", "Requests proxied to the upstream engine."),
    "upstream_errors": ("upstream_errors_total", "Requests the engine answered with a status >= 400 (passed through)."),
    "upstream_unreachable": ("upstream_unreachable_total", "Requests the engine could not be reached for (502)."),
    "streams_cut": ("streams_cut_total", "Streams the engine ended before [DONE] (error event sent; unverifiable)."),
    "clients_left": ("client_disconnects_total", "Streams whose client left early (still read to the end and recorded)."),
    "ids_refused": ("token_ids_refused_total", "Times the engine refused return_token_ids (retried without)."),
    "exchanges": ("exchanges_total", "Generation exchanges handed to the recorder."),
    "recorded": ("records_written_total", "Verifiable traces written in finished shards."),
    "unverifiable": ("records_unverifiable_total", "Traces written to unverifiable/ shards."),
    "unrecordable": ("exchanges_unrecordable_total", "Exchanges that yielded no trace (logged with the reason)."),
    "dropped": ("records_dropped_total", "Exchanges or traces lost: full queue, or recording stopped."),
    "recovered": ("records_recovered_total", "Traces sealed from write-ahead files: a dead gateway's at start, "
                                             "or its own when recording resumed."),
    "shards_written": ("shards_written_total", "Trace shards written."),
    "write_errors": ("write_errors_total", "Shard writes that failed (recording stopped)."),
}
GAUGES = {"queue_depth": ("queue_depth", "Exchanges waiting for the recorder's writer thread.")}


def _unix(t: dt.datetime | None) -> float | None:
    """Naive UTC (as the store keeps it) -> Unix seconds."""
    return None if t is None else calendar.timegm(t.timetuple()) + t.microsecond / 1e6


def history_metrics(s: Session) -> list[Metric]:
    """Per series: tokens verified, windows, latest exact-match rate / mean margin / p-value, verdict
    state, since when, last verified time."""
    fams = {
        "tokens": CounterMetricFamily("verinfer_tokens_verified", "Tokens verified (all windows).", labels=LABELS),
        "windows": CounterMetricFamily("verinfer_windows", "Windows recorded.", labels=LABELS),
        "exact": GaugeMetricFamily("verinfer_exact_match_rate", "Exact-match rate of the latest window.",
                                   labels=LABELS),
        "margin": GaugeMetricFamily("verinfer_mean_margin", "Mean margin (bounded at 20) of the latest window.",
                                    labels=LABELS),
        "p": GaugeMetricFamily("verinfer_p_value", "p-value of the latest window's verdict (absent: no verdict).",
                               labels=LABELS),
        "verdict": GaugeMetricFamily("verinfer_verdict", "Current verdict of the series (1 for the state it is in).",
                                     labels=LABELS + ["verdict"]),
        "since": GaugeMetricFamily("verinfer_verdict_since_timestamp_seconds",
                                   "Start of the first window of the current verdict's run.", labels=LABELS),
        "last": GaugeMetricFamily("verinfer_last_verified_timestamp_seconds",
                                  "When a window of the series was last recorded.", labels=LABELS),
    }
    for newest in views.series(s, views.Filters()):
        key = views.Key.of(newest)
        windows, tokens, last = views.totals(s, key)
        st = views.state(s, key, windows, tokens, last, newest)
        labels = [key.provider, key.model, key.profile, str(key.seconds)]
        fams["tokens"].add_metric(labels, tokens)
        fams["windows"].add_metric(labels, windows)
        for name, value in (("exact", st.latest.exact_match_rate), ("margin", st.latest.mean_margin),
                            ("p", st.latest.p_value), ("since", _unix(st.since)), ("last", _unix(last))):
            if value is not None:
                fams[name].add_metric(labels, value)
        for v in STATES:
            fams["verdict"].add_metric(labels + [v], 1.0 if (st.verdict or UNJUDGED) == v else 0.0)
    return list(fams.values()) + audit_metrics(s) + monitor_metrics(s)


def audit_metrics(s: Session) -> list[Metric]:
    """The latest scheduled audit per provider/model/profile: verdict state, p-value, when."""
    labels = ["provider", "model", "profile"]
    verdict = GaugeMetricFamily("verinfer_audit_verdict", "Verdict of the latest scheduled audit (1 for its state).",
                                labels=labels + ["verdict"])
    p_value = GaugeMetricFamily("verinfer_audit_p_value", "p-value of the latest scheduled audit.", labels=labels)
    at = GaugeMetricFamily("verinfer_audit_last_timestamp_seconds", "When the latest scheduled audit finished.",
                           labels=labels)
    latest = select(AuditResult.provider, AuditResult.model, AuditResult.profile, func.max(AuditResult.at).label("at")
                    ).group_by(AuditResult.provider, AuditResult.model, AuditResult.profile).subquery()
    rows = s.scalars(select(AuditResult).join(latest, and_(
        AuditResult.provider == latest.c.provider, AuditResult.model == latest.c.model,
        AuditResult.profile == latest.c.profile, AuditResult.at == latest.c.at)).order_by(AuditResult.id)).all()
    for a in {(a.provider, a.model, a.profile): a for a in rows}.values():  # the last row of a tied time
        key = [a.provider, a.model, a.profile]
        for v in STATES:
            verdict.add_metric(key + [v], 1.0 if (a.verdict or UNJUDGED) == v else 0.0)
        if a.p_value is not None:
            p_value.add_metric(key, a.p_value)
        at.add_metric(key, _unix(a.at))
    return [verdict, p_value, at]


def gateway_metrics(workers: dict[str, dict[str, int]]) -> list[Metric]:
    """The gateway's ``Counters.snapshot()`` of each worker process (``--workers``; keyed by its pid,
    the ``worker`` label) as counters and the queue-depth gauge: ``sum(rate(...))`` over workers stays
    right across a worker's restart."""
    families: dict[str, Metric] = {}
    for worker, snapshot in workers.items():
        for field, value in snapshot.items():
            if field in GAUGES:
                name, help_ = GAUGES[field]
                family = families.get(name) or GaugeMetricFamily(f"verinfer_gateway_{name}", help_, labels=["worker"])
            else:
                name, help_ = GATEWAY.get(field, (f"{field}_total", f"Gateway counter {field}."))
                family = families.get(name) or CounterMetricFamily(
                    f"verinfer_gateway_{name.removesuffix('_total')}", help_, labels=["worker"])
            families[name] = family
            family.add_metric([worker], value)
    return list(families.values())


class _Collector:
    def __init__(self, collect: Callable[[], list[Metric]]):
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


def exposition(collect: Callable[[], list[Metric]]) -> tuple[bytes, str]:
    """(body, content type) of one scrape of ``collect``'s metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(collect))
    return generate_latest(registry), CONTENT_TYPE_LATEST


SHARD_STATES = ("pending", "claimed", "done", "failed")


def monitor_metrics(s: Session, sample: float | None = None) -> list[Metric]:
    """The monitors' progress, from the database (so any process reports every monitor's work): shards
    per status (``failed`` ones included: a shard that could not be verified is never silent), the
    backlog (pending or claimed) and its age, traces recorded and verified, tokens verified; with
    ``sample``, the fraction this monitor verifies (``--sample``)."""
    by_status = dict(s.execute(select(Shard.status, func.count()).group_by(Shard.status)).all())
    shards = GaugeMetricFamily("verinfer_monitor_shards", "Trace shards known to the monitors, per status.",
                               labels=["status"])
    for status in sorted(set(SHARD_STATES) | set(by_status)):
        shards.add_metric([status], by_status.get(status, 0))
    backlog = GaugeMetricFamily("verinfer_monitor_backlog_shards", "Shards found and not yet verified "
                                "(pending or claimed).")
    backlog.add_metric([], by_status.get("pending", 0) + by_status.get("claimed", 0))
    oldest = s.scalar(select(func.min(Shard.discovered_at)).where(Shard.status.in_(("pending", "claimed"))))
    lag = GaugeMetricFamily("verinfer_monitor_lag_seconds", "Age of the oldest shard not yet verified (0: none).")
    lag.add_metric([], max(0.0, (utcnow() - oldest).total_seconds()) if oldest is not None else 0.0)
    offered, traces, tokens = s.execute(select(func.coalesce(func.sum(Shard.offered), 0), func.coalesce(
        func.sum(Shard.traces), 0), func.coalesce(func.sum(Shard.tokens), 0)).where(Shard.status == "done")).one()
    out: list[Metric] = [shards, backlog, lag]
    for name, help_, value in (("verinfer_monitor_traces_recorded", "Traces in verified shards (verified or "
                                "left out by --sample).", offered),
                               ("verinfer_monitor_traces_verified", "Traces verified.", traces),
                               ("verinfer_monitor_tokens_verified", "Tokens verified.", tokens)):
        family = CounterMetricFamily(name, help_)
        family.add_metric([], value)
        out.append(family)
    if sample is not None:
        fraction = GaugeMetricFamily("verinfer_monitor_sample_fraction", "Fraction of traces this monitor verifies "
                                     "(--keep-up: the fraction of the last shard it verified).")
        fraction.add_metric([], sample)
        out.append(fraction)
    return out


def alert_metrics(stats: dict[str, float]) -> list[Metric]:
    """The dashboard's alert delivery (``Alerter.stats``): alerts waiting, for how long, delivered,
    refused, and attempts that failed and will be retried (``verinfer_alerts_pending > 0`` for long is
    a receiver down: ``verinfer_alerts_backlog_seconds``)."""
    pending = GaugeMetricFamily("verinfer_alerts_pending", "Verdict-change alerts found and not yet delivered.")
    pending.add_metric([], stats["pending"])
    backlog = GaugeMetricFamily("verinfer_alerts_backlog_seconds",
                                "Seconds alerts have been waiting for delivery (0 when none waits).")
    backlog.add_metric([], stats["backlog_seconds"])
    out: list[Metric] = [pending, backlog]
    for field, name, help_ in (("delivered", "verinfer_alerts_delivered", "Alerts the receiver accepted (2xx)."),
                               ("refused", "verinfer_alerts_refused", "Alerts the receiver refused (4xx but 429; "
                                                                      "not retried)."),
                               ("failed_attempts", "verinfer_alert_attempts_failed",
                                "Delivery attempts that failed and were retried (network error, 5xx, 429).")):
        family = CounterMetricFamily(name, help_)
        family.add_metric([], stats[field])
        out.append(family)
    return out


def monitor_exposition(engine: Engine, sample: float) -> tuple[bytes, str]:
    """A monitor's own scrape (``verinfer monitor --metrics-port``): its progress and sampling fraction."""
    def collect() -> list[Metric]:
        with Session(engine) as s:
            return monitor_metrics(s, sample)

    return exposition(collect)


def history_exposition(engine: Engine, alerts: Callable[[], dict[str, float]] | None = None) -> tuple[bytes, str]:
    """The dashboard's scrape: the history and, with an alerter, its delivery (``alerts``: its ``stats``)."""
    def collect() -> list[Metric]:
        with Session(engine) as s:
            return history_metrics(s) + (alert_metrics(alerts()) if alerts else [])

    return exposition(collect)


__all__ = ["CONTENT_TYPE_LATEST", "alert_metrics", "audit_metrics", "exposition", "gateway_metrics", "history_exposition", "history_metrics",
           "monitor_exposition", "monitor_metrics"]
