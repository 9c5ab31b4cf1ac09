"""Input checks that answer fast and help that does not wrap (issue #31, items 4 and 7).

``verinfer --help`` and bad input (a missing file, a bad option, an old script's provider id as
``audit run --model``) are answered before torch or transformers is imported: the command line
imports them inside command bodies, and ``--threads`` hands its count to torch through
``OMP_NUM_THREADS`` while torch is not loaded yet. Each case runs the real entry point in a fresh
process and reports which heavy modules it imported (``benchmarks/cli_startup.py`` times it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numba")

# Runs the command line as `python -m verinfer.cli ARGS` does, then prints its exit code and the heavy
# modules imported, as the last line of stdout.
RUNNER = """
import json, runpy, sys
sys.argv = ["verinfer", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("verinfer.cli", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH")}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_cli(*args, cwd=None) -> tuple[dict, str, str]:
    proc = subprocess.run([sys.executable, "-c", RUNNER, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=_env(), cwd=cwd)
    *out, last = proc.stdout.splitlines() or [""]
    return json.loads(last), "\n".join(out), proc.stderr


def test_importing_the_command_line_imports_no_model_code():
    code = f"import sys, verinfer.cli.main; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env(),
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


EVERY_HELP = """
import sys, typer
from typer.testing import CliRunner
from verinfer.cli.main import app

def walk(cmd, path=()):
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from walk(sub, (*path, name))
    else:
        yield path

paths = list(walk(typer.main.get_command(app)))
failed = [p for p in paths if CliRunner().invoke(app, [*p, "--help"]).exit_code != 0]
print(len(paths), failed, [m for m in %r if m in sys.modules])
""" % (HEAVY,)


def test_every_commands_help_imports_no_model_code():
    out = subprocess.run([sys.executable, "-c", EVERY_HELP], capture_output=True, text=True, timeout=300,
                         env=_env(), check=True)
    count, rest = out.stdout.split(" ", 1)
    assert int(count) >= 15 and rest.strip() == "[] []", out.stdout


PROVIDER = ["-p", "a=http://127.0.0.1:1/v1"]


@pytest.mark.parametrize("args, exit_code, says", [
    (["--help"], 0, "Commands"),
    (["verify", "--help"], 0, "--verdict-batch"),
    (["audit", "run", "--help"], 0, "--served-model"),
    (["verify", "missing.jsonl"], 2, "missing.jsonl: no such file or directory"),
    (["verify", "missing.jsonl", "--threads", "1"], 2, "missing.jsonl"),  # --threads parsed first: still no torch
    (["verify", "t.jsonl", "--calibration", "missing.json"], 2, "--calibration missing.json: does not exist"),
    (["calibrate", "missing.parquet", "-o", "c.json"], 2, "missing.parquet: does not exist"),
    (["diagnose", "missing.jsonl"], 2, "TRACES missing.jsonl: does not exist"),
    (["generate", "-o", "g.jsonl", "--n", "many"], 2, "'--n'"),
    (["generate", "-o", "g.jsonl", "--prompts", "missing.jsonl"], 2, "--prompts missing.jsonl"),
    (["audit", "run", *PROVIDER, "--providers-file", "missing.json"], 2, "--providers-file missing.json"),
    (["audit", "run", *PROVIDER, "--model", "gpt-4o"], 2, "--served-model gpt-4o"),
    (["audit", "run", "-p", "no-url"], 2, "expected NAME=URL"),
    (["serve", "--bogus"], 2, "--bogus"),
])
def test_help_and_bad_input_answer_without_torch(tmp_path, args, exit_code, says):
    (tmp_path / "t.jsonl").write_text("")
    result, out, err = run_cli(*args, cwd=tmp_path)
    assert result == {"exit": exit_code, "heavy": []}, (result, out, err)
    assert says in out + err, out + err
    if exit_code == 2 and "Usage:" not in err:  # verinfer's own checks: one line (click's usage errors: its own form)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), err


def test_the_thread_count_reaches_torch_imported_after_parsing():
    """Parsing before torch is imported sets OMP_NUM_THREADS; torch, imported by the command body,
    starts with that count (here 1, where torch's own default on a multi-core machine is more)."""
    code = ("import os, sys; os.environ.pop('OMP_NUM_THREADS', None)\n"
            "from verinfer.machine import use_threads\n"
            "n = use_threads(1); assert 'torch' not in sys.modules\n"
            "import torch; print(n, os.environ['OMP_NUM_THREADS'], torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env(),
                         check=True)
    assert out.stdout.split() == ["1", "1", "1"], out.stdout + out.stderr


def test_help_is_full_width_in_a_pipe():
    """Outside a terminal (COLUMNS unset) help is one line per option, however long, as tables are."""
    result, out, err = run_cli("audit", "run", "--help")
    assert result["exit"] == 0, err
    served = next(line for line in out.splitlines() if line.lstrip().startswith("--served-model"))
    assert served.rstrip().endswith("a providers file's 'model' wins"), out  # the whole help text on its line
    assert len(served) > 120 and len(served.rstrip()) == len(served)  # wider than 80 columns, and not padded
    result, out, err = run_cli("--help")
    calibrate = next(line for line in out.splitlines() if line.lstrip().startswith("calibrate"))
    assert calibrate.rstrip().endswith("the honest precisions it covers)."), out
