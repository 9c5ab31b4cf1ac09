"""JSON Lines reading shared by every input file format (traces, prompts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


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
