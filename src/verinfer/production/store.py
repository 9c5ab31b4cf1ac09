"""The verification history: SQLAlchemy 2.0 models of shards, per-shard and per-window results and
scheduled audits, in SQLite (the embedded default) or PostgreSQL (by URL, psycopg 3).

The schema is created and evolved only by Alembic (``verinfer/production/migrations``), applied on
every open (``alembic.command.upgrade(config, "head")``; a no-op once at head), under a lock so
that two monitors starting together migrate once: PostgreSQL's advisory lock, SQLite's write lock.

Exactly-once bookkeeping rests on the database: a shard's identity is unique ``(path, sha256)``, a
monitor claims it with a conditional UPDATE (pending, or claimed with an expired lease) and
records its results together with ``status='done'`` in one transaction (``verinfer.production.monitor``).

Indexes serve the dashboard (issue #30), whose every read is a query builder below: the streams and
their current state are the ``streams`` rows and their newest windows (by primary key); a stream's
totals (windows, tokens, last update) are counters kept in its ``streams`` row, so ``/metrics`` costs
the same however long the history; a timeline is a range scan of ``uq_windows_key``; "since when" is index lookups of the latest
window with each other verdict (``ix_windows_state``); a window's traces are ``ix_window_traces_window``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import (BigInteger, DateTime, Float, ForeignKey, Index, Integer, Select, String, Text,
                        UniqueConstraint, and_, case, create_engine, event, func, or_, select, text, update)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

MIGRATIONS = Path(__file__).with_name("migrations")
_MIGRATION_LOCK = 0x76657269  # PostgreSQL advisory lock key ("veri")


class StoreError(ValueError):
    """A database URL that cannot be used (malformed, unsupported or unreachable)."""


def utcnow() -> dt.datetime:
    """Naive UTC: what every timestamp column holds (SQLite keeps no time zone)."""
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class ResultColumns:
    """What a judged set of tokens records, per shard group, per window and per audited provider."""

    provider: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    profile: Mapped[str] = mapped_column(String(64))
    traces: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(Integer, default=0)
    exact_match_rate: Mapped[float | None] = mapped_column(Float)
    mean_margin: Mapped[float | None] = mapped_column(Float)  # clipped at MARGIN_CLIP (verinfer.stats.summary)
    verdict: Mapped[str | None] = mapped_column(String(16))  # CONSISTENT / INCONSISTENT; NULL: no verdict (note says why)
    p_value: Mapped[float | None] = mapped_column(Float)
    tokens_needed: Mapped[int | None] = mapped_column(Integer)
    flags: Mapped[int | None] = mapped_column(Integer)  # calibrated: batches flagged
    batches: Mapped[int | None] = mapped_column(Integer)
    first_flagged: Mapped[str | None] = mapped_column(String(256))  # trace id of the first flagged batch / rejecting look
    judged_by: Mapped[str | None] = mapped_column(String(300))  # the calibration or bands behind the verdict
    note: Mapped[str | None] = mapped_column(Text)  # the verdict's text, or why there is none


class Shard(Base):
    """One trace file of the watched directory, identified by path and content."""

    __tablename__ = "shards"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(String(1024))
    sha256: Mapped[str] = mapped_column(String(64))
    bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending, claimed, done, failed
    owner: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[dt.datetime | None] = mapped_column(DateTime)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    discovered_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    traces: Mapped[int | None] = mapped_column(Integer)
    tokens: Mapped[int | None] = mapped_column(Integer)
    verify_s: Mapped[float | None] = mapped_column(Float)
    offered: Mapped[int | None] = mapped_column(Integer)  # traces in the shard; ``traces`` of them verified
    sample: Mapped[float | None] = mapped_column(Float)  # the monitor's --sample fraction (None: every trace)
    files_deleted_at: Mapped[dt.datetime | None] = mapped_column(DateTime)  # by retention (--retain-shards)
    scores_path: Mapped[str | None] = mapped_column(String(1024))
    error: Mapped[str | None] = mapped_column(Text)
    __table_args__ = (UniqueConstraint("path", "sha256", name="uq_shards_identity"),
                      Index("ix_shards_status", "status", "lease_until"))


class ShardResult(ResultColumns, Base):
    """A shard's traces of one provider/model/profile, judged on their own."""

    __tablename__ = "shard_results"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"))
    signature: Mapped[str] = mapped_column(Text)  # JSON: model, dtype, sampling settings (scoring.scores.signature)
    __table_args__ = (Index("ix_shard_results_shard", "shard_id"),)


class Window(ResultColumns, Base):
    """A fixed time bucket of request times for one provider/model/profile, judged over all its tokens."""

    __tablename__ = "windows"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seconds: Mapped[int] = mapped_column(Integer)
    start_time: Mapped[dt.datetime] = mapped_column(DateTime)
    end_time: Mapped[dt.datetime] = mapped_column(DateTime)
    shards: Mapped[int] = mapped_column(Integer, default=0)
    offered: Mapped[int] = mapped_column(Integer, default=0)  # traces recorded in it; ``traces`` of them verified
    computed: Mapped[int] = mapped_column(Integer, default=0)  # times recomputed (a later shard added traces)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    __table_args__ = (UniqueConstraint("provider", "model", "profile", "seconds", "start_time", name="uq_windows_key"),
                      Index("ix_windows_start", "start_time"),
                      Index("ix_windows_state", "provider", "model", "profile", "seconds", "verdict", "start_time"))


class Stream(Base):
    """A provider/model/profile at one window length, its newest window and its totals: the current
    state is one row per stream, read without scanning the windows (``latest``, ``totals``)."""

    __tablename__ = "streams"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    provider: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    profile: Mapped[str] = mapped_column(String(64))
    seconds: Mapped[int] = mapped_column(Integer)
    last_start: Mapped[dt.datetime] = mapped_column(DateTime)
    last_window_id: Mapped[int] = mapped_column(ForeignKey("windows.id", ondelete="CASCADE"))
    windows: Mapped[int] = mapped_column(Integer, default=0)  # totals, kept by advance_stream (migration 0002)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[dt.datetime | None] = mapped_column(DateTime)  # the newest windows.updated_at
    __table_args__ = (UniqueConstraint("provider", "model", "profile", "seconds", name="uq_streams_key"),)


class WindowTrace(Base):
    """A verified trace in its window: the drill-down from a window to its traces and their scores file."""

    __tablename__ = "window_traces"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    window_id: Mapped[int] = mapped_column(ForeignKey("windows.id", ondelete="CASCADE"))
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"))
    trace_id: Mapped[str] = mapped_column(String(256))
    request_time: Mapped[dt.datetime] = mapped_column(DateTime)
    tokens: Mapped[int] = mapped_column(Integer)
    exact_matches: Mapped[int] = mapped_column(Integer)
    mean_margin: Mapped[float] = mapped_column(Float)
    __table_args__ = (UniqueConstraint("shard_id", "trace_id", name="uq_window_traces_trace"),
                      Index("ix_window_traces_window", "window_id", "request_time"))


class AuditRun(Base):
    """One scheduled external audit (``verinfer.api.audit``); its slot is claimed once across monitors."""

    __tablename__ = "audit_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    slot: Mapped[dt.datetime] = mapped_column(DateTime, unique=True)
    owner: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="running")  # running, done, failed
    started_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    out_dir: Mapped[str] = mapped_column(String(1024))
    error: Mapped[str | None] = mapped_column(Text)


class AuditResult(ResultColumns, Base):
    """A provider's verdict in one scheduled audit, beside the traffic windows of the same provider."""

    __tablename__ = "audits"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("audit_runs.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(String(1024))
    mode: Mapped[str] = mapped_column(String(32))
    at: Mapped[dt.datetime] = mapped_column(DateTime)
    report: Mapped[str | None] = mapped_column(String(1024))
    __table_args__ = (Index("ix_audits_provider", "provider", "model", "at"),)


# --------------------------------------------------------------------------------------------------
# the dashboard's reads (issue #30), each an index range scan or lookup (tests/test_store.py checks the
# plans of every statement the dashboard's pages run)


@dataclass(frozen=True)
class Key:
    """A stream: one provider/model/profile at one window length (``streams``' and ``windows``' key)."""

    provider: str
    model: str
    profile: str
    seconds: int

    @classmethod
    def of(cls, row: "Window | Stream") -> "Key":
        return cls(row.provider, row.model, row.profile, row.seconds)

    def where(self, table: type[Window] | type[Stream] = Window) -> Any:
        return and_(table.provider == self.provider, table.model == self.model, table.profile == self.profile,
                    table.seconds == self.seconds)

    @property
    def label(self) -> str:
        return f"{self.provider} / {self.model} / {self.profile} / {self.seconds}s windows"


def latest(provider: str | None = None, model: str | None = None, profile: str | None = None) -> Select:
    """The newest window of every stream (the current state), in key order: one row per ``streams``
    row, the window by primary key; only the streams of ``provider`` / ``model`` / ``profile`` when given."""
    q = select(Window).join(Stream, Stream.last_window_id == Window.id)
    for column, value in ((Stream.provider, provider), (Stream.model, model), (Stream.profile, profile)):
        if value is not None:
            q = q.where(column == value)
    return q.order_by(Stream.provider, Stream.model, Stream.profile, Stream.seconds)


def totals(key: Key) -> Select:
    """A stream's window count, tokens and last update: its ``streams`` row (``uq_streams_key`` lookup)."""
    return select(Stream.windows, Stream.tokens, Stream.updated_at).where(key.where(Stream))


def _range(key: Key, since: dt.datetime | None, until: dt.datetime | None) -> list:
    return [key.where()] + ([Window.start_time >= since] if since is not None else []) + \
        ([Window.start_time <= until] if until is not None else [])


def timeline(key: Key, since: dt.datetime | None = None, until: dt.datetime | None = None,
             newest: int | None = None) -> Select:
    """A stream's windows starting in [since, until], oldest first; with ``newest``, only the newest
    that many, newest first (``uq_windows_key`` range)."""
    q = select(Window).where(*_range(key, since, until))
    return q.order_by(Window.start_time) if newest is None else q.order_by(Window.start_time.desc()).limit(newest)


def timeline_count(key: Key, since: dt.datetime | None = None, until: dt.datetime | None = None) -> Select:
    """How many windows ``timeline`` holds."""
    return select(func.count()).select_from(Window).where(*_range(key, since, until))


def neighbour(key: Key, start: dt.datetime, later: bool) -> Select:
    """The stream's window just after (``later``) or just before ``start``."""
    q = select(Window).where(key.where(), Window.start_time > start if later else Window.start_time < start)
    return q.order_by(Window.start_time if later else Window.start_time.desc()).limit(1)


def last_with(key: Key, verdict: str | None, before: dt.datetime | None = None) -> Select:
    """Start of the stream's newest window with ``verdict`` (None: without a verdict), before ``before``:
    one lookup of ``ix_windows_state`` (an IN or OR over verdicts would walk the stream's windows)."""
    return select(func.max(Window.start_time)).where(
        key.where(), Window.verdict.is_(None) if verdict is None else Window.verdict == verdict,
        *([Window.start_time < before] if before is not None else []))


def first_after(key: Key, after: dt.datetime | None) -> Select:
    """Start of the stream's first window after ``after`` (None: its first window)."""
    return select(func.min(Window.start_time)).where(key.where(),
                                                     *([Window.start_time > after] if after is not None else []))


def traces_of(window_id: int, limit: int | None = None, offset: int = 0) -> Select:
    """A window's traces in request order with their shards (which name the scores file holding their
    per-token scores), ``limit`` from ``offset`` (``ix_window_traces_window``)."""
    return (select(WindowTrace, Shard).join(Shard, Shard.id == WindowTrace.shard_id)
            .where(WindowTrace.window_id == window_id).order_by(WindowTrace.request_time, WindowTrace.trace_id)
            .limit(limit).offset(offset))


def trace_count(window_id: int) -> Select:
    return select(func.count()).select_from(WindowTrace).where(WindowTrace.window_id == window_id)


# --------------------------------------------------------------------------------------------------
# the monitor's writes shared with tests and benchmarks


def dialect_insert(dialect: str, table) -> Any:
    """An INSERT that can take ``on_conflict_do_nothing`` in the store's dialect."""
    return (pg_insert if dialect == "postgresql" else sqlite_insert)(table)


def advance_stream(s: Session, window: Window, windows: int = 0, tokens: int = 0) -> None:
    """Point the window's stream at it if it is the stream's newest, and add ``windows`` new windows and
    ``tokens`` (the change in the stream's token count) to its totals. The monitor calls it after locking
    the windows (one lock order, no deadlock), in the transaction that wrote them: the counters move with
    the windows or not at all."""
    key = Key.of(window)
    s.execute(dialect_insert(s.get_bind().dialect.name, Stream).values(
        provider=key.provider, model=key.model, profile=key.profile, seconds=key.seconds,
        last_start=window.start_time, last_window_id=window.id, windows=0, tokens=0)
        .on_conflict_do_nothing(index_elements=["provider", "model", "profile", "seconds"]))
    s.execute(update(Stream).where(key.where(Stream)).values(
        windows=Stream.windows + windows, tokens=Stream.tokens + tokens,
        updated_at=case((or_(Stream.updated_at.is_(None), Stream.updated_at < window.updated_at), window.updated_at),
                        else_=Stream.updated_at)))
    s.execute(update(Stream).where(Stream.provider == key.provider, Stream.model == key.model,
                                   Stream.profile == key.profile, Stream.seconds == key.seconds,
                                   Stream.last_start < window.start_time)
              .values(last_start=window.start_time, last_window_id=window.id))


# --------------------------------------------------------------------------------------------------
# engines


def database_url(url: str) -> str:
    """``postgresql://`` -> the psycopg 3 driver; a bare path -> ``sqlite:///path``."""
    if "://" not in url:
        return f"sqlite:///{url}"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def shown(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        return make_url(database_url(url)).render_as_string(hide_password=True)
    except ArgumentError:
        return "<malformed database URL>"


def _wal(dbapi_connection, seconds: float = 60.0) -> None:
    """Switch to WAL, retrying while another process does the same on a new file: SQLite can answer
    that pragma "database is locked" at once, without waiting in its busy handler (seen in CI with two
    processes opening one new database)."""
    import sqlite3
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            dbapi_connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sqlite_setup(engine: Engine) -> None:
    """WAL (readers beside one writer) and BEGIN IMMEDIATE, so a transaction that will write holds the
    write lock from its start (SQLAlchemy's documented pysqlite recipe): no upgrade deadlocks."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        _wal(dbapi_connection)
        dbapi_connection.execute("PRAGMA foreign_keys=ON")

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str) -> Engine:
    """An engine for ``url`` (no connection yet); StoreError for a malformed or unsupported one."""
    full = database_url(url)
    try:
        parsed = make_url(full)
    except ArgumentError:
        raise StoreError(f"--db {url!r}: not a database URL (sqlite:///PATH or postgresql://USER@HOST/DB)") from None
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(full, connect_args={"timeout": 60})
        _sqlite_setup(engine)
        return engine
    if parsed.get_backend_name() == "postgresql":
        return create_engine(full, pool_pre_ping=True, connect_args={"connect_timeout": 10})
    raise StoreError(f"--db {shown(url)}: unsupported database {parsed.get_backend_name()!r} (use sqlite or postgresql)")


def upgrade(engine: Engine) -> None:
    """Apply the Alembic migrations up to head, once even when several processes open together."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
        config.attributes["connection"] = conn
        command.upgrade(config, "head")


class Store:
    """An opened, migrated verification history."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        try:
            upgrade(self.engine)
        except OperationalError as exc:
            self.engine.dispose()
            reason = str(exc.orig or exc).strip().splitlines()[0] if str(exc.orig or exc).strip() else type(exc).__name__
            raise StoreError(f"--db {shown(url)}: cannot open the database ({reason})") from None
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Session]:
        """One transaction: committed on success, rolled back on any error."""
        with self.sessions() as session, session.begin():
            yield session

    def close(self) -> None:
        self.engine.dispose()


def open_store(url: str) -> Store:
    """Open (and migrate) the database at ``url``; StoreError with one line when it cannot be used."""
    return Store(url)


__all__ = ["AuditResult", "AuditRun", "Base", "Key", "Shard", "ShardResult", "Store", "StoreError", "Stream", "Window",
           "WindowTrace", "advance_stream", "database_url", "dialect_insert", "first_after", "last_with", "latest",
           "make_engine", "neighbour", "open_store", "shown", "timeline", "timeline_count", "totals", "trace_count",
           "traces_of", "upgrade", "utcnow"]
