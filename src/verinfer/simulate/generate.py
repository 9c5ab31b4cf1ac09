"""The provider simulator: batched KV-cache decoding with any sampler profile, writing traces.

Sampling goes through ``verinfer.sampling.sampler.sample``, the same code the verifier replays.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from verinfer.models.backend import Backend
from verinfer.prompts import Prompt, render
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import PROFILES, Profile, RowKeys, get_profile
from verinfer.sampling.profiles.transformers import TransformersProfile
from verinfer.sampling.sampler import sample
from verinfer.trace import Trace
from verinfer.commits.trace_commits import CommitSpec, build_commits


# A per-step hook on the sampled tokens, for simulated sampler bugs (``verinfer.simulate.variants``):
# called as ``hook(logits, tokens, requests, step)`` with the logits [n, V] and sampled tokens [n] of the
# n active rows, their requests, and the output index ``step``; returns the tokens to emit instead.
TokenHook = Callable[[torch.Tensor, torch.Tensor, Sequence["Request"], int], torch.Tensor]


@dataclass(frozen=True)
class Request:
    id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    messages: tuple[dict[str, str], ...] | None = None


def sample_rows(logits, rows: list[int], batch: Sequence[Request], profiles: dict[str, Profile],
                step: int | Sequence[int]):
    """Sample every active row, grouping rows by profile (each profile owns its noise state).

    ``step``: the output index each row samples, one for all or one per row (a continuously
    batched server's rows joined at different steps)."""
    tokens = torch.empty(len(rows), dtype=torch.long)
    steps = np.broadcast_to(np.asarray(step, dtype=np.int64), (len(rows),))
    by_profile: dict[str, list[int]] = {}
    for j, r in enumerate(rows):
        by_profile.setdefault(batch[r].params.profile, []).append(j)
    for name, js in by_profile.items():
        reqs = [batch[rows[j]] for j in js]
        keys = RowKeys(
            requests=tuple(r.id for r in reqs),
            seeds=np.array([r.params.seed for r in reqs], dtype=object),
            positions=np.array([len(r.prompt_token_ids) - 1 for r in reqs], dtype=np.int64) + steps[js],
            steps=steps[js].copy(),
        )
        idx = torch.as_tensor([rows[j] for j in js])
        profile = profiles.setdefault(name, get_profile(name))
        tokens[js] = sample(logits[idx], [r.params for r in reqs], profile, keys)
    return tokens


@dataclass
class Decoded:
    tokens: list[int]
    finish_reason: str
    rows: torch.Tensor | None = None  # committed hidden rows [L + n - 1, D] (verify/commits.py)


def decode_batch(backend: Backend, batch: Sequence[Request], max_new_tokens: int, stop_ids: set[int],
                 profiles: dict[str, Profile], token_hook: TokenHook | None = None,
                 capture: bool = False, prefill_chunk: int | None = None,
                 between_chunks: Callable[[], None] | None = None,
                 gone: Callable[[str], bool] | None = None, shared: int = 1) -> list[Decoded]:
    """Decode one batch with a shared KV cache (left padding).

    ``shared``: consecutive groups of this many requests have the same prompt (many samples of one
    prompt, as an audit's reference draws are): each prompt is prefilled once and its KV cache copied
    to the group's rows, as vLLM's prefix caching does for ``n`` > 1.

    With ``capture``, keep each request's final normed hidden states as they are computed (prompt
    rows from the prefill, one row per fed-back output token), for activation commits: no extra pass.

    ``prefill_chunk``: prefill the (padded) prompts in column chunks of at most this many tokens,
    each extending the KV cache, as engines' chunked prefill does (vLLM's
    ``max_num_batched_tokens``); ``between_chunks`` runs after each chunk but the last and may raise
    to stop the batch there (``verinfer serve`` stops a long prefill whose clients all left). The
    logits differ from a one-pass prefill only by summation order (benign noise, about 1e-5 in fp32).

    ``gone(request_id)``: true once a request's client has left; such rows stop decoding at once
    and leave the KV cache (with the rows already finished), so the others no longer pay for them.
    Their ``Decoded`` holds the tokens made until then.
    """
    lengths = torch.tensor([len(r.prompt_token_ids) for r in batch])
    width = int(lengths.max())
    ids = torch.full((len(batch), width), backend.pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, r in enumerate(batch):
        ids[b, width - len(r.prompt_token_ids):] = torch.as_tensor(r.prompt_token_ids)
        mask[b, width - len(r.prompt_token_ids):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    if shared > 1 and (len(batch) % shared or any(batch[b].prompt_token_ids != batch[b - b % shared].prompt_token_ids
                                                   for b in range(len(batch)))):
        raise ValueError(f"shared={shared}: the batch must be groups of {shared} requests with one prompt each")
    first = slice(None, None, shared)  # one row per prompt for the prefill
    cache = DynamicCache()
    chunk = prefill_chunk if prefill_chunk and prefill_chunk > 0 else width
    parts = []
    for lo in range(0, width, chunk):
        if lo and between_chunks is not None:
            between_chunks()
        hi = min(lo + chunk, width)
        part, cache = backend.hidden(ids[first, lo:hi], mask[first, :hi], positions[first, lo:hi], cache)
        parts.append(part if capture else part[:, -1:])
    h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if shared > 1:
        cache.batch_repeat_interleave(shared)
        h = h.repeat_interleave(shared, dim=0)
    logits = backend.logits(h[:, -1])
    rows = [[h[b, width - len(r.prompt_token_ids):].float().cpu()] for b, r in enumerate(batch)] if capture else None
    outputs: list[list[int]] = [[] for _ in batch]
    finish = ["length"] * len(batch)
    live = list(range(len(batch)))  # batch index of each row of the KV cache
    active = list(range(len(batch)))  # cache rows still decoding
    for step in range(max_new_tokens):
        view = [batch[b] for b in live]
        tokens = sample_rows(logits, active, view, profiles, step)
        if token_hook is not None:
            tokens = token_hook(logits[active], tokens, [view[j] for j in active], step)
        step_tokens = torch.full((len(live),), backend.pad_id, dtype=torch.long)
        for j, t in zip(active, tokens.tolist()):
            outputs[live[j]].append(t)
            step_tokens[j] = t
            if t in stop_ids:
                finish[live[j]] = "stop"
        active = [j for j in active if finish[live[j]] == "length" and len(outputs[live[j]]) < max_new_tokens]
        if gone is not None and any(gone(view[j].id) for j in active):
            # Rows whose clients left leave the batch, with every finished row: the cache keeps the rest.
            keep = [j for j in active if not gone(view[j].id)]
            index = torch.as_tensor(keep, dtype=torch.long)
            cache.batch_select_indices(index.to(h.device))
            mask, lengths, step_tokens = mask[index], lengths[index], step_tokens[index]
            live, active = [live[j] for j in keep], list(range(len(keep)))
        if not active:
            break
        mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long)], dim=1)
        h, cache = backend.hidden(step_tokens[:, None], mask, (lengths + step)[:, None], cache)
        logits = backend.logits(h[:, -1])
        if rows is not None:
            last = h[:, -1].float().cpu()
            for j in active:
                rows[live[j]].append(last[j: j + 1])
    return [Decoded(out, fin, torch.cat(rows[b]) if rows is not None else None)
            for b, (out, fin) in enumerate(zip(outputs, finish))]


def generate(
    backend: Backend,
    requests: Sequence[Request],
    max_new_tokens: int = 64,
    batch_size: int = 8,
    provider: str = "verinfer-simulator",
    on_batch: Callable[[int], None] | None = None,
    token_hook: TokenHook | None = None,
    commits: CommitSpec | None = None,
) -> list[Trace]:
    """Generate a trace per request, in batches of similar prompt length.

    ``token_hook`` may replace sampled tokens at each step (see ``TokenHook``); honest generation has none.
    ``commits`` attaches activation commits (Activation-DiFR, TOPLOC) built from the hidden
    states the decoding computed anyway.
    """
    stop_ids = backend.stop_ids()
    profiles: dict[str, Profile] = {}
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_token_ids))
    results: dict[int, Decoded] = {}
    sent: dict[int, Request] = {}  # each request as sampled: with its place in the batch where a profile needs it
    for lo in range(0, len(order), batch_size):
        chunk = order[lo: lo + batch_size]
        batch = [replace(requests[i], params=placed(requests[i].params, len(chunk), row, backend.vocab_size))
                 for row, i in enumerate(chunk)]
        decoded = decode_batch(backend, batch, max_new_tokens, stop_ids, profiles, token_hook,
                               capture=commits is not None)
        for i, req, res in zip(chunk, batch, decoded):
            results[i], sent[i] = res, req
            for profile in profiles.values():
                profile.forget(req.id)
        if on_batch:
            on_batch(len(chunk))
    traces = []
    for i in range(len(requests)):
        req, out, reason = sent[i], results[i].tokens, results[i].finish_reason
        fingerprints = (build_commits(results[i].rows, len(req.prompt_token_ids), commits, backend.model_id)
                        if commits is not None else None)
        traces.append(Trace.of_output(
            req.id, backend.model_id, req.prompt_token_ids, out, req.params, tokenizer=backend.tokenizer,
            provider=provider, meta={"finish_reason": reason, "dtype": backend.dtype_name},
            messages=list(req.messages) if req.messages else None, fingerprints=fingerprints))
    return traces


def placed(params: SamplingParams, batch_size: int, row: int, vocab: int) -> SamplingParams:
    """``params`` of a request sampled at row ``row`` of a ``batch_size``-row batch of ``vocab``-wide logits.

    The ``transformers`` profile records that place (``sampling.stream``): after ``torch.manual_seed(seed)``
    one generator draws the whole ``[batch, vocab]`` block at each step and a row reads its own row of it
    (``sampling/profiles/transformers.py``), so a trace replays only with the batch it was sampled in. Each
    trace is what that call, seeded with the trace's seed, samples at its row (the other rows' prompts do
    not change its noise). Other profiles draw per request and keep no place: their params are unchanged.
    """
    if PROFILES.get(params.profile) is not TransformersProfile:
        return params
    return params.with_(stream={"batch_size": batch_size, "row": row, "vocab": vocab})


def build_requests(backend: Backend, prompts: Sequence[Prompt], params: SamplingParams,
                   seed_stride: int = 1, id_prefix: str = "") -> list[Request]:
    """One request per prompt, rendered with the model's chat template; request i gets seed
    ``params.seed + i * seed_stride`` (the meaning of ``--seed`` in every command)."""
    out = []
    for i, p in enumerate(prompts):
        seed = None if params.seed is None else params.seed + i * seed_stride
        out.append(Request(f"{id_prefix}{p.id}", tuple(render(backend.tokenizer, p)), params.with_(seed=seed),
                           tuple(p.message_dicts()) or None))
    return out
