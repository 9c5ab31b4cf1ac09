"""Every recorded result under experiments/results is listed in experiments/README.md with the
command that regenerates it, and every program, subcommand and option those commands name exists;
every script under experiments/ and benchmarks/ has a real ``--help``.

``--help`` runs each script as ``__main__`` with ``sys.argv`` as a reader's ``python SCRIPT --help`` sets it:
it must print a usage screen and exit 0 without running anything. Every script runs in one fresh
interpreter, one after the other (``runpy``; the script's folder first on ``sys.path``, as for ``python
SCRIPT``), so the imports they share (torch, transformers: about 7 s here) are paid once, not once per
script; a script with a subcommand runs alone. The time limit is a hang guard (a script that ignored
``--help`` would run its whole experiment; the guard names the script it was in), not a speed claim:
nothing here depends on how fast the machine is."""

from __future__ import annotations

import json
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


# Runs each script of argv[2:] as ``python SCRIPT --help`` would (cwd: the checkout), in turn, and prints one
# JSON object: script -> [exit code, stdout, stderr]. Each name goes to the real stderr first, so a run
# that hangs shows which script it hung in.
_HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for script in sys.argv[1:]:
    print(script, file=sys.__stderr__, flush=True)
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    sys.argv, folder = [script, '--help'], script.rsplit('/', 1)[0]
    sys.path.insert(0, folder)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(script, run_name='__main__')
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        code, stderr = 1, io.StringIO(stderr.getvalue() + traceback.format_exc())
    finally:
        sys.path.remove(folder)
    out[script] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out), file=sys.__stdout__)
"""


@cache
def _every_help() -> dict[str, list]:
    try:
        proc = subprocess.run([sys.executable, "-c", _HELP_ALL, *SCRIPTS], capture_output=True, text=True,
                              timeout=HANG_GUARD_S, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        started = (exc.stderr or b"").decode(errors="replace").split()
        pytest.fail(f"{started[-1] if started else SCRIPTS[0]} --help still running after {HANG_GUARD_S} s: "
                    "it ignores --help")
    assert proc.returncode == 0, f"the --help runner failed: {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


@cache
def help_screen(script: str, *sub: str) -> str:
    """stdout of ``python script [sub] --help``; fails unless it is a usage screen and exits 0."""
    if sub:
        try:
            proc = subprocess.run([sys.executable, str(ROOT / script), *sub, "--help"], capture_output=True,
                                  text=True, timeout=HANG_GUARD_S, cwd=ROOT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{script} {' '.join(sub)} --help still running after {HANG_GUARD_S} s: it ignores --help")
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        code, stdout, stderr = _every_help()[script]
    assert code == 0, f"{script} {' '.join(sub)} --help exited {code}: {stderr[-2000:]}"
    assert stdout.lower().startswith("usage:"), f"{script} --help printed more than usage: {stdout[:300]}"
    return stdout


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
