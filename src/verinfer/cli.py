"""The command line: a thin layer of arguments, progress bars and tables over ``pipeline``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from packages and local files only
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from verinfer.models.load import DEFAULT_MODEL  # noqa: E402
from verinfer.cli_errors import one_line_errors as _friendly  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="verinfer: verify that LLM outputs came from the claimed model and sampler.")
console = Console()
err = Console(stderr=True)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


def _load_backend(model: str, dtype: str):
    from verinfer.models.backend import Backend

    with err.status(f"loading {model} ({dtype}); the first load converts the GGUF file (about 30 s)"):
        return Backend.load(model, dtype)


def _summary_table(rows: dict) -> Table:
    table = Table(show_lines=False)
    for col in ("set", "sequences", "tokens", "exact match", "margin = 0", "mean margin", "filtered"):
        table.add_column(col, justify="right" if col != "set" else "left")
    for name, s in rows.items():
        table.add_row(name, str(s.traces), str(s.tokens), f"{s.exact_match_rate:.1%}", f"{s.margin_zero_rate:.1%}",
                      f"{s.mean_margin:.3f}", f"{s.filtered_rate:.1%}")
    return table


def _print_summaries(rows: dict) -> None:
    console.print(_summary_table(rows))
    for name, s in rows.items():
        style = "red" if s.verdict.startswith("DIVERGES") else "green" if s.verdict.startswith("consistent") else "yellow"
        console.print(f"[bold]{name}[/bold]: [{style}]{s.verdict}[/{style}]", highlight=False)


@app.command()
@_friendly
def generate(
    out: Path = typer.Option(..., "--out", "-o", help="trace file to write (.jsonl or .parquet)"),
    prompts: str = typer.Option("chitchat", help="built-in prompt set (chitchat, human-eval) or a JSONL file"),
    n: int = typer.Option(16, help="number of prompts"),
    model: str = typer.Option(DEFAULT_MODEL, help="model alias, .gguf file, local directory or cached hub id"),
    dtype: str = typer.Option("float32", help="compute dtype (float32, bfloat16)"),
    profile: str = typer.Option("vllm", help="sampler profile: vllm, torch-exponential, greedy"),
    temperature: float = 1.0,
    top_k: int = typer.Option(50, help="<= 0 disables"),
    top_p: float = 0.95,
    min_p: float = 0.0,
    seed: int = typer.Option(1000, help="request i uses seed + i"),
    max_tokens: int = 64,
    batch_size: int = 8,
    fingerprint_dim: int = typer.Option(0, help="attach Activation-DiFR fingerprints of this many dims (0: off)"),
    fingerprint_precision: str = typer.Option("fp32", help="fingerprint storage: fp32, fp16, bf16, int8"),
    fingerprint_stride: int = typer.Option(1, help="fingerprint 1 of every N output tokens"),
    toploc: bool = typer.Option(False, help="attach TOPLOC proofs (top-128 of the bf16 hidden state per 32 tokens)"),
):
    """Generate traces with a sampler profile (the provider simulator)."""
    from verinfer.pipeline import build_requests
    from verinfer.generate import generate as run
    from verinfer.prompts import load_prompts
    from verinfer.sampling.params import SamplingParams
    from verinfer.trace import write_traces

    params = SamplingParams(profile=profile, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=None if profile == "greedy" else seed)
    from verinfer.sampling.profiles import get_profile

    get_profile(profile)
    if params.problems():
        raise ValueError(f"sampling: {params.problems()[0]}")
    backend = _load_backend(model, dtype)
    commits = None
    if fingerprint_dim or toploc:
        from verinfer.verify.activation_difr import FingerprintSpec
        from verinfer.verify.commits import CommitSpec

        spec = FingerprintSpec(fingerprint_dim, precision=fingerprint_precision, stride=fingerprint_stride,
                               hidden_size=backend.hidden_size) if fingerprint_dim else None
        if spec is not None and spec.problems():
            raise ValueError(f"fingerprint: {spec.problems()[0]}")
        commits = CommitSpec(fingerprint=spec, toploc_k=128 if toploc else None)
    requests = build_requests(backend, load_prompts(prompts, n), params)
    with _progress() as bar:
        task = bar.add_task("generating", total=len(requests))
        traces = run(backend, requests, max_tokens, batch_size, on_batch=lambda k: bar.advance(task, k),
                     commits=commits)
    write_traces(traces, out)
    tokens = sum(len(t.output_token_ids) for t in traces)
    console.print(f"wrote {len(traces)} traces ({tokens} output tokens) to {out}")


@app.command()
@_friendly
def verify(
    traces_path: Path = typer.Argument(..., metavar="TRACES", help="trace file (.jsonl or .parquet)"),
    scores: Optional[Path] = typer.Option(None, help="per-token scores (.parquet); default: TRACES.scores.parquet"),
    model: Optional[str] = typer.Option(None, help="reference model; default: the model the traces claim"),
    dtype: str = typer.Option("float32", help="verifier compute dtype"),
    calibration: Optional[Path] = typer.Option(None, help="calibration file from `verinfer calibrate`"),
    batch_size: Optional[int] = typer.Option(None, help="tokens per verdict batch (a calibrated size)"),
    skip_invalid: bool = typer.Option(False, help="skip invalid traces (counted and reported) instead of stopping"),
    allow_model_mismatch: bool = typer.Option(False, help="verify traces that claim another model"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the summary as JSON"),
):
    """Replay traces with one prefill each and score every token (Token-DiFR)."""
    from verinfer.pipeline import check_traces, load_calibrator, verify_to_file
    from verinfer.trace import read_traces
    from verinfer.verify.report import commit_scores, commit_verdicts, summarize, summarize_commits, write_commit_scores

    traces = read_traces(traces_path)
    calibrator = load_calibrator(calibration) if calibration else None
    claimed_models = sorted({t.model for t in traces})
    if model is None and len(claimed_models) > 1:
        raise ValueError(f"{traces_path}: traces claim several models ({', '.join(claimed_models)}); pass --model")
    backend = _load_backend(model or claimed_models[0], dtype)
    traces, skipped = check_traces(traces, backend, str(traces_path), skip_invalid, allow_model_mismatch)
    for line in skipped:
        err.print(f"[yellow]skipped:[/yellow] {line}", highlight=False)
    scores = scores or traces_path.with_name(traces_path.name.split(".")[0] + ".scores.parquet")
    total = sum(len(t.output_token_ids) for t in traces)
    checks: list = []
    with _progress() as bar:
        task = bar.add_task("verifying", total=total)
        columns = verify_to_file(backend, traces, scores, on_rows=lambda k: bar.advance(task, k), commit_checks=checks)
    summary = summarize(columns, calibrator, batch_size)
    _print_summaries({traces_path.name: summary})
    if checks:
        summary.details["commits"] = commits = summarize_commits(checks)
        if "toploc" in commits:
            t = commits["toploc"]
            console.print(f"TOPLOC: {t['passed']}/{t['chunks']} chunks pass the reference bf16 thresholds"
                          + (f"; failing traces: {', '.join(t['failed_traces'][:5])}" if t["failed_traces"] else ""))
        if "activation_difr" in commits:
            a = commits["activation_difr"]
            console.print(f"Activation-DiFR: {a['fingerprints']} fingerprints, mean L2 {a['mean_l2']:.4g}, "
                          f"max {a['max_l2']:.4g} (uncalibrated)")
        for e in commits["errors"]:
            err.print(f"[red]commit error:[/red] {e}", highlight=False)
        commit_path = write_commit_scores(checks, scores.with_name(scores.name.replace(".scores.", ".commits.")))
        console.print(f"commit scores: {commit_path}")
        if calibrator is not None:
            commits["verdicts"] = commit_verdicts(commit_scores(checks), calibrator, batch_size)
            for metric, verdict in commits["verdicts"].items():
                console.print(f"[bold]{metric}[/bold]: {verdict}", highlight=False)
    if skipped:
        console.print(f"{len(skipped)} invalid trace(s) skipped, {len(traces)} verified")
    console.print(f"per-token scores: {scores}")
    if json_out:
        json_out.write_text(json.dumps({**summary.to_dict(), "skipped": skipped}, indent=1, default=str))


@app.command()
@_friendly
def calibrate(
    honest_scores: list[Path] = typer.Argument(..., help="per-token score files of honest traces"),
    out: Path = typer.Option(..., "--out", "-o", help="calibration file to write (JSON)"),
    batch_sizes: str = typer.Option("10,100", help="comma-separated tokens per batch"),
    fpr: float = typer.Option(0.01, help="target false-positive rate"),
    commit_scores: list[Path] = typer.Option([], help="honest *.commits.parquet files (activation commit detectors)"),
):
    """Fit thresholds on honest scores at a target false-positive rate."""
    import numpy as np

    from verinfer.verify.report import fit_calibrator, read_commit_scores, read_scores

    parts = [read_scores(p) for p in honest_scores]
    columns = {k: np.concatenate([p[k] for p in parts]) for k in ("margin", "cross_entropy", "exact_match")}
    commit_parts = [read_commit_scores(p) for p in commit_scores]
    commits = {m: np.concatenate([p[m] for p in commit_parts if m in p])
               for m in {m for p in commit_parts for m in p}}
    sizes = tuple(int(s) for s in batch_sizes.split(","))
    calibrator = fit_calibrator(columns, sizes, fpr, commits)
    out.write_text(json.dumps(calibrator.to_dict(), indent=1))
    console.print(f"calibrated on {columns['margin'].size} honest tokens at {fpr:.1%} FPR, "
                  f"batch sizes {sizes}: {out}")


@app.command()
@_friendly
def demo(
    out_dir: Path = typer.Option(Path("verinfer-demo"), help="where traces, scores and the summary go"),
    model: str = typer.Option(DEFAULT_MODEL, help="reference model"),
    n: int = typer.Option(24, help="prompts per trace set"),
    max_tokens: int = typer.Option(64, help="most tokens generated per prompt"),
    audit_prompts: int = typer.Option(8, help="prompts for the loopback HTTP audit of an honest and a 4-bit "
                                      "server (0: skip it)"),
):
    """The main job on the bundled model: honest vs wrong-seed traces, calibrated and verified; then an
    honest and a 4-bit provider served on loopback and audited over HTTP."""
    from verinfer.pipeline import run_demo
    from verinfer.prompts import load_prompts

    backend = _load_backend(model, "float32")
    prompts = load_prompts("chitchat", n, seed=0)
    console.print(f"[bold]verinfer demo[/bold]: {backend.model_id}, {n} chitchat prompts x 3 trace sets, "
                  f"vLLM sampler (T=1, top-k 50, top-p 0.95), {max_tokens} tokens each")
    with _progress() as bar:
        task = bar.add_task("generating", total=3 * n)
        result = run_demo(backend, prompts, out_dir, max_new_tokens=max_tokens, batch_size=n,
                          on_tokens=lambda k: bar.advance(task, k),
                          on_stage=lambda s: bar.update(task, description=s), audit_prompts=min(audit_prompts, n))
    _print_summaries({"honest": result.honest, "wrong seed": result.wrong_seed})
    console.print(f"calibrated on {result.calibration_tokens} tokens of a separate honest set "
                  f"(mean clipped margin, batches of {result.batch_size} tokens, 1% target FPR); "
                  f"files in {result.out_dir}/")
    if result.audit is not None:
        console.print("[bold]HTTP audit[/bold] of two `verinfer serve` providers on loopback (greedy spot checks, "
                      "local reference, shipped bands):")
        for a in result.audit.providers:
            style = "green" if a.verdict.consistent else "red"
            console.print(f"[bold]{a.endpoint.name}[/bold]: [{style}]{a.verdict.text}[/{style}]", highlight=False)
        console.print(f"audit report: {result.audit_report}")


def _register_subcommands() -> None:
    from verinfer.determinism.cli import app as margingate

    app.add_typer(margingate, name="margingate", help="MarginGate: reproducible greedy decoding under dynamic batching")
    app.command(name="experiment")(_friendly(__import__("verinfer.experiments.cli", fromlist=["x"]).experiment))
    app.command(name="serve")(__import__("verinfer.serve.cli", fromlist=["serve"]).serve)
    app.add_typer(__import__("verinfer.audit.cli", fromlist=["app"]).app, name="audit", help="Audit OpenAI-compatible providers over HTTP")


_register_subcommands()


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
