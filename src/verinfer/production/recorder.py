"""The gateway's recorder: exchanges go through a bounded queue to one writer thread that turns them
into traces (``verinfer.production.exchange.record``), appends them to the open shard's write-ahead
file and writes rotating Parquet shards.

Recording never slows or fails a client's request: the request path only ``submit``s an exchange
(``put_nowait``); parsing, tokenizing and writing happen on the writer thread. When the queue is
full the policy decides: ``drop`` (the default: the exchange is counted in ``dropped`` and a log
line says so, once per full spell) or ``block`` (the request waits for room, trading latency for
completeness).

Shards: ``traces-<UTC time>-<pid>-<sequence>.parquet`` in the trace directory, readable as they are
by ``verinfer verify DIR`` and ``--ray`` (``verinfer.sharded``), and the unverifiable choices
(``meta.unverifiable`` says why) in ``unverifiable/`` below it, which ``verify DIR`` does not read.
A shard is closed after ``shard_records`` traces or ``shard_seconds`` after its first trace,
whichever comes first.

Durability follows PostgreSQL's write-ahead log (DESIGN.md): each trace is appended as a JSON line to
the open shard's write-ahead file (``<shard name>.wal``) as soon as it is parsed, and the file is
flushed to the OS as soon as the queue is empty and at least every ``SYNC_SECONDS``; ``fsync``
decides how often it also reaches the disk (``always``: every flush; ``second``, the default: at
most once a second; ``never``: the OS decides). Closing a shard writes it by
``verinfer.trace.write_traces`` (a temporary file fsync'd and renamed, the directory fsync'd; with
``never``, not fsync'd), then deletes the write-ahead file. So a kill -9 loses only what was still
queued or parsed in the last fraction of a second, and a power cut at most the last second. A
recorder that starts seals every write-ahead file a dead process left into the shard it was to
become (``records_recovered``, logged with the count), and deletes a dead writer's temporary files.
Several recorders (``--workers``) share a directory: names carry the process id, and sealing
claims a file by renaming it first, so two never seal the same one.

A shard that cannot be written (a full disk, a directory made read-only) stops recording with one
log line naming the directory and the error; its records, kept in its write-ahead file, and every
later exchange count as ``dropped``, and proxying goes on (health answers 503 meanwhile). Every
``RESUME_SECONDS`` the recorder tries again: a 1 MiB probe written and fsync'd in each directory,
then the write-ahead files the error left sealed into their shards (counted ``recovered``); when
both succeed recording resumes (``recording_resumed`` logged), with no restart. ``Counters``
holds every number ``/gateway/health`` reports, in one object a Prometheus ``/metrics`` endpoint
can read.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TextIO

from verinfer.files import remove_stale_temporaries_in, running
from verinfer.production.exchange import Exchange, Recording, Unrecordable, record
from verinfer.trace import Trace, TraceError, write_traces

POLICIES = ("drop", "block")
FSYNC = ("always", "second", "never")
UNVERIFIABLE_DIR = "unverifiable"
WAL = ".wal"  # a shard's write-ahead file: its final name plus this
SEALING = ".sealing"  # <wal>.<pid>.sealing: a write-ahead file claimed by the process that seals it
SYNC_SECONDS = 0.2  # the longest a parsed trace waits in the process before reaching the OS
JOURNAL = ".journal"  # exchanges-<UTC time>-<pid>-<seq>.journal: exchanges kept raw until the recorder can parse
RESUME_SECONDS = 5.0  # after a write error, how often the recorder tries to resume (``Recorder._resume``)
PROBE_BYTES = 1 << 20  # what a resume attempt writes first, to see there is room again


@dataclass
class Counters:
    """What the gateway did since it started (Prometheus style: monotonic totals, one gauge)."""

    requests: int = 0  # requests proxied
    upstream_errors: int = 0  # answered by the engine with a status >= 400 (passed through)
    upstream_unreachable: int = 0  # the engine could not be reached (502 to the client)
    streams_cut: int = 0  # streams the engine ended before [DONE] (an error event to the client; unverifiable)
    clients_left: int = 0  # streams whose client left before the end (read to the end and recorded all the same)
    ids_refused: int = 0  # the engine refused return_token_ids (retried without; remembered)
    exchanges: int = 0  # generation exchanges handed to the recorder
    recorded: int = 0  # verifiable traces in finished shards
    unverifiable: int = 0  # traces written to unverifiable/ shards
    unrecordable: int = 0  # exchanges that yielded no trace (logged with the reason)
    dropped: int = 0  # exchanges or traces lost: full queue, or recording stopped
    recovered: int = 0  # traces sealed at start from the write-ahead files of a gateway that died
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


def shard_name(seq: int, now: float | None = None) -> str:
    stamp = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return f"traces-{stamp}-{os.getpid()}-{seq:06d}.parquet"


def _owner(path: Path) -> int | None:
    """The process that owns a write-ahead file: its writer (``traces-<time>-<pid>-<seq>.parquet.wal``)
    or the sealer that claimed it (``...wal.<pid>.sealing``)."""
    if path.name.endswith(SEALING):
        pid = path.name[:-len(SEALING)].rsplit(".", 1)[-1]
    else:
        parts = path.name.split("-")
        pid = parts[2] if len(parts) >= 4 else ""
    return int(pid) if pid.isdigit() else None


def read_wal(path: Path) -> tuple[list[Trace], int]:
    """The traces of a write-ahead file and how many lines were unreadable (a crash can tear the last)."""
    traces, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                traces.append(Trace.from_dict(json.loads(line), f"{path}: line {n}"))
            except (ValueError, TypeError, TraceError):
                bad += 1
    return traces, bad


class AppendLog:
    """A file of lines, opened on the first one (never over an existing file), handed to the OS by
    ``sync`` and to the disk as the fsync policy says: a shard's write-ahead file, the journal."""

    def __init__(self, path: Path, fsync: str):
        self.path, self.fsync = path, fsync
        self.file: TextIO | None = None
        self.dirty = False  # written to the file's buffer, not yet flushed to the OS
        self.synced = 0.0  # monotonic time of the last fsync

    def write(self, text: str) -> None:
        if self.file is None:
            self.file = open(self.path, "x", encoding="utf-8")
        self.file.write(text)
        self.dirty = True

    def sync(self) -> None:
        if self.file is None or not self.dirty:
            return
        self.file.flush()
        self.dirty = False
        now = time.monotonic()
        if self.fsync == "always" or (self.fsync == "second" and now - self.synced >= 1.0):
            os.fsync(self.file.fileno())
            self.synced = now

    def close(self, remove: bool) -> None:
        """Close it, and delete it when what it held is safe elsewhere (``remove``)."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        if remove:
            with contextlib.suppress(OSError):  # gone with its directory: nothing left to delete
                self.path.unlink(missing_ok=True)


class ShardWriter:
    """The open shard of one directory: its traces in memory and, line by line, in its write-ahead
    file; ``flush`` closes it into a shard (never over an existing file)."""

    def __init__(self, directory: Path, write: Callable[[list[Trace], Path], object] = write_traces,
                 fsync: str = "second"):
        self.directory, self.write, self.fsync, self.seq = Path(directory), write, fsync, 0
        self.buffer: list[Trace] = []
        self.opened: float | None = None  # monotonic time of the open shard's first trace
        self.path: Path | None = None  # the open shard's final name
        self.wal: AppendLog | None = None

    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            self.seq += 1
            path = self.directory / shard_name(self.seq)
            if not path.exists() and not path.with_name(path.name + WAL).exists():
                break
        self.wal = AppendLog(path.with_name(path.name + WAL), self.fsync)
        self.path, self.opened = path, time.monotonic()

    def add(self, traces: list[Trace]) -> None:
        """Append to the open shard (opened on its first trace) and its write-ahead file (OSError propagates)."""
        if not traces:
            return
        if self.wal is None:
            self._open()
        self.wal.write("".join(json.dumps(t.to_dict(), ensure_ascii=False) + "\n" for t in traces))
        self.buffer += traces

    def sync(self) -> None:
        if self.wal is not None:
            self.wal.sync()

    def due(self, records: int, seconds: float) -> bool:
        return bool(self.buffer) and (len(self.buffer) >= records or time.monotonic() - self.opened >= seconds)

    def flush(self) -> tuple[Path, int] | None:
        """Write the open shard, then delete its write-ahead file (an error propagates; the caller
        ``abandon``s the shard, whose write-ahead file keeps its records for the next start)."""
        if not self.buffer:
            return None
        self.wal.sync()
        self.write(self.buffer, self.path)
        self.wal.close(remove=True)
        path, n = self.path, len(self.buffer)
        self.buffer, self.opened, self.path, self.wal = [], None, None, None
        return path, n

    def abandon(self) -> Path | None:
        """Stop writing the open shard, leaving its write-ahead file for the next start to seal."""
        wal = self.wal.path if self.wal is not None else None
        if self.wal is not None:
            self.wal.close(remove=False)
        self.buffer, self.opened, self.path, self.wal = [], None, None, None
        return wal


def journal(directory: Path, fsync: str) -> AppendLog:
    """Where exchanges are kept raw, one ``Exchange.to_json`` line each, while the recorder cannot parse
    yet (its profiles and tokenizer still loading): the write-ahead file of what is not yet a trace."""
    return AppendLog(directory / shard_name(1).replace("traces-", "exchanges-").replace(".parquet", JOURNAL), fsync)


def _claim_orphans(directory: Path, pattern: str, suffix: str) -> list[tuple[Path, Path]]:
    """(claimed path, original path) of the files a dead process left (``pattern``), each claimed by
    renaming it to ``<name>.<our pid>.sealing`` first (several recorders may start at once)."""
    out = []
    for path in sorted([*directory.glob(pattern), *directory.glob(f"{pattern}.*{SEALING}")]):
        owner = _owner(path)
        if owner is None or owner == os.getpid() or running(owner):
            continue
        name = path.name if path.name.endswith(suffix) else path.name[:path.name.index(suffix) + len(suffix)]
        claimed = path.with_name(f"{name}.{os.getpid()}{SEALING}")
        try:
            os.rename(path, claimed)
        except FileNotFoundError:  # another recorder claimed it first
            continue
        out.append((claimed, path.with_name(name)))
    return out


def read_journal(path: Path) -> tuple[list[Exchange], int]:
    """The exchanges of a journal and how many lines were unreadable (a crash can tear the last)."""
    exchanges, bad = [], 0
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            if line.strip():
                try:
                    exchanges.append(Exchange.from_json(line))
                except (ValueError, TypeError, KeyError):
                    bad += 1
    return exchanges, bad


def seal_orphans(directory: Path, write: Callable[[list[Trace], Path], object], log: Callable[..., None],
                 seen: set[str] | None = None) -> int:
    """Seal every write-ahead file in ``directory`` whose process is gone into the shard it was to
    become; returns the traces recovered (their ids added to ``seen``). A file is claimed by renaming
    it first (several recorders may start at once); a shard already in place (a crash between its
    rename and the deletion of its write-ahead file) is not written twice."""
    recovered = 0
    for claimed, wal in _claim_orphans(directory, f"traces-*.parquet{WAL}", WAL):
        shard = wal.with_name(wal.name[:-len(WAL)])
        traces, bad = seal(claimed, shard, write, seen)
        recovered += traces
        log("warning" if traces else "info", "wal_sealed", path=str(shard), records=traces, unreadable_lines=bad,
            detail="a gateway that died left these answered exchanges in its write-ahead file")
    return recovered


def seal(wal: Path, shard: Path, write: Callable[[list[Trace], Path], object],
         seen: set[str] | None = None) -> tuple[int, int]:
    """Write a write-ahead file's traces into ``shard`` (unless a shard is already there: a crash between
    its rename and the deletion of the write-ahead file), then delete it; (traces written, unreadable lines).
    ``seen`` collects the ids of its traces."""
    traces, bad = read_wal(wal)
    if seen is not None:
        seen.update(t.id for t in traces)
    written = 0
    if traces and not shard.exists():
        write(traces, shard)
        written = len(traces)
    wal.unlink()
    return written, bad


def probe(directory: Path, size: int = PROBE_BYTES) -> None:
    """Write ``size`` bytes to a file in ``directory``, fsync and delete it: an OSError if there is no room
    (an empty file can still be created on a full disk) or no way to write."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".verinfer-probe-{os.getpid()}"
    try:
        with open(path, "wb") as fh:
            fh.write(b"\0" * size)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


class Recorder:
    """The bounded queue and the writer thread (module docstring)."""

    def __init__(self, directory: Path, recording: Recording, log: Callable[..., None], counters: Counters,
                 shard_records: int = 1000, shard_seconds: float = 60.0, queue_size: int = 10000,
                 on_full: str = "drop", write: Callable[[list[Trace], Path], object] | None = None,
                 fsync: str = "second"):
        if on_full not in POLICIES:
            raise ValueError(f"on_full must be one of {', '.join(POLICIES)}, got {on_full!r}")
        if fsync not in FSYNC:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC)}, got {fsync!r}")
        for name, value in (("shard_records", shard_records), ("queue_size", queue_size)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not shard_seconds > 0:
            raise ValueError(f"shard_seconds must be > 0, got {shard_seconds}")
        self.directory, self.recording, self.log, self.counters = Path(directory), recording, log, counters
        self.directory.mkdir(parents=True, exist_ok=True)  # an impossible directory fails here, before any request
        write = write or functools.partial(write_traces, durable=fsync != "never")
        # ids of the traces sealed from dead processes' write-ahead files: a dead process's journal may hold
        # the same exchanges (killed while it parsed them, before the journal was deleted): not recorded twice
        self.sealed_ids: set[str] = set()
        for d in (self.directory, self.directory / UNVERIFIABLE_DIR):
            if d.is_dir():
                for tmp in remove_stale_temporaries_in(d):
                    self.log("info", "stale_tmp_removed", path=str(tmp))
                counters.add(recovered=(n := seal_orphans(d, write, self.log, self.sealed_ids)),
                             shards_written=int(n > 0))
        self.shard_records, self.shard_seconds, self.on_full, self.fsync = shard_records, shard_seconds, on_full, fsync
        self.queue: queue.Queue[Exchange | None] = queue.Queue(queue_size)
        self.shards = ShardWriter(self.directory, write, fsync)
        self.aside = ShardWriter(self.directory / UNVERIFIABLE_DIR, write, fsync)
        self.stopped: str | None = None  # why recording stopped (a write error), else None
        self.resumable = False  # stopped by a write error: retried every RESUME_SECONDS (``_resume``)
        self.stopped_at = 0.0  # monotonic time of the stop or of the last attempt to resume
        self.retry_error: str | None = None  # why the last attempt to resume failed
        self.abandoned: list[tuple[Path, Path]] = []  # (write-ahead file, its shard) left by a write error
        self.full = False  # inside a full-queue spell (logged once per spell)
        self.ready = False  # profiles imported and the tokenizer loaded (``_warm``): exchanges are being parsed
        self.thread = threading.Thread(target=self._run, name="verinfer-gateway-recorder", daemon=True)
        self.thread.start()

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

    def _warm(self) -> None:
        """Import the sampler profiles and load the claimed tokenizer (on a thread of its own, after the
        gateway listens: meanwhile the writer journals exchanges raw). A tokenizer that cannot be loaded
        stops recording."""
        began = time.monotonic()
        import pyarrow as pa

        import verinfer.sampling.profiles  # noqa: F401 (torch, numba: seconds on a loaded machine)

        pa.Table.from_pydict({"warm": [0]})  # pyarrow imports pandas on first use: here, not in the first shard
        try:
            self.recording = self.recording.loaded()
        except Exception as exc:
            self.stopped = f"the claimed model's tokenizer cannot be loaded: {type(exc).__name__}: {exc}"
            self.log("error", "recording_stopped", error=self.stopped, detail="proxying continues")
            return
        self.ready = True
        self.log("info", "recorder_ready", seconds=round(time.monotonic() - began, 2),
                 tokenizer=self.recording.tokenizer is not None)

    def _catch_up(self, journaled: AppendLog, waiting: list[Exchange]) -> None:
        """Once ready: parse the exchanges dead gateways journaled, then those journaled while warming."""
        for claimed, original in _claim_orphans(self.directory, f"exchanges-*{JOURNAL}", JOURNAL):
            exchanges, bad = read_journal(claimed)
            already = sum(not self._take(ex, skip=self.sealed_ids) for ex in exchanges)
            self._each(ShardWriter.sync)  # in this recorder's write-ahead files before the journal goes
            self.counters.add(recovered=len(exchanges) - already)
            claimed.unlink()
            self.log("warning", "journal_sealed", path=str(original), exchanges=len(exchanges) - already,
                     already_recorded=already, unreadable_lines=bad,
                     detail="a gateway that died left these answered exchanges unparsed; they are parsed now "
                            "with this gateway's claim (--profile, --model); already_recorded: parsed before it "
                            "died and sealed from its write-ahead file")
        for ex in waiting:
            self._take(ex)
        waiting.clear()
        self._each(ShardWriter.sync)
        journaled.close(remove=True)  # every exchange in it is now a trace in a write-ahead file

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug must not stop recording silently: health says so from now on
            self.stopped = f"the recorder's thread failed: {type(exc).__name__}: {exc}"
            self.log("error", "recording_stopped", error=self.stopped, detail="proxying continues; restart the gateway")
            raise

    def _loop(self) -> None:
        warm = threading.Thread(target=self._warm, name="verinfer-gateway-warm", daemon=True)
        warm.start()
        journaled, waiting, caught_up = journal(self.directory, self.fsync), [], False
        synced = time.monotonic()
        while True:
            try:
                ex = self.queue.get(timeout=min(SYNC_SECONDS, self.shard_seconds / 4))
            except queue.Empty:
                ex = False
            self.counters.queue_depth = self.queue.qsize()
            if ex is None:
                warm.join()
            if not caught_up and (self.ready or self.stopped) and not warm.is_alive():
                if self.ready:
                    self._catch_up(journaled, waiting)
                else:  # never ready: what was journaled stays for a later start; count it
                    self.counters.add(dropped=len(waiting))
                    waiting.clear()
                    with contextlib.suppress(OSError):
                        journaled.sync()
                caught_up = True
            if ex is None:
                if self.stopped and self.resumable:
                    self._resume()
                self._flush(force=True)
                return
            if ex is not False and not caught_up:
                waiting.append(ex)
                try:
                    journaled.write(ex.to_json() + "\n")
                except OSError as exc:
                    self.log("error", "journal_failed", error=str(exc), detail="kept in memory until the recorder is ready")
            elif ex is not False:
                self._take(ex)
            if self.queue.empty() or time.monotonic() - synced >= SYNC_SECONDS:
                with contextlib.suppress(OSError):
                    journaled.sync()
                self._each(ShardWriter.sync)
                synced = time.monotonic()
            self._flush(force=False)
            if self.stopped and self.resumable and time.monotonic() - self.stopped_at >= RESUME_SECONDS:
                self._resume()

    def _take(self, ex: Exchange, skip: set[str] = frozenset()) -> bool:
        """Parse and write one exchange; False when every trace it yields is in ``skip`` (already sealed)."""
        try:
            recorded = record(ex, self.recording)
        except Unrecordable as exc:
            self.counters.add(unrecordable=1)
            self.log("warning", "unrecordable", request_id=ex.request_id, reason=str(exc))
            return True
        except Exception as exc:  # a bug here must not stop the writer; the exchange is counted
            self.counters.add(unrecordable=1)
            self.log("error", "unrecordable", request_id=ex.request_id, reason=f"{type(exc).__name__}: {exc}")
            return True
        fresh = [[t for t in part if t.id not in skip] for part in (recorded.traces, recorded.unverifiable)]
        if skip and (recorded.traces or recorded.unverifiable) and not any(fresh):
            return False
        if self.stopped:
            self.counters.add(dropped=sum(map(len, fresh)))
            return True
        for writer, traces in zip((self.shards, self.aside), fresh):
            try:
                writer.add(traces)
            except Exception as exc:  # OSError (ENOSPC, EACCES) on the write-ahead file
                self._stop(writer, exc, len(traces))
        return True

    def _each(self, step: Callable[[ShardWriter], object]) -> None:
        for writer in (self.shards, self.aside):
            if self.stopped:
                return
            try:
                step(writer)
            except Exception as exc:
                self._stop(writer, exc, 0)

    def _stop(self, writer: ShardWriter, exc: Exception, unbuffered: int) -> None:
        """Recording stops at a write error: what the shard held stays in its write-ahead file."""
        pending = len(writer.buffer) + unbuffered
        shard = writer.path
        self.stopped = f"{writer.directory}: {type(exc).__name__}: {exc}"
        self.resumable, self.stopped_at = True, time.monotonic()
        self.counters.add(write_errors=1, dropped=pending)
        wal = writer.abandon()
        if wal is not None and wal.exists():
            self.abandoned.append((wal, shard))
        self.log("error", "recording_stopped", directory=str(writer.directory), error=str(exc), lost_records=pending,
                 write_ahead_file=str(wal) if wal else None,
                 detail=f"proxying continues; recording resumes by itself once the directory can be written "
                        f"(tried every {RESUME_SECONDS:g} s), sealing the write-ahead file's records into a shard")

    def _resume(self) -> None:
        """After a write error: write a probe into each directory, then seal the write-ahead files the
        error left; recording resumes only when all of that succeeds (else it is tried again later).
        Exchanges answered while stopped were counted ``dropped``; the sealed records count ``recovered``."""
        self.stopped_at = time.monotonic()
        sealed = 0
        try:
            for writer in (self.shards, self.aside):
                probe(writer.directory)
            while self.abandoned:
                wal, shard = self.abandoned[0]
                n = seal(wal, shard, self.shards.write)[0] if wal.exists() else 0
                self.abandoned.pop(0)
                sealed += n
                self.counters.add(recovered=n, shards_written=int(n > 0))
        except Exception as exc:  # still no room (OSError), or pyarrow's wrapping of one
            self.retry_error = f"{type(exc).__name__}: {exc}"
            return
        self.log("warning", "recording_resumed", was=self.stopped, sealed_records=sealed,
                 dropped_total=self.counters.snapshot()["dropped"])
        self.stopped, self.resumable, self.retry_error = None, False, None

    def _flush(self, force: bool) -> None:
        for writer, counter in ((self.shards, "recorded"), (self.aside, "unverifiable")):
            if self.stopped or not (force or writer.due(self.shard_records, self.shard_seconds)):
                continue
            try:
                done = writer.flush()
            except Exception as exc:  # OSError (ENOSPC, EACCES), or pyarrow's wrapping of one
                self._stop(writer, exc, 0)
                continue
            if done:
                self.counters.add(**{counter: done[1], "shards_written": 1})
                self.log("info", "shard_written", path=str(done[0]), records=done[1])
