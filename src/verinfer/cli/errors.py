"""One way every command line reports bad input: one red line on stderr and exit code 2.

Its own module so sub-apps (audit, margingate) can use it without importing ``verinfer.cli``,
which imports them.
"""

from __future__ import annotations

import functools
from typing import NoReturn

import typer
from rich.console import Console

err = Console(stderr=True)


def fail(message: str) -> NoReturn:
    """Report bad input as one red line on stderr and exit with code 2."""
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def one_line_errors(fn):
    """Turn input errors into one red line and exit code 2 (never a traceback)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from verinfer.models.load import ModelNotAvailable
        from verinfer.prompts import PromptError
        from verinfer.trace import TraceError

        try:
            return fn(*args, **kwargs)
        except (TraceError, PromptError, ModelNotAvailable, ValueError, OSError) as exc:
            fail(str(exc))
    return wrapper
