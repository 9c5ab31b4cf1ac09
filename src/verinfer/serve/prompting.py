"""Prompt token ids as the server sees them and as it reports them.

For an honest server both are the same. ``system-prompt:TEXT`` makes them differ (the model sees
the injection, the client is told it did not happen); ``old-template`` changes both alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from verinfer.prompts import Prompt, inject_system, render, system_prefix_ids
from verinfer.serve.config import PLAIN_CHATML, Misconfiguration


@dataclass(frozen=True)
class PromptIds:
    actual: tuple[int, ...]  # what the model is fed
    reported: tuple[int, ...]  # what the API returns as prompt_token_ids

    @property
    def hidden_prefix(self) -> int:
        """Leading actual tokens the client is not told about (completions injection), else 0."""
        n = len(self.actual) - len(self.reported)
        return n if n > 0 and self.actual[n:] == self.reported else 0


def _render_chat(tokenizer, messages: Sequence[dict[str, str]], old_template: bool) -> tuple[int, ...]:
    if not old_template:
        pairs = tuple((m["role"], m["content"]) for m in messages)
        return tuple(render(tokenizer, Prompt("request", pairs)))
    text = tokenizer.apply_chat_template(list(messages), chat_template=PLAIN_CHATML, add_generation_prompt=True,
                                         tokenize=False)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt(tokenizer, messages: Sequence[dict[str, str]], mis: Misconfiguration) -> PromptIds:
    reported = _render_chat(tokenizer, messages, mis.old_template)
    if mis.system_prompt is None:
        return PromptIds(reported, reported)
    return PromptIds(_render_chat(tokenizer, inject_system(messages, mis.system_prompt), mis.old_template), reported)


def completion_prompt(tokenizer, client_ids: Sequence[int], mis: Misconfiguration) -> PromptIds:
    reported = tuple(client_ids)
    if mis.system_prompt is None:
        return PromptIds(reported, reported)
    return PromptIds(tuple(system_prefix_ids(tokenizer, mis.system_prompt)) + reported, reported)
