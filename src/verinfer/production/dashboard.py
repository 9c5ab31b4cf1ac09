"""``verinfer dashboard``: the verification history as a status page, Prometheus metrics and alerts.

FastAPI serves server-rendered pages (Jinja, inline CSS and SVG: nothing is fetched from elsewhere,
no JavaScript): ``/`` (every series' current state and timeline, scheduled audits beside them,
filters in the query string so a view is a link), ``/window/{id}`` (the drill-down: a window's traces
with divergent tokens highlighted by the audit report's own template, ``auditing/templates/
tokens.html.j2``), ``/metrics`` (``verinfer.production.metrics``) and ``/health``. Times are UTC; the
overview reloads itself every ``refresh`` seconds (a query parameter; 0 turns it off).

Security (``verinfer.production.access``, the gateway's rule too): the CLI binds loopback unless told
otherwise, and beyond loopback it refuses to start without a token (``--auth-token-env``). With a
token every route but ``/health`` asks for it. Every provider-supplied string is escaped by Jinja's
autoescape; every page passes through ``verinfer.auditing.secrets.redact_text`` (URL credentials and
secret query values), and the token is registered there so it never appears either.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from verinfer.auditing.secrets import redact_text, remember
from verinfer.production.access import authorized, unauthorized_body
from verinfer.production import metrics, views
from verinfer.production.store import Store, Window, utcnow
from verinfer.production.timeline import chart
from verinfer.stats.pooling import MARGIN_CLIP

TRACES_PER_PAGE = 50
OPEN_ROUTES = ("/health",)


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


def create_app(store: Store, token: str | None = None, alerter=None, alert_every_s: float = 30.0,
               stale_after_s: float = views.STALE_AFTER_S) -> FastAPI:
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
            return JSONResponse(unauthorized_body("dashboard"), status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="verinfer dashboard"'})
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
            view = views.overview(s, f, stale_after_s=stale_after_s)
        return _page(env, "dashboard.html.j2", f=f, series=view.series, choices=view.choices,
                     charts=[chart(x.points, x.audits) for x in view.series], audits_alone=view.audits_alone,
                     since_until=f.range(), failed=view.failed, failed_count=view.failed_count)

    def api_error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": "bad_request"}}, status_code=status)

    @app.get("/api/series")
    def api_series(request: Request) -> JSONResponse:
        """Each series' current state, as the overview's table shows it (filters as the page's)."""
        try:
            f = views.Filters.parse(request.query_params)
        except ValueError as exc:
            return api_error(str(exc))
        with Session(engine) as s:
            return JSONResponse(views.series_json(views.overview(s, f, stale_after_s=stale_after_s)))

    @app.get("/api/windows")
    def api_windows(request: Request) -> JSONResponse:
        """The newest windows (``limit``, at most 1,000) that pass the filters and ``since`` / ``until``."""
        raw = request.query_params.get("limit") or "100"
        try:
            f = views.Filters.parse(request.query_params)
            limit = int(raw)
            if not 1 <= limit <= views.API_MAX_WINDOWS:
                raise ValueError
        except ValueError as exc:
            return api_error(str(exc) if str(exc) else f"limit={raw!r}: expected a number from 1 to "
                                                       f"{views.API_MAX_WINDOWS}")
        with Session(engine) as s:
            return JSONResponse(views.windows_json(s, f, limit))

    @app.get("/window/{window_ref}", response_class=HTMLResponse)
    def window(request: Request, window_ref: str) -> HTMLResponse:
        if not window_ref.isdigit():  # a page, not FastAPI's 422 JSON, for a link typed wrong
            return _page(env, "error.html.j2", 404, message=f"window {window_ref}: no such window (ids are numbers)")
        window_id = int(window_ref)
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
            flagged_at = views.trace_position(s, window_id, w.first_flagged) if w.first_flagged else None
        traces = views.trace_views(rows, w.model)
        return _page(env, "window.html.j2", w=w, traces=traces, count=count, offset=offset, per_page=TRACES_PER_PAGE,
                     band=views.band_at(w.judged_by, views.band_size(w.tokens)) if w.tokens else None,
                     before=before, after=after,
                     flagged_page=None if flagged_at is None else flagged_at // TRACES_PER_PAGE * TRACES_PER_PAGE)

    @app.get("/metrics")
    def prometheus() -> Response:
        body, content_type = metrics.history_exposition(engine, alerter.stats if alerter is not None else None)
        return Response(body, media_type=content_type)

    @app.get("/health")
    def health() -> JSONResponse:
        """200 when the history can be read (one row of its windows table), else 503 with the reason:
        a balancer or a probe must not see ok from a dashboard whose pages fail."""
        try:
            with Session(engine) as s:
                s.execute(select(Window.id).limit(1)).all()
        except Exception as exc:  # SQLAlchemyError, or the driver's own (a file gone, a server down)
            reason = redact_text(f"the database ({store.dialect}) cannot be read: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
            return JSONResponse({"status": "database_unreachable", "database": store.dialect, "reasons": [reason]},
                                status_code=503)
        return JSONResponse({"status": "ok", "database": store.dialect, "reasons": []})

    app.state.store = store
    return app


__all__ = ["create_app", "environment"]
