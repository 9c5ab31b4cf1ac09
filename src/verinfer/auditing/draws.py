"""The reference's own samples for audits without seeds, and the log-probabilities that rank them.

Without a seed a provider's sampled output cannot be replayed token by token; it can only be
compared, as a draw, with draws of the trusted reference under the same sampling parameters
(RUT, Zhu et al., ICLR 2026; Model Equality Testing, Gao et al., ICLR 2025). ``reference_draws``
samples ``m`` outputs per prompt with the local model (batched, through the project's sampler,
seeded by the audit's ``--seed`` so a rerun draws the same ones) and keeps them in a
``ResponseStore`` beside the provider responses: an interrupted audit resumes without drawing
again, and the draws of one prompt are written whole or not at all.

``sequence_logprobs`` scores output sequences with one prefill: the sum over output tokens of
the reference's log-probability at the claimed temperature (``log_softmax(logits / T)``, no
filter, so every sequence has a finite score). Any fixed score keeps the rank test exact; this
one is the reference's likelihood of what was sampled, which is what RUT ranks by.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from verinfer.auditing.store import ResponseStore
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import Request, generate

DRAW_PROFILE = "torch-exponential"  # any correct sampler draws the claimed distribution; this one is cheap and seeded


def draw_key(model_id: str, dtype: str, prompt_ids: Sequence[int], params: SamplingParams, m: int, seed: int,
             max_tokens: int) -> str:
    """What a prompt's draws depend on: model, prompt, sampler settings, how many, seeds, length."""
    text = json.dumps([model_id, dtype, list(prompt_ids), params.signature(), m, seed, max_tokens],
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def reference_draws(backend, prompts: Sequence[tuple[str, Sequence[int]]], params: SamplingParams, m: int,
                    seed: int, max_tokens: int, store: ResponseStore, batch_size: int = 16,
                    on_stage: Callable[[str], None] | None = None) -> dict[str, list[list[int]]]:
    """``m`` reference outputs per ``(prompt id, prompt token ids)``, drawn once and stored.

    Prompt i's draw j uses seed ``seed + i * m + j`` under the ``torch-exponential`` profile (an exponential race on a seeded generator) with ``params``'
    temperature, top-k, top-p and min-p (the claimed distribution; the provider's own sampler
    needs no seed)."""
    if m < 1:
        raise ValueError(f"reference samples per prompt must be >= 1, got {m}")
    keys = [draw_key(backend.model_id, backend.dtype_name, ids, params, m, seed, max_tokens) for _, ids in prompts]
    missing = [i for i, k in enumerate(keys) if k not in store]
    if missing and on_stage:
        on_stage(f"reference: drawing {m} samples for each of {len(missing)} prompt(s)")
    per = max(1, batch_size // m)  # prompts per generation call
    for lo in range(0, len(missing), per):
        chunk = missing[lo: lo + per]
        requests = [Request(f"draw-{i}-{j}", tuple(prompts[i][1]),
                            params.with_(profile=DRAW_PROFILE, seed=seed + i * m + j))
                    for i in chunk for j in range(m)]
        traces = generate(backend, requests, max_tokens, batch_size)
        for n, i in enumerate(chunk):
            outs = [list(t.output_token_ids) for t in traces[n * m:(n + 1) * m]]
            store.append(keys[i], "reference-draws", {"prompt_id": prompts[i][0], "m": m, "seed": seed}, outs)
    return {pid: store.get(k)["response"] for (pid, _), k in zip(prompts, keys)}


@torch.inference_mode()
def sequence_logprobs(backend, prompt_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                      temperature: float, token_budget: int = 4096) -> np.ndarray:
    """Sum over each output's tokens of ``log_softmax(logits / temperature)`` under ``backend``."""
    if not temperature > 0:
        raise ValueError(f"sequence log-probabilities need a temperature > 0, got {temperature}")
    sequences = [list(p) + list(o) for p, o in zip(prompt_ids, outputs)]
    starts = [len(p) for p in prompt_ids]
    total = np.zeros(len(sequences))
    for block in backend.prefill(sequences, starts, token_budget=token_budget):
        targets = torch.as_tensor([sequences[i][starts[i] + s] for i, s in zip(block.items.tolist(),
                                                                              block.steps.tolist())])
        lp = torch.log_softmax(block.logits.float() / temperature, dim=-1).gather(1, targets[:, None])[:, 0]
        np.add.at(total, block.items.numpy(), lp.double().numpy())
    return total


def retokenize(tokenizer, outputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Outputs as a provider that returns only text makes them: decoded (special tokens dropped)
    and encoded again, so reference draws and re-tokenized provider outputs stay exchangeable."""
    return [tokenizer.encode(tokenizer.decode(list(o), skip_special_tokens=True), add_special_tokens=False)
            for o in outputs]


def store_path(out_dir: Path) -> Path:
    """Where an audit keeps its reference draws (shared by every provider of the audit)."""
    return Path(out_dir) / "reference" / "draws.jsonl"
