"""The two generation endpoints, ``/v1/completions`` and ``/v1/chat/completions``: a request body
checked, decoded by the ``ServedModel`` and answered as a body or server-sent events.

Seeds and replay. Every response is generated with the server's sampler profile (``--profile``)
through ``verinfer.simulate.generate.sample_rows``, the code the verifier replays, and each choice carries
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
with ``verinfer verify`` against an honest server, batch noise aside: rows decoded in one batch
are left-padded together, which can move fp32 logits by ~1e-6 (the honest band calibrates this);
a row's prompt is always prefilled alone (``verinfer.serve.batch``).

Returned token ids follow vLLM's ``return_token_ids``: completions put ``prompt_token_ids`` and
``token_ids`` in each choice; chat puts ``prompt_token_ids`` at the top level and ``token_ids`` in
each choice. ``token_ids`` are the output tokens only (a stop token, if emitted, included; with a
``stop`` string, up to the token that completed it).

Misconfigured servers (``ServeConfig.misconfig``, see ``verinfer.serve.config``) claim the honest
configuration in every field: model id, ``verinfer_sampling``, ``/v1/models``.

Speculative decoding (``ServeConfig.speculative``, ``--speculative DRAFT:K``). Every request claims
``verinfer_sampling.speculative = {"draft", "k"}``; sampled ones are decoded speculatively, each
row one speculative step per scheduling step beside the batch (``verinfer.serve.speculative``),
greedy ones in the batch (identical tokens: vLLM
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
than 32 levels; 413 for a body over ``max_request_bytes``. A request none of whose rows
was admitted after ``queue_timeout_s`` gets 503 (``code: "queue_timeout"``); one that fails inside
the model gets 500 (``type: "server_error"``) alone, the rows batched with it are decoded again
without it. A handler whose client disconnects abandons its rows (``verinfer.serve.scheduler``);
a live stream whose client stops reading is dropped (``verinfer.serve.live``). A request with an
``Idempotency-Key`` header is decoded once per key and kept for its retries (``verinfer.serve.results``);
it is streamed once finished. The OpenAPI
schema (``/openapi.json``) describes both request bodies, bounds included.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from verinfer.serve.live import stream_live
from verinfer.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from verinfer.serve.prompting import PromptIds, chat_prompt, completion_prompt
from verinfer.serve.protocol import APIError, ChatRequest, CompletionRequest, parse
from verinfer.serve.served import Outcome, ServedModel
from verinfer.serve.stream import chunk_head, sse, stream_chunks, text_pieces


class Handlers:
    """The generation endpoints of one ``ServedModel``."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.tokenizer = served.tokenizer

    def live(self, req, echo: bool = False) -> bool:
        """Whether ``stream: true`` sends tokens as they are decoded. Not with stop strings or echo (text
        already sent could not be cut or prefixed) nor speculative decoding (drafts are verified in
        blocks): those are streamed once finished."""
        if not req.stream or req.stop or echo:
            return False
        claimed = self.served.claimed_params(req)
        return not claimed.speculative and not self.served.mis.actual_params(claimed).speculative

    async def answer(self, req, build, head: dict[str, Any], prompt: PromptIds, max_tokens: int,
                     logprobs: int | None, prompt_logprobs: int | None, client: Request | None,
                     key: str | None, echo: bool = False) -> dict[str, Any] | StreamingResponse:
        """Decode ``req`` and answer with ``build(outcomes)``: the body, or its server-sent events.
        With an idempotency ``key`` the decoding is shared with the key's other requests (``serve.results``)."""
        served = self.served
        if key is None and self.live(req, echo):
            return await stream_live(served, req, build, head, prompt, max_tokens, logprobs, client)
        if key is None:
            outcomes = await served.run(req, prompt, max_tokens, logprobs, prompt_logprobs, client)
        else:
            fingerprint = f"{head['object']} {req.model_dump_json()}"
            task = served.results.task(key, fingerprint, lambda: served.run(req, prompt, max_tokens, logprobs,
                                                                            prompt_logprobs))
            gone = (lambda: client.is_disconnected()) if client is not None else _stays
            outcomes = await served.results.wait(task, gone, served.config.disconnect_poll_s)
        body = build(outcomes)
        if not req.stream:
            return body
        usage = req.stream_options is not None and req.stream_options.include_usage
        pieces = [text_pieces(self.tokenizer, o.tokens, o.text) for o in outcomes]
        return StreamingResponse(sse(stream_chunks(body, pieces, usage)), media_type="text/event-stream")

    async def completion(self, body: Any, client: Request | None = None, key: str | None = None):
        req: CompletionRequest = parse(CompletionRequest, body)
        self.served.check_model(req.model)
        if isinstance(req.prompt, str):
            client_ids = self.tokenizer.encode(req.prompt)
            if not client_ids:
                raise APIError("prompt: the prompt tokenizes to no tokens", "prompt")
        else:
            client_ids = list(req.prompt)
            self.served.check_ids(client_ids, "prompt")
        prompt = completion_prompt(self.tokenizer, client_ids, self.served.mis)
        self.served.check_length(prompt, req.max_tokens, "prompt")
        wants_prompt_lp = req.echo and req.logprobs is not None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.served.name}

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
                self.served.extensions(o, choice)
                choices.append(choice)
            return {**head, "choices": choices, "usage": self.served.usage(outcomes)}

        return await self.answer(req, build, chunk_head(head), prompt, req.max_tokens, req.logprobs,
                                 req.logprobs if wants_prompt_lp else None, client, key, echo=req.echo)

    async def chat(self, body: Any, client: Request | None = None, key: str | None = None):
        req: ChatRequest = parse(ChatRequest, body)
        self.served.check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt = chat_prompt(self.tokenizer, messages, self.served.mis)
        limit = req.token_limit
        if limit is None:  # OpenAI: as much as fits
            limit = max(0, min(self.served.config.max_tokens_limit, self.served.max_model_len - len(prompt.actual)))
        self.served.check_length(prompt, limit, "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.served.name}

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
                self.served.extensions(o, choice)
                choices.append(choice)
            out = {**head, "choices": choices, "usage": self.served.usage(outcomes)}
            if req.return_token_ids:
                out["prompt_token_ids"] = list(outcomes[0].prompt.reported)
            return out

        return await self.answer(req, build, chunk_head(head), prompt, limit, top, None, client, key)


async def _stays() -> bool:
    return False
