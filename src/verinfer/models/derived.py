"""Backends derived from a reference without touching it: another dtype, another attention kernel,
round-to-nearest weight quantization (w4/w8 as w4a16/w8a16 kernels compute them).

The reference is never modified: weights are copied when they change and shared read-only when
they do not. Semantics of the quantizer: ``verinfer.simulate.variants`` (``w4-*``, ``w8``).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import torch
from torch import nn

from verinfer.models.backend import Backend


def _derive(backend: Backend, cls: type | None = None, **changes: Any) -> Backend:
    """A shallow copy of ``backend`` (optionally as subclass ``cls``) with some attributes replaced."""
    new = (cls or type(backend)).__new__(cls or type(backend))
    new.__dict__.update(backend.__dict__)
    new.__dict__.update(changes)
    if "model" in changes:
        new.config = changes["model"].config
    return new


def _clone_model(model: nn.Module, weight: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """A new module tree (own modules and config) whose parameters are ``weight(name, data)``.

    Without ``weight`` the parameters and buffers are shared with ``model`` (no copy): right for
    variants that change only module or config state. Tied parameters stay tied. Buffers are always
    shared (rotary frequencies stay fp32, as when a model is loaded in bf16).
    """
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters appear once
            data = p.data if weight is None else weight(name, p.data)
            memo[id(p)] = p if weight is None else nn.Parameter(data, requires_grad=False)
        for b in model.buffers():
            memo[id(b)] = b
        return copy.deepcopy(model, memo)


def with_dtype(backend: Backend, dtype: torch.dtype) -> Backend:
    """The same weights cast to ``dtype`` and computed in it (a copy; the reference is untouched)."""
    model = _clone_model(backend.model, lambda _, w: w.to(dtype, copy=True))
    model.config.dtype = dtype
    return _derive(backend, model=model, dtype=dtype)


def with_attention(backend: Backend, implementation: str) -> Backend:
    """The same weights run with transformers' ``attn_implementation`` (``eager``, ``sdpa``)."""
    model = _clone_model(backend.model)
    model.set_attn_implementation(implementation)
    return _derive(backend, model=model)


def _rtn_last_dim(x: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """Fake-quantize ``x`` [..., g] with one scale (and zero point) per group along the last dim."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = x.abs().amax(-1, keepdim=True) / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(x / scale).clamp(-qmax - 1, qmax) * scale
    qmax = 2**bits - 1
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    return (torch.round(x / scale + zero).clamp(0, qmax) - zero) * scale


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int | None = 128, symmetric: bool = True) -> torch.Tensor:
    """Round-to-nearest fake quantization of a ``[out, in]`` weight, returned in its own dtype.

    One scale per output channel and group of ``group_size`` consecutive input columns (``None``: one
    group per output channel); a ragged tail forms one shorter group.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_rtn expects a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8, got {bits}")
    x = weight.float()
    n_out, n_in = x.shape
    g = n_in if group_size is None else int(group_size)
    if g <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    full = (n_in // g) * g
    parts = []
    if full:
        parts.append(_rtn_last_dim(x[:, :full].reshape(n_out, -1, g), bits, symmetric).reshape(n_out, full))
    if full < n_in:
        parts.append(_rtn_last_dim(x[:, full:], bits, symmetric))
    return torch.cat(parts, dim=1).to(weight.dtype)


def quantized_linear_names(model: nn.Module) -> list[str]:
    """Weights a quantization variant rewrites: every ``nn.Linear`` except the output embeddings."""
    head = model.get_output_embeddings()
    return [f"{name}.weight" for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head and m.weight is not head.weight]


def with_quantized_weights(backend: Backend, bits: int, group_size: int | None, symmetric: bool = True) -> Backend:
    """A copy of ``backend`` whose decoder linear weights are RTN-quantized (see ``quantize_rtn``)."""
    targets = set(quantized_linear_names(backend.model))
    if not targets:
        raise ValueError("the model has no nn.Linear layers to quantize")

    def weight(name: str, w: torch.Tensor) -> torch.Tensor:
        return quantize_rtn(w, bits, group_size, symmetric) if name in targets else w.clone()

    return _derive(backend, model=_clone_model(backend.model, weight))


def _with_decoder_layers(backend: Backend, keep: list[int], model_id: str) -> Backend:
    """The model with only its decoder layers ``keep`` (in order), its own final norm and head: weights
    shared, nothing copied; the kept layers' KV-cache slots renumbered so that its decode runs."""
    model = _clone_model(backend.model)
    layers = list(model.model.layers)
    model.model.layers = nn.ModuleList(layers[i] for i in keep)
    for n, layer in enumerate(model.model.layers):
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = n
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return _derive(backend, model=model, model_id=model_id)


def with_layers(backend: Backend, n: int) -> Backend:
    """The model's first ``n`` decoder layers with its own final norm and head (a cheap self-draft)."""
    total = len(backend.model.model.layers)
    if not 1 <= n <= total:
        raise ValueError(f"draft layers:{n}: the model has {total} decoder layers")
    return _with_decoder_layers(backend, list(range(n)), f"{backend.model_id}+layers:{n}")


def without_layer(backend: Backend, i: int) -> Backend:
    """The model with decoder layer ``i`` (0-based, ``model.layers.i``) removed: its residual stream passes
    through unchanged (a layer lost in loading or sharding: a pipeline stage that drops a layer, a
    checkpoint missing one)."""
    total = len(backend.model.model.layers)
    if not 0 <= i < total or total < 2:
        raise ValueError(f"skip-layer-{i}: the model has decoder layers 0-{total - 1}")
    return _with_decoder_layers(backend, [n for n in range(total) if n != i], f"{backend.model_id}-layer{i}")


def draft_backend(backend: Backend, spec: str) -> Backend:
    """The draft model a speculative claim names: derived from the claimed model ``backend`` as
    ``layers:N`` (its first N layers) or ``wN`` (its N-bit round-to-nearest weights, groups of 128),
    or any other model spec ``Backend.load`` accepts (alias, local directory, cached hub id), loaded
    in the target's dtype and device, which must share the target's vocabulary."""
    kind, _, arg = spec.partition(":")
    if kind == "layers" and arg.isdigit():
        return with_layers(backend, int(arg))
    if re.fullmatch(r"w[2-8]", spec):
        return with_quantized_weights(backend, int(kind[1:]), 128)
    draft = Backend.load(spec, backend.dtype, str(backend.device))
    if draft.vocab_size != backend.vocab_size or len(draft.tokenizer) != len(backend.tokenizer):
        raise ValueError(f"draft model {spec!r} does not share the target's vocabulary "
                         f"({draft.vocab_size} vs {backend.vocab_size} logits)")
    return draft
