"""The verification history's database, in SQLite and a real PostgreSQL: Alembic migrations that
match the models and are idempotent (also when two processes open a new database together), and
every statement the dashboard's pages run answered from indexes with 100,000 windows in the table."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import event, insert, inspect, select, text
from sqlalchemy.engine import Engine

from tests.postgres_server import db_url, postgres_server  # noqa: F401 - fixtures
from verinfer.production.dashboard import create_app
from verinfer.production.store import (MIGRATIONS, Base, Key, Shard, Stream, Window, WindowTrace, latest, open_store,
                                       timeline, traces_of)

def _head() -> str:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(config).get_current_head()


def test_migrations_match_the_models_and_are_idempotent(db_url):
    store = open_store(db_url)
    again = open_store(db_url)  # a second open: nothing to do
    with store.engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == _head()
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        assert conn.execute(text("SELECT COUNT(*) FROM alembic_version")).scalar() == 1
    assert set(inspect(store.engine).get_table_names()) == {"alembic_version", *Base.metadata.tables}
    store.close()
    again.close()


def test_two_processes_opening_a_new_database_migrate_it_once(db_url):
    code = "import sys; from verinfer.production.store import open_store; open_store(sys.argv[1]).close(); print('ok')"
    procs = [subprocess.Popen([sys.executable, "-c", code, db_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err
    store = open_store(db_url)
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [_head()]
    store.close()


def test_migration_0002_fills_stream_totals_from_existing_windows(db_url):
    """A history written at revision 0001 (totals summed from the windows on every read) keeps its
    totals when upgraded: each stream's new counters are its windows' count, tokens and last update."""
    from alembic import command

    from verinfer.production.store import make_engine

    engine = make_engine(db_url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
    t0 = dt.datetime(2026, 1, 1)
    with engine.begin() as conn:
        for k, (provider, n) in enumerate((("acme", 3), ("other", 2))):
            for i in range(n):
                conn.execute(text(
                    "INSERT INTO windows (id, provider, model, profile, seconds, start_time, end_time, shards, computed, "
                    "traces, tokens, updated_at) VALUES (:id, :p, 'm', 'greedy', 60, :s, :e, 1, 1, 2, :tok, :u)"),
                    dict(id=10 * k + i + 1, p=provider, s=t0 + dt.timedelta(minutes=i), e=t0 + dt.timedelta(minutes=i + 1),
                         tok=100 + i, u=t0 + dt.timedelta(minutes=i + 5)))
            conn.execute(text("INSERT INTO streams (provider, model, profile, seconds, last_start, last_window_id) "
                              "VALUES (:p, 'm', 'greedy', 60, :s, :w)"),
                         dict(p=provider, s=t0 + dt.timedelta(minutes=n - 1), w=10 * k + n))
    engine.dispose()
    store = open_store(db_url)
    with store.engine.connect() as conn:
        got = conn.execute(text("SELECT provider, windows, tokens, updated_at FROM streams ORDER BY provider")).all()
    assert [(p, w, t) for p, w, t, _ in got] == [("acme", 3, 303), ("other", 2, 201)]
    assert [u if isinstance(u, dt.datetime) else dt.datetime.fromisoformat(u) for *_, u in got] == \
        [t0 + dt.timedelta(minutes=7), t0 + dt.timedelta(minutes=6)]
    with store.engine.connect() as conn:  # 0003: the windows of the time before sampling verified every trace
        assert conn.execute(text("SELECT COUNT(*), SUM(offered), SUM(traces) FROM windows")).one() == (5, 10, 10)
    store.close()


def _plan(conn, statement: str, parameters) -> str:
    """The query plan of one statement as the driver ran it (its own parameters)."""
    if conn.dialect.name == "sqlite":
        return "\n".join(str(r[-1]) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters))
    return "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {statement}", parameters))


FULL_SCAN = re.compile(r"^(SCAN (windows|window_traces)( |$)|.*Seq Scan on (windows|window_traces)( |$))")


def test_dashboard_reads_use_indexes_with_100000_windows(db_url):
    """Every statement the dashboard's pages and /metrics run, recorded as the driver gets it, is
    planned without a full scan of ``windows`` or ``window_traces`` (SQLite: no ``SCAN windows``, also
    not through an index; PostgreSQL: no ``Seq Scan``)."""
    store = open_store(db_url)
    t0 = dt.datetime(2026, 1, 1)
    streams = [(f"provider-{p}", "smollm2-135m", profile) for p in range(25) for profile in ("vllm", "greedy")]
    per = 100_000 // len(streams)
    verdicts = ("CONSISTENT", "CONSISTENT", "INCONSISTENT", None)
    with store.transaction() as s:
        s.execute(insert(Window), [
            dict(provider=p, model=m, profile=f, seconds=600, start_time=t0 + dt.timedelta(minutes=10 * i),
                 end_time=t0 + dt.timedelta(minutes=10 * i + 10), shards=1, computed=1, traces=4, tokens=48,
                 updated_at=t0, verdict=verdicts[(i // 7) % 4], exact_match_rate=1.0, mean_margin=0.0)
            for p, m, f in streams for i in range(per)])
        s.execute(insert(Stream), [dict(provider=p, model=m, profile=f, seconds=600,
                                        last_start=t0 + dt.timedelta(minutes=10 * (per - 1)), last_window_id=(k + 1) * per,
                                        windows=per, tokens=48 * per, updated_at=t0)
                                   for k, (p, m, f) in enumerate(streams)])
        shard = Shard(path="/x/a.parquet", sha256="0" * 64, bytes=1, status="done", attempts=1, discovered_at=t0)
        s.add(shard)
        s.flush()
        s.execute(insert(WindowTrace), [dict(window_id=w, shard_id=shard.id, trace_id=f"t{w}-{k}",
                                              request_time=t0, tokens=12, exact_matches=12, mean_margin=0.0)
                                         for w in range(1, 2001) for k in range(4)])
    with store.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("ANALYZE"))
            conn.commit()
        assert conn.execute(select(text("COUNT(*)")).select_from(Window)).scalar() == 100_000
        key = Key("provider-3", "smollm2-135m", "vllm", 600)
        assert len(conn.execute(timeline(key, t0 + dt.timedelta(days=3), t0 + dt.timedelta(days=4))).all()) == 145
        current = conn.execute(latest()).all()
        assert len(current) == len(streams) and {w.start_time for w in current} == {t0 + dt.timedelta(minutes=10 * (per - 1))}
        assert len(conn.execute(traces_of(5)).all()) == 4

    ran: list[tuple[str, object]] = []

    def record(_conn, _cursor, statement, parameters, _context, _executemany):
        if statement.lstrip().upper().startswith("SELECT"):
            ran.append((statement, parameters))

    since = (t0 + dt.timedelta(days=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    event.listen(Engine, "before_cursor_execute", record)
    try:
        with TestClient(create_app(store)) as client:
            for page in ("/?points=50", "/?provider=provider-3&profile=vllm", f"/?since={since}&points=50",
                         "/metrics", "/window/5", f"/window/{2 * per}"):
                assert client.get(page).status_code == 200, page
    finally:
        event.remove(Engine, "before_cursor_execute", record)
    tables = " ".join(statement for statement, _ in ran)
    assert all(f"FROM {t}" in tables or f"JOIN {t}" in tables for t in ("streams", "windows", "window_traces", "audits"))
    with store.engine.connect() as conn:
        plans = {statement: _plan(conn, statement, parameters) for statement, parameters in ran}
    for statement, plan in plans.items():
        assert not any(FULL_SCAN.match(line.strip().lstrip("-> ")) for line in plan.splitlines()), (statement, plan)
    store.close()
