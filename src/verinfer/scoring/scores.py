"""Score files: per-token Token-DiFR scores and per-commit scores in Parquet, with the signature of
what was verified (model, verifier dtype, sampling settings) in the file's metadata.

The signature travels from ``verify`` through ``calibrate`` into the calibration file, so a
calibration fitted on one sampler's traces is never silently applied to another's
(``verinfer.stats.calibration.check_signature``). Files are written by temporary file and rename.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from verinfer.files import atomic_path
from verinfer.trace import Trace

SCORE_SCHEMA = pa.schema([
    ("trace_id", pa.string()), ("position", pa.int64()), ("claimed", pa.int64()), ("verifier_token", pa.int64()),
    ("exact_match", pa.bool_()), ("margin", pa.float64()), ("filter_distance", pa.float64()),
    ("filtered", pa.bool_()), ("cross_entropy", pa.float64()), ("logit_rank", pa.int64()),
    ("gumbel_rank", pa.int64()), ("ipt_distance", pa.float64()), ("spec_mode", pa.string()),
    ("accept_slack", pa.float64()), ("depth_shift", pa.float64()),
])
OPTIONAL_SCORE_COLUMNS = ("ipt_distance", "spec_mode", "accept_slack", "depth_shift")  # absent from files written before them
COMMIT_SCHEMA = pa.schema([("trace_id", pa.string()), ("metric", pa.string()), ("index", pa.int64()),
                           ("score", pa.float64())])
COMMIT_METRICS = {"fingerprint_l2": "Activation-DiFR L2 per logged token",
                  "toploc": "TOPLOC exponent mismatches + mean mantissa error per 32-token chunk"}
SIGNATURE_KEY = b"verinfer.signature"


def signature(traces: Sequence[Trace], model: str, dtype: str, reference: str = "transformers") -> dict[str, Any]:
    """The verified configuration: reference model and dtype, and each distinct sampling setting; the
    reference's implementation when it is not transformers (``--backend vllm``: its noise is its own)."""
    sampling = {json.dumps(t.sampling.signature(), sort_keys=True) for t in traces}
    return with_reference({"model": model, "dtype": dtype, "sampling": [json.loads(s) for s in sorted(sampling)]},
                          reference)


def verified_signature(traces: Sequence[Trace], backend) -> dict[str, Any]:
    """``signature`` of ``traces`` as ``backend`` (the reference) verifies them."""
    return signature(traces, backend.model_id, backend.dtype_name, backend.reference_name)


def with_reference(sig: dict[str, Any], reference: str) -> dict[str, Any]:
    """``sig`` naming the reference's implementation, where it is not transformers (older signatures
    and the shipped calibrations' have none: transformers)."""
    return sig if reference == "transformers" else {**sig, "reference": reference}


def _with_signature(schema: pa.Schema, sig: dict | None) -> pa.Schema:
    return schema if sig is None else schema.with_metadata({SIGNATURE_KEY: json.dumps(sig, sort_keys=True)})


class ScoreWriter:
    """Streams score blocks into one Parquet file, written under a temporary name until closed."""

    def __init__(self, path: str | Path, sig: dict | None = None):
        self.path = Path(path)
        self._atomic = atomic_path(self.path)
        self._tmp = self._atomic.__enter__()
        self._schema = _with_signature(SCORE_SCHEMA, sig)
        self._writer = pq.ParquetWriter(self._tmp, self._schema)

    def write(self, columns: dict[str, np.ndarray]) -> None:
        self._writer.write_table(pa.table({k: columns[k] for k in SCORE_SCHEMA.names}, schema=self._schema))

    def __enter__(self) -> "ScoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb):
        self._writer.close()
        if exc_type is None:
            self._atomic.__exit__(None, None, None)
        else:
            self._atomic.__exit__(exc_type, exc, tb)


def _read(path: str | Path, schema: pa.Schema, what: str) -> pa.Table:
    if not Path(path).exists():
        raise ValueError(f"{path}: cannot read {what}: does not exist")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ValueError(f"{path}: cannot read {what} ({exc})") from None
    missing = [n for n in schema.names if n not in table.column_names and n not in OPTIONAL_SCORE_COLUMNS]
    if missing:
        hint = (" (this looks like a commit score file)" if what == "token scores" and "metric" in table.column_names
                else " (this looks like a token score file)" if "margin" in table.column_names else "")
        raise ValueError(f"{path}: not a verinfer {what} file: missing column(s) {', '.join(missing)}{hint}")
    return table


def read_scores(path: str | Path) -> dict[str, np.ndarray]:
    """Per-token score columns of a ``verinfer verify`` score file (checked: one-line error otherwise)."""
    table = _read(path, SCORE_SCHEMA, "token scores")
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


def read_signature(path: str | Path) -> dict | None:
    """The signature a score file was written with (None for files written before signatures)."""
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[SIGNATURE_KEY]) if SIGNATURE_KEY in meta else None


def commit_scores(checks: list) -> dict[str, np.ndarray]:
    """Continuous commit scores (higher = more divergent) by metric, in trace order."""
    out = {}
    for metric, attr in (("fingerprint_l2", "fingerprint_l2"), ("toploc", "toploc_score")):
        values = [getattr(c, attr) for c in checks if getattr(c, attr) is not None]
        if values:
            out[metric] = np.concatenate(values).astype(np.float64)
    return out


def write_commit_scores(checks: list, path: str | Path, sig: dict | None = None) -> Path:
    """One row per fingerprint (metric fingerprint_l2) and per TOPLOC chunk (metric toploc)."""
    cols: dict[str, list] = {n: [] for n in COMMIT_SCHEMA.names}
    for c in checks:
        for metric, values in (("fingerprint_l2", c.fingerprint_l2), ("toploc", c.toploc_score)):
            if values is None:
                continue
            cols["trace_id"] += [c.trace_id] * len(values)
            cols["metric"] += [metric] * len(values)
            cols["index"] += list(range(len(values)))
            cols["score"] += [float(v) for v in values]
    schema = _with_signature(COMMIT_SCHEMA, sig)
    with atomic_path(path) as tmp:
        pq.write_table(pa.table(cols, schema=schema), tmp)
    return Path(path)


def read_commit_scores(path: str | Path) -> dict[str, np.ndarray]:
    table = _read(path, COMMIT_SCHEMA, "commit scores").to_pydict()
    metrics = np.asarray(table["metric"], dtype=object)
    scores = np.asarray(table["score"], dtype=np.float64)
    return {m: scores[metrics == m] for m in COMMIT_METRICS if (metrics == m).any()}
