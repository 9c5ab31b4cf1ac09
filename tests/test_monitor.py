"""``verinfer monitor``: shards verified through the one scoring path into SQLite and a real
PostgreSQL, windows recomputed from all their shards, calibrated and uncalibrated verdicts, failed
shards recorded, scheduled audits; exactly once under restart, kill -9 and two monitors (real
processes), and one-line errors for bad input."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from tests.audit_servers import free_port
from tests.postgres_server import db_url, postgres_server  # noqa: F401 - fixtures
from verinfer import api
from verinfer.production.budget import Budget
from verinfer.production.monitor import Judge, Monitor, parse_duration, window_start
from verinfer.production.store import database_url, open_store
from verinfer.stats.calibration import Calibrator
from verinfer.stats.summary import token_statistics
from verinfer.trace import Trace, write_traces

T0 = dt.datetime(2026, 3, 1, 12, 0, 0)


def timed(traces: list[Trace], provider: str, start: dt.datetime, step_s: float) -> list[Trace]:
    """Copies of ``traces`` from ``provider`` with request times ``start + i * step_s`` (as the gateway writes)."""
    return [Trace(**{**t.__dict__, "provider": provider,
                     "meta": {"request_time": (start + dt.timedelta(seconds=i * step_s)).isoformat() + "Z"}})
            for i, t in enumerate(traces)]


def query(url: str, sql: str) -> list[tuple]:
    engine = create_engine(database_url(url))
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def honest(backend):
    return api.generate("chitchat", n=12, max_tokens=12, seed=1000, backend=backend)


@pytest.fixture(scope="module")
def calibration(backend, tmp_path_factory):
    """A calibration on separate honest traces (128 tokens: batches of 1 token at 1% FPR)."""
    cal = api.generate("chitchat", n=8, max_tokens=16, seed=7000, backend=backend)
    out = tmp_path_factory.mktemp("cal") / "calibration.json"
    api.calibrate(api.verify(cal, backend=backend), batch_sizes=(1,), out=out)
    return out


@pytest.fixture(scope="module")
def wrong_seed(backend, honest):
    """Traces sampled with other seeds that claim the honest ones (what the seed proxy does)."""
    other = api.generate("chitchat", n=6, max_tokens=12, seed=9000, backend=backend)
    return [Trace(**{**t.__dict__, "id": f"wrong-{i}", "sampling": t.sampling.with_(seed=h.sampling.seed)})
            for i, (t, h) in enumerate(zip(other, honest))]


def window_rows(url: str) -> list[tuple]:
    return query(url, "SELECT provider, start_time, traces, tokens, shards, exact_match_rate, mean_margin, verdict, "
                      "p_value, tokens_needed, first_flagged FROM windows ORDER BY provider, start_time")


def test_traffic_no_shipped_calibration_fits_is_recorded_uncalibrated_with_how_to_fit_one(backend, honest):
    """Settings nothing ships for (T 0.7): statistics, no verdict, and a note saying why and how to calibrate."""
    columns = api.verify(honest[:2], backend=backend).columns
    sig = {"model": backend.model_id, "dtype": "float32",
           "sampling": [{**honest[0].sampling.signature(), "temperature": 0.7}]}
    out = Judge()(columns, sig)
    assert out["verdict"] is None and out["judged_by"] is None and out["tokens"] == columns["margin"].size
    assert out["note"].startswith("uncalibrated") and "no shipped calibration fits" in out["note"]
    assert "--calibration cal.json" in out["note"]
    judged = Judge()(columns, {**sig, "sampling": [honest[0].sampling.signature()]})
    assert judged["verdict"] == "CONSISTENT" and "(shipped default)" in judged["judged_by"]
    assert Judge(defaults=False)(columns, {**sig, "sampling": [honest[0].sampling.signature()]})["verdict"] is None


def test_the_budget_chooses_a_keyed_uniform_subset():
    ids = [f"chatcmpl-{i}/0" for i in range(20000)]
    for fraction in (0.01, 0.1, 0.5):
        chosen = [i for i in ids if Budget(fraction, b"k" * 32).chosen(i)]
        sd = (len(ids) * fraction * (1 - fraction)) ** 0.5
        assert abs(len(chosen) - len(ids) * fraction) < 5 * sd, (fraction, len(chosen))
    a, b = (set(filter(Budget(0.1, key).chosen, ids)) for key in (b"a" * 32, b"b" * 32))
    assert a == set(filter(Budget(0.1, b"a" * 32).chosen, ids)) and len(a & b) < 0.2 * len(a)  # the key decides
    assert all(Budget(1.0).chosen(i) for i in ids[:100])
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="--sample must be in"):
            Budget(bad)


def test_a_sampling_monitor_verifies_the_chosen_traces_and_records_what_it_left(db_url, backend, honest, wrong_seed,
                                                                                 calibration, tmp_path):
    """--sample 0.5: only the chosen traces are scored; each window records the traces it held (offered)
    beside those verified, each shard its fraction; a window none of whose traces was chosen says so;
    the wrong-seed provider is still flagged from the half it verified."""
    d = tmp_path / "traces"
    write_traces(timed(honest, "acme", T0, 20), d / "a.parquet")
    write_traces(timed(wrong_seed, "cheat", T0, 20), d / "b.parquet")
    budget = Budget(0.5, b"a-fixed-key-for-this-test-------")
    left_out = [t for t in timed(honest, "quiet", T0 + dt.timedelta(minutes=30), 20) if not budget.chosen(t.id)]
    write_traces(left_out, d / "c.parquet")  # a shard none of whose traces is chosen: done, nothing scored
    store = open_store(db_url)
    out = Monitor(d, store, window_s=60, backend=backend, budget=budget,
                  judge=Judge(Calibrator.load(calibration), "cal.json")).run_once()
    assert len(out.verified) == 3 and not out.failed
    everything = honest + wrong_seed + left_out
    chosen = {t.id for t in everything if budget.chosen(t.id)}
    assert 0 < len(chosen) < len(everything)
    assert {r[0] for r in query(db_url, "SELECT trace_id FROM window_traces")} == chosen
    assert query(db_url, "SELECT SUM(offered), SUM(traces) FROM windows") == [(len(everything), len(chosen))]
    assert query(db_url, "SELECT DISTINCT sample FROM shards") == [(0.5,)]
    assert left_out and query(db_url, "SELECT SUM(offered), SUM(traces), COUNT(verdict) FROM windows "
                                      "WHERE provider = 'quiet'") == [(len(left_out), 0, 0)]
    assert query(db_url, "SELECT SUM(offered), SUM(traces) FROM shards") == [(len(everything), len(chosen))]
    for offered, traces, note in query(db_url, "SELECT offered, traces, note FROM windows"):
        assert offered >= traces and (traces > 0 or note.startswith(f"not verified: none of its {offered} traces"))
    cheat = query(db_url, "SELECT verdict FROM windows WHERE provider = 'cheat' AND traces > 0")
    assert "INCONSISTENT" in {v for (v,) in cheat}
    store.close()


def test_keep_up_thins_each_shard_by_the_shards_waiting_and_records_its_fraction(db_url, backend, honest, tmp_path):
    """--keep-up: the shard claimed with k shards pending behind it is verified at --sample / (1 + k),
    chosen by the same key (a thinner fraction's traces are a subset of a thicker one's); each shard
    records that fraction, and the windows what they held beside what was verified."""
    key = b"a-fixed-key-for-the-keep-up-test"
    ids = [f"t{i}" for i in range(4000)]
    half, quarter = Budget(0.5, key), Budget(0.5, key).thinned(1)
    assert quarter.fraction == 0.25 and Budget(0.5, key).thinned(0) == half
    assert set(filter(quarter.chosen, ids)) <= set(filter(half.chosen, ids))
    d = tmp_path / "traces"
    traces = timed([Trace(**{**t.__dict__, "id": f"{t.id}.{c}"}) for c in range(3) for t in honest], "acme", T0, 3)
    _write_shards(traces, d, 4)
    store = open_store(db_url)
    mon = Monitor(d, store, window_s=60, backend=backend, budget=Budget(0.5, key), keep_up=True)
    assert len(mon.run_once().verified) == 4
    rows = query(db_url, "SELECT sample, offered, traces FROM shards ORDER BY id")
    assert [r[0] for r in rows] == pytest.approx([0.5 / 4, 0.5 / 3, 0.5 / 2, 0.5])  # 3, 2, 1, 0 waiting
    per_shard = np.array_split(np.arange(len(traces)), 4)
    chosen = {traces[i].id for part, (fraction, _, _) in zip(per_shard, rows) for i in part
              if Budget(fraction, key).chosen(traces[i].id)}
    assert {r[0] for r in query(db_url, "SELECT trace_id FROM window_traces")} == chosen
    assert sum(r[2] for r in rows) == len(chosen) and sum(r[1] for r in rows) == len(traces)
    assert mon.fraction_now == 0.5 and mon.health()[1]["sample"] == 0.5
    store.close()


def test_retention_deletes_verified_shards_then_old_history_and_nothing_unverified(db_url, backend, honest, tmp_path):
    """--retain-shards: shard files (and score files) verified longer ago go, rows kept and marked; an old
    unverifiable/ shard goes; a shard not yet verified stays. --retain-history: windows, their traces and
    the rows of deleted shards older than that go. A rescan registers nothing again."""
    from verinfer.production.store import utcnow

    d = tmp_path / "traces"
    write_traces(timed(honest[:6], "acme", T0, 10), d / "a.parquet")
    write_traces(timed(honest[6:], "acme", T0 + dt.timedelta(minutes=5), 10), d / "b.parquet")
    (d / "unverifiable").mkdir()
    write_traces(honest[:1], d / "unverifiable" / "old.parquet")
    os.utime(d / "unverifiable" / "old.parquet", (time.time() - 9 * 86400,) * 2)
    store = open_store(db_url)
    day = 86400
    mon = Monitor(d, store, window_s=60, backend=backend, retain_shards_s=7 * day)
    assert len(mon.run_once().verified) == 2  # just verified: nothing is old enough yet
    assert (d / "a.parquet").exists() and not (d / "unverifiable" / "old.parquet").exists()
    write_traces(timed(honest[:2], "late", T0, 10), d / "c.parquet")  # found later, not verified yet
    mon.scan()
    scores = list((tmp_path / "traces.verinfer").glob("*.scores.parquet"))
    assert len(scores) == 2
    pruned = mon.prune(now=utcnow() + dt.timedelta(days=8))
    assert pruned["shard_files_deleted"] == 2 and not (d / "a.parquet").exists() and not (d / "b.parquet").exists()
    assert (d / "c.parquet").exists() and not any(p.exists() for p in scores)
    assert query(db_url, "SELECT COUNT(*) FROM shards WHERE files_deleted_at IS NOT NULL") == [(2,)]
    assert mon.scan() == 0 and query(db_url, "SELECT COUNT(*) FROM windows") == [(2,)]
    history = Monitor(d, store, window_s=60, backend=backend, retain_shards_s=7 * day, retain_history_s=30 * day)
    pruned = history.prune(now=utcnow() + dt.timedelta(days=8))  # the windows are from March: older than 30 days
    assert pruned["windows_deleted"] == 2 and pruned["shard_rows_deleted"] == 0  # verified 8 days ago: kept
    pruned = history.prune(now=utcnow() + dt.timedelta(days=31))
    assert pruned["shard_rows_deleted"] == 2
    assert query(db_url, "SELECT COUNT(*) FROM window_traces") == [(0,)]
    assert query(db_url, "SELECT status FROM shards") == [("pending",)]  # c, still to verify
    for kw, match in (({"retain_shards_s": 60}, "at least two windows"),
                      ({"retain_shards_s": 7 * day, "retain_history_s": day}, "at least --retain-shards")):
        with pytest.raises(ValueError, match=match):
            Monitor(d, store, window_s=60, backend=backend, **kw)
    store.close()


def test_durations_and_buckets():
    assert [parse_duration(x) for x in ("90s", "10m", "1h", "2d", "45")] == [90, 600, 3600, 172800, 45]
    assert parse_duration("30", unit="m") == 1800
    for bad in ("0m", "ten minutes", "-5m", "5w"):
        with pytest.raises(ValueError, match="positive duration"):
            parse_duration(bad)
    assert window_start(dt.datetime(2026, 3, 1, 12, 9, 59), 600) == dt.datetime(2026, 3, 1, 12, 0)
    assert window_start(dt.datetime(2026, 3, 1, 12, 10, 0), 600) == dt.datetime(2026, 3, 1, 12, 10)


def test_every_shard_and_window_recorded_once(db_url, backend, honest, tmp_path):
    """Three shards, one window fed by two of them: every trace in exactly one window, each window's
    statistics those of `verify` over its traces, and a second pass (or a restarted monitor) adds nothing."""
    d = tmp_path / "traces"
    a, b, c = timed(honest[:4], "acme", T0, 10), timed(honest[4:8], "acme", T0 + dt.timedelta(seconds=40), 10), \
        timed(honest[8:], "other", T0, 30)
    write_traces(a, d / "a.parquet")
    write_traces(b, d / "b.parquet")
    write_traces(c, d / "c.jsonl")
    (d / "d.parquet.tmp").write_text("a shard still being written: never read")
    store = open_store(db_url)
    first = Monitor(d, store, window_s=60, backend=backend).run_once()
    assert first.found == 3 and len(first.verified) == 3 and not first.failed
    total = sum(len(t.output_token_ids) for t in honest)
    assert query(db_url, "SELECT SUM(tokens), COUNT(*) FROM shards WHERE status = 'done'") == [(total, 3)]
    assert query(db_url, "SELECT COUNT(*), COUNT(DISTINCT trace_id), SUM(tokens) FROM window_traces") == \
        [(12, 12, total)]
    rows = window_rows(db_url)
    assert sum(r[3] for r in rows) == total
    # acme: T0+0..30 s and T0+40, 50 in the first minute, T0+60, 70 in the second; other: 0, 30 | 60, 90
    by_key = {(r[0], r[1] if isinstance(r[1], dt.datetime) else dt.datetime.fromisoformat(r[1])): r for r in rows}
    assert {k: (r[2], r[4]) for k, r in by_key.items()} == {
        ("acme", T0): (6, 2), ("acme", T0 + dt.timedelta(minutes=1)): (2, 1),
        ("other", T0): (2, 1), ("other", T0 + dt.timedelta(minutes=1)): (2, 1)}
    expected = token_statistics(api.verify(a + b[:2], backend=backend).columns)
    got = by_key[("acme", T0)]
    assert got[3] == expected["tokens"]
    assert got[5] == pytest.approx(expected["exact_match_rate"]) and got[6] == pytest.approx(expected["mean_margin"])
    # no calibration given: the shipped one `verify` uses for these settings judges every window, named
    assert {r[7] for r in rows} == {"CONSISTENT"}
    assert query(db_url, "SELECT DISTINCT judged_by FROM windows") == [
        ("calibration calibration-smollm2-135m-vllm-t1-k50-p0.95-minp0.json (shipped default)",)]  # generate's default profile
    assert query(db_url, "SELECT computed FROM windows WHERE shards = 2") == [(2,)]  # recomputed when b arrived
    assert query(db_url, "SELECT provider, windows, tokens FROM streams ORDER BY provider") == \
        query(db_url, "SELECT provider, COUNT(*), SUM(tokens) FROM windows GROUP BY provider ORDER BY provider")

    again = Monitor(d, store, window_s=60, backend=backend).run_once()  # a restarted monitor
    assert again.found == 0 and again.verified == []
    assert window_rows(db_url) == rows
    assert len(list((tmp_path / "traces.verinfer").glob("*.scores.parquet"))) == 3  # per-token scores beside
    store.close()


def test_calibrated_windows_flag_the_wrong_seed_whatever_the_shard_order(db_url, backend, honest, wrong_seed,
                                                                          calibration, tmp_path):
    """Honest traffic CONSISTENT, a later wrong-seed window INCONSISTENT with its first flagged trace;
    the shard's verdict is `verify --calibration`'s; a late honest shard into the flagged window
    recomputes it over all its tokens, the same as when the shards come in the other order."""
    judge_file = calibration
    shards = {"honest": timed(honest[:6], "acme", T0, 20),
              "wrong": timed(wrong_seed, "acme", T0 + dt.timedelta(minutes=10), 20),
              "late": timed(honest[6:], "acme", T0 + dt.timedelta(minutes=10, seconds=5), 20)}
    results = []
    for order, url in ((("honest", "wrong", "late"), db_url),
                       (("late", "wrong", "honest"), f"sqlite:///{tmp_path}/reversed.db")):
        d = tmp_path / f"traces-{order[0]}"
        d.mkdir()
        store = open_store(url)
        mon = Monitor(d, store, window_s=600, backend=backend, judge=Judge(Calibrator.load(judge_file), "cal.json"))
        for name in order:
            write_traces(shards[name], d / f"{name}.parquet")
            assert len(mon.run_once().verified) == 1
        results.append(window_rows(url))
        if url == db_url:
            shard_rows = dict(query(url, "SELECT s.path, r.p_value FROM shard_results r JOIN shards s "
                                         "ON s.id = r.shard_id"))
            wrong_path = str((d / "wrong.parquet").resolve())
            direct = api.verify(d / "wrong.parquet", backend=backend, calibration=judge_file,
                                scores=tmp_path / "direct.scores.parquet")
            assert direct.verdict.label == "INCONSISTENT"
            assert shard_rows[wrong_path] == pytest.approx(direct.verdict.p_value)
        store.close()
    rows = results[0]
    assert [r[7] for r in rows] == ["CONSISTENT", "INCONSISTENT"]
    flagged = rows[1]
    assert flagged[4] == 2 and flagged[2] == len(wrong_seed) + len(honest[6:])
    assert flagged[10] in {t.id for t in wrong_seed} and flagged[9] is not None and flagged[8] < 0.01
    assert rows[0][10] is None
    normalize = lambda rs: [tuple(round(x, 12) if isinstance(x, float) else x for x in r[2:]) for r in rs]  # noqa: E731
    assert normalize(results[1]) == normalize(rows)  # same tokens, verdicts and p-values in either order
    # the dashboard's drill-down of the flagged window: its first flagged trace a link to that trace's row
    # (with the prompt it was asked), and the verdict said once
    from fastapi.testclient import TestClient

    from verinfer.production.dashboard import create_app

    store = open_store(db_url)
    [(window_id,)] = query(db_url, "SELECT id FROM windows WHERE verdict = 'INCONSISTENT'")
    page = TestClient(create_app(store)).get(f"/window/{window_id}").text
    store.close()
    link = re.search(r'<a href="([^"]*)" id="first-flagged">', page).group(1)
    assert link.endswith(f"#trace-{flagged[10]}") and f'id="trace-{flagged[10]}"' in page
    assert page.count('<div class="prompt"><div><b>user</b>: ') == flagged[2]
    assert "INCONSISTENT INCONSISTENT" not in page and 'id="verdict">INCONSISTENT</span>' in page


def test_greedy_traffic_of_the_bundled_model_is_judged_by_the_shipped_bands(backend, tmp_path):
    traces = api.generate("chitchat", n=4, max_tokens=12, profile="greedy", backend=backend)
    write_traces(timed(traces, "acme", T0, 1), tmp_path / "t" / "g.jsonl")
    store = open_store(f"sqlite:///{tmp_path}/h.db")
    Monitor(tmp_path / "t", store, backend=backend).run_once()
    [(verdict, judged_by, note)] = query(f"sqlite:///{tmp_path}/h.db", "SELECT verdict, judged_by, note FROM windows")
    assert verdict == "CONSISTENT" and judged_by == "bands bands-smollm2-135m-greedy.json"
    assert note.startswith("CONSISTENT") and "resembles reference (fp32)" in note
    store.close()


def test_a_malformed_shard_is_recorded_failed_and_the_monitor_goes_on(backend, honest, tmp_path):
    d = tmp_path / "traces"
    write_traces(timed(honest[:2], "acme", T0, 1), d / "good.jsonl")
    lines = [json.dumps(t.to_dict()) for t in timed(honest[2:4], "acme", T0, 1)]
    (d / "bad.jsonl").write_text(lines[0] + "\n" + lines[1].replace('"output_token_ids": [', '"output_token_ids": ["x", ')
                                 + "\n")
    url = f"sqlite:///{tmp_path}/h.db"
    result = CliRunner().invoke(_app(), ["monitor", str(d), "--db", url, "--once", "--threads", "1"])
    assert result.exit_code == 2, result.output
    rows = dict(query(url, "SELECT path, status || ': ' || COALESCE(error, '') FROM shards"))
    assert rows[str((d / "good.jsonl").resolve())] == "done: "
    bad = rows[str((d / "bad.jsonl").resolve())]
    assert bad.startswith("failed: ") and "bad.jsonl:2 (id " in bad and "output_token_ids" in bad
    assert "\n" not in bad
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events if e["event"] in ("verified", "failed")] == ["failed", "verified"]
    again = CliRunner().invoke(_app(), ["monitor", str(d), "--db", url, "--once"])  # not retried: same bytes
    assert again.exit_code == 0 and query(url, "SELECT COUNT(*) FROM shards") == [(2,)]
    # the failed shard is visible to Prometheus too (the dashboard's /metrics reads the same table)
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from verinfer.production.dashboard import create_app

    client = TestClient(create_app(open_store(url)))
    body = client.get("/metrics").text
    shards = {s.labels["status"]: s.value for f in text_string_to_metric_families(body) for s in f.samples
              if s.name == "verinfer_monitor_shards"}
    assert shards == {"pending": 0, "claimed": 0, "done": 1, "failed": 1}
    page = client.get("/").text  # ... and on the page, with its error
    failed = page.split('id="failed-shards"')[1]
    assert "(1)" in failed.split("</h2>")[0] and failed.count('class="failed-row"') == 1 and "bad.jsonl:2" in failed


def test_the_monitor_serves_its_own_metrics_while_it_samples(honest, tmp_path):
    """`verinfer monitor --sample 0.5 --metrics-port P` as a process: /metrics counts the shards per status,
    the backlog and its lag, the traces recorded beside those verified and the fraction; /health is ok;
    beyond loopback it needs a token."""
    from prometheus_client.parser import text_string_to_metric_families

    d, url, port = tmp_path / "traces", f"sqlite:///{tmp_path}/h.db", free_port()
    _write_shards(timed(honest, "acme", T0, 7), d, 2)
    env_key = {"VERINFER_TEST_SAMPLE_KEY": "a-sampling-key-for-this-test"}
    os.environ.update(env_key)
    try:
        proc = _monitor_process(d, url, "--poll", "0.5", "--sample", "0.5", "--sample-key-env", "VERINFER_TEST_SAMPLE_KEY",
                                "--metrics-port", str(port), log=tmp_path / "monitor.log")
    finally:
        os.environ.pop("VERINFER_TEST_SAMPLE_KEY")
    try:
        deadline = time.monotonic() + 300  # a hang guard
        samples: dict = {}
        while time.monotonic() < deadline and samples.get(("verinfer_monitor_shards", "done")) != 2:
            assert proc.poll() is None, (tmp_path / "monitor.log").read_text()[-2000:]
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                samples = {(s.name, s.labels.get("status")): s.value for f in text_string_to_metric_families(body)
                           for s in f.samples}
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        proc.wait(60)
    chosen = sum(Budget(0.5, env_key["VERINFER_TEST_SAMPLE_KEY"].encode()).chosen(t.id) for t in honest)
    assert samples[("verinfer_monitor_shards", "done")] == 2 and samples[("verinfer_monitor_backlog_shards", None)] == 0
    assert samples[("verinfer_monitor_lag_seconds", None)] == 0 and samples[("verinfer_monitor_sample_fraction", None)] == 0.5
    assert samples[("verinfer_monitor_traces_recorded_total", None)] == len(honest)
    assert samples[("verinfer_monitor_traces_verified_total", None)] == chosen
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["sample"] == 0.5
    refused = CliRunner().invoke(_app(), ["monitor", str(d), "--db", url, "--once", "--metrics-port", "0",
                                          "--metrics-host", "0.0.0.0"])
    assert refused.exit_code == 2 and "--metrics-host 0.0.0.0 is reachable beyond" in refused.output


def _app():
    from verinfer.cli.main import app

    return app


def test_bad_database_and_directory_are_one_line_exit_2(tmp_path):
    (tmp_path / "t").mkdir()
    port = free_port()
    for args, fragment in (
            (["monitor", str(tmp_path / "t"), "--db", f"postgresql://u:hunter2@127.0.0.1:{port}/x"],
             "cannot open the database"),
            (["monitor", str(tmp_path / "t"), "--db", "mysql://h/x"], "unsupported database"),
            (["monitor", str(tmp_path / "nope"), "--db", f"sqlite:///{tmp_path}/h.db"], "no such directory"),
            (["monitor", str(tmp_path / "t"), "--db", f"sqlite:///{tmp_path}/h.db", "--window", "soon"], "--window")):
        result = CliRunner().invoke(_app(), args)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and fragment in lines[0] and "hunter2" not in result.stderr, result.stderr


def test_scheduled_audit_lands_in_the_same_database_once_per_slot(backend, tmp_path, one_torch_thread):
    from verinfer.production.monitor import AuditSchedule
    from verinfer.serve import ServeConfig, serve_in_thread

    url = f"sqlite:///{tmp_path}/h.db"
    store = open_store(url)
    with serve_in_thread(backend, ServeConfig()) as base:
        providers = tmp_path / "providers.json"
        providers.write_text(json.dumps([{"name": "acme", "url": base}]))
        schedule = AuditSchedule(providers, 3600, tmp_path / "audits",
                                 {"mode": "greedy", "n": 3, "max_tokens": 12, "backend": backend})
        now = dt.datetime(2026, 3, 1, 12, 30)
        run = schedule.maybe_run(store, "me", now)
        assert run is not None
        assert schedule.maybe_run(store, "another monitor", now + dt.timedelta(minutes=5)) is None  # same slot
    [(status, slot)] = query(url, "SELECT status, slot FROM audit_runs")
    assert status == "done" and str(slot).startswith("2026-03-01 12:00:00")
    [(provider, verdict, tokens, judged_by)] = query(url, "SELECT provider, verdict, tokens, judged_by FROM audits")
    assert provider == "acme" and verdict == "CONSISTENT" and tokens > 0 and judged_by.startswith("bands-")
    store.close()


# --------------------------------------------------------------------------------------------------
# exactly once with real processes


def _monitor_process(directory: Path, url: str, *extra: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "verinfer.cli", "monitor", str(directory), "--db", url,
                             "--threads", "1", "--window", "60", *extra],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)


def _write_shards(traces: list[Trace], d: Path, n: int) -> int:
    for i, part in enumerate(np.array_split(np.arange(len(traces)), n)):
        write_traces([traces[j] for j in part], d / f"shard{i:02d}.parquet")
    return sum(len(t.output_token_ids) for t in traces)


def _exactly_once(url: str, shards: int, traces: int, tokens: int) -> None:
    assert query(url, "SELECT status, COUNT(*), SUM(tokens) FROM shards GROUP BY status") == [("done", shards, tokens)]
    assert query(url, "SELECT COUNT(*), COUNT(DISTINCT trace_id) FROM window_traces") == [(traces, traces)]
    assert query(url, "SELECT SUM(tokens), SUM(traces) FROM windows") == [(tokens, traces)]
    assert query(url, "SELECT COUNT(*) FROM shard_results") == [(shards,)]
    # each stream's counters (kept by advance_stream, in the windows' transaction) agree with a recount
    assert query(url, "SELECT windows, tokens FROM streams ORDER BY provider, seconds") == \
        query(url, "SELECT COUNT(*), SUM(tokens) FROM windows GROUP BY provider, seconds ORDER BY provider, seconds")


def test_kill_9_mid_shard_then_a_restart_loses_and_doubles_nothing(db_url, honest, tmp_path):
    """A monitor killed (SIGKILL) while it holds its second shard, after recording the first: the
    restarted monitor leaves the first alone, takes the second over once its lease expires, and
    verifies the third; every shard, trace and token is counted once."""
    d = tmp_path / "traces"
    tokens = _write_shards(timed(honest, "acme", T0, 7), d, 3)
    killed = _monitor_process(d, db_url, "--lease", "3", "--poll", "0.5", log=tmp_path / "killed.log")
    engine = create_engine(database_url(db_url))
    deadline = time.monotonic() + 300  # a hang guard, not a timing claim
    state: list[tuple] = []
    with engine.connect() as conn:
        while time.monotonic() < deadline and killed.poll() is None:
            try:
                state = [tuple(r) for r in conn.execute(text("SELECT id, status FROM shards ORDER BY id"))]
                conn.rollback()
            except Exception:  # noqa: BLE001 - the schema may not exist yet
                conn.rollback()
            if [s for _, s in state[:2]] == ["done", "claimed"]:
                break
            time.sleep(0.02)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    engine.dispose()
    assert [s for _, s in state[:2]] == ["done", "claimed"], (state, (tmp_path / "killed.log").read_text())
    first, second = state[0][0], state[1][0]
    # killed mid-shard: the second shard is still claimed by the dead monitor, with nothing recorded for it
    assert query(db_url, f"SELECT status FROM shards WHERE id = {second}") == [("claimed",)]
    assert query(db_url, f"SELECT COUNT(*) FROM window_traces WHERE shard_id = {second}") == [(0,)]
    before = query(db_url, f"SELECT finished_at, owner FROM shards WHERE id = {first}")
    time.sleep(3.5)  # the killed monitor's lease expires
    p = _monitor_process(d, db_url, "--once", log=tmp_path / "restart.log")
    assert p.wait(timeout=600) == 0, (tmp_path / "restart.log").read_text()
    _exactly_once(db_url, 3, len(honest), tokens)
    assert query(db_url, f"SELECT finished_at, owner FROM shards WHERE id = {first}") == before  # left alone
    assert query(db_url, f"SELECT attempts FROM shards WHERE id = {second}") == [(2,)]  # taken over once
    events = [json.loads(line) for line in (tmp_path / "restart.log").read_text().splitlines() if line.startswith("{")]
    assert [e for e in events if e["event"] == "done"][0]["verified"] == 2


def test_two_monitors_on_one_directory_count_each_shard_once(db_url, honest, tmp_path):
    d = tmp_path / "traces"
    tokens = _write_shards(timed(honest, "acme", T0, 11), d, 6)
    procs = [_monitor_process(d, db_url, "--once", log=tmp_path / f"m{i}.log") for i in range(2)]
    for i, p in enumerate(procs):
        assert p.wait(timeout=600) == 0, (tmp_path / f"m{i}.log").read_text()
    _exactly_once(db_url, 6, len(honest), tokens)
    owners = {o.rsplit(":", 1)[0] for (o,) in query(db_url, "SELECT owner FROM shards")}
    assert owners <= {f"{os.uname().nodename}:{p.pid}" for p in procs}


def test_ray_records_what_the_in_process_monitor_records(backend, honest, tmp_path):
    """``--ray`` verifies the claimed shards on a local Ray cluster (``sharded.run_ray``, one worker) and
    records the same windows, token for token, as the in-process monitor, sampling included: the
    ``--sample`` key travels to the Ray actors, which verify the same chosen traces."""
    d = tmp_path / "traces"
    traces = timed(honest[:8], "acme", T0, 15)
    _write_shards(traces, d, 2)
    budget = Budget(0.5, b"a-fixed-key-for-the-ray-test----")
    chosen = [t for t in traces if budget.chosen(t.id)]
    assert 0 < len(chosen) < len(traces)
    rows = []
    for name, kwargs in (("local", {}), ("ray", {"use_ray": True, "workers": 1})):
        url = f"sqlite:///{tmp_path}/{name}.db"
        store = open_store(url)
        outcome = Monitor(d, store, out_dir=tmp_path / f"{name}.out", window_s=60, backend=backend, budget=budget,
                          **kwargs).run_once()
        assert len(outcome.verified) == 2 and not outcome.failed, outcome
        rows.append(window_rows(url))
        assert query(url, "SELECT SUM(offered), SUM(traces) FROM shards") == [(len(traces), len(chosen))]
        store.close()
    assert rows[1] == rows[0] and sum(r[3] for r in rows[0]) == sum(len(t.output_token_ids) for t in chosen)


def test_a_shard_whose_claims_keep_expiring_is_abandoned_not_retried_forever(backend, honest, tmp_path):
    d = tmp_path / "traces"
    write_traces(timed(honest[:2], "acme", T0, 1), d / "a.jsonl")
    url = f"sqlite:///{tmp_path}/h.db"
    store = open_store(url)
    mon = Monitor(d, store, backend=backend, max_attempts=3)
    mon.scan()
    for attempt in (1, 2, 3):  # three monitors die holding it: each claim expires
        [shard] = mon.claim()
        assert shard.attempts == attempt
        with store.transaction() as s:
            s.execute(text("UPDATE shards SET lease_until = '2000-01-01 00:00:00'"))
    assert mon.claim() == []
    [(status, error)] = query(url, "SELECT status, error FROM shards")
    assert status == "failed" and error.startswith("abandoned: 3 claims expired")
    store.close()


def test_sigterm_finishes_the_shard_at_hand_then_exits(honest, tmp_path):
    d = tmp_path / "traces"
    _write_shards(timed(honest, "acme", T0, 7), d, 4)
    url = f"sqlite:///{tmp_path}/h.db"
    p = _monitor_process(d, url, "--poll", "0.5", log=tmp_path / "m.log")
    deadline = time.monotonic() + 300  # a hang guard, not a timing claim
    while time.monotonic() < deadline and p.poll() is None:
        with contextlib.suppress(Exception):  # the schema may not exist yet
            if query(url, "SELECT COUNT(*) FROM shards WHERE status = 'done'")[0][0] >= 1:
                break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=300) == 0, (tmp_path / "m.log").read_text()
    states = dict(query(url, "SELECT status, COUNT(*) FROM shards GROUP BY status"))
    assert "claimed" not in states and states.get("done", 0) >= 1, states  # nothing left half-done
    done_tokens = query(url, "SELECT COALESCE(SUM(tokens), 0) FROM shards WHERE status = 'done'")[0][0]
    assert query(url, "SELECT COALESCE(SUM(tokens), 0) FROM windows") == [(done_tokens,)]
    events = [json.loads(line)["event"] for line in (tmp_path / "m.log").read_text().splitlines()
              if line.startswith("{")]
    assert events[-1] == "stopped"
