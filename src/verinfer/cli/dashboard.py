"""``verinfer dashboard --db URL --port N``: the verification history as a status page with
Prometheus ``/metrics`` and, with ``--alert-url``, a webhook on every verdict change
(``verinfer.production.dashboard``, ``.metrics``, ``.alerts``).

Binds 127.0.0.1 by default; any other ``--host`` needs ``--auth-token-env NAME`` naming a non-empty
environment variable, or it refuses to start (exit 2), as it does for a database it cannot open.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import typer

from verinfer.cli.errors import one_line_errors


@one_line_errors
def dashboard(
    db: str = typer.Option(..., "--db", help="the monitor's database: sqlite:///PATH or postgresql://USER@HOST/DB"),
    port: int = typer.Option(8300, help="port to listen on"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (beyond loopback it needs --auth-token-env)"),
    auth_token_env: Optional[str] = typer.Option(None, help="environment variable holding the token every route but "
                                                 "/health asks for (Bearer, or the basic-auth password)"),
    alert_url: Optional[str] = typer.Option(None, help="webhook POSTed a JSON body on every verdict change"),
    alert_state: Optional[Path] = typer.Option(None, help="--alert-url: file remembering what was alerted "
                                               "(default: under $VERINFER_CACHE/alerts, one per database)"),
    alert_every: float = typer.Option(30.0, help="--alert-url: seconds between checks for verdict changes"),
    public_url: Optional[str] = typer.Option(None, help="base URL of this dashboard in alert links "
                                             "(default: http://HOST:PORT)"),
    stale_after: str = typer.Option("30m", help="a series with no window recorded for this long shows IDLE, not "
                                    "its last verdict (e.g. 30m, 2h)"),
    alert_format: str = typer.Option("verinfer", help="--alert-url: the body's shape, verinfer (its own JSON) or "
                                     "alertmanager (Alertmanager's webhook: firing / resolved)"),
    alert_secret_env: Optional[str] = typer.Option(None, help="--alert-url: environment variable holding a secret; "
                                                   "each POST carries X-Verinfer-Signature-256: sha256=HMAC of its "
                                                   "body"),
):
    """Serve the verification history: current state, timelines, drill-down, /metrics and alerts."""
    import uvicorn

    from verinfer.extras import require

    require("production", "verinfer dashboard")

    from verinfer.production.access import secret_from_env, service_token
    from verinfer.production.alerts import SHAPES
    from verinfer.production.dashboard import create_app
    from verinfer.production.logs import uvicorn_log_config
    from verinfer.production.monitor import parse_duration
    from verinfer.production.store import open_store, shown
    from verinfer.sockets import bind

    token = service_token(host, auth_token_env)
    if alert_url is not None and not alert_url.startswith(("http://", "https://")):
        raise ValueError("--alert-url must be an http(s) URL")
    if not alert_every > 0:
        raise ValueError(f"--alert-every must be > 0, got {alert_every}")
    if public_url is not None and not public_url.startswith(("http://", "https://")):
        raise ValueError("--public-url must be an http(s) URL")
    if alert_format not in SHAPES:
        raise ValueError(f"--alert-format must be one of {', '.join(SHAPES)}, got {alert_format!r}")
    secret = secret_from_env("--alert-secret-env", alert_secret_env) if alert_secret_env else None
    stale_s = parse_duration(stale_after, "--stale-after")
    store = open_store(db)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    base = (public_url or f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}").rstrip("/")
    alerter = None
    if alert_url:
        from verinfer.models.load import cache_root
        from verinfer.production.alerts import Alerter, webhook_host
        from verinfer.production.views import read_engine

        state = alert_state or cache_root() / "alerts" / f"{hashlib.sha256(shown(db).encode()).hexdigest()[:16]}.json"
        alerter = Alerter(read_engine(store), alert_url, state, lambda window_id: f"{base}/window/{window_id}",
                          shape=alert_format, secret=secret)
        typer.echo(f"alerts: verdict changes to {webhook_host(alert_url)} (state {state})", err=True)
    typer.echo(f"verinfer dashboard of {shown(db)} on {base}/ (metrics at {base}/metrics)", err=True)
    try:
        uvicorn.Server(uvicorn.Config(create_app(store, token, alerter, alert_every, stale_s), log_level="warning",
                                      access_log=False, lifespan="on", timeout_graceful_shutdown=10,
                                      log_config=uvicorn_log_config())).run(sockets=[sock])
    finally:
        store.close()
