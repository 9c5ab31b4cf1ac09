"""Trusted references that score a provider's claimed tokens, one row per output token.

``LocalReference`` is the project's verifier: one prefill of a local model per sequence and the
Token-DiFR margin under the claimed sampler (``verinfer.scoring.traces.score_traces``).

``ApiReference`` asks a reference API for prompt logprobs of prompt + output (``echo: true,
max_tokens: 0, logprobs: k``) and scores each claimed token t by its own logprob:
``margin = max(max_j top_logprob_j, logprob_t) - logprob_t``. Log-softmax shifts every logit by
the same constant, so this equals ``max_j l_j - l_t`` in raw-logit units: for greedy decoding it is
exactly the Token-DiFR margin (the argmax is always in the top-k, and the claimed token's own
logprob is returned even outside it, so the margin stays finite where token-difr's is ``inf``).
For seeded sampling the Token-DiFR margin is ``max_j (l_j + T G_j) - (l_t + T G_t)`` over the
tokens the filters keep; it needs the whole kept distribution, of which a top-k list is only a
part (the maximum over the rest is unknown and top-p needs the full normalizer), so seeded audits
are refused against a reference API rather than scored with an approximation. The seedless modes
(``rank``, ``mmd``, ``logprobs``, ``auto``) use the same API for their draws and scores
(``verinfer.auditing.remote_reference``, which states what it approximates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verinfer.auditing.client import Call, ProviderClient, ProviderError
from verinfer.scoring.alignment import keep_rows
from verinfer.scoring.traces import Replays
from verinfer.trace import Trace

Columns = dict[str, np.ndarray]


@dataclass
class LocalReference:
    """The project's verifier on a local model (``verinfer.models.backend.Backend``)."""

    backend: object
    name: str = "local"

    @property
    def tokenizer(self):
        return self.backend.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    def describe(self) -> str:
        return f"local {self.backend.model_id} ({self.backend.dtype_name}), Token-DiFR margins"

    def score(self, traces: list[Trace], out_dir: Path, on_rows=None, skip: dict[str, set[int]] | None = None,
              reuse: Replays | None = None) -> Columns:
        """Per-token scores of ``traces`` (also in ``out_dir/scores.parquet``), without the positions
        ``skip`` names per trace id (re-tokenization drift, ``verinfer.auditing.alignment``); traces
        ``reuse`` already replayed as they stand are not replayed again."""
        from verinfer.scoring.scores import read_scores
        from verinfer.scoring.traces import check_traces, in_trace_order, score_traces

        check_traces(traces, self.backend, f"{out_dir.name} responses")
        score_traces(self.backend, traces, out_dir / "scores.parquet", on_rows=on_rows, skip=skip, reuse=reuse)
        return in_trace_order(read_scores(out_dir / "scores.parquet"), traces)


@dataclass
class ApiReference:
    """A reference API returning prompt logprobs; responses persisted like any provider's."""

    client: ProviderClient
    tokenizer: object
    top_logprobs: int = 5
    name: str = "api"

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def describe(self) -> str:
        return (f"reference API {self.client.endpoint.base_url} ({self.client.endpoint.model}), "
                f"margins from the claimed token's own prompt logprob (top-{self.top_logprobs})")

    def score(self, traces: list[Trace], out_dir: Path, on_rows=None, skip: dict[str, set[int]] | None = None) -> Columns:
        if any(not t.sampling.is_greedy for t in traces):
            raise ValueError("a reference API scores greedy audits only: seeded Token-DiFR margins need the "
                             "full kept distribution (use a local reference model for --mode seeded)")
        calls = [Call("completions", {"model": self.client.endpoint.model,
                                      "prompt": t.prompt_token_ids + t.output_token_ids,
                                      "max_tokens": 0, "echo": True, "logprobs": self.top_logprobs,
                                      "temperature": 0.0},
                      {"kind": "score", "prompt_id": t.id}) for t in traces]
        records = self.client.fetch(calls, on_done=None)
        parts = [self._rows(t, r["response"]) for t, r in zip(traces, records)]
        if on_rows:
            on_rows(sum(len(t.output_token_ids) for t in traces))
        return keep_rows({k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, skip or {})

    def _rows(self, trace: Trace, response: dict) -> Columns:
        where = f"reference API {self.client.endpoint.base_url}: scoring {trace.id}"
        logprobs = response["choices"][0].get("logprobs")
        if not isinstance(logprobs, dict):
            raise ProviderError(f"{where}: 'choices[0].logprobs' is missing (does the API support echo with logprobs?)")
        own, tops = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
        n_prompt, n_out = len(trace.prompt_token_ids), len(trace.output_token_ids)
        if not isinstance(own, list) or not isinstance(tops, list) or len(own) != n_prompt + n_out or len(tops) != len(own):
            got = len(own) if isinstance(own, list) else "no"
            raise ProviderError(f"{where}: expected {n_prompt + n_out} prompt logprobs "
                                f"('token_logprobs' and 'top_logprobs'), got {got} (another tokenizer?)")
        margin = np.empty(n_out)
        for i in range(n_out):
            lp, top = own[n_prompt + i], tops[n_prompt + i]
            if not isinstance(lp, (int, float)) or not isinstance(top, dict) or not top \
                    or not all(isinstance(v, (int, float)) for v in top.values()):
                raise ProviderError(f"{where}: output token {i}: malformed logprob entry")
            lp = float(lp) if math.isfinite(lp) else -1e9
            margin[i] = max(max(top.values()), lp) - lp
        return {"trace_id": np.array([trace.id] * n_out, dtype=object), "position": np.arange(n_out),
                "exact_match": margin <= 0,
                "margin": margin, "cross_entropy": np.array([-float(own[n_prompt + i]) for i in range(n_out)])}
