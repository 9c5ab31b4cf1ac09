"""TOPLOC against recorded proofs and verdicts of the reference library ``toploc`` 0.1.6 (CPU).

Fixtures only (``tests/fixtures/toploc/``; ``record.py`` there rebuilds them with the reference
installed): tie-dense bf16 chunks rebuilt from recipes (``chunks.py``) and a few real SmolLM2-135M
chunks stored as bits, each with the reference's base64 proofs and its check results on the honest
tensor and four perturbations.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from verinfer.commits.toploc import (
    CommitError,
    Thresholds,
    build_proofs,
    encode_proof,
    proofs_from_base64,
    proofs_to_base64,
    verify_proofs,
)
from verinfer.commits.toploc_poly import injective_modulus, interpolate

FIXTURES = Path(__file__).parent / "fixtures" / "toploc"
RECORDED = json.loads((FIXTURES / "reference_proofs.json").read_text())
CASES = RECORDED["cases"]
_spec = importlib.util.spec_from_file_location("toploc_fixture_chunks", FIXTURES / "chunks.py")
chunks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chunks)
REAL = dict(np.load(FIXTURES / "smollm2_states.npz"))


def tensor(name: str):
    """The case's hidden states, rebuilt and checked against the recorded digest."""
    case = CASES[name]
    if case["source"] == "smollm2_states.npz":
        h = chunks.from_bits(REAL[name.removeprefix("smollm2_")])
    else:
        h = chunks.case_tensor(name)
    assert (h.shape[0], h.shape[1]) == (case["n_tokens"], case["hidden"])
    assert chunks.digest(h) == case["sha256"], f"{name}: rebuilt tensor differs from the recorded one"
    return h


def spans(case: dict) -> list[tuple[int, int]]:
    prefill, n = case["prefill"], case["n_tokens"]
    chunk = RECORDED["meta"]["decode_chunk"]
    return ([(0, prefill)] if prefill else []) + [(s, min(s + chunk, n)) for s in range(prefill, n, chunk)]


def lowest_index_proofs(h, case: dict) -> list[str]:
    """Proofs under the rule "ties at the k-th magnitude go to the smallest indices" (verinfer's
    rule before it matched the reference), to show the fixture tells tie rules apart."""
    k, out = case["k"], []
    for a, b in spans(case):
        bits = chunks.bits_of(h[a:b]).reshape(-1)
        idx = np.lexsort((np.arange(bits.size), -(bits & 0x7FFF).astype(np.int64)))[:k]
        modulus = injective_modulus(idx)
        coeffs = interpolate((idx % modulus)[None], bits[idx].astype(np.int64)[None])[0]
        out.append(encode_proof(modulus, coeffs))
    return proofs_to_base64(out)


def test_fixture_covers_ties_both_topk_paths_and_real_chunks() -> None:
    assert RECORDED["meta"]["reference"].startswith("toploc 0.1.6")
    tied = [t for case in CASES.values() for t in case["boundary_tied"]]
    assert len(tied) >= 20 and sum(tied) >= 0.8 * len(tied)
    sizes = [(b - a) * case["hidden"] >= 64 * case["k"] for case in CASES.values() for a, b in spans(case)]
    assert any(sizes) and not all(sizes)  # torch's heap-selection path and its nth_element path
    assert sum(name.startswith("smollm2_") for name in CASES) >= 2
    moduli = {int.from_bytes(p, "big") for case in CASES.values() for p in
              (raw[:2] for raw in proofs_from_base64(case["proofs"], case["k"]))}
    assert 65497 in moduli and min(moduli) < 65497


def test_fixture_tells_tie_rules_apart() -> None:
    differ = total = 0
    for name, case in CASES.items():
        other = lowest_index_proofs(tensor(name), case)
        differ += sum(a != b for a, b in zip(other, case["proofs"]))
        total += len(other)
    assert differ >= total // 2, f"only {differ} of {total} recorded chunks depend on the tie rule"


@pytest.mark.parametrize("name", sorted(CASES))
def test_proofs_byte_identical_to_reference(name: str) -> None:
    case = CASES[name]
    proofs = build_proofs(tensor(name), case["prefill"], decode_chunk=RECORDED["meta"]["decode_chunk"], k=case["k"])
    assert proofs_to_base64(proofs) == case["proofs"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_checks_of_reference_proofs_agree_with_reference(name: str) -> None:
    """Our validator on the reference's proofs reports the reference's own statistics and verdicts."""
    case = CASES[name]
    h = tensor(name)
    for seed, (perturbation, recorded) in enumerate(case["reference_verdicts"].items()):
        assert perturbation in chunks.PERTURBATIONS
        checks = verify_proofs(chunks.perturb(h, perturbation, seed), case["prefill"], case["proofs"],
                               decode_chunk=RECORDED["meta"]["decode_chunk"], k=case["k"])
        assert len(checks) == len(recorded)
        for i, (ours, ref) in enumerate(zip(checks, recorded)):
            where = f"{name}/{perturbation}/chunk {i}"
            assert ours.exp_mismatches == ref["exp_mismatches"], where
            if ref["mean"] is None:
                assert math.isinf(ours.mean_mantissa_err), where
                continue
            assert ours.mean_mantissa_err == pytest.approx(ref["mean"], rel=1e-12), where
            assert ours.median_mantissa_err == ref["median_upper"], where  # its C++ check: the upper middle
            assert ours.passed == Thresholds().accepts(ref["exp_mismatches"], ref["mean"], ref["median_upper"], 0), where


def test_fixture_has_even_counts_where_the_median_rules_differ() -> None:
    """The check above tells the upper middle value (the reference's C++ check) from the mean of
    the two middle values (its Python path, ``statistics.median``) on these recorded chunks."""
    records = [r for case in CASES.values() for rs in case["reference_verdicts"].values() for r in rs]
    differ = [r for r in records if r["median"] is not None and r["median"] != r["median_upper"]]
    assert len(differ) >= 5


def test_cross_acceptance_and_expected_verdicts() -> None:
    """Honest proofs pass both ways; the recorded reference verdicts show what each perturbation does."""
    verdicts: dict[tuple[str, str], list[bool]] = {}
    for name, case in CASES.items():
        for perturbation, recorded in case["reference_verdicts"].items():
            verdicts[name, perturbation] = [
                ref["mean"] is not None
                and Thresholds().accepts(ref["exp_mismatches"], ref["mean"], ref["median_upper"], 0)
                for ref in recorded
            ]
    every = lambda perturbation, names=CASES: [v for n in names for v in verdicts[n, perturbation]]  # noqa: E731
    assert all(every("same"))  # the reference accepts its own honest proofs
    assert all(every("signs_flipped"))  # it ignores signs (a known weakness)
    assert not any(every("scaled_1.1")) and not any(every("noise_10pct"))
    # 1% relative noise passes on continuous values; on a plateau of equal magnitudes it reorders the
    # tied entries, so the verifier's top-k is mostly other indices (TOPLOC itself, any tie rule).
    plateaus = {"coarse", "plateau", "all_tied"}
    assert all(every("noise_1pct", [n for n in CASES if n not in plateaus]))
    assert not any(verdicts["all_tied", "noise_1pct"])
    for name, case in CASES.items():  # ours accepts the reference's honest proofs, exactly
        checks = verify_proofs(tensor(name), case["prefill"], case["proofs"], k=case["k"])
        assert all(c.passed and c.exp_mismatches == 0 and c.mean_mantissa_err == 0 for c in checks), name
        with pytest.raises(CommitError):
            verify_proofs(tensor(name), case["prefill"], case["proofs"][:-1], k=case["k"])
