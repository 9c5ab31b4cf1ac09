"""The command line as a user meets it: bad input, exit codes, one-line errors. The round trip runs
the real entry point in fresh processes; the other tests invoke the same app in this process
(``tests/cli_app.py``)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tests.cli_app import invoke
from verinfer.sampling.params import SamplingParams
from verinfer.trace import Trace, read_traces, write_traces


def process(*args, cwd=None) -> subprocess.CompletedProcess:
    """The real entry point in a fresh process, with one torch thread (as an xdist worker has: a
    child with the default policy took both cores beside the other worker's tests)."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           **{k: v for k, v in os.environ.items() if k in ("HOME", "VERINFER_CACHE", "PYTHONPATH")}}
    return subprocess.run([sys.executable, "-m", "verinfer.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=1200, env=env)


run = invoke


def good(i=0, **kw):
    d = dict(id=f"t{i}", model="smollm2-135m", prompt_token_ids=[1, 9690, 198], output_token_ids=[28, 29, 30],
             sampling=SamplingParams(seed=3, top_k=50, top_p=0.95))
    d.update(kw)
    return Trace(**d)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    text = " ".join(lines)
    assert text.startswith("error:"), proc.stderr
    for f in fragments:
        assert f in text, proc.stderr


@pytest.mark.parametrize(
    "content, fragments",
    [
        ("{oops\n", ["bad.jsonl:1: not valid JSON"]),
        ('{"id": "a", "model": "m"}\n', ["bad.jsonl:1 (id 'a'): missing field 'prompt_token_ids'"]),
        ("", ["no trace records"]),
    ],
)
def test_verify_rejects_malformed_files(tmp_path, content, fragments):
    (tmp_path / "bad.jsonl").write_text(content)
    assert_one_line_error(run("verify", str(tmp_path / "bad.jsonl")), *fragments)


def test_verify_rejects_out_of_vocabulary_and_skip_reports_counts(tmp_path):
    path = write_traces([good(0), good(1, output_token_ids=[28, 10**6])], tmp_path / "t.jsonl")
    proc = run("verify", str(path))
    assert_one_line_error(proc, "record 2 (id 't1')", "output_token_ids[1]: token id 1000000 is outside the vocabulary")
    assert not (tmp_path / "t.scores.parquet").exists()

    proc = run("verify", str(path), "--skip-invalid", "--json", str(tmp_path / "s.json"))
    assert proc.returncode == 0, proc.stderr
    assert "1 invalid trace(s) skipped, 1 verified" in proc.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["traces"] == 1 and summary["tokens"] == 3 and len(summary["skipped"]) == 1
    # the claim (vLLM, T=1, top-k 50, top-p 0.95) has a shipped calibration; 3 tokens are too few for it
    assert summary["verdict"] is None and "too few tokens" in summary["note"]
    assert summary["calibration"].endswith("(shipped default)")
    proc = run("verify", str(path), "--skip-invalid", "--no-default-calibration", "--scores", str(tmp_path / "n.parquet"),
               "--json", str(tmp_path / "n.json"))
    assert proc.returncode == 0 and "uncalibrated" in json.loads((tmp_path / "n.json").read_text())["note"]


def test_verify_rejects_model_mismatch_and_unknown_model(tmp_path):
    path = write_traces([good(0, model="llama-3.1-8b")], tmp_path / "t.jsonl")
    assert_one_line_error(run("verify", str(path)), "unknown model 'llama-3.1-8b'")
    assert_one_line_error(run("verify", str(path), "--model", "smollm2-135m"),
                          "trace claims 'llama-3.1-8b' but the verifier runs 'smollm2-135m'")


def test_missing_file_and_bad_calibration(tmp_path):
    assert_one_line_error(run("verify", str(tmp_path / "nope.jsonl")), "no such file")
    path = write_traces([good(0)], tmp_path / "t.jsonl")
    (tmp_path / "c.json").write_text("{}")
    assert_one_line_error(run("verify", str(path), "--calibration", str(tmp_path / "c.json")), "error:")


def test_generate_rejects_bad_params(tmp_path):
    assert_one_line_error(run("generate", "-o", str(tmp_path / "o.jsonl"), "--profile", "nope"),
                          "unknown sampler profile 'nope'")
    assert_one_line_error(run("generate", "-o", str(tmp_path / "o.jsonl"), "--top-p", "0"),
                          "top_p must be in (0, 1]")
    assert_one_line_error(run("generate", "-o", str(tmp_path / "o.jsonl"), "--prompts", str(tmp_path / "none.jsonl")),
                          "neither a built-in set")


def test_generate_calibrate_verify_round_trip(tmp_path):
    """A user's path, each command a fresh process of the real entry point: generate honest traces,
    calibrate on their scores, verify other traces."""
    run = process
    cal = tmp_path / "cal.jsonl"
    assert run("generate", "-o", str(cal), "--n", "6", "--max-tokens", "24", "--seed", "1").returncode == 0
    proc = run("verify", str(cal))
    assert proc.returncode == 0, proc.stderr
    proc = run("calibrate", str(tmp_path / "cal.scores.parquet"), "-o", str(tmp_path / "c.json"),
               "--verdict-batches", "1")
    assert proc.returncode == 0, proc.stderr
    test = tmp_path / "test.jsonl"
    assert run("generate", "-o", str(test), "--n", "4", "--max-tokens", "16", "--seed", "50").returncode == 0
    proc = run("verify", str(test), "--calibration", str(tmp_path / "c.json"), "--verdict-batch", "1",
               "--json", str(tmp_path / "v.json"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "v.json").read_text())
    assert summary["verdict"]["verdict"] == "CONSISTENT" and summary["consistent"] is True, summary
    assert summary["signature"]["sampling"][0]["profile"] == "vllm"

    # The same traces claiming other seeds diverge: exit 1, the verdict in the JSON.
    lying = [dataclasses.replace(t, sampling=t.sampling.with_(seed=t.sampling.seed + 7)) for t in read_traces(test)]
    write_traces(lying, tmp_path / "lying.jsonl")
    proc = run("verify", str(tmp_path / "lying.jsonl"), "--calibration", str(tmp_path / "c.json"),
               "--verdict-batch", "1", "--json", str(tmp_path / "lying.json"))
    assert proc.returncode == 1, proc.stderr
    assert json.loads((tmp_path / "lying.json").read_text())["verdict"]["verdict"] == "INCONSISTENT"

    # A calibration fitted on vLLM's sampler refuses traces of another sampler, naming both.
    other = [dataclasses.replace(t, sampling=t.sampling.with_(profile="torch-exponential")) for t in read_traces(test)]
    write_traces(other, tmp_path / "other.jsonl")
    proc = run("verify", str(tmp_path / "other.jsonl"), "--calibration", str(tmp_path / "c.json"))
    assert_one_line_error(proc, "c.json", "sampling: calibrated on", "torch-exponential")
    assert not (tmp_path / "other.scores.parquet").exists()  # refused before any scoring


def test_generate_with_commits_then_verify_reports_them(tmp_path):
    path = tmp_path / "c.jsonl"
    proc = run("generate", "-o", str(path), "--n", "3", "--max-tokens", "40", "--fingerprint-dim", "8",
               "--fingerprint-precision", "int8", "--toploc")
    assert proc.returncode == 0, proc.stderr
    proc = run("verify", str(path), "--json", str(tmp_path / "v.json"))
    assert proc.returncode == 0, proc.stderr
    assert "TOPLOC:" in proc.stdout and "Activation-DiFR:" in proc.stdout
    commits = json.loads((tmp_path / "v.json").read_text())["commits"]
    assert commits["toploc"]["passed"] == commits["toploc"]["chunks"] > 0 and not commits["errors"]
    assert commits["activation_difr"]["fingerprints"] > 0
    from verinfer.scoring.scores import read_commit_scores

    stored = read_commit_scores(tmp_path / "c.commits.parquet")
    assert stored["fingerprint_l2"].size == commits["activation_difr"]["fingerprints"]
    assert stored["toploc"].size == commits["toploc"]["chunks"]
    assert_one_line_error(run("generate", "-o", str(path), "--fingerprint-dim", "9999"), "dim 9999 is not in 1..576")


def test_default_outputs_keep_the_whole_stem_and_never_overwrite_an_input(tmp_path):
    """run.v1.jsonl and run.v2.jsonl get their own score files; an output equal to an input is
    refused before anything is written (the trace file stays intact)."""
    for name in ("run.v1.jsonl", "run.v2.jsonl"):
        write_traces([good(0)], tmp_path / name)
        assert run("verify", str(tmp_path / name)).returncode == 0
    assert (tmp_path / "run.v1.scores.parquet").exists() and (tmp_path / "run.v2.scores.parquet").exists()
    path = tmp_path / "t.jsonl"
    write_traces([good(0)], path)
    before = path.read_bytes()
    assert_one_line_error(run("verify", str(path), "--scores", str(path)), "would overwrite an input")
    assert_one_line_error(run("verify", str(path), "--json", str(path)), "would overwrite an input")
    assert_one_line_error(run("verify", str(path), "--scores", str(tmp_path / "s.parquet"), "--commit-scores",
                              str(tmp_path / "s.parquet")), "would overwrite another output")
    assert path.read_bytes() == before


def test_bad_calibration_files_and_score_files_are_one_line_errors(tmp_path):
    path = write_traces([good(0)], tmp_path / "t.jsonl")
    for name, content, needle in (("list.json", "[1, 2]", "a JSON list"), ("empty.json", "{}", "not a verinfer"),
                                  ("nothr.json", '{"format": "verinfer.calibrator", "version": 1, "batch_sizes": [1],'
                                   ' "fpr": 0.01, "rules": ["bound:20"], "resample": null, "random_state": null,'
                                   ' "metrics": {}}', "malformed")):
        (tmp_path / name).write_text(content)
        assert_one_line_error(run("verify", str(path), "--calibration", str(tmp_path / name)), name, needle)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "other.parquet")
    assert_one_line_error(run("calibrate", str(tmp_path / "other.parquet"), "-o", str(tmp_path / "c.json")),
                          "other.parquet", "not a verinfer token scores file")
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("flag, value", [("--n", "0"), ("--max-tokens", "-1"), ("--batch-size", "0")])
def test_generate_refuses_useless_sizes(tmp_path, flag, value):
    out = tmp_path / "o.jsonl"
    assert_one_line_error(run("generate", "-o", str(out), flag, value), flag, "at least 1")
    assert not out.exists()


def test_invalid_commitments_fail_the_check_and_overlong_traces_are_refused(tmp_path):
    """A garbage commitment is a failed check (exit 1, the trace named), not a note beside exit 0;
    a trace longer than the verifier's context is refused before any scoring (exit 2)."""
    path = write_traces([good(0), good(1, fingerprints={"toploc": {"proofs": "not base64!"}}),
                         good(2, fingerprints={"sha": "x"})], tmp_path / "c.jsonl")
    proc = run("verify", str(path), "--json", str(tmp_path / "v.json"))
    assert proc.returncode == 1, proc.stderr
    assert "invalid commitment" in proc.stderr and "trace 't1'" in proc.stderr and "unknown commit kind" in proc.stderr
    summary = json.loads((tmp_path / "v.json").read_text())
    assert summary["consistent"] is False and len(summary["commits"]["errors"]) == 2

    long = write_traces([good(0, prompt_token_ids=[1] * 9000)], tmp_path / "long.jsonl")
    assert_one_line_error(run("verify", str(long)), "record 1 (id 't0')", "more than the verifier's context of 8192")
    assert not (tmp_path / "long.scores.parquet").exists()
