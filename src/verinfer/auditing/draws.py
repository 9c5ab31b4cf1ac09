"""The reference's own samples for audits without seeds, and the per-completion scores that judge them.

Without a seed a provider's sampled output cannot be replayed token by token; it can only be
compared, as a draw, with draws of the trusted reference under the same sampling parameters
(RUT, Zhu et al., ICLR 2026; Model Equality Testing, Gao et al., ICLR 2025). ``reference_draws``
samples ``m`` outputs for each completion to be judged with the local model (batched, through the
project's sampler, seeded by the audit's ``--seed`` so a rerun draws the same ones) and keeps them
in a ``ResponseStore`` beside the provider responses: an interrupted audit resumes without drawing
again, and the draws of one completion are written whole or not at all.

Draws are keyed by the prompt's *content* and its *occurrence* (the k-th completion judged on that
prompt, whatever its id or request): two completions never share draws, since ranks against shared
draws are dependent and the rank test's false-positive rate grows with each repetition (issue #29).
The m draws of one completion share one prefill of the prompt (``decode_batch(shared=m)``).

``completion_scores`` scores completions with one prefill: per completion the sum over its tokens
of the reference's log-probability at the claimed temperature (``log_softmax(logits / T)``, no
filter, so every sequence has a finite score) and, from the same logits, the sum of its expectation
and variance under the claimed sampling distribution (temperature, then top-k / top-p / min-p).
The log-probability minus its expectation (``centred``) is a martingale under the null: the
entropy each completion's path happens to cross is removed, leaving the signal (issue #29 item 2).
Given ``tilts`` (the surprise test's), the same pass also sums, per completion, each position's
cumulant generating function of the centred log-probability, ``log E_q[exp(lambda * (log p - E_q log p))]``,
which makes the surprise test's martingale exact (``verinfer.auditing.surprise``).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from verinfer.auditing.progress import StageProgress
from verinfer.auditing.store import ResponseStore
from verinfer.models.backend import PrefillBlock
from verinfer.sampling.filters import kept_set
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import Request, decode_batch

DRAW_PROFILE = "torch-exponential"  # any correct sampler draws the claimed distribution; this one is cheap and seeded


def occurrences(prompt_ids: Sequence[Sequence[int]]) -> list[int]:
    """How many earlier entries have the same prompt content (0 for the first of each)."""
    seen: Counter = Counter()
    out = []
    for ids in prompt_ids:
        key = tuple(ids)
        out.append(seen[key])
        seen[key] += 1
    return out


def draw_key(model_id: str, dtype: str, prompt_ids: Sequence[int], occurrence: int, params: SamplingParams, m: int,
             seed: int, max_tokens: int) -> str:
    """What one completion's draws depend on: model, prompt content and occurrence, sampler settings,
    how many, seed, length."""
    text = json.dumps([model_id, dtype, list(prompt_ids), occurrence, params.signature(), m, seed, max_tokens],
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def reference_draws(backend, prompts: Sequence[tuple[str, Sequence[int]]], params: SamplingParams, m: int,
                    seed: int, max_tokens: int, store: ResponseStore, batch_size: int = 64,
                    on_stage: Callable[[str], None] | None = None) -> list[list[list[int]]]:
    """``m`` reference outputs for each ``(prompt id, prompt token ids)`` entry, drawn once and stored.

    Give one entry per completion to be judged (a prompt with n completions: n entries); entry i's
    draws are keyed by its content and occurrence (``draw_key``), and draw j uses the seed
    ``int(key[:7], 16) + j`` under the ``torch-exponential`` profile with ``params``' temperature,
    top-k, top-p and min-p (the claimed distribution; the provider's own sampler needs no seed)."""
    if m < 1:
        raise ValueError(f"reference samples per prompt must be >= 1, got {m}")
    keys = [draw_key(backend.model_id, backend.dtype_name, ids, k, params, m, seed, max_tokens)
            for (_, ids), k in zip(prompts, occurrences([ids for _, ids in prompts]))]
    missing = sorted({k: i for i, k in enumerate(keys) if k not in store}.values(), key=lambda i: len(prompts[i][1]))
    if missing and on_stage:
        on_stage(f"reference: drawing {m} samples for each of {len(missing)} completion(s)")
    progress = StageProgress(on_stage, "reference draws", len(missing), "completions")
    per = max(1, batch_size // m)  # completions per decode batch, each prompt prefilled once
    stops, profiles = backend.stop_ids(), {}
    for lo in range(0, len(missing), per):
        chunk = missing[lo: lo + per]
        requests = [Request(f"draw-{keys[i]}-{j}", tuple(prompts[i][1]),
                            params.with_(profile=DRAW_PROFILE, seed=int(keys[i][:7], 16) + j))
                    for i in chunk for j in range(m)]
        decoded = decode_batch(backend, requests, max_tokens, stops, profiles, shared=m)
        for profile in profiles.values():
            for r in requests:
                profile.forget(r.id)
        for n, i in enumerate(chunk):
            outs = [d.tokens for d in decoded[n * m:(n + 1) * m]]
            store.append(keys[i], "reference-draws", {"prompt_id": prompts[i][0], "m": m, "seed": seed}, outs)
        progress.advance(len(chunk))
    return [store.get(k)["response"] for k in keys]


@dataclass(frozen=True)
class CompletionScores:
    """Per completion: the reference's log-probability of it and that sum's mean and variance under
    the claimed sampling distribution, position by position (all sums over the completion's tokens)."""

    logprob: np.ndarray
    expected: np.ndarray
    variance: np.ndarray
    tokens: np.ndarray
    cgf: np.ndarray | None = None  # [completions, len(tilts)]: summed cumulant generating function at each tilt
    tilts: tuple[float, ...] = ()

    @property
    def centred(self) -> np.ndarray:
        """Log-probability minus its expectation: mean 0 under the null, whatever the path's entropy."""
        return self.logprob - self.expected

    def __getitem__(self, index) -> CompletionScores:
        cgf = None if self.cgf is None else self.cgf[index]
        return CompletionScores(self.logprob[index], self.expected[index], self.variance[index], self.tokens[index],
                                cgf, self.tilts)


@torch.inference_mode()
def completion_scores(backend, prompt_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                      params: SamplingParams, token_budget: int = 4096,
                      tilts: Sequence[float] = (), on_block: Callable[[PrefillBlock], None] | None = None
                      ) -> CompletionScores:
    """Score ``outputs`` (after ``prompt_ids``) with one prefill of ``backend`` under ``params``; with
    ``tilts``, also each completion's summed cumulant generating function at them (``cgf``).
    ``on_block`` sees each block of the prefill (raw logits), for other scores of the same rows
    without a second prefill (``auditing.auto``: the logprobs test's reference values)."""
    if not params.temperature > 0:
        raise ValueError(f"completion scores need a temperature > 0, got {params.temperature}")
    sequences = [list(p) + list(o) for p, o in zip(prompt_ids, outputs)]
    starts = [len(p) for p in prompt_ids]
    sums, cgf = np.zeros((3, len(sequences))), np.zeros((len(sequences), len(tilts)))
    filtered = params.top_k > 0 or params.top_p < 1 or params.min_p > 0
    for block in backend.prefill(sequences, starts, token_budget=token_budget):
        if on_block is not None:
            on_block(block)
        x = block.logits.float() / params.temperature
        logp = torch.log_softmax(x, dim=-1)
        if filtered:  # the sampling distribution q: the kept tokens, renormalized
            n = x.shape[0]
            kept = kept_set(x, torch.full((n,), params.top_k), torch.full((n,), params.top_p),
                            torch.full((n,), params.min_p))
            logq = torch.where(x >= kept.threshold[:, None], x - kept.log_norm[:, None].float(), -torch.inf)
        else:
            logq = logp
        q = logq.exp()
        mean = (q * logp).nan_to_num().sum(-1)  # 0 * -inf never arises: logp is finite
        var = (q * (logp - mean[:, None]) ** 2).sum(-1)
        targets = torch.as_tensor([sequences[i][starts[i] + s] for i, s in zip(block.items.tolist(),
                                                                               block.steps.tolist())])
        lp = logp.gather(1, targets[:, None])[:, 0]
        items = block.items.numpy()
        for row, values in enumerate((lp, mean, var)):
            np.add.at(sums[row], items, values.double().numpy())
        if tilts:  # log sum_y q(y) exp(lambda (log p(y) - mean)) / sum_y q(y), |lambda| < 1: no overflow; summed
            centred = logp - mean[:, None]  # in float64 and normalized, so rounding stays near 1e-7 per position
            sums_q = [torch.add(logq, centred, alpha=lam).exp_().sum(-1, dtype=torch.float64) for lam in (0.0, *tilts)]
            psi = torch.stack(sums_q[1:], dim=-1).log() - sums_q[0].log()[:, None]
            np.add.at(cgf, items, psi.numpy())
    return CompletionScores(sums[0], sums[1], sums[2], np.array([len(o) for o in outputs]),
                            cgf if tilts else None, tuple(tilts))


def retokenize(tokenizer, outputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Outputs as a provider that returns only text makes them: decoded (special tokens dropped)
    and encoded again, so reference draws and re-tokenized provider outputs stay exchangeable."""
    return [tokenizer.encode(tokenizer.decode(list(o), skip_special_tokens=True), add_special_tokens=False)
            for o in outputs]


def store_path(out_dir: Path) -> Path:
    """Where an audit keeps its reference draws (shared by every provider of the audit)."""
    return Path(out_dir) / "reference" / "draws.jsonl"
