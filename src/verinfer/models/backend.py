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

    decodes = True  # a KV-cache decode and derived copies of the model (False: prefills only, as vLLM's)
    reference_name = "transformers"  # what computes the hidden states (score signatures record it)

    def __init__(self, model, tokenizer, model_id: str, dtype: torch.dtype = torch.float32):
        self.model = model
        self._setup(tokenizer, model.config, model_id, dtype, next(model.parameters()).device,
                    int(model.get_output_embeddings().weight.shape[0]))

    def _setup(self, tokenizer, config, model_id: str, dtype: torch.dtype, device: torch.device, vocab_size: int):
        """What every backend knows of its model, whoever computes the hidden states."""
        self.tokenizer, self.config, self.model_id, self.dtype = tokenizer, config, model_id, dtype
        self.device, self.vocab_size = device, vocab_size
        self._softcap = getattr(config, "final_logit_softcapping", None)
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
        n = getattr(self.config.get_text_config(), "max_position_embeddings", None)
        return int(n) if n else None

    @property
    def hidden_size(self) -> int:
        return int(self.config.get_text_config().hidden_size)

    TURN_TERMINATORS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

    def stop_ids(self) -> set[int]:
        """Token ids that end a generation (EOS, plus the chat turn terminator where defined)."""
        vocab = self.tokenizer.get_vocab()
        ids = {vocab[t] for t in self.TURN_TERMINATORS if t in vocab}
        for value in (self.tokenizer.eos_token_id, self._generation_eos()):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    def _generation_eos(self) -> int | list[int] | None:
        return getattr(self.model.generation_config, "eos_token_id", None)

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

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, on_device: bool = False) -> torch.Tensor:
        """lm_head (and the final soft-cap some models use) in fp32, on the CPU unless ``on_device``."""
        out = self._head(hidden.to(self.device, self.dtype)).float()
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
        hs = self.sequence_hidden([sequences[i] for i in batch])
        if on_sequence_hidden is not None:
            for b, i in enumerate(batch):
                on_sequence_hidden(i, hs[b].float().cpu())
        # Row k of sequence i is the hidden state at position starts[i] - 1 + k: it predicts output token k.
        rows = torch.cat([hs[b][starts[i] - 1: len(sequences[i]) - 1] for b, i in enumerate(batch)])
        items = torch.cat([torch.full((len(sequences[i]) - starts[i],), i) for i in batch])
        steps = torch.cat([torch.arange(len(sequences[i]) - starts[i]) for i in batch])
        for lo in range(0, rows.shape[0], row_block):
            hid = rows[lo: lo + row_block]
            yield PrefillBlock(items[lo: lo + row_block], steps[lo: lo + row_block], self.logits(hid, on_device),
                               hid.float().cpu())

    def sequence_hidden(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each sequence's final normed hidden states [len, D], from one padded forward pass."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for b, seq in enumerate(sequences):
            ids[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[b, : len(seq)] = 1
        h, _ = self.hidden(ids, mask if len(sequences) > 1 else None)
        return [h[b, : len(seq)] for b, seq in enumerate(sequences)]
