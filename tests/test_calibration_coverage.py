"""Calibrations that know what they cover (issue #28 item 3): the honest precisions and profiles a
calibration was fitted on, the warning an fp32-only null gets, the verdict note when only numerical
noise explains a rejection, every calibration knob on the command line, and the shipped defaults."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.cli_app import invoke
from verinfer import api
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.scores import SCORE_SCHEMA, ScoreWriter
from verinfer.stats.calibration import Calibrator, coverage_warnings
from verinfer.stats.shipped import DATA_DIR, calibration_filename, find_calibration
from verinfer.stats.sides import detectors, judged_groups
from verinfer.stats.verdict import calibrated_verdict

SIG = {"model": "smollm2-135m", "dtype": "float32",
       "sampling": [SamplingParams(profile="vllm", top_k=50, top_p=0.95).signature()]}


def score_file(path, n: int, seed: int, noise: float):
    """A score file of ``n`` tokens: exact (noise 0) or with ``noise`` mismatches falling on both sides."""
    rng = np.random.default_rng(seed)
    miss = rng.random(n) < noise
    cols = {"trace_id": np.array([f"t{i // 50}" for i in range(n)], dtype=object), "position": np.arange(n) % 50,
            "claimed": np.zeros(n, np.int64), "verifier_token": miss.astype(np.int64), "exact_match": ~miss,
            "margin": np.where(miss, rng.exponential(0.3, n), 0.0), "filter_distance": np.zeros(n),
            "filtered": np.zeros(n, bool), "cross_entropy": rng.exponential(2.0, n), "logit_rank": miss.astype(np.int64),
            "gumbel_rank": miss.astype(np.int64), "ipt_distance": np.full(n, np.nan),
            "spec_mode": np.full(n, None, dtype=object), "accept_slack": np.full(n, np.nan),
            "depth_shift": np.where(miss, rng.choice([-1, 1], n) * rng.random(n), 0.0)}
    assert set(cols) == set(SCORE_SCHEMA.names)
    with ScoreWriter(path, SIG) as w:
        w.write(cols)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cov")
    return {"fp32": score_file(d / "fp32.scores.parquet", 2000, 1, 0.0),
            "bf16": score_file(d / "bf16.scores.parquet", 2000, 2, 0.03),
            "noisy": score_file(d / "noisy.scores.parquet", 2000, 3, 0.03), "dir": d}


def test_a_calibration_records_its_coverage_and_keeps_it_on_disk(files):
    out = files["dir"] / "pooled.json"
    cal = api.calibrate([files["fp32"], files["bf16"]], batch_sizes=(10,), precisions=["fp32", "bf16"], out=out)
    assert cal.coverage == {"precisions": ["bfloat16", "float32"], "profiles": ["vllm"]}
    assert Calibrator.load(out).coverage == cal.coverage and coverage_warnings(cal) == []
    assert judged_groups(cal.sides) and Calibrator.load(out).sides == cal.sides  # the shape null beside the margin
    # one honest group per source file: the least favourable precision decides, never a pooled mixture
    assert [(g["tokens"], g["positive"] + g["negative"] > 0) for g in cal.sides] == [(2000, False), (2000, True)]
    assert [g["group"].split(": ", 1)[1] for g in cal.sides] == [str(files["fp32"]), str(files["bf16"])]
    assert api.calibrate(files["fp32"], batch_sizes=(10,), shape=False).sides is None


def test_side_counts_load_from_files_with_and_without_beyond(files):
    """A calibration file counts each group's mismatches beyond the claimed filters; files written before
    that count load and judge the two sides only; a count that cannot be (beyond > deeper) is refused."""
    out = files["dir"] / "beyond.json"
    api.calibrate([files["fp32"], files["bf16"]], batch_sizes=(10,), precisions=["fp32", "bf16"], out=out)
    doc = json.loads(out.read_text())
    assert all("beyond" in g for g in doc["sides"]) and detectors(Calibrator.load(out).sides)[-1] == "beyond"
    for g in doc["sides"]:
        del g["beyond"]
    old = Calibrator.from_dict(doc)
    assert detectors(old.sides) == ("narrower", "wider")
    from verinfer.scoring.scores import read_scores

    assert "beyond" not in calibrated_verdict(read_scores(files["noisy"]), old, 10).detectors
    doc["sides"][1].update(beyond=doc["sides"][1]["negative"] + 1)
    with pytest.raises(ValueError, match="more 'beyond' than 'negative'"):
        Calibrator.from_dict(doc)


def test_an_fp32_only_null_warns_and_its_rejections_say_why(files):
    fp32 = api.calibrate(files["fp32"], batch_sizes=(10,), precisions=["fp32"])
    (warning,) = coverage_warnings(fp32, cli=True)
    assert "float32 only: honest bf16 providers" in warning and "--precisions fp32,bf16" in warning
    (unstated,) = coverage_warnings(api.calibrate(files["fp32"], batch_sizes=(10,)))
    assert "not recorded" in unstated
    from verinfer.scoring.scores import read_scores

    v = calibrated_verdict(read_scores(files["noisy"]), fp32, 10)
    assert set(v.detectors) == {"margin"}  # no honest mismatch in an exact fp32 null: no side to compare with
    assert not v.consistent and "the calibration covers float32 only" in v.text and "verinfer diagnose" in v.text
    assert "shallower" in v.note and "deeper" in v.note
    pooled = api.calibrate([files["fp32"], files["bf16"]], batch_sizes=(10,), precisions=["fp32", "bf16"])
    assert calibrated_verdict(read_scores(files["noisy"]), pooled, 10).note is None
    one_sided = read_scores(files["noisy"])
    one_sided["depth_shift"] = np.abs(one_sided["depth_shift"])  # every mismatch shallower: a narrower sampler
    v = calibrated_verdict(one_sided, fp32, 10)
    assert not v.consistent and v.note is None
    # without shape evidence (margin only, as a calibration without shape detectors judges) nothing is
    # said: the demo's wrong seed is not excused as noise
    margin_only = calibrated_verdict(read_scores(files["noisy"])["margin"], fp32, 10)
    assert not margin_only.consistent and margin_only.note is None


run = invoke  # the app in this process (tests/cli_app.py)


def test_calibrate_on_the_command_line_has_every_knob(files):
    d = files["dir"]
    proc = run("calibrate", files["fp32"], "-o", d / "a.json", "--verdict-batches", "10", "--precisions", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert "bf16 providers" in proc.stderr and "--precisions fp32,bf16" in proc.stderr
    proc = run("calibrate", files["fp32"], "-o", d / "b.json", "--verdict-batches", "100")
    assert proc.returncode == 2 and "--resample WINDOWS" in proc.stderr, proc.stderr
    proc = run("calibrate", files["fp32"], "-o", d / "b.json", "--verdict-batches", "100", "--resample", "200",
               "--no-shape", "--precisions", "fp32,bf16")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((d / "b.json").read_text())
    assert data["resample"] == 200 and data["batches"] == "windows_with_replacement"
    assert data["sides"] is None and data["coverage"]["precisions"] == ["bfloat16", "float32"]


def test_the_shipped_default_covers_generate_defaults_with_a_pooled_null():
    sig = {**SIG, "sampling": [SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95).signature()]}
    path = find_calibration(sig)
    assert path is not None and path.parent == DATA_DIR
    cal = Calibrator.load(path)
    assert cal.coverage["precisions"] == ["bfloat16", "float32"] and judged_groups(cal.sides)
    other = {**sig, "sampling": [SamplingParams(profile="vllm", top_k=40, top_p=0.95).signature()]}
    assert find_calibration(other) is None and find_calibration({**sig, "dtype": "bfloat16"}) is None
    assert calibration_filename("smollm2-135m", sig["sampling"][0]) == path.name
