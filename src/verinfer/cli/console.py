"""The one place command lines make their rich consoles.

On a terminal rich fits output to the window; into a file or a pipe it would wrap at 80 columns
(its fallback width), breaking table rows and long lines for whoever reads or greps them. There
it gets a width no line reaches, so tables and lines come out whole (issue #31, item 7).
"""

from __future__ import annotations

import sys

from rich.console import Console

PIPE_WIDTH = 1_000  # wider than any table or line the commands print: nothing wraps in files and pipes


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): the terminal's width on a terminal, no wrapping elsewhere."""
    stream = sys.stderr if stderr else sys.stdout
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        terminal = False
    return Console(stderr=stderr, width=None if terminal else PIPE_WIDTH)
