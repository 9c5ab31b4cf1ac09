"""The seedless modes against a reference you do not run locally: a trusted OpenAI-compatible API.

A customer auditing a hosted model they cannot load (a 70B on someone else's GPUs) can still run
``--mode rank | mmd | logprobs`` if they trust one endpoint serving the same model, typically their
own ``vllm serve``. Everything the local reference computes for those modes comes from that API
(``verinfer.auditing.reference.ApiReference``'s client; every response persisted in
``reference/responses.jsonl`` like a provider's, so a rerun resumes without paying again):

- **draws** (``remote_draws``): one completions request per prompt with ``n = m`` and the claimed
  temperature, top-k, top-p and min-p, on the prompt's token ids, asking for ``return_token_ids``.
  Exact: the API samples the claimed distribution itself. Seeds are sent (``DRAW_SEED_OFFSET +
  seed + i * m``; vLLM gives choice j ``seed + j``) so a rerun draws the same completions, and they
  are offset so that a provider that honours seeds and is the same engine never returns one of the
  reference's own draws (the audit sends providers ``seed + i``).
- **completion scores** (``remote_completion_scores``, the rank test's ``CompletionScores``):
  ``echo: true, max_tokens: 0, logprobs: 20`` on prompt + completion (vLLM's prompt logprobs).
  They are log-probabilities of the *raw* logits (what vLLM and OpenAI return); the log-probability
  at the claimed temperature and its expectation and variance under the claimed sampling
  distribution need the whole vocabulary, of which the API returns the top 20 and the claimed
  token: **approximated** (``position_moments``: the missing mass as a tail of tokens as likely as
  the least likely one returned; exact at T = 1 for the log-probability, and for the moments when
  the top 20 hold all the mass). Any fixed function of a completion keeps the rank test exact, so
  the approximation costs power, never false positives (measured: RESULTS.md section 22). The
  approximated expectation is off by about 0.3 nats per token on chitchat completions, so the
  draws-free ``surprise`` test, whose z-statistic uses the moments themselves, is refused against a
  reference API (``verinfer.auditing.run``): it flagged an honest provider most of the time.
- **logprob values** (``remote_values``): the same echo request, ``top_logprobs`` at each output
  position. The claimed token's own logprob is always returned (vLLM includes the prompt token
  beside its top-k); a provider's top-k alternative is known at the reference only when it is in
  the reference's top-k: **approximated**: outside it, the reference's k-th logprob stands in, an
  upper bound of the true value (counted per prompt as ``bounded_alternatives``). An honest
  provider's top-5 is inside the reference's top-20, so nothing is bounded there and the
  false-positive rate is untouched; a provider whose top tokens differ keeps part of that evidence
  (its alternatives look likelier to the reference than they are, which shrinks the difference).

Keys are asked for as ``token_id:<id>`` (``return_tokens_as_token_ids``, a vLLM extension that
``verinfer serve`` shares), so top-k keys map to ids without decoding ambiguity; a reference that
ignores it gets its strings mapped with the reference tokenizer (``logprobs.token_table``).

A reference that answers without prompt logprobs, with another tokenizer's positions, or not at
all stops the audit with one line naming it; the providers' responses were fetched and stored first
(``verinfer.auditing.run``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from verinfer.auditing.client import Call, ProviderError
from verinfer.auditing.draws import CompletionScores
from verinfer.auditing.logprobs import ReturnedLogprobs
from verinfer.auditing.responses import parse_generation
from verinfer.sampling.params import SamplingParams

DRAW_SEED_OFFSET = 1 << 40  # reference draws' seeds, far from the seeds the audit sends providers
ECHO_TOP = 20  # top logprobs asked per position (vLLM's default --max-logprobs)


def _where(reference, what: str) -> str:
    return f"reference API {reference.client.endpoint.display_url}: {what}"


def draw_calls(reference, prompts: Sequence[tuple[str, Sequence[int]]], params: SamplingParams, m: int, seed: int,
               max_tokens: int) -> list[Call]:
    """One completions request per ``(prompt id, prompt ids)`` for ``m`` draws under ``params``."""
    calls = []
    for i, (pid, ids) in enumerate(prompts):
        body = {"model": reference.client.endpoint.model, "prompt": list(ids), "max_tokens": max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "n": m,
                "seed": DRAW_SEED_OFFSET + seed + i * m, "return_token_ids": True}
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.min_p > 0:
            body["min_p"] = params.min_p
        calls.append(Call("completions", body, {"kind": "reference-draws", "prompt_id": pid, "index": i,
                                                "prompt_token_ids": list(ids)}))
    return calls


def remote_draws(reference, prompts: Sequence[tuple[str, Sequence[int]]], params: SamplingParams, m: int, seed: int,
                 max_tokens: int, on_stage: Callable[[str], None] | None = None) -> list[list[list[int]]]:
    """``m`` completions sampled by the reference API for each ``(prompt id, prompt ids)`` entry (one
    entry per completion judged, as ``draws.reference_draws`` takes them): entry i's request has its
    own seed, so a prompt repeated in the audit never shares draws."""
    if m < 1:
        raise ValueError(f"reference samples per prompt must be >= 1, got {m}")
    calls = draw_calls(reference, prompts, params, m, seed, max_tokens)
    todo = sum(c.key not in reference.client.store for c in calls)
    if todo and on_stage:
        on_stage(f"reference API: asking for {m} samples for each of {todo} completion(s)")
    out = []
    for record in reference.client.fetch(calls):
        where = _where(reference, f"draws for prompt {record['prompt_id']}")
        got = len(record["response"]["choices"])
        if got < m:
            raise ProviderError(f"{where}: asked for n={m} completions, got {got} (does the reference support n?)")
        out.append([parse_generation(record, reference.tokenizer, set(), reference.vocab_size, where,
                                     j).output_token_ids for j in range(m)])
    return out


def echo_calls(reference, prompt_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[Call]:
    """Prompt logprobs of prompt + output: ``echo``, no new token, ``ECHO_TOP`` alternatives per position."""
    return [Call("completions", {"model": reference.client.endpoint.model, "prompt": list(p) + list(o),
                                 "max_tokens": 0, "echo": True, "logprobs": ECHO_TOP, "temperature": 1.0,
                                 "return_tokens_as_token_ids": True},
                 {"kind": "reference-logprobs", "prompt_id": f"echo-{i}"})
            for i, (p, o) in enumerate(zip(prompt_ids, outputs))]


def _token_id(key: str, table: dict[str, int] | None) -> int | None:
    if key.startswith("token_id:"):
        try:
            return int(key[len("token_id:"):])
        except ValueError:
            return None
    return None if table is None else table.get(key)


def echo_positions(response: dict, n_prompt: int, n_out: int, where: str,
                   table: dict[str, int] | None = None) -> tuple[np.ndarray, list[dict[int, float]]]:
    """The output positions' own logprobs and ``{token id: logprob}`` top lists of an echo response."""
    choices = response.get("choices") if isinstance(response, dict) else None
    logprobs = choices[0].get("logprobs") if choices and isinstance(choices[0], dict) else None
    if not isinstance(logprobs, dict):
        raise ProviderError(f"{where}: 'choices[0].logprobs' is missing: the reference must return prompt "
                            "logprobs (echo with logprobs, as vLLM's completions endpoint does)")
    own, tops = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not isinstance(own, list) or not isinstance(tops, list) or len(own) < n_prompt + n_out or len(tops) != len(own):
        got = len(own) if isinstance(own, list) else "no"
        raise ProviderError(f"{where}: expected {n_prompt + n_out} prompt logprobs ('token_logprobs' and "
                            f"'top_logprobs'), got {got} (no prompt logprobs support, or another tokenizer?)")
    own, tops = own[n_prompt: n_prompt + n_out], tops[n_prompt: n_prompt + n_out]
    values, lists = np.empty(n_out), []
    for i, (lp, top) in enumerate(zip(own, tops)):
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not isinstance(top, dict) \
                or not all(isinstance(v, (int, float)) for v in top.values()):
            raise ProviderError(f"{where}: output token {i}: malformed logprob entry")
        values[i] = float(lp) if math.isfinite(lp) else -1e9
        lists.append({t: float(v) for k, v in top.items() if (t := _token_id(k, table)) is not None})
    return values, lists


def _echo(reference, prompt_ids, outputs, what: str, table=None) -> list[tuple[np.ndarray, list[dict[int, float]]]]:
    keep = [i for i, o in enumerate(outputs) if len(o)]
    calls = echo_calls(reference, [prompt_ids[i] for i in keep], [outputs[i] for i in keep])
    records = reference.client.fetch(calls)
    out = [(np.zeros(0), [])] * len(outputs)
    for i, record in zip(keep, records):
        out[i] = echo_positions(record["response"], len(prompt_ids[i]), len(outputs[i]),
                                _where(reference, f"{what} {i}"), table)
    return out


def position_moments(known: np.ndarray, claimed: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, ...]:
    """Per position, from raw (T = 1) logprobs of the known tokens (``known`` [N, K], -inf padded; the
    claimed token's own in ``claimed`` [N]): the claimed token's log-probability at the claimed
    temperature and that log-probability's mean and variance under the sampling distribution.

    Approximated (the API returns only the top-k): the mass the known tokens miss, ``r = 1 - sum p``,
    is a tail of tokens as likely as the least likely known one (``r / p_min`` of them); without
    filters it keeps its share of the normalizer and of the moments, with top-k / top-p / min-p the
    sampling distribution is the filters applied to the known tokens alone. At T = 1 the claimed
    token's log-probability is exact; the moments are exact when the top-k holds all the mass."""
    t = params.temperature
    p = np.exp(known)
    rest = np.clip(1.0 - p.sum(axis=1), 0.0, None)
    low = np.min(np.where(np.isfinite(known), known, np.inf), axis=1)
    count = rest / np.exp(low)  # tail tokens, each with raw logprob ``low``
    scaled = known / t
    top = np.max(scaled, axis=1)
    z = np.log(np.exp(scaled - top[:, None]).sum(axis=1) + count * np.exp(low / t - top)) + top
    logp, tail = scaled - z[:, None], low / t - z
    lp_claimed = claimed / t - z
    if params.top_k > 0 or params.top_p < 1 or params.min_p > 0:
        from verinfer.sampling.filters import kept_set

        x = torch.as_tensor(scaled, dtype=torch.float32)
        n = x.shape[0]
        kept = kept_set(x, torch.full((n,), params.top_k), torch.full((n,), params.top_p),
                        torch.full((n,), params.min_p))
        inside = x.numpy() >= kept.threshold.numpy()[:, None]  # compared in fp32, as kept_set computed it
        q = np.where(inside, np.exp(scaled - kept.log_norm.double().numpy()[:, None]), 0.0)
        q_tail = np.zeros(n)
    else:
        q, q_tail = np.exp(logp), count * np.exp(tail)
    safe = np.where(q > 0, logp, 0.0)
    mean = (q * safe).sum(axis=1) + q_tail * tail
    var = (q * (safe - mean[:, None]) ** 2).sum(axis=1) + q_tail * (tail - mean) ** 2
    return lp_claimed, mean, var


def api_view(logprobs: np.ndarray, targets: np.ndarray, k: int = ECHO_TOP) -> tuple[np.ndarray, np.ndarray]:
    """What a reference API returns for positions with raw log-softmax rows ``logprobs`` [N, V] and
    claimed tokens ``targets`` [N]: the top-``k`` logprobs plus the claimed token's, as ``known``
    [N, k + 1] (-inf where the claimed token is already in the top-k) and the claimed token's own
    logprob [N]. ``position_moments`` of it is what ``remote_completion_scores`` computes; with
    ``k`` = V it is exact (a test and ``experiments/remote_reference_power.py`` measure the gap)."""
    n = len(targets)
    top = np.argpartition(-logprobs, k - 1, axis=1)[:, :k] if k < logprobs.shape[1] else np.tile(
        np.arange(logprobs.shape[1]), (n, 1))
    known = np.full((n, top.shape[1] + 1), -np.inf)
    known[:, :-1] = np.take_along_axis(logprobs, top, axis=1)
    claimed = logprobs[np.arange(n), targets]
    outside = ~(top == targets[:, None]).any(axis=1)
    known[outside, -1] = claimed[outside]
    return known, claimed


def remote_completion_scores(reference, prompt_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                             params: SamplingParams) -> CompletionScores:
    """``draws.completion_scores`` from the reference API's prompt logprobs (``position_moments``)."""
    if not params.temperature > 0:
        raise ValueError(f"completion scores need a temperature > 0, got {params.temperature}")
    sums = np.zeros((3, len(outputs)))
    for i, (own, tops) in enumerate(_echo(reference, prompt_ids, outputs, "scoring completion")):
        if not len(own):
            continue
        width = 1 + max(len(t) for t in tops)
        known = np.full((len(own), width), -np.inf)
        for row, (claimed_id, lp, top) in enumerate(zip(outputs[i], own, tops)):
            entries = {**top, claimed_id: lp}
            known[row, : len(entries)] = list(entries.values())
        for k, v in enumerate(position_moments(known, own, params)):
            sums[k, i] = v.sum()
    return CompletionScores(sums[0], sums[1], sums[2], np.array([len(o) for o in outputs]))


def remote_values(reference, returned: Sequence[ReturnedLogprobs],
                  table: dict[str, int] | None = None) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """(provider values, reference values, alternatives bounded) per completion: the claimed token's
    reference logprob is always returned; a provider alternative outside the reference's top-k gets
    the reference's k-th logprob, an upper bound of its own (module docstring)."""
    echoed = _echo(reference, [r.prompt_token_ids for r in returned], [r.token_ids for r in returned],
                   "logprobs of completion", table)
    theirs, ours, bounded = [], [], []
    for r, (own, tops) in zip(returned, echoed):
        a, b, outside = [], [], 0
        for (ids, lps), lp, top in zip(r.entries, own, tops):
            a += lps
            b.append(lp)
            floor = min(top.values(), default=lp)  # the reference's k-th logprob bounds every token outside its top-k
            for t in ids[1:]:
                b.append(top.get(t, floor))
                outside += t not in top
        theirs.append(np.array(a, dtype=np.float64))
        ours.append(np.array(b, dtype=np.float64))
        bounded.append(outside)
    return theirs, ours, bounded
