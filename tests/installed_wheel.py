"""What an installed wheel must do (issue #37, item 3): ``.ci/run`` builds the sdist and the wheel,
installs the wheel (not editable) with the ``production`` extra into a fresh venv, and runs this file
there, outside the clone, so that nothing resolves to ``src/``:

    python tests/installed_wheel.py files WHEEL REPO   # every tracked file under src/verinfer is in WHEEL
    python tests/installed_wheel.py run WORKDIR        # the installed commands, end to end
    python tests/installed_wheel.py help               # every command's --help (any install, core only too)

``run`` checks, each with a one-line reason when it fails (exit 1): ``verinfer --version`` prints the
installed version; a small demo judges its honest set CONSISTENT and its wrong-seed set INCONSISTENT and
renders its audit report (templates); seeded traces from ``verinfer generate`` are judged by a shipped
calibration; greedy chat traffic through ``verinfer gateway`` in front of ``verinfer serve`` is
recorded, ``verinfer monitor --once`` judges it with the shipped greedy bands into a database its
Alembic migrations create; ``verinfer dashboard`` serves the page, a window's drill-down and
``/metrics``. Standard library and httpx (a core dependency) only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path

GUARD_S = 600  # a hang guard per step on a loaded 2-core machine, never a speed assertion


class Failed(Exception):
    """One check of the installed wheel failed; the message says which and why."""


def missing_from_wheel(wheel: Path, repo: Path) -> list[str]:
    """Tracked files of the package (``git ls-files src/verinfer``) that the wheel does not carry."""
    tracked = subprocess.run(["git", "-C", str(repo), "ls-files", "src/verinfer"], capture_output=True,
                             text=True, check=True).stdout.split()
    with zipfile.ZipFile(wheel) as z:
        carried = set(z.namelist())
    return [p for p in tracked if p.removeprefix("src/") not in carried]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_status(args: list[str], cwd: Path, env: dict, ok: tuple[int, ...] = (0,)) -> tuple[int, str]:
    """Exit status and output (stdout, then stderr) of ``args``; ``Failed`` when the status is not in ``ok``."""
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=GUARD_S)
    if proc.returncode not in ok:
        raise Failed(f"`{' '.join(map(str, args))}` exited {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
    return proc.returncode, proc.stdout + proc.stderr


def _run(args: list[str], cwd: Path, env: dict, ok: tuple[int, ...] = (0,)) -> str:
    return run_status(args, cwd, env, ok)[1]


@contextlib.contextmanager
def server(args: list[str], port: int, ready: str, cwd: Path, env: dict):
    """``args`` running in the background until ``ready`` answers 200 on ``port``; SIGTERM at the end.
    Standard library only (``.ci/extras_matrix.py`` runs it outside any venv)."""
    log = cwd / f"{Path(args[0]).name}-{args[1]}-{port}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + GUARD_S
        while True:
            if proc.poll() is not None:
                raise Failed(f"`{' '.join(args)}` exited {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):  # refused, or an HTTP error status
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready}", timeout=10):
                    break
            if time.monotonic() > deadline:
                raise Failed(f"`{' '.join(args)}` did not answer {ready} on port {port}: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def command_paths() -> list[list[str]]:
    """Every command and subcommand of the installed ``verinfer``, as argv prefixes."""
    import typer

    from verinfer.cli.main import app

    def walk(cmd, path: list[str]) -> list[list[str]]:  # a click Group (typer may vendor click) has .commands
        found = [path]
        if isinstance(getattr(cmd, "commands", None), dict):
            for name, sub in sorted(cmd.commands.items()):
                found += walk(sub, [*path, name])
        return found

    return walk(typer.main.get_command(app), [])


def check_help(verinfer: str = "", cwd: Path | None = None, env: dict | None = None) -> str:
    """``--help`` of every command exits 0 and prints its usage (one process: no extra is imported for it)."""
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    paths = command_paths()
    for path in paths:
        result = CliRunner().invoke(app, [*path, "--help"])
        if result.exit_code != 0 or "Usage:" not in result.output:
            raise Failed(f"`verinfer {' '.join(path)} --help` exited {result.exit_code}: {result.output[-1000:]}"
                         f"{result.exception!r}")
    return f"--help of {len(paths)} commands"


def check_version(verinfer: str, cwd: Path, env: dict) -> str:
    import verinfer as package

    installed = metadata.version("verinfer")
    if "site-packages" not in str(Path(package.__file__).resolve()):
        raise Failed(f"verinfer imports from {package.__file__}, not from the installed wheel")
    printed = _run([verinfer, "--version"], cwd, env).strip()
    if printed != f"verinfer {installed}":
        raise Failed(f"`verinfer --version` printed {printed!r}, not 'verinfer {installed}'")
    return printed


def check_demo(verinfer: str, cwd: Path, env: dict) -> str:
    """A smaller demo than the quick start's (which ``.ci/run`` runs verbatim in its own venv): the same
    stages, the same verdicts, the audit report rendered from the wheel's templates."""
    out = _run([verinfer, "demo", "--n", "8", "--max-tokens", "32", "--audit-prompts", "2"], cwd, env)
    for line in ("honest: CONSISTENT with the claimed configuration", "wrong seed: INCONSISTENT with the claimed"):
        if not any(printed.startswith(line) for printed in out.splitlines()):
            raise Failed(f"the demo did not print {line!r}: {out[-3000:]}")
    report = cwd / "verinfer-demo" / "audit" / "audit.html"
    if not report.is_file() or "<html" not in report.read_text()[:2000].lower():
        raise Failed(f"the demo did not render {report}")
    return "demo: honest CONSISTENT, wrong seed INCONSISTENT, audit.html rendered"


def check_shipped_calibration(verinfer: str, cwd: Path, env: dict) -> str:
    traces = cwd / "seeded.jsonl"
    _run([verinfer, "generate", "-o", str(traces), "--n", "4", "--max-tokens", "24"], cwd, env)
    out = _run([verinfer, "verify", str(traces)], cwd, env)
    shipped = "calibration-smollm2-135m-vllm-t1-k50-p0.95-minp0.json"
    if shipped not in out or "CONSISTENT" not in out:
        raise Failed(f"`verinfer verify` did not judge vLLM-seeded traces with the shipped {shipped}: {out[-3000:]}")
    return f"verify: judged by the shipped {shipped}"


def _chat(port: int, prompt: str, stream: bool = False) -> None:
    import httpx

    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": 16, "stream": stream}
    with httpx.Client(timeout=GUARD_S) as client:
        if stream:
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                if r.status_code != 200 or "data: [DONE]" not in r.read().decode():
                    raise Failed(f"a streamed chat through the gateway answered {r.status_code}")
            return
        r = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        if r.status_code != 200 or not r.json()["choices"][0]["message"]["content"]:
            raise Failed(f"a chat through the gateway answered {r.status_code}: {r.text[:500]}")


def check_production(verinfer: str, cwd: Path, env: dict) -> str:
    import httpx

    traffic, db = cwd / "traffic", cwd / "history.db"
    engine, gateway, dashboard = free_port(), free_port(), free_port()
    with server([verinfer, "serve", "--port", str(engine)], engine, "/v1/models", cwd, env):
        with server([verinfer, "gateway", "--upstream", f"http://127.0.0.1:{engine}", "--port", str(gateway),
                      "--traces", str(traffic), "--model", "smollm2-135m", "--provider", "wheel"],
                     gateway, "/gateway/health", cwd, env):
            for i, prompt in enumerate(["Name three colours.", "What is 2 + 2?", "Say hello in French.",
                                        "Write a haiku about rain."]):
                _chat(gateway, prompt, stream=i == 3)
        # SIGTERM wrote the open shard
    shards = sorted(traffic.glob("*.parquet"))
    if not shards:
        raise Failed(f"the gateway wrote no shard into {traffic}")
    _run([verinfer, "monitor", str(traffic), "--db", f"sqlite:///{db}", "--once"], cwd, env)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        heads = [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")]
        windows = conn.execute("SELECT id, provider, traces, verdict, judged_by FROM windows").fetchall()
    if len(heads) != 1:
        raise Failed(f"the monitor's database has no Alembic head: {heads}")
    if not windows or {w[1] for w in windows} != {"wheel"} or sum(w[2] for w in windows) != 4:
        raise Failed(f"the monitor recorded {windows}, not the 4 traces of provider 'wheel'")
    if any(w[3] != "CONSISTENT" or "bands-smollm2-135m-greedy.json" not in (w[4] or "") for w in windows):
        raise Failed(f"greedy honest traffic was not judged CONSISTENT by the shipped greedy bands: {windows}")
    with server([verinfer, "dashboard", "--db", f"sqlite:///{db}", "--port", str(dashboard)], dashboard, "/health",
                 cwd, env):
        base = f"http://127.0.0.1:{dashboard}"
        page, window = httpx.get(base + "/", timeout=60), httpx.get(f"{base}/window/{windows[0][0]}", timeout=60)
        metrics = httpx.get(base + "/metrics", timeout=60)
    if page.status_code != 200 or "wheel" not in page.text or "CONSISTENT" not in page.text:
        raise Failed(f"the dashboard page answered {page.status_code}: {page.text[:500]}")
    if window.status_code != 200 or "wheel" not in window.text:
        raise Failed(f"the window page answered {window.status_code}: {window.text[:500]}")
    wanted = re.compile(r'^verinfer_verdict\{[^}]*provider="wheel"[^}]*verdict="CONSISTENT"[^}]*\} 1\.0$', re.M)
    if metrics.status_code != 200 or not wanted.search(metrics.text):
        raise Failed(f"/metrics answered {metrics.status_code} without {wanted.pattern}: {metrics.text[-1500:]}")
    return (f"production: {len(shards)} shard(s), {sum(w[2] for w in windows)} traces CONSISTENT by the shipped "
            f"greedy bands, Alembic head {heads[0]}, dashboard page, window page and /metrics served")


def run(workdir: Path) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    verinfer = str(Path(sys.executable).with_name("verinfer"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    failures = 0
    for check in (check_version, check_help, check_shipped_calibration, check_production, check_demo):
        start = time.monotonic()
        try:
            said = check(verinfer, workdir, env)
        except (Failed, subprocess.TimeoutExpired) as exc:
            failures += 1
            print(f"installed wheel: FAILED {check.__name__}: {exc}", file=sys.stderr)
            continue
        print(f"installed wheel: ok ({time.monotonic() - start:.0f} s) {said}")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["files"] and len(argv) == 3:
        lost = missing_from_wheel(Path(argv[1]), Path(argv[2]))
        for path in lost:
            print(f"installed wheel: {argv[1]} lacks {path} (package data not declared in pyproject.toml)",
                  file=sys.stderr)
        print(json.dumps({"wheel": Path(argv[1]).name, "missing": len(lost)}))
        return 1 if lost else 0
    if argv[:1] == ["run"] and len(argv) == 2:
        return run(Path(argv[1]))
    if argv == ["help"]:
        try:
            print(f"installed: {check_help()}")
        except Failed as exc:
            print(f"installed: FAILED {exc}", file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
