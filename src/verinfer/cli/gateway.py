"""``verinfer gateway``: the recording reverse proxy in front of an engine (``verinfer.production.gateway``).

``verinfer.cli.main`` registers it as a command.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from verinfer.cli import options as opt
from verinfer.cli.errors import one_line_errors


def _bool(name: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _claimed(spec: str):
    """The claimed model's id now, and a loader of its tokenizer and stop ids (offline; a GGUF file is
    converted once) that the recorder calls on its own thread, so the gateway listens at once."""
    from verinfer.models.load import resolve

    source = resolve(spec)

    def load():
        from transformers import AutoTokenizer

        from verinfer.auditing.run import stop_ids
        from verinfer.models.load import ModelNotAvailable, local_dir

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(local_dir(source)), local_files_only=True)
        except OSError as exc:
            raise ModelNotAvailable(f"the tokenizer of {spec!r} is not available offline: {exc}".splitlines()[0]) from None
        return tokenizer, frozenset(stop_ids(tokenizer))
    return source.model_id, load


def _writable(directory: Path) -> None:
    """Refuse a trace directory the gateway cannot write before any request is proxied."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".verinfer-gateway-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
    finally:
        probe.unlink(missing_ok=True)


@one_line_errors
def gateway(
    upstream: str = typer.Option(..., help="the engine's base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is "
                                           "dropped)"),
    port: int = typer.Option(8080, help="TCP port to listen on (0: a free one, logged at start)"),
    traces: Path = typer.Option(..., help="directory for the trace shards (created if missing)"),
    profile: str = opt.profile("sampler profile the traces claim"),
    sampler: Optional[str] = opt.hidden("--sampler"),
    assign_seeds: bool = typer.Option(False, "--assign-seeds",
                                      help="give sampled requests without a seed one (recorded), so they verify"),
    model: Optional[str] = typer.Option(
        None, help="the claimed model (alias, .gguf, local directory): its id goes into the traces and its "
                   "tokenizer re-tokenizes engines that return no token ids (default: the id the engine reports, "
                   "returned ids only)"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (beyond loopback it needs --auth-token-env)"),
    auth_token_env: Optional[str] = typer.Option(None, help="environment variable holding the token /gateway/metrics "
                                                 "and /gateway/health's details ask for (Bearer, or the basic-auth "
                                                 "password); proxied requests keep their own Authorization"),
    provider: Optional[str] = typer.Option(None, help="provider name in the traces (default: the upstream's "
                                                      "host:port)"),
    shard_records: int = typer.Option(1000, help="close a shard after this many traces"),
    shard_seconds: float = typer.Option(60.0, help="close a shard this many seconds after its first trace"),
    queue_size: int = typer.Option(10000, help="exchanges waiting for the writer before --on-full applies"),
    on_full: str = typer.Option("drop", help="full queue: drop (count and log; clients never wait) or block "
                                             "(clients wait for room)"),
    store_text: str = typer.Option("true", help="false: keep token ids only (no messages, prompts or output "
                                                "text in the traces)"),
    token_ids: bool = opt.token_ids("ask the engine for the output's token ids (vLLM's return_token_ids), or "
                                    "only text (re-tokenized with --model's tokenizer)"),
    no_token_ids: Optional[bool] = opt.hidden("--no-token-ids"),
    request_defaults: Optional[str] = typer.Option(
        None, help="JSON object of fields to add to requests that leave them out, e.g. llama_cpp.server's "
                   "'{\"top_k\": 0, \"min_p\": 0, \"repeat_penalty\": 1}' so its defaults do not apply unrecorded"),
    timeout: float = typer.Option(600.0, help="seconds per network operation with the engine (connect, each "
                                  "read or write): a non-streamed completion sends nothing until it is done"),
    access_log: bool = typer.Option(False, "--access-log", help="one JSON log line per request"),
    fsync: str = typer.Option("second", help="when the open shard's write-ahead file reaches the disk: always "
                                             "(every flush), second (at most once a second) or never (the OS "
                                             "decides; shards are then not fsync'd either)"),
    max_body_mb: float = typer.Option(64.0, help="largest generation request (413 beyond) and largest answer "
                                                 "recorded (counted unrecordable beyond); other bodies stream through"),
    workers: int = typer.Option(1, help="worker processes sharing the port, each with its own recorder (give the "
                                        "gateway the cores: throughput grows with them)"),
):
    """Proxy an OpenAI-compatible engine unchanged for clients and record every exchange as traces
    (Parquet shards that `verinfer verify DIR` reads)."""
    import uvicorn

    from verinfer.extras import require

    require("production", "verinfer gateway", only=("prometheus_client", "httptools"))  # no database: it starts faster

    from verinfer.production.access import service_token
    from verinfer.production.gateway import Gateway, create_app
    from verinfer.production.logs import json_log, uvicorn_log_config
    from verinfer.sockets import bind

    if no_token_ids:
        token_ids = not opt.alias(no_token_ids, no_token_ids, "--no-token-ids", "--text-only")
    spec = {"upstream": upstream, "traces": str(traces), "profile": opt.alias(profile, sampler, "--sampler", "--profile"),
            "model": model, "provider": provider, "store_text": _bool("--store-text", store_text),
            "assign_seeds": assign_seeds, "token_ids": token_ids,
            "defaults": opt.json_object("--request-defaults", request_defaults) or {},
            "shard_records": shard_records, "shard_seconds": shard_seconds, "queue_size": queue_size,
            "on_full": on_full, "timeout_s": timeout, "access_log": access_log, "max_body_mb": max_body_mb,
            "fsync": fsync, "workers": workers, "auth_token_env": auth_token_env}
    token = service_token(host, auth_token_env)
    config = _config(spec)  # every problem is refused here, before a socket or a worker
    _writable(traces)
    sock = bind(host, port)
    log = json_log()
    host_, port_ = sock.getsockname()[:2]
    log("info", "listening", url=f"http://{host_}:{port_}", upstream=config.base, workers=workers)
    settings = dict(log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=30,
                    log_config=uvicorn_log_config())
    if workers == 1:
        uvicorn.Server(uvicorn.Config(create_app(Gateway(config, log), token), **settings)).run(sockets=[sock])
        return
    import inspect

    from uvicorn.supervisors import Multiprocess

    os.environ[SPEC_ENV] = json.dumps(spec)  # each worker process builds its own gateway from it (worker_app)
    uconfig = uvicorn.Config(f"{__name__}:worker_app", factory=True, workers=workers, **settings)
    older = "target" in inspect.signature(Multiprocess).parameters  # uvicorn before 0.36 took the target
    Multiprocess(uconfig, sockets=[sock], **({"target": uvicorn.Server(uconfig).run} if older else {})).run()


SPEC_ENV = "VERINFER_GATEWAY_SPEC"


def _config(spec: dict):
    """The gateway's configuration from the command line's values (the command and each worker)."""
    from verinfer.production.exchange import Recording
    from verinfer.production.gateway import GatewayConfig
    from verinfer.sampling.profile_names import canonical_profile

    canonical_profile(spec["profile"])  # an unknown name is refused here, naming the known ones
    model_id, load = _claimed(spec["model"]) if spec["model"] else (None, None)
    upstream = spec["upstream"]
    name = spec["provider"] or upstream.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    recording = Recording(name, spec["profile"], model_id, store_text=spec["store_text"], load=load)
    keys = ("assign_seeds", "token_ids", "defaults", "shard_records", "shard_seconds", "queue_size", "on_full",
            "timeout_s", "access_log", "max_body_mb", "fsync", "workers")
    config = GatewayConfig(upstream, Path(spec["traces"]), recording, **{k: spec[k] for k in keys})
    if config.problems():
        raise ValueError(config.problems()[0])
    return config


def worker_app():
    """One worker's ASGI app (``--workers`` > 1: uvicorn imports this in each worker process)."""
    from verinfer.production.gateway import Gateway, create_app
    from verinfer.production.logs import json_log

    spec = json.loads(os.environ[SPEC_ENV])
    token = os.environ[spec["auth_token_env"]] if spec["auth_token_env"] else None  # checked by the command
    return create_app(Gateway(_config(spec), json_log()), token)
