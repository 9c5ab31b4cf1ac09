"""``verinfer diagnose TRACES``: which configuration best explains the traces (``verinfer.api.diagnose``'s
steps: ``scoring/diagnosis_run.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from verinfer.cli import options as opt
from verinfer.cli.console import console as _console
from verinfer.cli.errors import one_line_errors

console = _console()
err = _console(stderr=True)


def _table(diagnosis, rows: int) -> Table:
    table = Table(show_lines=False)
    for col in ("rank", "candidate", "exact", "mean margin", "unexplained", "log-lik", "LR vs claim", "p"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for i, r in enumerate(diagnosis.ranked[:rows], 1):
        table.add_row(str(i), r.candidate.named, f"{r.exact:.1%}", f"{r.mean_margin:.3g}", f"{r.unexplained:.1%}",
                      f"{r.loglik:.1f}", f"{r.lr:.1f}", "" if r.candidate.axis == "claim" else f"{r.p:.2g}")
    return table


@one_line_errors
def diagnose(
    traces: Path = opt.input_files("trace file (.jsonl or .parquet)"),
    model: Optional[str] = typer.Option(None, help="reference model; default: the model the traces claim"),
    dtype: str = opt.dtype("float32", "reference compute dtype"),
    device: str = opt.device(),
    backend: str = opt.backend(),
    threads: int = opt.threads(),
    bands: Optional[str] = typer.Option(None, "--variants", help="also rank model-side variants, one extra prefill "
                                        "each (an fp8 KV cache variant: one teacher-forced decode of all the traces "
                                        "as one batch, as its provider decodes them): 'default' (bf16, w8-channel, w4-g128, fp8-kv), 'catalogue' (every "
                                        "model-side variant) or comma-separated variant names (as `audit bands "
                                        "--variants`)"),
    sigma: Optional[float] = typer.Option(None, help="logit noise (raw-logit std) the likelihood allows "
                                          "(default 0.1)"),
    alpha: Optional[float] = typer.Option(None, help="level of the likelihood-ratio test against the claim "
                                          "(default 0.01, Bonferroni over the candidates)"),
    rows: int = typer.Option(10, help="candidates shown in the table"),
    skip_invalid: bool = typer.Option(False, help="skip invalid traces instead of stopping"),
    allow_model_mismatch: bool = typer.Option(False, help="diagnose traces that claim another model"),
    calibration: Optional[Path] = opt.input_file("--calibration", "calibration file from `verinfer calibrate`: the "
                                                 "traces are also judged as `verify` judges them, and that verdict "
                                                 "decides whether they deviate"),
    default_calibration: bool = typer.Option(True, "--default-calibration/--no-default-calibration",
                                             help="without --calibration, judge with the shipped calibration for "
                                             "the claim, as `verify` does, if one exists"),
    search_models: bool = typer.Option(True, "--search-models/--no-search-models",
                                       help="when no candidate explains the tokens, or the verdict flags them and "
                                       "none beats the claim, search the derived models (RTN weights of every bit "
                                       "width, grouping and rounding; the first N layers; any one layer removed; "
                                       "an fp8 KV cache): one prefill of a derived copy of the model each"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="write the diagnosis as JSON"),
):
    """Replay the traces under candidate configurations (sampler settings, seeds, engine profiles,
    sampler bugs; with --variants, derived models) over one prefill and rank them by likelihood. A sampler
    setting that beats the claim is fitted at any value, with a 95% interval; when nothing explains the
    tokens, or the verdict flags them and nothing beats the claim, other chat templates (for traces that
    record their messages) and derived models (quantized weights, fewer layers, a layer removed, an fp8 KV
    cache) are searched.

    With a calibration (--calibration, else the shipped one for the claim) the traces are also judged
    as `verify` judges them, the verdict is printed beside the diagnosis, and the two never say
    opposite things: the calibrated verdict decides whether the traces deviate, diagnose what explains it.

    Exit 0: the traces do not deviate (the verdict is CONSISTENT; without a calibration: the claim is
    not rejected); 1: they deviate (INCONSISTENT; without one: a candidate explains the traces
    significantly better than the claim, or none explains them); 2: bad input."""
    from verinfer.api import diagnose as run, load_model
    from verinfer.scoring.diagnosis_run import prepare, reference_model

    if not traces.is_file():
        raise ValueError(f"TRACES {traces}: " + ("is not a file" if traces.exists() else "does not exist"))
    if rows < 1:
        raise ValueError(f"--rows must be >= 1, got {rows}")
    trace_list, source, _, _, band_names = prepare(traces, out, sigma, alpha, bands)
    if backend != "transformers" and band_names:
        from verinfer.models.vllm_backend import DERIVED_NEED_TRANSFORMERS

        raise ValueError(DERIVED_NEED_TRANSFORMERS)
    if calibration is not None:  # a bad calibration or an --out over it is refused before the model loads
        from verinfer.files import check_outputs
        from verinfer.stats.calibration import Calibrator

        check_outputs([out], [traces, calibration])
        Calibrator.load(calibration)
    if backend != "transformers" and search_models:
        err.print("model search off: it builds derived copies of the model (--backend transformers)", highlight=False)
        search_models = False
    with err.status(f"loading the reference model ({dtype})"):
        reference = load_model(reference_model(trace_list, model, source), dtype, device, backend)
    extra = ", one prefill per model variant" if band_names else ""
    with err.status(f"diagnosing: one prefill, the candidate replays{extra}, the calibrated verdict"):
        result = run(traces, backend=reference, variants=band_names, sigma=sigma, alpha=alpha, out=out,
                     skip_invalid=skip_invalid, allow_model_mismatch=allow_model_mismatch, calibration=calibration,
                     default_calibration=default_calibration, search_models=search_models)
    console.print(_table(result, rows))
    style = "red" if result.deviates else "green"
    console.print(f"[{style}]{result.text}[/{style}]", highlight=False, soft_wrap=True)
    if out is not None:
        err.print(f"diagnosis written to {out}", highlight=False)
    if result.deviates:
        raise typer.Exit(1)
