"""``verinfer serve``: run the OpenAI-compatible provider server (honest or misconfigured) with uvicorn.

``verinfer.cli.main`` registers ``serve`` as a command; ``app`` runs it standalone.
"""

from __future__ import annotations

import os
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import typer  # noqa: E402

from verinfer.cli import options as opt  # noqa: E402
from verinfer.cli.console import help_style  # noqa: E402

MISCONFIG_HELP = (
    "Serve misconfigured while the API claims the honest configuration; comma-separated or repeated. "
    "Any variant of the detection study (verinfer.simulate.variants): w4 (4-bit RTN weights, groups of 128), "
    "w8 (8-bit per channel), wB-gG[-asym], fp8-kv (fp8 KV cache, scale 1, as vLLM), fp8-kv-tensor, fp8-kv-head, "
    "fp8-kv-fresh, bf16, temperature-X (samples at X), top-p-X, wrong-seed (seed + 1000003), bug-topK[-rateR] "
    "(a sampler bug: rate R of tokens uniform among the top K), batch-N; joined with '+' they compose. "
    "Serving-level: system-prompt:TEXT (a hidden system prompt; responses report the client's prompt ids; "
    "takes the rest of the value, commas included) and old-template (chat rendered with plain ChatML, "
    "no default system message; reported prompt ids are the ones used), greedy-honest:VARIANT (honest at "
    "temperature 0, VARIANT for sampled requests: the greedy-only cheat). --list-misconfigs prints them all."
)

SPECULATIVE_HELP = (
    "DRAFT:K: decode every sampled request (T > 0) with vLLM 0.32's speculative decoding (model runner V2), "
    "a draft model proposing K tokens per step (1-32), and claim it in verinfer_sampling.speculative. "
    "DRAFT is layers:N (the served model's first N decoder layers) or wN (its N-bit RTN weights): "
    "layers:28:4, w4:2. Each sampled request then steps speculatively beside the batch (its own KV caches); "
    "greedy ones decode in the batch (same tokens). "
    "Each choice reports verinfer_spec_modes (a accepted draft, r resampled, b bonus per token). "
    "Needs --profile vllm."
)

app = typer.Typer(add_completion=False, **help_style(), help="Serve a local model over an OpenAI-compatible HTTP API.")


def _list_misconfigs() -> None:
    from verinfer.simulate.variants import family_docs, list_variants

    for v in list_variants():
        typer.echo(f"{v.name:<20} {'(honest) ' if v.honest else ''}{v.description}")
    for doc in family_docs():
        typer.echo(f"{'':<20} family {doc}")
    typer.echo(f"{'system-prompt:TEXT':<20} inject TEXT as a system prompt the client never sees")
    typer.echo(f"{'old-template':<20} render chat with plain ChatML (no default system message)")
    typer.echo(f"{'greedy-honest:VARIANT':<20} honest at temperature 0, VARIANT (e.g. w4) for sampled requests")


@app.callback(invoke_without_command=True)
def serve(
    model: str = opt.model(),
    host: str = typer.Option("127.0.0.1", help="interface to listen on"),
    port: int = typer.Option(8000, help="TCP port (0: a free one, printed at start)"),
    profile: str = opt.profile(),
    sampler: Optional[str] = opt.hidden("--sampler"),
    dtype: str = opt.dtype("float32", "compute dtype of the served (claimed) model"),
    device: str = opt.device(),
    batch_size: int = opt.batch_size(8, "most requests decoded together"),
    max_batch: Optional[int] = opt.hidden("--max-batch"),
    batch_wait_ms: float = typer.Option(5.0, help="how long an idle server waits for companions of a first request"),
    max_tokens_limit: int = typer.Option(1024, help="largest max_tokens a request may ask for"),
    max_model_len: Optional[int] = typer.Option(None, help="context length (default: the model's)"),
    max_prompt_tokens: Optional[int] = typer.Option(
        None, help="longest prompt a request may send, in tokens (default: the context length); longer: 400"),
    max_batch_prompt_tokens: int = typer.Option(
        8192, help="prefill budget of the running batch: rows x longest prompt (left padding); a request "
                   "over it on its own runs alone"),
    prefill_chunk: int = typer.Option(
        512, help="prompt tokens prefilled per chunk and per decoding step; a prompt whose clients all left "
                  "stops between chunks (0: one pass)"),
    queue_timeout: float = typer.Option(
        60.0, help="seconds a request may wait for its first row to be admitted before it gets 503 (0: no limit)"),
    stream_buffer: int = typer.Option(
        256, help="decoded chunks a live stream may hold for a client that does not read them (beyond the "
                  "OS socket buffers); past it the client is dropped and its rows stop"),
    result_ttl: float = typer.Option(
        600.0, help="seconds the result of a request with an Idempotency-Key header is kept for its retries"),
    max_request_bytes: int = typer.Option(1 << 20, help="largest request body in bytes; larger: 413"),
    misconfig: list[str] = typer.Option([], help=MISCONFIG_HELP),
    speculative: Optional[str] = typer.Option(None, "--speculative", metavar="DRAFT:K", help=SPECULATIVE_HELP),
    served_model_name: Optional[str] = typer.Option(None, help="model id the API reports (default: the model's id)"),
    threads: int = opt.threads(),
    list_misconfigs: bool = typer.Option(False, "--list-misconfigs", help="print every misconfiguration and exit"),
):
    """Serve MODEL at http://HOST:PORT/v1 (/models, /completions, /chat/completions)."""
    from verinfer.cli.console import console

    err = console(stderr=True)
    max_batch = opt.alias(batch_size, max_batch, "--max-batch", "--batch-size")
    profile = opt.alias(profile, sampler, "--sampler", "--profile")
    if list_misconfigs:
        _list_misconfigs()
        raise typer.Exit(0)
    try:
        _serve(err, model, host, port, profile, dtype, device, max_batch, batch_wait_ms, max_tokens_limit, max_model_len,
               misconfig, served_model_name, max_prompt_tokens=max_prompt_tokens,
               max_batch_prompt_tokens=max_batch_prompt_tokens, prefill_chunk_tokens=prefill_chunk,
               queue_timeout_s=queue_timeout, stream_buffer_events=stream_buffer, result_ttl_s=result_ttl,
               max_request_bytes=max_request_bytes, speculative=speculative)
    except (ValueError, OSError) as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _serve(err, model, host, port, profile, dtype, device, max_batch, batch_wait_ms, max_tokens_limit, max_model_len,
           misconfig, served_model_name, **limits) -> None:
    import uvicorn

    from verinfer.models.backend import Backend
    from verinfer.models.load import ModelNotAvailable
    from verinfer.serve.app import ServedModel, create_app
    from verinfer.serve.config import ServeConfig, split_names
    from verinfer.sockets import base_url, bind

    config = ServeConfig(sampler=profile, max_batch=max_batch, misconfig=split_names(misconfig),
                         served_model_name=served_model_name, max_tokens_limit=max_tokens_limit,
                         max_model_len=max_model_len, batch_wait_s=batch_wait_ms / 1000, host=host, port=port,
                         **limits)
    if config.problems():
        raise ValueError(config.problems()[0])
    try:
        with err.status(f"loading {model} ({dtype})"):
            backend = Backend.load(model, dtype, device=device)
    except ModelNotAvailable as exc:
        raise ValueError(str(exc)) from None
    building = [*config.misconfig, *([f"draft {config.speculative}"] if config.speculative else [])]
    with err.status("building the served model" + (f" ({', '.join(building)})" if building else "")):
        served = ServedModel(backend, config)
    sock = bind(host, port)
    state = "honest" if served.mis.honest else f"MISCONFIGURED: {', '.join(served.mis.names)}"
    if served.speculative:
        state += f"; speculative: draft {served.speculative['draft']}, k={served.speculative['k']}"
    err.print(f"serving {served.name} ({state}; sampler profile {profile}, {dtype}, batches of up to "
              f"{served.scheduler.max_batch}) at {base_url(sock)}", highlight=False)
    uvicorn.Server(uvicorn.Config(create_app(backend, config, served), log_level="info")).run(sockets=[sock])
