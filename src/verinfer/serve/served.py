"""The model behind the API: the reference backend, its misconfiguration, the schedulers that decode
for it, the limits a request is checked against, and a request decoded into its ``n`` outcomes.

A request's ``n`` rows are submitted together (one ``serve.jobs.Group``) and awaited together
(``ServedModel.wait``): a client that disconnects, a queue timeout or a failure of one row ends
them all. A misconfigured server decodes with the variant's model and parameters while every
response claims the honest configuration (``serve.config``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from verinfer.commits.activation_difr import FingerprintSpec
from verinfer.commits.trace_commits import CommitSpec, build_commits
from verinfer.models.backend import Backend
from verinfer.models.derived import draft_backend
from verinfer.models.load import ModelNotAvailable
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import get_profile
from verinfer.serve.config import Misconfiguration, ServeConfig, parse_misconfig
from verinfer.serve.jobs import Abandoned, Generation, Group, Job, QueueTimeout
from verinfer.serve.prompting import PromptIds
from verinfer.serve.protocol import APIError
from verinfer.serve.results import Results
from verinfer.serve.scheduler import Scheduler
from verinfer.simulate.generate import Request as GenRequest


@dataclass
class Outcome:
    """One finished request, after stop strings: what the response is built from."""

    prompt: PromptIds
    generation: Generation
    tokens: list[int]
    text: str
    finish_reason: str
    stop_reason: str | None
    claimed: SamplingParams
    commits: dict | None


def cut_at_stop(tokenizer, tokens: list[int], stops: list[str] | None) -> tuple[int, str, str | None]:
    """(tokens kept, text, matched stop string): cut at the first stop string, as OpenAI does."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if not stops or not any(s in text for s in stops):
        return len(tokens), text, None
    for k in range(1, len(tokens) + 1):
        partial = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        hits = [(partial.find(s), s) for s in stops if s in partial]
        if hits:
            at, stop = min(hits)
            return k, partial[:at], stop
    return len(tokens), text, None  # pragma: no cover - the full text contained a stop string


class Drafts:
    """Draft models derived from ``source`` by name (``models.derived.draft_backend``), each built once."""

    def __init__(self, source: Backend):
        self.source, self.built = source, {}

    def __call__(self, name: str) -> Backend:
        if name not in self.built:
            self.built[name] = draft_backend(self.source, name)
        return self.built[name]


class ServedModel:
    """The model behind the API: reference backend, misconfiguration, schedulers, limits."""

    def __init__(self, backend: Backend, config: ServeConfig):
        problems = config.problems()
        if problems:
            raise ValueError(f"serve config: {problems[0]}")
        get_profile(config.sampler)  # ValueError naming the known profiles
        self.reference = backend
        self.config = config
        self.mis: Misconfiguration = parse_misconfig(config.misconfig)
        variant = self.mis.variant
        self.speculative = config.speculative_claim
        if self.speculative is not None and variant is not None and variant.hook is not None:
            raise ValueError(f"--speculative cannot serve misconfig {variant.name!r}: its sampler bug is a per-step "
                             "token hook of the batched decoder, which speculative decoding does not use")
        self.generator = variant.build(backend) if variant is not None else backend
        # Drafts derive from the claimed model, so a misconfigured target still drafts as claimed; honest
        # noise (bf16, ...) reaches the draft too, as in ``Variant.generate``. The claimed draft is built
        # now, so a draft that cannot be built fails at start.
        honest_drafts = drafts = Drafts(backend)
        if variant is not None and variant.honest and self.generator is not backend:
            drafts = Drafts(self.generator)
        if self.speculative is not None:
            try:
                drafts(self.speculative["draft"])
                honest_drafts(self.speculative["draft"])
            except (ValueError, ModelNotAvailable) as exc:
                raise ValueError(f"--speculative {config.speculative}: {exc}") from None
        spec_rule = getattr(variant, "spec_rule", None) or "vllm"  # a speculative cheat, when the variant has one
        self.name = config.served_model_name or backend.model_id
        context = int(getattr(backend.model.config.get_text_config(), "max_position_embeddings", 0) or 2048)
        self.max_model_len = min(config.max_model_len or context, context)
        self.max_prompt_tokens = min(config.max_prompt_tokens or self.max_model_len, self.max_model_len)
        max_batch = variant.batch_size if variant is not None and variant.batch_size else config.max_batch
        self.scheduler = Scheduler(self.generator, variant, max_batch, config.batch_wait_s,
                                   max_batch_prompt_tokens=config.max_batch_prompt_tokens,
                                   queue_timeout_s=config.queue_timeout_s, drafts=drafts, spec_rule=spec_rule,
                                   prefill_chunk=config.prefill_chunk_tokens)
        self.honest_scheduler = self.scheduler  # the greedy-only cheat decodes greedy requests honestly, on its own thread
        if self.mis.greedy_honest:
            self.honest_scheduler = Scheduler(backend, None, config.max_batch, config.batch_wait_s,
                                              max_batch_prompt_tokens=config.max_batch_prompt_tokens,
                                              queue_timeout_s=config.queue_timeout_s, drafts=honest_drafts,
                                              prefill_chunk=config.prefill_chunk_tokens)
        self.results = Results(config.result_ttl_s, config.max_kept_results)
        self.dropped_streams = 0  # live streams given up on: their client stopped reading (``serve.live``)
        self.created = int(time.time())

    @property
    def schedulers(self) -> list[Scheduler]:
        return [self.scheduler] + ([self.honest_scheduler] if self.honest_scheduler is not self.scheduler else [])

    def scheduler_for(self, claimed: SamplingParams) -> Scheduler:
        return self.scheduler if self.mis.deviates(claimed) else self.honest_scheduler

    @property
    def tokenizer(self):
        return self.reference.tokenizer

    def card(self) -> dict[str, Any]:
        return {
            "id": self.name, "object": "model", "created": self.created, "owned_by": "verinfer",
            "root": self.reference.model_id, "max_model_len": self.max_model_len,
            "verinfer": {"sampler_profile": self.config.sampler, "vocab_size": self.reference.vocab_size,
                         "model_id": self.reference.model_id,
                         "dtype": str(self.reference.dtype).replace("torch.", ""),
                         **({"speculative": dict(self.speculative)} if self.speculative else {})},
        }

    # -- request handling ----------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.name:
            raise APIError(f"model {name!r} does not exist; this server serves {self.name!r}", "model", 404,
                           code="model_not_found")

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.reference.vocab_size]
        if bad:
            i, t = bad[0]
            more = f" ({len(bad)} such ids)" if len(bad) > 1 else ""
            raise APIError(f"{param}[{i}]: token id {t} is outside the vocabulary [0, {self.reference.vocab_size})"
                           + more, param)

    def check_length(self, prompt: PromptIds, max_tokens: int, param: str) -> None:
        if max_tokens > self.config.max_tokens_limit:
            raise APIError(f"max_tokens: {max_tokens} is above this server's limit of {self.config.max_tokens_limit}",
                           "max_tokens")
        hidden = len(prompt.actual) - len(prompt.reported)
        context = self.max_model_len - hidden  # a concealed injection also hides the room it takes
        longest = self.max_prompt_tokens - hidden
        if len(prompt.reported) > longest:
            raise APIError(f"{param}: the prompt has {len(prompt.reported)} tokens; this server takes prompts of at "
                           f"most {longest} tokens (context {context})", param)
        if len(prompt.reported) + max_tokens > context:
            raise APIError(f"{param}: the prompt has {len(prompt.reported)} tokens and max_tokens is {max_tokens}, "
                           f"more than the context of {context} tokens", param)

    def claimed_params(self, req) -> SamplingParams:
        seed = req.seed if req.seed is not None else secrets.randbelow(2**63)
        params = SamplingParams(profile=self.config.sampler, temperature=req.temperature, top_k=req.top_k,
                                top_p=req.top_p, min_p=req.min_p, seed=seed,
                                speculative=dict(self.speculative) if self.speculative else None)
        problems = params.problems()
        if problems:  # the request model's ranges make this unreachable; keep the check honest anyway
            raise APIError(f"sampling: {problems[0]}")
        return params

    def commit_spec(self, req, max_tokens: int) -> CommitSpec | None:
        c = req.verinfer_commits
        if c is None:
            return None
        if max_tokens < 1:
            raise APIError("verinfer_commits: commits cover generated tokens; max_tokens must be >= 1",
                           "verinfer_commits")
        fp = None
        if c.fingerprint_dim:
            fp = FingerprintSpec(c.fingerprint_dim, precision=c.fingerprint_precision, stride=c.fingerprint_stride,
                                 hidden_size=self.reference.hidden_size)
            if fp.problems():
                raise APIError(f"verinfer_commits.fingerprint_dim: {fp.problems()[0]}", "verinfer_commits.fingerprint_dim")
        return CommitSpec(fingerprint=fp, toploc_k=128 if c.toploc else None)

    async def wait(self, jobs: list[Job], client: Request | None, scheduler: Scheduler) -> list[Generation]:
        """Submit one request's jobs to ``scheduler`` and await them all. They end together: when
        ``client`` disconnects, when the request is not admitted within the queue timeout, or when
        one of them fails (its siblings are then abandoned)."""
        group = jobs[0].group
        try:
            waiters = [asyncio.wrap_future(scheduler.submit(job)) for job in jobs]
        except RuntimeError as exc:
            raise APIError(str(exc), status=503, type="server_error") from None
        for w in waiters:  # retrieved even if nobody waits any more
            w.add_done_callback(lambda f: f.cancelled() or f.exception())
        timeout = self.config.queue_timeout_s
        settled = False
        try:
            while True:
                done, pending = await asyncio.wait(waiters, timeout=self.config.disconnect_poll_s,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                failed = next((w for w in done if not w.cancelled() and w.exception() is not None), None)
                if failed is not None:
                    raise failed.exception()
                if not pending:
                    settled = True
                    return [w.result() for w in waiters]
                if client is not None and await client.is_disconnected():
                    raise Abandoned()
                if group.expired(timeout):
                    for job in jobs:  # cancelled before they ran: the scheduler counts them as expired
                        if not job.future.cancel():
                            job.gone.set()
                    settled = True
                    raise QueueTimeout(f"the request waited more than {timeout:g} s in the queue")
        except QueueTimeout as exc:
            raise APIError(f"{exc}; the server is overloaded, retry later", status=503, type="server_error",
                           code="queue_timeout") from None
        except Abandoned:
            raise APIError("the client disconnected", status=499, code="client_disconnected") from None
        except APIError:
            raise
        except Exception as exc:  # a failure inside the model: this request only
            raise APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500,
                           type="server_error") from None
        finally:  # the client left, this task was cancelled, or a row failed: the others stop too
            if not settled:
                for job in jobs:
                    job.abandon()

    async def run(self, req, prompt: PromptIds, max_tokens: int, logprobs: int | None,
                  prompt_logprobs: int | None, client: Request | None = None, on_token=None) -> list[Outcome]:
        """The request's ``n`` completions, decoded as one group (choice j of a seeded request uses seed + j);
        ``on_token(j, index, token, logprobs)`` hears choice j's tokens as they are decoded."""
        spec = self.commit_spec(req, max_tokens)
        claims = [self.claimed_params(req) for _ in range(req.n)]
        if req.seed is not None:
            claims = [c.with_(seed=req.seed + j) for j, c in enumerate(claims)]
        group, jobs = Group(), []
        for j, claimed in enumerate(claims):
            actual = self.mis.actual_params(claimed)
            hear = None if on_token is None else (lambda i, t, lp, j=j: on_token(j, i, t, lp))
            jobs.append(Job(GenRequest(f"req-{uuid.uuid4().hex}", prompt.actual, actual), max_tokens, logprobs,
                            prompt_logprobs if j == 0 else None, capture=spec is not None, on_token=hear, group=group))
        # One scheduler per request: its rows differ only in their seeds, which never decide the cheat's choice.
        gens = await self.wait(jobs, client, self.scheduler_for(claims[0]))
        out = []
        for claimed, gen in zip(claims, gens):
            n, text, stop = cut_at_stop(self.tokenizer, gen.tokens, req.stop)
            tokens = gen.tokens[:n]
            finish = "stop" if stop is not None else gen.finish_reason
            commits = None
            if spec is not None and tokens:
                rows = gen.rows[: len(prompt.actual) + n - 1]
                commits = build_commits(rows, len(prompt.actual), spec, self.reference.model_id)
            out.append(Outcome(prompt, gen, tokens, text, finish, stop, claimed, commits))
        return out

    @staticmethod
    def usage(outcomes: list[Outcome]) -> dict[str, int]:
        p, c = len(outcomes[0].prompt.reported), sum(len(o.tokens) for o in outcomes)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def extensions(self, o: Outcome, choice: dict) -> None:
        choice["verinfer_sampling"] = o.claimed.to_dict()
        modes = o.generation.spec_modes
        if modes is not None and o.claimed.speculative:  # a provider hiding its speculation reports none
            choice["verinfer_spec_modes"] = modes[: len(o.tokens)]
        if o.commits is not None:
            choice["verinfer_commits"] = o.commits

