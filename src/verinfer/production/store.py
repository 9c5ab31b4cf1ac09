"""The verification history: SQLAlchemy 2.0 models of shards, per-shard and per-window results and
scheduled audits, in SQLite (the embedded default) or PostgreSQL (by URL, psycopg 3).

The schema is created and evolved only by Alembic (``verinfer/production/migrations``), applied on
every open (``alembic.command.upgrade(config, "head")``; a no-op once at head), under a lock so
that two monitors starting together migrate once: PostgreSQL's advisory lock, SQLite's write lock.

Exactly-once bookkeeping rests on the database: a shard's identity is unique ``(path, sha256)``, a
monitor claims it with a conditional UPDATE (pending, or claimed with an expired lease) and
records its results together with ``status='done'`` in one transaction (``verinfer.production.monitor``).

Indexes serve the dashboard (issue #30): a timeline per provider/model/profile is a range scan of
``uq_windows_key``; the current state and "since when" are index lookups of the latest window and of
the latest window with another verdict (``streams``, ``ix_windows_state``); a window's traces are
``ix_window_traces_window``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from pathlib import Path
from typing import Iterator

from sqlalchemy import (BigInteger, DateTime, Float, ForeignKey, Index, Integer, Select, String, Text,
                        UniqueConstraint, and_, create_engine, event, func, or_, select, text)
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
    computed: Mapped[int] = mapped_column(Integer, default=0)  # times recomputed (a later shard added traces)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    __table_args__ = (UniqueConstraint("provider", "model", "profile", "seconds", "start_time", name="uq_windows_key"),
                      Index("ix_windows_start", "start_time"),
                      Index("ix_windows_state", "provider", "model", "profile", "seconds", "verdict", "start_time"))


class Stream(Base):
    """A provider/model/profile at one window length, and its newest window: the current state is one
    row per stream, read without scanning the windows (``latest``)."""

    __tablename__ = "streams"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    provider: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    profile: Mapped[str] = mapped_column(String(64))
    seconds: Mapped[int] = mapped_column(Integer)
    last_start: Mapped[dt.datetime] = mapped_column(DateTime)
    last_window_id: Mapped[int] = mapped_column(ForeignKey("windows.id", ondelete="CASCADE"))
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
# the dashboard's reads (issue #30), each an index range scan or lookup (tests/test_store.py checks the plans)


def timeline(provider: str, model: str, profile: str, seconds: int, since: dt.datetime | None = None,
             until: dt.datetime | None = None) -> Select:
    """One provider/model/profile's windows of one length, oldest first (``uq_windows_key``)."""
    q = select(Window).where(Window.provider == provider, Window.model == model, Window.profile == profile,
                             Window.seconds == seconds)
    if since is not None:
        q = q.where(Window.start_time >= since)
    if until is not None:
        q = q.where(Window.start_time < until)
    return q.order_by(Window.start_time)


def latest() -> Select:
    """The newest window of every stream (provider/model/profile and window length): the current state."""
    return select(Window).where(Window.id.in_(select(Stream.last_window_id)))


def last_other_verdict(window: Window) -> Select:
    """The newest earlier window of the same stream whose verdict differs: the current verdict holds
    since the window after it (``ix_windows_state``)."""
    other = (or_(Window.verdict != window.verdict, Window.verdict.is_(None)) if window.verdict is not None
             else Window.verdict.is_not(None))
    return (select(func.max(Window.start_time))
            .where(Window.provider == window.provider, Window.model == window.model, Window.profile == window.profile,
                   Window.seconds == window.seconds, Window.start_time < window.start_time, other))


def traces_of(window_id: int) -> Select:
    """A window's traces in request order, with the scores file holding their per-token scores."""
    return (select(WindowTrace, Shard.path, Shard.scores_path).join(Shard, Shard.id == WindowTrace.shard_id)
            .where(WindowTrace.window_id == window_id).order_by(WindowTrace.request_time))


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


def _sqlite_setup(engine: Engine) -> None:
    """WAL (readers beside one writer) and BEGIN IMMEDIATE, so a transaction that will write holds the
    write lock from its start (SQLAlchemy's documented pysqlite recipe): no upgrade deadlocks."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
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


__all__ = ["AuditResult", "AuditRun", "Base", "Shard", "ShardResult", "Store", "StoreError", "Stream", "Window", "WindowTrace",
           "database_url", "last_other_verdict", "latest", "make_engine", "open_store", "shown", "timeline", "traces_of",
           "upgrade", "utcnow"]
