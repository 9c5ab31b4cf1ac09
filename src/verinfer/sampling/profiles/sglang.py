"""SGLang's seeded sampler (deterministic inference, ``sampling_seed``), SGLang 0.5.23.

Facts read in the sglang 0.5.23 wheel (``sglang/srt/layers/sampler.py``, ``sglang/srt/sampling/
sampling_batch_info.py`` and ``sampling_params.py``, ``sglang/kernels/ops/sampling/murmur_hash.py``,
``sglang/srt/model_executor/model_runner.py``):

- Seeds exist only with ``--enable-deterministic-inference``; a request without ``sampling_seed``
  then gets **42** (``SamplingBatchInfo.from_schedule_batch``). Seeds are int64, hashed as
  ``seed.to(uint64)`` (two's complement).
- ``pos`` is the 0-based position of the last input token: ``seq_lens - 1`` at prefill, the decode
  token's position after (``ModelRunner.sample``): output token k of a prompt of length L uses
  ``L - 1 + k``, as in vLLM.
- Hash (``murmur_hash32_kernel``): MurmurHash3_x86_32 of ``[seed_lo, seed_hi, pos, col]`` with hash
  seed 0 and length 16: the same message as vLLM's V2 sampler (``murmur3.py``).
- Noise (``multinomial_with_seed``): ``u = h / (2**32 - 1)`` in fp64 (so ``u`` is in [0, 1], both
  ends reachable), ``L = clamp(log u, min=finfo(f64).min, max=-2**-32)``, ``G = -log(-L)``: G lies
  in [-709.8, 22.18] (the cap turns ``h = 2**32 - 1`` into ``-log(2**-32)`` instead of +inf).
  The token is ``argmax(logprobs_f64 + G)``, first index on ties.
- Order (``Sampler.forward``, ``_sample_from_probs``): ``logits / T`` -> ``softmax`` (fp32) ->
  * no top-k/top-p/min-p in the **whole batch** (``simple_sampling_case``;
    ``need_top_k_sampling = any(top_k != TOP_K_ALL)`` etc. are batch-wide): ``sampling_from_probs_torch``
    hashes **token ids** as ``col`` and scores ``log(probs)`` (fp32 log, then fp64).
  * otherwise (``top_k_top_p_min_p_sampling_from_probs_torch``, sampling backend ``pytorch``; the
    ``flashinfer`` backend asserts that no seed is set): probs sorted descending (full sort),
    ``cumsum`` taken **before** top-k masking, rank ``>= top_k`` masked, then ``cumsum - p > top_p``
    masked (top-p measured on the full, un-renormalized distribution), ``log`` in fp64 of the fp32
    probs, and the hash column is the **sorted rank**, mapped back through the sort's indices.
    In such a batch, a request without filters also gets rank columns: ``sampling.stream``
    ``{"sorted": true|false}`` records which path the batch took (default: sorted iff this request
    uses top-k or top-p).
- ``min_p`` with a seed is refused by SGLang itself (an assertion in the torch path); T below 1e-6
  becomes greedy (``top_k = 1``); T is not clamped.

Replay: the kept set is SGLang's (``kept_set`` below: rank < top_k and full-vocabulary mass before
the token <= top_p, in fp32), scores are ``x + G`` in fp64 (the engine's ``log(p)`` differs by a
per-row constant and fp32 rounding), and the rank of a token is its place in a stable descending
sort of the fp32 softmax (ties, which SGLang's GPU radix sort also orders by index, are rare).
The filters need ``Profile.kept_set`` to be honoured by the sampler.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from verinfer.sampling import murmur3
from verinfer.sampling.filters import kept_set as shared_kept_set, row_count
from verinfer.sampling.params import MIN_TEMPERATURE
from verinfer.sampling.profiles.base import Profile, reach

DEFAULT_SEED = 42
UINT32_MAX = 2**32 - 1
LOG_CAP = -(2.0**-32)
MAX_GUMBEL = 22.19  # -log(2**-32) = 22.18, rounded up
_RANKS = "_sglang_ranks"  # attribute carrying the rank map on a kept set built here


def gumbel_from_hash(h: np.ndarray) -> np.ndarray:
    """SGLang's fp64 noise from uint32 hashes: ``-log(-clamp(log(h / (2**32 - 1)), f64 min, -2**-32))``."""
    u = np.asarray(h, dtype=np.float64) / UINT32_MAX
    with np.errstate(divide="ignore"):
        log_u = np.log(u)
    log_u = np.clip(log_u, np.finfo(np.float64).min, LOG_CAP)
    return -np.log(-log_u)


def hashes(seeds, positions, rows: np.ndarray, cols: np.ndarray, vocab_size: int) -> np.ndarray:
    """MurmurHash3 of ``[seed_lo, seed_hi, pos, col]`` for (row, col) pairs, as uint32 (``murmur3.py``)."""
    state = murmur3.prefix_ints(seeds, np.asarray(positions, dtype=np.int64))
    return murmur3.hash_pairs_np(state, rows, cols, vocab_size)


def uses_sorted_path(params) -> bool:
    """Whether the request's batch took SGLang's sorted (rank-column) path."""
    stream = params.stream or {}
    if "sorted" in stream:
        return bool(stream["sorted"])
    return (0 < params.top_k) or params.top_p < 1


def sorted_probs(x: torch.Tensor):
    """SGLang's sort of ``softmax(x)`` (fp32, descending, ties by id): (values, indices), each [N, V].
    One sort serves both the keep counts and the rank columns of a row (it is the replay's costliest step)."""
    return torch.softmax(x.float(), dim=-1).sort(dim=-1, descending=True, stable=True)


def sorted_ranks(x: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's place in SGLang's sort of ``softmax(x)`` [N, V] int64 (``order``: that sort's indices)."""
    order = sorted_probs(x).indices if order is None else order
    ranks = torch.arange(x.shape[1], device=x.device).expand_as(order).contiguous()
    return torch.empty_like(order).scatter_(1, order, ranks)


def sglang_keep_counts(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       sorted_p: torch.Tensor | None = None) -> torch.Tensor:
    """How many tokens SGLang's filters keep per row of scaled logits ``x`` [N, V] (``sorted_p``:
    ``sorted_probs(x).values`` when already at hand).

    Stable descending sort of ``softmax(x)`` (fp32), cumulative sum before top-k masking, keep
    rank < top_k and ``cumsum - p <= top_p`` (a prefix of the sorted row).
    """
    vocab = x.shape[1]
    sorted_p = sorted_probs(x).values if sorted_p is None else sorted_p
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    keep = (torch.arange(vocab, device=x.device)[None, :] < k[:, None]) & ~(mass_before > top_p.float()[:, None])
    keep[:, 0] = True
    return row_count(keep)


class SglangProfile(Profile):
    name = "sglang"
    position_keyed = True
    description = "SGLang 0.5.23 deterministic sampling: Murmur3 Gumbel, u = h/(2^32-1); sorted-rank columns with filters"

    def kept_set(self, x, top_k, top_p, min_p):
        """SGLang's kept set in the shared threshold form (a prefix of the sorted row: top-k = its size)."""
        vocab = x.shape[1]
        filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
        k_eff = torch.zeros_like(top_k)  # 0: no filter
        idx = filtered.nonzero().squeeze(1)
        ranks: dict[int, torch.Tensor] = {}
        if idx.numel():
            xs = x[idx]
            order = sorted_probs(xs)  # one sort per row: its keep count here, its rank columns for the noise
            k_eff[idx] = sglang_keep_counts(xs, top_k[idx], top_p[idx], order.values).to(k_eff.dtype)
            ranks = dict(zip(idx.tolist(), sorted_ranks(xs, order.indices)))
        # base_norm: not over the claimed min-p and top-k's tokens here (k_eff folds top-p in)
        kept = replace(shared_kept_set(x, k_eff, torch.ones_like(top_p), torch.zeros_like(min_p)), base_norm=None)
        object.__setattr__(kept, _RANKS, {"x": x, "rows": ranks})  # KeptSet is frozen; other rows' ranks lazily
        return kept

    def gumbel_cols(self, keys, rows, cols, kept) -> torch.Tensor:
        """The hashed column of each pair: the token id, or its sorted rank on the sorted path."""
        sorted_rows = torch.tensor([uses_sorted_path(p) for p in keys.params], dtype=torch.bool,
                                   device=rows.device)
        out = cols.clone()
        pick = sorted_rows[rows]
        if bool(pick.any()):
            cache = getattr(kept, _RANKS, None)
            if cache is None:
                raise RuntimeError("profile 'sglang' with top-k/top-p needs its own kept_set (ranks); "
                                   "the sampler did not call Profile.kept_set")
            need = [r for r in torch.unique(rows[pick]).tolist() if r not in cache["rows"]]
            if need:
                for r, rank in zip(need, sorted_ranks(cache["x"][torch.tensor(need, device=cache["x"].device)])):
                    cache["rows"][r] = rank
            uniq = torch.unique(rows[pick])
            table = torch.stack([cache["rows"][r] for r in uniq.tolist()])
            out[pick] = table[torch.searchsorted(uniq, rows[pick]), cols[pick]]
        return out

    def noised(self, keys, rows, cols, x, vocab_size, kept=None):
        hcols = self.gumbel_cols(keys, rows.cpu(), cols.cpu(), kept)
        h = hashes(keys.seeds, keys.positions, rows.cpu().numpy(), hcols.numpy(), vocab_size)
        return x.double() + torch.from_numpy(gumbel_from_hash(h)).to(x.device)

    def gumbel(self, keys, rows, cols, vocab_size):
        """Noise by token id (the unfiltered path); rank columns need ``noised`` with a kept set."""
        return torch.from_numpy(gumbel_from_hash(hashes(keys.seeds, keys.positions, rows.cpu().numpy(),
                                                        cols.cpu().numpy(), vocab_size)))

    def noised_dense_above(self, keys, rows, x, threshold, floor, kept=None):
        """Whole rows of the unsorted (no-filter) path on the CPU: hash every token (integer work), then
        logarithms only for tokens whose ``u`` lets them reach the floor: ``G <= -log(-log u) <=
        -log(1 - u)``, so ``G >= floor - x`` needs ``(2**32 - 1 - h) <= (2**32 - 1) exp(x - floor)``, one
        fp32 ``exp`` per token (``base.reach``, with a margin for fp32 rounding; a few more
        tokens are kept and scored exactly). Rows on the sorted path hash ranks, not ids: they take
        the generic bound."""
        on_sorted = any(uses_sorted_path(keys.params[r]) for r in rows.tolist()) if keys.params else False
        if x.device.type != "cpu" or on_sorted:
            return super().noised_dense_above(keys, rows, x, threshold, floor, kept)
        state = murmur3.prefix_ints(keys.seeds, np.asarray(keys.positions, dtype=np.int64))
        words = murmur3.token_words(x.shape[1])
        out_r, out_c, out_s = [], [], []
        for i, r in enumerate(rows.tolist()):
            xr = x[i].numpy()
            h = murmur3.finish_np(state[r], words)
            gap = (np.uint32(UINT32_MAX) - h).astype(np.float32)  # (1 - u) (2**32 - 1)
            cols = np.flatnonzero((xr >= threshold[i].item()) & (gap <= reach(xr, floor[i]) * np.float32(UINT32_MAX)))
            out_r.append(np.full(cols.size, i))
            out_c.append(cols)
            out_s.append(xr[cols].astype(np.float64) + gumbel_from_hash(h[cols]))
        cat = lambda parts, dtype: torch.from_numpy(np.concatenate(parts).astype(dtype))  # noqa: E731
        return cat(out_r, np.int64), cat(out_c, np.int64), cat(out_s, np.float64)

    def noise_bound(self, keys):
        return torch.full((len(keys.requests),), MAX_GUMBEL, dtype=torch.float64, device="cpu")

    def problems(self, params):
        out = []
        if params.fp64_gumbel:
            out.append("fp64_gumbel is a vLLM option; profile 'sglang' has no fp64 mode")
        if params.min_p > 0:
            out.append("min_p: SGLang refuses min-p sampling with a sampling seed")
        if 0 < params.temperature < MIN_TEMPERATURE and not params.is_greedy:
            out.append(f"temperature {params.temperature} < {MIN_TEMPERATURE}: SGLang does not clamp it")
        stream = params.stream
        if stream is not None:
            unknown = sorted(set(stream) - {"sorted"})
            if unknown:
                out.append(f"stream: unknown field(s) for profile 'sglang': {', '.join(unknown)}")
            if "sorted" in stream and not isinstance(stream["sorted"], bool):
                out.append(f"stream.sorted must be true or false, got {stream['sorted']!r}")
            if stream.get("sorted") is False and ((0 < params.top_k) or params.top_p < 1):
                out.append("stream.sorted is false but the request uses top-k/top-p (SGLang sorts then)")
        return out
