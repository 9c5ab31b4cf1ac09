"""Gemma-3-270M through the same loading path (optional: pip install -e ".[gemma]"; run with -m gemma)."""

import pytest

from verinfer.simulate.generate import generate
from verinfer.models.backend import Backend
from verinfer.simulate.generate import build_requests
from verinfer.prompts import Prompt
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.token_difr import verify_traces

pytestmark = pytest.mark.gemma


def test_gemma_generates_and_verifies():
    backend = Backend.load("gemma3-270m")
    assert backend.vocab_size == 262144 and backend.tokenizer.convert_tokens_to_ids("<end_of_turn>") in backend.stop_ids()
    prompts = [Prompt("g0", (("user", "Name three colours."),)), Prompt("g1", (("user", "What is 2 + 2?"),))]
    params = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=5)
    traces = generate(backend, build_requests(backend, prompts, params), 24, batch_size=2)
    rows = [b.columns["exact_match"] for b in verify_traces(backend, traces)]
    matched = sum(int(r.sum()) for r in rows) / sum(r.size for r in rows)
    assert matched >= 0.95
