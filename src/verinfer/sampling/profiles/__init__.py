"""The registry of sampler profiles: one module per engine and version, selectable by name."""

from __future__ import annotations

from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profile_names import PROFILE_ALIASES, PROFILE_NAMES, canonical_profile
from verinfer.sampling.profiles.base import Profile, RowKeys
from verinfer.sampling.profiles.greedy import GreedyProfile
from verinfer.sampling.profiles.llama_cpp import LlamaCppProfile
from verinfer.sampling.profiles.sglang import SglangProfile
from verinfer.sampling.profiles.transformers import TransformersProfile
from verinfer.sampling.profiles.vllm import VllmProfile
from verinfer.sampling.profiles.vllm_v1 import VllmV1CudaProfile, VllmV1Profile
from verinfer.sampling.profiles.vllm_cpu import VllmCpuProfile

_CLASSES: tuple[type[Profile], ...] = (
    GreedyProfile,
    VllmProfile,
    VllmV1Profile,
    VllmV1CudaProfile,
    VllmCpuProfile,
    TransformersProfile,
    SglangProfile,
    LlamaCppProfile,
)

if tuple(c.name for c in _CLASSES) != PROFILE_NAMES:  # the light list the command line's help reads
    raise ImportError(f"verinfer.sampling.profile_names.PROFILE_NAMES {PROFILE_NAMES} does not match the "
                      f"profiles {tuple(c.name for c in _CLASSES)}")

PROFILES: dict[str, type[Profile]] = {n: c for c in _CLASSES for n in (c.name, *c.aliases)}
if {a: c.name for c in _CLASSES for a in c.aliases} != PROFILE_ALIASES:
    raise ImportError(f"verinfer.sampling.profile_names.PROFILE_ALIASES {PROFILE_ALIASES} does not match the "
                      f"profiles' aliases")

__all__ = ["PROFILES", "Profile", "RowKeys", "get_profile", "params_problems", "profile_names"]


def profile_names() -> list[str]:
    """Canonical names (no aliases), for help texts."""
    return list(PROFILE_NAMES)


def get_profile(name: str) -> Profile:
    """A fresh profile instance by name or alias, or a ValueError listing the known names."""
    return PROFILES[canonical_profile(name)]()


def params_problems(params: SamplingParams) -> list[str]:
    """Everything wrong with ``params``: generic checks, the profile's name, then what it cannot replay."""
    out = params.problems()
    if params.profile not in PROFILES:
        return [f"profile: unknown profile {params.profile!r} (known: {', '.join(sorted(PROFILES))})", *out]
    if params.speculative is not None and params.profile not in ("vllm", "greedy"):
        out.append(f"speculative decoding is replayed for the 'vllm' profile (vLLM's V2 rejection sampler), "
                   f"not {params.profile!r}")
    return out + PROFILES[params.profile]().problems(params)
