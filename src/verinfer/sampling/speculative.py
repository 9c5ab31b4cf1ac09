"""vLLM's speculative-decoding sampler (model runner V2, vLLM 0.32), replayed exactly.

Follows ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py`` (``rejection_sample``: the
stats, rejection, resample and insert kernels) and ``sample/gumbel.py`` of vLLM 0.32.0, the
standard rejection rule of Leviathan et al. (2023) / Chen et al. (2023):

- **Draft.** The draft model proposes ``k`` tokens one by one, each the Gumbel argmax of its logits
  divided by the temperature (no top-k/top-p/min-p: vLLM's drafter ignores them), with the Murmur3
  noise of the ``vllm`` profile at ``pos + 2**30`` (``_DRAFT_NOISE_SALT``). The logits row that
  proposes draft ``j`` is the one at position ``pos0 + j`` (``pos0``: position of the block's first
  input token, i.e. the last accepted token): a draw is keyed by the position of the input token
  whose logits it samples (``spec_decode/standalone_ar/speculator.py``, the draft-model speculator:
  ``positions`` of the last token, then ``+ 1`` per step).
- **Acceptance.** Target row ``j`` (processed: temperature, min-p, top-k/top-p applied, filtered
  tokens ``-inf``) accepts draft ``d_j`` iff ``log p(d_j) > log u_j + log q(d_j)`` in fp32, with
  ``u_j = tl_rand32(seed, pos0 + j)`` (Triton Philox, ``sampling/philox.py``), ``p`` the target's and
  ``q`` the draft's (tempered, unfiltered) softmax; both log-normalisers are computed as the kernel
  does, per 8,192-token block. The first rejection ends the block. Greedy (T = 0): accept iff the
  draft is the target's argmax. A draft of ``-1`` (placeholder) ends the block unverified.
- **Resample / bonus.** The block's last token is drawn at the first rejected row ``a`` (or at row
  ``k``, the bonus, when all drafts pass) as the Gumbel argmax, with the target's own noise at
  ``pos0 + a`` (no salt), of the residual ``log max(p - q, 0)`` computed as
  ``log p + log1p(-exp(log q - log p))`` where ``q < p`` and ``-inf`` elsewhere; for a one-hot draft
  (n-gram) the residual is the target with the rejected token removed; for the bonus it is the
  target's processed logits themselves, so a bonus token is exactly what plain sampling would
  emit. Greedy rows emit the target argmax. fp32 noise, or fp64 with ``use_fp64_gumbel``.

Checked token for token against vLLM's own kernels run in Triton's interpreter
(``tests/test_vllm_spec_kernel.py``, fixture recorded by ``engines/vllm_cpu/spec_fixtures.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from verinfer.sampling import philox
from verinfer.sampling.filters import kept_set
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles.base import RowKeys
from verinfer.sampling.profiles.vllm import VllmProfile

STATS_BLOCK = 8192  # rejection_sample's VOCAB_BLOCK_SIZE: block-wise max / sum of exponentials
_F = np.float32
MODES = {"a": "accepted draft", "r": "resampled after a rejection", "b": "bonus (every draft accepted)"}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_logsumexp(x: np.ndarray) -> np.float32:
    """fp32 log-sum-exp of a row as the kernel computes it: per 8,192-lane block (padded with
    ``-inf``) the max and ``sum(exp(x - max))``, then ``max + log(sum(s_b * exp(m_b - max)))``."""
    x = np.asarray(x, dtype=_F)
    n_blocks = -(-x.size // STATS_BLOCK)
    padded = np.full(n_blocks * STATS_BLOCK, -np.inf, dtype=_F)
    padded[: x.size] = x
    blocks = padded.reshape(n_blocks, STATS_BLOCK)
    maxes = blocks.max(axis=1)
    with np.errstate(invalid="ignore"):
        sums = np.array([np.sum(np.exp(b - m)) if m > -np.inf else _F(0) for b, m in zip(blocks, maxes)], dtype=_F)
    width = _next_pow2(n_blocks)
    m_all = np.full(width, -np.inf, dtype=_F)
    s_all = np.zeros(width, dtype=_F)
    m_all[:n_blocks], s_all[:n_blocks] = maxes, sums
    top = m_all.max()
    with np.errstate(invalid="ignore", divide="ignore"):
        return _F(top + np.log(np.sum(s_all * np.exp(m_all - top))))


def draft_scaled(draft_row: np.ndarray, temperature: float) -> np.ndarray:
    """The draft's tempered logits (``draft_logits / temp`` in fp32; the cache holds them untempered)."""
    return np.asarray(draft_row, dtype=_F) / _F(temperature)


def row_normalizers(target_row: np.ndarray, draft_row: np.ndarray | None, temperature: float):
    """(target, tempered draft) log-normalizers of one row, computed once for every test at the row."""
    return (block_logsumexp(target_row),
            None if draft_row is None else block_logsumexp(draft_scaled(draft_row, temperature)))


def acceptance_slack(target_row: np.ndarray, draft_row: np.ndarray | None, token: int, seed: int, pos: int,
                     temperature: float, norms=None) -> float:
    """``log p(d) - (log u + log q(d))`` in fp32: the draft ``d`` is accepted iff this is > 0.

    ``target_row``: processed target logits; ``draft_row``: raw draft logits (None: one-hot draft);
    ``norms``: the row's ``row_normalizers`` when the caller has them.
    """
    t_lse, d_lse = norms or row_normalizers(target_row, draft_row, temperature)
    t = np.asarray(target_row, dtype=_F)
    target_lp = t[token] - t_lse
    if draft_row is None:
        draft_lp = _F(0)
    else:
        d = draft_scaled(draft_row, temperature)
        draft_lp = d[token] - d_lse
    u = philox.tl_rand32([seed], np.array([pos], dtype=np.int64))[0]
    return float(_F(target_lp) - (np.log(u) + _F(draft_lp)))


def residual_logits(target_row: np.ndarray, draft_row: np.ndarray | None, rejected: int,
                    temperature: float, norms=None) -> np.ndarray:
    """fp32 logits of the residual ``max(p - q, 0)`` the rejected row resamples from."""
    t = np.asarray(target_row, dtype=_F)
    if draft_row is None:  # one-hot draft: the target without the rejected token
        out = t.copy()
        out[rejected] = -np.inf
        return out
    t_lse, d_lse = norms or row_normalizers(target_row, draft_row, temperature)
    d = draft_scaled(draft_row, temperature)
    t_lp = t - t_lse
    d_lp = d - d_lse
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ratio = np.exp(d_lp - t_lp)
        return np.where(ratio < 1, t_lp + np.log1p(-ratio), -np.inf).astype(_F)


def noised_row(x: np.ndarray, seed: int, pos: int, fp64: bool = False, draft: bool = False) -> np.ndarray:
    """``x + G`` for every token of one row with vLLM's Murmur3 noise at ``pos`` (salted when
    ``draft``), added in the engine's precision (fp32, or fp64 with ``fp64``); returned as fp64."""
    keys = RowKeys(requests=("row",), seeds=np.array([seed], dtype=object), positions=np.array([pos], dtype=np.int64),
                   steps=np.zeros(1, dtype=np.int64), params=(SamplingParams(fp64_gumbel=fp64),))
    n = len(x)
    return VllmProfile(draft=draft).noised(keys, torch.zeros(n, dtype=torch.int64), torch.arange(n),
                                           torch.from_numpy(np.asarray(x, dtype=_F).astype(np.float64)), n).numpy()


def first_argmax(scores: np.ndarray) -> int:
    """Index of the maximum, the first on ties (the kernels' block-then-global argmax)."""
    return int(np.argmax(scores))


def is_speculative(params: SamplingParams) -> bool:
    """Traces that need the speculative replay (greedy speculative decoding is plain greedy)."""
    return bool(params.speculative) and not params.is_greedy


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's logits as vLLM's rejection sampler sees them: fp32, divided by the temperature,
    filtered tokens (min-p, top-k, top-p) set to ``-inf``; greedy rows stay raw."""
    x = logits.float()
    if params.is_greedy:
        return x
    n = x.shape[0]
    x = x / torch.full((n, 1), params.effective_temperature)  # elementwise fp32 division, as the sampler does
    kept = kept_set(x, torch.full((n,), params.top_k), torch.full((n,), params.top_p, dtype=torch.float32),
                    torch.full((n,), params.min_p, dtype=torch.float32))
    if bool(torch.isfinite(kept.threshold).any()):
        x = x.masked_fill(x < kept.threshold[:, None], float("-inf"))
    return x


def draft_proposal(draft_row: np.ndarray, params: SamplingParams, pos: int) -> int:
    """The draft model's token for logits at ``pos``: its argmax (greedy) or the Gumbel argmax of
    ``logits / T`` with the draft's salted noise (no filters: vLLM's drafter ignores them)."""
    if params.is_greedy:
        return first_argmax(draft_row)
    x = draft_scaled(draft_row, params.effective_temperature)
    return first_argmax(noised_row(x, params.seed, pos, params.fp64_gumbel, draft=True))


@dataclass(frozen=True)
class SpecBlock:
    """One verification step of one request: the emitted tokens and how many drafts passed."""

    tokens: list[int]
    num_accepted: int
    bonus: bool = False  # every draft passed: the last token was drawn at row k

    @property
    def modes(self) -> str:
        """Per emitted token: ``a`` accepted draft, then ``r`` (resampled) or ``b`` (bonus)."""
        return "a" * self.num_accepted + ("b" if self.bonus else "r")


def rejection_sample(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, draft_tokens: Sequence[int], *,
                     seed: int, pos0: int, temperature: float, fp64: bool = False) -> SpecBlock:
    """vLLM's ``rejection_sample`` for one request.

    ``target_logits`` [k+1, V]: processed target logits (temperature and filters applied, filtered
    tokens ``-inf``) of rows ``pos0 .. pos0 + k``; ``draft_logits`` [k, V]: the draft's raw logits
    (None for a one-hot draft); ``draft_tokens``: the k proposals (``-1``: placeholder).
    """
    target = target_logits.float().numpy()
    draft = None if draft_logits is None else draft_logits.float().numpy()
    k = len(draft_tokens)
    greedy = temperature == 0.0
    emitted: list[int] = []
    accepted = 0
    for i, d in enumerate(draft_tokens):
        if greedy:
            top = first_argmax(target[i])
            ok = d >= 0 and d == top
            emitted.append(int(d) if ok else top)
            if not ok:
                return SpecBlock(emitted, accepted)
            accepted += 1
            continue
        if d < 0 or acceptance_slack(target[i], None if draft is None else draft[i], int(d), seed, pos0 + i,
                                     temperature) <= 0:
            break
        emitted.append(int(d))
        accepted += 1
    a = accepted
    bonus = a == k
    if greedy:  # every draft matched: the bonus is the target's argmax at row k
        return SpecBlock(emitted + [first_argmax(target[k])], accepted, bonus=True)
    if bonus or draft_tokens[a] < 0:
        x = target[a]
    else:
        x = residual_logits(target[a], None if draft is None else draft[a], int(draft_tokens[a]), temperature)
    token = first_argmax(noised_row(x, seed, pos0 + a, fp64))
    return SpecBlock(emitted + [token], accepted, bonus=bonus)
