"""Activation-DiFR fingerprints: projection, storage precisions, exact byte accounting, parsing."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verinfer.commits.activation_difr import (
    FingerprintCommit, FingerprintError, FingerprintSpec, decode, distances, encode, projection,
)


def test_projection_is_orthonormal_and_seeded():
    p = projection(576, 16, 42).double()
    assert torch.allclose(p.T @ p, torch.eye(16, dtype=torch.float64), atol=1e-6)
    assert torch.equal(projection(576, 16, 42), projection(576, 16, 42))
    assert not torch.equal(projection(576, 16, 42), projection(576, 16, 43))
    assert torch.equal(projection(576, 4, 42), projection(576, 128, 42)[:, :4])  # nested prefixes


@pytest.mark.parametrize("precision, tol", [("fp32", 0), ("fp16", 1e-3), ("bf16", 8e-3), ("int8", 1e-2)])
def test_storage_round_trip_and_bytes(precision, tol):
    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    data = encode(x, precision)
    spec = FingerprintSpec(dim=8, precision=precision, stride=4)
    assert len(data) == 5 * spec.bytes_per_fingerprint
    assert spec.bytes_per_token() == spec.bytes_per_fingerprint / 4
    back = decode(data, precision, 8, 5)
    assert np.max(np.abs(back - x) / np.abs(x).max(axis=1, keepdims=True)) <= tol


def test_commit_round_trip_and_honest_distance_zero():
    h = torch.randn(37, 576, generator=torch.Generator().manual_seed(1))
    spec = FingerprintSpec(dim=4, stride=3, precision="fp16")
    commit = FingerprintCommit.build(h, spec)
    assert commit.values.shape == (len(spec.logged(37)), 4) == (13, 4)  # 42 % 3 == 0: indices 0, 3, ..., 36
    again = FingerprintCommit.from_dict(commit.to_dict())
    assert again.spec == spec and np.array_equal(again.values, commit.values)
    assert distances(again, h)["l2"].max() == 0
    far = distances(again, h * 1.05)["l2"]
    assert far.min() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"values": "!!!"}, "not valid base64"),
        ({"dim": 0}, "dim 0 is not in 1..576"),
        ({"precision": "fp8"}, "precision 'fp8'"),
        ({"n_tokens": 99}, "expected 99 fingerprints"),
        ({"version": 2}, "unsupported method/version"),
        ({"seed": -1}, "field 'seed' must be a non-negative integer"),
    ],
)
def test_malformed_commits_are_named(change, message):
    d = FingerprintCommit.build(torch.randn(10, 576), FingerprintSpec(dim=4)).to_dict()
    d.update(change)
    with pytest.raises(FingerprintError, match=message) as info:
        FingerprintCommit.from_dict(d, where="trace 't3'")
    assert str(info.value).startswith("trace 't3': ")


def test_nan_values_rejected():
    data = encode(np.array([[np.nan, 1.0]], dtype=np.float32), "fp32")
    with pytest.raises(FingerprintError, match="finite"):
        decode(data, "fp32", 2, 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # no wall-clock checks
@given(st.dictionaries(st.sampled_from(["method", "version", "dim", "seed", "precision", "stride", "hidden_size",
                                        "n_tokens", "values", "layer"]),
                       st.one_of(st.integers(-5, 2000), st.text(max_size=12), st.none(), st.booleans())))
def test_parser_never_raises_anything_else(d):
    try:
        FingerprintCommit.from_dict({"method": "activation-difr", "version": 1, **d})
    except FingerprintError:
        pass
