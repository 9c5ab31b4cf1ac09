"""Scoring a set of traces: validate them against the verifier, replay them with one prefill each,
stream per-token scores to Parquet and check activation commits from the same prefill."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from verinfer.commits.trace_commits import CommitCheck, check_commits, commit_rows
from verinfer.models.backend import Backend
from verinfer.trace import Trace, TraceError
from verinfer.scoring.scores import ScoreWriter, signature, write_commit_scores
from verinfer.scoring.token_difr import verify_traces

Progress = Callable[[int], None] | None
COMPACT = ("trace_id", "position", "exact_match", "margin", "cross_entropy")  # what verdicts need, in memory


def check_traces(traces: Sequence[Trace], backend: Backend, source: str, skip_invalid: bool = False,
                 allow_model_mismatch: bool = False) -> tuple[list[Trace], list[str]]:
    """Validate traces against the verifier (vocabulary, model, context length); raise on the first
    problem unless skipping (then each problem is returned as a line naming file, record and field)."""
    kept, skipped = [], []
    for n, t in enumerate(traces, 1):
        problems = t.problems(backend.vocab_size, None if allow_model_mismatch else backend.model_id,
                              backend.max_length)
        if not problems:
            kept.append(t)
            continue
        message = f"{source}: record {n} (id {t.id!r}): {problems[0]}"
        if not skip_invalid:
            raise TraceError(message)
        skipped.append(message)
    if not kept:
        raise TraceError(f"{source}: no valid traces left to verify ({len(skipped)} skipped)")
    return kept, skipped


def in_trace_order(columns: dict[str, np.ndarray], traces: Sequence[Trace]) -> dict[str, np.ndarray]:
    """Rows sorted by the traces' order, then position (the verifier streams blocks in its own
    order); verdicts batch consecutive tokens, so every command judges tokens in this one order."""
    rank = {t.id: i for i, t in enumerate(traces)}
    order = np.lexsort((columns["position"], np.array([rank[t] for t in columns["trace_id"]])))
    return {k: np.asarray(v)[order] for k, v in columns.items()}


@dataclass
class Scored:
    """What scoring a trace set leaves in memory: compact per-token columns and the commit checks."""

    columns: dict[str, np.ndarray]
    commit_checks: list[CommitCheck] = field(default_factory=list)
    signature: dict = field(default_factory=dict)
    scores_path: Path | None = None
    commits_path: Path | None = None


def score_traces(backend: Backend, traces: Sequence[Trace], scores_path: Path | None = None,
                 commits_path: Path | None = None, on_rows: Progress = None) -> Scored:
    """Score every token (streaming to ``scores_path`` when given) and check every trace's commits.

    Commit scores go to ``commits_path`` when given and some trace carries commits.
    """
    parts: dict[str, list[np.ndarray]] = {k: [] for k in COMPACT}
    checks: list[CommitCheck] = []
    sig = signature(traces, backend.model_id, backend.dtype_name)

    def check(i: int, hidden) -> None:
        t = traces[i]
        if t.fingerprints:
            rows = commit_rows(hidden, len(t.prompt_token_ids), len(t.output_token_ids))
            checks.append(check_commits(t.id, t.fingerprints, rows, len(t.prompt_token_ids)))

    wants_hidden = any(t.fingerprints for t in traces)
    with ScoreWriter(scores_path, sig) if scores_path else contextlib.nullcontext() as writer:
        for block in verify_traces(backend, traces, on_rows=on_rows,
                                   on_sequence_hidden=check if wants_hidden else None):
            if writer:
                writer.write(block.columns)
            for k in COMPACT:
                parts[k].append(block.columns[k])
    written = write_commit_scores(checks, commits_path, sig) if checks and commits_path else None
    columns = in_trace_order({k: np.concatenate(v) for k, v in parts.items()}, traces)
    return Scored(columns, checks, sig,
                  Path(scores_path) if scores_path else None, written)
