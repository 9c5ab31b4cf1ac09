"""``verinfer dashboard``: the verification history as a status page, Prometheus metrics and alerts.

FastAPI serves server-rendered pages (Jinja, inline CSS and SVG: nothing is fetched from elsewhere,
no JavaScript): ``/`` (every series' current state and timeline, scheduled audits beside them,
filters in the query string so a view is a link), ``/window/{id}`` (the drill-down: a window's traces
with divergent tokens highlighted by the audit report's own template, ``auditing/templates/
tokens.html.j2``), ``/metrics`` (``verinfer.production.metrics``) and ``/health``. Times are UTC; the
overview reloads itself every ``refresh`` seconds (a query parameter; 0 turns it off).

Security: the CLI binds loopback unless told otherwise, and beyond loopback it refuses to start
without a token (``--auth-token-env``). With a token every route but ``/health`` asks for it, as
``Authorization: Bearer TOKEN`` (Prometheus' ``authorization`` setting) or as the password of HTTP
basic auth (what a browser prompts for). Every provider-supplied string is escaped by Jinja's
autoescape; every page passes through ``verinfer.auditing.secrets.redact_text`` (URL credentials and
secret query values), and the token is registered there so it never appears either.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import secrets
import threading
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from sqlalchemy.orm import Session

from verinfer.auditing.secrets import redact_text, remember
from verinfer.production import metrics, views
from verinfer.production.store import Store, utcnow
from verinfer.production.timeline import chart
from verinfer.stats.pooling import MARGIN_CLIP

TRACES_PER_PAGE = 50
OPEN_ROUTES = ("/health",)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``: addresses only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def authorized(header: str | None, token: str) -> bool:
    """``Bearer TOKEN`` or HTTP basic auth whose password is TOKEN (any user name)."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return secrets.compare_digest(value.strip().encode(), token.encode())
    if scheme.lower() == "basic":
        try:
            password = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return False
        return secrets.compare_digest(password.encode(), token.encode())
    return False


def _utc(t: dt.datetime | None, seconds: bool = True) -> str:
    return "-" if t is None else t.strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M") + "Z"


def _num(value: float | None, fmt: str = "%.4g") -> str:
    return "-" if value is None else fmt % value


def environment() -> jinja2.Environment:
    """This package's templates, and the audit report's (for the shared token partial)."""
    env = jinja2.Environment(loader=jinja2.ChoiceLoader([jinja2.PackageLoader("verinfer.production", "templates"),
                                                         jinja2.PackageLoader("verinfer.auditing", "templates")]),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
    env.filters.update(utc=_utc, num=_num)
    return env


def _page(env: jinja2.Environment, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    html = env.get_template(name).render(now=utcnow(), clip=MARGIN_CLIP, **context)
    return HTMLResponse(redact_text(html), status_code=status)


def create_app(store: Store, token: str | None = None, alerter=None, alert_every_s: float = 30.0) -> FastAPI:
    """The dashboard over ``store`` (read through ``views.read_engine``); ``alerter``
    (``verinfer.production.alerts.Alerter``) polls for verdict changes on a thread while it runs."""
    engine = views.read_engine(store)
    env = environment()
    if token:
        remember(token)
    stop = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        thread = None
        if alerter is not None:
            thread = threading.Thread(target=alerter.run, args=(alert_every_s, stop), name="verinfer-alert-poll",
                                      daemon=True)
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if thread is not None:
                thread.join(30)
                alerter.close()
            if engine is not store.engine:
                engine.dispose()

    app = FastAPI(title="verinfer dashboard", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if token and request.url.path not in OPEN_ROUTES and not authorized(request.headers.get("authorization"),
                                                                             token):
            return JSONResponse({"error": {"message": "this dashboard needs its token (Authorization: Bearer TOKEN, "
                                                      "or the token as the HTTP basic-auth password)",
                                           "type": "authentication_error", "code": "unauthorized"}},
                                status_code=401, headers={"WWW-Authenticate": 'Basic realm="verinfer dashboard"'})
        return await call_next(request)

    def bad_request(message: str) -> HTMLResponse:
        return _page(env, "error.html.j2", 400, message=message)

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request) -> HTMLResponse:
        try:
            f = views.Filters.parse(request.query_params)
        except ValueError as exc:
            return bad_request(str(exc))
        with Session(engine) as s:
            view = views.overview(s, f)
        return _page(env, "dashboard.html.j2", f=f, series=view.series, choices=view.choices,
                     charts=[chart(x.points, x.audits) for x in view.series], audits_alone=view.audits_alone,
                     since_until=f.range())

    @app.get("/window/{window_id}", response_class=HTMLResponse)
    def window(request: Request, window_id: int) -> HTMLResponse:
        try:
            offset = int(request.query_params.get("offset") or 0)
            if offset < 0:
                raise ValueError
        except ValueError:
            return bad_request(f"offset={request.query_params.get('offset')!r}: expected a whole number >= 0")
        with Session(engine) as s:
            w = views.window(s, window_id)
            if w is None:
                return _page(env, "error.html.j2", 404, message=f"window {window_id}: no such window")
            rows, count = views.window_traces(s, window_id, TRACES_PER_PAGE, offset)
            before, after = views.neighbours(s, w)
        traces = views.trace_views(rows, w.model)
        return _page(env, "window.html.j2", w=w, traces=traces, count=count, offset=offset, per_page=TRACES_PER_PAGE,
                     band=views.band_at(w.judged_by, views.band_size(w.tokens)) if w.tokens else None,
                     before=before, after=after)

    @app.get("/metrics")
    def prometheus() -> Response:
        body, content_type = metrics.history_exposition(engine)
        return Response(body, media_type=content_type)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "database": store.dialect}

    app.state.store = store
    return app


__all__ = ["authorized", "create_app", "environment", "is_loopback"]
