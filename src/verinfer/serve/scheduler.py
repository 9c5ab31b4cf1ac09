"""One thread that owns the model and schedules rows continuously, as vLLM's scheduler does.

torch modules and KV caches are not safe to drive from several threads, so HTTP handlers never
touch the model: they submit ``Job``s (one per output row, ``serve.jobs``) and await their futures.
Each iteration of the scheduler's loop

1. admits queued jobs in arrival order while the batch has a free slot (``max_batch`` rows,
   speculative ones included) and the prefill budget allows (rows x longest prompt within
   ``max_batch_prompt_tokens``; a job over it on its own runs alone);
2. prefills admitted prompts, whole chunks of ``prefill_chunk`` tokens up to that many tokens per
   iteration (engines' chunked prefill; the rows of one request share one prefill), and lets the
   finished ones join the running batch (``serve.batch``);
3. decodes one step of every running row, and one speculative step of every speculative row
   (``serve.speculative``); finished rows leave and their futures are settled at once.

So a request joins the running batch at the next step boundary and leaves it when it is done: a
short request behind long ones waits one step and a prefill chunk, not for the long ones to end
(``benchmarks/serve_latency.py``). An idle scheduler waits ``batch_wait_s`` after a first arrival for
companions, so that requests sent together start together.

One request never costs another its answer or much of its time:

- Isolation. A job whose parameters the sampler cannot take fails alone, before it runs; if a
  step of the batch raises anyway, each of its rows is decoded again alone, so only the one that
  fails gets the error and the others get the tokens they get alone.
- Cancellation. ``Job.abandon`` (the handler's client disconnected) drops a queued job; a running
  row leaves the batch (and the KV cache) at the next step, a prefilling one before its next
  chunk, a speculative one before its next step.
- Queue timeout. A request none of whose rows was admitted within ``queue_timeout_s`` fails with
  ``QueueTimeout``; the rows of a request are one unit (``serve.jobs``), so its own siblings
  never make it expire.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from verinfer.models.backend import Backend
from verinfer.sampling.profiles import Profile
from verinfer.serve.batch import Prefill, Prefilled, Row, RunningBatch
from verinfer.serve.jobs import Abandoned, Generation, Group, Job, QueueTimeout
from verinfer.serve.speculative import SpecRow, is_speculative_job
from verinfer.simulate.variants import Variant

INT64 = 2**63


@dataclass(eq=False)
class _Pending:
    """A prompt being prefilled and the admitted rows waiting for it (one request's)."""

    prefill: Prefill
    jobs: list[Job]
    group: Group


class Scheduler:
    """The model-owning thread. ``submit`` is safe from any thread; results arrive on job futures.

    ``max_batch``: rows decoded at once. ``max_batch_prompt_tokens``: prefill budget (rows x
    longest prompt; None: none). ``queue_timeout_s``: a request not admitted within it fails with
    ``QueueTimeout`` (0: no limit). ``drafts``: the draft model a speculative job's
    ``speculative.draft`` names (None: a speculative job fails alone); ``spec_rule``: the
    speculative decoder's rule (``vllm``: honest). ``prefill_chunk``: prompt tokens prefilled per
    chunk and per iteration (None or 0: whole prompts).
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
        self.batches = 0  # times the running batch started from empty
        self.requests = 0  # jobs decoded (each once, whatever retries it took)
        self.largest_batch = 0  # most rows decoded in one step
        self.decode_steps = 0  # decoding steps (one per output position of the batch; speculative: per token)
        self.abandoned = 0  # jobs whose client left: dropped from the queue or stopped while running
        self.expired = 0  # jobs of requests that waited longer than queue_timeout_s
        self.failed = 0  # jobs that failed with an internal error
        self.spec_requests = 0  # jobs decoded speculatively (each also counts in ``requests``)
        self.spec_tokens = 0  # their output tokens
        self.spec_accepted = 0  # of which accepted drafts (spec_accepted / spec_tokens: the draft's share)
        self._inbox: queue.Queue[Job | None] = queue.Queue()
        self._waiting: deque[Job] = deque()  # submitted, not admitted (scheduler thread only)
        self._pending: list[_Pending] = []  # admitted, prompt being prefilled
        self._prefixes: dict[Group, Prefilled] = {}  # a request's prefilled prompt while siblings wait
        self._profiles: dict[str, Profile] = {}
        self._batch = self._new_batch()
        self._spec: list[SpecRow] = []
        self._thread = threading.Thread(target=self._run, name="verinfer-serve-scheduler", daemon=True)
        self._closed = False

    def _new_batch(self) -> RunningBatch:
        hook = self.variant.hook() if self.variant is not None and self.variant.hook else None
        return RunningBatch(self.backend, self.stop_ids, self._profiles, hook)

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def queued(self) -> int:
        """Jobs submitted and not admitted yet."""
        return self._inbox.qsize() + len(self._waiting)

    @property
    def running(self) -> int:
        """Rows admitted and not finished: prefilling, decoding, speculative."""
        return len(self._batch) + sum(len(p.jobs) for p in self._pending) + len(self._spec)

    def submit(self, job: Job) -> Future:
        if self._closed:
            raise RuntimeError("the server is shutting down")
        self._inbox.put(job)
        return job.future

    def close(self, timeout: float | None = 60) -> None:
        """Finish queued and running work, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while True:
            idle = not self.running and not self._waiting
            stopping = self._take(wait=idle and not stopping) or stopping
            if stopping and not self.running and not self._waiting and self._inbox.empty():
                return
            self._admit()
            self._prefill()
            self._step()
            self._step_speculative()

    def _take(self, wait: bool) -> bool:
        """Move submitted jobs to the waiting line; an idle scheduler blocks for the first and then
        waits ``batch_wait_s`` for companions. True when ``close`` was called."""
        stopping = False
        if wait:
            first = self._inbox.get()
            if first is None:
                return True
            self._waiting.append(first)
            deadline = time.monotonic() + self.batch_wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    nxt = self._inbox.get(timeout=left)
                except queue.Empty:
                    break
                if nxt is None:
                    return True
                self._waiting.append(nxt)
        while True:
            try:
                nxt = self._inbox.get_nowait()
            except queue.Empty:
                return stopping
            if nxt is None:
                stopping = True
            else:
                self._waiting.append(nxt)

    def _fits(self, job: Job) -> bool:
        """The prefill budget: rows x longest prompt, counting the running rows and ``job``."""
        if self.max_batch_prompt_tokens is None or not self.running:
            return True
        lengths = [r.job.prompt_len for r in self._batch.rows] + [j.prompt_len for p in self._pending
                                                                   for j in p.jobs]
        lengths += [s.job.prompt_len for s in self._spec]
        return (len(lengths) + 1) * max(job.prompt_len, *lengths) <= self.max_batch_prompt_tokens

    def _admit(self) -> None:
        now = time.monotonic()
        while self._waiting:
            job = self._waiting[0]
            if job.future.cancelled() or job.gone.is_set():  # the handler gave up on it: client gone or timed out
                self._waiting.popleft()
                self._drop(job)
                continue
            if job.group.expired(self.queue_timeout_s, now):
                self._waiting.popleft()
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(QueueTimeout(
                        f"the request waited more than {self.queue_timeout_s:g} s in the queue"))
                self.expired += 1
                self._release(job.group)
                continue
            if self.running >= self.max_batch or not self._fits(job):
                return  # in arrival order: nobody overtakes the head of the line
            self._waiting.popleft()
            if not job.future.set_running_or_notify_cancel():
                self._drop(job)
                continue
            job.group.started.set()
            problem = self._problem(job)
            if problem is not None:
                self._fail(job, ValueError(f"request {job.request.id}: {problem}"))
            elif is_speculative_job(job):
                try:
                    draft = self.drafts(job.request.params.speculative["draft"])
                    self._spec.append(SpecRow(job, self.backend, draft, self.spec_rule, self.prefill_chunk,
                                              self.stop_ids))
                except Exception as exc:
                    self._fail(job, exc)
            else:
                self._start(job)

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

    def _start(self, job: Job) -> None:
        """An admitted plain row: joins at once when its request's prompt is prefilled, else waits for it."""
        prefix = self._prefixes.get(job.group)
        if prefix is not None:
            self._join(job, prefix)
            return
        for p in self._pending:
            if p.group is job.group and p.prefill.prompt == job.request.prompt_token_ids:
                p.jobs.append(job)
                return
        capture = any(j.needs_rows for j in job.group.jobs)
        self._pending.append(_Pending(Prefill(self.backend, job.request.prompt_token_ids, self.prefill_chunk, capture),
                                      [job], job.group))

    def _join(self, job: Job, prefilled: Prefilled) -> None:
        if job.max_tokens <= 0:  # nothing to decode: scored prompt only
            row = Row(job, prefilled.length, hidden=[prefilled.rows] if job.needs_rows else None,
                      logprobs=[] if job.logprobs is not None else None)
            self._finish(row, self._batch)
        else:
            if not len(self._batch):
                self.batches += 1
            self._batch.join(job, prefilled)
        if any(self._unadmitted(j) for j in job.group.jobs):
            self._prefixes[job.group] = prefilled  # siblings still to come share it
        else:
            self._prefixes.pop(job.group, None)

    @staticmethod
    def _unadmitted(job: Job) -> bool:
        return not job.future.running() and not job.future.done()

    def _release(self, group: Group) -> None:
        """Forget a request's prefilled prompt once none of its rows can still need it."""
        if group in self._prefixes and not any(self._unadmitted(j) for j in group.jobs):
            del self._prefixes[group]

    def _prefill(self) -> None:
        """Whole prompt chunks, up to ``prefill_chunk`` tokens this iteration (at least one chunk)."""
        used = 0
        while self._pending:
            p = self._pending[0]
            for job in [j for j in p.jobs if j.gone.is_set()]:
                p.jobs.remove(job)
                self._settle(job, Abandoned())
            if not p.jobs:
                self._pending.pop(0)
                self._release(p.group)
                continue
            size = p.prefill.next_size
            if self.prefill_chunk and used and used + size > self.prefill_chunk:
                return
            try:
                done = p.prefill.advance()
            except Exception as exc:
                self._pending.pop(0)
                for job in p.jobs:
                    self._fail(job, exc)
                continue
            used += size
            if done is not None:
                self._pending.pop(0)
                for job in p.jobs:
                    self._join(job, done)

    def _step(self) -> None:
        if not len(self._batch):
            return
        rows = list(self._batch.rows)
        try:
            finished, gone = self._batch.step()
        except Exception as exc:
            self._isolate(rows, exc)
            return
        self.decode_steps += 1
        self.largest_batch = max(self.largest_batch, len(rows))
        for row in gone:
            self._forget(row.job)
            self._settle(row.job, Abandoned())
        for row in finished:
            self._finish(row, self._batch)

    def _isolate(self, rows: list[Row], exc: Exception) -> None:
        """A step failed: each of its rows is decoded again alone, so only the one at fault fails."""
        self._batch = self._new_batch()
        for row in rows:
            self._forget(row.job)
        if len(rows) == 1:
            self._fail(rows[0].job, exc)
            return
        print(f"verinfer serve: a step of {len(rows)} rows failed ({type(exc).__name__}: {exc}); "
              "decoding them one by one", file=sys.stderr)
        for row in rows:
            self._decode_alone(row.job)

    def _decode_alone(self, job: Job) -> None:
        """``job`` from its prompt to its end in a batch of its own (the isolation path)."""
        solo = self._new_batch()
        try:
            prefill = Prefill(self.backend, job.request.prompt_token_ids, self.prefill_chunk, job.needs_rows)
            while (done := prefill.advance()) is None:
                if job.gone.is_set():
                    break
            if job.gone.is_set():
                self._settle(job, Abandoned())
                return
            if job.max_tokens <= 0:
                self._finish(Row(job, len(prefill.prompt), hidden=[done.rows] if job.needs_rows else None,
                                 logprobs=[] if job.logprobs is not None else None), solo)
                return
            solo.join(job, done)
            while True:
                finished, gone = solo.step()
                self.decode_steps += 1
                if gone:
                    self._settle(job, Abandoned())
                    return
                if finished:
                    self._finish(finished[0], solo)
                    return
        except Exception as exc:
            self._fail(job, exc)
        finally:
            self._forget(job)

    def _step_speculative(self) -> None:
        for row in list(self._spec):
            job = row.job
            if job.gone.is_set():
                self._spec.remove(row)
                self._settle(job, Abandoned())
                continue
            try:
                if not row.advance():
                    continue
                self._spec.remove(row)
                gen = row.generation()
            except Exception as exc:
                if row in self._spec:
                    self._spec.remove(row)
                self._fail(job, exc)
                continue
            self.spec_requests += 1
            self.spec_tokens += len(gen.tokens)
            self.spec_accepted += gen.spec_modes.count("a")
            self.decode_steps += len(gen.tokens)
            self._settle(job, gen)

    # -- settling futures ------------------------------------------------------------------------

    def _finish(self, row: Row, batch: RunningBatch) -> None:
        self._forget(row.job)
        try:
            gen = batch.generation(row)
        except Exception as exc:
            self._fail(row.job, exc)
            return
        self._settle(row.job, gen)

    def _forget(self, job: Job) -> None:
        for profile in self._profiles.values():
            profile.forget(job.request.id)

    def _drop(self, job: Job) -> None:
        """A job its handler gave up on before it ran: its client left, or it timed out there."""
        if job.gone.is_set():
            self.abandoned += 1
        else:
            self.expired += 1
        job.future.cancel()
        self._release(job.group)

    def _fail(self, job: Job, exc: BaseException) -> None:
        print(f"verinfer serve: request {job.request.id} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        self._settle(job, exc)

    def _settle(self, job: Job, result: Generation | BaseException) -> None:
        if isinstance(result, Abandoned):
            self.abandoned += 1
        elif isinstance(result, BaseException):
            self.failed += 1
        else:
            self.requests += 1
        if job.future.done():  # pragma: no cover - settled once by construction; never twice
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)
