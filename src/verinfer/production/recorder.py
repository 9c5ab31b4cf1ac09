"""The gateway's recorder: exchanges go through a bounded queue to one writer thread that turns them
into traces (``verinfer.production.exchange.record``) and writes rotating Parquet shards.

Recording never slows or fails a client's request: the request path only ``submit``s an exchange
(``put_nowait``); parsing, tokenizing and writing happen on the writer thread. When the queue is
full the policy decides: ``drop`` (the default: the exchange is counted in ``dropped`` and a log
line says so, once per full spell) or ``block`` (the request waits for room, trading latency for
completeness).

Shards: ``traces-<UTC time>-<pid>-<sequence>.parquet`` in the trace directory, readable as they are
by ``verinfer verify DIR`` and ``--ray`` (``verinfer.sharded``), and the unverifiable choices
(``meta.unverifiable`` says why) in ``unverifiable/`` below it, which ``verify DIR`` does not read.
A shard is closed after ``shard_records`` traces or ``shard_seconds`` after its first trace,
whichever comes first, and written by ``verinfer.trace.write_traces`` (a temporary file renamed into
place), so a crash or kill -9 loses at most the open shard's records and never leaves a partial
shard; names carry the time, the process id and a sequence number and an existing file is never
replaced. A half-written ``.parquet.tmp`` left by a killed gateway (its process gone) is deleted when
the next one starts. ``close`` (graceful shutdown) drains the queue and writes the open shard.

A shard that cannot be written (a full disk, a directory made read-only) stops recording with one
log line naming the directory and the error; its records and every later exchange count as
``dropped`` and proxying goes on. ``Counters`` holds every number ``/gateway/health`` reports, in one
object a Prometheus ``/metrics`` endpoint can read.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from verinfer.production.exchange import Exchange, Recording, Unrecordable, record
from verinfer.trace import Trace, write_traces

POLICIES = ("drop", "block")
UNVERIFIABLE_DIR = "unverifiable"


@dataclass
class Counters:
    """What the gateway did since it started (Prometheus style: monotonic totals, one gauge)."""

    requests: int = 0  # requests proxied
    upstream_errors: int = 0  # answered by the engine with a status >= 400 (passed through)
    upstream_unreachable: int = 0  # the engine could not be reached (502 to the client)
    ids_refused: int = 0  # the engine refused return_token_ids (retried without; remembered)
    exchanges: int = 0  # generation exchanges handed to the recorder
    recorded: int = 0  # verifiable traces in finished shards
    unverifiable: int = 0  # traces written to unverifiable/ shards
    unrecordable: int = 0  # exchanges that yielded no trace (logged with the reason)
    dropped: int = 0  # exchanges or traces lost: full queue, or recording stopped
    shards_written: int = 0
    write_errors: int = 0
    queue_depth: int = 0  # gauge: exchanges waiting for the writer
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def shard_name(seq: int, now: float | None = None) -> str:
    stamp = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return f"traces-{stamp}-{os.getpid()}-{seq:06d}.parquet"


class ShardWriter:
    """Buffers traces and writes them as shards into one directory (never over an existing file)."""

    def __init__(self, directory: Path, write: Callable[[list[Trace], Path], object] = write_traces):
        self.directory, self.write, self.seq = Path(directory), write, 0
        self.buffer: list[Trace] = []
        self.opened: float | None = None  # monotonic time of the open shard's first trace

    def add(self, traces: list[Trace]) -> None:
        if traces and self.opened is None:
            self.opened = time.monotonic()
        self.buffer += traces

    def due(self, records: int, seconds: float) -> bool:
        return bool(self.buffer) and (len(self.buffer) >= records or time.monotonic() - self.opened >= seconds)

    def flush(self) -> tuple[Path, int] | None:
        """Write the open shard (OSError propagates, the buffer kept for the caller to count)."""
        if not self.buffer:
            return None
        while True:
            self.seq += 1
            path = self.directory / shard_name(self.seq)
            if not path.exists():
                break
        self.write(self.buffer, path)
        n, self.buffer, self.opened = len(self.buffer), [], None
        return path, n


class Recorder:
    """The bounded queue and the writer thread (module docstring)."""

    def __init__(self, directory: Path, recording: Recording, log: Callable[..., None], counters: Counters,
                 shard_records: int = 1000, shard_seconds: float = 60.0, queue_size: int = 10000,
                 on_full: str = "drop", write: Callable[[list[Trace], Path], object] = write_traces):
        if on_full not in POLICIES:
            raise ValueError(f"on_full must be one of {', '.join(POLICIES)}, got {on_full!r}")
        for name, value in (("shard_records", shard_records), ("queue_size", queue_size)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not shard_seconds > 0:
            raise ValueError(f"shard_seconds must be > 0, got {shard_seconds}")
        self.directory, self.recording, self.log, self.counters = Path(directory), recording, log, counters
        self.directory.mkdir(parents=True, exist_ok=True)  # an impossible directory fails here, before any request
        self._remove_stale()
        self.shard_records, self.shard_seconds, self.on_full = shard_records, shard_seconds, on_full
        self.queue: queue.Queue[Exchange | None] = queue.Queue(queue_size)
        self.shards = ShardWriter(self.directory, write)
        self.aside = ShardWriter(self.directory / UNVERIFIABLE_DIR, write)
        self.stopped: str | None = None  # why recording stopped (a write error), else None
        self.full = False  # inside a full-queue spell (logged once per spell)
        self.thread = threading.Thread(target=self._run, name="verinfer-gateway-recorder", daemon=True)
        self.thread.start()

    def _remove_stale(self) -> None:
        """Delete the half-written shards (``*.parquet.tmp``) a killed gateway left: their process is gone."""
        for tmp in [*self.directory.glob("traces-*.parquet.tmp"),
                    *(self.directory / UNVERIFIABLE_DIR).glob("traces-*.parquet.tmp")]:
            parts = tmp.name.split("-")
            if len(parts) < 4 or not parts[2].isdigit() or _alive(int(parts[2])):
                continue
            with contextlib.suppress(OSError):
                tmp.unlink()
                self.log("info", "stale_tmp_removed", path=str(tmp))

    def submit(self, ex: Exchange) -> None:
        """Hand an exchange over without waiting (policy ``drop``) or until there is room (``block``;
        call it off the event loop)."""
        self.counters.add(exchanges=1)
        if self.stopped:
            self.counters.add(dropped=1)
            return
        try:
            if self.on_full == "block":
                self.queue.put(ex)
            else:
                self.queue.put_nowait(ex)
        except queue.Full:
            self.counters.add(dropped=1)
            if not self.full:
                self.full = True
                self.log("warning", "queue_full", queue_size=self.queue.maxsize, policy=self.on_full,
                         detail="exchanges are dropped until the writer catches up (see 'dropped')")
            return
        if self.full:
            self.full = False
            self.log("info", "queue_recovered", dropped_total=self.counters.snapshot()["dropped"])
        self.counters.queue_depth = self.queue.qsize()

    def close(self, timeout: float = 60.0) -> None:
        """Drain the queue, write the open shards, stop the thread (graceful shutdown)."""
        self.queue.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                ex = self.queue.get(timeout=min(1.0, self.shard_seconds / 4))
            except queue.Empty:
                ex = False
            self.counters.queue_depth = self.queue.qsize()
            if ex is None:
                self._flush(force=True)
                return
            if ex is not False:
                self._take(ex)
            self._flush(force=False)

    def _take(self, ex: Exchange) -> None:
        try:
            recorded = record(ex, self.recording)
        except Unrecordable as exc:
            self.counters.add(unrecordable=1)
            self.log("warning", "unrecordable", request_id=ex.request_id, reason=str(exc))
            return
        except Exception as exc:  # a bug here must not stop the writer; the exchange is counted
            self.counters.add(unrecordable=1)
            self.log("error", "unrecordable", request_id=ex.request_id, reason=f"{type(exc).__name__}: {exc}")
            return
        if self.stopped:
            self.counters.add(dropped=len(recorded.traces) + len(recorded.unverifiable))
            return
        self.shards.add(recorded.traces)
        self.aside.add(recorded.unverifiable)

    def _flush(self, force: bool) -> None:
        for writer, counter in ((self.shards, "recorded"), (self.aside, "unverifiable")):
            if self.stopped or not (force or writer.due(self.shard_records, self.shard_seconds)):
                continue
            pending = len(writer.buffer)
            try:
                done = writer.flush()
            except Exception as exc:  # OSError (ENOSPC, EACCES), or pyarrow's wrapping of one
                self.stopped = f"{writer.directory}: {type(exc).__name__}: {exc}"
                self.counters.add(write_errors=1, dropped=pending)
                writer.buffer = []
                self.log("error", "recording_stopped", directory=str(writer.directory), error=str(exc),
                         lost_records=pending, detail="proxying continues; fix the directory and restart the gateway")
                continue
            if done:
                self.counters.add(**{counter: done[1], "shards_written": 1})
                self.log("info", "shard_written", path=str(done[0]), records=done[1])
