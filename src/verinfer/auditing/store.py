"""Paid-for responses on disk before anything can fail: an append-only, fsync'd JSONL file.

Every request is keyed by a stable hash of what was asked (endpoint path and body, never the API
key), so an interrupted audit that is run again finds what it already has and pays only for the
rest. A line is written whole with one ``write`` and flushed to disk before the response is used;
a line that is not valid JSON can only come from a write that was cut off (the process killed
mid-write); it is skipped and counted (``damaged_lines``, shown in the report), and its request is
simply asked again.

Nothing secret is written: every record passes through ``verinfer.auditing.secrets.redact`` first,
so a provider that echoes the API key (or a URL password) in its body has it replaced by
``[REDACTED]`` on disk and in memory alike.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from verinfer.auditing.secrets import redact

RECORD_FORMAT = "verinfer.audit.response/1"


class StoreError(ValueError):
    """A response file that cannot be read back; the message names the file and line."""


def request_key(path: str, body: dict[str, Any]) -> str:
    """Stable id of a request: sha256 of the endpoint path and the canonical JSON body."""
    canonical = json.dumps({"path": path, "body": body}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:32]


class ResponseStore:
    """Responses of one provider, by request key; appends are atomic per line and fsync'd."""

    def __init__(self, path: str | Path):
        self.path = Path(path)  # its directory is made by the first append: a failed audit leaves none
        self.damaged_lines = 0
        self._needs_newline = False
        self._records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            for record in self._read():
                self._records[record["key"]] = record

    def _read(self) -> Iterator[dict[str, Any]]:
        raw = self.path.read_bytes()
        self._needs_newline = bool(raw) and not raw.endswith(b"\n")
        for lineno, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.damaged_lines += 1  # a write cut off mid-line
                continue
            if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or "key" not in record:
                raise StoreError(f"{self.path}:{lineno}: not a {RECORD_FORMAT} record")
            yield record

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[dict[str, Any]]:
        return list(self._records.values())

    def get(self, key: str) -> dict[str, Any] | None:
        return self._records.get(key)

    def append(self, key: str, path: str, body: dict[str, Any], response: Any, **meta: Any) -> dict[str, Any]:
        """Write one record (redacted) and fsync it; only then is it visible to ``get``."""
        record = redact({"format": RECORD_FORMAT, "key": key, "path": path, "request": body, "response": response,
                         **meta})
        line = (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")
        if self._needs_newline:  # start on a fresh line after a cut-off one
            line = b"\n" + line
            self._needs_newline = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._records[key] = record
        return record
