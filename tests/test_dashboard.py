"""``verinfer dashboard`` without a model: pages, filters, escaping and redaction, the token rule,
Prometheus metrics (dashboard and gateway), and alerts delivered to a local receiver with retries,
once per change across restarts. Windows are written through the store's models; the browser test
with a real monitor is tests/test_dashboard_browser.py."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from contextlib import contextmanager

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from tests.audit_servers import asgi_in_thread, free_port
from tests.postgres_server import db_url, fresh_database, postgres_server  # noqa: F401 - fixtures
from verinfer.production import views
from verinfer.production.alerts import Alerter
from verinfer.production.access import authorized, is_loopback
from verinfer.production.dashboard import create_app
from verinfer.production.metrics import exposition, gateway_metrics
from verinfer.production.store import AuditResult, AuditRun, Window, advance_stream, open_store

T0 = dt.datetime(2026, 3, 1, 12, 0, 0)
EVIL = 'evil<script>alert("x")</script>'
SECRET = "sk-SECRETSECRET123"
# acme's verdicts per 10-minute window: two changes (C -> I at 2, I -> C at 5); None carries the state on
ACME = ["CONSISTENT", "CONSISTENT", "INCONSISTENT", "INCONSISTENT", None, "CONSISTENT"]


def add_window(s, provider: str, i: int, verdict: str | None, model: str = "smollm2-135m", tokens: int = 100,
               note: str | None = None) -> None:
    start = T0 + dt.timedelta(minutes=10 * i)
    w = Window(provider=provider, model=model, profile="vllm-cpu", seconds=600, start_time=start,
               end_time=start + dt.timedelta(minutes=10), traces=4, tokens=tokens,
               exact_match_rate=0.99 if verdict != "INCONSISTENT" else 0.4,
               mean_margin=0.01 if verdict != "INCONSISTENT" else 3.0, verdict=verdict,
               p_value=None if verdict is None else (0.5 if verdict == "CONSISTENT" else 1e-4),
               judged_by=None if verdict is None else "bands bands-smollm2-135m-greedy.json",
               note=note or (verdict or "too few tokens: 3 < the smallest calibrated batch (10)"), shards=1, computed=1,
               updated_at=start + dt.timedelta(minutes=11))
    s.add(w)
    s.flush()
    advance_stream(s, w, 1, tokens)  # as the monitor records it: the stream's newest window and its totals


@pytest.fixture()
def db(db_url):
    """The history in SQLite and in a real PostgreSQL (tests/postgres_server.py)."""
    store = open_store(db_url)
    with store.transaction() as s:
        for i, v in enumerate(ACME):
            add_window(s, "acme", i, v)
        for i in range(3):
            add_window(s, EVIL, i, "CONSISTENT", model="m<b>odel")
        run = AuditRun(slot=T0, owner="test", status="done", out_dir="/tmp/x")
        s.add(run)
        s.flush()
        s.add(AuditResult(run_id=run.id, url=f"https://user:{SECRET}@provider.example/v1?api_key={SECRET}",
                          mode="greedy", at=T0 + dt.timedelta(minutes=25), provider="acme", model="smollm2-135m",
                          profile="greedy", traces=16, tokens=512, exact_match_rate=0.98, mean_margin=0.02,
                          verdict="CONSISTENT", p_value=0.4, judged_by="bands-smollm2-135m-greedy.json"))
        s.add(AuditResult(run_id=run.id, url="https://other.example/v1", mode="greedy", at=T0, provider="audited-only",
                          model="smollm2-135m", profile="greedy", traces=16, tokens=500, verdict="INCONSISTENT",
                          p_value=0.001))
    yield store
    store.close()


def test_overview_shows_every_window_state_and_changes(db):
    client = TestClient(create_app(db, stale_after_s=float("inf")))  # a history from March: not idle here
    page = client.get("/").text
    assert page.count('class="state-row"') == 2
    acme = page.split('<h2 class="series"')[1]
    ids = set(re.findall(r'<circle class="pt[^"]*" data-window="(\d+)"', acme))
    cells = re.findall(r'<rect class="cell cell-(\w+)" data-window="(\d+)"', acme)
    assert len(ids) == len(ACME) and len(cells) == len(ACME)  # a point and a verdict cell for every window
    assert [c for c, _ in cells] == [v or "none" for v in ACME]
    assert re.findall(r'class="change-label"[^>]*>→ (\w+)<', acme) == ["INCONSISTENT", "CONSISTENT"]
    assert acme.count('<rect class="band"') == 5  # bands behind the exact-match rate of the judged windows
    assert acme.count('<path class="audit a-CONSISTENT"') == 1
    state = re.search(r'data-provider="acme" data-state="(\w+)">(.*?)</tr>', page, re.S)
    assert state.group(1) == "CONSISTENT"
    assert "2026-03-01 12:50:00Z" in state.group(2)  # since: the window after the last INCONSISTENT one
    assert '<meta http-equiv="refresh" content="30">' in page
    assert "<script" not in page and "&lt;script&gt;" in page and "m&lt;b&gt;odel" in page
    assert SECRET not in page and "provider.example" in page  # the audit's URL shown, its secrets redacted
    alone = page.split('id="audits-alone"')[1]  # an audited provider without traffic still shows
    assert alone.count('class="audit-row"') == 1 and "audited-only" in alone and "INCONSISTENT" in alone


def test_the_state_table_follows_the_time_range(db):
    """With ``until``, each series' state is the one it had then (it showed today's whatever the range)."""
    client = TestClient(create_app(db, stale_after_s=float("inf")))
    inconsistent_at = next(i for i, v in enumerate(ACME) if v == "INCONSISTENT")
    until = (T0 + dt.timedelta(minutes=10 * inconsistent_at)).strftime("%Y-%m-%dT%H:%M:%SZ")
    page = client.get(f"/?until={until}").text
    state = re.search(r'data-provider="acme" data-state="(\w+)">(.*?)</tr>', page, re.S)
    assert state.group(1) == "INCONSISTENT", state.group(0)
    api = client.get(f"/api/series?provider=acme&until={until}").json()["series"][0]
    assert api["verdict"] == "INCONSISTENT" and api["since"] == until
    before_any = client.get("/?until=2026-02-01T00:00:00Z").text  # nothing recorded yet then
    assert 'data-provider="acme"' not in before_any


def test_a_series_with_nothing_recorded_lately_is_idle_not_green(db):
    """A series whose newest window was recorded over --stale-after ago shows IDLE with how long and what
    its last window said (it kept its green pill for ever)."""
    page = TestClient(create_app(db)).get("/").text  # the fixture's windows were recorded in March
    state = re.search(r'data-provider="acme" data-state="(\w+)">(.*?)</tr>', page, re.S)
    assert state.group(1) == "idle" and 'class="state st-idle">IDLE<' in state.group(2)
    assert "nothing verified for" in state.group(2) and "the last window said CONSISTENT" in state.group(2)
    assert 'st-CONSISTENT">CONSISTENT<' not in page.split('id="states"')[1].split("</table>")[0]


def test_the_json_api_gives_scripts_what_the_pages_show(db):
    client = TestClient(create_app(db, stale_after_s=float("inf")))
    series = client.get("/api/series").json()["series"]
    acme = next(x for x in series if x["provider"] == "acme")
    assert acme["state"] == acme["verdict"] == "CONSISTENT" and acme["windows"] == len(ACME)
    assert acme["since"] == "2026-03-01T12:50:00Z" and acme["idle_seconds"] is None
    assert [x["provider"] for x in client.get("/api/series?provider=acme").json()["series"]] == ["acme"]
    windows = client.get("/api/windows?provider=acme&limit=3").json()["windows"]
    assert len(windows) == 3 and [w["start"] for w in windows] == sorted((w["start"] for w in windows), reverse=True)
    assert windows[0]["id"] == acme["latest_window"] and {"verdict", "p_value", "offered", "judged_by"} <= set(windows[0])
    ranged = client.get("/api/windows?provider=acme&since=2026-03-01T12:10:00Z&until=2026-03-01T12:20:00Z").json()
    assert [w["start"] for w in ranged["windows"]] == ["2026-03-01T12:20:00Z", "2026-03-01T12:10:00Z"]
    for bad in ("limit=0", "limit=many", "since=yesterday-ish"):
        r = client.get(f"/api/windows?{bad}")
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", bad
    assert TestClient(create_app(db, "t0ken-for-the-dashboard-1234")).get("/api/series").status_code == 401


def test_bad_links_are_pages_not_json(db):
    client = TestClient(create_app(db))
    bad = client.get("/window/abc")
    assert bad.status_code == 404 and "text/html" in bad.headers["content-type"] and "no such window" in bad.text
    backwards = client.get("/?since=2026-03-02T00:00:00Z&until=2026-03-01T00:00:00Z")
    assert backwards.status_code == 400 and "is later than until" in backwards.text


def test_state_is_the_latest_window_with_since_when(db):
    with db.transaction() as s:
        add_window(s, "acme", len(ACME), None)  # the latest window lacks tokens
    with db.sessions() as s:
        [(key, windows, tokens, last)] = [k for k in views.keys(s, views.Filters()) if k[0].provider == "acme"]
        st = views.state(s, key, windows, tokens, last)
    assert windows == len(ACME) + 1 and tokens == 100 * windows
    assert st.verdict is None and st.label == "not enough tokens" and st.last_verdict == "CONSISTENT"
    assert st.since == T0 + dt.timedelta(minutes=10 * len(ACME))


def test_filters_select_series_and_time_and_reject_bad_input(db):
    client = TestClient(create_app(db))
    page = client.get("/", params={"provider": EVIL}).text
    assert page.count('class="state-row"') == 1 and 'data-provider="acme"' not in page
    ranged = client.get("/", params={"provider": "acme", "since": "2026-03-01T12:20:00Z",
                                     "until": "2026-03-01T12:40:00Z", "refresh": "0"}).text
    assert len(re.findall(r'<rect class="cell', ranged)) == 3 and 'http-equiv="refresh"' not in ranged
    latest = client.get("/", params={"provider": "acme", "points": "2"}).text
    assert len(re.findall(r'<rect class="cell', latest)) == 2 and "2 of 6 windows" in latest
    assert "until=2026-03-01T12%3A40%3A00Z" in latest  # the "earlier" link pages back from the first shown
    for params, name in (({"since": "yesterday"}, "since="), ({"points": "lots"}, "points="),
                         ({"points": "0"}, "points=")):
        bad = client.get("/", params=params)
        assert bad.status_code == 400 and name in bad.text
    assert client.get("/window/999").status_code == 404
    assert "acme" not in client.get("/", params={"provider": "nobody"}).text.split("<h2>Current state</h2>")[1]


def test_metrics_follow_prometheus_conventions(db):
    body = TestClient(create_app(db)).get("/metrics")
    assert body.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body.text)}
    acme = {"provider": "acme", "model": "smollm2-135m", "profile": "vllm-cpu", "window_seconds": "600"}

    def value(name: str, **labels) -> float:
        want = {**acme, **labels}
        return next(s.value for s in fams[name].samples if s.labels == want and not s.name.endswith("_created"))

    assert fams["verinfer_tokens_verified"].type == "counter"
    assert value("verinfer_tokens_verified") == 100 * len(ACME) and value("verinfer_windows") == len(ACME)
    assert value("verinfer_verdict", verdict="CONSISTENT") == 1 and value("verinfer_verdict", verdict="INCONSISTENT") == 0
    states: dict[tuple, dict[str, float]] = {}  # each series: one state at 1 among three upper-case ones
    for sample in fams["verinfer_verdict"].samples:
        series = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "verdict"))
        states.setdefault(series, {})[sample.labels["verdict"]] = sample.value
    assert all(set(st) == {"CONSISTENT", "INCONSISTENT", "UNJUDGED"} and sum(st.values()) == 1 for st in states.values())
    assert value("verinfer_exact_match_rate") == pytest.approx(0.99) and value("verinfer_p_value") == 0.5
    assert value("verinfer_verdict_since_timestamp_seconds") == (T0 + dt.timedelta(minutes=50)).replace(
        tzinfo=dt.timezone.utc).timestamp()
    assert "verinfer_tokens_verified_total{" in body.text and EVIL.replace('"', '\\"') in body.text
    audit = {s.labels["provider"]: s.value for s in fams["verinfer_audit_verdict"].samples
             if s.labels["verdict"] == "INCONSISTENT"}
    assert audit == {"acme": 0.0, "audited-only": 1.0}
    assert [s.value for s in fams["verinfer_audit_p_value"].samples if s.labels["provider"] == "acme"] == [0.4]


def test_gateway_metrics_from_its_counters():
    from verinfer.production.recorder import Counters

    counters = Counters()
    counters.add(requests=5, dropped=2, recorded=3)
    counters.queue_depth = 7
    body, _ = exposition(lambda: gateway_metrics({"1": counters.snapshot(), "2": Counters().snapshot()}))
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
               if s.labels["worker"] == "1"}
    assert samples["verinfer_gateway_requests_total"] == 5 and samples["verinfer_gateway_records_dropped_total"] == 2
    assert samples["verinfer_gateway_records_written_total"] == 3 and samples["verinfer_gateway_queue_depth"] == 7


def test_health_is_503_with_the_reason_when_the_history_cannot_be_read(postgres_server):  # noqa: F811
    """The database dropped from under a running dashboard (its connections ended): /health answers 503
    and says why, as / fails (it said 200 "ok" while / and /metrics failed). SQLite keeps its open file."""
    import psycopg

    url = fresh_database(postgres_server)
    store = open_store(url)
    client = TestClient(create_app(store), raise_server_exceptions=False)
    ok = client.get("/health")
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
    gone = client.get("/health")
    assert ok.status_code == 200 and ok.json() == {"status": "ok", "database": "postgresql", "reasons": []}
    assert gone.status_code == 503 and gone.json()["status"] == "database_unreachable", gone.text
    assert "the database (postgresql) cannot be read" in gone.json()["reasons"][0]
    assert client.get("/").status_code == 500  # what health now owns up to
    store.engine.dispose()


def test_token_required_beyond_loopback(db, monkeypatch):
    token = "t0ken-for-the-dashboard-1234"
    client = TestClient(create_app(db, token))
    assert client.get("/").status_code == 401 and client.get("/metrics").status_code == 401
    assert client.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert client.get("/metrics", auth=("anyone", token)).status_code == 200
    assert client.get("/health").status_code == 200
    assert authorized(f"Bearer {token}", token) and not authorized("Basic !!!", token) and not authorized(None, token)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    from verinfer.cli.main import app

    url = db.url
    refused = CliRunner().invoke(app, ["dashboard", "--db", url, "--host", "0.0.0.0", "--port", "0"])
    assert refused.exit_code == 2 and "--auth-token-env" in refused.output
    monkeypatch.setenv("SHORT_TOKEN", "abc")
    short = CliRunner().invoke(app, ["dashboard", "--db", url, "--host", "0.0.0.0", "--auth-token-env", "SHORT_TOKEN"])
    assert short.exit_code == 2 and "too short" in short.output and "abc" not in short.output
    bad_db = CliRunner().invoke(app, ["dashboard", "--db", "mysql://x/y"])
    assert bad_db.exit_code == 2 and "unsupported database" in bad_db.output


@contextmanager
def receiver(fail_first: int = 0, port: int = 0, raw: list | None = None):
    """A local webhook receiver answering 503 to its first ``fail_first`` posts (``raw``: gets each
    accepted post's body bytes and headers)."""
    app, got, tries = FastAPI(), [], []

    @app.post("/hook")
    async def hook(request: Request):
        tries.append(1)
        if len(tries) <= fail_first:
            return Response(status_code=503)
        got.append(await request.json())
        if raw is not None:
            raw.append((await request.body(), dict(request.headers)))
        return {"ok": True}

    with asgi_in_thread(app, "/hook", port) as url:
        yield url, got, tries


def test_alerts_once_per_change_retried_and_remembered(db, tmp_path):
    engine, state = views.read_engine(db), tmp_path / "alerts.json"
    with receiver(fail_first=2) as (url, got, tries):
        alerter = Alerter(engine, url, state, lambda i: f"http://dash.example/window/{i}", backoff_s=0.05)
        assert alerter.poll() == []  # a first start takes the current verdicts, it does not alert on history
        with db.transaction() as s:
            add_window(s, "acme", len(ACME), "INCONSISTENT")
            add_window(s, "newcomer", 0, "INCONSISTENT")
        found = alerter.poll()
        assert {(a["provider"], a["previous"], a["verdict"]) for a in found} == {
            ("acme", "CONSISTENT", "INCONSISTENT"), ("newcomer", None, "INCONSISTENT")}
        assert alerter.poll() == []  # nothing new: nothing sent again
        assert alerter.wait_idle(60)
        alerter.close()
        assert len(got) == 2 and len(tries) == 4  # two 503s retried with backoff, then both delivered
        body = next(a for a in got if a["provider"] == "acme")
        assert body["p_value"] == 1e-4 and body["window"]["start"] == "2026-03-01T13:00:00Z"
        assert body["link"] == f"http://dash.example/window/{body['window']['id']}" and body["model"] == "smollm2-135m"
        assert json.loads(state.read_text())["pending"] == []

        again = Alerter(engine, url, state, lambda i: f"http://dash.example/window/{i}")  # a restart
        assert again.poll() == []
        with db.transaction() as s:
            add_window(s, "acme", len(ACME) + 1, "CONSISTENT")
        assert [(a["previous"], a["verdict"]) for a in again.poll()] == [("INCONSISTENT", "CONSISTENT")]
        assert again.wait_idle(60)
        again.close()
        assert len(got) == 3


def test_alerts_never_block_the_poll_and_reach_a_receiver_that_comes_back_in_order(db, tmp_path):
    """A receiver down: the poll returns at once, the alerts wait (kept in the state file, counted in
    /metrics), retried for as long as it takes (it used to give up after 8 attempts until a restart);
    once the receiver is up they arrive, the older change of a series before the newer one."""
    port = free_port()  # nobody answers on it yet
    state = tmp_path / "alerts.json"
    alerter = Alerter(views.read_engine(db), f"http://127.0.0.1:{port}/hook", state, str, backoff_s=0.01,
                      max_backoff_s=0.05)
    alerter.poll()
    with db.transaction() as s:
        add_window(s, "acme", len(ACME), "INCONSISTENT")
    assert len(alerter.poll()) == 1  # returns at once; delivery is the sender thread's
    with db.transaction() as s:
        add_window(s, "acme", len(ACME) + 1, "CONSISTENT")
    assert len(alerter.poll()) == 1
    deadline = time.monotonic() + 30
    while alerter.failed_attempts < 5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not alerter.wait_idle(0.2) and len(json.loads(state.read_text())["pending"]) == 2
    scrape = TestClient(create_app(db, alerter=alerter)).get("/metrics").text
    samples = {m.name: m.samples[0].value for m in text_string_to_metric_families(scrape) if m.name.startswith("verinfer_alert")}
    assert samples["verinfer_alerts_pending"] == 2 and samples["verinfer_alerts_backlog_seconds"] > 0
    assert samples["verinfer_alert_attempts_failed"] >= 5 and samples["verinfer_alerts_delivered"] == 0
    with receiver(port=port) as (_, got, _tries):
        assert alerter.wait_idle(60)
        alerter.close()
    assert [(a["provider"], a["verdict"]) for a in got] == [("acme", "INCONSISTENT"), ("acme", "CONSISTENT")]
    assert json.loads(state.read_text())["pending"] == [] and alerter.delivered == 2


def test_alerts_can_be_signed_and_take_alertmanagers_shape(db, tmp_path):
    """--alert-secret-env: the HMAC-SHA256 of the exact body in X-Verinfer-Signature-256; --alert-format
    alertmanager: firing when a series turns INCONSISTENT, resolved when it is CONSISTENT again."""
    import hashlib
    import hmac

    secret, raw = "a-webhook-secret-of-some-length", []
    with receiver(raw=raw) as (url, got, _):
        alerter = Alerter(views.read_engine(db), url, tmp_path / "a.json", lambda i: f"http://dash.example/window/{i}",
                          shape="alertmanager", secret=secret, backoff_s=0.01)
        alerter.poll()
        for i, verdict in enumerate(("INCONSISTENT", "CONSISTENT")):
            with db.transaction() as s:
                add_window(s, "acme", len(ACME) + i, verdict)
            alerter.poll()
        assert alerter.wait_idle(60)
        alerter.close()
    assert [b["status"] for b in got] == ["firing", "resolved"]
    firing = got[0]["alerts"][0]
    assert firing["labels"] == {"alertname": "VerinferInconsistent", "provider": "acme", "model": "smollm2-135m",
                                "profile": "vllm-cpu", "window_seconds": "600"}
    assert firing["generatorURL"].startswith("http://dash.example/window/") and got[0]["externalURL"] == "http://dash.example"
    for body, headers in raw:
        expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        assert headers["x-verinfer-signature-256"] == expected
    with pytest.raises(ValueError, match="--alert-format must be one of verinfer, alertmanager"):
        Alerter(views.read_engine(db), "http://127.0.0.1:9/hook", tmp_path / "b.json", str, shape="slack")


def test_drill_down_names_what_it_cannot_show(db):
    """A window whose shard file is gone still lists its traces, each saying why its tokens are missing."""
    from verinfer.production.store import Shard, WindowTrace

    with db.transaction() as s:
        w = s.query(Window).filter_by(provider="acme").order_by(Window.start_time).first()
        shard = Shard(path="/nonexistent/traces-1.parquet", sha256="0" * 64, bytes=1, status="done",
                      scores_path="/nonexistent/traces-1.scores.parquet")
        s.add(shard)
        s.flush()
        s.add_all([WindowTrace(window_id=w.id, shard_id=shard.id, trace_id=f"t<{i}>", request_time=w.start_time,
                               tokens=10, exact_matches=10, mean_margin=0.0) for i in range(3)])
        window_id = w.id
    page = TestClient(create_app(db)).get(f"/window/{window_id}")
    assert page.status_code == 200 and page.text.count('class="trace-row"') == 3
    assert page.text.count("tokens not shown: ") == 3 and "traces-1.parquet" in page.text and "t&lt;0&gt;" in page.text
    assert 'id="next"' in page.text and 'id="previous"' not in page.text  # the series' first window
    assert re.search(r'id="verified-traces">4<', page.text)  # every trace verified: just the count
    with db.transaction() as s:
        s.get(Window, window_id).offered = 40  # a monitor with --sample 0.1 verified 4 of 40
    page = TestClient(create_app(db)).get(f"/window/{window_id}")
    assert re.search(r'id="verified-traces">4 of 40 \(10% verified', page.text), page.text


def test_the_shared_token_partial_escapes_provider_text():
    from verinfer.production.dashboard import environment

    html = environment().from_string('{% import "tokens.html.j2" as t %}{{ t.render(pieces, 20.0) }}').render(
        pieces=[("<script>alert(1)</script>", 0.0), ("<img src=x onerror=alert(1)>", 3.0), ("\n", None)])
    assert "<script" not in html and "<img" not in html and "&lt;script&gt;" in html
    assert html.count('<mark class="div lo" title="margin 3">') == 1 and "⏎<br>" in html


def test_axis_ticks_are_round_numbers_and_times_with_the_date_once_a_day():
    from verinfer.production.timeline import nice_range, time_ticks

    lo, hi, ticks = nice_range(0.9612, 1.0)
    assert (lo, hi) == (0.96, 1.0) and [t for _, t in ticks] == ["0.96", "0.97", "0.98", "0.99", "1.00"]
    assert [t for _, t in nice_range(0.0, 3.4)[2]] == ["0", "1", "2", "3", "4"]
    for a, b in ((0.0, 0.04), (0.2, 0.9), (0.0, 17.3), (0.5, 0.5)):  # always a nice step, covering the data
        lo, hi, ticks = nice_range(a, b)
        steps = {round(ticks[i + 1][0] - ticks[i][0], 9) for i in range(len(ticks) - 1)}
        assert lo <= a and hi >= b and len(steps) == 1 and f"{steps.pop():.0e}"[0] in "125" and len(ticks) <= 6
    night = time_ticks(dt.datetime(2026, 3, 1, 20, 7), dt.datetime(2026, 3, 2, 9, 0))
    assert [label for _, label in night] == ["2026-03-01 21:00Z", "2026-03-02 00:00", "03:00", "06:00", "09:00"]
    hour = time_ticks(T0, T0 + dt.timedelta(minutes=60))  # the window edges of 10-minute windows
    assert [t.minute for t, _ in hour] == [0, 10, 20, 30, 40, 50, 0] and hour[1][1] == "12:10"


def test_verdict_changes_and_bands():
    pts = [views.Point(i, T0, T0, 1, 10, 1.0, 0.0, v, None, None, None) for i, v in
           enumerate([None, "CONSISTENT", None, "INCONSISTENT", "INCONSISTENT", "CONSISTENT"])]
    views.mark_changes(pts)
    assert [p.changed for p in pts] == [False, False, False, True, False, True]
    views.mark_changes(pts, before="INCONSISTENT")
    assert pts[1].changed
    band = views.band_at("bands bands-smollm2-135m-greedy.json", 400)
    assert band.margin is None and 0.5 < band.exact[0] < band.exact[1] <= 1.0 and "400 tokens" in band.text
    wider = views.band_at("bands bands-smollm2-135m-greedy.json", 50)
    assert wider.exact[1] - wider.exact[0] > band.exact[1] - band.exact[0]  # fewer tokens, a wider honest range
    gone = views.band_at("calibration /nonexistent/cal.json", 100)
    assert gone.exact is None and "not readable" in gone.text


def test_the_gateway_serves_its_counters_at_gateway_metrics(tmp_path):
    from verinfer.production.exchange import Recording
    from verinfer.production.gateway import Gateway, GatewayConfig, create_app as gateway_app

    g = Gateway(GatewayConfig("http://127.0.0.1:9", tmp_path, Recording("fake")), log=lambda *a, **k: None)
    g.counters.add(requests=4, dropped=1, unrecordable=2)
    body = TestClient(gateway_app(g)).get("/gateway/metrics")  # no lifespan: nothing proxied, nothing recorded
    samples = {s.name: s.value for f in text_string_to_metric_families(body.text) for s in f.samples}
    assert samples["verinfer_gateway_requests_total"] == 4 and samples["verinfer_gateway_records_dropped_total"] == 1
    assert samples["verinfer_gateway_exchanges_unrecordable_total"] == 2
    assert samples["verinfer_gateway_queue_depth"] == 0


def test_the_command_serves_beyond_loopback_only_with_its_token(db, tmp_path):
    """`verinfer dashboard` as a process on 0.0.0.0 with --auth-token-env: /health open, the rest asks."""
    import os
    import sys

    import httpx

    from tests.audit_servers import free_port, serving_process

    token, port = "a-long-enough-dashboard-token", free_port()
    env = {**os.environ, "DASH_TOKEN": token}
    argv = [sys.executable, "-m", "verinfer.cli.main", "dashboard", "--db", db.url, "--host", "0.0.0.0",
            "--port", str(port), "--auth-token-env", "DASH_TOKEN"]
    with serving_process(argv, tmp_path / "dashboard.log", f"http://127.0.0.1:{port}/health", env, ready_s=120):
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/", timeout=60).status_code == 401
        page = httpx.get(f"{base}/", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert page.status_code == 200 and 'data-provider="acme"' in page.text and token not in page.text
        assert httpx.get(f"{base}/metrics", auth=("prometheus", token), timeout=60).status_code == 200
    assert token not in (tmp_path / "dashboard.log").read_text()
