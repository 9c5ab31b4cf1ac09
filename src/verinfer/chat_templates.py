"""Chat templates a provider may have applied instead of the claimed model's own (issue #41 item 1: a
changed chat template, tested against the traces with the claimed prompt as the null).

A server started without the model's template, or with another family's, renders the same messages into
other tokens: the model then answers another prompt, and no sampler or weight change reproduces its
tokens. Each template here renders a request's messages as that format is published (the rendered text
is tokenized by the claimed model's tokenizer, so another family's markers become plain text, as they
do when such a server is misconfigured):

- ``plain``: no template: the contents joined by newlines (what a server without a chat template, or a
  completion endpoint, sends; the tokenizer's own BOS rule applies);
- ``no-generation-prompt``: the model's own template without the assistant header;
- ``chatml``: ChatML without a default system message (the generic template engines fall back to);
- ``llama-3``: Meta Llama 3's header format;
- ``gemma``: Gemma's turns (a system message merged into the first user turn);
- ``mistral``: Mistral's ``[INST]`` format (a system message prepended to the first user turn);
- ``alpaca``: the Alpaca instruction format.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

Messages = Sequence[Mapping[str, str]]


def _merged(messages: Messages) -> list[tuple[str, str]]:
    """(role, content) with a leading system message merged into the first user turn (formats without a
    system role)."""
    pairs = [(m["role"], m["content"]) for m in messages]
    if len(pairs) > 1 and pairs[0][0] == "system" and pairs[1][0] == "user":
        return [("user", f"{pairs[0][1]}\n\n{pairs[1][1]}"), *pairs[2:]]
    return [("user" if r == "system" else r, c) for r, c in pairs]


def _chatml(messages: Messages) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"


def _llama3(messages: Messages) -> str:
    return "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages) + \
        "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _gemma(messages: Messages) -> str:
    turns = "".join(f"<start_of_turn>{'model' if r == 'assistant' else 'user'}\n{c}<end_of_turn>\n"
                    for r, c in _merged(messages))
    return f"<bos>{turns}<start_of_turn>model\n"


def _mistral(messages: Messages) -> str:
    return "<s>" + "".join(f"[INST] {c} [/INST]" if r == "user" else f"{c}</s>" for r, c in _merged(messages))


def _alpaca(messages: Messages) -> str:
    pairs = [(m["role"], m["content"]) for m in messages]
    system = "".join(f"{c}\n\n" for r, c in pairs if r == "system")
    turns = "".join(f"### Instruction:\n{c}\n\n" if r == "user" else f"### Response:\n{c}\n\n"
                    for r, c in pairs if r != "system")
    return f"{system}{turns}### Response:\n"


TEXT_TEMPLATES: dict[str, Callable[[Messages], str]] = {
    "chatml": _chatml, "llama-3": _llama3, "gemma": _gemma, "mistral": _mistral, "alpaca": _alpaca}
TEMPLATES = ("plain", "no-generation-prompt", *TEXT_TEMPLATES)
DESCRIBED = {"plain": "no chat template (the messages as plain text)",
             "no-generation-prompt": "the model's chat template without the assistant header",
             "chatml": "the ChatML chat template without a default system message",
             "llama-3": "the Llama 3 chat template", "gemma": "the Gemma chat template",
             "mistral": "the Mistral [INST] chat template", "alpaca": "the Alpaca instruction format"}


def renderable(messages: object) -> bool:
    """Whether ``messages`` can be rendered: a non-empty list of messages with a text role and content (not
    OpenAI's content parts)."""
    return bool(messages) and isinstance(messages, (list, tuple)) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def rendered(tokenizer, messages: Messages, name: str) -> list[int]:
    """The messages' prompt ids under template ``name`` (``TEMPLATES``), tokenized by ``tokenizer``."""
    if not renderable(messages):
        raise ValueError(f"chat template {name}: every message needs a text role and content")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if name == "plain":
        return tokenizer.encode("\n".join(m["content"] for m in messages))
    if name == "no-generation-prompt":
        if not tokenizer.chat_template:
            raise ValueError("chat template no-generation-prompt: the tokenizer has no chat template")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    if name not in TEXT_TEMPLATES:
        raise ValueError(f"unknown chat template {name!r} (known: {', '.join(TEMPLATES)})")
    return tokenizer.encode(TEXT_TEMPLATES[name](messages), add_special_tokens=False)


__all__ = ["DESCRIBED", "TEMPLATES", "renderable", "rendered"]
