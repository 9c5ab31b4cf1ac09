"""Scoring a set of traces: validate them against the verifier, replay them with one prefill each,
stream per-token scores to Parquet and check activation commits from the same prefill."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from verinfer.commits.trace_commits import CommitCheck, check_commits, commit_rows
from verinfer.models.backend import Backend
from verinfer.scoring.alignment import align, keep_rows, lost_bytes_tail, occurrences
from verinfer.trace import Trace, TraceError
from verinfer.scoring.scores import ScoreWriter, verified_signature, write_commit_scores
from verinfer.scoring.token_difr import verify_traces

Progress = Callable[[int], None] | None
COMPACT = ("trace_id", "position", "exact_match", "margin", "cross_entropy", "depth_shift")  # what verdicts need


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


Replays = dict[str, dict[str, np.ndarray]]  # per trace id, the score columns of its last replay


def by_trace(columns: dict[str, np.ndarray]) -> Replays:
    """Score columns split per trace id (one stable sort, not one mask per trace), rows by position."""
    ids = np.asarray(columns["trace_id"])
    if not len(ids):
        return {}
    order = np.lexsort((np.asarray(columns["position"]), ids.astype(str)))
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    ends = np.r_[starts[1:], len(order)]
    return {str(sorted_ids[a]): {k: np.asarray(v)[order[a:b]] for k, v in columns.items()}
            for a, b in zip(starts, ends)}


def reusable(traces: Sequence[Trace], replays: Replays | None) -> Replays:
    """The replays that score ``traces`` exactly as they now stand (same output ids, no commits to
    check, which need the prefill's hidden states): scoring them again would repeat the same prefill."""
    out = {}
    for t in traces:
        r = (replays or {}).get(t.id)
        if r is not None and not t.fingerprints and np.array_equal(r["claimed"], t.output_token_ids):
            out[t.id] = r
    return out


def replayer(backend: Backend, base: Sequence[Trace], last: Replays | None = None):
    """The alignment's ``Replay`` over ``base`` (``scoring.alignment.align``): output ``k`` scored with the
    ids given, candidates of one output told apart by id (``occurrences``); each replay's columns also
    go to ``last`` when given."""
    def replay(ids: list[list[int]], todo: list[int]) -> list[dict[str, np.ndarray]]:
        subset = [replace(base[k], output_token_ids=i, id=base[k].id + tag)
                  for k, i, tag in zip(todo, ids, occurrences(todo))]
        blocks = [block.columns for block in verify_traces(backend, subset)]
        got = by_trace({k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]})
        if last is not None:
            last.update(got)
        return [got[t.id] for t in subset]

    return replay


def align_retokenized(backend: Backend, traces: Sequence[Trace]) -> tuple[list[Trace], dict[str, set[int]], Replays]:
    """Traces whose output ids were re-tokenized from text (``meta.token_source == "retokenized"``, the
    text kept in ``output_text``, as the gateway records text-only engines) re-split at every
    tokenization break the replay reveals (``verinfer.scoring.alignment``); returns the traces (the
    re-split ones with ``meta.realigned``, those whose text ends inside a character with
    ``meta.lost_bytes_from``), per trace id the positions to leave unscored, and the
    alignment's last replays, which ``score_traces(reuse=)`` takes instead of scoring them again."""
    out = list(traces)
    which = [i for i, t in enumerate(out) if (t.meta or {}).get("token_source") == "retokenized"
             and t.output_text and t.output_token_ids and not t.sampling.speculative]
    if not which:
        return out, {}, {}
    last: Replays = {}
    replay = replayer(backend, [out[i] for i in which], last)
    skip = {}
    for i, a in zip(which, align([(out[i].output_token_ids, out[i].output_text) for i in which], replay,
                                 backend.tokenizer)):
        tail = lost_bytes_tail(backend.tokenizer, a.ids, out[i].output_text)  # bytes the text lost: drift too
        lost = set(range(tail, len(a.ids))) if tail is not None else set()
        if a.realigned or lost:
            out[i] = replace(out[i], output_token_ids=a.ids, meta={**out[i].meta, "realigned": a.realigned,
                                                                   **({"lost_bytes_from": tail} if lost else {})})
            skip[out[i].id] = set(a.realigned) | lost
    return out, skip, last


def score_traces(backend: Backend, traces: Sequence[Trace], scores_path: Path | None = None,
                 commits_path: Path | None = None, on_rows: Progress = None,
                 skip: dict[str, set[int]] | None = None, reuse: Replays | None = None) -> Scored:
    """Score every token (streaming to ``scores_path`` when given) and check every trace's commits.

    Commit scores go to ``commits_path`` when given and some trace carries commits. ``skip`` names,
    per trace id, positions left out of the scores (re-tokenization drift: ``align_retokenized``);
    ``reuse`` holds replays already made of some traces (the alignment's), which are not replayed again.
    """
    parts: dict[str, list[np.ndarray]] = {k: [] for k in COMPACT}
    checks: list[CommitCheck] = []
    sig = verified_signature(traces, backend)

    reused = reusable(traces, reuse)
    fresh = [t for t in traces if t.id not in reused]

    def check(i: int, hidden) -> None:
        t = fresh[i]
        if t.fingerprints:
            rows = commit_rows(hidden, len(t.prompt_token_ids), len(t.output_token_ids))
            checks.append(check_commits(t.id, t.fingerprints, rows, len(t.prompt_token_ids)))

    wants_hidden = any(t.fingerprints for t in fresh)
    blocks = (b.columns for b in verify_traces(backend, fresh, on_rows=on_rows,
                                               on_sequence_hidden=check if wants_hidden else None)) if fresh else ()
    with ScoreWriter(scores_path, sig) if scores_path else contextlib.nullcontext() as writer:
        for block_columns in itertools.chain(blocks, _replayed(reused.values(), on_rows)):
            columns = keep_rows(block_columns, skip or {})
            if writer:
                writer.write(columns)
            for k in COMPACT:
                parts[k].append(columns[k])
    written = write_commit_scores(checks, commits_path, sig) if checks and commits_path else None
    columns = in_trace_order({k: np.concatenate(v) for k, v in parts.items()}, traces)
    return Scored(columns, checks, sig,
                  Path(scores_path) if scores_path else None, written)


def _replayed(replays, on_rows: Progress):
    """Replays made before (``reuse``), as the score blocks the verifier would have streamed."""
    for columns in replays:
        if on_rows:
            on_rows(len(columns["position"]))
        yield columns
