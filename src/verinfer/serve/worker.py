"""One thread that owns the model and decodes queued requests in batches.

torch modules and KV caches are not safe to drive from several threads, so HTTP handlers never
touch the model: they submit a ``Job`` and await its future. The worker takes the first queued job,
waits ``batch_wait_s`` for companions (up to ``max_batch``), and decodes them together with
``verinfer.generate.decode_batch`` (the sampler code the verifier replays). Jobs in one batch may
ask for different ``max_tokens``: the batch runs to the largest and each job keeps its own first
``max_tokens`` tokens (decoding is causal, so a row's tokens do not depend on how long it runs).

Logprobs are the provider's own: a token hook records the log-softmax of the raw logits (before
temperature and filters, as vLLM returns them by default) at each step; prompt logprobs come from
the prompt's hidden states captured by the same prefill (no extra forward pass).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from verinfer.generate import Request, TokenHook, decode_batch
from verinfer.models.backend import Backend
from verinfer.models.variants import Variant
from verinfer.sampling.profiles import Profile


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one position: the token there, its logprob, and the top alternatives."""

    token: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class Job:
    request: Request  # actual prompt ids and actual (possibly misconfigured) sampling parameters
    max_tokens: int
    logprobs: int | None = None  # top-N logprobs per output token (None: none)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (None: none)
    capture: bool = False  # keep hidden rows for activation commits
    future: Future = field(default_factory=Future)


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token was emitted) or "length"
    rows: torch.Tensor | None  # committed hidden rows [L + n - 1, D] (verify/commits.py)
    logprobs: list[TokenLogprobs] | None  # per output token
    prompt_logprobs: list[TokenLogprobs] | None  # per actual prompt position 1 .. L-1


def _top(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """TokenLogprobs rows from a [R, V] log-softmax and the chosen token of each row."""
    picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    if k > 0:
        vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    else:
        vals = ids = [[] for _ in picked]
    return [TokenLogprobs(int(t), float(p), tuple(i), tuple(v))
            for t, p, i, v in zip(chosen.tolist(), picked, ids, vals)]


class LogprobRecorder:
    """A token hook that records output-token logprobs (after an optional inner hook, e.g. a sampler bug)."""

    def __init__(self, wants: dict[str, int], inner: TokenHook | None = None):
        self.wants, self.inner = wants, inner
        self.records: dict[str, list[TokenLogprobs]] = {rid: [] for rid in wants}

    def __call__(self, logits, tokens, requests, step):
        if self.inner is not None:
            tokens = self.inner(logits, tokens, requests, step)
        rows = [j for j, r in enumerate(requests) if r.id in self.wants]
        if rows:
            lp = torch.log_softmax(logits[rows].float(), dim=-1)
            k = max(self.wants[requests[j].id] for j in rows)
            for j, rec in zip(rows, _top(lp, tokens[rows], k)):
                rid = requests[j].id
                n = self.wants[rid]
                self.records[rid].append(TokenLogprobs(rec.token, rec.logprob, rec.top_ids[:n], rec.top_logprobs[:n]))
        return tokens


def prompt_logprobs(backend: Backend, rows: torch.Tensor, prompt: tuple[int, ...], k: int,
                    block: int = 512) -> list[TokenLogprobs]:
    """Logprobs of prompt tokens 1 .. L-1 from the prompt's hidden rows (lm_head in row blocks)."""
    out: list[TokenLogprobs] = []
    targets = torch.as_tensor(prompt[1:], dtype=torch.long)
    for lo in range(0, len(prompt) - 1, block):
        hi = min(lo + block, len(prompt) - 1)
        lp = torch.log_softmax(backend.logits(rows[lo:hi]), dim=-1)
        out += _top(lp, targets[lo:hi], k)
    return out


class BatchWorker:
    """The model-owning thread. ``submit`` is safe from any thread; results arrive on job futures."""

    def __init__(self, backend: Backend, variant: Variant | None = None, max_batch: int = 8,
                 batch_wait_s: float = 0.005):
        self.backend = backend  # the backend that generates (the variant's, when misconfigured)
        self.variant = variant
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.stop_ids = backend.stop_ids()
        self.batches = 0  # decoded batches (reported by /health)
        self.requests = 0
        self.largest_batch = 0
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._profiles: dict[str, Profile] = {}
        self._thread = threading.Thread(target=self._run, name="verinfer-serve-worker", daemon=True)
        self._closed = False

    def start(self) -> "BatchWorker":
        self._thread.start()
        return self

    def submit(self, job: Job) -> Future:
        if self._closed:
            raise RuntimeError("the server is shutting down")
        self._queue.put(job)
        return job.future

    def close(self, timeout: float | None = 60) -> None:
        """Finish queued work, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _collect(self, first: Job) -> tuple[list[Job], bool]:
        jobs, stopping = [first], False
        deadline = time.monotonic() + self.batch_wait_s
        while len(jobs) < self.max_batch:
            try:
                nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if nxt is None:
                stopping = True
                break
            jobs.append(nxt)
        return jobs, stopping

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs, stopping = self._collect(first)
            jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
            if jobs:
                try:
                    results = self._decode(jobs)
                except Exception as exc:  # a bug or resource failure: every waiting request learns of it
                    for job in jobs:
                        job.future.set_exception(exc)
                else:
                    for job, res in zip(jobs, results):
                        job.future.set_result(res)
            if stopping:
                return

    def _decode(self, jobs: list[Job]) -> list[Generation]:
        batch = [j.request for j in jobs]
        inner = self.variant.hook() if self.variant is not None and self.variant.hook else None
        wants = {j.request.id: j.logprobs for j in jobs if j.logprobs is not None}
        hook = LogprobRecorder(wants, inner) if wants else inner
        capture = any(j.capture or j.prompt_logprobs is not None for j in jobs)
        steps = max(j.max_tokens for j in jobs)
        decoded = decode_batch(self.backend, batch, steps, self.stop_ids, self._profiles, hook, capture=capture)
        for r in batch:
            for profile in self._profiles.values():
                profile.forget(r.id)
        self.batches += 1
        self.requests += len(jobs)
        self.largest_batch = max(self.largest_batch, len(jobs))
        out = []
        for job, dec in zip(jobs, decoded):
            n = min(len(dec.tokens), job.max_tokens)
            tokens = dec.tokens[:n]
            finish = "stop" if tokens and tokens[-1] in self.stop_ids else "length"
            length = len(job.request.prompt_token_ids)
            rows = dec.rows[: length + n - 1] if dec.rows is not None and job.capture else None
            plp = (prompt_logprobs(self.backend, dec.rows[:length - 1], job.request.prompt_token_ids,
                                   job.prompt_logprobs) if job.prompt_logprobs is not None else None)
            lps = hook.records[job.request.id][:n] if job.logprobs is not None else None
            out.append(Generation(tokens, finish, rows, lps, plp))
        return out
