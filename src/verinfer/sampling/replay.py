"""What replaying the sampler on a block of logits gives: the picked token per row and, when claimed
tokens are given, their Token-DiFR scores.

Its own module, below ``sampler.py`` and ``inverse_cdf.py``, because both fill it (Gumbel and
inverse-CDF profiles) and neither may import the other's caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Replay:
    """Per-row outcome of replaying the sampler; the score fields are set only with claims."""

    token: torch.Tensor  # [N] the token the sampler picks
    margin: torch.Tensor | None = None  # [N] fp64, raw-logit units; inf when the claim is filtered
    filter_distance: torch.Tensor | None = None  # [N] raw-logit distance to surviving the filters
    logprob: torch.Tensor | None = None  # [N] log-prob of the claim under the processed distribution
    logit_rank: torch.Tensor | None = None  # [N] claims' rank among raw logits (0 = top)
    gumbel_rank: torch.Tensor | None = None  # [N] claims' rank among kept x + G (0 = sampled)
    depth_shift: torch.Tensor | None = None  # [N] fp64 depth(picked) - depth(claim), 0 at matches (depth.py)
