"""Returned top-k logprobs against the reference's, for providers without seeds or token ids (LOGIC).

A provider asked for ``logprobs`` returns, at each output position, the sampled token's logprob
and its top-k alternatives, as token strings. The reference recomputes the log-softmax of its raw
logits (vLLM's default, which is what OpenAI-compatible servers return) at the same positions, for
the same tokens; the claimed token's own logprob is always among them, so every position has a
value even when the provider's top-k and the reference's disagree. The two samples of values (the
provider's, the reference's) are compared by SciPy's two-sample Kolmogorov-Smirnov test on
doubling prefixes of prompts (``verinfer.stats.verdict``). An honest provider returns the
reference's values up to numerical noise; another model returns its own, which for its own top
tokens are systematically higher than the reference's.

Token strings are mapped to ids with the reference tokenizer (``token_table``): a claimed token
whose string more than one id decodes to (an incomplete UTF-8 byte, say), or none does, ends the
sequence there, and the positions lost are counted; such alternatives are skipped. The KS p-value treats values as independent, which positions of
one sequence are not; under the null the two samples are nearly identical, so the test is
conservative there, but it is a comparison baseline rather than an exact test.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from scipy.stats import ks_2samp

from verinfer.auditing.client import ProviderError
from verinfer.auditing.rank import rank_looks
from verinfer.stats.verdict import Verdict, doubling_looks, sequential


@dataclass
class ReturnedLogprobs:
    """One completion's returned logprobs: the claimed ids and, per position, (ids, logprobs)."""

    prompt_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    entries: list[tuple[list[int], list[float]]]  # per position: claimed token first, then the top-k
    unmapped: int  # positions dropped because a token string did not map to one id


def token_table(tokenizer) -> dict[str, int]:
    """Token string -> id for strings exactly one id decodes to."""
    seen: dict[str, int] = {}
    twice: set[str] = set()
    for i in range(len(tokenizer)):
        s = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if s in seen:
            twice.add(s)
        seen[s] = i
    return {s: i for s, i in seen.items() if s not in twice}


def _positions(logprobs: Any, where: str) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token, logprob, [(top token, logprob)]) per position, from the chat or the completions format."""
    bad = ProviderError(f"{where}: 'logprobs' is missing or malformed (ask a provider that returns top logprobs)")
    if not isinstance(logprobs, dict):
        raise bad
    out = []
    try:
        if isinstance(logprobs.get("content"), list):  # chat
            for e in logprobs["content"]:
                out.append((e["token"], float(e["logprob"]), [(t["token"], float(t["logprob"]))
                                                              for t in e.get("top_logprobs") or []]))
        else:  # completions
            for tok, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
                out.append((tok, float(lp), [(t, float(v)) for t, v in (top or {}).items()]))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise bad from None
    return out


def parse_returned(record: dict, choice: int, table: dict[str, int], prompt_id: str,
                   prompt_token_ids: list[int], where: str) -> ReturnedLogprobs:
    """A stored response's returned logprobs, mapped to reference token ids."""
    c = record["response"]["choices"][choice]
    positions = _positions(c.get("logprobs"), where)
    ids, entries = [], []
    for k, (tok, lp, top) in enumerate(positions):
        if tok not in table:  # the claimed token is needed for every later position: stop here
            return ReturnedLogprobs(prompt_id, prompt_token_ids, ids, entries, len(positions) - k)
        ids.append(table[tok])
        others = [(table[t], v) for t, v in top if t in table and table[t] != table[tok]]  # ambiguous ones skipped
        entries.append(([table[tok]] + [i for i, _ in others], [lp] + [v for _, v in others]))
    return ReturnedLogprobs(prompt_id, prompt_token_ids, ids, entries, 0)


class ReferenceValues:
    """The reference's raw log-softmax at each returned position for each returned token, filled from
    prefill blocks (``add``): of the returned completions themselves (``reference_values``), or of
    another scoring's prefill of the same sequences (``auditing.auto``: surprise's), so that the
    logprobs test costs no prefill of its own."""

    def __init__(self, returned: Sequence[ReturnedLogprobs]):
        self.returned = returned
        self.out: list[list] = [[None] * len(r.token_ids) for r in returned]

    @torch.inference_mode()
    def add(self, block, which: Sequence[int | None]) -> None:
        """Values from ``block``, whose sequence ``j`` is prompt + a continuation of returned completion
        ``which[j]`` (None: no returned completion), positions past the returned ones ignored."""
        lp = torch.log_softmax(block.logits.float(), dim=-1)
        for row, (item, step) in enumerate(zip(block.items.tolist(), block.steps.tolist())):
            i = which[item]
            if i is not None and step < len(self.out[i]):
                self.out[i][step] = lp[row, self.returned[i].entries[step][0]].double().numpy()

    def missing(self) -> list[int]:
        """The returned completions with a position no block has filled."""
        return [i for i, o in enumerate(self.out) if any(v is None for v in o)]

    def values(self) -> list[np.ndarray]:
        return [np.concatenate(o) if o else np.zeros(0) for o in self.out]


def reference_values(backend, returned: Sequence[ReturnedLogprobs], sink: ReferenceValues | None = None
                     ) -> list[np.ndarray]:
    """The reference's raw log-softmax at each returned position for each returned token: one prefill
    of the completions ``sink`` (already partly filled, if given) lacks."""
    sink = sink or ReferenceValues(returned)
    keep = [i for i in sink.missing() if returned[i].token_ids]
    for block in backend.prefill([returned[i].prompt_token_ids + returned[i].token_ids for i in keep],
                                 [len(returned[i].prompt_token_ids) for i in keep]):
        sink.add(block, keep)
    return sink.values()


@torch.inference_mode()
def returned_logprobs(built, prompt_ids: list[list[int]], outputs: list[list[int]],
                      seen_ids: list[list[int]], top: int = 5) -> list[ReturnedLogprobs]:
    """What a provider running ``built`` returns with ``top_logprobs``: per position, the sampled token's
    raw log-softmax and its top alternatives (from a prefill of its own model over the prompt it saw,
    ``seen_ids``, and its own output), reported against the client's ``prompt_ids``."""
    entries: list[list] = [[None] * len(o) for o in outputs]
    for block in built.prefill([p + o for p, o in zip(seen_ids, outputs)], [len(p) for p in seen_ids]):
        lp = torch.log_softmax(block.logits.float(), dim=-1)
        best = lp.topk(top, dim=-1).indices
        for row, (i, step) in enumerate(zip(block.items.tolist(), block.steps.tolist())):
            ids = [outputs[i][step]] + [t for t in best[row].tolist() if t != outputs[i][step]]
            entries[i][step] = (ids, lp[row, ids].tolist())
    return [ReturnedLogprobs(str(i), p, o, e, 0) for i, (p, o, e) in enumerate(zip(prompt_ids, outputs, entries))]


def provider_values(returned: Sequence[ReturnedLogprobs]) -> list[np.ndarray]:
    return [np.array([v for _, lps in r.entries for v in lps], dtype=np.float64) for r in returned]


GAP_STATISTIC = "mean clipped logprob gap"
GAP_PROFILE = "torch-exponential"  # gap bands name no engine: which sampler drew a token does not change its logprob


def gap_signature(params) -> dict:
    """The sampling signature logprob-gap bands are built for and found by: the claimed temperature and
    filters (which tokens get sampled), any engine (``GAP_PROFILE``)."""
    return params.with_(profile=GAP_PROFILE, seed=None).signature()
AGREE = 1e-4  # nats: a position whose returned values all lie this close to the reference's agrees


def position_gaps(returned: Sequence[ReturnedLogprobs], theirs: Sequence[np.ndarray],
                  ours: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per completion, per position: the mean ``|provider - reference|`` over the position's returned
    values (the sampled token's and its alternatives'), each pair the same token at the same position.

    The pairing is what an unpaired comparison of the two sets of values throws away: another model,
    a hidden system prompt or other weights move each value a little, in both directions, which
    leaves the two sets alike while every pair differs (issue #42: 0.28 nats per token against
    5e-6 for an honest fp32 server, and the KS test passed it)."""
    out = []
    for r, a, b in zip(returned, theirs, ours):
        d, k, g = np.abs(np.asarray(a) - np.asarray(b)), 0, []
        for ids, _ in r.entries:
            g.append(float(d[k:k + len(ids)].mean()))
            k += len(ids)
        out.append(np.array(g))
    return out


def gap_rows(gaps: Sequence[np.ndarray], clip: float) -> np.ndarray:
    """Per completion ``[positions, sum of gaps clipped at clip, positions agreeing within AGREE]``: the
    rows pooled verdicts and bands resample (``stats.verdict.pooled_verdict``)."""
    return np.array([[g.size, float(np.minimum(g, clip).sum()), float((g <= AGREE).sum())] for g in gaps],
                    dtype=np.float64).reshape(-1, 3)


def logprob_verdict(provider: Sequence[np.ndarray], reference: Sequence[np.ndarray], tokens: np.ndarray,
                    alpha: float = 0.01) -> Verdict:
    """Sequential two-sample KS verdict on per-prompt paired logprob values (LOGIC)."""
    if len(provider) < 2:
        raise ValueError(f"a logprobs audit needs at least 2 prompts, got {len(provider)}")
    looks = rank_looks(len(provider))

    def p_at(k: int) -> float:
        a, b = np.concatenate(provider[:k]), np.concatenate(reference[:k])
        if not (a.size and b.size):
            return 1.0
        with warnings.catch_warnings():  # scipy falls back to the asymptotic p-value itself and says so
            warnings.filterwarnings("ignore", message="ks_2samp: Exact calculation unsuccessful")
            return float(ks_2samp(a, b).pvalue)

    p, first = sequential(p_at, looks, alpha)
    a, b = np.concatenate(provider), np.concatenate(reference)
    diff = float(np.mean(np.abs(a - b))) if a.size else 0.0
    method = (f"sequential two-sample Kolmogorov-Smirnov test ({doubling_looks(len(looks))} of prompts, Bonferroni) "
              f"of the provider's returned logprobs against the reference's at the same positions and tokens "
              f"({a.size} values; LOGIC)")
    return Verdict(p >= alpha, p, alpha, int(tokens.sum()), len(provider), "sequence", diff,
                   "mean |provider - reference| logprob", diff, diff, len(looks),
                   None if first is None else int(tokens[:first].sum()), method, sequences=len(provider),
                   interval=False)
