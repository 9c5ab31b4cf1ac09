"""Hugging Face transformers ``generate(do_sample=True)`` on CPU after ``torch.manual_seed(seed)``.

Facts (transformers 5.23.0, torch 2.13.0+cpu; read in the installed source and measured):

- Order (``transformers/generation/utils.py``, ``GenerationMixin._get_logits_processor``): logits
  of the last position cast to fp32 -> processors (repetition penalty, bad words, ...) -> warpers
  in this order: ``TemperatureLogitsWarper`` (only when ``temperature != 1.0``; ``scores / T``, no
  clamp), ``TopKLogitsWarper`` (``top_k != 0``: masks ``scores < topk(scores, k)[-1]``, so ties with
  the k-th value are kept), ``TopPLogitsWarper`` (``top_p < 1``: ascending sort, fp32 softmax
  cumsum, masks ``cumsum <= 1 - top_p``, the largest always kept), ``MinPLogitsWarper`` (``min_p``
  set: ``probs < min_p * max(probs)`` after top-k/top-p) -> ``softmax`` -> ``torch.multinomial(probs,
  1)`` (``_sample`` in the same file). Masked entries are ``-inf``.
- ``GenerationConfig._get_default_generation_params`` fills unset fields: ``top_k`` defaults to
  **50** with ``do_sample=True``. Pass ``top_k=0`` (and ``top_p=1.0``) for an unfiltered
  distribution; the bundled SmolLM2 model's generation config sets only bos/eos/pad ids.
- ``torch.multinomial(probs, 1)`` on CPU (``aten/src/ATen/native/Distributions.cpp``, the
  one-sample / no-replacement fast path) draws ``q = empty_like(probs).exponential_()`` from the
  generator for the **whole** ``[batch, vocab]`` tensor and returns ``argmax(probs / q)``: the
  exponential race, i.e. ``argmax(x + G)`` with ``G = -log q`` (REFERENCE.md 1.1). Checked here
  against ``torch.multinomial`` itself (tests). With no ``generator`` argument it uses the global
  CPU generator that ``torch.manual_seed(seed)`` seeds (MT19937); drawing ``[n, B, V]`` at once
  equals n successive ``[B, V]`` draws. Each fp32 ``q`` is ``-log1p(-u)`` of a 53-bit uniform
  ``u`` cast to fp32, so ``q >= 2**-53`` except ``u = 0`` exactly (probability ``2**-53``).
- The batch keeps its size until every row stops (finished rows sample padding), so output
  token k of batch row r uses block k, row r of the stream.

So the noise of a token depends on the trace's ``seed`` (the value given to
``torch.manual_seed`` right before ``generate``), the output index k, and three stream facts,
recorded in ``sampling.stream``:

    batch_size  rows in the ``generate`` call (B)
    row         this sequence's row in it (0-based)
    vocab       width of the sampled tensor (the model's logits width, V)

Limits: nothing else may draw from the global generator between ``manual_seed`` and the end of
``generate`` (dropout, another ``generate``); ``num_return_sequences > 1`` and beam sampling are
not modelled. ``min_p`` together with ``top_p`` is refused: transformers applies min-p after top-p,
the shared sampler before. Temperatures in (0, 0.01) are refused: transformers does not clamp them.
``argmax(p / q)`` is compared in fp32 by the engine and as ``x + G`` in fp64 here: they can differ
only on near-exact ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verinfer.sampling.params import MIN_TEMPERATURE
from verinfer.sampling.profiles.vllm_v1 import VllmV1Profile

STREAM_KEYS = ("batch_size", "row", "vocab")
# -log(2**-53) = 36.74: the largest G except the 2**-53 chance of q = 0 (G = inf) per entry.
MAX_GUMBEL = 36.75


def stream_problems(stream) -> list[str]:
    """What is missing or wrong in a transformers trace's ``stream`` (empty when usable)."""
    if not isinstance(stream, dict):
        return [f"stream: profile 'transformers' needs {{{', '.join(STREAM_KEYS)}}} (the generate call's "
                "batch size, the row, and the logits width), got none"]
    out = []
    unknown = sorted(set(stream) - set(STREAM_KEYS))
    if unknown:
        out.append(f"stream: unknown field(s) for profile 'transformers': {', '.join(unknown)}")
    for key in STREAM_KEYS:
        v = stream.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "row" else 1):
            out.append(f"stream.{key} must be a {'non-negative' if key == 'row' else 'positive'} integer, got {v!r}")
    if not out and stream["row"] >= stream["batch_size"]:
        out.append(f"stream.row must be < stream.batch_size, got row {stream['row']} of {stream['batch_size']}")
    return out


@dataclass
class TransformersProfile(VllmV1Profile):
    """Replays the global CPU generator of one ``generate`` call: the same CPU exponential race as vLLM
    V1's (``profiles/vllm_v1.py``: the generator's fp64 uniforms, ``q`` only where a token can win), with
    each step drawing the whole ``[batch, vocab]`` block. The traces of one call share its seed and so its
    blocks: each step's block is drawn once for all of them (``VllmV1Profile._draw``), not once a trace."""

    name = "transformers"
    aliases = ("hf-transformers",)
    description = "HF transformers generate(do_sample=True) on CPU: multinomial = exponential race over [batch, vocab]"

    def _layout(self, params, vocab_size):
        stream = params.stream
        if stream["vocab"] != vocab_size:
            raise ValueError(f"stream.vocab is {stream['vocab']} but the model's logits have {vocab_size} columns "
                             "(was the trace made with another model?)")
        return stream["batch_size"], stream["row"]

    def noise_bound(self, keys):
        return torch.full((len(keys.requests),), MAX_GUMBEL, dtype=torch.float64, device="cpu")

    def problems(self, params):
        out = stream_problems(params.stream)
        if params.fp64_gumbel:
            out.append("fp64_gumbel is a vLLM option; profile 'transformers' has no fp64 mode")
        if params.min_p > 0 and params.top_p < 1:
            out.append("min_p with top_p: transformers applies min-p after top-p, the shared sampler before")
        if 0 < params.temperature < MIN_TEMPERATURE and not params.is_greedy:
            out.append(f"temperature {params.temperature} < {MIN_TEMPERATURE}: transformers does not clamp it")
        return out
