"""The public API: the README's example runs as written, and the one verdict rule behaves as its
docstring says (false-positive rate held under sequential looks, Holm across sets)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import verinfer
from verinfer.stats.verdict import adjust, flag_verdict, holm, look_sizes, pooled_verdict

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- api-example -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its marked Python example"
    return match.group(1)


def test_readme_python_example_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-c", readme_example()], capture_output=True, text=True, cwd=tmp_path,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("CONSISTENT with the claimed configuration at 1% FPR"), proc.stdout
    assert lines[1].endswith("tokens scored") and int(lines[1].split()[0]) > 0
    assert lines[-1] == "INCONSISTENT", proc.stdout


def test_import_is_cheap_and_exports_the_api():
    proc = subprocess.run([sys.executable, "-c", "import sys, verinfer; print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", "import verinfer should not load torch before an API call"
    for name in ("generate", "verify", "calibrate", "load_model", "Verdict", "VerifyResult", "Calibrator"):
        assert callable(getattr(verinfer, name))
    with pytest.raises(AttributeError):
        verinfer.nothing_here  # noqa: B018


def test_sequential_verdict_keeps_the_false_positive_rate():
    """Honest flags (Bernoulli at the calibrated rate) are called inconsistent at most alpha of the
    time although the test looks at every doubling prefix; testing each look at alpha instead
    (no Bonferroni) would exceed it, which this simulation shows too."""
    rng = np.random.default_rng(1)
    fpr, n, reps = 0.05, 256, 3000
    rejected = naive = 0
    from scipy.stats import binomtest

    for _ in range(reps):
        flags = rng.random(n) < fpr
        rejected += not flag_verdict(flags, fpr, 1).consistent
        cum = np.cumsum(flags)
        naive += any(binomtest(int(cum[k - 1]), k, fpr, alternative="greater").pvalue < fpr for k in look_sizes(n))
    bound = fpr + 3 * np.sqrt(fpr * (1 - fpr) / reps)
    assert rejected / reps <= bound, rejected / reps
    assert naive / reps > rejected / reps  # the looks cost something; Bonferroni pays for them


def test_verdict_detects_and_reports_where_it_stopped():
    flags = np.zeros(200, dtype=bool)
    flags[100:] = True  # a provider that turns bad half-way
    v = flag_verdict(flags, 0.01, 10)
    assert not v.consistent and v.tokens_needed == 128 * 10  # the first doubling look that rejects
    assert v.flagged == 100 and v.units == 200 and v.tokens == 2000
    assert "INCONSISTENT" in v.text and v.to_dict()["verdict"] == "INCONSISTENT"


def test_holm_and_adjust():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    vs = [flag_verdict(np.array([True] * 3 + [False] * 97), 0.01, 1),
          flag_verdict(np.zeros(100, dtype=bool), 0.01, 1)]
    raw = vs[0].p_value
    adjust(vs)
    assert vs[0].p_adjusted == pytest.approx(min(1.0, 2 * raw)) and vs[1].p_adjusted == 1.0
    assert vs[0].consistent == (vs[0].p_adjusted >= 0.01)


def test_pooled_verdict_on_honest_and_shifted_sequences():
    rng = np.random.default_rng(3)

    def seqs(n, mean):
        lengths = rng.integers(20, 40, size=n).astype(float)
        return np.stack([lengths, lengths * rng.exponential(mean, size=n), lengths], axis=1)

    band = seqs(200, 0.01)
    honest = pooled_verdict(seqs(12, 0.01), [band], 0.01, all_bands={"honest": band})
    bad = pooled_verdict(seqs(12, 0.2), [band], 0.01, all_bands={"honest": band})
    assert honest.consistent and not bad.consistent and bad.tokens_needed is not None
    assert honest.resembles == "honest" and bad.unit == "sequence"
    lo, _, hi = bad.band_ranges["honest"]
    assert not lo <= bad.statistic <= hi  # far outside the only band: it resembles nothing, and says so
    assert bad.resembles is None and bad.nearest == "honest" and "outside every band's range (nearest: honest)" in bad.text


def test_margingate_result_files_record_the_command_as_typed():
    from verinfer.cli.margingate import command_line

    assert command_line(["verinfer", "margingate", "sweep", "--n", "2"]) == "verinfer margingate sweep --n 2"
    assert command_line(["/x/cli/__main__.py", "margingate", "measure"]) == "verinfer margingate measure"
    assert command_line(["margingate.py", "decode", "-o", "a b.jsonl"]) == "verinfer margingate decode -o 'a b.jsonl'"


def test_layers_have_no_cycles():
    """The import-linter contracts in pyproject.toml: dependencies point one way, between the layers
    and inside ``verinfer.sampling`` (sampler -> inverse_cdf -> profiles -> shared pieces)."""
    proc = subprocess.run(["lint-imports", "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_token_detector_clips_at_the_honest_percentile_unless_the_null_has_no_noise():
    """Honest bf16-like noise with a few filtered (infinite) claims: the clipped detector keeps the
    threshold low enough to flag a wrong seed; an exact null (every margin 0) falls back to the
    bounded margin, which the clip would erase."""
    from verinfer.stats.calibration import Calibrator
    from verinfer.stats.verdict import CLIPPED, DETECTOR, calibrated_verdict, token_detector

    rng = np.random.default_rng(5)
    honest = np.where(rng.random(4000) < 0.97, 0.0, rng.exponential(0.05, 4000))
    honest[rng.choice(4000, 12, replace=False)] = np.inf  # honest claims outside the reference's top-p
    cols = {"margin": honest, "cross_entropy": np.zeros(4000), "exact_match": (honest == 0).astype(float)}
    noisy = Calibrator(batch_sizes=(4,)).fit(cols)
    assert token_detector(noisy) == CLIPPED
    wrong_seed = np.where(rng.random(400) < 0.4, 0.0, rng.exponential(1.6, 400))
    assert not calibrated_verdict(wrong_seed, noisy, 4).consistent
    assert calibrated_verdict(wrong_seed, noisy, 4, *DETECTOR).consistent  # the bound alone misses it here
    exact = Calibrator(batch_sizes=(4,)).fit({k: np.zeros(4000) for k in ("margin", "cross_entropy")} |
                                             {"exact_match": np.ones(4000)})
    assert token_detector(exact) == DETECTOR and not calibrated_verdict(wrong_seed, exact, 4).consistent
