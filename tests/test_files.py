"""The output policy: atomic writes that leave the old file on failure, names that keep the whole
stem, and outputs that never coincide with inputs or each other."""

from __future__ import annotations

import errno
import os

import pytest

from verinfer.files import OutputError, check_outputs, derived_path, write_atomic


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    write_atomic(path, "old")

    def full_disk(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OutputError, match=r"calibration\.json: cannot write \(No space left on device\)"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]


def test_derived_names_keep_the_whole_stem(tmp_path):
    assert derived_path(tmp_path / "run.v1.jsonl", ".scores.parquet").name == "run.v1.scores.parquet"
    assert derived_path(tmp_path / "run.v2.jsonl", ".scores.parquet").name == "run.v2.scores.parquet"
    assert derived_path(tmp_path / "noext", ".scores.parquet").name == "noext.scores.parquet"


def test_outputs_never_equal_inputs_or_each_other(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("x")
    with pytest.raises(OutputError, match="overwrite an input"):
        check_outputs([tmp_path / "." / "t.jsonl"], [trace])
    link = tmp_path / "link.jsonl"
    link.symlink_to(trace)
    with pytest.raises(OutputError, match="overwrite an input"):
        check_outputs([link], [trace])
    with pytest.raises(OutputError, match="another output"):
        check_outputs([tmp_path / "a", tmp_path / "a"], [])
    check_outputs([tmp_path / "a", None, tmp_path / "b"], [trace, None])
