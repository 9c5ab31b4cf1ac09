"""``verinfer monitor DIR --db URL``: verify a trace directory shard by shard into the verification
history (``verinfer.production.monitor``), once (``--once``) or until SIGTERM / Ctrl-C.

Logs are JSON lines on stderr (one per event: verified, failed, dropped, audit). Exit codes with
``--once``: 0 recorded, 1 a window this run touched is INCONSISTENT, 2 bad input (a database that
cannot be opened, a missing directory) or a shard that could not be verified (recorded as failed).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from verinfer.cli import options as opt
from verinfer.cli.errors import one_line_errors


def _event(event: str, fields: dict) -> None:
    """One JSON line per event on stderr (structured logs for the operator's collector)."""
    line = {"ts": dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"), "event": event, **fields}
    print(json.dumps(line, default=str), file=sys.stderr, flush=True)


@one_line_errors
def monitor(
    directory: Path = typer.Argument(..., metavar="DIR", help="directory the gateway writes trace shards into"),
    db: str = typer.Option(..., "--db", help="sqlite:///PATH (embedded) or postgresql://USER[:PASS]@HOST[:PORT]/DB"),
    once: bool = typer.Option(False, "--once", help="verify what is there, record it, exit"),
    ray: bool = typer.Option(False, "--ray", help="verify shards on a local Ray cluster (verinfer.sharded.run_ray)"),
    workers: Optional[int] = typer.Option(None, help="--ray: model replicas (default: one per CPU)"),
    calibration: Optional[Path] = opt.input_file("--calibration", "calibration file from `verinfer calibrate`; "
                                                 "without it: the shipped calibration verify uses, else the "
                                                 "shipped bands, where they fit; else recorded uncalibrated"),
    window: str = typer.Option("10m", help="window length of the per-window verdicts (e.g. 90s, 10m, 1h)"),
    poll: float = typer.Option(10.0, help="seconds between directory scans"),
    model: Optional[str] = typer.Option(None, help="reference model; default: the model the traces claim"),
    dtype: str = opt.dtype("float32", "verifier compute dtype"),
    device: str = opt.device(),
    backend: str = opt.backend(),
    threads: int = opt.threads(),
    out_dir: Optional[Path] = typer.Option(None, help="per-token scores per shard (default: DIR.verinfer)"),
    lease: float = typer.Option(120.0, help="seconds a claim holds without renewal before another monitor "
                                "may take the shard (renewed every third of it while verifying)"),
    alpha: float = opt.fpr(),
    audits: Optional[Path] = opt.input_file("--audits", "providers file (JSON list of {name, url, model?, "
                                            "api_key_env?}) to audit on a schedule into the same database"),
    every: str = typer.Option("60", help="--audits: interval (a bare number is minutes; or 30m, 2h)"),
    audit_mode: str = typer.Option("greedy", help="--audits: audit mode (verinfer audit run --mode)"),
    audit_n: int = typer.Option(16, help="--audits: prompts per provider"),
    sample: float = typer.Option(1.0, help="verify this fraction of the traces, chosen by a keyed hash of their "
                                 "ids the provider cannot predict (each window records how many it held and "
                                 "how many were verified)"),
    sample_key_env: Optional[str] = typer.Option(None, help="--sample: environment variable holding the key "
                                                 "(default: a random one per process)"),
    keep_up: bool = typer.Option(False, "--keep-up", help="never fall behind: verify each shard at --sample "
                                 "divided by (1 + the shards waiting), so the backlog stays bounded under any "
                                 "traffic (each shard records the fraction it was verified at)"),
    retain_shards: Optional[str] = typer.Option(None, help="delete trace shards (and their score files) verified "
                                                "longer ago than this (e.g. 7d), and unverifiable/ shards as old; "
                                                "default: keep them"),
    retain_history: Optional[str] = typer.Option(None, help="delete windows, audits and the rows of deleted shards "
                                                 "older than this (e.g. 180d); default: keep them"),
    metrics_port: Optional[int] = typer.Option(None, help="serve this monitor's /metrics (Prometheus: backlog, "
                                               "lag, shards per status, sampling) and /health on this port"),
    metrics_host: str = typer.Option("127.0.0.1", help="--metrics-port: interface (beyond loopback it needs "
                                     "--auth-token-env)"),
    auth_token_env: Optional[str] = typer.Option(None, help="--metrics-port: environment variable holding the "
                                                 "token /metrics asks for (Bearer, or the basic-auth password)"),
):
    """Verify each new trace shard in DIR exactly once and record per-shard and per-window verdicts."""
    from verinfer.extras import require

    require("production", "verinfer monitor")
    if ray:
        require("ray", "verinfer monitor --ray")
    from verinfer.production.access import service_token
    from verinfer.production.budget import Budget
    from verinfer.production.monitor import AuditSchedule, Judge, Monitor, parse_duration
    from verinfer.production.store import open_store, shown
    from verinfer.stats.calibration import Calibrator

    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory")
    window_s = parse_duration(window)
    if poll <= 0 or lease <= 0:
        raise ValueError("--poll and --lease must be positive")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if not 0 < alpha < 1:
        raise ValueError(f"--fpr must be in (0, 1), got {alpha}")
    budget = Budget.from_options(sample, sample_key_env)
    calibrator = Calibrator.load(calibration) if calibration else None
    schedule = None
    if audits is not None:
        if not audits.is_file():
            raise ValueError(f"--audits {audits}: no such file")
        schedule = AuditSchedule(audits, parse_duration(every, "--every", unit="m"),
                                 (out_dir or Path(f"{directory.resolve()}.verinfer")) / "audits",
                                 {"mode": audit_mode, "n": audit_n, "fpr": alpha, "model": model})
    token = service_token(metrics_host, auth_token_env, "--metrics-host") if metrics_port is not None else None
    store = open_store(db)
    mon = Monitor(directory, store, out_dir=out_dir, judge=Judge(calibrator, str(calibration or ""), alpha),
                  window_s=window_s, model=model, dtype=dtype, device=device, reference=backend, lease_s=lease,
                  use_ray=ray,
                  workers=workers, on_event=_event, budget=budget, keep_up=keep_up,
                  retain_shards_s=parse_duration(retain_shards, "--retain-shards") if retain_shards else None,
                  retain_history_s=parse_duration(retain_history, "--retain-history") if retain_history else None)
    _event("start", {"directory": str(mon.directory), "db": shown(db), "owner": mon.owner, "window_s": window_s,
                     "scores": str(mon.out_dir), "once": once, "ray": ray, "sample": budget.fraction, "keep_up": keep_up})
    exporter = contextlib.nullcontext()
    if metrics_port is not None:
        from verinfer.production.exporter import asgi_in_thread, exporter_app
        from verinfer.production.logs import uvicorn_log_config
        from verinfer.production.metrics import monitor_exposition
        from verinfer.sockets import base_url, bind

        sock = bind(metrics_host, metrics_port)
        _event("metrics", {"url": base_url(sock).removesuffix("/v1") + "/metrics"})
        exporter = asgi_in_thread(exporter_app(lambda: monitor_exposition(store.engine, mon.fraction_now), mon.health,
                                               token), sock, log_config=uvicorn_log_config())
    with exporter:
        _run(mon, store, once, poll, schedule)


def _run(mon, store, once: bool, poll: float, schedule) -> None:
    try:
        if once:
            if schedule is not None:
                schedule.maybe_run(store, mon.owner)
            outcome = mon.run_once()
            _event("done", {"found": outcome.found, "verified": len(outcome.verified),
                            "failed": len(outcome.failed), "dropped": len(outcome.dropped)})
            if "INCONSISTENT" in outcome.verdicts:
                raise typer.Exit(1)
            if outcome.failed:
                raise typer.Exit(2)
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: mon.stop.set())
        mon.run(poll, audits=schedule)
        _event("stopped", {"owner": mon.owner})
    finally:
        store.close()
