"""``verinfer audit``: audit OpenAI-compatible providers, and build the calibrated bands it uses."""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from verinfer.cli import options as opt
from verinfer.cli.console import console as _console, help_style
from verinfer.cli.errors import one_line_errors as _friendly
from verinfer.files import fresh_path, write_atomic

app = typer.Typer(add_completion=False, **help_style(), no_args_is_help=True,
                  help="Audit OpenAI-compatible providers against a trusted reference, with calibrated bands.")
console = _console()
err = _console(stderr=True)
TOP_K_HELP = ("seeded and seedless modes: top-k (-1: off; sent only when > 0, so requests carry only OpenAI "
              "fields: generate's 50 simulates a vLLM chat deployment, an audit asks what any provider accepts)")
TOP_P_HELP = "seeded and seedless modes: top-p (1.0: off, the whole distribution; generate's 0.95 simulates vLLM chat)"


def sampling_options(fn):
    """The sampling options ``audit bands`` and ``audit run`` share, declared once: the command gets
    them as one dict ``sampling`` of ``api.audit`` keywords, which are ``AuditSpec``'s field names, so
    bands are built for exactly what an audit asks (``--sampler``, the profile's old spelling, is a
    hidden alias)."""
    options = [("profile", str, opt.profile("seeded mode: the provider's sampler profile")),
               ("sampler", Optional[str], opt.hidden("--sampler")),
               ("temperature", float, opt.temperature()),
               ("top_k", int, typer.Option(-1, help=TOP_K_HELP)),
               ("top_p", float, typer.Option(1.0, help=TOP_P_HELP)),
               ("min_p", float, opt.min_p()),
               ("seed", int, opt.seed())]
    signature = inspect.signature(fn)
    params = []
    for p in signature.parameters.values():  # the shared options where the command lists ``sampling``
        params += [inspect.Parameter(name, p.kind, default=default, annotation=kind) for name, kind, default in options] \
            if p.name == "sampling" else [p]

    @functools.wraps(fn)
    def command(*args, **kwargs):
        values = {name: kwargs.pop(name) for name, _, _ in options}
        profile = opt.alias(values.pop("profile"), values.pop("sampler"), "--sampler", "--profile")
        return fn(*args, sampling={"profile": profile, **values}, **kwargs)

    command.__signature__ = signature.replace(parameters=params)
    return command


@app.command()
@_friendly
@sampling_options
def bands(
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="bands file; default: a new file named after the "
                                       "model and settings in the current directory (-2, -3, ... if taken)"),
    model: str = opt.model(help="reference model whose variants the bands measure"),
    prompts: str = opt.prompts(),
    n: int = opt.n(48, "number of prompts per band"),
    prompt_seed: int = opt.prompt_seed(1, "which prompts a built-in set samples (default 1: another sample "
                                       "than the one `audit run` audits by default, 0)"),
    variants: str = typer.Option(",".join(("honest", "bf16", "w8", "fp8-kv", "w4")), help="comma-separated variants"),
    mode: str = typer.Option("greedy", help="greedy, seeded, or logprobs (the paired logprob-gap test of --mode "
                             "logprobs and auto; the other seedless modes need no bands)"),
    sampling: Optional[dict] = None,
    max_tokens: int = opt.max_tokens(48),
    batch_size: int = opt.batch_size(16),
    threads: int = opt.threads(),
):
    """Build calibrated bands (honest, bf16-, 8-bit-, fp8-KV-, 4-bit-like) for an audit's settings."""
    from verinfer.auditing.bands import bands_filename, build_bands
    from verinfer.auditing.logprobs import gap_signature
    from verinfer.auditing.plan import AuditSpec
    from verinfer.models.backend import Backend
    from verinfer.prompts import load_prompts

    spec = AuditSpec(mode=mode, max_tokens=max_tokens, endpoint="chat", **sampling)
    if spec.problems():
        raise ValueError(spec.problems()[0])
    sp = sampling
    backend = Backend.load(model)
    data = build_bands(backend, load_prompts(prompts, n, seed=prompt_seed), spec,
                       [v.strip() for v in variants.split(",") if v.strip()], batch_size,
                       on_stage=lambda s: err.print(s), command=" ".join(
                           ["verinfer audit bands", f"--model {model}", f"--prompts {prompts}", f"--n {n}",
                            f"--prompt-seed {prompt_seed}", f"--variants {variants}", f"--mode {mode}",
                            *([f"--profile {sp['profile']}", f"--temperature {sp['temperature']:g}",
                               f"--top-k {sp['top_k']}", f"--top-p {sp['top_p']:g}", f"--min-p {sp['min_p']:g}",
                               f"--seed {sp['seed']}"]
                              if mode == "seeded" else [f"--temperature {sp['temperature']:g}", f"--top-k {sp['top_k']}",
                                                        f"--top-p {sp['top_p']:g}", f"--min-p {sp['min_p']:g}"]
                              if mode == "logprobs" else []), f"--max-tokens {max_tokens}"]))
    kind = "logprob-gap" if mode == "logprobs" else "margin"
    signature = gap_signature(spec.params(0)) if mode == "logprobs" else spec.signature()
    data["prompt_set"] = prompts  # what an audit compares its own prompts with
    out = out or fresh_path(bands_filename(backend.model_id, signature, kind,
                                           prompts if kind == "logprob-gap" else None))  # never the package's data
    write_atomic(out, json.dumps(data, indent=1))
    for name, b in data["bands"].items():
        toks = sum(s[0] for s in b["sequences"])
        console.print(f"{b['label']:>18}: {len(b['sequences'])} sequences, {toks} tokens, "
                      f"mean clipped {'margin' if kind == 'margin' else 'logprob gap'} "
                      f"{sum(s[1] for s in b['sequences']) / max(toks, 1):.4f}")
    console.print(f"clip {data['clip']:.4g}; wrote {out} in {data['built_s']} s")


def _endpoints(provider: list[str], providers_file: Optional[Path], model: str, api_key_env: str):
    """``name=url`` options and/or a JSON file of ``{name, url, model?, api_key_env?}`` objects."""
    from verinfer.auditing.client import Endpoint, endpoints_from_file
    from verinfer.auditing.secrets import redact_text

    out = []
    for item in provider:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--provider {redact_text(item)!r}: expected NAME=URL with an http(s) base URL "
                             "ending in /v1")
        out.append(Endpoint(name, url, model, api_key_env))
    if providers_file:
        out += endpoints_from_file(providers_file, model, api_key_env)
    if not out:
        raise ValueError("no provider to audit: pass --provider NAME=URL (repeatable) or --providers-file")
    return out


def _reference_model(ctx: typer.Context, model: str, old: Optional[str]) -> str:
    """``--model`` is the local reference model in ``audit run`` too; before issue #31 it was the id
    sent to providers (now ``--served-model``) and the reference was ``--reference-model`` (now its
    hidden alias). An old script's provider id is refused before anything loads, saying so."""
    from verinfer.models.load import available_offline

    given = getattr(ctx.get_parameter_source("model"), "name", None) == "COMMANDLINE"
    if old is not None and given and old != model:
        raise ValueError(f"--model {model} and --reference-model {old}: --model is the local reference model "
                         f"now (--reference-model its old spelling); pass the providers' model id as "
                         f"--served-model {model}")
    model = opt.alias(model, old, "--reference-model", "--model")
    problem = available_offline(model) if given else None
    if problem:
        raise ValueError(f"--model {model}: not a model verinfer can load here ({problem}); --model is the local "
                         f"reference model: pass the providers' model id as --served-model {model}")
    return model


@app.command()
@_friendly
@sampling_options
def run(
    ctx: typer.Context,
    provider: list[str] = typer.Option([], "--provider", "-p", help="NAME=BASE_URL (ending in /v1); repeatable"),
    providers_file: Optional[Path] = opt.input_file("--providers-file", "JSON list of {name, url, model?, "
                                                     "api_key_env?}"),
    out: Path = typer.Option(Path("verinfer-audit"), "--out", "-o", help="audit directory (re-running resumes)"),
    model: str = opt.model(help="local reference model (also the tokenizer): alias, .gguf file, local directory "
                           "or cached hub id; the providers' model id is --served-model"),
    reference_model: Optional[str] = opt.hidden("--reference-model"),
    served_model: Optional[str] = typer.Option(None, "--served-model", help="model id sent to providers (as "
                                               "vLLM's --served-model-name); default: the reference model's id; a "
                                               "providers file's 'model' wins"),
    device: str = opt.device(),
    backend: str = opt.backend(),
    reference_url: Optional[str] = typer.Option(None, help="trusted reference API base URL (e.g. your own vllm "
                                                "serve) returning prompt logprobs (echo) and, for rank / mmd / auto, "
                                                "n samples; default: the local reference model"),
    reference_api_model: Optional[str] = typer.Option(None, help="model id at the reference API"),
    reference_api_key_env: Optional[str] = typer.Option(None, help="env var of the reference API's key"),
    api_key_env: str = typer.Option("OPENAI_API_KEY", help="environment variable holding providers' API key"),
    prompts: str = opt.prompts(),
    n: int = opt.n(),
    prompt_seed: int = opt.prompt_seed(),
    mode: str = typer.Option("greedy", help="greedy (temperature 0 spot checks), seeded (the provider honours "
                             "seeds with a known sampler), or sampled traffic without seeds: surprise (completions' "
                             "reference log-probabilities against their expected value, no draws), rank (one completion "
                             "ranked among reference draws), mmd (many completions per prompt), logprobs (the "
                             "provider's returned logprobs against the reference's), or auto (every test the responses "
                             "allow, combined by Holm's procedure; no seeds unless --seeds)"),
    samples: int = typer.Option(16, help="rank: reference draws per prompt; mmd: completions per prompt from the "
                                "provider (one request with n) and from the reference"),
    stream: bool = typer.Option(False, help="ask for streamed responses (stream: true, server-sent events)"),
    choices: int = typer.Option(1, help="seeded and auto modes: completions per request (sent as n; auto runs mmd "
                                "from 2 on); choice j claims the "
                                "request's seed + j, as vLLM seeds it (prompt i is sent seed + i x choices)"),
    seeds: bool = typer.Option(False, help="auto mode: also send seeds (and ask the first prompts twice to learn "
                               "whether they are honoured), adding the seeded test; default: no seeds, as customers "
                               "send none"),
    top_logprobs: int = typer.Option(5, help="logprobs mode: alternatives asked for per position (0-20; the "
                                     "sampled token's own logprob is always compared)"),
    sampling: Optional[dict] = None,
    max_tokens: int = opt.max_tokens(48),
    endpoint: str = typer.Option("chat", help="chat (messages) or completions (token-id prompts)"),
    token_ids: bool = opt.token_ids("ask for the output's token ids (return_token_ids), or only text "
                                    "(re-tokenized)"),
    no_token_ids: Optional[bool] = opt.hidden("--no-token-ids/--no-no-token-ids"),
    extra_body: Optional[str] = typer.Option(None, help="JSON object of more fields for every generation request "
                                             "(fields the audit sets keep its values); llama-cpp-python's server: "
                                             "'{\"top_k\": 0, \"min_p\": 0, \"repeat_penalty\": 1}'"),
    bands_file: Optional[Path] = opt.input_file("--bands", "bands file from `verinfer audit bands`"),
    calibration: Optional[Path] = opt.input_file("--calibration", "calibration file from `verinfer calibrate` "
                                                 "instead of bands (seeded replays without either: the shipped "
                                                 "calibration of the claimed settings, when one exists)"),
    verdict_batch: Optional[int] = opt.verdict_batch("with --calibration: tokens per verdict batch (a calibrated "
                                                     "size)"),
    batch_size: Optional[int] = opt.hidden("--batch-size"),
    fpr: float = opt.fpr(),
    concurrency: int = typer.Option(4, help="most requests in flight per provider (halved while the server "
                                    "times out or answers slower than half --timeout, raised again as it keeps up)"),
    timeout: float = typer.Option(120.0, help="seconds per network operation (connect, each read)"),
    deadline: float = typer.Option(600.0, help="seconds per request, sent to last byte received (a response "
                                   "still arriving then is kept as rejected and stops the audit)"),
    max_response_mb: float = typer.Option(64.0, help="largest response body read, in MiB (a larger one is kept "
                                          "as rejected, cut there, and stops the audit)"),
    retries: int = typer.Option(4, help="retries on connection errors, timeouts, 5xx and 429"),
    threads: int = opt.threads(),
):
    """Audit providers: ask, persist, verify against the reference, judge against calibrated bands.

    Exit 0: every provider consistent; 1: some provider INCONSISTENT; 2: bad input."""
    verdict_batch = opt.alias(verdict_batch, batch_size, "--batch-size (tokens per verdict batch)", "--verdict-batch")
    if no_token_ids is not None:
        token_ids = not opt.alias(no_token_ids, no_token_ids, "--no-token-ids", "--token-ids/--text-only")
    model = _reference_model(ctx, model, reference_model)
    _endpoints(provider, providers_file, served_model or model, api_key_env)  # refused before torch or a model loads
    if backend != "transformers" and mode in ("rank", "mmd", "auto") and not reference_url:
        raise ValueError(f"--mode {mode} draws reference samples, which decode with a KV cache: with --backend "
                         "vllm give --reference-url (your own vllm serve), or use --backend transformers")
    from verinfer import api
    from verinfer.auditing.report import warning_lines

    reference = api.load_model(model, "float32", device, backend)
    endpoints = _endpoints(provider, providers_file, served_model or reference.model_id, api_key_env)
    result = api.audit(endpoints, out=out, prompts=prompts, n=n, prompt_seed=prompt_seed, mode=mode, **sampling,
                       max_tokens=max_tokens, endpoint=endpoint, token_ids=token_ids, bands=bands_file,
                       calibration=calibration, batch_size=verdict_batch, fpr=fpr, concurrency=concurrency,
                       timeout=timeout, retries=retries, deadline=deadline, max_response_mb=max_response_mb,
                       reference_url=reference_url,
                       reference_api_model=reference_api_model, reference_api_key_env=reference_api_key_env,
                       backend=reference, on_stage=lambda s: err.print(s), samples=samples, stream=stream,
                       top_logprobs=top_logprobs, extra_body=opt.json_object("--extra-body", extra_body),
                       choices=choices, seeds=seeds)
    json_path, html_path = result.reports
    for a in result.providers:
        style = "green" if a.verdict.consistent else "red"
        console.print(f"[bold]{a.endpoint.name}[/bold]: [{style}]{a.verdict.text}[/{style}]", highlight=False,
                      soft_wrap=True)
        for t in a.tests or []:  # --mode auto: each test, whether it ran, and the one that carried the verdict
            console.print(f"  {t['test']}: " + (f"p {t['p_value']:.3g}, Holm-adjusted {t['p_holm']:.3g}"
                                                + (" (rejects)" if t["rejects"] else "") if t["ran"]
                                                else f"not run ({escape(t['note'])})"), highlight=False, soft_wrap=True)
        for line in warning_lines(a):  # what the provider said it served contradicts the request
            console.print(f"  [yellow]warning:[/yellow] {escape(line)}", highlight=False, soft_wrap=True)
    console.print(f"reports: {json_path} {html_path}")
    if any(not a.verdict.consistent for a in result.providers):
        raise typer.Exit(1)
