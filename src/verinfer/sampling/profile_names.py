"""The sampler profiles' canonical names and aliases, readable without loading the profiles.

The profiles import torch and compile numba kernels; the command line names them in ``--help``
and must answer that without either (issue #31: input checks that answer fast).
``verinfer.sampling.profiles`` checks at import that its classes carry exactly these names, in
this order, so the list cannot drift from the registry.
"""

from __future__ import annotations

PROFILE_NAMES: tuple[str, ...] = (
    "greedy", "vllm", "vllm-v1", "vllm-v1-cuda", "vllm-cpu", "transformers", "sglang", "llama.cpp",
)
PROFILE_ALIASES: dict[str, str] = {"torch-exponential": "vllm-v1", "hf-transformers": "transformers",
                                   "llama-cpp": "llama.cpp"}


def canonical_profile(name: str) -> str:
    """A profile's canonical name from its name or alias, or the ValueError ``get_profile`` gives."""
    if name in PROFILE_NAMES:
        return name
    if name in PROFILE_ALIASES:
        return PROFILE_ALIASES[name]
    known = sorted([*PROFILE_NAMES, *PROFILE_ALIASES])
    raise ValueError(f"unknown sampler profile {name!r}; known: {', '.join(known)}")
