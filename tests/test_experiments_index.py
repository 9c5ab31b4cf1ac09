"""Every recorded result under experiments/results is listed in experiments/README.md with the
command that regenerates it, and every program, subcommand and option those commands name exists;
every script under experiments/ and benchmarks/ has a real ``--help``.

``--help`` runs in a fresh interpreter, as a reader would type it: it must print a usage screen and
exit 0 without running anything. The time limit is a hang guard (a script that ignored ``--help``
would run its whole experiment), not a speed claim: nothing here depends on how fast the machine is."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "experiments" / "README.md"
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for folder in ("experiments", "benchmarks")
                 for p in (ROOT / folder).glob("*.py"))
HANG_GUARD_S = 600


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


@cache
def help_screen(script: str, *sub: str) -> str:
    """stdout of ``python script [sub] --help``; fails unless it is a usage screen and exits 0."""
    try:
        proc = subprocess.run([sys.executable, str(ROOT / script), *sub, "--help"], capture_output=True,
                              text=True, timeout=HANG_GUARD_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} {' '.join(sub)} --help still running after {HANG_GUARD_S} s: it ignores --help")
    assert proc.returncode == 0, f"{script} {' '.join(sub)} --help exited {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.lower().startswith("usage:"), f"{script} --help printed more than usage: {proc.stdout[:300]}"
    return proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_has_a_real_help(script):
    screen = help_screen(script)
    assert "--help" in screen and Path(script).name in screen


@pytest.mark.parametrize("result, command", rows())
def test_each_command_exists_with_its_options(result, command):
    words = shlex.split(command)
    flags = [w.split("=")[0] for w in words if w.startswith("--")]
    if words[0] == "verinfer":
        cmd, _ = _verinfer_command(words)
        known = {o for p in cmd.params for o in getattr(p, "opts", [])}
    else:
        assert words[:1] == ["python"], command
        assert words[1] in SCRIPTS, f"{words[1]} does not exist"
        sub = [w for w in words[2:3] if not w.startswith("-")]
        known = set(re.findall(r"--[a-z0-9-]+", help_screen(words[1], *sub)))
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{command}: unknown option(s) {unknown}"
