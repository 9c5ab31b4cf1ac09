"""The sampler profiles' canonical names, readable without loading the profiles.

The profiles import torch and compile numba kernels; the command line names them in ``--help``
and must answer that without either (issue #31: input checks that answer fast).
``verinfer.sampling.profiles`` checks at import that its classes carry exactly these names, in
this order, so the list cannot drift from the registry.
"""

from __future__ import annotations

PROFILE_NAMES: tuple[str, ...] = (
    "greedy", "vllm", "vllm-v1", "vllm-v1-cuda", "vllm-cpu", "transformers", "sglang", "llama.cpp",
)
