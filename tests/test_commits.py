"""Commits on real hidden states: honest rows pass, other models' rows fail, bad commits are named."""

import numpy as np
import torch

from verinfer.commits.activation_difr import FingerprintSpec
from verinfer.commits.trace_commits import CommitSpec, build_commits, check_commits, commit_rows

SPEC = CommitSpec(fingerprint=FingerprintSpec(dim=8, hidden_size=576), toploc_k=128)


def rows_for(backend, ids, prompt_len):
    h, _ = backend.hidden(torch.tensor([ids]), None)
    return commit_rows(h[0].float(), prompt_len, len(ids) - prompt_len)


def test_honest_commits_pass_and_bf16_rows_stay_close(backend):
    ids = list(range(100, 180))
    rows = rows_for(backend, ids, 20)
    commits = build_commits(rows, 20, SPEC, backend.model_id)
    assert rows.shape[0] == 79
    same = check_commits("t", commits, rows, 20)
    assert same.error is None and same.fingerprint_l2.max() == 0 and same.toploc_passed.all()
    assert len(same.toploc_passed) == 1 + 2  # prefill proof + ceil(59 / 32) decode chunks
    bf = rows.bfloat16().float() + 0.002 * torch.randn_like(rows) * rows.abs()
    noisy = check_commits("t", commits, bf, 20)
    assert noisy.toploc_passed.all() and 0 < noisy.fingerprint_l2.max()


def test_other_rows_fail(backend):
    ids = list(range(100, 180))
    commits = build_commits(rows_for(backend, ids, 20), 20, SPEC, backend.model_id)
    other = rows_for(backend, list(range(300, 380)), 20)
    check = check_commits("t", commits, other, 20)
    assert not check.toploc_passed.any()
    assert check.error == "trace 't': toploc proof fails 3 of 3 chunks at the reference thresholds"  # exit 1
    assert check.fingerprint_l2.min() > 1.0


def test_malformed_commits_are_reported_not_raised(backend):
    rows = rows_for(backend, list(range(100, 140)), 10)
    commits = build_commits(rows, 10, SPEC, backend.model_id)
    bad = {**commits, "toploc": {**commits["toploc"], "proofs": ["AAAA"]}}
    check = check_commits("t9", bad, rows, 10)
    assert check.error.startswith("trace 't9': ") and check.toploc_passed is None
    assert "unknown commit kind" in check_commits("t9", {"zk": {}}, rows, 10).error
    short = check_commits("t9", commits, rows[:-3], 10)
    assert short.error and "t9" in short.error
    assert check_commits("t9", None, rows, 10).error is None
    assert np.isfinite(check_commits("t9", commits, rows, 10).fingerprint_l2).all()
