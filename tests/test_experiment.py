"""The detection-power runner end to end on a tiny matrix: cache, resume, analysis, report."""

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from verinfer.cli.main import app
from verinfer.studies import detection
from verinfer.studies.detection_report import analyse, markdown
from verinfer.stats.calibration import Calibrator
from verinfer.stats.power import Detector, power_curves, random_batch_means, tokens_to_reach


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("out")
    result = CliRunner().invoke(app, ["experiment", "--smoke", "--out", str(out), "--cache", str(cache),
                                      "--n-batches", "300", "--n-boot", "50"])
    assert result.exit_code == 0, result.output
    return cache, out, result


def test_smoke_report_files_and_detection(smoke_run):
    cache, out, result = smoke_run
    for name in ("detection.json", "detection.md", "auc_vs_tokens.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "detection.json").read_text())
    wrong = report["configs"]["wrong-seed"]
    # A wrong seed changes ~60% of sampled tokens; the bounded margin separates it within 20 tokens.
    assert wrong["tokens_needed"]["margin (bound 20)"] is not None
    assert wrong["tokens_needed"]["margin (bound 20)"] <= 20
    assert wrong["verdict"]["met"] is True  # the paper's bar for a wrong seed is 100 tokens
    # Honest fp32 decode vs the fp32 prefill: almost every token reproduced exactly.
    assert report["honest_noise"]["honest-fp32"]["exact_match"] > 0.95
    assert report["honest_noise"]["wrong-seed"]["exact_match"] < 0.8
    assert report["held_out_fpr"], "held-out FPR rows are missing"
    assert "verinfer experiment --smoke" in (out / "detection.md").read_text()
    assert "wrong-seed" in result.output


def test_resume_regenerates_only_missing_chunks(smoke_run):
    cache, _, _ = smoke_run
    matrix = detection.smoke_matrix()
    stages: list[str] = []
    detection.run_matrix(matrix, cache, stage=stages.append)
    assert not [s for s in stages if "generating" in s or "verifying" in s], stages  # everything cached
    chunk = sorted(cache.rglob("wrong-seed-*/chunk-001.*"))
    assert len(chunk) == 2  # traces and scores
    for path in chunk:
        path.unlink()
    stages.clear()
    data = detection.run_matrix(matrix, cache, stage=stages.append)
    assert stages == ["wrong-seed: generating chunk 2", "wrong-seed: verifying chunk 2"]
    assert data["wrong-seed"].tokens > 0
    # Traces kept but scores lost (killed during verification): verify again, do not regenerate.
    next(cache.rglob("wrong-seed-*/chunk-000.scores.parquet")).unlink()
    stages.clear()
    detection.run_matrix(matrix, cache, stage=stages.append)
    assert stages == ["wrong-seed: verifying chunk 1"]


def test_changed_settings_use_a_new_cache_entry(smoke_run):
    cache, _, _ = smoke_run
    matrix = detection.smoke_matrix()
    key = matrix.cache_key(detection.CONFIGS["wrong-seed"], "m")
    from dataclasses import replace

    assert replace(matrix, max_tokens=21).cache_key(detection.CONFIGS["wrong-seed"], "m") != key
    assert replace(matrix, split_seed=5).cache_key(detection.CONFIGS["wrong-seed"], "m") == key  # analysis only
    # The adversary's search settings key only the attack configurations.
    assert replace(matrix, attack_rounds=3).cache_key(detection.CONFIGS["wrong-seed"], "m") == key
    attack = detection.CONFIGS["w4+ce-attack"]
    assert replace(matrix, attack_rounds=3).cache_key(attack, "m") != matrix.cache_key(attack, "m")


def test_bad_matrix_settings_are_refused():
    with pytest.raises(ValueError, match="unknown configuration"):
        detection.Matrix(configs=("honest-fp32", "w5"))
    with pytest.raises(ValueError, match="honest"):
        detection.Matrix(configs=("wrong-seed",))
    result = CliRunner().invoke(app, ["experiment", "--configs", "nope"])
    assert result.exit_code == 2 and "unknown configuration" in result.output


def test_power_curves_on_synthetic_scores():
    """Known distributions: a shifted mean is found at the size the z-score predicts; no shift is chance."""
    rng = np.random.default_rng(0)
    honest = {"margin": np.abs(rng.normal(0, 1, 20000))}
    shifted = {"margin": np.abs(rng.normal(0, 1, 20000)) + 0.1}
    same = {"margin": np.abs(rng.normal(0, 1, 20000))}
    det = (Detector("margin", "bound:20", "m"),)
    cal = Calibrator((1,), 0.01, ("bound:20",)).fit(honest)
    sizes = (1, 10, 100, 1000, 5000)
    curves = power_curves(cal, honest, honest, shifted, shifted, det, sizes, n_batches=500, n_boot=20,
                          combined=False)["m"]
    assert curves[0].auc.estimate < 0.7 and curves[-1].auc.estimate > 0.99
    # Separation needs ~ (z_0.99 + z_0.99)^2 * var / shift^2 = (4.65)^2 * 0.36 / 0.01 ~ 780 tokens.
    assert tokens_to_reach(curves, 0.99) in (1000, 5000)
    null = power_curves(cal, honest, honest, same, same, det, (100,), n_batches=500, n_boot=20, combined=False)["m"]
    assert null[0].auc.estimate < 0.75
    lower = {"margin": honest["margin"] * 0.5}
    flipped = power_curves(cal, honest, honest, lower, lower, det, (100,), n_batches=200, n_boot=20,
                           combined=False)["m"]
    assert flipped[0].auc.estimate == 0.5 and not flipped[0].oriented


def test_random_batch_means_is_unbiased_with_the_iid_spread():
    x = np.arange(10, dtype=float)
    m = random_batch_means(x, 50, 4000, np.random.default_rng(1), chunk_elems=1000)
    assert abs(m.mean() - 4.5) < 0.05
    assert abs(m.std() - x.std() / np.sqrt(50)) < 0.03


def test_markdown_lists_every_configuration(smoke_run, tmp_path):
    cache, _, _ = smoke_run
    matrix = detection.smoke_matrix()
    data = detection.run_matrix(matrix, cache)
    result = analyse(data, matrix, (1, 5), n_batches=100, n_boot=10)
    text = markdown(result)
    assert "| wrong-seed |" in text and "honest-fp32 (honest)" in text
    shutil.rmtree(tmp_path, ignore_errors=True)
