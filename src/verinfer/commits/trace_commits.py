"""Activation commits attached to traces: what a provider builds and what a validator checks.

Both kinds come from one sequence of final normed hidden states (the input to lm_head), the rows
a provider computes anyway while generating:

    row j = hidden state at input position j, for j = 0 .. L + n - 2

(L prompt tokens, n output tokens: the last output token is never fed back, so it has no row).
Row ``L - 1 + k`` is the one whose logits sampled output token k.

- Activation-DiFR fingerprints one row per output token (rows L-1 .. L+n-2), strided.
- TOPLOC proves the prompt rows (one prefill proof over rows 0..L-1) and the decode rows
  (chunks of 32 over rows L..L+n-2), in the reference library's byte format.

The validator prefills prompt + output once and slices the same rows, so a commit check costs no
extra forward pass next to Token-DiFR.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verinfer.commits.activation_difr import FingerprintCommit, FingerprintError, FingerprintSpec, distances
from verinfer.commits.toploc import CommitError, Thresholds, ToplocCommit, chunk_score


@dataclass(frozen=True)
class CommitSpec:
    """Which commits a provider attaches (either may be off)."""

    fingerprint: FingerprintSpec | None = None
    toploc_k: int | None = None
    decode_chunk: int = 32


def commit_rows(hidden: torch.Tensor, prompt_len: int, n_out: int) -> torch.Tensor:
    """The committed rows (see module docstring) from a full-sequence hidden state [L + n (- 1), D]."""
    return hidden[: prompt_len + n_out - 1]


def build_commits(rows: torch.Tensor, prompt_len: int, spec: CommitSpec, model: str) -> dict:
    """The ``fingerprints`` field of a trace from its committed rows [L + n - 1, D]."""
    out: dict = {}
    if spec.fingerprint is not None:
        out["activation-difr"] = FingerprintCommit.build(rows[prompt_len - 1:], spec.fingerprint).to_dict()
    if spec.toploc_k is not None:
        commit = ToplocCommit.from_hidden(rows, prompt_len, model, decode_chunk=spec.decode_chunk, k=spec.toploc_k)
        out["toploc"] = commit.to_dict()
    return out


@dataclass
class CommitCheck:
    """A validator's findings for one trace; ``error`` is set when a commit is invalid: it could not be
    parsed, or a TOPLOC chunk fails the reference thresholds (the proof does not match the
    validator's activations; the chunk results stay in ``toploc_passed``)."""

    trace_id: str
    fingerprint_l2: np.ndarray | None = None  # per logged token
    toploc_exp_mismatches: np.ndarray | None = None  # per chunk
    toploc_mean_mantissa: np.ndarray | None = None
    toploc_passed: np.ndarray | None = None
    error: str | None = None

    @property
    def toploc_score(self) -> np.ndarray | None:
        """Per chunk: ``toploc.chunk_score`` (None without a TOPLOC commit)."""
        if self.toploc_exp_mismatches is None:
            return None
        return chunk_score(self.toploc_exp_mismatches, self.toploc_mean_mantissa)


def check_commits(trace_id: str, fingerprints: dict | None, rows: torch.Tensor, prompt_len: int,
                  thresholds: Thresholds = Thresholds()) -> CommitCheck:
    """Check a trace's commits against the validator's own rows; malformed commits become ``error``."""
    check = CommitCheck(trace_id)
    if not fingerprints:
        return check
    where = f"trace {trace_id!r}"
    try:
        unknown = set(fingerprints) - {"activation-difr", "toploc"}
        if unknown:
            raise FingerprintError(f"{where}: unknown commit kind(s) {', '.join(sorted(unknown))}")
        if "activation-difr" in fingerprints:
            commit = FingerprintCommit.from_dict(fingerprints["activation-difr"], f"{where}: activation-difr")
            check.fingerprint_l2 = distances(commit, rows[prompt_len - 1:])["l2"]
        if "toploc" in fingerprints:
            commit = ToplocCommit.from_dict(fingerprints["toploc"])
            if commit.prefill_len != prompt_len or commit.n_tokens != rows.shape[0]:
                raise CommitError(f"{where}: toploc commit covers {commit.prefill_len} prompt and "
                                  f"{commit.n_tokens} total rows, the trace has {prompt_len} and {rows.shape[0]}")
            results = commit.verify(rows, thresholds)
            check.toploc_exp_mismatches = np.array([r.exp_mismatches for r in results])
            check.toploc_mean_mantissa = np.array([r.mean_mantissa_err for r in results])
            check.toploc_passed = np.array([r.passed for r in results])
            if not check.toploc_passed.all():  # an invalid commitment, like an unparseable one (exit 1)
                raise CommitError(f"{where}: toploc proof fails {int((~check.toploc_passed).sum())} of "
                                  f"{check.toploc_passed.size} chunks at the reference thresholds")
    except (FingerprintError, CommitError) as exc:
        message = str(exc)
        check.error = message if message.startswith(where) else f"{where}: {message}"
    return check
