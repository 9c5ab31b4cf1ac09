"""The one place command lines make their rich consoles.

On a terminal rich fits output to the window; into a file or a pipe it would wrap at 80 columns
(its fallback width), breaking table rows and long lines for whoever reads or greps them. There
it gets a width no line reaches, so tables and lines come out whole (issue #31, item 7). ``--help``
likewise: typer's rich panels would wrap at 80 columns (or pad every line to a wide width), so
outside a terminal help is click's plain text, one line per option (``help_style``).
"""

from __future__ import annotations

import sys

from rich.console import Console

PIPE_WIDTH = 1_000  # wider than any table or line the commands print: nothing wraps in files and pipes


def _terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): the terminal's width on a terminal, no wrapping elsewhere."""
    return Console(stderr=stderr, width=None if _terminal(sys.stderr if stderr else sys.stdout) else PIPE_WIDTH)


def help_style() -> dict:
    """Keywords of every ``typer.Typer``: rich help panels on a terminal; elsewhere click's plain
    help at ``PIPE_WIDTH`` (context settings are inherited by sub-commands), so no help line wraps."""
    if _terminal(sys.stdout):
        return {}
    return {"rich_markup_mode": None,
            "context_settings": {"terminal_width": PIPE_WIDTH, "max_content_width": PIPE_WIDTH}}
