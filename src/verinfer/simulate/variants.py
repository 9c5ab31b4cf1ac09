"""Configuration variants: honest noise sources and misconfigurations of a provider, by name.

A ``Variant`` says how a provider deviates from the reference configuration while still *claiming*
it. It can touch four things, each optional:

- the model (``transform``): a new ``Backend`` derived from the reference one. The reference is never
  modified: weights are copied when they change (bf16, w4, w8) and shared read-only when they do not
  (attention kernel, fp8 KV cache, which replace only module/config objects or the KV cache);
- the sampler (``sampling``): the parameters actually used, while traces record the claimed ones;
- the decode loop (``batch_size``, ``hook``): the generation batch (padding) and a per-step token hook
  (simulated sampler bugs);
- the prompt (``prompt``): the request the model really sees (a hidden system prompt), while traces
  record the claimed prompt.

``Variant.generate(reference, requests)`` runs a variant and returns traces that claim the honest
configuration (model id, sampling parameters and seeds of ``requests``, ``meta["dtype"]`` of the
reference) and record the truth in ``meta["variant"]`` and ``meta["variant_settings"]`` (plus
``meta["bug_steps"]`` and ``meta["bug_changed_steps"]`` for sampler bugs).

All variants live in one registry (``get_variant(name)``, ``list_variants()``). Besides the named
entries, parametric families are recognised (``batch-N``, ``wB-gG[-asym]``, ``temperature-X``,
``top-p-X``, ``top-k-K``, ``min-p-X``, ``bug-topK[-rateR]``) and names compose with ``+`` (``w4-g128+temperature-0.9`` is the
4-bit model sampling at T=0.9), which is how the cross-entropy-matching adversary
(``match_cross_entropy``) names what it found.

Semantics worth knowing:

- ``w4-*``/``w8``: round-to-nearest fake quantization (codes dequantized back to the compute dtype, as
  w4a16/w8a16 kernels do) of every ``nn.Linear`` in the decoder (q, k, v, o, gate, up, down). The
  embeddings and lm_head (tied in SmolLM2) stay at full precision, as bitsandbytes, GPTQ, AWQ and
  compressed-tensors w4a16 leave them by default. Groups run along the input dimension; a dimension
  that is not a multiple of the group size (576 = 4 x 128 + 64 in SmolLM2) ends in one shorter group.
  Symmetric: ``scale = amax / (2**(B-1) - 1)``, codes in ``[-2**(B-1), 2**(B-1) - 1]``. Asymmetric
  (``-asym``): min/max range widened to include 0, ``2**B - 1`` steps and an integer zero point.
- ``fp8-kv*``: keys and values are stored in the KV cache as ``torch.float8_e4m3fn`` (saturated at
  +-448) with a per-layer scale, and read back as ``fp8 * scale``. ``fp8-kv`` is vLLM's default for a
  checkpoint without KV scales (scale 1.0) and vLLM's read path: attention reads every key and value,
  including those of the chunk being computed, from the fp8 cache, so even the prompt pass changes.
  ``fp8-kv-tensor`` / ``fp8-kv-head`` calibrate the scale (``amax / 448``, per layer or per layer and
  KV head) on the prompt pass and freeze it (transformers' ``Fp8QuantizedLayer`` rule).
  ``fp8-kv-fresh`` lets each pass attend to its own fresh keys and values at full precision and to
  earlier tokens through the fp8 cache (as engines that attend before writing the cache do): the
  prompt pass, hence the first output token's logits, is bit-identical to the reference, while every
  decode step reads the prompt and earlier outputs from fp8, so decode logits differ.
  When ``hidden`` is called without a cache (a verifier-style prefill), the fp8 backend makes one, so
  its prefill goes through the same fp8 cache as its decode.
- ``bug-topK``: with probability ``rate`` (1% by default) per output token, decided by an RNG of its
  own keyed by (bug seed, request id, step), the sampler's token is replaced by one drawn uniformly from
  the top K raw logits (DiFR section 5.1). Independent of batching; the steps where it fired are
  recorded in ``meta["bug_steps"]``.
- ``wrong-seed``: samples with ``seed + 1_000_003`` while claiming ``seed``.
- ``system-prompt:TEXT``: TEXT injected as the first system message of a chat request
  (``verinfer.prompts.inject_system``, the rule ``verinfer serve --misconfig system-prompt:TEXT``
  uses), or its tokens plus a blank line prepended to a request without messages; the trace keeps
  the client's prompt ids.
- ``layers-N``: a smaller model of the same family, sharing the tokenizer: the claimed model's
  first N decoder layers with its own final norm and head (no second SmolLM2 size ships offline;
  a different family, e.g. Gemma-3-270M, has another tokenizer, so token-level audits cannot
  compare it with SmolLM2 at all).
- ``chat-template:NAME``: the request's messages rendered by another chat template than the claimed
  model's (``verinfer.chat_templates``: no template, another family's, ChatML without a default
  system message); the trace keeps the client's prompt ids.
- ``skip-layer-I``: a damaged model: the claimed model without its decoder layer I (0-based), the
  residual stream passing that layer unchanged (a layer lost in loading or by a pipeline stage).
- Speculative decoding (``simulate/speculative.py``): a request whose actual parameters carry
  ``speculative`` is decoded speculatively, with the draft derived from the claimed model (a
  misconfigured target still drafts with the claimed draft). ``spec-draft-only`` returns the draft's
  proposals unchecked (the cheap-model cheat), ``spec-top1`` accepts a draft iff it is the target's
  top-1 token, ``no-spec`` decodes plainly while claiming speculative decoding, and
  ``spec-undeclared`` speculates (``layers:28``, k = 4) while claiming plain decoding.
"""


from __future__ import annotations

import re
import zlib
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from verinfer.models.backend import Backend
from verinfer.models.derived import (
    draft_backend, with_attention, with_dtype, with_layers, with_quantized_weights, without_layer,
)
from verinfer.models.fp8_kv import Fp8KV, with_fp8_kv
from verinfer.chat_templates import TEMPLATES, rendered
from verinfer.prompts import Prompt, inject_system, render, system_prefix_ids
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.speculative import is_speculative
from verinfer.simulate.generate import Request, TokenHook, generate
from verinfer.simulate.speculative import generate_speculative
from verinfer.trace import Trace

WRONG_SEED_OFFSET = 1_000_003
UNDECLARED_SPEC = {"draft": "layers:28", "k": 4}

# --------------------------------------------------------------------------------------------------
# Sampler bug


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


class TopKUniformBug:
    """A sampler bug: with probability ``rate`` the emitted token is uniform among the top ``k`` logits.

    The decision and the pick come from an RNG keyed by (``seed``, request id, step), so they do not
    depend on batching and do not touch the sampler's own noise. ``events[request_id]`` lists
    ``(step, sampled, emitted)`` for every step where the bug fired (emitted may equal sampled).
    """

    def __init__(self, k: int, rate: float = 0.01, seed: int = 0):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not 0 <= rate <= 1:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.k, self.rate, self.seed = int(k), float(rate), int(seed)
        self.events: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        self.steps_seen = 0

    def _rng(self, request_id: str, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, _stable_hash(request_id), int(step)])

    def fires(self, request_id: str, step: int) -> bool:
        return bool(self._rng(request_id, step).random() < self.rate)

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor, requests: Sequence[Request], step: int):
        out = tokens.clone()
        self.steps_seen += len(requests)
        for j, req in enumerate(requests):
            rng = self._rng(req.id, step)
            if rng.random() >= self.rate:
                continue
            top = torch.topk(logits[j].float(), min(self.k, logits.shape[-1])).indices
            out[j] = top[int(rng.integers(top.numel()))]
            self.events[req.id].append((int(step), int(tokens[j]), int(out[j])))
        return out

    def trace_meta(self, request_id: str) -> dict[str, Any]:
        ev = self.events.get(request_id, [])
        return {"bug_steps": [s for s, _, _ in ev], "bug_changed_steps": [s for s, a, b in ev if a != b]}


# --------------------------------------------------------------------------------------------------
# Variants and their registry


@dataclass(frozen=True)
class Variant:
    """A named way to run the provider: see the module docstring."""

    name: str
    description: str
    honest: bool = False  # a benign noise source (True) or a misconfiguration (False)
    transform: Callable[[Backend], Backend] | None = None
    sampling: Callable[[SamplingParams], SamplingParams] | None = None
    batch_size: int | None = None
    hook: Callable[[], TokenHook] | None = None  # a factory: each run gets a fresh hook
    spec_rule: str | None = None  # speculative decoding's rule (simulate.speculative.RULES); None: honest
    prompt: Callable[[Backend, Request], Request] | None = None  # the request the model sees (claimed: the input)
    settings: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def build(self, reference: Backend) -> Backend:
        """The backend this variant generates with (the reference itself when the model is unchanged)."""
        return self.transform(reference) if self.transform else reference

    def actual_params(self, claimed: SamplingParams) -> SamplingParams:
        return self.sampling(claimed) if self.sampling else claimed

    def generate(self, reference: Backend, requests: Sequence[Request], max_new_tokens: int = 64,
                 batch_size: int = 8, backend: Backend | None = None,
                 on_batch: Callable[[int], None] | None = None, **generate_options: Any) -> list[Trace]:
        """Generate as this variant; traces claim ``reference``'s model and ``requests``' parameters.

        Pass ``backend`` (from ``build``) to reuse a built model across calls; ``generate_options``
        (``provider``, ``commits``) go to ``verinfer.simulate.generate.generate`` unchanged, so activation
        commits are built from the variant's own hidden states, as a misconfigured provider's would be.
        """
        backend = backend if backend is not None else self.build(reference)
        actual = [replace(r, params=self.actual_params(r.params)) for r in requests]
        if self.prompt is not None:
            actual = [self.prompt(backend, r) for r in actual]
        hook = self.hook() if self.hook else None
        if any(is_speculative(r.params) for r in actual):
            traces = self._generate_speculative(reference, backend, actual, max_new_tokens, on_batch)
        else:
            traces = generate(backend, actual, max_new_tokens, self.batch_size or batch_size, on_batch=on_batch,
                              token_hook=hook, **generate_options)
        for req, t in zip(requests, traces):
            t.prompt_token_ids = list(req.prompt_token_ids)  # the claim: what the client sent
            if not req.params.speculative:
                t.spec_modes = None  # the claim is plain decoding: a provider hiding speculation records none
            t.sampling = req.params.with_(stream=t.sampling.stream)  # the claim, where generate sampled it
            t.model = reference.model_id
            meta = {**(t.meta or {}), "dtype": reference.dtype_name, "variant": self.name}
            if self.settings:
                meta["variant_settings"] = dict(self.settings)
            if hook is not None and hasattr(hook, "trace_meta"):
                meta.update(hook.trace_meta(req.id))
            t.meta = meta
        return traces


    def _generate_speculative(self, reference: Backend, backend: Backend, actual: Sequence[Request],
                              max_new_tokens: int, on_batch) -> list[Trace]:
        if self.hook is not None:
            raise ValueError(f"variant {self.name}: token hooks are not supported with speculative decoding")
        drafts: dict[str, Backend] = {}
        traces = []
        for r in actual:
            if is_speculative(r.params):
                name = r.params.speculative["draft"]
                if name not in drafts:  # honest noise (bf16) reaches the draft too; a cheat drafts as claimed
                    drafts[name] = draft_backend(backend if self.honest else reference, name)
                traces += generate_speculative(backend, [r], max_new_tokens, draft=drafts[name],
                                               rule=self.spec_rule or "vllm")
            else:
                traces += generate(backend, [r], max_new_tokens, 1)
            if on_batch:
                on_batch(1)
        return traces


def compose(*variants: Variant) -> Variant:
    """Apply variants in order (model transforms, then sampling changes, hooks chained)."""
    if not variants:
        raise ValueError("compose needs at least one variant")
    if len(variants) == 1:
        return variants[0]
    transforms = [v.transform for v in variants if v.transform]
    samplings = [v.sampling for v in variants if v.sampling]
    hooks = [v.hook for v in variants if v.hook]
    prompts = [v.prompt for v in variants if v.prompt]

    def transform(b: Backend) -> Backend:
        for f in transforms:
            b = f(b)
        return b

    def sampling(p: SamplingParams) -> SamplingParams:
        for f in samplings:
            p = f(p)
        return p

    def prompt(b: Backend, r: Request) -> Request:
        for f in prompts:
            r = f(b, r)
        return r

    hook = None
    if len(hooks) == 1:
        hook = hooks[0]
    elif hooks:
        hook = lambda: _ChainedHook([h() for h in hooks])  # noqa: E731
    sizes = [v.batch_size for v in variants if v.batch_size]
    return Variant(
        name="+".join(v.name for v in variants),
        description="; ".join(v.description for v in variants),
        honest=all(v.honest for v in variants),
        transform=transform if transforms else None,
        sampling=sampling if samplings else None,
        batch_size=sizes[-1] if sizes else None,
        hook=hook,
        spec_rule=next((v.spec_rule for v in reversed(variants) if v.spec_rule), None),
        prompt=prompt if prompts else None,
        settings={k: v for var in variants for k, v in var.settings.items()},
    )


class _ChainedHook:
    def __init__(self, hooks):
        self.hooks = hooks

    def __call__(self, logits, tokens, requests, step):
        for h in self.hooks:
            tokens = h(logits, tokens, requests, step)
        return tokens

    def trace_meta(self, request_id):
        out: dict[str, Any] = {}
        for h in self.hooks:
            if hasattr(h, "trace_meta"):
                out.update(h.trace_meta(request_id))
        return out


# Builders for the parametric families (also used by the fixed entries below).

def batch_variant(n: int) -> Variant:
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    return Variant(f"batch-{n}", f"honest: generate in batches of {n} (left padding, shared KV cache)", True,
                   batch_size=n, settings={"batch_size": n})


def weight_quant_variant(bits: int, group_size: int | None, symmetric: bool = True) -> Variant:
    grouping = "per output channel" if group_size is None else f"groups of {group_size}"
    name = f"w{bits}-" + ("channel" if group_size is None else f"g{group_size}") + ("" if symmetric else "-asym")
    kind = "symmetric" if symmetric else "asymmetric"
    return Variant(
        name, f"{bits}-bit {kind} round-to-nearest decoder linear weights, {grouping} (embeddings/lm_head kept)",
        transform=lambda b: with_quantized_weights(b, bits, group_size, symmetric),
        settings={"weight_bits": bits, "group_size": group_size, "symmetric": symmetric},
    )


def fp8_kv_variant(scale: str = "unit", read_current: bool = True, name: str = "fp8-kv") -> Variant:
    spec = Fp8KV(scale, read_current)
    how = {"unit": "scale 1.0", "tensor": "per-layer amax scale", "head": "per-KV-head amax scale"}[scale]
    read = "all K/V read back from fp8 (vLLM)" if read_current else "current chunk's K/V fresh, earlier ones fp8"
    return Variant(name, f"KV cache stored as float8_e4m3fn, {how}; {read}",
                   transform=lambda b: with_fp8_kv(b, spec),
                   settings={"kv_cache_dtype": "float8_e4m3fn", "kv_scale": scale, "kv_read_current": read_current})


def temperature_variant(t: float) -> Variant:
    if not t > 0:
        raise ValueError(f"temperature must be > 0, got {t}")
    return Variant(f"temperature-{t:g}", f"samples at temperature {t:g} while claiming the requested one",
                   sampling=lambda p: p.with_(temperature=float(t)), settings={"temperature": float(t)})


def top_p_variant(p_: float) -> Variant:
    if not 0 < p_ <= 1:
        raise ValueError(f"top-p must be in (0, 1], got {p_}")
    return Variant(f"top-p-{p_:g}", f"samples with top-p {p_:g} while claiming the requested one",
                   sampling=lambda p: p.with_(top_p=float(p_)), settings={"top_p": float(p_)})


def top_k_variant(k: int) -> Variant:
    if k < 1:
        raise ValueError(f"top-k must be >= 1, got {k}")
    return Variant(f"top-k-{k}", f"samples with top-k {k} while claiming the requested one (an approximate or "
                   "misconfigured top-k)", sampling=lambda p: p.with_(top_k=int(k)), settings={"top_k": int(k)})


def min_p_variant(m: float) -> Variant:
    if not 0 <= m <= 1:
        raise ValueError(f"min-p must be in [0, 1], got {m}")
    return Variant(f"min-p-{m:g}", f"samples with min-p {m:g} while claiming the requested one",
                   sampling=lambda p: p.with_(min_p=float(m)), settings={"min_p": float(m)})


def bug_variant(k: int, rate: float = 0.01, seed: int = 0) -> Variant:
    suffix = "" if rate == 0.01 else f"-rate{rate:g}"
    return Variant(f"bug-top{k}{suffix}",
                   f"sampler bug: {rate:.3g} of tokens uniform among the top {k} logits (own seeded RNG)",
                   hook=lambda: TopKUniformBug(k, rate, seed),
                   settings={"bug_top_k": k, "bug_rate": rate, "bug_seed": seed})


def system_prompt_variant(text: str) -> Variant:
    if not text.strip():
        raise ValueError("system-prompt:TEXT needs a non-empty TEXT")

    def seen(backend: Backend, r: Request) -> Request:
        if r.messages:
            pairs = tuple((m["role"], m["content"]) for m in inject_system(r.messages, text))
            return replace(r, prompt_token_ids=tuple(render(backend.tokenizer, Prompt(r.id, pairs))))
        return replace(r, prompt_token_ids=tuple(system_prefix_ids(backend.tokenizer, text)) + r.prompt_token_ids)

    return Variant(f"system-prompt:{text}", f"a hidden system prompt: {text!r}", prompt=seen,
                   settings={"system_prompt": text})


def chat_template_variant(name: str) -> Variant:
    if name not in TEMPLATES:
        raise ValueError(f"chat-template:NAME: unknown template {name!r} (known: {', '.join(TEMPLATES)})")

    def seen(backend: Backend, r: Request) -> Request:
        if not r.messages:
            raise ValueError(f"chat-template:{name}: request {r.id!r} has no messages to render")
        return replace(r, prompt_token_ids=tuple(rendered(backend.tokenizer, r.messages, name)))

    return Variant(f"chat-template:{name}", f"the messages rendered by another chat template ({name}) than the "
                   "claimed model's", prompt=seen, settings={"chat_template": name})


def layers_variant(n: int) -> Variant:
    return Variant(f"layers-{n}", f"a smaller model of the same family: the claimed model's first {n} decoder "
                   "layers, its final norm and head (same tokenizer)", transform=lambda b: with_layers(b, n),
                   settings={"layers": n})


def skip_layer_variant(i: int) -> Variant:
    return Variant(f"skip-layer-{i}", f"a damaged model: the claimed model without decoder layer {i} (0-based; its "
                   "residual passes through)", transform=lambda b: without_layer(b, i), settings={"skip_layer": i})


def _wrong_seed(p: SamplingParams) -> SamplingParams:
    if p.seed is None:
        return p
    return p.with_(seed=(p.seed + WRONG_SEED_OFFSET) % 2**63)


_REGISTRY: dict[str, Variant] = {}
_ALIASES = {"w4": "w4-g128", "w8": "w8-channel"}


def register(variant: Variant) -> Variant:
    if variant.name in _REGISTRY:
        raise ValueError(f"variant {variant.name!r} is already registered")
    _REGISTRY[variant.name] = variant
    return variant


for _v in (
    Variant("honest", "the reference configuration: KV-cache decode at the caller's batch size, verified by prefill",
            True),
    Variant("prefill-vs-decode", "honest, batch 1: the only difference from the verifier is KV-cache decode "
            "vs full prefill", True, batch_size=1, settings={"batch_size": 1}),
    batch_variant(1), batch_variant(4), batch_variant(8), batch_variant(16),
    Variant("bf16", "honest: weights and activations in bfloat16 (lm_head output cast to fp32 for sampling)", True,
            transform=lambda b: with_dtype(b, torch.bfloat16), settings={"dtype": "bfloat16"}),
    Variant("attn-eager", "honest: transformers' eager attention (matmul + softmax) instead of the reference's",
            True, transform=lambda b: with_attention(b, "eager"), settings={"attn_implementation": "eager"}),
    Variant("attn-sdpa", "honest: torch scaled_dot_product_attention (the reference's default)", True,
            transform=lambda b: with_attention(b, "sdpa"), settings={"attn_implementation": "sdpa"}),
    weight_quant_variant(4, 128), weight_quant_variant(4, 32), weight_quant_variant(4, 128, symmetric=False),
    weight_quant_variant(4, 32, symmetric=False), weight_quant_variant(8, None),
    fp8_kv_variant("unit", True, "fp8-kv"), fp8_kv_variant("tensor", True, "fp8-kv-tensor"),
    fp8_kv_variant("head", True, "fp8-kv-head"), fp8_kv_variant("unit", False, "fp8-kv-fresh"),
    temperature_variant(1.1), temperature_variant(0.9), top_p_variant(0.85), top_p_variant(0.76),
    top_k_variant(40), top_k_variant(60), min_p_variant(0.04), min_p_variant(0.06),
    Variant("wrong-seed", f"samples with seed + {WRONG_SEED_OFFSET} while claiming the requested seed",
            sampling=_wrong_seed, settings={"seed_offset": WRONG_SEED_OFFSET}),
    bug_variant(2), bug_variant(32),
    Variant("spec-draft-only", "speculative cheat: the draft's proposals returned without the target's check",
            spec_rule="draft-only", settings={"spec_rule": "draft-only"}),
    Variant("spec-top1", "speculative with a wrong rule: accept a draft iff it is the target's top-1 token",
            spec_rule="top1", settings={"spec_rule": "top1"}),
    Variant("no-spec", "plain decoding while claiming speculative decoding",
            sampling=lambda p: p.with_(speculative=None), settings={"speculative": None}),
    Variant("spec-undeclared", f"speculative decoding ({UNDECLARED_SPEC['draft']}, k={UNDECLARED_SPEC['k']}) "
            "while claiming plain decoding", sampling=lambda p: p.with_(speculative=dict(UNDECLARED_SPEC)),
            settings={"speculative": UNDECLARED_SPEC}),
):
    register(_v)

_FAMILIES: list[tuple[re.Pattern, Callable[[re.Match], Variant], str]] = [
    (re.compile(r"batch-(\d+)"), lambda m: batch_variant(int(m[1])), "batch-N: generation batch size N"),
    (re.compile(r"w(\d)-(?:g(\d+)|channel)(-asym)?"),
     lambda m: weight_quant_variant(int(m[1]), int(m[2]) if m[2] else None, not m[3]),
     "wB-gG[-asym], wB-channel[-asym]: B-bit RTN weights, group size G or per channel"),
    (re.compile(r"temperature-(\d+(?:\.\d*)?)"), lambda m: temperature_variant(float(m[1])),
     "temperature-X: sample at temperature X"),
    (re.compile(r"top-p-(\d+(?:\.\d*)?)"), lambda m: top_p_variant(float(m[1])), "top-p-X: sample with top-p X"),
    (re.compile(r"top-k-(\d+)"), lambda m: top_k_variant(int(m[1])), "top-k-K: sample with top-k K"),
    (re.compile(r"min-p-(\d+(?:\.\d*)?)"), lambda m: min_p_variant(float(m[1])), "min-p-X: sample with min-p X"),
    (re.compile(r"bug-top(\d+)(?:-rate(\d+(?:\.\d*)?(?:e-?\d+)?))?"),
     lambda m: bug_variant(int(m[1]), float(m[2]) if m[2] else 0.01),
     "bug-topK[-rateR]: rate R (default 0.01) of tokens uniform among the top K"),
    (re.compile(r"layers-(\d+)"), lambda m: layers_variant(int(m[1])),
     "layers-N: the claimed model's first N decoder layers (a smaller model, same tokenizer)"),
    (re.compile(r"skip-layer-(\d+)"), lambda m: skip_layer_variant(int(m[1])),
     "skip-layer-I: the claimed model without decoder layer I (0-based), its residual passed through"),
    (re.compile(r"chat-template:(.+)"), lambda m: chat_template_variant(m[1]),
     "chat-template:NAME: the messages rendered by another chat template (verinfer.chat_templates)"),
    (re.compile(r"system-prompt:(.+)", re.S), lambda m: system_prompt_variant(m[1]),
     "system-prompt:TEXT: TEXT as a hidden system message"),
]


def get_variant(name: str) -> Variant:
    """A variant by registry name, alias, family pattern, or ``+``-joined composition of those."""
    if "+" in name:
        return compose(*(get_variant(part) for part in name.split("+")))
    key = _ALIASES.get(name, name)
    if key in _REGISTRY:
        return _REGISTRY[key]
    for pattern, build, _ in _FAMILIES:
        m = pattern.fullmatch(key)
        if m:
            return build(m)
    raise KeyError(f"unknown variant {name!r}; known: {', '.join(sorted(_REGISTRY))}; "
                   f"families: {'; '.join(doc for _, _, doc in _FAMILIES)}; combine with '+'")


def list_variants() -> list[Variant]:
    """The named registry entries, honest ones first."""
    return sorted(_REGISTRY.values(), key=lambda v: (not v.honest, v.name))


def family_docs() -> list[str]:
    return [doc for _, _, doc in _FAMILIES]


__all__ = [
    "TopKUniformBug", "Variant", "batch_variant", "bug_variant", "chat_template_variant", "compose", "family_docs",
    "fp8_kv_variant", "get_variant", "layers_variant", "list_variants", "min_p_variant", "register", "skip_layer_variant",
    "system_prompt_variant", "temperature_variant", "top_k_variant", "top_p_variant", "weight_quant_variant",
]
