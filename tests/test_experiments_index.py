"""Every recorded result under experiments/results is listed in experiments/README.md with the
command that regenerates it, and every program, subcommand and option those commands name exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "experiments" / "README.md"


def rows() -> list[tuple[str, str]]:
    out = []
    for line in INDEX.read_text().splitlines():
        m = re.match(r"\|\s*(.+?)\s*\|\s*`(.+)`\s*\|$", line)
        if m and not m.group(1).startswith("result"):
            out.append((m.group(1), m.group(2)))
    return out


def test_every_result_is_listed():
    listed = " ".join(result for result, _ in rows())
    results = ROOT / "experiments" / "results"
    missing = [p.name for p in results.iterdir()
               if f"experiments/results/{p.name}{'/' if p.is_dir() else ''}" not in listed]
    assert not missing, f"results without a command in experiments/README.md: {missing}"


def _verinfer_command(words: list[str]):
    from verinfer.cli.main import app

    cmd = typer.main.get_command(app)
    rest = words[1:]
    while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
        assert rest[0] in cmd.commands, f"no subcommand {rest[0]!r}"
        cmd, rest = cmd.commands[rest[0]], rest[1:]
    return cmd, rest


@pytest.mark.parametrize("result, command", rows())
def test_each_command_exists_with_its_options(result, command):
    words = shlex.split(command)
    flags = [w.split("=")[0] for w in words if w.startswith("--")]
    if words[0] == "verinfer":
        cmd, _ = _verinfer_command(words)
        known = {o for p in cmd.params for o in getattr(p, "opts", [])}
    else:
        assert words[:1] == ["python"], command
        script = ROOT / words[1]
        assert script.is_file(), f"{words[1]} does not exist"
        sub = [w for w in words[2:3] if not w.startswith("-")]
        proc = subprocess.run([sys.executable, str(script), *sub, "--help"], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        known = set(re.findall(r"--[a-z0-9-]+", proc.stdout))
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{command}: unknown option(s) {unknown}"
