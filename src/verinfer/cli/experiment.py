"""`verinfer experiment`: the detection-power matrix, its tables and plots (see ``detection``)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Optional

import typer
from rich.progress import Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from verinfer.cli import options as opt
from verinfer.cli.console import console as _console

console = _console()
err = _console(stderr=True)


def experiment(
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="where the report goes; default: a new "
                                       "directory verinfer-experiment in the current directory (-2, -3, ... if taken)"),
    cache: Optional[Path] = typer.Option(None, help="trace/score cache (default $VERINFER_CACHE/experiments)"),
    configs: Optional[str] = typer.Option(None, help="comma-separated configurations (default: all)"),
    model: str = opt.model(),
    device: str = opt.device(),
    prompts: str = opt.prompts(),
    n: int = opt.n(128, "prompts per configuration"),
    n_prompts: Optional[int] = opt.hidden("--n-prompts"),
    max_tokens: int = opt.max_tokens(),
    verdict_batches: Optional[str] = opt.verdict_batches(None, "tokens per verdict batch to evaluate, comma-separated"),
    batch_sizes: Optional[str] = opt.hidden("--batch-sizes"),
    n_batches: int = typer.Option(1000, "--n-batches", help="random batches per side and batch size"),
    n_boot: int = typer.Option(100, "--n-boot", help="bootstrap resamples per AUC"),
    smoke: bool = typer.Option(False, help="a tiny matrix (two configurations, 16 prompts x 20 tokens)"),
    threads: int = opt.threads(),
    speculative: Optional[str] = typer.Option(
        None, "--speculative", help="DRAFT:K (e.g. layers:28:4): every configuration claims and runs vLLM's "
        "speculative decoding; default configurations become the speculative matrix"),
) -> None:
    """Detection power: the honest/misconfigured matrix (cached, resumable), AUC-vs-tokens tables and plots."""
    n_prompts = opt.alias(n, n_prompts, "--n-prompts", "--n")
    from verinfer.files import fresh_path
    from verinfer.studies import detection
    from verinfer.studies.detection_report import analyse, write_report
    from verinfer.machine import describe
    from verinfer.models.load import cache_root
    from verinfer.stats.power import BATCH_SIZES

    matrix = detection.smoke_matrix() if smoke else detection.Matrix(model=model, prompts=prompts,
                                                                      n_prompts=n_prompts, max_tokens=max_tokens,
                                                                      device=device)
    if configs or speculative:
        chosen = tuple(c.strip() for c in configs.split(",") if c.strip()) if configs else (
            detection.SPECULATIVE_CONFIGS if not smoke else ("honest-fp32", "spec-draft-only"))
        matrix = dataclasses.replace(matrix, configs=chosen, speculative=speculative)
    verdict_batches = opt.alias(verdict_batches, batch_sizes, "--batch-sizes (tokens per verdict batch)",
                                "--verdict-batches")
    sizes = opt.sizes("--verdict-batches", verdict_batches) if verdict_batches else \
        ((1, 5, 20, 50) if smoke else BATCH_SIZES)
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("loading the model")
        data = detection.run_matrix(matrix, cache or cache_root() / "experiments",
                                    stage=lambda s: bar.update(task, description=s))
        bar.update(task, description="analysing")
        result = analyse(data, matrix, sizes, n_batches=n_batches, n_boot=n_boot)
    # The command that reproduces this report, spelled out from the effective settings.
    args = ["--smoke"] if smoke else ["--model", matrix.model, "--prompts", matrix.prompts,
                                       "--n", str(matrix.n_prompts), "--max-tokens", str(matrix.max_tokens)]
    out = out or fresh_path("verinfer-experiment", directory=True)  # never over committed results
    args += ["--configs", ",".join(matrix.configs), "--verdict-batches", ",".join(map(str, sizes)),
             "--n-batches", str(n_batches), "--n-boot", str(n_boot), "--out", str(out)]
    args += ["--speculative", speculative] if speculative else []
    command = "verinfer experiment " + " ".join(shlex.quote(a) for a in args)
    paths = write_report(result, out, describe(threads), command)
    table = Table("configuration", "target", "detector", "tokens for AUC >= 0.99", "met", title="Detection power")
    for name, c in result["configs"].items():
        v = c["verdict"]
        table.add_row(name, f"{c['target']:,}" if c["target"] else "-", v["detector"],
                      f"{v['tokens']:,}" if v["tokens"] else f"> {v['max_tokens']:,} (AUC {v['auc_at_max']:.2f})",
                      "-" if "met" not in v else ("yes" if v["met"] else "no"))
    console.print(table)
    console.print("wrote " + ", ".join(str(p) for p in paths))
