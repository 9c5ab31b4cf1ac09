"""``verinfer margingate``: measure batch-induced token flips and calibrate MarginGate
(registered as a sub-app by ``verinfer.cli``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import typer  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="MarginGate: verify only low-margin decode steps against a deterministic path.")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}") from None


def _run(cfg, out: Optional[Path], threads: int) -> None:
    import torch

    from verinfer.determinism.experiment import header, run_experiment
    from verinfer.models.load import ModelNotAvailable
    from verinfer.prompts import PromptError

    import shlex
    import sys

    torch.set_num_threads(threads)
    command = "verinfer margingate " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        typer.echo(header([cfg], command))
        rep = run_experiment(cfg, log=typer.echo)
    except (ModelNotAvailable, PromptError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header([cfg], command) + "\n\n" + rep.markdown() + "\n")
        typer.echo(f"wrote {out}")


@app.command()
def measure(
    prompts: str = typer.Option("chitchat", help="prompt set: chitchat, human-eval, gsm8k, or a JSONL file"),
    n: int = typer.Option(12, help="number of prompts"),
    max_new_tokens: int = typer.Option(32, help="tokens per request"),
    batch: int = typer.Option(4, help="largest running batch"),
    dtype: str = typer.Option("float32", help="float32 or bfloat16 (bf16 is several times slower on CPU)"),
    model: str = typer.Option("smollm2-135m", help="model alias, .gguf file or local Llama directory"),
    seed: int = typer.Option(0, help="prompt sample seed"),
    threads: int = typer.Option(1, help="torch threads"),
    fidelity: bool = typer.Option(True, help="also recompute each fast step deterministically on the fast "
                                             "path's cache and compare with the reference (doubles the cost)"),
    out: Optional[Path] = typer.Option(None, help="also write the tables to this markdown file"),
):
    """Flip rate, margins at flips vs stable steps, and K/V deviation: fast path vs reference."""
    from verinfer.determinism.experiment import Config

    _run(Config(model=model, dtype=dtype, calibration=prompts, transfer=(), n=n, max_new_tokens=max_new_tokens,
                batch=batch, seed=seed, measure_only=True, fidelity=fidelity), out, threads)


@app.command()
def sweep(
    prompts: str = typer.Option("chitchat", help="calibration prompt set"),
    transfer: str = typer.Option("gsm8k,human-eval", help="comma-separated prompt sets for the transfer table"),
    n: int = typer.Option(12, help="calibration prompts"),
    n_transfer: int = typer.Option(6, help="prompts per transfer set"),
    max_new_tokens: int = typer.Option(32, help="tokens per request"),
    batch: int = typer.Option(4, help="largest running batch"),
    batch_sizes: str = typer.Option("", help="comma-separated extra batch sizes for the scaling table"),
    thresholds: str = typer.Option("", help="comma-separated margin thresholds (default depends on dtype)"),
    dtype: str = typer.Option("float32", help="float32 or bfloat16"),
    model: str = typer.Option("smollm2-135m", help="model alias, .gguf file or local Llama directory"),
    repeats: int = typer.Option(1, help="interleaved repeats per policy (median time)"),
    seed: int = typer.Option(0, help="prompt sample seed"),
    threads: int = typer.Option(1, help="torch threads"),
    out: Optional[Path] = typer.Option(None, help="also write the tables to this markdown file"),
):
    """Baselines and the threshold sweep (window rule and the paper's single-column rule) on a
    calibration set, then transfer of the chosen thresholds and batch-size scaling."""
    from verinfer.determinism.experiment import Config

    try:
        sizes = tuple(int(b) for b in batch_sizes.split(",") if b.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {batch_sizes!r}") from None
    _run(Config(model=model, dtype=dtype, calibration=prompts, transfer=tuple(s for s in transfer.split(",") if s),
                n=n, n_transfer=n_transfer, max_new_tokens=max_new_tokens, batch=batch, batch_sizes=sizes,
                thresholds=_floats(thresholds), repeats=repeats, seed=seed), out, threads)


if __name__ == "__main__":
    app()
