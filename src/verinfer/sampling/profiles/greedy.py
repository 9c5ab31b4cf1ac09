"""Greedy decoding: argmax of the raw logits, no noise and no filters (every engine agrees)."""

from __future__ import annotations

import torch

from verinfer.sampling.profiles.base import Profile


class GreedyProfile(Profile):
    name = "greedy"
    seeded = False
    description = "argmax of the raw logits; no noise, no filters"

    def gumbel(self, keys, rows, cols, vocab_size):
        return torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
