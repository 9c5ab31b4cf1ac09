"""Deterministic greedy decoding under dynamic batching: MarginGate and its baselines.

- ``model.Llama``: a Llama decoder over a Hugging Face model's weights with a KV cache we own
  (``KVPool``), a fast batched path and a deterministic (batch-invariant) path.
- ``engine.Engine``: a dynamic-batching serving decoder; ``Policy`` picks fast, MarginGate(threshold),
  always-on verification or the deterministic path for every step; ``Request.protected`` is per request.
- ``study``: the seed paper's observations (flip rate, margins, K/V deviation) and policy evaluation.
- ``experiment``: calibration sweep, transfer and batch-size scaling, shared by the CLI and benchmark.
"""

from verinfer.determinism.engine import Engine, Output, Policy, Request, Run, Stats
from verinfer.determinism.model import KVPool, Llama

__all__ = ["Engine", "KVPool", "Llama", "Output", "Policy", "Request", "Run", "Stats"]
