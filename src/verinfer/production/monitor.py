"""Continuous verification of a trace directory into the verification history (issue #26, part 2).

A monitor finds each finished shard (a ``.jsonl`` / ``.parquet`` file renamed into place; ``*.tmp``
is never looked at: ``verinfer.sharded.find_shards``), verifies it through the one scoring path
(``verinfer.sharded.verify_shard`` -> ``verinfer.api.verify``, or ``verinfer.sharded.run_ray``),
and records per-shard and per-window results (``verinfer.production.store``).

Exactly once, arbitrated by the database: a shard is the unique row ``(path, sha256)``; a monitor
claims it with a conditional UPDATE (pending, or claimed under an expired lease), renews its lease
while it works, and commits the results with ``status='done'`` in one transaction that first checks
it still holds the claim. A monitor killed mid-shard leaves a claim whose lease expires, so the
shard is taken again (its complete scores files, if written, are reused: ``sharded.done_record``);
two monitors never both record one shard.

Windows are fixed buckets of the traces' request times (``meta.request_time``, ISO-8601 UTC; a
trace without one falls in the bucket of its shard's file time) per provider/model/profile. A
window that gets traces from a later shard is recomputed from every shard's scores of its traces,
in request-time order, under a row lock (PostgreSQL ``FOR UPDATE``; SQLite's write lock), so it is
judged over all its tokens and never double-counts.

Verdicts come from the one verdict rule (``verinfer.stats``): with a calibration file, its
calibrated flags (as ``verinfer verify --calibration``); without one, the shipped calibration
``verinfer verify`` would use for the traces' signature (``verinfer.stats.shipped``: seeded traffic
of the bundled model at the shipped settings), else the shipped bands when they exist (as
``verinfer audit``: greedy traffic on the bundled model); otherwise the result is recorded
uncalibrated (statistics, no verdict, and a note saying why and how to fit one). ``judged_by``
names what judged each window.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.exc import OperationalError

from verinfer import sharded
from verinfer.models.load import file_sha256 as sha256
from verinfer.production.budget import Budget
from verinfer.production.store import (AuditResult, AuditRun, Key, Shard, ShardResult, Store, Window, WindowTrace,
                                       advance_stream, dialect_insert, timeline, utcnow)
from verinfer.scoring.scores import read_scores, read_signature, signature
from verinfer.stats.calibration import Calibrator, signature_mismatch
from verinfer.stats.pooling import sequence_stats
from verinfer.stats.shipped import find_calibration, no_default
from verinfer.stats.summary import UNCALIBRATED, summarize, token_statistics
from verinfer.stats.verdict import Verdict, pooled_verdict, token_detector
from verinfer.trace import Trace, read_traces

log = logging.getLogger("verinfer.monitor")

REQUEST_TIME = "request_time"  # the meta field the gateway writes (ISO-8601 UTC)
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_ALPHA = 0.01
RAY_BATCH = 64  # shards claimed at once with --ray (each batch starts a local cluster: sharded.run_ray)
# greedy decoding takes the argmax, whatever top-k / top-p / min-p a request also sent: its bands are these
GREEDY = {"profile": "greedy", "temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}


def parse_duration(text: str, what: str = "--window", unit: str = "s") -> int:
    """``90s``, ``10m``, ``1h``, ``1d`` (a bare number in ``unit``) -> seconds."""
    m = re.fullmatch(r"\s*(\d+)\s*([smhd]?)\s*", str(text))
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"{what} {text!r}: expected a positive duration such as 90s, 10m, 1h or 1d")
    return int(m.group(1)) * UNITS[m.group(2) or unit]


def as_utc(value: dt.datetime) -> dt.datetime:
    """Naive UTC, as the store keeps every time (a naive input is taken as UTC)."""
    return value.astimezone(dt.timezone.utc).replace(tzinfo=None) if value.tzinfo else value


def request_time(trace: Trace, where: str, fallback: dt.datetime) -> dt.datetime:
    """The trace's request time (``meta.request_time``), or ``fallback`` when it records none."""
    value = (trace.meta or {}).get(REQUEST_TIME)
    if value is None:
        return fallback
    try:
        return as_utc(dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")))
    except ValueError:
        raise ValueError(f"{where}: trace {trace.id!r}: meta.{REQUEST_TIME} {value!r} is not an ISO-8601 time") from None


def window_start(t: dt.datetime, seconds: int) -> dt.datetime:
    """The start of the fixed ``seconds`` bucket (aligned to the Unix epoch) holding ``t``."""
    epoch = int((t - dt.datetime(1970, 1, 1)).total_seconds() // seconds) * seconds
    return dt.datetime(1970, 1, 1) + dt.timedelta(seconds=epoch)


# --------------------------------------------------------------------------------------------------
# judging: the one verdict rule, with a calibration, shipped bands, or none


@dataclass
class Judge:
    """How a set of per-token scores becomes a recorded result."""

    calibrator: Calibrator | None = None
    source: str = ""  # the calibration file
    alpha: float = DEFAULT_ALPHA
    defaults: bool = True  # without a calibration, use the shipped calibrations, then bands, that fit

    def __call__(self, columns: dict[str, np.ndarray], sig: dict) -> dict[str, Any]:
        """Statistics and, when a calibration (given, else the shipped one ``verify`` would use) or
        shipped bands fit ``sig``, the verdict of ``columns``; ``judged_by`` names which."""
        stats = token_statistics(columns)
        out: dict[str, Any] = dict(traces=stats["traces"], tokens=stats["tokens"],
                                   exact_match_rate=stats["exact_match_rate"], mean_margin=stats["mean_margin"],
                                   verdict=None, p_value=None, tokens_needed=None, flags=None, batches=None,
                                   first_flagged=None, judged_by=None, note=UNCALIBRATED)
        calibrator, source = self.calibrator, self.source
        if calibrator is None and self.defaults:
            shipped = find_calibration(sig)
            if shipped is not None:
                calibrator, source = _shipped(shipped), f"{shipped.name} (shipped default)"
        if calibrator is not None:
            verdict, first = self._calibrated(columns, sig, out, calibrator, source)
        else:
            verdict, first = self._banded(columns, sig, out)
        if verdict is not None:
            out.update(verdict=verdict.label, p_value=verdict.p_value, tokens_needed=verdict.tokens_needed,
                       flags=verdict.flagged, batches=verdict.units if verdict.unit == "batch" else None,
                       first_flagged=first, note=verdict.text)
        return out

    def _calibrated(self, columns, sig, out, calibrator: Calibrator, source: str) -> tuple[Verdict | None, str | None]:
        problem = signature_mismatch(calibrator.signature, sig)
        if problem:
            out["note"] = f"no verdict: the calibration ({source}) does not match these traces: {problem}"
            return None, None
        summary = summarize(columns, calibrator, alpha=self.alpha)
        if summary.verdict is None:
            out["note"] = summary.note
            return None, None
        out["judged_by"] = f"calibration {source}"
        v = summary.verdict
        metric, rule = token_detector(calibrator)
        flags = calibrator.predict(np.asarray(columns["margin"], dtype=np.float64), v.batch_size,
                                        metric=metric, rule=rule)
        first = str(columns["trace_id"][int(np.argmax(flags)) * v.batch_size]) if flags.any() else None
        return v, first

    def _banded(self, columns, sig, out) -> tuple[Verdict | None, str | None]:
        from verinfer.auditing.bands import bands_filename, find_bands

        samplings = [GREEDY if s.get("profile") == "greedy" else s for s in sig["sampling"]]
        bands = find_bands(sig["model"], samplings[0]) if self.defaults and len(samplings) == 1 else None
        if bands is None or bands.data.get("reference_dtype", "float32") != sig["dtype"]:
            which = bands_filename(sig["model"], samplings[0]) if len(samplings) == 1 else "one sampling setting"
            out["note"] = (f"{UNCALIBRATED} (no shipped bands for these traces: {which}); "
                           f"{no_default(sig).removeprefix('uncalibrated: ')}")
            return None, None
        seq = sequence_stats(columns, bands.clip)
        v = pooled_verdict(seq, bands.honest_bands(), self.alpha, all_bands=bands.labelled(),
                           source=Path(bands.source).name, clip=bands.clip)
        out["judged_by"] = f"bands {Path(bands.source).name}"
        first = None
        if v.tokens_needed is not None and not v.consistent:
            ids = list(dict.fromkeys(str(t) for t in columns["trace_id"]))  # sequence_stats' order
            first = ids[int(np.searchsorted(np.cumsum(seq[:, 0]), v.tokens_needed))]
        return v, first


@functools.lru_cache(maxsize=None)
def _shipped(path: Path) -> Calibrator:
    """A shipped calibration, loaded once per process (every window of its streams uses it)."""
    return Calibrator.load(path)


# --------------------------------------------------------------------------------------------------
# one shard's traces, grouped by provider/model/profile and window


def key_of(trace: Trace, seconds: int) -> Key:
    """The stream a trace's window belongs to (``seconds``: the window length)."""
    return Key(trace.provider or "unknown", trace.model, trace.sampling.profile, seconds)


@dataclass
class ShardTraces:
    """A verified shard's per-token scores with each trace's group, window and request time."""

    columns: dict[str, np.ndarray]
    traces: list[Trace]  # the verified ones (all, unless the monitor samples: ``budget``)
    times: dict[str, dt.datetime]
    verifier: dict  # the score file's signature: the verifier's model and dtype
    unverified: list[Trace] = field(default_factory=list)  # recorded, not chosen for verification
    sample: float | None = None  # the fraction it was verified at (its score record's; None: every trace)

    def select(self, ids: set[str]) -> dict[str, np.ndarray]:
        mask = np.isin(self.columns["trace_id"], list(ids))
        return {k: v[mask] for k, v in self.columns.items()}

    def groups(self, seconds: int) -> dict[Key, list[Trace]]:
        out: dict[Key, list[Trace]] = {}
        for t in self.traces:
            out.setdefault(key_of(t, seconds), []).append(t)
        return out


def per_trace(columns: dict[str, np.ndarray]) -> dict[str, tuple[int, int, float]]:
    """Each trace's (tokens, exact matches, mean clipped margin), from its per-token scores."""
    stats = sequence_stats(columns)
    ids = list(dict.fromkeys(str(t) for t in columns["trace_id"]))
    return {i: (int(n), int(e), float(s / max(n, 1))) for i, (n, s, e) in zip(ids, stats)}


def ordered(parts: Sequence[tuple[dict[str, np.ndarray], dict[str, dt.datetime]]]) -> dict[str, np.ndarray]:
    """Concatenate score columns with their tokens ordered by each trace's (request time, id), so a
    window's verdict is the same whichever shard arrived first."""
    cols = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
    times = {t: at for _, part_times in parts for t, at in part_times.items()}
    rank_of = {t: r for r, t in enumerate(sorted(times, key=lambda t: (times[t], t)))}
    order = np.argsort(np.array([rank_of[str(t)] for t in cols["trace_id"]], dtype=np.int64), kind="stable")
    return {k: v[order] for k, v in cols.items()}


JUDGED = ("trace_id", "margin", "cross_entropy", "exact_match")  # the score columns a verdict reads


@functools.lru_cache(maxsize=16)
def _scores(path: str, mtime_ns: int) -> dict[str, np.ndarray]:
    return {k: v for k, v in read_scores(path).items() if k in JUDGED}


def cached_scores(path: str) -> dict[str, np.ndarray]:
    """The judged columns of a shard's score file, read once per version (a window re-reads its shards
    whenever a later shard adds traces to it); 16 files at most are held."""
    return _scores(path, os.stat(path).st_mtime_ns)


# --------------------------------------------------------------------------------------------------
# the monitor


class LeaseLost(Exception):
    """Another monitor took this shard over (its lease had expired); this result is dropped."""


@dataclass
class Outcome:
    """What one pass did (for logs, ``--once`` and tests)."""

    found: int = 0
    verified: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # one line each
    dropped: list[str] = field(default_factory=list)  # lease lost: another monitor recorded it
    verdicts: list[str | None] = field(default_factory=list)  # of the windows this pass touched


class Monitor:
    """Watches ``directory`` and records into ``store``; one process, any number beside it."""

    def __init__(self, directory: str | Path, store: Store, *, out_dir: str | Path | None = None,
                 judge: Judge | None = None, window_s: int = 600, model: str | None = None,
                 dtype: str = "float32", device: str = "cpu", reference: str = "transformers",
                 lease_s: float = 120.0, max_attempts: int = 3,
                 use_ray: bool = False, workers: int | None = None, backend=None,
                 on_event: Callable[[str, dict], None] | None = None, budget: Budget | None = None,
                 retain_shards_s: float | None = None, retain_history_s: float | None = None,
                 keep_up: bool = False):
        self.directory = Path(directory).resolve()
        if not self.directory.is_dir():
            raise ValueError(f"{directory}: not a directory")
        self.store, self.judge, self.window_s = store, judge or Judge(), window_s
        if keep_up and budget is None:
            budget = Budget()
        self.budget = budget if budget is not None and (budget.fraction < 1 or keep_up) else None
        self.keep_up = keep_up  # thin each shard's fraction by the backlog behind it (Budget.thinned)
        self.fraction_now = self.budget.fraction if self.budget else 1.0  # the last shard's (``--keep-up``)
        for name, value in (("--retain-shards", retain_shards_s), ("--retain-history", retain_history_s)):
            if value is not None and value < 2 * window_s:  # a window still filling reads its shards' scores
                raise ValueError(f"{name} must be at least two windows ({2 * window_s} s), got {value:g} s")
        if retain_shards_s is not None and retain_history_s is not None and retain_history_s < retain_shards_s:
            raise ValueError("--retain-history must be at least --retain-shards (a shard's row outlives its files)")
        self.retain_shards_s, self.retain_history_s = retain_shards_s, retain_history_s
        self.out_dir = Path(out_dir) if out_dir else Path(f"{self.directory}.verinfer")
        self.model, self.dtype, self.device, self.backend = model, dtype, device, backend
        if reference != "transformers":
            from verinfer.models.vllm_backend import check_with_ray

            check_with_ray(use_ray, reference)
        self.reference = reference  # load_model's backend: transformers, or vllm[:KEY=VALUE,...]
        self.lease = dt.timedelta(seconds=lease_s)
        self.max_attempts, self.use_ray, self.workers = max_attempts, use_ray, workers
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.on_event = on_event or (lambda event, fields: None)
        self._known: dict[tuple[str, int, int], str] = {}
        self._beat = threading.Event()
        self.stop = threading.Event()  # set (e.g. on SIGTERM): finish the shard at hand, then return

    # -- finding shards ------------------------------------------------------------------------------

    def _insert(self, table):
        return dialect_insert(self.store.dialect, table)

    def scan(self) -> int:
        """Register every finished shard not registered yet (unique path + sha256); how many were new."""
        try:
            files = sharded.find_shards(self.directory)
        except ValueError:
            return 0
        new = 0
        for path in files:
            try:
                st = path.stat()
            except OSError:
                continue  # removed while listing
            key = (str(path), st.st_size, st.st_mtime_ns)
            if key in self._known:
                continue
            digest = sha256(path)
            with self.store.transaction() as s:
                new += len(s.execute(self._insert(Shard).values(
                    path=str(path), sha256=digest, bytes=st.st_size, status="pending", attempts=0,
                    discovered_at=utcnow()).on_conflict_do_nothing(index_elements=["path", "sha256"])
                    .returning(Shard.id)).all())
            self._known[key] = digest
        return new

    def claim(self, limit: int = 1) -> list[Shard]:
        """Claim up to ``limit`` shards: pending ones, then claims whose lease expired (a monitor died)."""
        now = utcnow()
        takeable = or_(Shard.status == "pending", and_(Shard.status == "claimed", Shard.lease_until < now))
        with self.store.transaction() as s:
            s.execute(update(Shard).where(Shard.status == "claimed", Shard.lease_until < now,
                                          Shard.attempts >= self.max_attempts).values(
                status="failed", finished_at=now, lease_until=None,
                error=f"abandoned: {self.max_attempts} claims expired without a result (did the monitor crash on it?)"))
            ids = s.scalars(select(Shard.id).where(takeable).order_by(Shard.id).limit(limit)).all()
        claimed = []
        for shard_id in ids:
            with self.store.transaction() as s:
                got = s.execute(update(Shard).where(Shard.id == shard_id, takeable).values(
                    status="claimed", owner=self.owner, lease_until=now + self.lease,
                    attempts=Shard.attempts + 1)).rowcount
                if got == 1:
                    claimed.append(s.get(Shard, shard_id))
        return claimed

    def renew(self) -> None:
        """Extend the lease of every shard this monitor holds."""
        with self.store.transaction() as s:
            s.execute(update(Shard).where(Shard.owner == self.owner, Shard.status == "claimed")
                      .values(lease_until=utcnow() + self.lease))

    def _heartbeat(self) -> None:
        while not self._beat.wait(self.lease.total_seconds() / 3):
            try:
                self.renew()
            except OperationalError as exc:  # a busy database: the next beat tries again
                log.warning("lease renewal failed: %s", str(exc).splitlines()[0])

    # -- verifying --------------------------------------------------------------------------------

    def _backend(self, model: str):
        if self.backend is None or self.backend.model_id != model:
            from verinfer.api import load_model

            self.backend = load_model(model, self.dtype, self.device, self.reference)
        return self.backend

    def shard_budget(self) -> Budget | None:
        """The budget for the next shard: ``--sample``'s, thinned by the shards waiting (``--keep-up``)."""
        if self.budget is None or not self.keep_up:
            return self.budget
        with self.store.transaction() as s:
            waiting = s.scalar(select(func.count()).select_from(Shard).where(Shard.status == "pending")) or 0
        budget = self.budget.thinned(waiting)
        self.fraction_now = budget.fraction
        return budget

    def _verify_local(self, path: Path, budget: Budget | None) -> None:
        """Scores for the shard's current bytes in ``out_dir`` (reused when a killed claim wrote them)."""
        record = sharded.done_record(self.out_dir, path)
        model = self.model or read_traces(path)[0].model
        backend = self._backend(model)
        if record is None or (record.get("signature") or {}).get("model", backend.model_id) != backend.model_id:
            sharded.verify_shard(path, self.out_dir, backend, sample=budget)

    def load(self, path: Path) -> ShardTraces:
        """A verified shard's traces (with request times) and per-token scores."""
        traces = read_traces(path)
        fallback = as_utc(dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc))
        times = {t.id: request_time(t, str(path), fallback) for t in traces}
        scores = sharded.ShardFiles.of(self.out_dir, path).scores
        columns = read_scores(scores)
        scored = set(columns["trace_id"].tolist())
        record = sharded.done_record(self.out_dir, path) or {}
        return ShardTraces(columns, [t for t in traces if t.id in scored], times, read_signature(scores) or
                           {"model": self.model or traces[0].model, "dtype": self.dtype},
                           [t for t in traces if t.id not in scored], record.get("sample"))

    def process(self, shard: Shard, verify: bool = True, budget: Budget | None = None) -> tuple[str, list[str | None]]:
        """Verify (unless ``verify`` is False: scores already written) and record one claimed shard, the
        traces ``budget`` chooses (``shard_budget``)."""
        path = Path(shard.path)
        started = time.perf_counter()
        try:
            if not path.is_file():
                raise ValueError(f"{path}: no such file (removed before it was verified)")
            if sha256(path) != shard.sha256:
                raise ValueError(f"{path}: changed since it was found (a finished shard must not be rewritten)")
            if verify:
                self._verify_local(path, budget)
            data = self.load(path)
        except (ValueError, OSError) as exc:
            self.fail(shard, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return "failed", []
        return self.record(shard, data, time.perf_counter() - started)

    def fail(self, shard: Shard, error: str) -> bool:
        """Record the shard as failed with its one-line error (kept: the same bytes are not retried)."""
        with self.store.transaction() as s:
            got = s.execute(update(Shard).where(Shard.id == shard.id, Shard.owner == self.owner,
                                                Shard.status == "claimed").values(
                status="failed", error=error, finished_at=utcnow(), lease_until=None)).rowcount
        self.on_event("failed", {"shard": shard.path, "error": error})
        return got == 1

    # -- recording ----------------------------------------------------------------------------------

    def record(self, shard: Shard, data: ShardTraces, verify_s: float, retries: int = 5) -> tuple[str, list]:
        """Shard results, window traces and recomputed windows, with ``done``, in one transaction."""
        for attempt in range(retries):
            try:
                with self.store.transaction() as s:
                    verdicts = self._record(s, shard, data, verify_s)
                self.on_event("verified", {"shard": shard.path, "tokens": int(data.columns["margin"].size),
                                           "verify_s": round(verify_s, 3), "windows": verdicts})
                return "verified", verdicts
            except LeaseLost:
                self.on_event("dropped", {"shard": shard.path})
                return "dropped", []
            except OperationalError as exc:  # deadlock or a busy database: the transaction was rolled back
                if attempt == retries - 1:
                    raise
                log.warning("recording %s: %s; retrying", shard.path, str(exc).splitlines()[0])
                time.sleep(0.2 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _record(self, s, shard: Shard, data: ShardTraces, verify_s: float) -> list[str | None]:
        tokens = int(data.columns["margin"].size)
        got = s.execute(update(Shard).where(Shard.id == shard.id, Shard.owner == self.owner,
                                            Shard.status == "claimed").values(
            status="done", finished_at=utcnow(), lease_until=None, traces=len(data.traces), tokens=tokens,
            offered=len(data.traces) + len(data.unverified), sample=data.sample,
            verify_s=verify_s, error=None,
            scores_path=str(sharded.ShardFiles.of(self.out_dir, Path(shard.path)).scores))).rowcount
        if got != 1:
            raise LeaseLost()
        trace_stats = per_trace(data.columns) if data.traces else {}  # none chosen by the budget: no scores
        buckets: dict[tuple[Key, dt.datetime], list[Trace]] = {}
        for key, traces in data.groups(self.window_s).items():
            sig = signature(traces, data.verifier["model"], data.verifier["dtype"],
                            data.verifier.get("reference", "transformers"))
            s.add(ShardResult(shard_id=shard.id, signature=json.dumps(sig, sort_keys=True), provider=key.provider,
                              model=key.model, profile=key.profile,
                              **self.judge(data.select({t.id for t in traces}), sig)))
            for t in traces:
                buckets.setdefault((key, window_start(data.times[t.id], self.window_s)), []).append(t)
        offered: dict[tuple[Key, dt.datetime], int] = {}  # every recorded trace, verified or not (``budget``)
        for t in data.traces + data.unverified:
            bucket = (key_of(t, self.window_s), window_start(data.times[t.id], self.window_s))
            buckets.setdefault(bucket, [])
            offered[bucket] = offered.get(bucket, 0) + 1
        verdicts, windows = [], []
        added: dict[Key, list[int]] = {}  # per stream: new windows, change in tokens (its totals' counters)
        sorted_buckets = sorted(buckets, key=lambda b: (b[0].provider, b[0].model, b[0].profile, b[1]))
        for (key, start) in sorted_buckets:
            window = self._lock_window(s, key, start)
            windows.append(window)
            new, before = window.computed == 0, window.tokens
            s.add_all([WindowTrace(window_id=window.id, shard_id=shard.id, trace_id=t.id,
                                   request_time=data.times[t.id], tokens=trace_stats[t.id][0],
                                   exact_matches=trace_stats[t.id][1], mean_margin=trace_stats[t.id][2])
                       for t in buckets[(key, start)]])
            s.flush()
            window.offered = (window.offered or 0) + offered[(key, start)]
            self._recompute(s, window)
            delta = added.setdefault(key, [0, 0])
            delta[0], delta[1] = delta[0] + new, delta[1] + window.tokens - before
            verdicts.append(window.verdict)
        newest: dict[Key, Window] = {}
        for (key, start), window in zip(sorted_buckets, windows):
            newest[key] = window  # sorted by start within a key: the last is the newest
        for key in sorted(newest, key=lambda k: (k.provider, k.model, k.profile)):
            advance_stream(s, newest[key], *added[key])  # locked after the windows: one lock order
        return verdicts

    def _lock_window(self, s, key: Key, start: dt.datetime) -> Window:
        """The window row, created if new, locked until this transaction ends."""
        now = utcnow()
        s.execute(self._insert(Window).values(
            provider=key.provider, model=key.model, profile=key.profile, seconds=key.seconds, start_time=start,
            end_time=start + dt.timedelta(seconds=key.seconds), shards=0, computed=0, traces=0, tokens=0,
            offered=0, updated_at=now).on_conflict_do_nothing(
            index_elements=["provider", "model", "profile", "seconds", "start_time"]))
        return s.scalars(timeline(key, start, start).with_for_update()).one()

    def _recompute(self, s, window: Window) -> None:
        """Judge the window over every token of every trace it holds, from all its shards."""
        rows = s.execute(select(WindowTrace.trace_id, WindowTrace.request_time, WindowTrace.shard_id,
                                Shard.scores_path).join(Shard, Shard.id == WindowTrace.shard_id)
                         .where(WindowTrace.window_id == window.id)).all()
        if not rows:  # every trace it received so far was left out by the budget
            window.note = (f"not verified: none of its {window.offered} traces was chosen for verification "
                           f"(--sample {self.budget.fraction:g})" if self.budget else "not verified: no scored traces")
            window.computed, window.updated_at = window.computed + 1, utcnow()
            return
        by_shard: dict[int, tuple[str, dict[str, dt.datetime]]] = {}
        for trace_id, at, shard_id, scores_path in rows:
            by_shard.setdefault(shard_id, (scores_path, {}))[1][trace_id] = at
        parts = []
        for scores_path, times in by_shard.values():
            cols = cached_scores(scores_path)
            mask = np.isin(cols["trace_id"], list(times))
            parts.append(({k: v[mask] for k, v in cols.items()}, times))
        sigs = [json.loads(x) for x in s.scalars(select(ShardResult.signature).where(
            ShardResult.shard_id.in_(list(by_shard)), ShardResult.provider == window.provider,
            ShardResult.model == window.model, ShardResult.profile == window.profile)).all()]
        samplings = sorted({json.dumps(p, sort_keys=True) for sig in sigs for p in sig["sampling"]})
        sig = {"model": sigs[0]["model"], "dtype": sigs[0]["dtype"], "sampling": [json.loads(p) for p in samplings]}
        for name, value in self.judge(ordered(parts), sig).items():
            setattr(window, name, value)
        window.shards, window.computed, window.updated_at = len(by_shard), window.computed + 1, utcnow()

    # -- passes -------------------------------------------------------------------------------------

    def run_once(self, limit: int | None = None) -> Outcome:
        """Register new shards, then verify and record claimable ones until none is left (or ``limit``)."""
        outcome = Outcome(found=self.scan())
        beat = threading.Thread(target=self._heartbeat, daemon=True, name="verinfer-monitor-lease")
        self._beat.clear()
        beat.start()
        try:
            while not self.stop.is_set() and (limit is None or len(outcome.verified) + len(outcome.failed) < limit):
                batch = self.claim(RAY_BATCH if self.use_ray else 1)  # one Ray cluster per batch
                if not batch:
                    break
                if self.use_ray:
                    self._ray_batch(batch, outcome)
                else:
                    for shard in batch:
                        self._tally(outcome, shard, *self.process(shard, budget=self.shard_budget()))
        finally:
            self._beat.set()
            beat.join()
        if self.retain_shards_s is not None or self.retain_history_s is not None:
            self.prune()
        return outcome

    def _tally(self, outcome: Outcome, shard: Shard, status: str, verdicts: list) -> None:
        {"verified": outcome.verified, "failed": outcome.failed, "dropped": outcome.dropped}[status].append(shard.path)
        outcome.verdicts += verdicts

    def _ray_batch(self, batch: list[Shard], outcome: Outcome) -> None:
        """Verify a batch of claimed shards on Ray (``sharded.run_ray``), recording each as it finishes
        (one budget for the batch: the ``--sample`` key travels to the Ray actors)."""
        by_path = {shard.path: shard for shard in batch}
        budget = self.shard_budget()
        model = self.model or _claimed_model(batch)
        errors: dict[str, str] = {}

        def finished(row: dict) -> None:
            shard = by_path[str(row["shard"])]
            if row["error"]:
                errors[shard.path] = row["error"]
                self.fail(shard, str(row["error"]).splitlines()[0])
                self._tally(outcome, shard, "failed", [])
            else:
                self._tally(outcome, shard, *self.process(shard, verify=False))

        result = sharded.run_ray([Path(p) for p in by_path], self.out_dir, model, self.dtype,
                                 workers=self.workers, on_shard=finished,
                                 sample=budget)
        for path in result.resumed:  # scores already complete for these bytes (an earlier claim's)
            self._tally(outcome, by_path[path], *self.process(by_path[path], verify=False))

    # -- retention ------------------------------------------------------------------------------------

    def prune(self, now: dt.datetime | None = None) -> dict[str, int]:
        """Retention, after each pass. ``retain_shards_s``: the files of shards verified (or failed) longer
        ago, and their score files, are deleted (the rows stay, marked ``files_deleted_at``, so the path is
        never taken for a new shard; the drill-down says the tokens are gone); so are the gateway's
        ``unverifiable/`` shards older than that (never verified: by file time). ``retain_history_s``:
        windows that ended, audits run and shard rows whose files are gone, longer ago, are deleted
        (with their traces and results). A shard not yet verified is never deleted."""
        now = now or utcnow()
        out = {"shard_files_deleted": 0, "unverifiable_deleted": 0, "windows_deleted": 0, "shard_rows_deleted": 0,
               "audit_runs_deleted": 0}
        if self.retain_shards_s is not None:
            cutoff = now - dt.timedelta(seconds=self.retain_shards_s)
            with self.store.transaction() as s:
                old = s.execute(select(Shard.id, Shard.path).where(
                    Shard.status.in_(("done", "failed")), Shard.finished_at < cutoff,
                    Shard.files_deleted_at.is_(None))).all()
            for shard_id, path in old:
                files = sharded.ShardFiles.of(self.out_dir, Path(path))
                for f in (Path(path), files.scores, files.commits, files.record):
                    f.unlink(missing_ok=True)
                with self.store.transaction() as s:
                    s.execute(update(Shard).where(Shard.id == shard_id).values(files_deleted_at=now))
                out["shard_files_deleted"] += 1
            aside = self.directory / "unverifiable"
            for f in sorted(aside.glob("*.parquet")) if aside.is_dir() else []:
                with contextlib.suppress(OSError):
                    if f.stat().st_mtime < cutoff.replace(tzinfo=dt.timezone.utc).timestamp():
                        f.unlink()
                        out["unverifiable_deleted"] += 1
        if self.retain_history_s is not None:
            cutoff = now - dt.timedelta(seconds=self.retain_history_s)
            with self.store.transaction() as s:
                out["windows_deleted"] = s.execute(delete(Window).where(Window.end_time < cutoff)).rowcount
                out["shard_rows_deleted"] = s.execute(delete(Shard).where(
                    Shard.finished_at < cutoff, Shard.files_deleted_at.is_not(None))).rowcount
                out["audit_runs_deleted"] = s.execute(delete(AuditRun).where(AuditRun.slot < cutoff)).rowcount
        if any(out.values()):
            self.on_event("pruned", out)
        return out

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health`` of ``--metrics-port``: 200 with the backlog while the database answers, else 503."""
        try:
            with self.store.transaction() as s:
                pending = s.scalar(select(func.count()).select_from(Shard).where(
                    Shard.status.in_(("pending", "claimed"))))
        except Exception as exc:  # SQLAlchemyError or the driver's own: the monitor cannot record
            return 503, {"status": "database_unreachable", "owner": self.owner,
                         "reasons": [f"the database cannot be read: {type(exc).__name__}: {str(exc).splitlines()[0]}"]}
        return 200, {"status": "ok", "owner": self.owner, "backlog_shards": pending, "reasons": [],
                     "sample": self.fraction_now}

    def run(self, poll_s: float = 10.0, audits: "AuditSchedule | None" = None) -> None:
        """Pass after pass until ``self.stop`` is set (a pass finishes the shard it is on first)."""
        while not self.stop.is_set():
            if audits is not None:
                audits.maybe_run(self.store, self.owner)
            self.run_once()
            self.stop.wait(poll_s)


def _claimed_model(batch: list[Shard]) -> str:
    for shard in batch:
        try:
            return read_traces(shard.path)[0].model
        except (ValueError, OSError):
            continue
    from verinfer.models.load import DEFAULT_MODEL

    return DEFAULT_MODEL


# --------------------------------------------------------------------------------------------------
# scheduled external audits


@dataclass
class AuditSchedule:
    """``verinfer.api.audit`` of a providers file every ``every_s`` seconds, into the same history.

    Each slot (a multiple of ``every_s`` since the epoch) is claimed by one monitor through the unique
    ``audit_runs.slot``; a monitor killed during an audit leaves that slot ``running`` (not retried:
    the next slot audits again)."""

    providers_file: Path
    every_s: int
    out_dir: Path
    options: dict = field(default_factory=dict)  # further keyword arguments of verinfer.api.audit

    def due_slot(self, now: dt.datetime) -> dt.datetime:
        return window_start(now, self.every_s)

    def maybe_run(self, store: Store, owner: str, now: dt.datetime | None = None) -> int | None:
        """Run this slot's audit if no monitor has; the run's id, or None."""
        from verinfer.auditing.client import endpoints_from_file

        slot = self.due_slot(now or utcnow())
        out = self.out_dir / f"audit-{slot:%Y%m%dT%H%M%SZ}"
        insert = dialect_insert(store.dialect, AuditRun)
        with store.transaction() as s:
            run_id = s.scalars(insert.values(slot=slot, owner=owner, status="running", started_at=utcnow(),
                                             out_dir=str(out)).on_conflict_do_nothing(index_elements=["slot"])
                               .returning(AuditRun.id)).first()
        if run_id is None:
            return None
        try:
            from verinfer import api

            endpoints = endpoints_from_file(self.providers_file, self.options.get("model") or "smollm2-135m",
                                            self.options.get("api_key_env", "OPENAI_API_KEY"))
            result = api.audit(endpoints, out=out, **{k: v for k, v in self.options.items()
                                                      if k not in ("model", "api_key_env")})
        except Exception as exc:  # noqa: BLE001 - any failure is recorded on the run; the monitor goes on
            with store.transaction() as s:
                s.execute(update(AuditRun).where(AuditRun.id == run_id).values(
                    status="failed", finished_at=utcnow(), error=f"{type(exc).__name__}: {exc}".splitlines()[0]))
            log.warning("scheduled audit %s failed: %s", slot, exc)
            return run_id
        at = utcnow()
        with store.transaction() as s:
            for p in result.providers:
                v = p.verdict
                stats = token_statistics(p.columns) if len(p.columns.get("margin", ())) else {}
                s.add(AuditResult(
                    run_id=run_id, url=p.endpoint.base_url, mode=result.spec.mode, at=at,
                    report=str(result.reports[1]) if result.reports else None, provider=p.endpoint.name,
                    model=p.endpoint.model, profile=result.spec.profile if result.spec.mode != "greedy" else "greedy",
                    traces=len(p.claims), tokens=v.tokens, exact_match_rate=stats.get("exact_match_rate"),
                    mean_margin=stats.get("mean_margin"), verdict=v.label,
                    p_value=v.p_adjusted if v.p_adjusted is not None else v.p_value, tokens_needed=v.tokens_needed,
                    flags=v.flagged, batches=v.units if v.unit == "batch" else None, first_flagged=None,
                    judged_by=Path(result.bands.source).name if result.bands else "calibration", note=v.text))
            s.execute(update(AuditRun).where(AuditRun.id == run_id).values(status="done", finished_at=at))
        return run_id


__all__ = ["AuditSchedule", "Judge", "Monitor", "Outcome", "parse_duration", "request_time", "window_start"]
