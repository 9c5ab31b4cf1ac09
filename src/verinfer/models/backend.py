"""A model backend that prefills (chunked, streaming) and decodes with a KV cache.

The backend splits the network at the final norm: ``hidden`` gives the final normed hidden state
(the input to lm_head, which activation commits fingerprint) and ``logits`` applies the head.
Verification streams logits in row blocks, so memory stays flat however many tokens it checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from verinfer.models.load import DEFAULT_MODEL, load_pretrained, resolve

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(sorted(DTYPES))}") from None


@dataclass
class PrefillBlock:
    """Logits for a block of scored rows: row i predicts output token ``steps[i]`` of ``items[i]``."""

    items: torch.Tensor  # [R] index of the sequence in the caller's list
    steps: torch.Tensor  # [R] output index k
    logits: torch.Tensor  # [R, V] fp32
    hidden: torch.Tensor  # [R, D] final normed hidden state at the row's input position


class Backend:
    """A causal LM ready for verification and generation, loaded offline."""

    def __init__(self, model, tokenizer, model_id: str, dtype: torch.dtype = torch.float32):
        self.model = model
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.dtype = dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._softcap = getattr(model.config, "final_logit_softcapping", None)
        eos = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    @classmethod
    def load(cls, spec: str = DEFAULT_MODEL, dtype: str | torch.dtype = torch.float32,
             device: str = "cpu") -> "Backend":
        """Load offline; ``device`` may be a GPU (logits always come back to the CPU sampler)."""
        source = resolve(spec)
        dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        model, tokenizer = load_pretrained(source, dt)
        return cls(model.to(device), tokenizer, source.model_id, dt)

    @property
    def dtype_name(self) -> str:
        """The compute dtype as traces, signatures and reports name it (``float32``, ``bfloat16``)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def max_length(self) -> int | None:
        """The longest sequence the model's positions cover (None when the config does not say)."""
        n = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        return int(n) if n else None

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.get_text_config().hidden_size)

    TURN_TERMINATORS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

    def stop_ids(self) -> set[int]:
        """Token ids that end a generation (EOS, plus the chat turn terminator where defined)."""
        vocab = self.tokenizer.get_vocab()
        ids = {vocab[t] for t in self.TURN_TERMINATORS if t in vocab}
        for value in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    @torch.inference_mode()
    def hidden(self, input_ids, attention_mask, position_ids=None, cache=None):
        """Final normed hidden states [B, T, D] and the updated KV cache."""
        to = (lambda t: None if t is None else t.to(self.device))
        out = self.model.base_model(
            input_ids=to(input_ids),
            attention_mask=to(attention_mask),
            position_ids=to(position_ids),
            cache=cache,  # transformers >= 5.24 (``past_key_values`` is deprecated)
            use_cache=cache is not None,
        )
        return out.last_hidden_state, out.cache

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, on_device: bool = False) -> torch.Tensor:
        """lm_head (and the final soft-cap some models use) in fp32, on the CPU unless ``on_device``."""
        out = self.model.get_output_embeddings()(hidden.to(self.device, self.dtype)).float()
        if self._softcap:
            out = torch.tanh(out / self._softcap) * self._softcap
        return out if on_device else out.cpu()

    def prefill(
        self,
        sequences: Sequence[Sequence[int]],
        starts: Sequence[int],
        token_budget: int = 4096,
        row_block: int = 512,
        on_sequence_hidden: Callable[[int, torch.Tensor], None] | None = None,
        on_device: bool = False,
    ) -> Iterator[PrefillBlock]:
        """Stream logits for the rows that predict ``sequences[i][starts[i]:]`` (one forward pass).

        With ``on_device`` the logits stay on the model's device (verification scores them there and
        brings back only per-token columns); otherwise they come to the CPU.

        Sequences are grouped by length into micro-batches of at most ``token_budget`` padded
        tokens; lm_head runs on blocks of at most ``row_block`` rows, so peak memory depends on
        these two numbers, not on how many tokens are verified. ``on_sequence_hidden(i, h)``
        receives each sequence's full hidden states [len, D] (for activation commits).
        """
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        batch: list[int] = []
        for i in order + [None]:
            if i is not None and (not batch or (len(batch) + 1) * len(sequences[i]) <= token_budget):
                batch.append(i)
                continue
            if batch:
                yield from self._prefill_batch(sequences, starts, batch, row_block, on_sequence_hidden, on_device)
            batch = [i] if i is not None else []

    def _prefill_batch(self, sequences, starts, batch: list[int], row_block: int,
                       on_sequence_hidden=None, on_device: bool = False) -> Iterator[PrefillBlock]:
        width = max(len(sequences[i]) for i in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, : len(sequences[i])] = torch.as_tensor(sequences[i], dtype=torch.long)
            mask[b, : len(sequences[i])] = 1
        h, _ = self.hidden(ids, mask if len(batch) > 1 else None)
        if on_sequence_hidden is not None:
            for b, i in enumerate(batch):
                on_sequence_hidden(i, h[b, : len(sequences[i])].float().cpu())
        rows_b, rows_t, items, steps = [], [], [], []
        for b, i in enumerate(batch):
            n_out = len(sequences[i]) - starts[i]
            rows_b.append(torch.full((n_out,), b))
            rows_t.append(torch.arange(starts[i] - 1, starts[i] - 1 + n_out))
            items.append(torch.full((n_out,), i))
            steps.append(torch.arange(n_out))
        rb, rt, it, st = (torch.cat(x) for x in (rows_b, rows_t, items, steps))
        for lo in range(0, rb.numel(), row_block):
            sl = slice(lo, lo + row_block)
            hid = h[rb[sl].to(h.device), rt[sl].to(h.device)]
            yield PrefillBlock(it[sl], st[sl], self.logits(hid, on_device), hid.float().cpu())
