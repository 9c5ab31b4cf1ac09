"""The command line invoked in the test's own process (typer's CliRunner), for tests of what a command
does rather than of the process it runs in: the model a command loads stays loaded for the next, so a
test costs its work, not an interpreter start and a model load per command (about 10 s each here).
Tests of the process itself (the entry point, signals, what reaches the terminal) start real ones."""

from __future__ import annotations

import contextlib
import os
import subprocess


def invoke(*args, cwd=None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The app in this process, its exit code, stdout and stderr as a process's; an exception the app let
    escape is re-raised (a process would print its traceback and exit 1). The torch thread count a
    command sets (``--threads``) is restored after it; ``env`` is set for the command's duration."""
    import torch
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    threads = torch.get_num_threads()
    try:
        with contextlib.chdir(cwd or os.getcwd()):
            result = CliRunner().invoke(app, [str(a) for a in args],
                                        env={"HF_HUB_OFFLINE": "1", "COLUMNS": "80", **(env or {})})
    finally:
        torch.set_num_threads(threads)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["verinfer", *map(str, args)], result.exit_code, result.stdout, result.stderr)
