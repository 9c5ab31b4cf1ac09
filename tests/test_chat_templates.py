"""Other chat templates a provider may render the messages with (``verinfer.chat_templates``)."""

from __future__ import annotations

import pytest

from verinfer.chat_templates import DESCRIBED, TEMPLATES, rendered

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    from verinfer.api import load_model

    return load_model().tokenizer


def test_each_template_renders_its_published_format(tokenizer):
    text = {name: tokenizer.decode(rendered(tokenizer, MESSAGES, name)) for name in TEMPLATES}
    assert text["chatml"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert text["llama-3"] == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                               "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert text["gemma"] == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert text["mistral"] == "<s>[INST] Be brief.\n\nHi [/INST]"
    assert text["alpaca"] == "Be brief.\n\n### Instruction:\nHi\n\n### Response:\n"
    assert text["plain"] == "Be brief.\nHi"
    own = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert own == text["no-generation-prompt"] + "<|im_start|>assistant\n"
    assert set(DESCRIBED) == set(TEMPLATES)


def test_the_models_own_markers_stay_special_tokens_and_bad_messages_are_refused(tokenizer):
    """ChatML's markers are SmolLM2's special tokens, so its ChatML rendering without a system message is
    the model's own template less the default system block, token for token."""
    user = [{"role": "user", "content": "Hi"}]
    own = tokenizer.encode(tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)
    chatml = rendered(tokenizer, user, "chatml")
    assert own[-len(chatml):] == chatml and len(own) > len(chatml)
    with pytest.raises(ValueError, match="unknown chat template 'vicuna'"):
        rendered(tokenizer, user, "vicuna")
    with pytest.raises(ValueError, match="needs a text role and content"):
        rendered(tokenizer, [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "chatml")


def test_the_chat_template_variant_serves_other_prompts_and_names_unknown_templates():
    from verinfer.simulate.variants import get_variant

    assert get_variant("chat-template:gemma").settings == {"chat_template": "gemma"}
    with pytest.raises(ValueError, match="unknown template 'nope'"):
        get_variant("chat-template:nope")


def test_the_template_search_skips_traces_without_text_messages():
    """Traces recorded without messages, or with content parts instead of text, are not re-rendered (the
    search returns None before any model is needed)."""
    import numpy as np

    from verinfer.sampling.params import SamplingParams
    from verinfer.scoring.diagnosis_run import search_template
    from verinfer.trace import Trace

    parts = Trace("a", "m", [1, 2], [3], SamplingParams(), messages=[{"role": "user", "content": [{"type": "text"}]}])
    bare = Trace("b", "m", [1, 2], [3], SamplingParams())
    for traces in ([parts], [bare]):
        assert search_template(None, traces, np.zeros(1), np.array([0, 1]), 0.1, 1e-4, 4096, 512) is None
