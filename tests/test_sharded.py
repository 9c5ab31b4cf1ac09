"""Verification of many shards (issue #16, part 3): in one process and on a local Ray cluster with two
CPU workers started inside the test run; bit-identical scores, resume, a killed worker, bad shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from verinfer import api, sharded
from verinfer.cli.main import app
from verinfer.scoring.scores import read_scores
from verinfer.trace import write_traces

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def traces(backend):
    return api.generate("chitchat", n=6, max_tokens=10, seed=3, backend=backend)


def _shards(directory: Path, traces) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        write_traces(traces[2 * i: 2 * i + 2], directory / f"part{i}.jsonl")
    return sharded.find_shards(directory)


def _differences(a: dict, b: dict) -> list[str]:
    """Score columns that are not equal bit for bit (NaN equal to NaN), each with where it first differs."""
    if a.keys() != b.keys():
        return [f"columns {sorted(a.keys() ^ b.keys())} in one file only"]
    out = []
    for k in a:
        if not np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f"):
            at = np.flatnonzero(a[k] != b[k]) if a[k].shape == b[k].shape else []
            first = int(at[0]) if len(at) else None
            out.append(f"{k}: {len(at)} of {len(a[k])} differ" + (f", first at {first}: {a[k][first]!r} vs "
                                                                  f"{b[k][first]!r}" if first is not None else ""))
    return out


def _same(a: dict, b: dict) -> bool:
    """Score columns equal bit for bit (NaN where both are NaN)."""
    return not _differences(a, b)


def test_find_shards_takes_a_directory_a_glob_or_a_file(tmp_path, traces):
    shards = _shards(tmp_path / "d", traces)
    (tmp_path / "d" / "notes.txt").write_text("not a shard")
    assert [s.name for s in shards] == ["part0.jsonl", "part1.jsonl", "part2.jsonl"]
    assert sharded.find_shards(str(tmp_path / "d" / "part[12].jsonl")) == shards[1:]
    assert sharded.find_shards(shards[0]) == shards[:1]
    with pytest.raises(ValueError, match="no trace shards"):
        sharded.find_shards(tmp_path / "nothing-*.jsonl")
    with pytest.raises(ValueError, match="no such file or directory"):
        sharded.find_shards(tmp_path / "missing.jsonl")


def test_local_shards_equal_the_single_file_run_and_resume(tmp_path, traces, backend):
    shards = _shards(tmp_path / "d", traces)
    out = tmp_path / "out"
    first = sharded.run_local(shards, out, backend)
    assert len(first.verified) == 3 and not first.errors and not first.resumed
    for shard in shards:  # each shard's scores are what verifying that file alone writes
        alone = api.verify(shard, scores=tmp_path / f"{shard.stem}.alone.scores.parquet", backend=backend)
        assert _same(read_scores(sharded.ShardFiles.of(out, shard).scores), read_scores(alone.scored.scores_path))
    whole = api.verify(traces, backend=backend)
    merged = sharded.merge(out, shards)
    assert (merged.tokens, merged.traces) == (whole.summary.tokens, whole.summary.traces)
    assert merged.exact_match_rate == whole.summary.exact_match_rate == 1.0
    assert merged.mean_margin == whole.summary.mean_margin

    stamps = {s: sharded.ShardFiles.of(out, s).record.stat().st_mtime_ns for s in shards}
    again = sharded.run_local(shards, out, backend)
    assert again.verified == [] and sorted(again.resumed) == [str(s) for s in shards]
    assert {s: sharded.ShardFiles.of(out, s).record.stat().st_mtime_ns for s in shards} == stamps
    write_traces(traces[2:3], shards[1])  # the shard changed: only it is verified again
    third = sharded.run_local(shards, out, backend)
    assert third.verified == [str(shards[1])] and len(third.resumed) == 2
    assert sharded.merge(out, shards).traces == 5


def test_a_malformed_shard_is_named_with_its_record_and_the_others_finish(tmp_path, traces, backend):
    shards = _shards(tmp_path / "d", traces)
    good = shards[0].read_text().splitlines()
    bad = tmp_path / "d" / "part9.jsonl"
    bad.write_text(good[0] + "\n{not json\n")
    result = sharded.run_local(sharded.find_shards(tmp_path / "d"), tmp_path / "out", backend)
    assert len(result.verified) == 3 and len(result.errors) == 1
    assert f"{bad}:2" in result.errors[0]
    assert not sharded.ShardFiles.of(tmp_path / "out", bad).scores.exists()
    run = CliRunner().invoke(app, ["verify", str(tmp_path / "d"), "--out-dir", str(tmp_path / "cli")])
    assert run.exit_code == 2, run.output
    assert f"{bad}:2" in run.output and "3 shard(s) verified now" in run.output
    skip = CliRunner().invoke(app, ["verify", str(tmp_path / "d"), "--out-dir", str(tmp_path / "cli"),
                                    "--skip-invalid", "--json", str(tmp_path / "s.json")])
    assert skip.exit_code == 0, skip.output
    report = json.loads((tmp_path / "s.json").read_text())
    assert len(report["resumed"]) == 3 and len(report["errors"]) == 1 and report["tokens"] > 0


# -- on a local Ray cluster -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield ray
    ray.shutdown()


def _dies_once(marker: Path) -> type:
    """A verifier that kills its own process (a lost worker) the first time it is given ``part1``
    (defined in a closure, so Ray ships it to the workers by value, marker path included)."""

    class DiesOnce(sharded.ShardVerifier):
        def __call__(self, batch):
            if any(str(s).endswith("part1.jsonl") for s in batch["shard"]) and not marker.exists():
                marker.write_text("killed")
                os._exit(1)
            return super().__call__(batch)

    return DiesOnce


def test_ray_workers_score_bit_identically_and_survive_a_killed_worker(ray_cluster, tmp_path, traces, backend):
    """Against a local run in a fresh process, as a user's ``verinfer verify DIR`` runs: this worker's
    own history (twice in whole-suite runs, never alone) gave other bits than fresh Ray workers."""
    shards = _shards(tmp_path / "d", traces)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "verinfer.cli", "verify", str(tmp_path / "d"), "--out-dir",
                    str(tmp_path / "local")], env=env, check=True, capture_output=True, timeout=600)
    local = sharded.run_local(shards, tmp_path / "local", backend)  # resumes: every shard is done
    assert local.verified == [] and len(local.resumed) == len(shards)
    local = replace(local, verified=local.resumed)
    marker = tmp_path / "killed"
    result = sharded.run_ray(shards, tmp_path / "ray", backend.model_id, workers=2, verifier=_dies_once(marker))
    assert marker.read_text() == "killed"  # a worker really died mid-run
    assert sorted(result.verified) == sorted(local.verified) and not result.errors
    for shard in shards:
        differ = _differences(read_scores(sharded.ShardFiles.of(tmp_path / "ray", shard).scores),
                              read_scores(sharded.ShardFiles.of(tmp_path / "local", shard).scores))
        assert not differ, f"{shard.name}: {differ}"
    merged = sharded.merge(tmp_path / "ray", shards)
    assert merged.tokens == sharded.merge(tmp_path / "local", shards).tokens  # each shard scored once


def test_ray_cli_resumes_and_reports_a_bad_shard(ray_cluster, tmp_path, traces):
    shards = _shards(tmp_path / "d", traces)
    (tmp_path / "d" / "part9.jsonl").write_text('{"schema": "verinfer.trace/1"}\n')
    out = tmp_path / "out"
    run = CliRunner().invoke(app, ["verify", str(tmp_path / "d"), "--ray", "--workers", "2", "--out-dir", str(out),
                                   "--json", str(tmp_path / "a.json")])
    assert run.exit_code == 2, run.output
    assert "part9.jsonl:1" in run.output
    assert all(sharded.done_record(out, s) for s in shards)
    write_traces([replace(traces[0], id="extra")], tmp_path / "d" / "part9.jsonl")  # fixed: only it is redone
    again = CliRunner().invoke(app, ["verify", str(tmp_path / "d"), "--ray", "--out-dir", str(out),
                                     "--json", str(tmp_path / "b.json")])
    assert again.exit_code == 0, again.output
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["verified"] == [str(tmp_path / "d" / "part9.jsonl")] and len(report["resumed"]) == 3
    assert report["traces"] == 7 and report["exact_match_rate"] == 1.0
