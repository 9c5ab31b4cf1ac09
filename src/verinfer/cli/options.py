"""One vocabulary of options: the same flag means the same thing in every command.

``--model`` (alias, .gguf file, local directory or cached hub id), ``--dtype``, ``--device``,
``--prompts`` / ``--n`` / ``--prompt-seed`` (which prompts), ``--seed`` (the first request's
sampling seed: request i uses seed + i), ``--max-tokens`` (new tokens per request), ``--batch-size``
(requests decoded together), ``--fpr`` (target false-positive rate), ``--out`` / ``-o``.
Old spellings (``--max-new-tokens``, ``--batch``, ``--n-prompts``) are hidden aliases for one
release and print a deprecation note.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

from verinfer.cli.errors import fail
from verinfer.models.load import DEFAULT_MODEL

err = Console(stderr=True)


def model(default: str = DEFAULT_MODEL, help: str = "model alias, .gguf file, local directory or cached hub id"):
    return typer.Option(default, "--model", help=help)


def dtype(default: str = "float32", help: str = "compute dtype (float32, bfloat16)"):
    return typer.Option(default, "--dtype", help=help)


def device(default: str = "cpu"):
    return typer.Option(default, "--device", help="torch device of the model (cpu, cuda, cuda:1, ...)",
                        callback=_check_device)


def _check_device(value: str) -> str:
    """Every command's ``--device``, checked as it is parsed: one line and exit 2 for a device torch
    cannot name or this machine lacks (``verinfer.api.check_device``)."""
    from verinfer.api import check_device

    try:
        check_device(value)
    except ValueError as exc:
        fail(str(exc))
    return value


def prompts(default: str = "chitchat"):
    return typer.Option(default, "--prompts", help="built-in prompt set (chitchat, human-eval, gsm8k) or a JSONL file")


def n(default: int = 16, help: str = "number of prompts"):
    return typer.Option(default, "--n", help=help)


def prompt_seed(default: int = 0):
    return typer.Option(default, "--prompt-seed", help="which prompts a built-in set samples")


def seed(default: int = 1000):
    return typer.Option(default, "--seed", help="the first request's sampling seed: request i uses seed + i")


def max_tokens(default: int = 64):
    return typer.Option(default, "--max-tokens", help="most new tokens per request")


def batch_size(default: int = 8, help: str = "requests decoded together"):
    return typer.Option(default, "--batch-size", help=help)


def fpr(default: float = 0.01):
    return typer.Option(default, "--fpr", help="target false-positive rate")


def hidden(flag: str):
    """A deprecated spelling, kept hidden for one release."""
    return typer.Option(None, flag, hidden=True)


def alias(value, old: Optional[object], old_flag: str, new_flag: str):
    """The value given under the old spelling wins (with a note); else the current option's."""
    if old is None:
        return value
    err.print(f"[yellow]note:[/yellow] {old_flag} is deprecated; use {new_flag}", highlight=False)
    return old
