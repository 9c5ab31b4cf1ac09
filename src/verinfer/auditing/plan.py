"""What an audit asks each provider: one request per prompt, greedy, seeded or sampled without a seed.

Greedy spot checks (temperature 0) need nothing from the provider but argmax decoding. Seeded
mode asks for sampling with a per-prompt seed and replays it with the provider's sampler profile
(``--profile vllm``), so only engines whose sampler the project reproduces can be audited that way.
With ``choices > 1`` a seeded request asks for ``n`` completions: vLLM seeds choice j of a request
with seed ``seed + j`` (``SamplingParams`` children, REFERENCE.md 1.2 and 8; ``verinfer serve`` does
the same), so prompt i is sent seed ``seed + i * choices`` and its choice j claims one more per j:
every claimed seed of an audit is distinct, and ``choices = 1`` keeps ``seed + i``.
The seedless modes ask for sampling at the claimed temperature and top-k/top-p without a seed, as
customers do: ``rank`` one completion per prompt, ranked among ``samples`` reference draws (RUT,
``verinfer.auditing.rank``); ``mmd`` ``samples`` completions per prompt in one request (``n``),
compared with as many reference draws (Model Equality Testing, ``verinfer.auditing.mmd``);
``logprobs`` one completion per prompt with its top-k logprobs, compared with the reference's at
the same positions (LOGIC, ``verinfer.auditing.logprobs``).
``auto`` asks for all of it in one request per prompt (sampling at the claimed settings with
``choices`` as ``n``, top logprobs and token ids) and runs every test the responses allow
(``verinfer.auditing.auto``); it sends no seed, as customers' traffic carries none, unless ``seeds``
asks it to (then as seeded mode does, for its seeded test).
Chat requests are what customers send (the provider applies its chat template, which is part of
what gets audited); completion requests send our rendering as token ids, fixing the prompt exactly.
``extra_body`` adds fields to every generation request, for servers whose defaults sample
differently from what the audit claims when a knob is left out (llama-cpp-python's server:
``{"top_k": 0, "min_p": 0, "repeat_penalty": 1}``, else top-k 40, min-p 0.05 and a repeat penalty of
1.1 apply, greedy included); a field the audit sets itself (model, prompt, temperature, the claimed
knobs, seed, ...) keeps the audit's value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from verinfer.auditing.client import Call
from verinfer.prompts import Prompt, render
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import get_profile

MODES = ("greedy", "seeded", "surprise", "rank", "mmd", "logprobs", "auto")
SEEDLESS = ("surprise", "rank", "mmd", "logprobs")  # sampled without a seed (no bands or calibration)
ENDPOINTS = {"chat": "chat/completions", "completions": "completions"}


@dataclass(frozen=True)
class AuditSpec:
    """How the audit samples: mode, the claimed sampler settings, the endpoint and token budget."""

    mode: str = "greedy"
    profile: str = "vllm"  # profile replaying the provider's seeded sampler (seeded mode)
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 1000  # prompt i gets seed + i
    max_tokens: int = 48
    endpoint: str = "chat"
    token_ids: bool = True  # ask for vLLM's return_token_ids (omit for providers that refuse unknown fields)
    samples: int = 16  # rank: reference draws per prompt; mmd: completions per prompt from each side
    stream: bool = False  # ask for server-sent events (stream: true), as chat clients do
    top_logprobs: int = 5  # logprobs mode: alternatives per position
    extra_body: Mapping[str, Any] | None = None  # more request fields; the audit's own fields win
    choices: int = 1  # seeded: completions per request (n); choice j claims the request's seed + j
    seeds: bool = False  # auto: send seeds (and probe whether they are honoured) for its seeded test

    @property
    def seedless(self) -> bool:
        return self.mode in SEEDLESS

    @property
    def replays(self) -> bool:
        """Whether the requests carry seeds for a seeded replay (seeded mode, and auto with ``seeds``)."""
        return self.mode == "seeded" or (self.mode == "auto" and self.seeds)

    def problems(self) -> list[str]:
        out = []
        if self.mode not in MODES:
            out.append(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.endpoint not in ENDPOINTS:
            out.append(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_tokens < 1:
            out.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.choices < 1 or (self.choices > 1 and self.mode not in ("seeded", "auto")):
            out.append(f"choices (n per request) must be >= 1 and applies to --mode seeded or auto only, got {self.choices} "
                       f"with --mode {self.mode}" + (" (mmd sends --samples as n)" if self.mode == "mmd" else ""))
        if self.extra_body is not None:
            if not isinstance(self.extra_body, Mapping) or not all(isinstance(k, str) for k in self.extra_body):
                out.append(f"extra_body must be a JSON object, got {str(self.extra_body)[:80]!r}")
            else:
                try:
                    json.dumps(dict(self.extra_body))
                except (TypeError, ValueError) as exc:
                    out.append(f"extra_body must be JSON-serializable: {exc}")
        if self.seedless or self.mode == "auto":  # auto runs the seedless tests too (verinfer.auditing.auto)
            if self.mode in ("logprobs", "auto") and not 0 <= self.top_logprobs <= 20:
                out.append(f"top_logprobs must be in 0..20, got {self.top_logprobs}")
            if self.samples < (2 if self.mode == "mmd" else 1):
                out.append(f"--samples must be >= {2 if self.mode == 'mmd' else 1} for --mode {self.mode}, "
                           f"got {self.samples}")
            out += self.params(0).with_(profile="vllm", seed=0).problems()
            if self.temperature < 1e-5:
                out.append(f"--mode {self.mode} audits sampled traffic and needs a temperature > 0 "
                           "(use --mode greedy for argmax spot checks)")
        if self.seeds and self.mode != "auto":
            out.append(f"--seeds applies to --mode auto (--mode {self.mode} "
                       + ("always sends seeds)" if self.mode == "seeded" else "sends none)"))
        if self.replays:
            try:
                get_profile(self.profile)
            except (KeyError, ValueError) as exc:
                out.append(str(exc.args[0]))
            out += self.params(0).problems()
            if self.params(0).is_greedy:
                out.append(f"{self.mode} mode needs a temperature > 0 (use --mode greedy for argmax spot checks)")
        return out

    def params(self, index: int) -> SamplingParams:
        """The sampling parameters claim ``index`` claims (what the verifier replays): prompt i's choice j
        is claim ``i * choices + j`` (``claim_index``), so its seed is the request's seed + j."""
        if self.mode == "greedy":
            return SamplingParams(profile="greedy", temperature=0.0)
        return SamplingParams(profile=self.profile, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, seed=self.seed + index if self.replays else None)

    def claim_index(self, prompt_index: int, choice: int = 0) -> int:
        """The claim (and seed offset) of choice ``choice`` of prompt ``prompt_index``'s request."""
        return prompt_index * self.choices + choice

    def signature(self) -> dict:
        """The settings a calibration band must share with the audit (seeds excluded)."""
        return self.params(0).signature()


def generation_calls(spec: AuditSpec, prompts: Sequence[Prompt], tokenizer, model: str) -> list[Call]:
    """One request per prompt; metadata carries the prompt id and our rendering of the prompt."""
    calls = []
    for i, prompt in enumerate(prompts):
        params = spec.params(spec.claim_index(i))
        ids = render(tokenizer, prompt)
        body: dict = {**(spec.extra_body or {}), "model": model, "max_tokens": spec.max_tokens,
                      "temperature": params.temperature}
        if spec.endpoint == "chat":
            if not prompt.messages:
                raise ValueError(f"prompt {prompt.id!r} has only token ids; audit it with --endpoint completions")
            body["messages"] = prompt.message_dicts()
        else:
            body["prompt"] = ids
        if not params.is_greedy:
            body["top_p"] = params.top_p
            if params.seed is not None:
                body["seed"] = params.seed
            if params.top_k > 0:
                body["top_k"] = params.top_k
            if params.min_p > 0:
                body["min_p"] = params.min_p
        if spec.mode == "mmd":
            body["n"] = spec.samples
        elif spec.choices > 1:
            body["n"] = spec.choices
        if spec.mode in ("logprobs", "auto"):
            body.update({"logprobs": True, "top_logprobs": spec.top_logprobs} if spec.endpoint == "chat"
                        else {"logprobs": spec.top_logprobs})
        if spec.stream:
            body["stream"] = True
        if spec.token_ids:
            body["return_token_ids"] = True
        calls.append(Call(ENDPOINTS[spec.endpoint], body,
                          {"kind": "generate", "prompt_id": prompt.id, "index": i, "prompt_token_ids": ids}))
    return calls
