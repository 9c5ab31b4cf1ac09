"""The main commands: a thin layer of options, progress bars and tables over ``verinfer.api``.

Exit codes (the same in every command): 0 consistent (or no verdict asked for), 1 a verdict says
DIVERGES / INCONSISTENT or a commitment is invalid, 2 bad input (one line naming what and where)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from packages and local files only
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import typer  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from verinfer.cli import options as opt  # noqa: E402
from verinfer.cli.console import console as _console, help_style  # noqa: E402
from verinfer.cli.errors import one_line_errors as _friendly  # noqa: E402

app = typer.Typer(add_completion=False, **help_style(), no_args_is_help=True,
                  help="verinfer: verify that LLM outputs came from the claimed model and sampler.")
console = _console()
err = _console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from verinfer import __version__

        console.print(f"verinfer {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print verinfer's version and exit")) -> None:
    """verinfer: verify that LLM outputs came from the claimed model and sampler."""


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


def _load_backend(model: str, dtype: str, device: str = "cpu", backend: str = "transformers"):
    from verinfer.api import load_model

    how = "" if backend == "transformers" else f" in vLLM ({backend})"
    with err.status(f"loading {model} ({dtype}){how}; the first load converts the GGUF file (about 30 s)"):
        return load_model(model, dtype, device, backend)


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
        ok = s.verdict.consistent if s.verdict else None
        style = "yellow" if ok is None else "green" if ok else "red"
        console.print(f"[bold]{name}[/bold]: [{style}]{s.verdict_text}[/{style}]", highlight=False, soft_wrap=True)


def _exit_code(consistent: bool | None) -> None:
    """Exit 1 when a verdict diverges or a commitment is invalid (0 otherwise; 2 is bad input)."""
    if consistent is False:
        raise typer.Exit(1)


@app.command()
@_friendly
def generate(
    out: Path = typer.Option(..., "--out", "-o", help="trace file to write (.jsonl or .parquet)"),
    prompts: str = opt.prompts(),
    n: int = opt.n(),
    model: str = opt.model(),
    dtype: str = opt.dtype(),
    device: str = opt.device(),
    profile: str = opt.profile(),
    sampler: Optional[str] = opt.hidden("--sampler"),
    temperature: float = opt.temperature(),
    top_k: int = typer.Option(50, help="top-k (<= 0: off; 50 with top-p 0.95 simulates a vLLM chat deployment, "
                              "where `audit` asks providers for the unfiltered distribution)"),
    top_p: float = typer.Option(0.95, help="top-p (1.0: off)"),
    min_p: float = opt.min_p(),
    seed: int = opt.seed(),
    max_tokens: int = opt.max_tokens(),
    batch_size: int = opt.batch_size(),
    threads: int = opt.threads(),
    fingerprint_dim: int = typer.Option(0, help="attach Activation-DiFR fingerprints of this many dims (0: off)"),
    fingerprint_precision: str = typer.Option("fp32", help="fingerprint storage: fp32, fp16, bf16, int8"),
    fingerprint_stride: int = typer.Option(1, help="fingerprint 1 of every N output tokens"),
    toploc: bool = typer.Option(False, help="attach TOPLOC proofs (top-128 of the bf16 hidden state per 32 tokens)"),
    speculative: Optional[str] = typer.Option(
        None, "--speculative", help="DRAFT:K: decode as vLLM's speculative decoding with K drafts per step from "
        "DRAFT = layers:N (the model's first N layers) or wN (N-bit weights), e.g. layers:28:4"),
):
    """Generate traces with a sampler profile (the provider simulator)."""
    from verinfer import api

    profile = opt.alias(profile, sampler, "--sampler", "--profile")
    for name, value in (("--n", n), ("--max-tokens", max_tokens), ("--batch-size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    backend = _load_backend(model, dtype, device)
    commits = None
    if fingerprint_dim or toploc:
        from verinfer.commits.activation_difr import FingerprintSpec
        from verinfer.commits.trace_commits import CommitSpec

        spec = FingerprintSpec(fingerprint_dim, precision=fingerprint_precision, stride=fingerprint_stride,
                               hidden_size=backend.hidden_size) if fingerprint_dim else None
        if spec is not None and spec.problems():
            raise ValueError(f"fingerprint: {spec.problems()[0]}")
        commits = CommitSpec(fingerprint=spec, toploc_k=128 if toploc else None)
    with _progress() as bar:
        task = bar.add_task("generating", total=n)
        traces = api.generate(prompts, n=n, profile=profile, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, seed=seed, max_tokens=max_tokens, batch_size=batch_size, commits=commits,
                              out=out, backend=backend, on_batch=lambda k: bar.advance(task, k),
                              speculative=speculative)
    tokens = sum(len(t.output_token_ids) for t in traces)
    console.print(f"wrote {len(traces)} traces ({tokens} output tokens) to {out}")


@app.command()
@_friendly
def verify(
    traces_arg: str = opt.traces("trace file (.jsonl or .parquet), or a directory or glob of trace shards "
                                 "(verified shard by shard, resumably)"),
    scores: Optional[Path] = typer.Option(None, help="per-token scores (.parquet); default: <TRACES stem>.scores.parquet "
                                          "(a trace file not in .jsonl keeps its extension: t.parquet.scores.parquet)"),
    commit_scores: Optional[Path] = typer.Option(None, help="commit scores (.parquet); default: <scores stem>"
                                                 ".commits.parquet"),
    model: Optional[str] = typer.Option(None, help="reference model; default: the model the traces claim"),
    dtype: str = opt.dtype("float32", "verifier compute dtype"),
    device: str = opt.device(),
    backend: str = opt.backend(),
    threads: int = opt.threads(),
    calibration: Optional[Path] = opt.input_file("--calibration", "calibration file from `verinfer calibrate`"),
    default_calibration: bool = typer.Option(True, "--default-calibration/--no-default-calibration",
                                             help="without --calibration, judge with the shipped pooled fp32 + bf16 "
                                             "calibration for the traces' model and sampling settings, if one exists"),
    verdict_batch: Optional[int] = opt.verdict_batch(),
    batch_size: Optional[int] = opt.hidden("--batch-size"),
    skip_invalid: bool = typer.Option(False, help="skip invalid traces (counted and reported) instead of stopping"),
    allow_model_mismatch: bool = typer.Option(False, help="verify traces that claim another model"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the summary as JSON"),
    out_dir: Optional[Path] = typer.Option(None, help="shards: directory for per-shard scores and records "
                                           "(default: <TRACES>.verinfer beside a directory, verinfer-shards/ for a glob)"),
    ray: bool = typer.Option(False, "--ray", help="verify the shards on a Ray cluster: a local one, or --ray-address"),
    ray_address: Optional[str] = typer.Option(None, help="address of a running Ray cluster (implies --ray)"),
    workers: Optional[int] = typer.Option(None, help="Ray: model replicas (default: one per GPU, else one per CPU)"),
):
    """Replay traces with one prefill each and score every token (Token-DiFR).

    Exit 0: consistent (or uncalibrated); 1: the calibrated verdict diverges or a commitment is
    invalid; 2: bad input."""
    from verinfer import api
    from verinfer.files import check_outputs, write_atomic
    from verinfer.scoring.diagnosis_run import reference_model
    from verinfer.trace import read_traces

    batch_size = opt.alias(verdict_batch, batch_size, "--batch-size (tokens per verdict batch)", "--verdict-batch")
    traces_path = Path(traces_arg)
    if ray or ray_address or not traces_path.is_file():
        if scores is not None or commit_scores is not None:
            from verinfer.sharded import find_shards

            find_shards(traces_arg)  # a missing input is named as such, not as a misused option
            raise ValueError(f"{traces_arg}: --scores / --commit-scores name one trace file's outputs; "
                             "the shards of a directory or glob go to --out-dir")
        _verify_shards(traces_arg, out_dir, model, dtype, device, calibration, batch_size, skip_invalid,
                       allow_model_mismatch, json_out, ray or bool(ray_address), ray_address, workers, backend)
        return
    check_outputs([json_out], [traces_path, calibration, scores])
    traces = read_traces(traces_path)
    reference = _load_backend(reference_model(traces, model, str(traces_path)), dtype, device, backend)
    with _progress() as bar:
        task = bar.add_task("verifying", total=sum(len(t.output_token_ids) for t in traces))
        result = api.verify(traces_path, calibration=calibration, batch_size=batch_size, scores=scores,
                            commit_scores_out=commit_scores, skip_invalid=skip_invalid,
                            allow_model_mismatch=allow_model_mismatch, backend=reference,
                            on_rows=lambda k: bar.advance(task, k), default_calibration=default_calibration)
    for line in result.skipped:
        err.print(f"[yellow]skipped:[/yellow] {line}", highlight=False)
    summary = result.summary
    _print_summaries({traces_path.name: summary})
    if summary.calibration:
        console.print(f"calibration: {summary.calibration}", highlight=False)
    commits = summary.commits
    if "toploc" in commits:
        t = commits["toploc"]
        console.print(f"TOPLOC: {t['passed']}/{t['chunks']} chunks pass the reference bf16 thresholds"
                      + (f"; failing traces: {', '.join(t['failed_traces'][:5])}" if t["failed_traces"] else ""))
    if "activation_difr" in commits:
        a = commits["activation_difr"]
        console.print(f"Activation-DiFR: {a['fingerprints']} fingerprints, mean L2 {a['mean_l2']:.4g}, "
                      f"max {a['max_l2']:.4g} (uncalibrated)")
    for e in commits.get("errors", []):
        err.print(f"[red]invalid commitment:[/red] {e}", highlight=False, soft_wrap=True)
    for metric, v in summary.commit_verdicts.items():
        console.print(f"[bold]{metric}[/bold]: {v.text}", highlight=False, soft_wrap=True)
    if result.scored.commits_path:
        console.print(f"commit scores: {result.scored.commits_path}")
    if result.skipped:
        console.print(f"{len(result.skipped)} invalid trace(s) skipped, {summary.traces} verified")
    console.print(f"per-token scores: {result.scored.scores_path}")
    if json_out:
        write_atomic(json_out, json.dumps(result.to_dict(), indent=1, default=str))
    _exit_code(result.consistent)


def _verify_shards(spec: str, out_dir: Path | None, model: str | None, dtype: str, device: str,
                   calibration: Path | None, batch_size: int | None, skip_invalid: bool, allow_model_mismatch: bool,
                   json_out: Path | None, use_ray: bool, address: str | None, workers: int | None,
                   backend: str = "transformers") -> None:
    """``verify`` over many shards (``verinfer.sharded``): per-shard scores in ``out_dir``, one merged verdict."""
    from verinfer import api, sharded
    from verinfer.extras import require
    from verinfer.files import check_outputs, write_atomic
    from verinfer.models.vllm_backend import check_with_ray
    from verinfer.stats.calibration import Calibrator
    from verinfer.trace import read_traces

    check_with_ray(use_ray, backend)
    if use_ray:
        require("ray", "verinfer verify --ray")
    shards = sharded.find_shards(spec)
    if out_dir is None:
        out_dir = Path(f"{spec.rstrip('/')}.verinfer") if Path(spec).is_dir() else Path("verinfer-shards")
    check_outputs([json_out], [*shards, calibration])
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    calibrator = Calibrator.load(calibration) if calibration else None
    api.check_batch_size(batch_size, calibrator, str(calibration))
    model = model or read_traces(shards[0])[0].model
    with _progress() as bar:
        task = bar.add_task("verifying shards", total=len(shards))
        bar.advance(task, sum(1 for s in shards if sharded.done_record(out_dir, s) is not None))
        step = lambda row: bar.advance(task, 1)  # noqa: E731
        if use_ray:
            result = sharded.run_ray(shards, out_dir, model, dtype, address, workers, skip_invalid,
                                     allow_model_mismatch, on_shard=step)
        else:
            result = sharded.run_local(shards, out_dir, _load_backend(model, dtype, device, backend), skip_invalid,
                                       allow_model_mismatch, on_shard=step)
    for line in result.errors:
        err.print(f"[red]error:[/red] {line}", highlight=False, soft_wrap=True)
    for line in result.skipped:
        err.print(f"[yellow]skipped:[/yellow] {line}", highlight=False, soft_wrap=True)
    done = len(result.shards) - len(result.errors)
    if done:
        result.summary = sharded.merge(out_dir, shards, calibrator, batch_size, source=spec)
        _print_summaries({f"{done} shard(s)": result.summary})
    console.print(f"{len(result.verified)} shard(s) verified now, {len(result.resumed)} already done, "
                  f"{len(result.errors)} failed; per-shard scores in {out_dir}/")
    if json_out:
        write_atomic(json_out, json.dumps(result.to_dict(), indent=1, default=str))
    if result.errors and not skip_invalid:  # with --skip-invalid, unreadable shards are reported and left out
        raise typer.Exit(2)
    _exit_code(result.summary.consistent if done else None)


@app.command()
@_friendly
def calibrate(
    honest_scores: list[Path] = opt.input_files("per-token score files of honest traces"),
    out: Path = typer.Option(..., "--out", "-o", help="calibration file to write (JSON)"),
    verdict_batches: str = opt.verdict_batches("10,100"),
    batch_sizes: Optional[str] = opt.hidden("--batch-sizes"),
    fpr: float = opt.fpr(),
    commit_scores: list[Path] = opt.input_file("--commit-scores", "honest *.commits.parquet files (activation "
                                               "commit detectors)", default=[]),
    precisions: Optional[str] = typer.Option(None, help="honest precisions behind the score files, comma-separated "
                                             "(fp32,bf16): recorded as the calibration's coverage"),
    resample: Optional[int] = typer.Option(None, min=1, help="bootstrap this many overlapping windows per batch size "
                                           "when honest tokens are too few for disjoint batches"),
    shape: bool = typer.Option(True, "--shape/--no-shape", help="fit the sampler-shape detectors (narrower / wider "
                               "filters and temperatures) beside the margin"),
):
    """Fit thresholds on honest scores at a target false-positive rate (recording the model, dtype
    and sampling settings they were verified under, and the honest precisions it covers)."""
    from verinfer import api
    from verinfer.stats.calibration import coverage_warnings

    sizes = opt.sizes("--verdict-batches", opt.alias(verdict_batches, batch_sizes, "--batch-sizes (tokens per "
                                                      "verdict batch)", "--verdict-batches"))
    calibrator = api.calibrate(honest_scores, batch_sizes=sizes, fpr=fpr, commit_scores_files=commit_scores, out=out,
                               resample=resample, precisions=precisions.split(",") if precisions else None,
                               shape=shape)
    console.print(f"calibrated on {calibrator.n_tokens_['margin']} honest tokens at {fpr:.1%} FPR, "
                  f"verdict batches of {', '.join(map(str, sizes))} token(s): {out}")
    for line in coverage_warnings(calibrator, cli=True):
        err.print(f"[yellow]warning:[/yellow] {line}", highlight=False, soft_wrap=True)


@app.command()
@_friendly
def demo(
    out_dir: Path = typer.Option(Path("verinfer-demo"), "--out", "--out-dir", "-o",
                                 help="where traces, scores and the summary go"),
    model: str = opt.model(),
    n: int = opt.n(24, "prompts per trace set"),
    max_tokens: int = opt.max_tokens(),
    threads: int = opt.threads(),
    audit_prompts: int = typer.Option(8, help="prompts for the loopback HTTP audit of an honest and a 4-bit "
                                      "server (0: skip it)"),
):
    """The main job on the bundled model: honest vs wrong-seed traces, calibrated and verified; then an
    honest and a 4-bit provider served on loopback and audited over HTTP."""
    from verinfer.demo import run_demo
    from verinfer.prompts import load_prompts

    backend = _load_backend(model, "float32")
    prompts = load_prompts("chitchat", n, seed=0)
    console.print(f"[bold]verinfer demo[/bold]: {backend.model_id}, {n} chitchat prompts x 3 trace sets, "
                  f"vLLM sampler (T=1, top-k 50, top-p 0.95), {max_tokens} tokens each")
    with _progress() as bar:
        task = bar.add_task("generating", total=3 * n)
        result = run_demo(backend, prompts, out_dir, max_tokens=max_tokens, batch_size=n,
                          on_tokens=lambda k: bar.advance(task, k),
                          on_stage=lambda s: bar.update(task, description=s), audit_prompts=min(audit_prompts, n))
    _print_summaries({"honest": result.honest.summary, "wrong seed": result.wrong_seed.summary})
    console.print(f"calibrated on {result.calibration_tokens} tokens of a separate honest set "
                  f"({result.detector}, batches of {result.batch_size} tokens, 1% target FPR); "
                  f"files in {result.out_dir}/")
    if result.audit is not None:
        console.print("[bold]HTTP audit[/bold] of two `verinfer serve` providers on loopback (greedy spot checks, "
                      "local reference, shipped bands):")
        for a in result.audit.providers:
            style = "green" if a.verdict.consistent else "red"
            console.print(f"[bold]{a.endpoint.name}[/bold]: [{style}]{a.verdict.text}[/{style}]", highlight=False,
                          soft_wrap=True)
        console.print(f"audit report: {result.audit_report}")


def _register_subcommands() -> None:
    from verinfer.cli.margingate import app as margingate

    app.add_typer(margingate, name="margingate", help="MarginGate: reproducible greedy decoding under dynamic batching")
    app.command(name="experiment")(_friendly(__import__("verinfer.cli.experiment", fromlist=["x"]).experiment))
    app.command(name="serve")(__import__("verinfer.cli.serve", fromlist=["serve"]).serve)
    app.command(name="gateway")(__import__("verinfer.cli.gateway", fromlist=["gateway"]).gateway)
    app.command(name="monitor")(__import__("verinfer.cli.monitor", fromlist=["monitor"]).monitor)
    app.command(name="dashboard")(__import__("verinfer.cli.dashboard", fromlist=["dashboard"]).dashboard)
    app.command(name="diagnose")(__import__("verinfer.cli.diagnose", fromlist=["diagnose"]).diagnose)
    app.add_typer(__import__("verinfer.cli.audit", fromlist=["app"]).app, name="audit", help="Audit OpenAI-compatible providers over HTTP")


_register_subcommands()


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
