"""One thread that owns the model and decodes queued requests in batches.

torch modules and KV caches are not safe to drive from several threads, so HTTP handlers never
touch the model: they submit a ``Job`` and await its future. The worker takes the first queued job,
waits ``batch_wait_s`` for companions (up to ``max_batch``), and decodes them together with
``verinfer.simulate.generate.decode_batch`` (the sampler code the verifier replays). Jobs in one batch may
ask for different ``max_tokens``: the batch runs to the largest and each job keeps its own first
``max_tokens`` tokens (decoding is causal, so a row's tokens do not depend on how long it runs).

Logprobs are the provider's own: a token hook records the log-softmax of the raw logits (before
temperature and filters, as vLLM returns them by default) at each step; prompt logprobs come from
the prompt's hidden states captured by the same prefill (no extra forward pass).

One request never costs another its answer or much of its time:

- Isolation. A job whose parameters the sampler cannot take fails alone, before batching; if
  decoding a batch raises anyway, each of its jobs is decoded again on its own, so only the one
  that fails gets the error and the others get the tokens they get alone.
- Cancellation. ``Job.abandon`` (the handler's client disconnected) drops a queued job; in a
  decoding batch its row leaves the batch (and the KV cache) at the next decode step, so the rows
  that stay stop paying for it, and a batch whose rows are all abandoned or finished ends there.
  A long prefill is checked after every chunk of ``prefill_chunk`` prompt tokens (prompts are
  prefilled in chunks, as engines' chunked prefill does): a client that leaves during an
  8,000-token prefill costs the next one at most a chunk's time.
- Queue timeout. A job still queued after ``queue_timeout_s`` fails with ``QueueTimeout``.
- Prefill budget. A batch takes companions only while rows times its longest prompt stays within
  ``max_batch_prompt_tokens`` (left padding makes every row as long as the longest); a job over
  the budget on its own runs alone.

Speculative decoding (``verinfer serve --speculative``). A job whose actual parameters claim
``speculative`` and sample (T > 0) is decoded on its own by
``verinfer.simulate.speculative.decode_speculative``, the sampler the verifier replays, with the
draft model it names (``drafts``) proposing ``k`` tokens per step. Such jobs do not batch with the
left-padded decoder: each step accepts a different number of drafts per request, so the rows of a
batch would drift apart, and the KV caches are cut back per request after each step. The other
jobs of the same batch (greedy ones: speculative decoding leaves them unchanged, since vLLM accepts
a draft iff it is the target's argmax) still decode together through ``decode_batch``. Logprobs,
prompt logprobs and the hidden rows of activation commits of a speculative job come from one extra
prefill of prompt + output on the generating model, made only when the job asks for them;
``Generation.spec_modes`` says how each token was produced (``a`` accepted draft, ``r``
resampled, ``b`` bonus). An abandoned speculative job stops at its next emitted token.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from verinfer.simulate.generate import Request, TokenHook, decode_batch
from verinfer.simulate.speculative import decode_speculative
from verinfer.models.backend import Backend
from verinfer.simulate.variants import Variant
from verinfer.sampling.profiles import Profile


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one position: the token there, its logprob, and the top alternatives."""

    token: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


INT64 = 2**63


class Abandoned(Exception):
    """The job's client went away before its result was ready; nobody reads this."""


class QueueTimeout(Exception):
    """The job waited in the queue longer than the server's limit and was not run."""


@dataclass
class Job:
    request: Request  # actual prompt ids and actual (possibly misconfigured) sampling parameters
    max_tokens: int
    logprobs: int | None = None  # top-N logprobs per output token (None: none)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (None: none)
    capture: bool = False  # keep hidden rows for activation commits
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.monotonic)
    gone: threading.Event = field(default_factory=threading.Event)  # set by ``abandon``
    # Live streaming: called from the worker thread with (index, token, logprobs or None) for each
    # output token as it is decoded; a job decoded again after an early stop repeats its indices.
    on_token: Callable[[int, int, TokenLogprobs | None], None] | None = None

    @property
    def needs_rows(self) -> bool:
        return self.capture or self.prompt_logprobs is not None

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    def abandon(self) -> bool:
        """The client is gone: a queued job is dropped, a decoding one stops at a decode step.

        True when the job was dropped before it started.
        """
        self.gone.set()
        return self.future.cancel()


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token was emitted) or "length"
    rows: torch.Tensor | None  # committed hidden rows [L + n - 1, D] (verify/commits.py)
    logprobs: list[TokenLogprobs] | None  # per output token
    prompt_logprobs: list[TokenLogprobs] | None  # per actual prompt position 1 .. L-1
    spec_modes: str | None = None  # speculative jobs: a / r / b per output token (see the module docstring)


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


class _StopBatch(Exception):
    """Raised by ``StepHook``: every row the batch still decodes belongs to a client that is gone."""


class StepHook:
    """The token hook of one batch: the variant's hook (a sampler bug), logprobs, each row's tokens.

    Counts decode steps (``steps``, and ``on_step`` as they happen) and ends the batch early (``_StopBatch``) once every row still
    decoding is done for its own job or abandoned, and at least one is abandoned and not done (so
    a batch nobody abandoned always runs to its natural end and returns its hidden rows).
    """

    def __init__(self, jobs: list[Job], inner: TokenHook | None, stop_ids: set[int],
                 on_step: Callable[[], None] | None = None):
        self.jobs = {j.request.id: j for j in jobs}
        self.on_step = on_step
        self.inner, self.stop_ids = inner, stop_ids
        wants = {j.request.id: j.logprobs for j in jobs if j.logprobs is not None}
        self.recorder = LogprobRecorder(wants) if wants else None
        self.tokens: dict[str, list[int]] = {rid: [] for rid in self.jobs}
        self.steps = 0

    def done(self, rid: str) -> bool:
        toks = self.tokens[rid]
        return len(toks) >= self.jobs[rid].max_tokens or bool(toks and toks[-1] in self.stop_ids)

    def gone(self, rid: str) -> bool:
        """Whether the client of request ``rid`` has left (its row then leaves the batch)."""
        return self.jobs[rid].gone.is_set()

    def between_chunks(self) -> None:
        """Between prefill chunks: stop (``_StopBatch``) when every job's client is gone."""
        if all(j.gone.is_set() for j in self.jobs.values()):
            raise _StopBatch

    def __call__(self, logits, tokens, requests, step):
        if self.inner is not None:
            tokens = self.inner(logits, tokens, requests, step)
        if self.recorder is not None:
            tokens = self.recorder(logits, tokens, requests, step)
        self.steps += 1
        if self.on_step is not None:
            self.on_step()
        for r, t in zip(requests, tokens.tolist()):
            job = self.jobs[r.id]
            # Rows decode on after their own job is done; those tokens are dropped, never streamed.
            hear = job.on_token is not None and not job.gone.is_set() and not self.done(r.id)
            self.tokens[r.id].append(t)
            if hear:
                lp = self.recorder.records[r.id][-1] if job.logprobs is not None else None
                job.on_token(len(self.tokens[r.id]) - 1, t, lp)
        gone = [self.jobs[r.id].gone.is_set() for r in requests]
        done = [self.done(r.id) for r in requests]
        if any(g and not d for g, d in zip(gone, done)) and all(g or d for g, d in zip(gone, done)):
            raise _StopBatch
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


class _WatchedStops(frozenset):
    """The stop ids given to ``decode_speculative``, which tests each emitted token against them:
    that test also ends the decoding (``_StopBatch``) once the job's client is gone."""

    def __new__(cls, ids, gone: threading.Event):
        self = super().__new__(cls, ids)
        self.gone = gone
        return self

    def __contains__(self, token) -> bool:
        if self.gone.is_set():
            raise _StopBatch
        return super().__contains__(token)


def _stop_if(gone: threading.Event) -> None:
    """Between prefill chunks of a speculative job: stop once its client is gone."""
    if gone.is_set():
        raise _StopBatch


def is_speculative_job(job: Job) -> bool:
    """A job the speculative decoder serves: it claims speculative decoding and samples."""
    params = job.request.params
    return bool(params.speculative) and not params.is_greedy


class BatchWorker:
    """The model-owning thread. ``submit`` is safe from any thread; results arrive on job futures.

    ``max_batch_prompt_tokens``: prefill budget of a batch (rows x longest prompt; None: no budget).
    ``queue_timeout_s``: a job queued longer fails with ``QueueTimeout`` (0: no limit).
    ``drafts``: the draft model a speculative job's ``speculative.draft`` names, by name (None: a
    speculative job fails alone); ``spec_rule``: ``decode_speculative``'s rule (``vllm``: honest).
    ``prefill_chunk``: prompt tokens prefilled per chunk (None or 0: one pass); between chunks a
    batch whose clients all left stops.
    """

    def __init__(self, backend: Backend, variant: Variant | None = None, max_batch: int = 8,
                 batch_wait_s: float = 0.005, max_batch_prompt_tokens: int | None = None,
                 queue_timeout_s: float = 0.0, drafts: Callable[[str], Backend] | None = None,
                 spec_rule: str = "vllm", prefill_chunk: int | None = None):
        self.backend = backend  # the backend that generates (the variant's, when misconfigured)
        self.variant = variant
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.max_batch_prompt_tokens = max_batch_prompt_tokens
        self.queue_timeout_s = queue_timeout_s
        self.stop_ids = backend.stop_ids()
        self.drafts, self.spec_rule = drafts, spec_rule
        self.prefill_chunk = prefill_chunk
        # Counters reported by /health.
        self.batches = 0  # decoded batches
        self.requests = 0  # jobs decoded (each once, whatever retries it took)
        self.largest_batch = 0
        self.decode_steps = 0  # sampling steps of all batches (one per output token position)
        self.abandoned = 0  # jobs whose client left: dropped from the queue or stopped mid-batch
        self.expired = 0  # jobs that waited longer than queue_timeout_s
        self.failed = 0  # jobs that failed with an internal error
        self.spec_requests = 0  # jobs decoded speculatively (each also counts in ``requests``)
        self.spec_tokens = 0  # their output tokens
        self.spec_accepted = 0  # of which accepted drafts (spec_accepted / spec_tokens: the draft's share)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._held: Job | None = None  # the job that did not fit the last batch's budget: next batch's first
        self._profiles: dict[str, Profile] = {}
        self._thread = threading.Thread(target=self._run, name="verinfer-serve-worker", daemon=True)
        self._closed = False

    def start(self) -> "BatchWorker":
        self._thread.start()
        return self

    @property
    def queued(self) -> int:
        return self._queue.qsize() + (self._held is not None)

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

    def _count_step(self) -> None:
        self.decode_steps += 1

    def _admit(self, job: Job) -> bool:
        """Mark a dequeued job running; False (and its future settled) when it must not run."""
        if job.future.cancelled() or job.gone.is_set():  # the handler gave up on it: client gone or timed out
            if job.gone.is_set():
                self.abandoned += 1
            else:
                self.expired += 1
            job.future.cancel()
            return False
        if self.queue_timeout_s and time.monotonic() - job.queued_at > self.queue_timeout_s:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(QueueTimeout(
                    f"the request waited more than {self.queue_timeout_s:g} s in the queue"))
            self.expired += 1
            return False
        return job.future.set_running_or_notify_cancel()

    def _fits(self, jobs: list[Job], job: Job) -> bool:
        if self.max_batch_prompt_tokens is None:
            return True
        width = max(job.prompt_len, *(j.prompt_len for j in jobs))
        return (len(jobs) + 1) * width <= self.max_batch_prompt_tokens

    def _collect(self, first: Job) -> tuple[list[Job], bool]:
        """The batch that starts with ``first``: companions that arrive within ``batch_wait_s``."""
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
            if not self._admit(nxt):
                continue
            if not self._fits(jobs, nxt):
                self._held = nxt  # first of the next batch (order is kept)
                break
            jobs.append(nxt)
        return jobs, stopping

    def _run(self) -> None:
        while True:
            if self._held is not None:
                first, self._held = self._held, None
            else:
                first = self._queue.get()
                if first is None:
                    return
                if not self._admit(first):
                    continue
            jobs, stopping = self._collect(first)
            self._serve(jobs)
            if stopping:
                if self._held is not None:  # close() queued None after it: serve it before stopping
                    job, self._held = self._held, None
                    self._serve([job])
                return

    def _problem(self, job: Job) -> str | None:
        """What in a job would fail a whole batch's tensors (the API refuses it before; checked again)."""
        r = job.request
        if not r.prompt_token_ids:
            return "empty prompt"
        if job.max_tokens < 0:
            return f"max_tokens {job.max_tokens} < 0"
        problems = r.params.problems()
        if problems:
            return problems[0]
        if not -INT64 <= r.params.top_k < INT64:
            return f"top_k {r.params.top_k} does not fit int64"
        if is_speculative_job(job) and self.drafts is None:
            return "speculative decoding was asked for, but this server has no draft model"
        return None

    def _serve(self, jobs: list[Job]) -> None:
        """Decode ``jobs`` and settle their futures; a failure fails only the jobs it belongs to."""
        ok = []
        for job in jobs:
            problem = self._problem(job)
            if problem is None:
                ok.append(job)
            else:
                self.failed += 1
                job.future.set_exception(ValueError(f"request {job.request.id}: {problem}"))
        if not ok:
            return
        try:
            results = self._decode(ok)
        except Exception as exc:
            if len(ok) == 1:
                results = [exc]
            else:  # find the job that fails: each on its own
                print(f"verinfer serve: a batch of {len(ok)} failed ({type(exc).__name__}: {exc}); "
                      "decoding its requests one by one", file=sys.stderr)
                results = []
                for job in ok:
                    try:
                        results += self._decode([job])
                    except Exception as one:
                        results.append(one)
        for job, res in zip(ok, results):
            if isinstance(res, Abandoned):
                self.abandoned += 1
            elif isinstance(res, BaseException):
                self.failed += 1
                print(f"verinfer serve: request {job.request.id} failed: {type(res).__name__}: {res}",
                      file=sys.stderr)
            else:
                self.requests += 1
            if isinstance(res, BaseException):
                job.future.set_exception(res)
            else:
                job.future.set_result(res)

    def _decode(self, jobs: list[Job]) -> list[Generation | Exception]:
        """One batch: a Generation per job, or ``Abandoned`` for a job whose client left.

        Speculative jobs are decoded one by one (module docstring), the others together."""
        spec = [is_speculative_job(j) for j in jobs]
        if not any(spec):
            return self._decode_batch(jobs)
        plain = [j for j, s in zip(jobs, spec) if not s]
        plain_out = iter(self._decode_batch(plain) if plain else [])
        return [self._decode_speculative(j) if s else next(plain_out) for j, s in zip(jobs, spec)]

    def _decode_speculative(self, job: Job) -> Generation | Exception:
        """One speculative job, alone (``decode_speculative``): its Generation, ``Abandoned`` when its
        client left, or the exception that failed it (this job only)."""
        if job.gone.is_set():
            return Abandoned()
        tokens, modes, finish = [], "", "length"
        try:
            if job.max_tokens > 0:
                draft = self.drafts(job.request.params.speculative["draft"])
                res = decode_speculative(self.backend, draft, job.request, job.max_tokens,
                                         _WatchedStops(self.stop_ids, job.gone), self.spec_rule,
                                         self.prefill_chunk, lambda: _stop_if(job.gone))
                tokens, modes, finish = res.tokens, res.modes, res.finish_reason
            rows = lps = plp = None
            if job.needs_rows or job.logprobs is not None:
                prompt, length = job.request.prompt_token_ids, job.prompt_len
                rows = self._prefill_rows(prompt, tokens)
                if job.logprobs is not None:  # output token i is predicted by row L - 1 + i
                    lps = prompt_logprobs(self.backend, rows[length - 1:], (prompt[-1], *tokens), job.logprobs)
                if job.prompt_logprobs is not None:
                    plp = prompt_logprobs(self.backend, rows[:length - 1], prompt, job.prompt_logprobs)
        except _StopBatch:
            return Abandoned()
        except Exception as exc:
            return exc
        self.spec_requests += 1
        self.spec_tokens += len(tokens)
        self.spec_accepted += modes.count("a")
        self.decode_steps += len(tokens)
        return Generation(tokens, finish, rows if job.capture else None, lps, plp, modes)

    def _prefill_rows(self, prompt: tuple[int, ...], tokens: list[int]) -> torch.Tensor:
        """Final hidden rows [L + n - 1, D] of prompt + output, from one prefill on the generating model
        (the last output token is never fed back; L rows when there is no output)."""
        ids = torch.tensor([list(prompt) + list(tokens[:-1])])
        h, _ = self.backend.hidden(ids, None, torch.arange(ids.shape[1])[None], None)
        return h[0].float().cpu()

    def _decode_batch(self, jobs: list[Job]) -> list[Generation | Exception]:
        """Jobs decoded together by ``decode_batch`` (left padding, one sampling step per token)."""
        if all(j.gone.is_set() for j in jobs):
            return [Abandoned() for _ in jobs]
        batch = [j.request for j in jobs]
        inner = self.variant.hook() if self.variant is not None and self.variant.hook else None
        hook = StepHook(jobs, inner, self.stop_ids, on_step=self._count_step)
        capture = any(j.needs_rows for j in jobs)
        steps = max(j.max_tokens for j in jobs)
        decoded = None
        try:
            decoded = decode_batch(self.backend, batch, steps, self.stop_ids, self._profiles, hook, capture=capture,
                                   prefill_chunk=self.prefill_chunk, between_chunks=hook.between_chunks,
                                   gone=hook.gone)
        except _StopBatch:
            pass  # only abandoned rows were left; the others' tokens are in the hook
        finally:
            for r in batch:
                for profile in self._profiles.values():
                    profile.forget(r.id)
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(jobs))
        out: list[Generation | Exception] = []
        for b, job in enumerate(jobs):
            if job.gone.is_set():
                out.append(Abandoned())
                continue
            if decoded is None and job.needs_rows:  # stopped early: its hidden rows were not returned
                out += self._decode([job])
                continue
            n = min(len(decoded[b].tokens) if decoded is not None else len(hook.tokens[job.request.id]),
                    job.max_tokens)
            tokens = (decoded[b].tokens if decoded is not None else hook.tokens[job.request.id])[:n]
            finish = "stop" if tokens and tokens[-1] in self.stop_ids else "length"
            length = job.prompt_len
            rows = decoded[b].rows if decoded is not None else None
            keep = rows[: length + n - 1] if rows is not None and job.capture else None
            plp = (prompt_logprobs(self.backend, rows[:length - 1], job.request.prompt_token_ids,
                                   job.prompt_logprobs) if job.prompt_logprobs is not None else None)
            lps = hook.recorder.records[job.request.id][:n] if job.logprobs is not None else None
            out.append(Generation(tokens, finish, keep, lps, plp))
        return out
