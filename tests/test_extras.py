"""Optional extras (issue #31, item 6): the core install runs the demo; a command that needs an extra
says which one in one line (simulated here by making its modules unimportable)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from verinfer import extras
from verinfer.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("ray", "sqlalchemy", "alembic", "prometheus_client", "psycopg")


def _block(monkeypatch, *modules: str) -> None:
    """Make ``modules`` unimportable, as when their extra is not installed (None in sys.modules)."""
    for name in modules:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def test_require_names_the_extra(monkeypatch):
    _block(monkeypatch, "ray")
    with pytest.raises(extras.MissingExtra) as caught:
        extras.require("ray", "verinfer verify --ray")
    assert str(caught.value) == "verinfer verify --ray needs the 'ray' extra: pip install -e '.[ray]'"
    assert caught.value.name == "ray"


def test_require_returns_the_modules_when_installed():
    import sqlalchemy

    assert extras.require("production", "verinfer monitor")[0] is sqlalchemy


@pytest.mark.parametrize("argv, extra, feature", [
    (["verify", "{dir}", "--ray"], "ray", "verinfer verify --ray"),
    (["monitor", "{dir}", "--db", "sqlite:///{dir}/h.db", "--once", "--ray"], "ray", "verinfer monitor --ray"),
    (["monitor", "{dir}", "--db", "sqlite:///{dir}/h.db", "--once"], "production", "verinfer monitor"),
    (["dashboard", "--db", "sqlite:///{dir}/h.db"], "production", "verinfer dashboard"),
    (["gateway", "--upstream", "http://127.0.0.1:9", "--traces", "{dir}/t"], "production", "verinfer gateway"),
])
def test_missing_extra_is_one_line_and_exit_2(tmp_path, monkeypatch, argv, extra, feature):
    (tmp_path / "a.jsonl").write_text("")
    _block(monkeypatch, *extras.EXTRAS[extra])
    result = CliRunner().invoke(app, [a.format(dir=tmp_path) for a in argv])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"error: {extras.message(feature, extra)}"], result.output


def test_core_commands_import_no_extra():
    """The demo, the API and the command line load without any extra's modules (a fresh core install
    has none of them)."""
    code = ("import sys, verinfer.cli.main, verinfer.api, verinfer.demo, verinfer.sharded; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.strip() == ""


def test_pyproject_extras_match():
    """Each extra verinfer.extras names exists; the core needs none of the heavy parts; the test extra
    pulls every extra the tests exercise."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    core = " ".join(project["dependencies"])
    for name in ("ray", "sqlalchemy", "alembic", "psycopg", "prometheus"):
        assert name not in core
    assert set(extras.EXTRAS) <= set(optional)
    assert any(r.startswith("verinfer[") and all(e in r for e in extras.EXTRAS) for r in optional["test"])
