"""A speculatively decoded row (``verinfer serve --speculative``): one request decoded by
``verinfer.simulate.speculative.speculative_blocks``, the sampler the verifier replays, one step
(k drafts proposed, verified, cut back) per scheduler iteration.

Such rows join and leave the scheduler's iterations as plain rows do, but keep their own KV caches
(target and draft): each step accepts a different number of drafts per request, so their caches
are cut back per request. Logprobs, prompt logprobs and the hidden rows of activation commits come
from one extra prefill of prompt + output on the generating model, made only when the job asks for
them; ``Generation.spec_modes`` says how each token was produced (``a`` accepted draft, ``r``
resampled, ``b`` bonus).
"""

from __future__ import annotations

import torch

from verinfer.models.backend import Backend
from verinfer.serve.jobs import Generation, Job
from verinfer.serve.logprobs import prompt_logprobs
from verinfer.simulate.speculative import speculative_blocks


def is_speculative_job(job: Job) -> bool:
    """A job the speculative decoder serves: it claims speculative decoding and samples."""
    params = job.request.params
    return bool(params.speculative) and not params.is_greedy


class SpecRow:
    """One speculative job between scheduler iterations; ``advance`` runs its next prompt chunk or step."""

    def __init__(self, job: Job, target: Backend, draft: Backend, rule: str, prefill_chunk: int | None,
                 stop_ids: set[int]):
        self.job, self.target, self.stop_ids = job, target, stop_ids
        self.tokens: list[int] = []
        self.modes = ""
        self.finish: str | None = "length" if job.max_tokens <= 0 else None
        self.blocks = speculative_blocks(target, draft, job.request, rule, prefill_chunk)

    def advance(self) -> bool:
        """One prompt chunk or one speculative step; True once the row is finished."""
        if self.finish is not None:
            return True
        block = next(self.blocks)
        if block is None:
            return False
        for tok, mode in zip(block.tokens, block.modes):
            self.tokens.append(tok)
            self.modes += mode
            if tok in self.stop_ids or len(self.tokens) >= self.job.max_tokens:
                self.finish = "stop" if tok in self.stop_ids else "length"
                return True
        return False

    def generation(self) -> Generation:
        job, tokens = self.job, self.tokens
        rows = lps = plp = None
        if job.needs_rows or job.logprobs is not None:
            prompt, length = job.request.prompt_token_ids, job.prompt_len
            rows = self._prefill_rows(prompt, tokens)
            if job.logprobs is not None:  # output token i is predicted by row L - 1 + i
                lps = prompt_logprobs(self.target, rows[length - 1:], (prompt[-1], *tokens), job.logprobs)
            if job.prompt_logprobs is not None:
                plp = prompt_logprobs(self.target, rows[:length - 1], prompt, job.prompt_logprobs)
        return Generation(tokens, self.finish or "length", rows if job.capture else None, lps, plp, self.modes)

    def _prefill_rows(self, prompt: tuple[int, ...], tokens: list[int]) -> torch.Tensor:
        """Final hidden rows [L + n - 1, D] of prompt + output, from one prefill on the generating model
        (the last output token is never fed back; L rows when there is no output)."""
        ids = torch.tensor([list(prompt) + list(tokens[:-1])])
        h, _ = self.target.hidden(ids, None, torch.arange(ids.shape[1])[None], None)
        return h[0].float().cpu()
