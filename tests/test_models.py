"""Model loading offline: packaged GGUF (cached), local directories, clear errors otherwise."""

import pytest
import torch

from verinfer.models.backend import Backend, parse_dtype
from verinfer.models.load import ModelNotAvailable, local_dir, resolve


def test_default_model_is_cached_as_safetensors(backend):
    directory = local_dir(resolve("smollm2-135m"))
    assert (directory / "model.safetensors").exists() and (directory / "verinfer.json").exists()
    assert backend.model_id == "smollm2-135m" and backend.vocab_size == 49152
    assert backend.tokenizer.chat_template and backend.stop_ids()


def test_local_directory_loads_the_same_model(backend):
    directory = local_dir(resolve("smollm2-135m"))
    other = Backend.load(str(directory))
    ids = torch.tensor([[1, 9690, 198, 28, 29]])
    assert torch.equal(backend.logits(backend.hidden(ids, None)[0]), other.logits(other.hidden(ids, None)[0]))


def test_bf16_backend_differs_slightly(backend):
    bf = Backend.load("smollm2-135m", "bf16")
    ids = torch.tensor([[1, 9690, 198, 28, 29, 30, 31]])
    a, b = backend.logits(backend.hidden(ids, None)[0]), bf.logits(bf.hidden(ids, None)[0])
    diff = (a - b).abs().max().item()
    assert 1e-3 < diff < 5.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no-such-model", "unknown model 'no-such-model'"),
        ("/nonexistent/file.gguf", "GGUF file not found"),
        ("someorg/not-cached-model", "not available offline"),
    ],
)
def test_unavailable_models_say_why(spec, message):
    with pytest.raises(ModelNotAvailable, match=message):
        Backend.load(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotAvailable, match="has no config.json"):
        resolve(str(tmp_path))


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        parse_dtype("int3")


def test_a_gemma3_tokenizer_without_a_chat_template_gets_gemmas_turn_format(backend):
    """The gemma3-270m GGUF package carries no chat template, and chat prompts were tokenized as plain
    text (issue #40 item 1): the loader gives a Gemma 3 tokenizer Gemma's turn format; others keep theirs."""
    import copy

    from verinfer.models.load import with_chat_template

    msgs = [{"role": "system", "content": "Be terse. "}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    tok = copy.deepcopy(backend.tokenizer)
    tok.chat_template = None
    text = with_chat_template(tok, "gemma3_text").apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (f"{tok.bos_token}<start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello"
                    "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    plain = copy.deepcopy(backend.tokenizer)
    plain.chat_template = None
    assert with_chat_template(plain, "llama").chat_template is None  # no format is invented for other families
    assert with_chat_template(backend.tokenizer, "gemma3").chat_template == backend.tokenizer.chat_template
