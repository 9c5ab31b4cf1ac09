"""The OpenAI-compatible provider server: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Seeds and replay. Every response is generated with the server's sampler profile (``--sampler``)
through ``verinfer.simulate.generate.decode_batch``, the code the verifier replays, and each choice carries
``verinfer_sampling``: the ``SamplingParams`` dict (profile, temperature, top_k, top_p, min_p, seed)
the provider claims. A request without ``seed`` gets a random one in [0, 2^63), reported there.
For the ``vllm`` profile the k-th output token (k = 0, 1, ...) uses the noise of position
``len(prompt_token_ids) - 1 + k`` under that seed, where ``prompt_token_ids`` are the ids returned
with ``return_token_ids`` (for chat: the prompt rendered with the model's chat template and the
generation prompt); for ``vllm-v1`` (alias ``torch-exponential``) it uses the k-th full-vocabulary draw of a
``torch.Generator`` seeded with the seed; ``temperature`` 0 (below 1e-5) is greedy. So

    Trace(id, model, choice["prompt_token_ids"], choice["token_ids"],
          SamplingParams.from_dict(choice["verinfer_sampling"]), fingerprints=choice.get("verinfer_commits"))

(for chat, ``prompt_token_ids`` is at the top level of the response, as in vLLM) verifies as honest
with ``verinfer verify`` against an honest server, batch noise aside: requests decoded in one batch
are left-padded together, which can move fp32 logits by ~1e-6 (the honest band calibrates this).

Returned token ids follow vLLM's ``return_token_ids``: completions put ``prompt_token_ids`` and
``token_ids`` in each choice; chat puts ``prompt_token_ids`` at the top level and ``token_ids`` in
each choice. ``token_ids`` are the output tokens only (a stop token, if emitted, included; with a
``stop`` string, up to the token that completed it).

Misconfigured servers (``ServeConfig.misconfig``, see ``verinfer.serve.config``) claim the honest
configuration in every field: model id, ``verinfer_sampling``, ``/v1/models``.

Speculative decoding (``ServeConfig.speculative``, ``--speculative DRAFT:K``). Every request claims
``verinfer_sampling.speculative = {"draft", "k"}``; sampled ones are decoded speculatively one at a
time (``verinfer.serve.worker``), greedy ones by the batched decoder (identical tokens: vLLM
accepts a draft iff it is the target's argmax). A speculatively decoded choice also carries
``verinfer_spec_modes``: one letter per returned token id, ``a`` (accepted draft), ``r`` (resampled
after a rejection) or ``b`` (bonus after all k drafts passed), cut with the tokens at a stop string;
it becomes the trace's ``spec_modes``, so ``Trace(..., spec_modes=choice.get("verinfer_spec_modes"))``
replays with ``verinfer verify``. Streamed responses send it on each choice's last chunk, beside
``verinfer_sampling`` (the request is decoded whole first, as without speculation). ``/health``
counts ``spec_requests``, ``spec_tokens`` and ``spec_accepted`` (accepted drafts among those tokens).

Limits and errors. Every error is ``{"error": {"message", "type", "param", "code"}}``. A request the
server cannot take is refused before it reaches a batch: 400 naming the field (``param``) for any
value out of range, a lone surrogate, an integer of over 40 digits, a prompt longer than
``max_prompt_tokens`` or than the context; 400 for a body that is not UTF-8 JSON or nests deeper
than 32 levels; 413 for a body over ``max_request_bytes``. A request still queued after
``queue_timeout_s`` gets 503 (``code: "queue_timeout"``); one that fails inside the model gets
500 (``type: "server_error"``) alone, the requests batched with it are decoded again without it.
A handler whose client disconnects abandons its job (see ``verinfer.serve.worker``). The OpenAPI
schema (``/openapi.json``) describes both request bodies, bounds included.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from verinfer.simulate.generate import Request as GenRequest
from verinfer.models.backend import Backend
from verinfer.models.derived import draft_backend
from verinfer.models.load import ModelNotAvailable
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import get_profile
from verinfer.serve.config import Misconfiguration, ServeConfig, parse_misconfig
from verinfer.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from verinfer.serve.prompting import PromptIds, chat_prompt, completion_prompt
from verinfer.serve.protocol import APIError, ChatRequest, CompletionRequest, decode_body, parse
from verinfer.serve.stream import (LiveChoice, chunk_head, last_chunk, role_chunk, sse, sse_live, stream_chunks,
                                   text_pieces, token_chunk)
from verinfer.serve.worker import Abandoned, BatchWorker, Generation, Job, QueueTimeout
from verinfer.commits.activation_difr import FingerprintSpec
from verinfer.commits.trace_commits import CommitSpec, build_commits


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


class _Drafts:
    """Draft models derived from ``source`` by name (``models.derived.draft_backend``), each built once."""

    def __init__(self, source: Backend):
        self.source, self.built = source, {}

    def __call__(self, name: str) -> Backend:
        if name not in self.built:
            self.built[name] = draft_backend(self.source, name)
        return self.built[name]


class ServedModel:
    """The model behind the API: reference backend, misconfiguration, worker, limits."""

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
        honest_drafts = drafts = _Drafts(backend)
        if variant is not None and variant.honest and self.generator is not backend:
            drafts = _Drafts(self.generator)
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
        self.worker = BatchWorker(self.generator, variant, max_batch, config.batch_wait_s,
                                  max_batch_prompt_tokens=config.max_batch_prompt_tokens,
                                  queue_timeout_s=config.queue_timeout_s, drafts=drafts, spec_rule=spec_rule,
                                  prefill_chunk=config.prefill_chunk_tokens)
        self.honest_worker = self.worker  # the greedy-only cheat decodes greedy requests honestly, on its own thread
        if self.mis.greedy_honest:
            self.honest_worker = BatchWorker(backend, None, config.max_batch, config.batch_wait_s,
                                             max_batch_prompt_tokens=config.max_batch_prompt_tokens,
                                             queue_timeout_s=config.queue_timeout_s, drafts=honest_drafts,
                                             prefill_chunk=config.prefill_chunk_tokens)
        self.created = int(time.time())

    @property
    def workers(self) -> list[BatchWorker]:
        return [self.worker] + ([self.honest_worker] if self.honest_worker is not self.worker else [])

    def worker_for(self, claimed: SamplingParams) -> BatchWorker:
        return self.worker if self.mis.deviates(claimed) else self.honest_worker

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

    async def wait(self, job: Job, client: Request | None, worker: BatchWorker) -> Generation:
        """Submit ``job`` to ``worker`` and await it; abandon it when ``client`` disconnects or the queue times out."""
        try:
            future = worker.submit(job)
        except RuntimeError as exc:
            raise APIError(str(exc), status=503, type="server_error") from None
        waiter = asyncio.wrap_future(future)
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody waits
        timeout = self.config.queue_timeout_s
        try:
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=self.config.disconnect_poll_s)
                if waiter.done():
                    break
                if client is not None and await client.is_disconnected():
                    job.abandon()
                    raise APIError("the client disconnected", status=499, code="client_disconnected")
                if timeout and time.monotonic() - job.queued_at > timeout and future.cancel():
                    raise QueueTimeout(f"the request waited more than {timeout:g} s in the queue")
            return waiter.result()
        except asyncio.CancelledError:
            job.abandon()
            raise
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

    async def run(self, req, prompt: PromptIds, max_tokens: int, logprobs: int | None,
                  prompt_logprobs: int | None, client: Request | None = None, on_token=None) -> list[Outcome]:
        """The request's ``n`` completions, decoded together (choice j of a seeded request uses seed + j);
        ``on_token(j, index, token, logprobs)`` hears choice j's tokens as they are decoded."""
        spec = self.commit_spec(req, max_tokens)
        claims = [self.claimed_params(req) for _ in range(req.n)]
        if req.seed is not None:
            claims = [c.with_(seed=req.seed + j) for j, c in enumerate(claims)]
        jobs = []
        for j, claimed in enumerate(claims):
            actual = self.mis.actual_params(claimed)
            hear = None if on_token is None else (lambda i, t, lp, j=j: on_token(j, i, t, lp))
            jobs.append(Job(GenRequest(f"req-{uuid.uuid4().hex}", prompt.actual, actual), max_tokens, logprobs,
                            prompt_logprobs if j == 0 else None, capture=spec is not None, on_token=hear))
        workers = [self.worker_for(claimed) for claimed in claims]
        gens = await asyncio.gather(*(self.wait(job, client, worker) for job, worker in zip(jobs, workers)))
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

    def live(self, req, echo: bool = False) -> bool:
        """Whether ``stream: true`` sends tokens as they are decoded. Not with stop strings or echo (text
        already sent could not be cut or prefixed) nor speculative decoding (drafts are verified in
        blocks): those are streamed once finished."""
        if not req.stream or req.stop or echo:
            return False
        claimed = self.claimed_params(req)
        return not claimed.speculative and not self.mis.actual_params(claimed).speculative

    async def answer(self, req, build, head: dict[str, Any], prompt: PromptIds, max_tokens: int,
                     logprobs: int | None, prompt_logprobs: int | None, client: Request | None,
                     echo: bool = False) -> dict[str, Any] | StreamingResponse:
        """Decode ``req`` and answer with ``build(outcomes)``: the body, or its server-sent events."""
        if self.live(req, echo):
            return await self.stream_live(req, build, head, prompt, max_tokens, logprobs, client)
        outcomes = await self.run(req, prompt, max_tokens, logprobs, prompt_logprobs, client)
        body = build(outcomes)
        if not req.stream:
            return body
        usage = req.stream_options is not None and req.stream_options.include_usage
        pieces = [text_pieces(self.tokenizer, o.tokens, o.text) for o in outcomes]
        return StreamingResponse(sse(stream_chunks(body, pieces, usage)), media_type="text/event-stream")

    async def stream_live(self, req, build, head: dict[str, Any], prompt: PromptIds, max_tokens: int,
                          logprobs: int | None, client: Request | None) -> StreamingResponse:
        """Server-sent events sent as the worker decodes (``stream.LiveChoice``), closed by the finished
        response's last chunks. Failures before the first token answer with their own status; a
        failure after it ends the stream with an error event. A client that leaves abandons the jobs."""
        loop = asyncio.get_running_loop()
        heard: asyncio.Queue = asyncio.Queue()

        def on_token(j: int, i: int, token: int, lp) -> None:  # the worker's thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
                loop.call_soon_threadsafe(heard.put_nowait, (j, i, token, lp))

        task = asyncio.ensure_future(self.run(req, prompt, max_tokens, logprobs, None, client, on_token))
        nxt = asyncio.ensure_future(heard.get())
        await asyncio.wait({task, nxt}, return_when=asyncio.FIRST_COMPLETED)
        if not nxt.done() and task.exception() is not None:
            nxt.cancel()
            task.result()  # raises: the status of an ordinary failure, before any byte is sent
        chat = head["object"] == "chat.completion.chunk"
        text = TokenText(self.tokenizer, req.return_tokens_as_token_ids)
        usage = req.stream_options is not None and req.stream_options.include_usage

        async def chunks():
            nonlocal nxt
            choices = [LiveChoice(self.tokenizer) for _ in range(req.n)]
            try:
                if chat:
                    yield role_chunk(head, list(range(req.n)), list(prompt.reported) if req.return_token_ids else None)
                while True:
                    if not nxt.done() and heard.empty():
                        await asyncio.wait({task, nxt}, return_when=asyncio.FIRST_COMPLETED)
                    if nxt.done():
                        j, i, token, lp = nxt.result()
                        nxt = asyncio.ensure_future(heard.get())
                    elif not heard.empty():  # queued while the getter had not run yet
                        j, i, token, lp = heard.get_nowait()
                    else:  # finished, and everything it decoded was heard
                        break
                    live = choices[j]
                    if i < len(live.tokens):  # decoded again after an early stop: already sent
                        continue
                    first_ids = list(prompt.reported) if not chat and i == 0 and req.return_token_ids else None
                    yield token_chunk(head, j, live.piece(token), live.logprobs(text, lp, chat),
                                      [token] if req.return_token_ids else None, first_ids)
                try:
                    body = build(task.result())
                except APIError as exc:
                    yield exc.body()
                    return
                for choice, live in zip(body["choices"], choices):
                    rest = live.rest(choice["message"]["content"] if chat else choice["text"])
                    if rest:
                        yield token_chunk(head, choice["index"], rest, None, None, None)
                    yield {**head, "choices": [last_chunk(choice, chat, prompt_ids=not live.tokens)]}
                if usage:
                    yield {**head, "choices": [], "usage": body["usage"]}
            finally:
                nxt.cancel()
                if not task.done():
                    task.cancel()  # the client left: ``wait`` abandons the jobs

        return StreamingResponse(sse_live(chunks()), media_type="text/event-stream")

    async def completion(self, body: Any, client: Request | None = None):
        req: CompletionRequest = parse(CompletionRequest, body)
        self.check_model(req.model)
        if isinstance(req.prompt, str):
            client_ids = self.tokenizer.encode(req.prompt)
            if not client_ids:
                raise APIError("prompt: the prompt tokenizes to no tokens", "prompt")
        else:
            client_ids = list(req.prompt)
            self.check_ids(client_ids, "prompt")
        prompt = completion_prompt(self.tokenizer, client_ids, self.mis)
        self.check_length(prompt, req.max_tokens, "prompt")
        wants_prompt_lp = req.echo and req.logprobs is not None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.name}

        def build(outcomes: list[Outcome]) -> dict[str, Any]:
            choices = []
            for j, o in enumerate(outcomes):
                text = o.text
                if req.echo:
                    prompt_text = req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(client_ids)
                    text = prompt_text + text
                choice: dict[str, Any] = {"index": j, "text": text, "logprobs": None,
                                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if req.logprobs is not None:
                    entries: list = []
                    if req.echo:
                        reported = o.prompt.reported
                        plp = outcomes[0].generation.prompt_logprobs[len(o.prompt.actual) - len(reported):]
                        entries = [reported[0], *plp]
                    entries += o.generation.logprobs[: len(o.tokens)]
                    choice["logprobs"] = completion_logprobs(
                        TokenText(self.tokenizer, req.return_tokens_as_token_ids), entries)
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(o.prompt.reported)
                    choice["token_ids"] = o.tokens
                self.extensions(o, choice)
                choices.append(choice)
            return {**head, "choices": choices, "usage": self.usage(outcomes)}

        return await self.answer(req, build, chunk_head(head), prompt, req.max_tokens, req.logprobs,
                                 req.logprobs if wants_prompt_lp else None, client, echo=req.echo)

    async def chat(self, body: Any, client: Request | None = None):
        req: ChatRequest = parse(ChatRequest, body)
        self.check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt = chat_prompt(self.tokenizer, messages, self.mis)
        limit = req.token_limit
        if limit is None:  # OpenAI: as much as fits
            limit = max(0, min(self.config.max_tokens_limit, self.max_model_len - len(prompt.actual)))
        self.check_length(prompt, limit, "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name}

        def build(outcomes: list[Outcome]) -> dict[str, Any]:
            choices = []
            for j, o in enumerate(outcomes):
                choice: dict[str, Any] = {"index": j, "message": {"role": "assistant", "content": o.text},
                                          "logprobs": None, "finish_reason": o.finish_reason,
                                          "stop_reason": o.stop_reason}
                if top is not None:
                    choice["logprobs"] = chat_logprobs(TokenText(self.tokenizer, req.return_tokens_as_token_ids),
                                                       o.generation.logprobs[: len(o.tokens)])
                if req.return_token_ids:
                    choice["token_ids"] = o.tokens
                self.extensions(o, choice)
                choices.append(choice)
            out = {**head, "choices": choices, "usage": self.usage(outcomes)}
            if req.return_token_ids:
                out["prompt_token_ids"] = list(outcomes[0].prompt.reported)
            return out

        return await self.answer(req, build, chunk_head(head), prompt, limit, top, None, client)


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _json_body(request: Request, limit: int) -> Any:
    """The body as JSON (``protocol.decode_body``), read no further than ``limit`` bytes (413 above)."""
    too_large = APIError(f"request body is larger than this server's limit of {limit} bytes", status=413,
                         code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and (len(length) > 18 or int(length) > limit):
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError("the client disconnected", status=499, code="client_disconnected") from None
    return decode_body(b"".join(chunks))


def _request_body(model, served: ServedModel) -> tuple[dict, dict]:
    """OpenAPI ``requestBody`` of a route that reads its body itself, and the schemas it refers to.

    The model's bounds, tightened to this server's: token limits, token ids within the vocabulary.
    """
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    props = schema["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        for option in props.get(name, {}).get("anyOf", [props.get(name, {})]):
            if option.get("type") == "integer":
                option["maximum"] = served.config.max_tokens_limit
    for option in props.get("prompt", {}).get("anyOf", []):
        if option.get("type") == "array":
            option["items"]["maximum"] = served.reference.vocab_size - 1
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}, defs


def create_app(backend: Backend, config: ServeConfig = ServeConfig(), served: ServedModel | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the model's worker thread."""
    served = served or ServedModel(backend, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for w in served.workers:
            w.start()
        try:
            yield
        finally:
            for w in served.workers:
                await asyncio.to_thread(w.close)

    app = FastAPI(title="verinfer provider", lifespan=lifespan)
    app.state.served = served

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return _error(APIError(str(exc.detail), status=exc.status_code, code=code))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        print(f"verinfer serve: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _error(APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500, type="server_error"))

    @app.get("/health")
    async def health():
        ws = served.workers
        total = {k: sum(getattr(w, k) for w in ws) for k in ("requests", "batches", "decode_steps", "queued",
                                                              "abandoned", "expired", "failed", "spec_requests",
                                                              "spec_tokens", "spec_accepted")}
        return {"status": "ok", **total, "largest_batch": max(w.largest_batch for w in ws),
                "max_batch": served.worker.max_batch}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        served.check_model(model_id)
        return served.card()

    limit = served.config.max_request_bytes
    completion_body, completion_defs = _request_body(CompletionRequest, served)
    chat_body, chat_defs = _request_body(ChatRequest, served)

    @app.post("/v1/completions", openapi_extra=completion_body)
    async def completions(request: Request):
        return await served.completion(await _json_body(request, limit), request)

    @app.post("/v1/chat/completions", openapi_extra=chat_body)
    async def chat_completions(request: Request):
        return await served.chat(await _json_body(request, limit), request)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update({**completion_defs, **chat_defs})
        return app.openapi_schema

    app.openapi = openapi
    return app
