"""TOPLOC proofs: reference format, verification behaviour, strict parsers (fast; no model)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from verinfer.commits.toploc import (
    MAGIC,
    ChunkCheck,
    CommitError,
    Thresholds,
    ToplocCommit,
    build_proofs,
    count_chunks,
    decode_proof,
    encode_proof,
    proofs_from_base64,
    proofs_to_base64,
    select_topk,
    verify_proofs,
)
from verinfer.commits.toploc_poly import P, _mod, evaluate, injective_modulus, interpolate

GOLDEN_A = "/9nZxJ9IOQVQa+YMcKiZYaGOpPND0lpZ1wvD4ubZqiTKEA=="
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def bf16_from_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def golden_a() -> torch.Tensor:
    j = np.arange(32 * 64)
    bits = (((j * 7) % 3 == 0).astype(np.int64) << 15) | (0x3C00 + (j * 997) % 2048)
    return bf16_from_bits(bits).reshape(32, 64)


def gaussian(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def relative_noise(h: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    return h * (1 + scale * gaussian(tuple(h.shape), seed))


def newton_coeffs(xs: list[int], ys: list[int]) -> list[int]:
    """Textbook Newton interpolation mod P, expanded to monomials (independent oracle)."""
    n = len(xs)
    c = [y % P for y in ys]
    for s in range(1, n):
        for i in range(n - 1, s - 1, -1):
            c[i] = (c[i] - c[i - 1]) * pow(xs[i] - xs[i - s], P - 2, P) % P
    poly = [c[-1]]
    for i in range(n - 2, -1, -1):
        shifted = [0] + poly
        poly = [(shifted[d] - xs[i] * (poly[d] if d < len(poly) else 0)) % P for d in range(len(shifted))]
        poly[0] = (poly[0] + c[i]) % P
    return poly + [0] * (n - len(poly))


def passed(checks: list[ChunkCheck]) -> list[bool]:
    return [c.passed for c in checks]


# --- reference format ----------------------------------------------------------------------------


def test_golden_vector_a() -> None:
    proofs = build_proofs(golden_a(), 0, k=16)
    assert proofs_to_base64(proofs) == [GOLDEN_A]
    assert int.from_bytes(proofs[0][:2], "big") == P
    assert verify_proofs(golden_a(), 0, [GOLDEN_A], k=16) == [ChunkCheck(0, 0.0, 0.0, 0, True)]


def test_prefill_len_zero_means_no_prefill_proof() -> None:
    assert build_proofs(golden_a(), 32, k=16) == build_proofs(golden_a(), 0, k=16)  # same single chunk
    assert len(build_proofs(golden_a(), 16, decode_chunk=8, k=16)) == 3


@pytest.mark.parametrize("k", [1, 2, 3, 5, 16, 100, 128])
def test_interpolation_equals_newton(k: int) -> None:
    rng = np.random.default_rng(k)
    xs = rng.choice(P, size=k, replace=False)
    ys = rng.integers(0, P, size=k)
    coeffs = interpolate(xs[None], ys[None])[0]
    assert coeffs.tolist() == newton_coeffs(xs.tolist(), ys.tolist())
    assert evaluate(coeffs[None], xs[None])[0].tolist() == ys.tolist()


def test_float_mod_is_exact_below_2_50() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.integers(0, 2**50, 100_000), rng.integers(0, 2**44 // P, 100_000) * P])
    values = np.concatenate([values, values + P - 1, np.maximum(values - 1, 0)])
    values = values[values < 2**50]
    assert (_mod(values.astype(np.float64)).astype(np.int64) == values % P).all()


def test_injective_modulus_is_the_largest() -> None:
    assert injective_modulus(np.arange(128)) == P
    assert injective_modulus(np.array([0, P, 2 * P])) == P - 1  # residues 0, 1, 2
    assert injective_modulus(np.array([0, P - 1, P])) == P - 2  # P: 0 = P; P - 1: 0 = P - 1


def test_chunk_layout_and_sizes() -> None:
    h = gaussian((100, 64), 0)
    proofs = build_proofs(h, 30)  # prefill 30 rows, then decode chunks of 32, 32, 6 rows
    assert len(proofs) == count_chunks(100, 30, 32) == 4
    assert {len(p) for p in proofs} == {258}
    assert all(c.passed for c in verify_proofs(h, 30, proofs))
    assert build_proofs(h[:0], 0) == [] and verify_proofs(h[:0], 0, []) == []


def test_base64_round_trip() -> None:
    proofs = build_proofs(gaussian((70, 64), 1), 6)
    texts = proofs_to_base64(proofs)
    assert all(len(t) == 344 for t in texts)
    assert proofs_from_base64(texts) == proofs
    assert passed(verify_proofs(gaussian((70, 64), 1), 6, texts)) == [True] * 3


# --- verification behaviour ------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "prefill"), [((32, 576), 0), ((4 * 32, 4096), 32)])
def test_honest_proofs_pass_same_tensor_and_small_noise(shape: tuple[int, int], prefill: int) -> None:
    h = gaussian(shape, 2)
    proofs = build_proofs(h, prefill)
    exact = verify_proofs(h, prefill, proofs)
    assert all(c == ChunkCheck(0, 0.0, 0.0, 0, True) for c in exact)
    assert all(passed(verify_proofs(relative_noise(h, 0.01, 3), prefill, proofs)))


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda h: relative_noise(h, 0.10, 4), id="10%-noise"),
        pytest.param(lambda h: h * 1.1, id="x1.1"),
        pytest.param(lambda h: gaussian(tuple(h.shape), 5), id="other-tensor"),
        pytest.param(lambda h: h[torch.randperm(h.shape[0], generator=torch.Generator().manual_seed(6))], id="perm"),
    ],
)
def test_tampered_states_fail(tamper) -> None:
    h = gaussian((2 * 32, 4096), 7)
    proofs = build_proofs(h, 0)
    assert passed(verify_proofs(tamper(h), 0, proofs)) == [False, False]


def test_sign_flip_is_reported_but_accepted_by_reference_thresholds() -> None:
    h = gaussian((32, 576), 8)
    check = verify_proofs(-h, 0, build_proofs(h, 0))[0]
    assert check.passed and check.exp_mismatches == 0 and check.sign_mismatches == 128
    assert not verify_proofs(-h, 0, build_proofs(h, 0), thresholds=Thresholds(sign_mismatches=10))[0].passed


@pytest.mark.parametrize(
    ("errors", "median", "passes"),
    [
        ([0, 7, 9, 9], 9.0, False),  # even count: the upper middle (9), not the mean of 7 and 9 (8, would pass)
        ([0, 1, 7, 9], 7.0, True),  # the mean of the middle values (4) would pass too; the rule is still 7
        ([3, 8, 8], 8.0, True),  # odd count: the middle value
    ],
)
def test_median_is_the_upper_middle_value_as_the_reference(errors: list[int], median: float, passes: bool) -> None:
    """The reference's C++ check sorts the mantissa errors and takes element size / 2."""
    claimed = bf16_from_bits(np.full(len(errors), 0x3F80))[None]  # 1.0: exponent 127, mantissa 0
    own = bf16_from_bits(0x3F80 + np.array(errors))[None]  # same exponent, mantissa off by each error
    check = verify_proofs(own, 0, build_proofs(claimed, 0, k=len(errors)), k=len(errors))[0]
    assert check.exp_mismatches == 0 and check.mean_mantissa_err == sum(errors) / len(errors)
    assert check.median_mantissa_err == median and check.passed is passes


def test_injective_modulus_below_p_still_verifies() -> None:
    h = gaussian((32, 4096), 9) * 0.01
    flat = h.view(-1)
    big = np.random.default_rng(10).choice(65497, size=126, replace=False)
    flat[torch.from_numpy(big)] = 5.0 + torch.arange(126) / 64
    flat[1000], flat[1000 + P] = 8.0, -9.0  # both in the top-k, equal mod 65497
    proof = build_proofs(h, 0)[0]
    modulus = int.from_bytes(proof[:2], "big")
    assert modulus < P
    assert verify_proofs(h, 0, [proof])[0] == ChunkCheck(0, 0.0, 0.0, 0, True)
    assert verify_proofs(relative_noise(h, 0.01, 11), 0, [proof])[0].passed
    # The reference's Python path evaluates at index mod 65497 instead of mod m: that breaks here.
    idx = select_topk(h.bfloat16().view(torch.int16).numpy().view(np.uint16).reshape(1, -1), 128)
    _, coeffs = decode_proof(proof, 128)
    own = h.bfloat16().view(torch.int16).numpy().view(np.uint16).reshape(-1)[idx[0]]
    assert (evaluate(coeffs[None], idx % P)[0] != own).any()


def test_ties_at_the_kth_magnitude_follow_torch_topk() -> None:
    row = bf16_from_bits(np.zeros(12)).float()
    row[[1, 2, 4, 7, 9]] = torch.tensor([3.0, -3.0, 3.0, 5.0, -3.0])
    bits = row.bfloat16().view(torch.int16).numpy().view(np.uint16)
    for k in (1, 2, 4, 5):
        chosen = set(select_topk(bits[None], k)[0].tolist())
        assert 7 in chosen and chosen <= {1, 2, 4, 7, 9} and len(chosen) == k
        assert chosen == set(row.bfloat16().abs().topk(k).indices.tolist())  # the reference's call
    batch = np.stack([bits, bits[::-1].copy()])  # rows are independent of their neighbours
    assert [set(r) for r in select_topk(batch, 3).tolist()] == [
        set(select_topk(bits[None], 3)[0].tolist()), set(select_topk(bits[::-1].copy()[None], 3)[0].tolist())
    ]
    ones = torch.ones(32, 64)  # every entry tied: the proof is over whichever k entries topk takes
    idx = select_topk(np.full((1, 32 * 64), 0x3F80, np.uint16), 16)
    expected = encode_proof(injective_modulus(idx[0]), interpolate(idx, np.full((1, 16), 0x3F80))[0])
    assert build_proofs(ones, 0, k=16) == [expected]
    assert verify_proofs(ones, 0, [expected], k=16) == [ChunkCheck(0, 0.0, 0.0, 0, True)]


@FUZZ
@given(
    bits=hnp.arrays(
        np.uint16,
        st.tuples(st.integers(1, 3), st.integers(1, 1500)),  # both torch paths: n >= 64k and n < 64k
        elements=st.sampled_from([0, 0x8000, 0x3F80, 0xBF80, 0x4000, 0xC000, 0x3F81, 0x0001, 0x7F7F]),
    ),
    k=st.integers(1, 64),
)
def test_select_topk_is_the_reference_selection(bits: np.ndarray, k: int) -> None:
    k = min(k, bits.shape[1])
    chosen = select_topk(bits, k)
    mags = (bits & 0x7FFF).astype(np.int64)
    for row, picked, mag in zip(bits, chosen, mags):
        assert len(set(picked.tolist())) == k
        assert sorted(mag[picked], reverse=True) == sorted(mag, reverse=True)[:k]  # a top-k set
        flat = bf16_from_bits(row)  # the reference: flat.abs().topk(k) per chunk, 1-D
        assert set(picked.tolist()) == set(flat.abs().topk(k).indices.tolist())


@pytest.mark.parametrize("values", ["gaussian", "coarse grid", "few magnitudes", "all equal", "ascending"])
@pytest.mark.parametrize("k", [1, 2, 7, 128])
def test_heap_selection_is_torch_topk_on_wide_tied_rows(values: str, k: int) -> None:
    """Rows with 64k <= n go through the compiled libstdc++ heap selection: the set torch.topk keeps."""
    rng = np.random.default_rng(k)
    n = max(64 * k, 18432)  # 32 x 576: a decode chunk of the bundled model
    rows = {
        "gaussian": lambda: gaussian((8, n), k).bfloat16().view(torch.int16).numpy().view(np.uint16),
        "coarse grid": lambda: (torch.round(gaussian((8, n), k) * 4) / 4).bfloat16().view(torch.int16).numpy().view(np.uint16),
        "few magnitudes": lambda: rng.choice(np.array([0x3F80, 0xBF80, 0x3F81, 0x4000, 0], np.uint16), (4, n)),
        "all equal": lambda: np.full((4, n), 0x3F80, np.uint16),
        "ascending": lambda: np.tile((0x3F00 + np.arange(n) // 97).astype(np.uint16), (4, 1)),
    }[values]()
    chosen = select_topk(rows, k)
    for row, picked in zip(rows, chosen):
        flat = bf16_from_bits(row)
        assert set(picked.tolist()) == set(flat.abs().topk(k).indices.tolist())


# --- envelope --------------------------------------------------------------------------------------


def make_commit() -> tuple[ToplocCommit, torch.Tensor]:
    h = gaussian((75, 64), 12)
    return ToplocCommit.from_hidden(h, 10, "SmolLM2-135M-Instruct", decode_chunk=32, k=32), h


def test_envelope_round_trips() -> None:
    commit, h = make_commit()
    assert commit.count == 4 and commit.n_tokens == 75 and commit.hidden_size == 64
    raw = commit.to_bytes()
    assert raw[:4] == MAGIC and len(raw) == 30 + len(commit.model) + 4 * (2 + 2 * 32)
    assert ToplocCommit.from_bytes(raw) == commit
    assert ToplocCommit.from_dict(json.loads(json.dumps(commit.to_dict()))) == commit
    assert all(passed(commit.verify(h)))
    assert not any(passed(commit.verify(h * 1.1)))
    with pytest.raises(CommitError, match="shape"):
        commit.verify(h[:-1])


# --- strict parsers: named cases -------------------------------------------------------------------


def proof_with(modulus: int, coeffs: list[int], k: int = 4) -> bytes:
    return modulus.to_bytes(2, "big") + b"".join(c.to_bytes(2, "big") for c in (coeffs + [0] * k)[:k])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (proof_with(0, []), "toploc proof 3: modulus 0 is not in 4..65497"),
        (proof_with(65498, []), "modulus 65498"),
        (proof_with(P, [1, 65497]), "coefficient 1 is 65497"),
        (proof_with(P, [])[:-1], "9 bytes, expected 10"),
        (proof_with(P, []) + b"\0", "11 bytes"),
        ("not bytes", "expected bytes"),
    ],
)
def test_bad_proofs_are_named(data: object, message: str) -> None:
    with pytest.raises(CommitError, match=message):
        decode_proof(data, 4, 3)


@pytest.mark.parametrize(
    ("texts", "message"),
    [(["@@@@"], "not valid base64"), (["AAB="], "not canonical"), (["AAA"], "not valid base64"), ("AAAA", "list")],
)
def test_bad_base64_is_rejected(texts: object, message: str) -> None:
    with pytest.raises(CommitError, match=message):
        proofs_from_base64(texts, k=4)


@pytest.mark.parametrize(
    ("hidden", "message"),
    [
        (torch.tensor([[1.0, float("nan")]] * 20), "NaN or inf"),
        (torch.tensor([[1.0, float("inf")]] * 20), "NaN or inf"),
        (torch.tensor([[1.0, 1e39]] * 20, dtype=torch.float64), "NaN or inf"),  # overflows bf16
        (torch.ones(40), "shape"),
        (torch.ones(1, 40, 8), "shape"),
        (torch.ones(40, 0), "shape"),
        (torch.ones(40, 8, dtype=torch.int32), "floating point"),
        (torch.ones(40, 8).to_sparse(), "dense"),
        (np.ones((40, 8), dtype=np.int64), "floating point"),
        ([[1.0] * 8] * 40, "expected a torch tensor"),
    ],
)
def test_bad_hidden_states_are_rejected(hidden: object, message: str) -> None:
    with pytest.raises(CommitError, match=message):
        build_proofs(hidden, 0, k=4)


def test_bad_layouts_and_counts_are_rejected() -> None:
    h = gaussian((40, 8), 13)
    proofs = build_proofs(h, 4, k=4)
    with pytest.raises(CommitError, match="prefill_len 41"):
        build_proofs(h, 41, k=4)
    with pytest.raises(CommitError, match="smaller than k=64"):
        build_proofs(h, 4, k=64)  # the 4-row prefill and tail chunks hold 32 elements
    with pytest.raises(CommitError, match="got 3 proofs for 6 chunks"):
        verify_proofs(h, 4, proofs[:3], decode_chunk=8, k=4)
    with pytest.raises(CommitError, match="got 4 proofs for 3 chunks"):
        verify_proofs(h, 4, proofs + proofs[:1], k=4)
    with pytest.raises(CommitError, match="list of proofs"):
        verify_proofs(h, 4, proofs[0], k=4)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"version": 2}, "unknown version 2"),
        ({"dtype": "fp16"}, "unknown dtype 'fp16'"),
        ({"method": "difr"}, "method 'difr'"),
        ({"k": 33}, "toploc proof 0: 66 bytes, expected 68"),
        ({"n_tokens": 200}, "4 proofs for 7 chunks"),
        ({"count": 5}, "count 5 but 4 proofs"),
        ({"k": True}, "k must be an integer"),
        ({"proofs": "AAAA"}, "proofs must be a list"),
        ({"extra": 1}, "unknown fields 'extra'"),
    ],
)
def test_bad_envelope_dicts_are_named(patch: dict, message: str) -> None:
    data = make_commit()[0].to_dict() | patch
    with pytest.raises(CommitError, match=message):
        ToplocCommit.from_dict(data)


def test_bad_envelope_bytes_are_named() -> None:
    raw = make_commit()[0].to_bytes()
    cases = [
        (b"XXXX" + raw[4:], "bad magic"),
        (raw[:4] + b"\x02" + raw[5:], "unknown version 2"),
        (raw[:5] + b"\x07" + raw[6:], "unknown dtype code 7"),
        (raw[:-1], "expected"),
        (raw[:20], "shorter than the 30-byte header"),
        (raw + b"\0", "expected"),
    ]
    for data, message in cases:
        with pytest.raises(CommitError, match=message):
            ToplocCommit.from_bytes(data)


# --- strict parsers: fuzz --------------------------------------------------------------------------


def parses_or_commit_error(parse, data) -> None:
    try:
        parse(data)
    except CommitError as error:
        assert "\n" not in str(error)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
any_input = st.one_of(st.binary(max_size=80), st.text(max_size=40), json_values)


@FUZZ
@given(data=any_input, k=st.integers(-2, 6))
def test_fuzz_decode_proof(data: object, k: int) -> None:
    parses_or_commit_error(lambda d: decode_proof(d, max(k, 1), 0), data)


@FUZZ
@given(data=st.one_of(st.lists(st.text(max_size=20), max_size=3), any_input))
def test_fuzz_proofs_from_base64(data: object) -> None:
    parses_or_commit_error(lambda d: proofs_from_base64(d, k=4), data)


@FUZZ
@given(data=any_input)
def test_fuzz_envelope_from_arbitrary_input(data: object) -> None:
    parses_or_commit_error(ToplocCommit.from_bytes, data)
    parses_or_commit_error(ToplocCommit.from_dict, data)


VALID_COMMIT = make_commit()[0]


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 10_000),
    truncate=st.booleans(),
)
def test_fuzz_envelope_bytes_mutations(edits: list[tuple[int, int]], cut: int, truncate: bool) -> None:
    raw = bytearray(VALID_COMMIT.to_bytes())
    for pos, value in edits:
        raw[pos % len(raw)] = value
    parses_or_commit_error(ToplocCommit.from_bytes, bytes(raw[: cut % len(raw)] if truncate else raw))


@FUZZ
@given(key=st.sampled_from(sorted(VALID_COMMIT.to_dict())), value=json_values, drop=st.booleans())
def test_fuzz_envelope_dict_mutations(key: str, value: object, drop: bool) -> None:
    data = VALID_COMMIT.to_dict()
    if drop:
        del data[key]
    else:
        data[key] = value
    parses_or_commit_error(ToplocCommit.from_dict, data)


FUZZ_HIDDEN = gaussian((40, 16), 14)
FUZZ_PROOFS = build_proofs(FUZZ_HIDDEN, 8, decode_chunk=16, k=8)


@FUZZ
@given(
    which=st.integers(0, len(FUZZ_PROOFS) - 1),
    flips=st.lists(st.tuples(st.integers(0, 17), st.integers(1, 255)), min_size=1, max_size=3),
)
def test_fuzz_flipped_proof_bytes(which: int, flips: list[tuple[int, int]]) -> None:
    proofs = list(FUZZ_PROOFS)
    raw = bytearray(proofs[which])
    for pos, mask in flips:
        raw[pos] ^= mask
    proofs[which] = bytes(raw)
    try:
        checks = verify_proofs(FUZZ_HIDDEN, 8, proofs, decode_chunk=16, k=8)
    except CommitError:
        return
    assert len(checks) == len(FUZZ_PROOFS) and all(isinstance(c, ChunkCheck) for c in checks)


@FUZZ
@given(
    proofs=st.lists(st.one_of(st.binary(min_size=18, max_size=18), st.binary(max_size=30), st.text()), max_size=4),
    layout=st.one_of(st.just((8, 16, 8)), st.tuples(st.integers(-1, 41), st.integers(-1, 40), st.integers(-1, 9))),
)
def test_fuzz_verify_arbitrary_proofs(proofs: list, layout: tuple[int, int, int]) -> None:
    prefill, chunk, k = layout
    try:
        checks = verify_proofs(FUZZ_HIDDEN, prefill, proofs, decode_chunk=chunk, k=k)
    except CommitError:
        return
    assert len(checks) == len(proofs)


@FUZZ
@given(
    hidden=hnp.arrays(
        dtype=st.sampled_from([np.float16, np.float32, np.float64, np.dtype(">f4"), np.int8, np.bool_]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=12),
    ),
    prefill=st.integers(-1, 12),
)
def test_fuzz_hidden_states(hidden: np.ndarray, prefill: int) -> None:
    parses_or_commit_error(lambda h: build_proofs(h, prefill, decode_chunk=4, k=4), hidden)


def test_base64_helpers_use_standard_alphabet_with_padding() -> None:
    proof = build_proofs(golden_a(), 0, k=16)[0]
    assert proofs_to_base64([proof])[0] == base64.standard_b64encode(proof).decode()
    assert GOLDEN_A.endswith("==")
