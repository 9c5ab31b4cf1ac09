"""``verinfer margingate``: measure batch-induced token flips and calibrate MarginGate
(registered as a sub-app by ``verinfer.cli``)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import typer  # noqa: E402

from verinfer.cli import options as opt  # noqa: E402
from verinfer.cli.console import help_style  # noqa: E402
from verinfer.cli.errors import one_line_errors  # noqa: E402

app = typer.Typer(add_completion=False, **help_style(), no_args_is_help=True,
                  help="MarginGate: verify only low-margin decode steps against a deterministic path.")
LLAMA_ONLY = "model alias, .gguf file, local directory or cached hub id (Llama-architecture models only)"


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}") from None


def _old_spellings(max_tokens, max_new_tokens, batch_size, batch, prompt_seed, seed) -> tuple[int, int, int]:
    """(tokens, batch, prompt seed) from the shared options or their old spellings (one release)."""
    return (opt.alias(max_tokens, max_new_tokens, "--max-new-tokens", "--max-tokens"),
            opt.alias(batch_size, batch, "--batch", "--batch-size"),
            opt.alias(prompt_seed, seed, "--seed (here: the prompt sample)", "--prompt-seed"))


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it again: ``verinfer margingate <sub> ...`` whether it ran
    from the ``verinfer`` entry point, ``python -m verinfer.cli`` or this sub-app alone."""
    argv = list(sys.argv if argv is None else argv)[1:]
    if "margingate" in argv:
        argv = argv[argv.index("margingate") + 1:]
    return "verinfer margingate " + " ".join(shlex.quote(a) for a in argv)


def _run(cfg, out: Optional[Path]) -> None:
    from verinfer.determinism.experiment import header, run_experiment

    command = command_line()
    typer.echo(header([cfg], command))
    rep = run_experiment(cfg, log=typer.echo)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header([cfg], command) + "\n\n" + rep.markdown() + "\n")
        typer.echo(f"wrote {out}")


@app.command()
@one_line_errors
def measure(
    prompts: str = opt.prompts(),
    n: int = opt.n(12),
    max_tokens: int = opt.max_tokens(32),
    max_new_tokens: Optional[int] = opt.hidden("--max-new-tokens"),
    batch_size: int = opt.batch_size(4, "requests decoded together (the largest running batch)"),
    batch: Optional[int] = opt.hidden("--batch"),
    dtype: str = opt.dtype(help="compute dtype (float32, bfloat16: several times slower on CPU)"),
    model: str = opt.model(help=LLAMA_ONLY),
    prompt_seed: int = opt.prompt_seed(0),
    seed: Optional[int] = opt.hidden("--seed"),
    threads: int = opt.threads(),
    fidelity: bool = typer.Option(True, help="also recompute each fast step deterministically on the fast "
                                             "path's cache and compare with the reference (doubles the cost)"),
    out: Optional[Path] = typer.Option(None, help="also write the tables to this markdown file"),
):
    """Flip rate, margins at flips vs stable steps, and K/V deviation: fast path vs reference."""
    max_new_tokens, batch, seed = _old_spellings(max_tokens, max_new_tokens, batch_size, batch, prompt_seed, seed)
    from verinfer.determinism.experiment import Config

    _run(Config(model=model, dtype=dtype, calibration=prompts, transfer=(), n=n, max_new_tokens=max_new_tokens,
                batch=batch, seed=seed, measure_only=True, fidelity=fidelity), out)


@app.command()
@one_line_errors
def sweep(
    prompts: str = opt.prompts(help="built-in prompt set (chitchat, human-eval, gsm8k) or a JSONL file: the "
                               "calibration set"),
    transfer: str = typer.Option("gsm8k,human-eval", help="comma-separated prompt sets for the transfer table"),
    n: int = opt.n(12, "number of prompts in the calibration set"),
    n_transfer: int = typer.Option(6, help="prompts per transfer set"),
    max_tokens: int = opt.max_tokens(32),
    max_new_tokens: Optional[int] = opt.hidden("--max-new-tokens"),
    batch_size: int = opt.batch_size(4, "requests decoded together (the largest running batch)"),
    batch: Optional[int] = opt.hidden("--batch"),
    batch_sizes: str = typer.Option("", help="requests decoded together, comma-separated: extra batch sizes for the "
                                    "scaling table"),
    thresholds: str = typer.Option("", help="comma-separated margin thresholds (default depends on dtype)"),
    dtype: str = opt.dtype(),
    model: str = opt.model(help=LLAMA_ONLY),
    repeats: int = typer.Option(1, help="interleaved repeats per policy (median time)"),
    prompt_seed: int = opt.prompt_seed(0),
    seed: Optional[int] = opt.hidden("--seed"),
    threads: int = opt.threads(),
    out: Optional[Path] = typer.Option(None, help="also write the tables to this markdown file"),
):
    """Baselines and the threshold sweep (window rule and the paper's single-column rule) on a
    calibration set, then transfer of the chosen thresholds and batch-size scaling."""
    max_new_tokens, batch, seed = _old_spellings(max_tokens, max_new_tokens, batch_size, batch, prompt_seed, seed)
    from verinfer.determinism.experiment import Config

    sizes = opt.sizes("--batch-sizes", batch_sizes)
    _run(Config(model=model, dtype=dtype, calibration=prompts, transfer=tuple(s for s in transfer.split(",") if s),
                n=n, n_transfer=n_transfer, max_new_tokens=max_new_tokens, batch=batch, batch_sizes=sizes,
                thresholds=_floats(thresholds), repeats=repeats, seed=seed), out)


POLICIES = ("margingate", "fast", "always", "deterministic")


@app.command()
@one_line_errors
def decode(
    out: Path = typer.Option(..., "--out", "-o", help="greedy traces to write (.jsonl or .parquet)"),
    prompts: str = opt.prompts(),
    n: int = opt.n(16),
    prompt_seed: int = opt.prompt_seed(0),
    seed: Optional[int] = opt.hidden("--seed"),
    max_tokens: int = opt.max_tokens(64),
    max_new_tokens: Optional[int] = opt.hidden("--max-new-tokens"),
    batch_size: int = opt.batch_size(8, "requests decoded together (the largest running batch)"),
    batch: Optional[int] = opt.hidden("--batch"),
    arrival_gap: int = typer.Option(2, help="request i joins at engine step i * gap (a changing batch)"),
    policy: str = typer.Option("margingate", help="margingate, fast, always or deterministic"),
    threshold: float = typer.Option(0.13, help="margingate: verify steps whose top-1/top-2 margin is below this"),
    commit: str = typer.Option("window", help="margingate: window (exact), repair (the paper's rule) or verified"),
    dtype: str = opt.dtype(help="compute dtype (float32, bfloat16); float32 as in every other command"),
    model: str = opt.model(help=LLAMA_ONLY),
    threads: int = opt.threads(),
):
    """Decode prompts greedily through the dynamic-batching engine under a policy and write traces
    (greedy profile): with margingate's window rule or the deterministic policy, every output is the
    one the request gets decoded alone, whatever the batch."""
    max_new_tokens, batch, seed = _old_spellings(max_tokens, max_new_tokens, batch_size, batch, prompt_seed, seed)
    from verinfer.determinism.engine import Engine, Policy
    from verinfer.determinism.model import Llama
    from verinfer.determinism.study import load_prompt_set, make_requests
    from verinfer.models.backend import Backend
    from verinfer.sampling.params import SamplingParams
    from verinfer.trace import Trace, write_traces

    if policy not in POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    pol = {"margingate": lambda: Policy.margingate(threshold, commit), "fast": Policy.fast,
           "always": lambda: Policy.always(commit), "deterministic": Policy.deterministic}[policy]()
    if n < 1 or max_new_tokens < 1 or batch < 1 or arrival_gap < 0:
        raise ValueError("--n, --max-tokens and --batch-size must be >= 1 and --arrival-gap >= 0")
    if out.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"{out}: the trace file must end in .jsonl or .parquet")
    backend = Backend.load(model, dtype)
    reqs = make_requests(backend.tokenizer, load_prompt_set(prompts, n, seed), max_new_tokens, arrival_gap)
    max_len = max(len(r.prompt) for r in reqs) + max_new_tokens + 1
    run = Engine(Llama(backend.model), batch, max_len, backend.stop_ids()).run(reqs, pol)
    traces = []
    for r in reqs:
        o = run.outputs[r.id]
        traces.append(Trace.of_output(
            r.id, backend.model_id, r.prompt, o.tokens, SamplingParams(profile="greedy", temperature=0.0),
            tokenizer=backend.tokenizer, provider="verinfer-margingate",
            meta={"finish_reason": o.finish, "dtype": dtype, "policy": pol.name, "batch": batch,
                  "verified_at_emission": int(sum(o.verified)), "repairs": int(sum(o.repaired)), "rollbacks": o.rollbacks},
        ))
    write_traces(traces, out)
    s = run.stats
    typer.echo(f"{pol.name}: {len(traces)} requests, {s.protected_decode_steps} protected decode steps, "
               f"verifier launches {100 * s.trigger_rate:.2f}% ({s.final_checks} final checks), "
               f"{s.repairs} repairs, {s.rollbacks} rollbacks ({s.dropped_tokens} tokens dropped), "
               f"{s.cpu_s:.1f} s CPU; wrote {out}")


if __name__ == "__main__":
    app()
