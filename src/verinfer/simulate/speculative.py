"""A speculative-decoding provider: a draft model proposes k tokens, the target verifies them with
vLLM's V2 rejection sampler (``sampling/speculative.py``, the code the verifier replays).

One request at a time, with a KV cache per model that is cut back to the accepted tokens after each
step (``DynamicCache.crop``). Each trace records the claim in ``sampling.speculative`` and, per
output token, how it was produced in ``spec_modes`` (``a`` accepted draft, ``r`` resampled, ``b``
bonus). ``rule`` simulates dishonest providers for experiments:

- ``vllm``: the honest sampler.
- ``draft-only``: the cheap-model cheat: every proposal is returned unchecked and the bonus token
  comes from the draft too; the trace claims ``aaa..ab`` steps as an honest one would look.
- ``top1``: a wrong acceptance rule: a draft is accepted iff it is the target's top-1 token, and a
  rejected step emits the target's own Gumbel sample at that position.
Greedy requests (T = 0) decode exactly as plain greedy decoding (vLLM accepts a draft iff it is the
target's argmax), so they need no speculative replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache

from verinfer.models.backend import Backend
from verinfer.models.derived import draft_backend
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.speculative import (SpecBlock, draft_proposal, first_argmax, noised_row, processed_logits,
                                           rejection_sample)
from verinfer.simulate.generate import Request
from verinfer.trace import Trace

RULES = ("vllm", "draft-only", "top1")


class _Model:
    """One model's KV cache over a growing context: ``logits_after(tokens)`` feeds every token it
    has not cached and returns the logits of the last ``n`` fed positions."""

    def __init__(self, backend: Backend):
        self.backend, self.cache, self.cached = backend, DynamicCache(), 0

    def feed(self, context: Sequence[int], rows: int) -> torch.Tensor:
        new = list(context[self.cached:])
        ids = torch.tensor([new])
        pos = torch.arange(self.cached, len(context))[None]
        h, self.cache = self.backend.hidden(ids, None, pos, self.cache)
        self.cached = len(context)
        return self.backend.logits(h[0, -rows:])

    def crop(self, length: int) -> None:
        if self.cached > length:
            self.cache.crop(length - self.cached)  # transformers 5: a negative count of tokens to drop
            self.cached = length


def _step(target: _Model, draft: _Model, context: list[int], params: SamplingParams, k: int,
          rule: str) -> SpecBlock:
    pos0 = len(context) - 1
    proposals, draft_rows = [], []
    for j in range(k):
        row = draft.feed(context + proposals, 1)[0]
        draft_rows.append(row)
        proposals.append(draft_proposal(row.numpy(), params, pos0 + j))
    if rule == "draft-only":
        bonus = draft_proposal(draft.feed(context + proposals, 1)[0].numpy(), params, pos0 + k)
        return SpecBlock(proposals + [bonus], k, bonus=True)
    target_rows = processed_logits(target.feed(context + proposals, k + 1), params)
    if rule == "top1":
        for j, d in enumerate(proposals):
            if d != first_argmax(target_rows[j].numpy()):
                tok = first_argmax(noised_row(target_rows[j].numpy(), params.seed, pos0 + j, params.fp64_gumbel))
                return SpecBlock(proposals[:j] + [tok], j)
        tok = first_argmax(noised_row(target_rows[k].numpy(), params.seed, pos0 + k, params.fp64_gumbel))
        return SpecBlock(proposals + [tok], k, bonus=True)
    temperature = 0.0 if params.is_greedy else params.effective_temperature
    return rejection_sample(target_rows, torch.stack(draft_rows), proposals, seed=params.seed, pos0=pos0,
                            temperature=temperature, fp64=params.fp64_gumbel)


@dataclass
class SpecDecoded:
    tokens: list[int]
    modes: str
    finish_reason: str


def speculative_blocks(target: Backend, draft: Backend, request: Request, rule: str = "vllm",
                       prefill_chunk: int | None = None) -> Iterator[SpecBlock | None]:
    """Decode one request speculatively a step at a time, without end: ``None`` after each prompt
    chunk but the last (the prompt is cached in chunks of at most ``prefill_chunk`` tokens), then one
    ``SpecBlock`` per step. The caller stops at a stop token or its length (``decode_speculative``;
    ``verinfer serve`` interleaves the steps of several requests)."""
    if rule not in RULES:
        raise ValueError(f"unknown speculative rule {rule!r}; known: {', '.join(RULES)}")
    params = request.params
    k = int(params.speculative["k"])
    t_model, d_model = _Model(target), _Model(draft)
    context = list(request.prompt_token_ids)
    chunk = prefill_chunk if prefill_chunk and prefill_chunk > 0 else len(context)
    for end in range(chunk, len(context) - 1 + chunk, chunk):  # cache the prompt but its last token, fed each step
        if end > chunk:
            yield None
        t_model.feed(context[:min(end, len(context) - 1)], 1)
        d_model.feed(context[:min(end, len(context) - 1)], 1)
    while True:
        block = _step(t_model, d_model, context, params, k, rule)
        yield block
        kept = len(context) + block.num_accepted  # cached positions still valid: the accepted drafts
        context += block.tokens
        t_model.crop(kept)
        d_model.crop(kept)


def decode_speculative(target: Backend, draft: Backend, request: Request, max_new_tokens: int, stop_ids: set[int],
                       rule: str = "vllm", prefill_chunk: int | None = None,
                       between_chunks: Callable[[], None] | None = None) -> SpecDecoded:
    """Decode one request speculatively; the output is cut at a stop token or ``max_new_tokens``.

    ``prefill_chunk`` / ``between_chunks``: the prompt is cached in chunks of at most that many
    tokens, ``between_chunks`` running between them (it may raise to stop), as in ``decode_batch``."""
    out, modes = [], ""
    for block in speculative_blocks(target, draft, request, rule, prefill_chunk):
        if block is None:
            if between_chunks is not None:
                between_chunks()
            continue
        for tok, mode in zip(block.tokens, block.modes):
            out.append(tok)
            modes += mode
            if tok in stop_ids or len(out) >= max_new_tokens:
                return SpecDecoded(out, modes, "stop" if tok in stop_ids else "length")
    raise AssertionError("unreachable: speculative_blocks never ends")  # pragma: no cover


def generate_speculative(target: Backend, requests: Sequence[Request], max_new_tokens: int = 64,
                         draft: Backend | None = None, rule: str = "vllm", provider: str = "verinfer-simulator",
                         on_request: Callable[[int], None] | None = None) -> list[Trace]:
    """A trace per request, decoded speculatively with the draft each request's params name
    (``draft`` overrides it, e.g. to simulate a provider using another draft than it claims)."""
    stop_ids = target.stop_ids()
    drafts: dict[str, Backend] = {}
    traces = []
    for req in requests:
        spec = req.params.speculative
        if not spec:
            raise ValueError(f"request {req.id}: sampling.speculative is not set")
        d = draft or drafts.setdefault(spec["draft"], draft_backend(target, spec["draft"]))
        res = decode_speculative(target, d, req, max_new_tokens, stop_ids, rule)
        traces.append(Trace.of_output(
            req.id, target.model_id, req.prompt_token_ids, res.tokens, req.params, tokenizer=target.tokenizer,
            provider=provider, meta={"finish_reason": res.finish_reason, "dtype": target.dtype_name},
            messages=list(req.messages) if req.messages else None, spec_modes=res.modes))
        if on_request:
            on_request(1)
    return traces
