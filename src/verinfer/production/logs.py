"""Logs of the long-running commands (gateway, in-engine recorder, dashboard): JSON lines on stderr.

One object per record: ``ts`` (UTC, milliseconds), ``level``, ``event`` and the record's fields
(``log(level, event, **fields)``); records from other libraries (uvicorn's start-up warnings and
tracebacks) go through the same formatter, naming their ``logger`` and carrying a traceback as
``error``, so a log shipper parses every line.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any, Callable


def iso(epoch: float) -> str:
    """An epoch time as ISO-8601 UTC with milliseconds (``2026-03-01T12:00:00.000Z``)."""
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonLines(logging.Formatter):
    """The formatter of every line (module docstring)."""

    def format(self, r: logging.LogRecord) -> str:
        out = {"ts": iso(r.created), "level": r.levelname.lower(), "event": r.getMessage(), **getattr(r, "fields", {})}
        if not r.name.startswith("verinfer"):
            out["logger"] = r.name
        if r.exc_info:
            out["error"] = self.formatException(r.exc_info)
        return json.dumps(out, default=str)


def json_log(name: str = "verinfer.gateway", stream=None) -> Callable[..., None]:
    """``log(level, event, **fields)`` on logger ``name``: one JSON object per line on ``stream`` (stderr)."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(JsonLines())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False

    def log(level: str, event: str, **fields: Any) -> None:
        logger.log(getattr(logging, level.upper()), event, extra={"fields": fields})
    return log


def uvicorn_log_config(level: str = "warning") -> dict[str, Any]:
    """uvicorn's ``log_config``: its own messages (start-up, errors, tracebacks) as JSON lines on stderr too."""
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": f"{__name__}.JsonLines"}},
            "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
            "loggers": {name: {"handlers": ["stderr"], "level": level.upper(), "propagate": False}
                        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}}


__all__ = ["JsonLines", "iso", "json_log", "uvicorn_log_config"]
