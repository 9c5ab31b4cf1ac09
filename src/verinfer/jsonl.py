"""JSON Lines reading shared by every input file format (traces, prompts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def read_jsonl(path: Path, error: type[Exception]) -> Iterator[tuple[str, object]]:
    """Yield ('<path>:<line>', record) for each non-blank line; ``error`` names a line that is not JSON."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            yield f"{path}:{lineno}", record
