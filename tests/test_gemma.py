"""Gemma-3-270M, the second bundled model, first-class in the main suite (issue #40 item 1).

Another architecture than SmolLM2 in every respect that replay depends on: 262,144 vocabulary entries,
a tied head, 18 layers of which 15 attend over a 512-token sliding window, Gemma's own chat format
(``<start_of_turn>``; the package's GGUF carries none, ``models.load.GEMMA3_CHAT_TEMPLATE``) and
``<end_of_turn>`` as its stop token. Its conversion (about a minute) is done once per cache;
``.ci/run`` keeps it outside the clone.
"""

from __future__ import annotations

import argparse

import numpy as np

from tests.test_served_shapes import shapes
from verinfer import api


def test_gemma_loads_with_its_own_shape_stop_token_and_chat_format(gemma):
    config = gemma.model.config
    assert gemma.vocab_size == 262144 and config.tie_word_embeddings and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == 3 and len(config.layer_types) == 18
    assert gemma.tokenizer.convert_tokens_to_ids("<end_of_turn>") in gemma.stop_ids()
    text = gemma.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                               tokenize=False)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_every_profile_replays_gemma_exactly(gemma):
    """Greedy and every seeded profile (T 0.8 / top-k 50 / top-p 0.95, and T 1 over all 262,144 entries),
    on chat prompts and on one 600-token prompt past the sliding window: 100% of tokens exact in fp32, as
    on SmolLM2 (the served-shapes experiment's replay, on the trained model)."""
    from verinfer.sampling.profiles import profile_names

    results = shapes.run_replay(gemma, argparse.Namespace(n=2, max_tokens=8, seed=4242, long_prompt=600))
    assert {r["profile"] for r in results} == set(profile_names())
    assert not [r for r in results if "skipped" in r]
    assert sum(r["tokens"] for r in results) == (len(results) - 1) * 2 * 8 + 8  # no early stop hides a row
    assert results[-1]["prompt_tokens"] == 600
    assert [(r["case"], r["mismatches"]) for r in results if r["exact"] != r["tokens"]] == []


def test_the_demo_runs_on_gemma_with_its_shipped_bands_and_calibration(gemma, tmp_path):
    """``verinfer demo --model gemma3-270m``, smaller: honest and wrong-seed traces judged by a calibration
    fitted on a separate honest set, an honest and a 4-bit ``verinfer serve`` audited over loopback HTTP
    against Gemma's shipped greedy bands; and the same traces judged by Gemma's own shipped default for
    their settings (``experiments/default_calibrations.py --model gemma3-270m``), not SmolLM2's."""
    from verinfer.demo import run_demo
    from verinfer.prompts import load_prompts

    result = run_demo(gemma, load_prompts("chitchat", 8, seed=0), tmp_path, max_tokens=24, batch_size=8,
                      audit_prompts=8)
    assert result.honest.consistent is True, result.honest.summary.verdict_text
    assert result.wrong_seed.consistent is False, result.wrong_seed.summary.verdict_text
    audited = {a.endpoint.name: a.verdict for a in result.audit.providers}
    assert audited["honest"].consistent and not audited["w4"].consistent, {k: v.text for k, v in audited.items()}
    ok, bad = (api.verify(tmp_path / f"{name}.traces.jsonl", backend=gemma, scores=tmp_path / f"{name}.default.parquet")
               for name in ("honest", "wrong-seed"))
    assert "calibration-gemma3-270m-vllm-t1-k50-p0.95-minp0.json" in (ok.summary.calibration or ""), ok.summary.note
    assert np.asarray(ok.columns["exact_match"], bool).all()
    assert ok.consistent is True, ok.summary.verdict_text
    assert bad.consistent is False, bad.summary.verdict_text
