"""One vocabulary of options: the same flag means the same thing in every command.

``--model`` (the model loaded here: alias, .gguf file, local directory or cached hub id; a
provider's model id is ``audit run --served-model``), ``--profile`` (the engine sampler), ``--dtype``, ``--device``,
``--prompts`` / ``--n`` / ``--prompt-seed`` (which prompts), ``--seed`` (the first request's
sampling seed: request i uses seed + i), ``--max-tokens`` (new tokens per request), ``--batch-size``
/ ``--batch-sizes`` (requests decoded together), ``--verdict-batch`` / ``--verdict-batches`` (tokens
per verdict batch), ``--token-ids/--text-only``, ``--fpr`` (target false-positive rate), ``--out`` /
``-o``. Old spellings (``--max-new-tokens``, ``--batch``, ``--n-prompts``, ``--batch-size`` and
``--batch-sizes`` for verdict batches, ``--no-token-ids``, ``--sampler``, ``audit run
--reference-model``) are hidden aliases for one release and
print a deprecation note. ``tests/test_options.py`` walks every command and holds them to this.

Input files are checked as the command line is parsed (``input_file``, ``prompts``): a missing one
is one line and exit 2 before any model loads (issue #31, item 4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from verinfer.cli.console import console
from verinfer.cli.errors import fail
from verinfer.files import missing_input
from verinfer.models.load import DEFAULT_MODEL
from verinfer.sampling.profile_names import PROFILE_NAMES

err = console(stderr=True)


def model(default: str = DEFAULT_MODEL, help: str = "model alias, .gguf file, local directory or cached hub id"):
    return typer.Option(default, "--model", help=help)


def dtype(default: str = "float32", help: str = "compute dtype (float32, bfloat16)"):
    return typer.Option(default, "--dtype", help=help)


def device(default: str = "cpu"):
    return typer.Option(default, "--device", help="torch device of the model (cpu, cuda, cuda:1, ...)",
                        callback=_check_device)


def _check_device(value: str) -> str:
    """Every command's ``--device``, checked as it is parsed: one line and exit 2 for a device torch
    cannot name or this machine lacks (``verinfer.machine.check_device``)."""
    from verinfer.machine import check_device

    try:
        check_device(value)
    except ValueError as exc:
        fail(str(exc))
    return value


def backend():
    return typer.Option("transformers", "--backend", callback=_check_backend, help=(
        "what computes the reference: transformers (the model here, on --device), or vllm[:KEY=VALUE,...]: "
        "its hidden states computed by vLLM itself, with vLLM engine arguments (e.g. "
        "vllm:tensor_parallel_size=4 across GPUs; vLLM's python: $VERINFER_VLLM_PYTHON, else this one)"))


def _check_backend(value: str) -> str:
    """An unknown backend, or vLLM arguments that are not KEY=VALUE, refused as they are parsed."""
    if value != "transformers":
        from verinfer.models.vllm_backend import engine_args

        try:
            engine_args(value)
        except ValueError as exc:
            fail(str(exc))
    return value


def prompts(default: str = "chitchat", help: str = "built-in prompt set (chitchat, human-eval, gsm8k) or a JSONL file"):
    return typer.Option(default, "--prompts", help=help, callback=_check_prompts)


def _check_prompts(value: str) -> str:
    """A prompt set that is neither built in nor a file is refused as it is parsed."""
    from verinfer.prompts import BUILTIN

    if value not in BUILTIN and not Path(value).is_file():
        fail(f"--prompts {value}: neither a built-in set ({', '.join(BUILTIN)}) nor a file "
             + ("(does not exist)" if not Path(value).exists() else "(not a regular file)"))
    return value


def input_file(flag: str, help: str, default: Optional[Path] = None):
    """An input file option (``--calibration``, ``--bands``, ...), checked to exist as it is parsed."""
    return typer.Option(default, flag, help=help, callback=_check_inputs)


def traces(help: str):
    """The TRACES argument (a trace file, a directory or a glob of shards): a plain path that does
    not exist is refused as it is parsed, before torch is even imported."""
    return typer.Argument(..., metavar="TRACES", help=help, callback=_check_traces)


def _check_traces(value: str) -> str:
    if (missing := missing_input(value)) is not None:
        fail(f"TRACES {missing}")
    return value


def input_files(help: str, default=..., metavar: Optional[str] = None):
    """Input file arguments (score files), each checked to exist as it is parsed."""
    return typer.Argument(default, help=help, metavar=metavar, callback=_check_inputs)


def _check_inputs(ctx: typer.Context, param: typer.CallbackParam, value):
    """One line and exit 2 for a missing input file, naming the option and the path."""
    flag = max(param.opts, key=len) if param.param_type_name == "option" else (param.name or "").upper()
    for path in value if isinstance(value, (list, tuple)) else [value]:
        if path is None:
            continue
        if not Path(path).exists():
            fail(f"{flag} {path}: does not exist")
        if Path(path).is_dir():
            fail(f"{flag} {path}: is a directory, not a file")
    return value


def profile(help: str = "sampler profile"):
    """The engine sampler a request is (or was) drawn with, one name in every command (the trace's
    ``sampling.profile``, ``api.generate(profile=)``); ``--sampler`` is its old spelling."""
    return typer.Option("vllm", "--profile", help=f"{help}: {', '.join(PROFILE_NAMES)}")


def n(default: int = 16, help: str = "number of prompts"):
    return typer.Option(default, "--n", help=help)


def prompt_seed(default: int = 0, help: str = "which prompts a built-in set samples"):
    return typer.Option(default, "--prompt-seed", help=help)


def seed(default: int = 1000):
    return typer.Option(default, "--seed", help="the first request's sampling seed: request i uses seed + i")


def max_tokens(default: int = 64):
    return typer.Option(default, "--max-tokens", help="most new tokens per request")


def batch_size(default: int = 8, help: str = "requests decoded together"):
    return typer.Option(default, "--batch-size", help=help)


def verdict_batch(help: str = "tokens per verdict batch (a calibrated size; default: the largest whose whole batches "
                  "could reject)"):
    return typer.Option(None, "--verdict-batch", help=help)


def verdict_batches(default: Optional[str], help: str = "tokens per verdict batch, comma-separated"):
    return typer.Option(default, "--verdict-batches", help=help)


def token_ids(help: str):
    return typer.Option(True, "--token-ids/--text-only", help=help)


def sizes(flag: str, text: str) -> tuple[int, ...]:
    """Comma-separated positive integers (``--verdict-batches``, ``--batch-sizes``), or a one-line error."""
    try:
        values = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag}: sizes must be at least 1, got {text!r}")
    return values


def temperature(default: float = 1.0):
    return typer.Option(default, "--temperature", help="sampling temperature (0: greedy)")


def min_p(default: float = 0.0):
    return typer.Option(default, "--min-p", help="min-p (0: off)")


def fpr(default: float = 0.01):
    return typer.Option(default, "--fpr", help="target false-positive rate")


def threads():
    """``--threads`` on every command that runs a model, applied to torch as it is parsed, so every
    command follows one policy (``verinfer.machine``)."""
    return typer.Option(None, "--threads", min=0, callback=_apply_threads,
                        help="torch intra-op threads (default or 0: OMP_NUM_THREADS if set, 1 in a worker "
                             "process, else the physical cores this process may use that other processes "
                             "leave idle)")


def _apply_threads(value: Optional[int]) -> int:
    from verinfer.machine import use_threads

    return use_threads(value)


def hidden(flag: str):
    """A deprecated spelling, kept hidden for one release (a flag pair such as ``--no-x/--no-no-x``
    for an old boolean)."""
    return typer.Option(None, flag, hidden=True)


def alias(value, old: Optional[object], old_flag: str, new_flag: str):
    """The value given under the old spelling wins (with a note); else the current option's."""
    if old is None:
        return value
    err.print(f"[yellow]note:[/yellow] {old_flag} is deprecated; use {new_flag}", highlight=False)
    return old


def json_object(option: str, text: Optional[str]) -> Optional[dict]:
    """A JSON-object option's value (``audit run --extra-body``, ``gateway --request-defaults``), or a
    ValueError naming the option (``verinfer.jsonl.json_object``, as streamed events are read)."""
    from verinfer.jsonl import json_object as parse

    return None if text is None else parse(text, option)
