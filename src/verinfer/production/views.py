"""What the dashboard shows, read from the verification history (``verinfer.production.store``).

Read-only, through the store's query builders (``verinfer.production.store``: each served by one of
its indexes, so that pages stay fast with 100,000 windows; ``benchmarks/dashboard_pages.py``): the
series and their newest windows from ``streams``, a range scan of ``uq_windows_key`` per shown
series' totals and timeline (the latest ``points`` windows of the range), and index lookups of
``ix_windows_state`` for since when a series' verdict holds.

A *series* is one provider/model/profile at one window length. A *verdict change* is a window whose
verdict (CONSISTENT / INCONSISTENT) differs from the last verdict before it in its series; windows
without a verdict (too few tokens, uncalibrated) neither change nor end a state.

Honest bands drawn behind a timeline come from the calibration or bands file a window was judged by
(``judged_by``): a calibration's thresholds for the statistics the window records (the mean margin
bounded at 20, the mismatch rate) at the largest fitted batch size the window's tokens fill, or a
bands file's 2.5-97.5% range of honest pseudo-audits of the window's size (exact-match rate only: the
bands pool the margin clipped at their own clip, which the window does not record).
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import urlencode

import numpy as np
from sqlalchemy import and_, create_engine, func, or_, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from verinfer.production import store as reads
from verinfer.production.monitor import as_utc, parse_duration
from verinfer.production.store import (AuditResult, Key, Shard, Store, Window, WindowTrace, database_url,
                                      utcnow)
from verinfer.stats.pooling import MARGIN_CLIP

VERDICTS = ("CONSISTENT", "INCONSISTENT")
MAX_POINTS = 5000


def read_engine(history: Store) -> Engine:
    """An engine for page queries. SQLite: one without the store's BEGIN IMMEDIATE (which a writer
    needs, and which would make every page hold the monitor's write lock); WAL lets it read beside
    the monitor. PostgreSQL: the store's own."""
    if history.dialect != "sqlite":
        return history.engine
    return create_engine(database_url(history.url), connect_args={"timeout": 60})


# --------------------------------------------------------------------------------------------------
# filters: what a page shows, as a shareable query string


def parse_time(text: str, what: str, now: dt.datetime) -> dt.datetime:
    """``2026-03-01T12:00:00Z`` (ISO-8601, UTC when naive) or a span back from now (``6h``, ``7d``)."""
    try:
        return now - dt.timedelta(seconds=parse_duration(text, what))
    except ValueError:
        pass
    try:
        return as_utc(dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00")))
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected an ISO-8601 UTC time (2026-03-01T12:00:00Z) "
                         f"or a span back from now (6h, 7d)") from None


@dataclass(frozen=True)
class Filters:
    """Provider / model / profile (exact names), time range of window starts, points per timeline."""

    provider: str | None = None
    model: str | None = None
    profile: str | None = None
    since: str | None = None  # as typed (kept relative in shared links: "24h" stays "the last 24 h")
    until: str | None = None
    points: int = 500
    refresh: int = 30  # seconds between page reloads; 0: off

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> "Filters":
        """From a page's query string; ValueError naming the parameter for a bad value."""
        values: dict[str, Any] = {k: (query.get(k) or "").strip() or None for k in ("provider", "model", "profile",
                                                                                  "since", "until")}
        for name, default, top in (("points", cls.points, MAX_POINTS), ("refresh", cls.refresh, 86400)):
            raw = query.get(name)
            try:
                values[name] = default if raw in (None, "") else int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r}: expected a whole number") from None
            if not (0 if name == "refresh" else 1) <= values[name] <= top:
                raise ValueError(f"{name}={raw!r}: expected a number from {0 if name == 'refresh' else 1} to {top}")
        out = cls(**values)
        since, until = out.range()  # a bad time fails here, with its name
        if since is not None and until is not None and since > until:
            raise ValueError(f"since={out.since!r} is later than until={out.until!r}: nothing can be in that range")
        return out

    def range(self, now: dt.datetime | None = None) -> tuple[dt.datetime | None, dt.datetime | None]:
        now = now or utcnow()
        return (parse_time(self.since, "since", now) if self.since else None,
                parse_time(self.until, "until", now) if self.until else None)

    def query(self, **changes: Any) -> str:
        """This view's query string (with ``changes``): a link that shows the same page."""
        f = replace(self, **changes)
        items = {k: getattr(f, k) for k in ("provider", "model", "profile", "since", "until")}
        items.update(points=f.points if f.points != Filters.points else None,
                     refresh=f.refresh if f.refresh != Filters.refresh else None)
        return urlencode({k: v for k, v in items.items() if v is not None})

    def where(self, table) -> list:
        return [getattr(table, k) == getattr(self, k) for k in ("provider", "model", "profile")
                if getattr(self, k) is not None]

    def shows(self, key: Key) -> bool:
        return all(getattr(self, k) is None or getattr(self, k) == getattr(key, k) for k in ("provider", "model",
                                                                                           "profile"))


# --------------------------------------------------------------------------------------------------
# honest bands behind a timeline


@dataclass(frozen=True)
class Band:
    """Honest ranges of a window's statistics at its token count, from what judged it."""

    source: str
    exact: tuple[float, float] | None  # exact-match rate
    margin: tuple[float, float] | None  # mean margin bounded at MARGIN_CLIP
    text: str  # how the ranges were obtained


@functools.lru_cache(maxsize=16)
def _judge_file(judged_by: str) -> tuple[str, Any]:
    """("calibration" | "bands", the loaded object) or ("none", why)."""
    kind, _, name = judged_by.partition(" ")
    if kind == "calibration":
        from verinfer.stats.calibration import Calibrator

        try:
            return "calibration", Calibrator.load(name)
        except (OSError, ValueError) as exc:
            return "none", f"calibration {Path(name).name} not readable here ({str(exc).splitlines()[0][:160]})"
    if kind == "bands" or judged_by.startswith("bands-"):
        from verinfer.auditing.bands import DATA_DIR, Bands

        file = name if kind == "bands" else judged_by
        try:
            return "bands", Bands.load(DATA_DIR / Path(file).name)
        except ValueError as exc:
            return "none", f"bands {Path(file).name} not readable here ({str(exc).splitlines()[0][:160]})"
    return "none", f"judged by {judged_by!r}: no bands to draw"


def _fitted(calibrator, metric: str, rule: str, tokens: int) -> tuple[int, float] | None:
    sizes = [n for (m, r, n) in calibrator.thresholds_ if m == metric and r == rule and n <= tokens]
    return (max(sizes), calibrator.threshold(metric, rule, max(sizes))) if sizes else None


def band_size(tokens: int) -> int:
    """``tokens`` rounded down to two significant digits: bands are computed once per size class (at
    most 90 a decade) and a band of slightly fewer tokens is slightly wider, never narrower."""
    digits = max(len(str(int(tokens))) - 2, 0)
    return max(int(tokens) // 10 ** digits * 10 ** digits, 1)


@functools.lru_cache(maxsize=4096)
def band_at(judged_by: str | None, tokens: int) -> Band | None:
    """The honest ranges behind a window of ``tokens`` tokens judged by ``judged_by`` (None: no verdict)."""
    if not judged_by:
        return None
    kind, obj = _judge_file(judged_by)
    if kind == "none":
        return Band(judged_by, None, None, obj)
    if kind == "calibration":
        margin = _fitted(obj, "margin", f"bound:{MARGIN_CLIP:g}", tokens)
        exact = _fitted(obj, "exact_match", "mismatch_rate", tokens)
        text = (f"honest batches of {margin[0] if margin else exact[0]} tokens stay inside at FPR {obj.fpr:g} "
                f"(calibration thresholds)") if (margin or exact) else "no calibrated batch size fits this window"
        return Band(judged_by, (1.0 - exact[1], 1.0) if exact else None, (0.0, margin[1]) if margin else None, text)
    rng = np.random.default_rng(0)
    from verinfer.stats.verdict import pseudo_audits

    lo, hi = [], []
    for seq in obj.honest_bands():
        stats = pseudo_audits(seq[:, [0, 2]], tokens, 400, rng)
        lo.append(float(np.percentile(stats, 2.5)))
        hi.append(float(np.percentile(stats, 97.5)))
    return Band(judged_by, (min(lo), max(hi)), None,
                f"2.5-97.5% of honest pseudo-audits of {tokens} tokens ({Path(obj.source).name}); the bands judge the "
                f"margin clipped at {obj.clip:.3g}, which windows do not record: no margin band")


# --------------------------------------------------------------------------------------------------
# series, timelines, state


@dataclass
class Point:
    """One window on a timeline."""

    id: int
    start: dt.datetime
    end: dt.datetime
    traces: int
    tokens: int
    exact_match_rate: float | None
    mean_margin: float | None
    verdict: str | None
    p_value: float | None
    judged_by: str | None
    note: str | None
    changed: bool = False  # its verdict differs from the last verdict before it
    band: Band | None = None


@dataclass
class State:
    """A series now: its latest window, since when its verdict holds, its totals."""

    key: Key
    windows: int
    tokens: int
    last_verified: dt.datetime | None
    latest: Point
    verdict: str | None  # the latest window's
    since: dt.datetime | None  # start of the first window of the current run of that verdict
    last_verdict: str | None  # the latest window with a verdict's (when the latest window has none)
    idle_s: float | None = None  # seconds since a window of it was last recorded, when over the stale limit

    @property
    def label(self) -> str:
        """IDLE (nothing verified for too long: a verdict that old is no news) / CONSISTENT / INCONSISTENT
        / not enough tokens / no verdict (uncalibrated, no bands)."""
        if self.idle_s is not None:
            return "IDLE"
        if self.verdict:
            return self.verdict
        return "not enough tokens" if (self.latest.note or "").startswith("too few") else "no verdict"


@dataclass
class Series:
    key: Key
    state: State
    points: list[Point]
    in_range: int  # windows in the time range (points shows the latest of them)
    audits: list[AuditResult] = field(default_factory=list)


def _point(w: Window) -> Point:
    return Point(w.id, w.start_time, w.end_time, w.traces, w.tokens, w.exact_match_rate, w.mean_margin, w.verdict,
                 w.p_value, w.judged_by, w.note)


def series(s: Session, f: Filters) -> list[Window]:
    """The newest window of every series that passes the filters, in key order (``streams``)."""
    return list(s.scalars(reads.latest(f.provider, f.model, f.profile)).all())


def totals(s: Session, key: Key) -> tuple[int, int, dt.datetime | None]:
    """A series' window count, tokens and last update."""
    windows, tokens, last = s.execute(reads.totals(key)).one()
    return int(windows), int(tokens), last


def keys(s: Session, f: Filters) -> list[tuple[Key, int, int, dt.datetime | None]]:
    """Every series that passes the filters with its window count, tokens and last update."""
    return [(key, *totals(s, key)) for key in (Key.of(w) for w in series(s, f))]


def last_decided(s: Session, key: Key, before: dt.datetime | None = None) -> Window | None:
    """The latest window with a verdict (before ``before``): one index lookup per verdict."""
    ends = [t for v in VERDICTS if (t := s.scalar(reads.last_with(key, v, before))) is not None]
    return s.scalars(reads.timeline(key, max(ends), max(ends))).first() if ends else None


def state(s: Session, key: Key, windows: int, tokens: int, last_verified: dt.datetime | None,
          latest: Window | None = None) -> State:
    """The series' current state from index lookups: its latest window (``latest`` when the caller
    has it), the latest window of each other verdict, the first window after them."""
    latest = latest or s.scalars(reads.timeline(key, newest=1)).one()
    decided = latest if latest.verdict is not None else last_decided(s, key, latest.start_time)
    verdict = latest.verdict
    # since: the first window after the latest one (before ``latest``: the state as of it) whose verdict
    # differs (NULL counts as differing for the latest window's own state; a run of no-verdict windows
    # has its own "since")
    ends = [t for v in (*VERDICTS, None)
            if v != verdict and (t := s.scalar(reads.last_with(key, v, latest.start_time))) is not None]
    since = s.scalar(reads.first_after(key, max(ends) if ends else None))
    return State(key, windows, tokens, last_verified, _point(latest), verdict, since,
                 decided.verdict if decided is not None else None)


def timeline(s: Session, key: Key, f: Filters, now: dt.datetime | None = None) -> tuple[list[Point], int]:
    """The latest ``f.points`` windows of the range, oldest first, with verdict changes marked; and
    how many windows the range holds."""
    since, until = f.range(now)
    rows = s.scalars(reads.timeline(key, since, until, newest=f.points)).all()[::-1]
    count = s.scalar(reads.timeline_count(key, since, until))
    points = [_point(w) for w in rows]
    before = None
    if points:
        prior = last_decided(s, key, points[0].start)
        before = prior.verdict if prior is not None else None
    mark_changes(points, before)
    for p in points:
        p.band = band_at(p.judged_by, band_size(p.tokens)) if p.tokens else None
    return points, int(count)


def mark_changes(points: Sequence[Point], before: str | None = None) -> None:
    """Mark each point whose verdict differs from the last verdict before it (``before``: the last
    verdict ahead of the first point); points without a verdict carry the previous one on."""
    last = before
    for p in points:
        if p.verdict is None:
            continue
        p.changed = last is not None and p.verdict != last
        last = p.verdict


def audits(s: Session, f: Filters, now: dt.datetime | None = None) -> list[AuditResult]:
    """Scheduled audits that pass the filters, newest first (at most ``f.points``)."""
    since, until = f.range(now)
    where = f.where(AuditResult) + ([AuditResult.at >= since] if since else []) + \
        ([AuditResult.at <= until] if until else [])
    return list(s.scalars(select(AuditResult).where(*where).order_by(AuditResult.at.desc()).limit(f.points)).all())


@dataclass
class Overview:
    series: list[Series]
    choices: dict[str, list[str]]  # filter choices: every provider, model and profile in the history
    audits_alone: list[AuditResult]  # scheduled audits of providers/models without traffic windows
    failed: list[Shard] = field(default_factory=list)  # the latest shards that could not be verified
    failed_count: int = 0  # all of them


FAILED_SHOWN = 10


STALE_AFTER_S = 1800.0  # a series with no window recorded for this long shows IDLE, not its old verdict


def overview(s: Session, f: Filters, now: dt.datetime | None = None, stale_after_s: float = STALE_AFTER_S) -> Overview:
    """Everything the main page shows: each series' state (IDLE when no window of it was recorded for
    ``stale_after_s``), timeline and the audits beside it."""
    now = now or utcnow()
    found = audits(s, f, now)
    every = {Key.of(w): w for w in series(s, Filters())}  # all series: the filters' choices
    out = []
    until = f.range(now)[1]
    for key, newest in every.items():
        if not f.shows(key):
            continue
        if until is not None:  # the state as of the range's end: its latest window there
            newest = s.scalars(reads.timeline(key, None, until, newest=1)).first()
            if newest is None:
                continue
        points, count = timeline(s, key, f, now)
        st = state(s, key, *totals(s, key), newest)
        if until is None and st.last_verified is not None and \
                (idle := (now - st.last_verified).total_seconds()) > stale_after_s:
            st.idle_s = idle
        out.append(Series(key, st, points, count,
                          [a for a in found if (a.provider, a.model) == (key.provider, key.model)]))
    audited = s.execute(select(AuditResult.provider, AuditResult.model, AuditResult.profile).distinct()).all()
    choices = {name: sorted({getattr(k, name) for k in every} | {getattr(a, name) for a in audited})
               for name in ("provider", "model", "profile")}
    traffic = {(k.provider, k.model) for k in every}
    failed = s.scalars(select(Shard).where(Shard.status == "failed").order_by(Shard.finished_at.desc(), Shard.id.desc())
                       .limit(FAILED_SHOWN)).all()
    failed_count = int(s.scalar(select(func.count()).select_from(Shard).where(Shard.status == "failed")))
    return Overview(out, choices, [a for a in found if (a.provider, a.model) not in traffic], list(failed),
                    failed_count)


# --------------------------------------------------------------------------------------------------
# the JSON status API (/api/series, /api/windows): what the pages show, for scripts

API_MAX_WINDOWS = 1000


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.isoformat() + "Z"


def window_json(w: Window) -> dict[str, Any]:
    return {"id": w.id, "provider": w.provider, "model": w.model, "profile": w.profile, "window_seconds": w.seconds,
            "start": _iso(w.start_time), "end": _iso(w.end_time), "verdict": w.verdict, "p_value": w.p_value,
            "traces": w.traces, "offered": w.offered, "tokens": w.tokens, "exact_match_rate": w.exact_match_rate,
            "mean_margin": w.mean_margin, "tokens_needed": w.tokens_needed, "first_flagged": w.first_flagged,
            "judged_by": w.judged_by, "note": w.note, "updated_at": _iso(w.updated_at)}


def series_json(view: Overview) -> dict[str, Any]:
    """``/api/series``: each series' state as the overview shows it (``state``: its pill's label)."""
    return {"series": [{"provider": x.key.provider, "model": x.key.model, "profile": x.key.profile,
                        "window_seconds": x.key.seconds, "state": x.state.label, "verdict": x.state.verdict,
                        "since": _iso(x.state.since), "last_verified": _iso(x.state.last_verified),
                        "idle_seconds": x.state.idle_s, "windows": x.state.windows, "tokens": x.state.tokens,
                        "latest_window": x.state.latest.id} for x in view.series],
            "failed_shards": view.failed_count}


def windows_json(s: Session, f: Filters, limit: int) -> dict[str, Any]:
    """``/api/windows``: the newest ``limit`` windows that pass the filters and the time range, newest first."""
    since, until = f.range()
    q = select(Window).where(*f.where(Window), *([Window.start_time >= since] if since else []),
                             *([Window.start_time <= until] if until else []))
    rows = s.scalars(q.order_by(Window.start_time.desc(), Window.id.desc()).limit(limit)).all()
    return {"windows": [window_json(w) for w in rows], "limit": limit}


# --------------------------------------------------------------------------------------------------
# drill-down: a window's traces with their per-token scores


@dataclass
class TraceView:
    trace_id: str
    request_time: dt.datetime
    tokens: int
    exact_matches: int
    mean_margin: float
    shard: str
    pieces: list[tuple[str, float | None]] | None  # token text and margin; None: the files are gone
    missing: str | None = None  # why the tokens cannot be shown
    prompt: list[tuple[str, str]] | None = None  # (role, text) as the trace stored it (messages or prompt text)


def window(s: Session, window_id: int) -> Window | None:
    return s.get(Window, window_id)


def neighbours(s: Session, w: Window) -> tuple[Window | None, Window | None]:
    """The windows just before and after ``w`` in its series (links on its page)."""
    return tuple(s.scalars(reads.neighbour(Key.of(w), w.start_time, later)).first() for later in (False, True))


def window_traces(s: Session, window_id: int, limit: int, offset: int = 0) -> tuple[list[tuple], int]:
    """(WindowTrace, Shard) rows of a window in request-time order, and how many it holds."""
    rows = s.execute(reads.traces_of(window_id, limit, offset)).all()
    return [tuple(r) for r in rows], int(s.scalar(reads.trace_count(window_id)))


def trace_position(s: Session, window_id: int, trace_id: str) -> int | None:
    """Where ``trace_id`` is in the window's request-time order (its page in the drill-down), or None."""
    wt = s.scalars(select(WindowTrace).where(WindowTrace.window_id == window_id,
                                             WindowTrace.trace_id == trace_id)).first()
    if wt is None:
        return None
    before = or_(WindowTrace.request_time < wt.request_time,
                 and_(WindowTrace.request_time == wt.request_time, WindowTrace.trace_id < wt.trace_id))
    return int(s.scalar(select(func.count()).select_from(WindowTrace).where(WindowTrace.window_id == window_id,
                                                                            before)))


@functools.lru_cache(maxsize=4)
def tokenizer(model: str):
    """The claimed model's tokenizer, offline (None when it is not available here: ids are shown)."""
    from transformers import AutoTokenizer

    from verinfer.models.load import ModelNotAvailable, local_dir, resolve

    try:
        return AutoTokenizer.from_pretrained(str(local_dir(resolve(model))), local_files_only=True)
    except (OSError, ValueError, ModelNotAvailable):
        return None


def prompt_of(trace, tok, limit: int = 2000) -> list[tuple[str, str]]:
    """What the trace was asked: its chat messages, else its prompt text, else its prompt ids decoded
    (a trace recorded with ``--store-text false`` keeps ids only); each text cut at ``limit`` characters."""
    cut = (lambda text: text if len(text) <= limit else text[:limit] + " …")
    if trace.messages:
        return [(str(m.get("role", "")), cut(str(m.get("content", "")))) for m in trace.messages]
    if trace.prompt_text:
        return [("prompt", cut(trace.prompt_text))]
    if tok is not None:
        return [("prompt ids, decoded", cut(tok.decode(trace.prompt_token_ids)))]
    return [("prompt ids", cut(" ".join(map(str, trace.prompt_token_ids))))]


def trace_views(rows: Sequence[tuple], model: str) -> list[TraceView]:
    """Each trace's output tokens with their margins, from its shard and the shard's scores file."""
    from verinfer.scoring.scores import read_scores
    from verinfer.trace import read_traces

    by_shard: dict[int, list] = {}
    for wt, shard in rows:
        by_shard.setdefault(shard.id, []).append((wt, shard))
    tok = tokenizer(model) if rows else None
    views: dict[tuple[int, str], TraceView] = {}
    for items in by_shard.values():
        shard = items[0][1]
        wanted = {wt.trace_id for wt, _ in items}
        try:
            traces = {t.id: t for t in read_traces(shard.path) if t.id in wanted}
            cols = read_scores(shard.scores_path) if shard.scores_path else None
        except (OSError, ValueError) as exc:
            traces, cols, why = {}, None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        else:
            why = None if cols is not None else "no scores file recorded for the shard"
        for wt, _ in items:
            pieces, missing = None, why
            trace = traces.get(wt.trace_id)
            if why is None and trace is None:
                missing = f"trace {wt.trace_id!r} is no longer in {Path(shard.path).name}"
            elif why is None:
                mask = cols["trace_id"] == wt.trace_id
                margin = dict(zip(cols["position"][mask].tolist(), cols["margin"][mask].tolist()))
                ids = trace.output_token_ids
                texts = [tok.decode([t]) for t in ids] if tok is not None else [f"#{t} " for t in ids]
                pieces = [(text, margin.get(i)) for i, text in enumerate(texts)]
            views[shard.id, wt.trace_id] = TraceView(wt.trace_id, wt.request_time, wt.tokens, wt.exact_matches,
                                                     wt.mean_margin, shard.path, pieces, missing,
                                                     prompt_of(trace, tok) if trace is not None else None)
    return [views[shard.id, wt.trace_id] for wt, shard in rows]


__all__ = ["Band", "Filters", "Key", "Overview", "Point", "Series", "State", "TraceView", "audits", "band_at",
           "series_json", "window_json", "windows_json",
           "band_size", "keys", "last_decided", "mark_changes", "neighbours", "overview", "parse_time", "read_engine",
           "series", "state", "timeline", "totals", "trace_views", "window", "window_traces"]
