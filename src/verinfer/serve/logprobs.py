"""Logprobs: the provider's own (``top_logprobs``, ``prompt_logprobs``: log-softmax of the raw logits,
before temperature and filters, as vLLM returns them by default) and the two OpenAI response
formats they are sent in.

Completions (``logprobs: N``): ``{tokens, token_logprobs, top_logprobs, text_offset}``; each
``top_logprobs`` entry maps token strings to logprobs for the top N tokens plus the chosen one (as
vLLM does, so ``logprobs: 0`` still reports the chosen token). With ``echo`` the prompt's tokens
come first and the first prompt token, which nothing predicts, has ``null`` logprob and top entry.
``text_offset`` is the cumulative length of the token strings, as vLLM computes it.

Chat (``logprobs: true``, ``top_logprobs: N``): ``{content: [{token, logprob, bytes, top_logprobs}]}``
with one entry per output token id (``token_ids`` aligned, stop token included).

Token strings are ``tokenizer.decode([id])``; ``return_tokens_as_token_ids`` gives
``"token_id:<id>"`` instead (vLLM's extension), which makes top-logprob keys unambiguous.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import torch

from verinfer.models.backend import Backend
from verinfer.serve.jobs import TokenLogprobs


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """TokenLogprobs rows from a [R, V] log-softmax and the chosen token of each row (top ``k`` kept)."""
    picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    if k > 0:
        vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    else:
        vals = ids = [[] for _ in picked]
    return [TokenLogprobs(int(t), float(p), tuple(i), tuple(v))
            for t, p, i, v in zip(chosen.tolist(), picked, ids, vals)]


def prompt_logprobs(backend: Backend, rows: torch.Tensor, prompt: Sequence[int], k: int,
                    block: int = 512) -> list[TokenLogprobs]:
    """Logprobs of prompt tokens 1 .. L-1 from the prompt's hidden rows (lm_head in row blocks)."""
    out: list[TokenLogprobs] = []
    targets = torch.as_tensor(prompt[1:], dtype=torch.long)
    for lo in range(0, len(prompt) - 1, block):
        hi = min(lo + block, len(prompt) - 1)
        lp = torch.log_softmax(backend.logits(rows[lo:hi]), dim=-1)
        out += top_logprobs(lp, targets[lo:hi], k)
    return out


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (printable bytes map to themselves, the rest to 256+)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Token strings and bytes for one tokenizer (cached: the vocabulary does not change)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def string(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else _decode_one(self.tokenizer, token)

    def bytes(self, token: int) -> list[int]:
        """The token's raw bytes: exact for byte-level BPE and <0xNN> byte tokens, else its UTF-8 text."""
        piece = self.tokenizer.convert_ids_to_tokens(int(token))
        table = _byte_decoder()
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return [int(piece[3:5], 16)]
                except ValueError:
                    pass
            if piece and all(c in table for c in piece) and getattr(self.tokenizer, "is_fast", False) \
                    and _is_byte_level(self.tokenizer):
                return [table[c] for c in piece]
        return list(_decode_one(self.tokenizer, token).encode("utf-8"))


def _decode_one(tokenizer, token: int) -> str:
    return tokenizer.decode([int(token)], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _is_byte_level(tokenizer) -> bool:
    try:
        return type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"
    except AttributeError:
        return False


def completion_logprobs(text: TokenText, entries: Sequence[TokenLogprobs | int]) -> dict[str, Any]:
    """Completions format; a bare int entry is a token without a logprob (the echoed first prompt token)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for e in entries:
        tok = e if isinstance(e, int) else e.token
        s = text.string(tok)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if isinstance(e, int):
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(e.logprob)
        top = {text.string(i): lp for i, lp in zip(e.top_ids, e.top_logprobs)}
        top.setdefault(s, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(text: TokenText, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    content = []
    for e in entries:
        content.append({
            "token": text.string(e.token), "logprob": e.logprob, "bytes": text.bytes(e.token),
            "top_logprobs": [{"token": text.string(i), "logprob": lp, "bytes": text.bytes(i)}
                             for i, lp in zip(e.top_ids, e.top_logprobs)],
        })
    return {"content": content}
