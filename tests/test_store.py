"""The verification history's database, in SQLite and a real PostgreSQL: Alembic migrations that
match the models and are idempotent (also when two processes open a new database together), and
the dashboard's reads answered from indexes with 100,000 windows in the table."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import insert, inspect, select, text

from tests.postgres_server import db_url, postgres_server  # noqa: F401 - fixtures
from verinfer.production.store import (MIGRATIONS, Base, Shard, Stream, Window, WindowTrace, last_other_verdict, latest,
                                       open_store, timeline, traces_of)

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


def _plan(conn, statement) -> str:
    compiled = statement.compile(conn, compile_kwargs={"literal_binds": True})
    if conn.dialect.name == "sqlite":
        return "\n".join(str(r[-1]) for r in conn.execute(text(f"EXPLAIN QUERY PLAN {compiled}")))
    return "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN {compiled}")))


def test_dashboard_reads_use_indexes_with_100000_windows(db_url):
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
                                        last_start=t0 + dt.timedelta(minutes=10 * (per - 1)), last_window_id=(k + 1) * per)
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
        assert conn.execute(select(text("COUNT(*)")).select_from(Window)).scalar() == 100_000
        day = timeline("provider-3", "smollm2-135m", "vllm", 600, t0 + dt.timedelta(days=3), t0 + dt.timedelta(days=4))
        assert len(conn.execute(day).all()) == 144
        current = conn.execute(latest()).all()
        assert len(current) == len(streams) and {w.start_time for w in current} == {t0 + dt.timedelta(minutes=10 * (per - 1))}
        newest = conn.execute(select(Window).where(Window.provider == "provider-3", Window.profile == "vllm")
                              .order_by(Window.start_time.desc()).limit(1)).one()
        since = conn.execute(last_other_verdict(newest)).scalar()
        assert since is not None and since < newest.start_time
        assert len(conn.execute(traces_of(5)).all()) == 4
        plans = {name: _plan(conn, q) for name, q in (
            ("timeline", day), ("since", last_other_verdict(newest)), ("traces", traces_of(5)), ("latest", latest()))}
    for name, plan in plans.items():
        if store.dialect == "sqlite":
            assert "SEARCH windows USING" in plan or "SEARCH window_traces USING" in plan, (name, plan)
            assert not any(line.strip() in ("SCAN windows", "SCAN window_traces") for line in plan.splitlines()), \
                (name, plan)
        else:
            assert "Index" in plan and "Seq Scan on windows" not in plan and "Seq Scan on window_traces" not in plan, \
                (name, plan)
    store.close()
