"""The OpenAI-compatible provider server as a FastAPI app: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/health`` and ``/openapi.json``.

``create_app`` wires the routes to a ``ServedModel`` (``serve.served``: the model, its schedulers and
limits) through ``serve.handlers`` (request to response, the API's semantics: seeds, returned ids,
limits and errors), and starts and stops the schedulers' threads with the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from verinfer.models.backend import Backend
from verinfer.serve.config import ServeConfig
from verinfer.serve.handlers import Handlers
from verinfer.serve.protocol import APIError, ChatRequest, CompletionRequest, decode_body
from verinfer.serve.results import check_key
from verinfer.serve.served import ServedModel

__all__ = ["ServedModel", "create_app"]


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _json_body(request: Request, limit: int) -> Any:
    """The body as JSON (``protocol.decode_body``), read no further than ``limit`` bytes (413 above)."""
    too_large = APIError(f"request body is larger than this server's limit of {limit} bytes", status=413,
                         code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and (len(length) > 18 or int(length) > limit):
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError("the client disconnected", status=499, code="client_disconnected") from None
    return decode_body(b"".join(chunks))


def _request_body(model, served: ServedModel) -> tuple[dict, dict]:
    """OpenAPI ``requestBody`` of a route that reads its body itself, and the schemas it refers to.

    The model's bounds, tightened to this server's: token limits, token ids within the vocabulary.
    """
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    props = schema["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        for option in props.get(name, {}).get("anyOf", [props.get(name, {})]):
            if option.get("type") == "integer":
                option["maximum"] = served.config.max_tokens_limit
    for option in props.get("prompt", {}).get("anyOf", []):
        if option.get("type") == "array":
            option["items"]["maximum"] = served.reference.vocab_size - 1
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}, defs


def create_app(backend: Backend, config: ServeConfig = ServeConfig(), served: ServedModel | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the model's scheduler threads."""
    served = served or ServedModel(backend, config)
    handlers = Handlers(served)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for s in served.schedulers:
            s.start()
        try:
            yield
        finally:
            for s in served.schedulers:
                await asyncio.to_thread(s.close)

    app = FastAPI(title="verinfer provider", lifespan=lifespan)
    app.state.served = served

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return _error(APIError(str(exc.detail), status=exc.status_code, code=code))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        print(f"verinfer serve: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _error(APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500, type="server_error"))

    @app.get("/health")
    async def health():
        ss = served.schedulers
        total = {k: sum(getattr(s, k) for s in ss) for k in ("requests", "batches", "decode_steps", "queued",
                                                              "running", "abandoned", "expired", "failed",
                                                              "spec_requests", "spec_tokens", "spec_accepted")}
        return {"status": "ok", **total, "largest_batch": max(s.largest_batch for s in ss),
                "max_batch": served.scheduler.max_batch, "dropped_streams": served.dropped_streams,
                "kept_results": len(served.results), "reused_results": served.results.reused,
                "detached": served.results.detached}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        served.check_model(model_id)
        return served.card()

    limit = served.config.max_request_bytes
    completion_body, completion_defs = _request_body(CompletionRequest, served)
    chat_body, chat_defs = _request_body(ChatRequest, served)

    @app.post("/v1/completions", openapi_extra=completion_body)
    async def completions(request: Request):
        key = check_key(request.headers.get("idempotency-key"))
        return await handlers.completion(await _json_body(request, limit), request, key)

    @app.post("/v1/chat/completions", openapi_extra=chat_body)
    async def chat_completions(request: Request):
        key = check_key(request.headers.get("idempotency-key"))
        return await handlers.chat(await _json_body(request, limit), request, key)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update({**completion_defs, **chat_defs})
        return app.openapi_schema

    app.openapi = openapi
    return app
