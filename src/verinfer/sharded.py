"""Verification of many trace shards, resumable, in one process or on a Ray cluster (issue #16).

A trace set too large for one file comes as shards: a directory or glob of ``.jsonl`` / ``.parquet``
trace files. Each shard is verified by ``verinfer.api.verify`` (the one scoring path) into
``<out>/<shard file name>.scores.parquet`` (and ``.commits.parquet`` when it has activation
commits), both written atomically; then ``<shard file name>.done.json`` records the shard's SHA-256,
its summary and its verification signature. A shard whose record matches its current bytes is not
verified again, so a run that stops (killed, out of time, a worker lost) resumes where it was; a
shard whose file changed is verified again. Nothing is half-written: a score file without its
record is redone, and the temporary files of a run killed mid-write are removed when the next run
starts (``files.remove_stale_temporaries``: their writer's pid no longer runs on this machine).

With Ray (``run_ray``), Ray Data turns the shards to do into a dataset and maps it with an actor
pool of model replicas (``ShardVerifier``: one per GPU when the cluster has GPUs, else one CPU
actor per worker), one shard per call, streaming results back as they finish. Ray Data restarts a
killed actor and retries its shard (its default for actor pools: ``max_restarts=-1``,
``max_task_retries=-1``); since outputs appear only by rename and records are written last, a
retried shard is scored once in the output. A shard that cannot be read (malformed JSON, a bad
token id) is reported with its file and record and the others still finish.

The merged summary (``merge``) pools every shard's per-token scores and judges them with the
calibration by the one verdict rule, exactly as if the traces were one file.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from verinfer.files import missing_input, remove_stale_temporaries, write_atomic
from verinfer.models.load import file_sha256 as sha256
from verinfer.scoring.scores import read_commit_scores, read_scores
from verinfer.stats.calibration import Calibrator, signature_mismatch
from verinfer.stats.summary import Summary, summarize

SUFFIXES = (".jsonl", ".parquet")
RECORD_FORMAT = "verinfer.shard/1"


def find_shards(spec: str | Path) -> list[Path]:
    """Trace shards named by ``spec``: a trace file, a directory (its ``.jsonl`` / ``.parquet`` files,
    not recursive) or a glob pattern; sorted, so every run sees them in one order."""
    path = Path(spec)
    if (missing := missing_input(spec)) is not None:
        raise ValueError(missing)
    if path.is_dir():
        found = [p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES]
    elif path.is_file():
        found = [path]
    else:
        found = [Path(p) for p in glob.glob(str(spec)) if Path(p).is_file() and Path(p).suffix in SUFFIXES]
    if not found:
        raise ValueError(f"{spec}: no trace shards (.jsonl or .parquet files) found")
    return sorted(found)


@dataclass(frozen=True)
class ShardFiles:
    """Where one shard's outputs go in the output directory."""

    scores: Path
    commits: Path
    record: Path

    @classmethod
    def of(cls, out_dir: Path, shard: Path) -> "ShardFiles":
        base = Path(out_dir) / shard.name
        return cls(Path(f"{base}.scores.parquet"), Path(f"{base}.commits.parquet"), Path(f"{base}.done.json"))


def done_record(out_dir: Path, shard: Path) -> dict | None:
    """The shard's record when its outputs are complete and match its current bytes, else None."""
    files = ShardFiles.of(out_dir, shard)
    try:
        record = json.loads(files.record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or record.get("sha256") != sha256(shard):
        return None
    return record if files.scores.exists() else None


class Sample(Protocol):
    """Which traces of a shard to verify (``verinfer.production.budget.Budget``: the monitor's ``--sample``)."""

    fraction: float

    def chosen(self, trace_id: str) -> bool: ...


def verify_shard(shard: Path, out_dir: Path, backend, skip_invalid: bool = False,
                 allow_model_mismatch: bool = False, sample: Sample | None = None) -> dict:
    """Verify one shard into ``out_dir`` (scores, commit scores, then its record, each atomically);
    with ``sample`` only the traces it chooses (the monitor's ``--sample``: the record says how many
    the shard held, ``offered``, and the fraction they were chosen at, ``sample``). None chosen: an
    empty score file, so the shard counts as done."""
    from verinfer import api
    from verinfer.scoring.scores import ScoreWriter
    from verinfer.trace import read_traces

    files = ShardFiles.of(out_dir, shard)
    digest = sha256(shard)
    source: Path | list = shard
    offered = None
    if sample is not None:
        every = read_traces(shard)
        source, offered = [t for t in every if sample.chosen(t.id)], len(every)
    if offered is not None and not source:
        with ScoreWriter(files.scores):
            pass
        record = {"format": RECORD_FORMAT, "shard": str(shard), "sha256": digest, "signature": None, "traces": 0,
                  "tokens": 0, "skipped": [], "commits": None, "commit_scores": None, "offered": offered,
                  "sample": sample.fraction}
    else:
        result = api.verify(source, scores=files.scores, commit_scores_out=files.commits, backend=backend,
                            skip_invalid=skip_invalid, allow_model_mismatch=allow_model_mismatch)
        record = {"format": RECORD_FORMAT, "shard": str(shard), "sha256": digest, "signature": result.scored.signature,
                  "traces": result.summary.traces, "tokens": result.summary.tokens, "skipped": result.skipped,
                  "commits": result.summary.commits,
                  "commit_scores": str(result.scored.commits_path) if result.scored.commits_path else None,
                  "offered": offered if offered is not None else result.summary.traces,
                  "sample": sample.fraction if sample is not None else None}
    write_atomic(files.record, json.dumps(record, default=str))
    return record


@dataclass
class ShardedResult:
    """What a sharded run did and its merged verdict."""

    summary: Summary
    shards: list[Path]
    verified: list[str] = field(default_factory=list)  # shards scored in this run
    resumed: list[str] = field(default_factory=list)  # shards already scored by an earlier run
    errors: list[str] = field(default_factory=list)  # one line per shard that could not be verified
    skipped: list[str] = field(default_factory=list)  # invalid traces skipped inside shards

    @property
    def consistent(self) -> bool | None:
        return False if self.errors else self.summary.consistent

    def to_dict(self) -> dict:
        return {**self.summary.to_dict(), "shards": [str(s) for s in self.shards], "verified": self.verified,
                "resumed": self.resumed, "errors": self.errors, "skipped": self.skipped}


def merge(out_dir: Path, shards: Sequence[Path], calibrator: Calibrator | None = None,
          batch_size: int | None = None, alpha: float | None = None, source: str = "shards") -> Summary:
    """Pool every completed shard's scores into one summary and calibrated verdict.

    Shards must share one verification signature (model, dtype, sampling settings), and match the
    calibration's; commit checks are added up shard by shard."""
    records = [r for r in (done_record(out_dir, s) for s in shards) if r is not None]
    if not records:
        raise ValueError(f"{source}: no shard has been verified")
    signatures = {json.dumps(r["signature"], sort_keys=True) for r in records}
    if len(signatures) > 1:
        raise ValueError(f"{source}: shards were verified under different signatures; verify and calibrate "
                         "each configuration separately")
    if calibrator is not None:
        problem = signature_mismatch(calibrator.signature, records[0]["signature"])
        if problem:
            raise ValueError(f"calibration does not match {source}: {problem}")
    parts = [read_scores(ShardFiles.of(out_dir, Path(r["shard"])).scores) for r in records]
    columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    commit_parts = [read_commit_scores(r["commit_scores"]) for r in records if r.get("commit_scores")]
    commit_scores = ({k: np.concatenate([p[k] for p in commit_parts if k in p])
                      for k in {k for p in commit_parts for k in p}} if commit_parts else None)
    summary = summarize(columns, calibrator, batch_size, None, commit_scores, alpha)
    summary.commits = merge_commits([r.get("commits") or {} for r in records])
    return summary


def merge_commits(parts: Sequence[dict]) -> dict:
    """Add up the per-shard commit summaries (``stats.summary.summarize_commits``)."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    out: dict[str, Any] = {"traces_with_commits": sum(p.get("traces_with_commits", 0) for p in parts),
                           "errors": [e for p in parts for e in p.get("errors", [])]}
    l2 = [p["activation_difr"] for p in parts if "activation_difr" in p]
    if l2:
        n = sum(a["fingerprints"] for a in l2)
        out["activation_difr"] = {"fingerprints": n, "mean_l2": sum(a["mean_l2"] * a["fingerprints"] for a in l2) / n,
                                  "max_l2": max(a["max_l2"] for a in l2)}
    tl = [p["toploc"] for p in parts if "toploc" in p]
    if tl:
        out["toploc"] = {"chunks": sum(t["chunks"] for t in tl), "passed": sum(t["passed"] for t in tl),
                         "failed_traces": [f for t in tl for f in t["failed_traces"]]}
    return out


def _todo(shards: Sequence[Path], out_dir: Path) -> tuple[list[Path], list[str]]:
    """The shards still to verify and those done; the temporaries a killed run left are removed."""
    todo, resumed = [], []
    for s in shards:
        for path in astuple(ShardFiles.of(out_dir, s)):
            remove_stale_temporaries(path)
        (resumed.append(str(s)) if done_record(out_dir, s) is not None else todo.append(s))
    return todo, resumed


def run_local(shards: Sequence[Path], out_dir: Path, backend, skip_invalid: bool = False,
              allow_model_mismatch: bool = False, on_shard: Callable[[dict], None] | None = None) -> ShardedResult:
    """Verify the shards not done yet one after another in this process."""
    out_dir.mkdir(parents=True, exist_ok=True)
    todo, resumed = _todo(shards, out_dir)
    result = ShardedResult(Summary(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0), list(shards), resumed=resumed)
    for shard in todo:
        row = _verify_row(shard, out_dir, backend, skip_invalid, allow_model_mismatch)
        _collect(result, row)
        if on_shard:
            on_shard(row)
    return result


def _verify_row(shard: Path, out_dir: Path, backend, skip_invalid: bool, allow_model_mismatch: bool,
                sample: Sample | None = None) -> dict:
    """One shard as a result row; a shard that cannot be verified gives its one-line error instead."""
    try:
        record = verify_shard(shard, out_dir, backend, skip_invalid, allow_model_mismatch, sample=sample)
    except (ValueError, OSError) as exc:
        return {"shard": str(shard), "error": str(exc), "tokens": 0, "skipped": "[]"}
    return {"shard": str(shard), "error": "", "tokens": int(record["tokens"]), "skipped": json.dumps(record["skipped"])}


def _collect(result: ShardedResult, row: dict) -> None:
    if row["error"]:
        result.errors.append(row["error"])
    else:
        result.verified.append(row["shard"])
        result.skipped += json.loads(row["skipped"])


class ShardVerifier:
    """A Ray Data actor: loads the reference model once, then verifies one shard per call (only the
    traces ``sample`` chooses, when given: the monitor's ``--sample``, its key shipped to the actor)."""

    def __init__(self, out_dir: str, model: str, dtype: str, device: str, threads: int,
                 skip_invalid: bool, allow_model_mismatch: bool, sample: Sample | None = None):
        from verinfer.api import load_model
        from verinfer.machine import use_threads

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        use_threads(threads)
        self.out_dir, self.skip_invalid, self.allow = Path(out_dir), skip_invalid, allow_model_mismatch
        self.sample = sample
        self.backend = load_model(model, dtype, device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        rows = [_verify_row(Path(str(s)), self.out_dir, self.backend, self.skip_invalid, self.allow, self.sample)
                for s in batch["shard"]]
        return {k: [r[k] for r in rows] for k in ("shard", "error", "tokens", "skipped")}


def run_ray(shards: Sequence[Path], out_dir: Path, model: str, dtype: str = "float32", address: str | None = None,
            workers: int | None = None, skip_invalid: bool = False, allow_model_mismatch: bool = False,
            on_shard: Callable[[dict], None] | None = None, verifier: type = ShardVerifier,
            sample: Sample | None = None) -> ShardedResult:
    """Verify the shards not done yet on a Ray cluster (``address``; None: start a local one) with an
    actor pool of ``workers`` model replicas (default: one per GPU, else one per CPU); ``sample`` (picklable)
    as in ``verify_shard``."""
    from verinfer.extras import require

    ray, _ = require("ray", "verinfer.sharded.run_ray")

    out_dir.mkdir(parents=True, exist_ok=True)
    todo, resumed = _todo(shards, out_dir)
    result = ShardedResult(Summary(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0), list(shards), resumed=resumed)
    if not todo:
        return result
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if address is None:
            kwargs.update(num_cpus=workers or os.cpu_count() or 1, object_store_memory=256 * 2**20)
        ray.init(address=address, **kwargs)
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        cpus = int(ray.cluster_resources().get("CPU", 1))
        n = workers or (gpus if gpus else cpus)
        per = {"num_gpus": 1} if gpus else {"num_cpus": 1}
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.from_items([{"shard": str(s)} for s in todo], override_num_blocks=len(todo))
        pool = ray.data.ActorPoolStrategy(size=min(n, len(todo)))
        mapped = ds.map_batches(verifier, batch_size=1, compute=pool, fn_constructor_kwargs=dict(
            out_dir=str(out_dir), model=model, dtype=dtype, device="cuda" if gpus else "cpu",
            threads=1, skip_invalid=skip_invalid, allow_model_mismatch=allow_model_mismatch, sample=sample),
            **per)
        for row in mapped.iter_rows():
            row = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            _collect(result, row)
            if on_shard:
                on_shard(row)
    finally:
        if started:
            ray.shutdown()
    return result
