"""The SRE's kit in ``deploy/`` (issue #39 item 9): Prometheus rules and scrape config (``promtool``, and
loaded by a real Prometheus that scrapes a live gateway and dashboard), a Grafana dashboard and an
Alertmanager example that name only metrics and alerts verinfer has, systemd units (``systemd-analyze
verify``). Debian's ``prometheus`` (promtool too) and systemd are needed: the tests fail, never skip,
without them (``.ci/run`` installs them)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.audit_servers import asgi_in_thread, free_port
from tests.test_gateway import CHAT, fake_engine

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES, SCRAPE = DEPLOY / "prometheus" / "verinfer-rules.yml", DEPLOY / "prometheus" / "prometheus.yml"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is needed to check deploy/ (Debian package '{package}')"
    return path


def exported_names() -> set[str]:
    """Every metric name verinfer's /metrics endpoints can expose (counters with and without _total)."""
    from verinfer.production import metrics
    from verinfer.production.recorder import Counters
    from verinfer.production.store import open_store

    store = open_store("sqlite://")
    try:
        with store.sessions() as s:
            families = (metrics.history_metrics(s) + metrics.monitor_metrics(s, 0.5)
                        + metrics.alert_metrics({"pending": 0, "backlog_seconds": 0, "delivered": 0, "refused": 0,
                                                 "failed_attempts": 0})
                        + metrics.gateway_metrics({"1": Counters().snapshot()}))
    finally:
        store.close()
    names = set()
    for f in families:
        names.add(f.name)
        if f.type == "counter":
            names.add(f"{f.name}_total")
    return names


def _named(expr: str) -> set[str]:
    return set(re.findall(r"\bverinfer_[a-z_]+\b", expr))


def test_rules_and_dashboard_name_only_metrics_verinfer_exports():
    names = exported_names()
    rules = yaml.safe_load(RULES.read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    grafana = json.loads((DEPLOY / "grafana" / "verinfer.json").read_text())
    exprs += [t["expr"] for p in grafana["panels"] for t in p["targets"]]
    used = set().union(*map(_named, exprs))
    assert used and used <= names, sorted(used - names)
    assert {"verinfer_verdict", "verinfer_gateway_records_dropped_total", "verinfer_monitor_lag_seconds",
            "verinfer_alerts_backlog_seconds"} <= used  # verdicts, recording, verification, alert delivery
    inconsistent = next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == "VerinferInconsistent")
    assert inconsistent["keep_firing_for"]  # rides out a dashboard restart's scrape gap (README)
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    am = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    receivers = {r["name"] for r in am["receivers"]}
    assert am["route"]["receiver"] in receivers and all(r["receiver"] in receivers for r in am["route"]["routes"])
    inhibited = {m.split("=", 1)[1].strip('"') for rule in am["inhibit_rules"]
                 for m in rule["source_matchers"] + rule["target_matchers"] if m.startswith("alertname=")}
    assert inhibited <= alerts


def test_promtool_accepts_the_rules_and_the_scrape_config():
    promtool = _tool("promtool", "prometheus")
    for argv in (["check", "rules", str(RULES)], ["check", "config", str(SCRAPE)]):
        done = subprocess.run([promtool, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_real_prometheus_scrapes_verinfer_and_evaluates_its_rules(tmp_path):
    """Prometheus (Debian's) with the shipped rules, scraping a live gateway's /gateway/metrics and a
    dashboard's /metrics every second: every target up, every rule group evaluated without error, and
    a gateway counter queried back."""
    prometheus = _tool("prometheus", "prometheus")
    from verinfer.production.dashboard import create_app
    from verinfer.production.exchange import Recording
    from verinfer.production.exporter import asgi_in_thread as serve
    from verinfer.production.gateway import Gateway, GatewayConfig, gateway_in_thread
    from verinfer.production.store import open_store
    from verinfer.sockets import bind

    store = open_store(f"sqlite:///{tmp_path}/h.db")
    dash_sock = bind("127.0.0.1", 0)
    dash = dash_sock.getsockname()[1]
    with asgi_in_thread(fake_engine()) as engine, \
            gateway_in_thread(Gateway(GatewayConfig(engine, tmp_path / "traffic", Recording("fake")),
                                      log=lambda *a, **k: None)) as gw, serve(create_app(store), dash_sock):
        assert httpx.post(f"{gw}/chat/completions", json=CHAT, timeout=30).status_code == 200
        gw_port = int(gw.split(":")[2].split("/")[0])
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "verinfer-dashboard", "static_configs": [{"targets": [f"127.0.0.1:{dash}"]}]},
                {"job_name": "verinfer-gateway", "metrics_path": "/gateway/metrics",
                 "static_configs": [{"targets": [f"127.0.0.1:{gw_port}"]}]}]}))
        proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "prometheus.log", "w"))
        try:
            api, deadline = f"http://127.0.0.1:{port}/api/v1", time.monotonic() + 120
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-3000:]
                try:
                    targets = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
                    groups = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
                    value = httpx.get(f"{api}/query", params={"query": "sum(verinfer_gateway_requests_total)"},
                                      timeout=5).json()["data"]["result"]
                except (httpx.HTTPError, KeyError, ValueError):
                    time.sleep(0.5)
                    continue
                evaluated = all(g["lastEvaluation"] > "2000" for g in groups) and groups
                if len(targets) == 2 and all(t["health"] == "up" for t in targets) and evaluated and value:
                    break
                time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(30)
    store.close()
    assert {g["name"] for g in groups} == {"verinfer-verdicts", "verinfer-recording", "verinfer-verification"}
    assert all(r["health"] == "ok" for g in groups for r in g["rules"]), [(r["name"], r.get("lastError"))
                                                                       for g in groups for r in g["rules"]]
    assert float(value[0]["value"][1]) >= 1


def test_systemd_units_verify(tmp_path):
    """``systemd-analyze verify`` on each unit, its ExecStart pointed at this environment's ``verinfer``
    (the units name /opt/verinfer/bin/verinfer: a venv made for the service, README "Deploy it")."""
    analyze = _tool("systemd-analyze", "systemd")
    verinfer = Path(sys.executable).with_name("verinfer")
    assert verinfer.exists(), verinfer
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    assert {u.name for u in units} == {"verinfer-gateway.service", "verinfer-monitor.service",
                                       "verinfer-dashboard.service"}
    for unit in units:
        local = tmp_path / unit.name
        local.write_text(unit.read_text().replace("/opt/verinfer/bin/verinfer", str(verinfer)))
        done = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True, timeout=60)
        problems = [line for line in (done.stdout + done.stderr).splitlines() if unit.name in line or "verinfer" in line]
        assert done.returncode == 0 and not problems, done.stdout + done.stderr
        command = re.search(r"ExecStart=\S+ (.*?)\n(?!\s)", unit.read_text().replace("\\\n", " ") + "\n", re.S).group(1)
        args = command.split()
        assert args[0] in ("gateway", "monitor", "dashboard")
        help_text = subprocess.run([str(verinfer), args[0], "--help"], capture_output=True, text=True,
                                   env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"}).stdout
        assert all(a in help_text for a in args if a.startswith("--")), (unit.name, args)  # options that exist
