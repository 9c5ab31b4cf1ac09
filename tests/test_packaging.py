"""Packaging (issue #37): the version has one source, ``verinfer --version`` prints it, and the wheel
check that ``.ci/run`` applies to a built wheel names a package file the wheel lacks."""

from __future__ import annotations

import subprocess
import tomllib
import zipfile
from pathlib import Path

from typer.testing import CliRunner

import verinfer
from tests.installed_wheel import missing_from_wheel
from verinfer.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def test_version_has_one_source_and_the_cli_prints_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "verinfer.__version__"}
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"verinfer {verinfer.__version__}\n"


def test_wheel_check_names_a_file_the_wheel_lacks(tmp_path):
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "src/verinfer"], capture_output=True, text=True,
                             check=True).stdout.split()
    data = [p for p in tracked if p.endswith(".json")]
    assert data, "the package ships data files"
    complete, partial = tmp_path / "complete.whl", tmp_path / "partial.whl"
    for wheel, left_out in ((complete, None), (partial, data[0])):
        with zipfile.ZipFile(wheel, "w") as z:
            for p in tracked:
                if p != left_out:
                    z.writestr(p.removeprefix("src/"), "")
    assert missing_from_wheel(complete, ROOT) == []
    assert missing_from_wheel(partial, ROOT) == [data[0]]
