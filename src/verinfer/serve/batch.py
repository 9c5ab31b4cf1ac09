"""The running batch: the KV state of the rows the scheduler decodes together, rows joining and
leaving at step boundaries (continuous batching, as vLLM's scheduler runs its batch).

A row's prompt is prefilled alone (``Prefill``), in chunks at fixed offsets (multiples of the
chunk size from its first token), so its KV cache and first logits do not depend on what else the
server is doing; the rows of one request share that prefill. It then joins the batch's cache,
which is left-padded to the longest row (``RunningBatch.join``); every step samples each row at its
own output index (``simulate.generate.sample_rows``, the code the verifier replays), feeds the
sampled tokens back in one forward pass, and drops the rows that are finished or abandoned from the
cache (and the padding columns no row needs any more). Positions are explicit per row and padding
is masked, so a row's tokens are the ones it gets decoded alone, batch noise aside (fp32 sums in
another order: a near-tie can in principle differ; the honest band calibrates this).

Logprobs are the provider's own (``serve.logprobs``); a misconfigured variant's token hook (a
sampler bug) runs on the sampled tokens before they are emitted, as in ``decode_batch``.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from verinfer.models.backend import Backend
from verinfer.sampling.profiles import Profile
from verinfer.serve.jobs import Generation, Job, TokenLogprobs
from verinfer.serve.logprobs import prompt_logprobs, top_logprobs
from verinfer.simulate.generate import TokenHook, sample_rows


@dataclass
class Prefilled:
    """A prompt's KV cache (a transformers cache whose layers hold [1, H, L, D] tensors, of the class the
    backend installs: ``DynamicLayer``, or ``verinfer.models.fp8_kv.Fp8KVLayer`` for the fp8 KV variant),
    the logits after its last token, and its hidden rows [L, D] when captured."""

    cache: DynamicCache
    logits: torch.Tensor  # [V]
    rows: torch.Tensor | None

    @property
    def length(self) -> int:
        return int(self.cache.layers[0].keys.shape[2])


def batch_tensors(layer) -> dict[str, int | None]:
    """A cache layer's per-row tensors: attribute -> its sequence dimension (None: no sequence
    dimension, one entry per row such as a per-row fp8 scale). Layers that keep more than keys and
    values say so in ``BATCH_TENSORS``; rows are always dimension 0."""
    return getattr(layer, "BATCH_TENSORS", {"keys": 2, "values": 2})


def _own_cache(cache: DynamicCache) -> DynamicCache:
    """A cache of its own over the same tensors (a request's rows share one prefill; tensors are only
    ever replaced, never written in place, so sharing them is safe)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


class Prefill:
    """One prompt prefilled alone, ``chunk`` tokens per ``advance`` (0 or None: the whole prompt)."""

    def __init__(self, backend: Backend, prompt: Sequence[int], chunk: int | None, capture: bool):
        self.backend, self.prompt, self.capture = backend, tuple(prompt), capture
        self.chunk = chunk if chunk and chunk > 0 else len(self.prompt)
        self.done = 0  # prompt tokens in the cache
        self.cache = DynamicCache()
        self.parts: list[torch.Tensor] = []

    @property
    def next_size(self) -> int:
        return min(self.chunk, len(self.prompt) - self.done)

    def advance(self) -> Prefilled | None:
        """Prefill the next chunk; the finished ``Prefilled`` after the last one, else None."""
        lo, hi = self.done, self.done + self.next_size
        ids = torch.tensor([self.prompt[lo:hi]])
        h, self.cache = self.backend.hidden(ids, torch.ones((1, hi), dtype=torch.long), torch.arange(lo, hi)[None],
                                            self.cache)
        self.done = hi
        self.parts.append(h[0].float().cpu() if self.capture else h[0, -1:])
        if hi < len(self.prompt):
            return None
        rows = torch.cat(self.parts) if self.capture else None
        return Prefilled(self.cache, self.backend.logits(h[:, -1])[0], rows)


@dataclass(eq=False)
class Row:
    """One job in the batch: its tokens so far and what it records."""

    job: Job
    length: int  # positions in its KV cache (prompt + output tokens fed back)
    tokens: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] | None = None  # prompt rows, then one per fed-back token (commits, prompt logprobs)
    logprobs: list[TokenLogprobs] | None = None

    @property
    def request_id(self) -> str:
        return self.job.request.id


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` padded with zeros on the left of dimension ``dim`` to ``width``."""
    short = width - t.shape[dim]
    if short == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [short, 0]
    return F.pad(t, pad)


class RunningBatch:
    """The rows decoding together and their shared, left-padded KV cache ([B, H, W, D] per layer)."""

    def __init__(self, backend: Backend, stop_ids: set[int], profiles: dict[str, Profile],
                 hook: TokenHook | None = None):
        self.backend, self.stop_ids, self.profiles, self.hook = backend, stop_ids, profiles, hook
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)  # [B, W]: 1 where a row has a cached position
        self.logits = torch.zeros((0, 0))  # [B, V]: what each row samples next

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def join(self, job: Job, p: Prefilled) -> Row:
        """Add ``job``'s row, its prompt prefilled as ``p``, to the batch (it samples at the next step)."""
        length = p.length
        row = Row(job, length, hidden=[p.rows[:length]] if job.needs_rows else None,
                  logprobs=[] if job.logprobs is not None else None)
        ones = torch.ones((1, length), dtype=torch.long)
        if not self.rows:
            self.cache = _own_cache(p.cache)
            self.mask, self.logits = ones, p.logits[None]
        else:
            width = max(self.width, length)
            for layer, new in zip(self.cache.layers, p.cache.layers):
                for name, dim in batch_tensors(layer).items():
                    a, b = getattr(layer, name), getattr(new, name)
                    if dim is not None:
                        a, b = _left_pad(a, width, dim), _left_pad(b, width, dim)
                    setattr(layer, name, torch.cat([a, b]))
            self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(ones, width, 1)])
            self.logits = torch.cat([self.logits, p.logits[None]])
        self.rows.append(row)
        return row

    def done(self, row: Row) -> bool:
        toks = row.tokens
        return len(toks) >= row.job.max_tokens or bool(toks and toks[-1] in self.stop_ids)

    def sample(self) -> torch.Tensor:
        """Each row's next token (sampler, then the variant's hook), its logprobs recorded."""
        requests = [r.job.request for r in self.rows]
        steps = [len(r.tokens) for r in self.rows]
        tokens = sample_rows(self.logits, list(range(len(self.rows))), requests, self.profiles, steps)
        if self.hook is not None:  # the hook's interface takes one output index: rows grouped by theirs
            for step in sorted(set(steps)):
                idx = [j for j, s in enumerate(steps) if s == step]
                tokens[idx] = self.hook(self.logits[idx], tokens[idx], [requests[j] for j in idx], step)
        wants = [j for j, r in enumerate(self.rows) if r.logprobs is not None]
        if wants:
            lp = torch.log_softmax(self.logits[wants].float(), dim=-1)
            k = max(self.rows[j].job.logprobs for j in wants)
            for j, rec in zip(wants, top_logprobs(lp, tokens[wants], k)):
                n = self.rows[j].job.logprobs
                self.rows[j].logprobs.append(TokenLogprobs(rec.token, rec.logprob, rec.top_ids[:n],
                                                           rec.top_logprobs[:n]))
        return tokens

    def step(self) -> tuple[list[Row], list[Row]]:
        """One decoding step of every row: (rows finished, rows whose client left), both out of the batch."""
        tokens = self.sample().tolist()
        finished, gone, keep = [], [], []
        for j, (row, t) in enumerate(zip(self.rows, tokens)):
            if row.job.gone.is_set():
                gone.append(row)
                continue
            row.tokens.append(t)
            if row.job.on_token is not None:
                row.job.on_token(len(row.tokens) - 1, t, row.logprobs[-1] if row.logprobs is not None else None)
            (finished if self.done(row) else keep).append(j)
        finished = [self.rows[j] for j in finished]
        if len(keep) < len(self.rows):
            self._keep(keep)
        if self.rows:
            self._feed([tokens[j] for j in keep])
        return finished, gone

    def _keep(self, index: list[int]) -> None:
        """Only rows ``index`` stay; padding columns no row needs any more are cut."""
        self.rows = [self.rows[j] for j in index]
        if not self.rows:
            self.cache, self.mask, self.logits = None, torch.zeros((0, 0), dtype=torch.long), torch.zeros((0, 0))
            return
        sel = torch.as_tensor(index, dtype=torch.long)
        self.mask, self.logits = self.mask[sel], self.logits[sel]
        lead = int(self.mask.any(0).long().argmax())  # first column some row uses
        for layer in self.cache.layers:
            for name, dim in batch_tensors(layer).items():
                t = getattr(layer, name)
                t = t[sel.to(t.device)]
                setattr(layer, name, t.narrow(dim, lead, t.shape[dim] - lead) if dim is not None and lead else t)
        if lead:
            self.mask = self.mask[:, lead:]

    def _feed(self, tokens: list[int]) -> None:
        """Feed each row's newest token: one forward pass, new logits."""
        self.mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=torch.long)], dim=1)
        positions = torch.tensor([[r.length] for r in self.rows])
        h, self.cache = self.backend.hidden(torch.tensor(tokens)[:, None], self.mask, positions, self.cache)
        self.logits = self.backend.logits(h[:, -1])
        last = h[:, -1].float().cpu() if any(r.hidden is not None for r in self.rows) else None
        for j, r in enumerate(self.rows):
            r.length += 1
            if r.hidden is not None:
                r.hidden.append(last[j: j + 1])

    def generation(self, row: Row) -> Generation:
        """A finished row's result: tokens, finish reason, committed rows and logprobs."""
        job, tokens = row.job, row.tokens
        finish = "stop" if tokens and tokens[-1] in self.stop_ids else "length"
        rows = torch.cat(row.hidden) if row.hidden is not None else None
        plp = (prompt_logprobs(self.backend, rows[:job.prompt_len - 1], job.request.prompt_token_ids,
                               job.prompt_logprobs) if job.prompt_logprobs is not None else None)
        keep = rows[: job.prompt_len + len(tokens) - 1] if rows is not None and job.capture else None
        return Generation(tokens, finish, keep, row.logprobs, plp)
