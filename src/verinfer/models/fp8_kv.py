"""An fp8 (e4m3) KV cache: keys and values stored as ``float8_e4m3fn`` with a per-layer scale and read
back as ``fp8 * scale``, with vLLM's read path or the attend-before-write one (semantics:
``verinfer.simulate.variants``, ``fp8-kv*``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from verinfer.models.backend import Backend
from verinfer.models.derived import _derive


FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


@dataclass(frozen=True)
class Fp8KV:
    """How the fp8 KV cache scales and reads its entries.

    ``scale``: ``"unit"`` (1.0, vLLM's default without calibrated scales), ``"tensor"`` (amax / 448 per
    layer) or ``"head"`` (amax / 448 per layer and KV head); calibrated ones are measured on the first
    (prompt) pass and then frozen. ``read_current``: attention reads the current chunk's own keys and
    values back from the fp8 cache too (vLLM) instead of using them fresh.
    """

    scale: str = "unit"
    read_current: bool = True

    def __post_init__(self):
        if self.scale not in ("unit", "tensor", "head"):
            raise ValueError(f"fp8 KV scale must be 'unit', 'tensor' or 'head', got {self.scale!r}")


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``x`` stored as float8_e4m3fn with ``scale`` (saturating at +-448) and read back in x's dtype."""
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(x.dtype)


class Fp8KVLayer(DynamicLayer):
    """A transformers cache layer that stores keys and values as float8_e4m3fn plus a scale.

    Scales keep a leading batch dimension ([1, 1, 1, 1] per layer, [1, H, 1, 1] per head), so rows
    prefilled alone can decode in one batch, each with its own scale (``verinfer.serve.batch`` joins
    and selects every tensor ``BATCH_TENSORS`` names)."""

    BATCH_TENSORS = {"keys": 2, "values": 2, "_keys_read": 2, "_values_read": 2, "key_scale": None,
                     "value_scale": None}

    def __init__(self, spec: Fp8KV):
        super().__init__()
        self.spec = spec
        self.key_scale: torch.Tensor | None = None
        self.value_scale: torch.Tensor | None = None

    def _calibrate(self, x: torch.Tensor) -> torch.Tensor:  # x [B, H, T, D]
        if self.spec.scale == "unit":
            return torch.ones((1, 1, 1, 1), dtype=torch.float32, device=x.device)
        amax = x.abs().amax().reshape(1, 1, 1, 1) if self.spec.scale == "tensor" else \
            x.abs().amax(dim=(0, 2, 3), keepdim=True)
        return (amax.float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)

    @staticmethod
    def _store(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def _read(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (q.float() * scale).to(self.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.key_scale, self.value_scale = self._calibrate(key_states), self._calibrate(value_states)
            self.keys = self._store(key_states, self.key_scale)
            self.values = self._store(value_states, self.value_scale)
            # What attention reads: the fp8 entries dequantized once, as they are appended. Reading the
            # whole fp8 cache back every step gives the same values but costs O(length) conversions
            # per step (fp8 casts are slow on CPU: 5 tokens/s at batch 16 instead of ~70).
            self._keys_read = self._read(self.keys, self.key_scale)
            self._values_read = self._read(self.values, self.value_scale)
            self.is_initialized = True
        else:
            new_k, new_v = self._store(key_states, self.key_scale), self._store(value_states, self.value_scale)
            self.keys = torch.cat([self.keys, new_k], dim=-2)
            self.values = torch.cat([self.values, new_v], dim=-2)
            self._keys_read = torch.cat([self._keys_read, self._read(new_k, self.key_scale)], dim=-2)
            self._values_read = torch.cat([self._values_read, self._read(new_v, self.value_scale)], dim=-2)
        if self.spec.read_current:
            return self._keys_read, self._values_read
        n = key_states.shape[-2]
        return (torch.cat([self._keys_read[..., :-n, :], key_states], dim=-2),
                torch.cat([self._values_read[..., :-n, :], value_states], dim=-2))


class Fp8KVBackend(Backend):
    """A backend whose KV cache stores keys and values in fp8 (weights shared with its source)."""

    kv: Fp8KV = Fp8KV()

    def new_cache(self) -> DynamicCache:
        cache = DynamicCache()
        self._install(cache)
        return cache

    def _install(self, cache) -> None:
        if isinstance(cache, DynamicCache) and all(isinstance(layer, Fp8KVLayer) for layer in cache.layers) \
                and cache.layer_class_to_replicate is None and cache.layers:
            return
        if not isinstance(cache, DynamicCache) or cache.get_seq_length() > 0:
            raise ValueError("the fp8 KV cache variant needs an empty transformers DynamicCache to start from")
        n_layers = int(self.model.config.get_text_config().num_hidden_layers)
        cache.layers = [Fp8KVLayer(self.kv) for _ in range(n_layers)]
        cache.layer_class_to_replicate = None

    @torch.inference_mode()
    def hidden(self, input_ids, attention_mask, position_ids=None, cache=None):
        if cache is None:  # a prefill: it goes through an fp8 cache of its own, as in the engine
            h, _ = super().hidden(input_ids, attention_mask, position_ids, self.new_cache())
            return h, None
        self._install(cache)  # generation hands in an empty DynamicCache: make its layers fp8
        return super().hidden(input_ids, attention_mask, position_ids, cache)


def with_fp8_kv(backend: Backend, spec: Fp8KV = Fp8KV()) -> Backend:
    if isinstance(backend, Fp8KVBackend):
        raise ValueError("the backend already has an fp8 KV cache")
    return _derive(backend, Fp8KVBackend, kv=spec)
