"""The scheduler's units of work: a ``Job`` per output row, a ``Group`` per request (its ``n`` rows),
and what a job ends with (``Generation``, or ``Abandoned`` / ``QueueTimeout``).

HTTP handlers build jobs and await their futures; only the scheduler's thread touches the model.
A request's rows are one unit for the queue timeout: the timeout applies to the admission of the
request's first row, so rows 9 to 16 of an ``n = 16`` request, waiting for slots behind rows 1 to 8,
are never expired by their own siblings (admission is in arrival order, so they are next).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from verinfer.simulate.generate import Request


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one position: the token there, its logprob, and the top alternatives."""

    token: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class Abandoned(Exception):
    """The job's client went away before its result was ready; nobody reads this."""


class QueueTimeout(Exception):
    """The request waited in the queue longer than the server's limit and was not run."""


class Group:
    """One request's rows. ``started`` is set when its first row is admitted (from then on its other
    rows wait for slots without a deadline); ``queued_at`` is when the request arrived."""

    def __init__(self) -> None:
        self.queued_at = time.monotonic()
        self.started = threading.Event()
        self.jobs: list[Job] = []

    def expired(self, timeout_s: float, now: float | None = None) -> bool:
        """Whether the request waited more than ``timeout_s`` (0: no limit) before any of its rows ran."""
        now = time.monotonic() if now is None else now
        return bool(timeout_s) and not self.started.is_set() and now - self.queued_at > timeout_s


@dataclass(eq=False)
class Job:
    """One output row: actual prompt ids and actual (possibly misconfigured) sampling parameters."""

    request: Request
    max_tokens: int
    logprobs: int | None = None  # top-N logprobs per output token (None: none)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (None: none)
    capture: bool = False  # keep hidden rows for activation commits
    future: Future = field(default_factory=Future)
    gone: threading.Event = field(default_factory=threading.Event)  # set by ``abandon``
    # Live streaming: called from the scheduler's thread with (index, token, logprobs or None) for each
    # output token as it is decoded; a job decoded again alone after a failure repeats its indices.
    on_token: Callable[[int, int, TokenLogprobs | None], None] | None = None
    group: Group = field(default_factory=Group)

    def __post_init__(self) -> None:
        self.group.jobs.append(self)

    @property
    def needs_rows(self) -> bool:
        return self.capture or self.prompt_logprobs is not None

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def queued_at(self) -> float:
        return self.group.queued_at

    def abandon(self) -> bool:
        """The client is gone: a queued job is dropped, a decoding one leaves the batch at the next step.

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
    spec_modes: str | None = None  # speculative jobs: a / r / b per output token (``verinfer.serve.speculative``)
