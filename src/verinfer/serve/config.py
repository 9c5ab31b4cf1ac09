"""What a served provider is: its settings, and the misconfigurations it hides behind an honest API.

A misconfiguration is either a configuration variant of the detection study
(``verinfer.simulate.variants``: quantized weights, fp8 KV cache, temperature, top-p, wrong seed,
sampler bugs, ...), applied inside the server exactly as the study applies it, or one of two
serving-level deviations that only exist where prompts are rendered:

- ``system-prompt:TEXT``: a system prompt the client never sees. Chat requests get TEXT as the
  first system message (prepended to the client's own system message, if any, separated by a blank
  line); completion requests get the tokens of ``TEXT + "\\n\\n"`` prepended to the prompt. The
  provider conceals it: ``prompt_token_ids``, ``usage`` and echoed prompts describe the client's
  prompt as rendered without the injection, which is what a dishonest provider reports.
- ``old-template``: chat is rendered with a plain ChatML template that has no default system
  message (SmolLM2's own template inserts one). This is a stale deployment rather than a lie:
  ``prompt_token_ids`` are the ids the server really used, as vLLM reports them, so an auditor
  who compares them with its own rendering sees the drift; one who re-renders sees divergence.

- ``greedy-honest:VARIANT``: the greedy-only cheat. Requests at temperature 0 are decoded by the
  honest model, every sampled request by VARIANT (``greedy-honest:w4``: 4-bit weights whenever
  the client samples), so greedy spot checks see an honest provider while the sampled traffic a
  customer buys is not. Audits of sampled traffic (``verinfer audit run --mode rank``) catch it.

Names are given comma-separated or repeated; ``system-prompt:TEXT`` takes the rest of its value
(commas included), so give it last or on its own.

Speculative decoding (``speculative``, ``verinfer serve --speculative DRAFT:K``): every sampled
request is decoded as vLLM 0.32's model runner V2 decodes with a draft model proposing ``K`` tokens
per step (``verinfer.simulate.speculative``), and claims it in ``verinfer_sampling.speculative``.
``DRAFT`` is ``layers:N`` (the served model's first N decoder layers) or ``wN`` (its N-bit RTN
weights): ``layers:28:4``, ``w4:2``. The draft is always derived from the *claimed* (reference)
model, so a misconfigured server still drafts as it claims; only honest noise variants (e.g.
``bf16``) reach the draft too, as in ``Variant.generate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verinfer.sampling.params import SamplingParams, parse_speculative
from verinfer.sampling.profiles import PROFILES, params_problems
from verinfer.simulate.variants import Variant, compose, get_variant

SYSTEM_PROMPT = "system-prompt:"
OLD_TEMPLATE = "old-template"
GREEDY_HONEST = "greedy-honest:"

# A plain ChatML template as older ChatML deployments shipped it: no default system message.
PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ServeConfig:
    """How ``verinfer serve`` runs; the defaults are an honest vLLM-like provider.

    ``misconfig``: names as described in the module docstring (empty: honest).
    ``served_model_name``: the id the API reports and requires (default: the backend's model id,
    which is what traces must claim for ``verinfer verify``).

    Limits that keep one request from costing the others (see README, "Limits and errors"):
    ``max_prompt_tokens``: longest prompt a request may send (default: the context length);
    ``max_batch``: rows decoded at once (the running batch; ``serve.scheduler``);
    ``max_batch_prompt_tokens``: prefill budget of the running batch, counted as rows times the
    longest prompt (left padding); a request over it on its own still runs, alone;
    ``queue_timeout_s``: a request none of whose rows was admitted after this long gets 503 (0:
    wait forever); the rows of one request are one unit (``serve.jobs``);
    ``prefill_chunk_tokens``: prompt tokens prefilled per chunk and per scheduling step; a prompt
    whose clients all left stops between chunks (0: one-pass prefill, not interruptible);
    ``stream_buffer_events``: decoded chunks a live stream may hold for a client that does not read
    them (beyond the OS socket buffers); past it the client is dropped and its rows stop;
    ``result_ttl_s`` / ``max_kept_results``: how long and how many results of requests with an
    ``Idempotency-Key`` are kept for their retries (``serve.results``);
    ``max_request_bytes``: largest request body (413 above it);
    ``disconnect_poll_s``: how often a waiting handler checks whether its client is gone.
    """

    sampler: str = "vllm"
    max_batch: int = 8
    misconfig: tuple[str, ...] = ()
    served_model_name: str | None = None
    max_tokens_limit: int = 1024
    max_model_len: int | None = None  # default: the model's context length
    batch_wait_s: float = 0.005  # how long an idle scheduler waits for companions of a first arrival
    max_prompt_tokens: int | None = None  # default: the context length
    max_batch_prompt_tokens: int = 8192
    prefill_chunk_tokens: int = 512
    queue_timeout_s: float = 60.0
    stream_buffer_events: int = 256
    result_ttl_s: float = 600.0
    max_kept_results: int = 1024
    max_request_bytes: int = 1 << 20
    disconnect_poll_s: float = 0.1
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    speculative: str | None = None  # DRAFT:K (module docstring); None: plain decoding

    @property
    def speculative_claim(self) -> dict | None:
        """``speculative`` as the ``SamplingParams.speculative`` claim (ValueError when malformed)."""
        return None if self.speculative is None else parse_speculative(self.speculative)

    def problems(self) -> list[str]:
        out = []
        if self.speculative is not None:
            try:
                spec = self.speculative_claim
            except ValueError as exc:
                out.append(str(exc))
            else:
                needs = params_problems(SamplingParams(profile=self.sampler, seed=0, speculative=spec)) \
                    if self.sampler in PROFILES else []
                if needs:
                    out.append(f"--speculative {self.speculative}: {needs[0]}")
        if self.max_batch < 1:
            out.append(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_tokens_limit < 1:
            out.append(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        if self.max_model_len is not None and self.max_model_len < 2:
            out.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 <= self.batch_wait_s <= 10:
            out.append(f"batch_wait_s must be in [0, 10] seconds, got {self.batch_wait_s}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            out.append(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_batch_prompt_tokens < 1:
            out.append(f"max_batch_prompt_tokens must be >= 1, got {self.max_batch_prompt_tokens}")
        if self.prefill_chunk_tokens < 0:
            out.append(f"prefill_chunk_tokens must be >= 0 (0: one pass), got {self.prefill_chunk_tokens}")
        if not self.queue_timeout_s >= 0:
            out.append(f"queue_timeout_s must be >= 0 seconds (0: no timeout), got {self.queue_timeout_s}")
        if self.stream_buffer_events < 1:
            out.append(f"stream_buffer_events must be >= 1, got {self.stream_buffer_events}")
        if not self.result_ttl_s >= 0:
            out.append(f"result_ttl_s must be >= 0 seconds, got {self.result_ttl_s}")
        if self.max_kept_results < 1:
            out.append(f"max_kept_results must be >= 1, got {self.max_kept_results}")
        if self.max_request_bytes < 1024:
            out.append(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not 0 < self.disconnect_poll_s <= 10:
            out.append(f"disconnect_poll_s must be in (0, 10] seconds, got {self.disconnect_poll_s}")
        if not 0 <= self.port <= 65535:
            out.append(f"port must be in 0..65535, got {self.port}")
        if self.sampler in PROFILES:  # unknown names are refused by name elsewhere
            needs = params_problems(SamplingParams(profile=self.sampler, seed=0))
            if needs:  # e.g. transformers: its noise depends on a generate call's batch, which a server has not
                out.append(f"sampler {self.sampler!r} cannot be served: {needs[0]}")
        return out


@dataclass(frozen=True)
class Misconfiguration:
    """The parsed ``misconfig`` list: one composed variant plus the serving-level deviations."""

    names: tuple[str, ...] = ()
    variant: Variant | None = None
    system_prompt: str | None = None
    old_template: bool = False
    greedy_honest: bool = False  # the variant serves sampled requests only; greedy ones get the honest model
    settings: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def honest(self) -> bool:
        return not self.names

    def deviates(self, claimed: SamplingParams) -> bool:
        """Whether a request claiming ``claimed`` is served by the variant (else by the honest model)."""
        return self.variant is not None and not (self.greedy_honest and claimed.is_greedy)

    def actual_params(self, claimed: SamplingParams) -> SamplingParams:
        """The sampling parameters a request claiming ``claimed`` is really decoded with."""
        return self.variant.actual_params(claimed) if self.deviates(claimed) else claimed


def split_names(values: list[str] | tuple[str, ...] | str) -> tuple[str, ...]:
    """Split comma-separated names; ``system-prompt:TEXT`` keeps the rest of its value."""
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        rest = value
        while rest:
            rest = rest.strip()
            if rest.startswith(SYSTEM_PROMPT):
                out.append(rest)
                break
            head, _, rest = rest.partition(",")
            if head.strip():
                out.append(head.strip())
    return tuple(out)


def parse_misconfig(names: list[str] | tuple[str, ...] | str) -> Misconfiguration:
    """Resolve names against the variant registry; ValueError naming the bad one otherwise."""
    names = split_names(names)
    variants: list[Variant] = []
    system_prompt = None
    old_template = greedy_honest = False
    for name in names:
        if name.startswith(GREEDY_HONEST):
            inner = name[len(GREEDY_HONEST):]
            if greedy_honest or not inner.strip():
                raise ValueError(f"misconfig {name!r}: give 'greedy-honest:VARIANT' once, with a variant "
                                 "(e.g. greedy-honest:w4)")
            greedy_honest = True
            name = inner.strip()
        if name.startswith(SYSTEM_PROMPT):
            text = name[len(SYSTEM_PROMPT):]
            if not text.strip():
                raise ValueError("misconfig 'system-prompt:TEXT' needs a non-empty TEXT")
            if system_prompt is not None:
                raise ValueError("misconfig 'system-prompt:' given twice")
            system_prompt = text
        elif name == OLD_TEMPLATE:
            old_template = True
        else:
            try:
                variants.append(get_variant(name))
            except KeyError as exc:
                raise ValueError(f"misconfig {name!r}: {exc.args[0]}; serving-level: "
                                 f"{SYSTEM_PROMPT}TEXT, {OLD_TEMPLATE}") from None
    variant = compose(*variants) if variants else None
    if variant is not None and variant.prompt is not None:  # the server renders prompts itself (above)
        raise ValueError(f"misconfig {', '.join(names)}: give {SYSTEM_PROMPT}TEXT as a name of its own")
    settings = dict(variant.settings) if variant else {}
    if system_prompt is not None:
        settings["system_prompt"] = system_prompt
    if old_template:
        settings["chat_template"] = "plain-chatml"
    if greedy_honest:
        if variant is None:
            raise ValueError("misconfig 'greedy-honest:VARIANT' needs a model or sampler variant, e.g. greedy-honest:w4")
        settings["greedy_honest"] = True
    return Misconfiguration(names, variant, system_prompt, old_template, greedy_honest, settings)
