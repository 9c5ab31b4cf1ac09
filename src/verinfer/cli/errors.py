"""One way every command line reports bad input: one red line on stderr and exit code 2.

Its own module so sub-apps (audit, margingate) can use it without importing ``verinfer.cli``,
which imports them.
"""

from __future__ import annotations

import functools
from typing import NoReturn

import typer
from rich.markup import escape

from verinfer.cli.console import console

err = console(stderr=True)


def fail(message: str) -> NoReturn:
    """Report bad input as one red line on stderr and exit with code 2 (the message is text, not
    markup: ``pip install -e '.[ray]'`` keeps its brackets)."""
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def one_line_errors(fn):
    """Turn input errors into one red line and exit code 2 (never a traceback)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from verinfer.extras import MissingExtra
        from verinfer.models.load import ModelNotAvailable, ReferenceFailed

        try:  # TraceError, PromptError, StreamError... are ValueErrors
            return fn(*args, **kwargs)
        except (ModelNotAvailable, ReferenceFailed, MissingExtra, ValueError, OSError) as exc:
            fail(str(exc))
    return wrapper
