"""JSON Lines reading shared by every input file format (traces, prompts), and the one check that a
piece of JSON text is an object (command-line options, streamed events)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


def read_jsonl(path: Path, error: type[Exception]) -> Iterator[tuple[str, object]]:
    """Yield ('<path>:<line>', record) for each non-blank line; ``error`` names a line that is not JSON."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise error(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})") \
                    from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                what = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "nested too deep"
                raise error(f"{path}:{lineno}: not valid JSON ({what})") from None
            yield f"{path}:{lineno}", record


def json_object(text: str, where: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """``text`` parsed as a JSON object, or ``error`` naming ``where``: not JSON, or JSON of another
    type (``audit run --extra-body``, ``gateway --request-defaults``, a streamed event)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        what = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deep"
        raise error(f"{where}: not JSON ({what})") from None
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value
