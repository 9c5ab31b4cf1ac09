"""A Llama decoder over a Hugging Face model's own weights, with a KV cache that we own.

Read top to bottom like nanoGPT: RMSNorm, rotary embedding, one decoder layer, then the four
entry points the serving engine uses.

- ``prefill_fast`` / ``decode_fast``: the fast path. Requests share one call: linear layers run
  on all rows together (so a row's fp32 result depends on the row-count bucket 1 / 2-3 / >=4) and
  attention runs on a padded batch with a key mask (so a row depends on the padded width).
- ``prefill_det`` / ``decode_det``: the deterministic path. Every request's result is a function of
  its own tokens only: linear layers get at least ``min_rows`` rows (fp32 results depend on the row
  bucket only, never on the neighbouring rows, so padding to 4 rows pins the bucket), and attention
  runs per request over exactly its own keys, with no padding and no mask.

The cache is a pool of slots, ``k[layer, slot, kv_head, position, head_dim]`` (and ``v``). A
request owns one slot; its K/V column at position ``p`` is ``k[:, slot, :, p]``, so MarginGate's
single-column repair is one indexed write (``KVPool.write_column``), with no rollback and no
re-decoding. The fast path keeps its running requests in slots ``0..B-1`` so that batched attention
reads a view of the pool instead of gathering a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

# On this CPU (REFERENCE.md section 2) fp32 F.linear gives a row a result that depends on the number
# of rows in the call only through the bucket M = 1, 2..3, >= 4; bf16 is bit-identical for every M.
MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1, torch.float16: 1}


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class KVPool:
    """K/V tensors for ``slots`` requests of up to ``max_len`` positions, and each slot's length."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.lengths = [0] * slots
        self.max_len = max_len

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    def column(self, slot: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the K and V column at ``pos`` of ``slot`` for every layer: two [L, Hkv, hd]."""
        return self.k[:, slot, :, pos].clone(), self.v[:, slot, :, pos].clone()

    def write_column(self, slot: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite the K and V column at ``pos`` of ``slot`` (every layer) and nothing else."""
        self.k[:, slot, :, pos] = k
        self.v[:, slot, :, pos] = v

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s cache into slot ``dst`` (used to keep running requests contiguous)."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def snapshot(self, slot: int, layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a slot's K and V over its length: [L', Hkv, T, hd] each."""
        n = self.lengths[slot]
        idx = slice(None) if layers is None else layers
        return self.k[idx, slot, :, :n].clone(), self.v[idx, slot, :, :n].clone()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Llama:
    """The decoder. ``Llama(backend.model)`` shares the Hugging Face weights (no copy in its dtype)."""

    def __init__(self, hf_model):
        cfg = hf_model.config
        if getattr(cfg, "model_type", None) != "llama":
            raise ValueError(f"the MarginGate decoder supports Llama models, not {cfg.model_type!r}")
        rope = getattr(hf_model.model.rotary_emb, "rope_type", "default")
        if rope != "default":
            raise ValueError(f"rope type {rope!r} is not supported (only 'default')")
        base = hf_model.model
        self.dtype = base.embed_tokens.weight.dtype
        self.min_rows = MIN_ROWS.get(self.dtype, 4)
        self.eps = float(cfg.rms_norm_eps)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.group = self.n_heads // self.n_kv
        self.embed = base.embed_tokens.weight.detach()
        self.norm = base.norm.weight.detach()
        self.head = hf_model.get_output_embeddings().weight.detach()
        self.inv_freq = base.rotary_emb.inv_freq.detach().float()
        self.rope_scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        self.layers = []
        for layer in base.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(LayerWeights(
                layer.input_layernorm.weight.detach(), att.q_proj.weight.detach(), att.k_proj.weight.detach(),
                att.v_proj.weight.detach(), att.o_proj.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach(),
            ))
        self.vocab_size = int(self.head.shape[0])

    def new_pool(self, slots: int, max_len: int) -> KVPool:
        return KVPool(len(self.layers), slots, self.n_kv, max_len, self.head_dim, self.dtype)

    # ----- building blocks -------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., head_dim] for integer positions of any shape, as Hugging Face computes them."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, det: bool) -> torch.Tensor:
        """``x @ w.T`` over the last dim; the deterministic path pads to ``min_rows`` rows."""
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if det and n < self.min_rows:
            rows = torch.cat([rows, rows.new_zeros(self.min_rows - n, rows.shape[1])])
        return F.linear(rows, w)[:n].reshape(*lead, w.shape[0])

    def _mlp(self, x: torch.Tensor, w: LayerWeights, det: bool) -> torch.Tensor:
        h = rms_norm(x, w.ln2, self.eps)
        return self._linear(F.silu(self._linear(h, w.gate, det)) * self._linear(h, w.up, det), w.down, det)

    def _qkv(self, x: torch.Tensor, w: LayerWeights, cos, sin, det: bool):
        """Rotated q [.., H, hd], k [.., Hkv, hd] and v [.., Hkv, hd] for rows x [.., D]."""
        h = rms_norm(x, w.ln1, self.eps)
        lead = x.shape[:-1]
        q = self._linear(h, w.q, det).view(*lead, self.n_heads, self.head_dim)
        k = self._linear(h, w.k, det).view(*lead, self.n_kv, self.head_dim)
        v = self._linear(h, w.v, det).view(*lead, self.n_kv, self.head_dim)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _logits(self, x: torch.Tensor, det: bool) -> torch.Tensor:
        return self._linear(rms_norm(x, self.norm, self.eps), self.head, det).float()

    # ----- prefill --------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill_det(self, pool: KVPool, slot: int, prompt: list[int]) -> torch.Tensor:
        """Prefill one request alone (no padding, causal attention); logits [V] of its last position."""
        ids = torch.as_tensor(prompt, dtype=torch.long)
        n = ids.numel()
        if n > pool.max_len:
            raise ValueError(f"prompt of {n} tokens does not fit a cache of {pool.max_len} positions")
        x = self.embed[ids]
        cos, sin = self._rope(torch.arange(n))
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(x, w, cos, sin, det=True)  # [T, H, hd], [T, Hkv, hd]
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, hd]
            pool.k[li, slot, :, :n] = k
            pool.v[li, slot, :, :n] = v
            a = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k[None], v[None], is_causal=True, enable_gqa=True,
            )[0]  # [H, T, hd]
            x = x + self._linear(a.transpose(0, 1).reshape(n, -1), w.o, det=True)
            x = x + self._mlp(x, w, det=True)
        pool.lengths[slot] = n
        return self._logits(x[-1:], det=True)[0]

    @torch.inference_mode()
    def prefill_fast(self, pool: KVPool, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Prefill several requests in one right-padded, masked call; logits [n, V] of each last position."""
        n, width = len(prompts), max(len(p) for p in prompts)
        if width > pool.max_len:
            raise ValueError(f"prompt of {width} tokens does not fit a cache of {pool.max_len} positions")
        ids = torch.zeros((n, width), dtype=torch.long)
        lens = torch.tensor([len(p) for p in prompts])
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        key_ok = torch.arange(width)[None, :] < lens[:, None]  # [n, T]
        mask = torch.ones(width, width, dtype=torch.bool).tril()[None] & key_ok[:, None, :]  # [n, T, T]
        x = self.embed[ids]
        cos, sin = self._rope(torch.arange(width).expand(n, width))
        slot_idx = torch.as_tensor(slots)
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(x, w, cos, sin, det=False)  # [n, T, H, hd]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [n, Hkv, T, hd]
            pool.k[li, slot_idx, :, :width] = k
            pool.v[li, slot_idx, :, :width] = v
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, attn_mask=mask[:, None], enable_gqa=True,
            )  # [n, H, T, hd]
            x = x + self._linear(a.transpose(1, 2).reshape(n, width, -1), w.o, det=False)
            x = x + self._mlp(x, w, det=False)
        for s, p in zip(slots, prompts):
            pool.lengths[s] = len(p)
        return self._logits(x[torch.arange(n), lens - 1], det=False)

    # ----- decode ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode_fast(self, pool: KVPool, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step for the requests in slots ``0..B-1``: append each token's K/V column at the
        slot's length, attend over the padded batch with a key mask; logits [B, V]."""
        b = tokens.numel()
        pos = torch.tensor(pool.lengths[:b])
        if int(pos.max()) >= pool.max_len:
            raise ValueError(f"a request reached the cache length ({pool.max_len} positions)")
        width = int(pos.max()) + 1
        mask = (torch.arange(width)[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, W]
        rows = torch.arange(b)
        x = self.embed[tokens]
        cos, sin = self._rope(pos)
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(x, w, cos, sin, det=False)  # [B, H, hd], [B, Hkv, hd]
            pool.k[li, rows, :, pos] = k
            pool.v[li, rows, :, pos] = v
            a = F.scaled_dot_product_attention(
                q[:, :, None], pool.k[li, :b, :, :width], pool.v[li, :b, :, :width], attn_mask=mask,
                enable_gqa=True,
            )  # [B, H, 1, hd]
            x = x + self._linear(a.reshape(b, -1), w.o, det=False)
            x = x + self._mlp(x, w, det=False)
        for s in range(b):
            pool.lengths[s] += 1
        return self._logits(x, det=False)

    @torch.inference_mode()
    def forward_det(self, pool: KVPool, slots: list[int], tokens: Sequence[Sequence[int]], starts: list[int],
                    commit: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Deterministic decode of a run of tokens per request: ``tokens[i][j]`` at position
        ``starts[i] + j`` of ``slots[i]``. Every row attends, exactly as a one-token decode step would
        (query length 1, no padding, no mask), over its own columns ``0..position``; the linear layers
        take all rows in one call (a row's result never depends on the other rows, see ``MIN_ROWS``).
        So a window of ``W`` tokens gives bit for bit what ``W`` successive deterministic decode steps
        give, in one pass: this is what lets the verifier recompute every column since its last
        checkpoint at about the price of one step on memory-bound hardware.

        Returns logits [R, V] and the K and V columns ([R, L, Hkv, hd] each), rows in request order.
        With ``commit`` the columns stay in the cache and a slot's length becomes the end of its run;
        without it the cache is left exactly as it was.
        """
        rows = [(s, p0 + j) for s, p0, toks in zip(slots, starts, tokens) for j in range(len(toks))]
        ids = torch.as_tensor([t for toks in tokens for t in toks], dtype=torch.long)
        if any(p >= pool.max_len for _, p in rows):
            raise ValueError(f"a request reached the cache length ({pool.max_len} positions)")
        saved = [pool.column(s, p) for s, p in rows] if not commit else None
        x = self.embed[ids]
        cos, sin = self._rope(torch.as_tensor([p for _, p in rows]))
        k_cols = torch.empty(len(rows), len(self.layers), self.n_kv, self.head_dim, dtype=self.dtype)
        v_cols = torch.empty_like(k_cols)
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(x, w, cos, sin, det=True)
            k_cols[:, li], v_cols[:, li] = k, v
            for i, (s, p) in enumerate(rows):  # every column of the window first, then each row's attention
                pool.k[li, s, :, p] = k[i]
                pool.v[li, s, :, p] = v[i]
            outs = [F.scaled_dot_product_attention(
                q[i, None, :, None], pool.k[li, s:s + 1, :, : p + 1], pool.v[li, s:s + 1, :, : p + 1],
                enable_gqa=True,
            ).reshape(-1) for i, (s, p) in enumerate(rows)]
            x = x + self._linear(torch.stack(outs), w.o, det=True)
            x = x + self._mlp(x, w, det=True)
        if commit:
            for s, p0, toks in zip(slots, starts, tokens):
                pool.lengths[s] = p0 + len(toks)
        else:
            for (s, p), (k_saved, v_saved) in zip(rows, saved):
                pool.write_column(s, p, k_saved, v_saved)
        return self._logits(x, det=True), k_cols, v_cols

    def decode_det(self, pool: KVPool, slots: list[int], tokens: torch.Tensor, positions: list[int],
                   commit: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One deterministic decode step for each request: ``tokens[i]`` at ``positions[i]`` of
        ``slots[i]`` (``forward_det`` with one-token runs). ``commit=False`` is the single-step
        verifier: it returns the logits and the K/V column and leaves the cache exactly as it was."""
        return self.forward_det(pool, slots, [[int(t)] for t in tokens], list(positions), commit)
