"""A greedy serving decoder with dynamic batching, and the MarginGate controller inside it.

Requests arrive at given engine steps, join the running batch while there is a free slot (up to
``max_batch``), and leave when they emit a stop token or reach their token limit; so the batch size,
the padded attention width and the prompts that share a prefill change all the time.

Policies (what a *protected* request gets; unprotected requests always take the fast path):

- ``fast``: batched prefill and batched KV-cache decoding only (no guarantee).
- ``margingate(threshold, commit="repair")``, the paper's rule: the protected request is prefilled
  deterministically; each decode step runs the fast path, and when the top-1/top-2 margin of its
  fast logits is below ``threshold`` the deterministic verifier recomputes that step for it
  (``Llama.decode_det`` without commit). If the verifier's token differs, the engine emits the
  verifier's token and overwrites only the current position's K/V column with the verifier's
  column. ``commit="verified"`` also writes that column when the tokens agree.
- ``margingate(threshold)`` (``commit="window"``, the default): verinfer's exact variant. The gate
  is the same; the verifier recomputes, in one deterministic pass (``Llama.forward_det``), every column since the
  request's last verified one, commits them all, and checks every token emitted since then against
  its own. At the first token it would not have chosen (a flip the gate missed) the request rolls
  back to it: later tokens are dropped and decoding resumes from the verifier's token. When the
  request finishes, the tail after the last trigger is checked the same way. Every emitted token is
  then the deterministic path's token on the deterministic cache, whatever the threshold: the
  threshold only trades verifier launches against rolled-back work. Why: on this CPU in bf16 the
  fast columns that single-column repair leaves in place move the verifier's logits as much as the
  step's own noise (RESULTS.md section 4), so the paper's rule cannot be exact here.
- ``always``: the same verifier and repair on every decode step (LLM-42-style per-token verification);
  ``margingate`` with an infinite threshold. With ``commit="verified"`` (or ``"window"``) every
  committed column is the verifier's, so its output equals the reference by construction.
- ``deterministic``: every request, every step on the deterministic path (global batch invariance).

The reference output of a request is its output under ``deterministic``; it does not depend on
the batch (``tests/test_determinism.py`` proves it), so it equals decoding the request alone.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from verinfer.determinism.model import KVPool, Llama


@dataclass(frozen=True)
class Request:
    id: str
    prompt: tuple[int, ...]
    max_new_tokens: int = 64
    protected: bool = True
    arrival: int = 0  # the engine step from which the request may join the batch


COMMIT_RULES = ("repair", "verified", "window")
COMMIT_SUFFIX = {"window": "", "verified": "/current-column", "repair": "/repair-only"}


@dataclass(frozen=True)
class Policy:
    """``commit`` says what a verified step leaves in the cache: ``"repair"`` overwrites the current
    K/V column only when the verifier's token differs (the paper's rule), ``"verified"`` writes the
    verifier's column on every verified step (LLM-42's rule: the committed state is always the
    verified one, so verifying every step reproduces the deterministic path exactly), ``"window"``
    recomputes and commits every column since the last verified one and rolls back missed flips
    (exact for any threshold; see the module docstring)."""

    mode: str = "fast"  # fast | margingate | deterministic
    threshold: float = 0.0  # margingate: verify a step when its fast top-1/top-2 margin is below this
    commit: str = "window"

    def __post_init__(self):
        if self.mode not in ("fast", "margingate", "deterministic"):
            raise ValueError(f"unknown policy mode {self.mode!r}: use fast, margingate or deterministic")
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.commit not in COMMIT_RULES:
            raise ValueError(f"unknown commit rule {self.commit!r}: use {', '.join(COMMIT_RULES)}")

    @classmethod
    def fast(cls) -> "Policy":
        return cls("fast")

    @classmethod
    def margingate(cls, threshold: float, commit: str = "window") -> "Policy":
        return cls("margingate", float(threshold), commit)

    @classmethod
    def always(cls, commit: str = "window") -> "Policy":
        return cls("margingate", math.inf, commit)

    @classmethod
    def deterministic(cls) -> "Policy":
        return cls("deterministic")

    @property
    def name(self) -> str:
        if self.mode == "margingate":
            base = "always-on" if math.isinf(self.threshold) else f"margingate@{self.threshold:g}"
            if math.isinf(self.threshold) and self.commit != "repair":
                return base  # every step verified: the window and current-column rules coincide
            return base + COMMIT_SUFFIX[self.commit]
        return self.mode


@dataclass
class Output:
    """What one request emitted, with the fast (or deterministic) margin of every step."""

    id: str
    protected: bool
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-1/top-2 margin of the logits that chose token k
    verified: list[bool] = field(default_factory=list)  # the verifier ran for token k
    repaired: list[bool] = field(default_factory=list)  # the verifier changed token k and its K/V column
    finish: str = "length"
    checked: int = 0  # leading tokens chosen on the deterministic path over a verified cache (window rule)
    rollbacks: int = 0  # window rule: missed flips found, each dropping the tokens after it
    cache: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V snapshot at finish (keep_layers)


@dataclass
class Stats:
    steps: int = 0  # engine iterations that decoded
    decode_steps: int = 0  # request-steps of decoding (all requests)
    protected_decode_steps: int = 0
    verifier_steps: int = 0  # request-steps the verifier recomputed
    verifier_calls: int = 0  # verifier invocations (one call covers every request triggered in a step)
    repairs: int = 0
    verifier_rows: int = 0  # positions the verifier recomputed (one per verifier step, more with windows)
    rollbacks: int = 0  # window rule: missed flips found after the fact
    final_checks: int = 0  # window rule: launches that check a finished request's tail (in verifier_steps)
    dropped_tokens: int = 0  # tokens emitted after a missed flip and decoded again
    batch_sizes: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time (steadier than wall time on a shared machine)
    prefill_s: float = 0.0
    fast_s: float = 0.0
    verify_s: float = 0.0
    det_s: float = 0.0

    @property
    def trigger_rate(self) -> float:
        return self.verifier_steps / self.protected_decode_steps if self.protected_decode_steps else 0.0

    @property
    def repair_rate(self) -> float:
        return self.repairs / self.protected_decode_steps if self.protected_decode_steps else 0.0


@dataclass
class Site:
    """Where a fault-injection hook is called: after the fast step, before the gate looks at it."""

    request: Request
    index: int  # output token index the logits choose
    logits: torch.Tensor  # [V] fast logits of this request (a view: edits change what the gate sees)
    pool: KVPool
    slot: int
    pos: int  # the position whose K/V column this step appended
    token_in: int  # the token fed at this step (its K/V column is at ``pos``)


@dataclass
class Run:
    outputs: dict[str, Output]
    stats: Stats
    policy: Policy


def margins_of(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit for each row of [B, V]."""
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


class Engine:
    """Runs a list of requests through one dynamic batch under a policy."""

    def __init__(self, model: Llama, max_batch: int = 8, max_len: int = 1024, stop_ids: set[int] | None = None,
                 keep_layers: Sequence[int] | None = None,
                 observer: Callable[[Request, int, torch.Tensor], None] | None = None,
                 fault: Callable[[Site], None] | None = None):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.model = model
        self.max_batch = max_batch
        self.max_len = max_len
        self.stop_ids = set(stop_ids or ())
        self.keep_layers = list(keep_layers) if keep_layers is not None else None
        self.observer = observer
        self.fault = fault

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], policy: Policy) -> Run:
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        for r in requests:
            if not r.prompt or r.max_new_tokens < 1:
                raise ValueError(f"request {r.id!r} needs a non-empty prompt and max_new_tokens >= 1")
            if len(r.prompt) + r.max_new_tokens > self.max_len:
                raise ValueError(f"request {r.id!r} needs {len(r.prompt) + r.max_new_tokens} positions; "
                                 f"the engine's max_len is {self.max_len}")
        pool = self.model.new_pool(self.max_batch, self.max_len)
        queue = sorted(requests, key=lambda r: r.arrival)  # stable: ties keep the caller's order
        outputs = {r.id: Output(r.id, r.protected) for r in requests}
        running: list[Request] = []  # running[i] owns slot i
        stats = Stats()
        start, cpu_start = time.perf_counter(), time.process_time()
        step = 0
        while queue or running:
            if not running and queue[0].arrival > step:
                step = queue[0].arrival
            joining = []
            while queue and queue[0].arrival <= step and len(running) + len(joining) < self.max_batch:
                joining.append(queue.pop(0))
            if joining:
                t0 = time.perf_counter()
                self._admit(policy, pool, running, joining, outputs)
                stats.prefill_s += time.perf_counter() - t0
                running.extend(joining)
                self._retire(pool, running, outputs)
            if running:
                self._decode(policy, pool, running, outputs, stats)
                self._finalize(policy, pool, running, outputs, stats)
                self._retire(pool, running, outputs)
            step += 1
        stats.wall_s = time.perf_counter() - start
        stats.cpu_s = time.process_time() - cpu_start
        return Run(outputs, stats, policy)

    # ----- one engine iteration -------------------------------------------------------------------

    def _admit(self, policy: Policy, pool: KVPool, running: list[Request], joining: list[Request],
               outputs: dict[str, Output]) -> None:
        model, first = self.model, len(running)
        slots = list(range(first, first + len(joining)))
        det = [policy.mode == "deterministic" or (policy.mode == "margingate" and r.protected) for r in joining]
        logits = torch.empty(len(joining), model.vocab_size)
        batched = [i for i, d in enumerate(det) if not d]
        if batched:
            logits[batched] = model.prefill_fast(pool, [slots[i] for i in batched],
                                                 [list(joining[i].prompt) for i in batched])
        for i, d in enumerate(det):
            if d:
                logits[i] = model.prefill_det(pool, slots[i], list(joining[i].prompt))
        margins = margins_of(logits)
        for i, r in enumerate(joining):
            self._emit(r, outputs[r.id], logits[i], int(logits[i].argmax()), float(margins[i]), det[i], False)
            outputs[r.id].checked = int(det[i])

    def _decode(self, policy: Policy, pool: KVPool, running: list[Request], outputs: dict[str, Output],
                stats: Stats) -> None:
        model, b = self.model, len(running)
        tokens = torch.tensor([outputs[r.id].tokens[-1] for r in running])
        positions = list(pool.lengths[:b])
        stats.steps += 1
        stats.decode_steps += b
        stats.protected_decode_steps += sum(r.protected for r in running)
        stats.batch_sizes.append(b)
        if policy.mode == "deterministic":
            t0 = time.perf_counter()
            logits, _, _ = model.decode_det(pool, list(range(b)), tokens, positions, commit=True)
            stats.det_s += time.perf_counter() - t0
            margins = margins_of(logits)
            for i, r in enumerate(running):
                self._emit(r, outputs[r.id], logits[i], int(logits[i].argmax()), float(margins[i]), True, False)
            return
        t0 = time.perf_counter()
        logits = model.decode_fast(pool, tokens)
        stats.fast_s += time.perf_counter() - t0
        if self.fault is not None:
            for i, r in enumerate(running):
                self.fault(Site(r, len(outputs[r.id].tokens), logits[i], pool, i, positions[i], int(tokens[i])))
        margins = margins_of(logits)
        chosen = logits.argmax(-1).tolist()
        verify = []
        if policy.mode == "margingate":
            verify = [i for i, r in enumerate(running) if r.protected and float(margins[i]) < policy.threshold]
        repaired, decided = set(), {}
        if verify:
            t0 = time.perf_counter()
            if policy.commit == "window":
                decided = self._check_windows(pool, [(i, running[i]) for i in verify], outputs, stats, current=True)
            else:
                vlogits, k_cols, v_cols = model.decode_det(pool, verify, tokens[verify],
                                                           [positions[i] for i in verify], commit=False)
                stats.verifier_rows += len(verify)
                for j, i in enumerate(verify):
                    token = int(vlogits[j].argmax())
                    if token != chosen[i] or policy.commit == "verified":
                        pool.write_column(i, positions[i], k_cols[j], v_cols[j])  # only the current column
                    if token != chosen[i]:  # repair: emit the verifier's token
                        chosen[i] = token
                        repaired.add(i)
            stats.verify_s += time.perf_counter() - t0
            stats.verifier_calls += 1
            stats.verifier_steps += len(verify)
        verified = set(verify)
        for i, r in enumerate(running):
            if i in decided:  # window rule: the verifier decides this request's next token
                if self._settle(pool, i, r, outputs[r.id], *decided[i], stats, fast_token=chosen[i]):
                    repaired.add(i)
                continue
            self._emit(r, outputs[r.id], logits[i], chosen[i], float(margins[i]), i in verified, i in repaired)
        stats.repairs += len(repaired)

    def _check_windows(self, pool: KVPool, items: list[tuple[int, Request]], outputs: dict[str, Output],
                       stats: Stats, current: bool) -> dict[int, tuple[int, torch.Tensor]]:
        """Window rule: recompute, in one deterministic pass, every column since each request's last
        verified one (committing them) and compare every emitted token with the verifier's choice.

        With ``current`` the run ends at this step's input token, so its last row decides the step's
        new token. Returns, per slot, the output index the verifier decides (its first disagreement
        with an emitted token, or the new token) and the verifier's logits for it."""
        slots, runs, starts = [], [], []
        for slot, r in items:
            out = outputs[r.id]
            first = out.checked - 1  # the input token whose column is the first unverified one
            slots.append(slot)
            runs.append(out.tokens[first:len(out.tokens) if current else len(out.tokens) - 1])
            starts.append(len(r.prompt) + first)
        logits, _, _ = self.model.forward_det(pool, slots, runs, starts, commit=True)
        stats.verifier_rows += len(logits)
        decided, row = {}, 0
        for (slot, r), run in zip(items, runs):
            out = outputs[r.id]
            picks = logits[row:row + len(run)].argmax(-1).tolist()
            for j, t in enumerate(picks):
                k = out.checked + j
                if k == len(out.tokens) or out.tokens[k] != t:
                    decided[slot] = (k, logits[row + j])
                    break
            row += len(run)
        return decided

    def _settle(self, pool: KVPool, slot: int, r: Request, out: Output, index: int, vlogits: torch.Tensor,
                stats: Stats, fast_token: int | None = None) -> bool:
        """Emit the verifier's token for output ``index``; an index before the end is a flip the gate
        missed, so the tokens from it on are dropped first. True when it replaced this step's fast
        token (a repair)."""
        missed = index < len(out.tokens)
        if missed:
            self._roll_back(pool, slot, r, out, index, stats)
        token = int(vlogits.argmax())
        self._emit(r, out, vlogits, token, float(margins_of(vlogits[None])[0]), True, missed or token != fast_token)
        out.checked = len(out.tokens)
        return not missed and fast_token is not None and token != fast_token

    def _roll_back(self, pool: KVPool, slot: int, r: Request, out: Output, index: int, stats: Stats) -> None:
        """Drop tokens ``index..`` (the verifier chose another token at ``index``); the cache keeps
        the verified columns up to the input token of ``index``."""
        stats.rollbacks += 1
        stats.dropped_tokens += len(out.tokens) - index
        out.rollbacks += 1
        for seq in (out.tokens, out.margins, out.verified, out.repaired):
            del seq[index:]
        out.finish = "stop" if out.tokens and out.tokens[-1] in self.stop_ids else "length"
        pool.lengths[slot] = len(r.prompt) + index

    def _finalize(self, policy: Policy, pool: KVPool, running: list[Request], outputs: dict[str, Output],
                  stats: Stats) -> None:
        """Window rule: before a protected request leaves, check the tokens after its last trigger;
        a missed flip rolls it back and keeps it running."""
        if policy.mode != "margingate" or policy.commit != "window":
            return
        items = [(i, r) for i, r in enumerate(running)
                 if r.protected and self._finished(r, outputs[r.id]) and outputs[r.id].checked < len(outputs[r.id].tokens)]
        if not items:
            return
        t0 = time.perf_counter()
        decided = self._check_windows(pool, items, outputs, stats, current=False)
        for slot, r in items:
            out = outputs[r.id]
            if slot in decided:
                self._settle(pool, slot, r, out, *decided[slot], stats)
            out.checked = len(out.tokens)
        stats.verify_s += time.perf_counter() - t0
        stats.verifier_calls += 1
        stats.verifier_steps += len(items)
        stats.final_checks += len(items)

    def _finished(self, r: Request, out: Output) -> bool:
        return out.finish == "stop" or len(out.tokens) >= r.max_new_tokens

    def _emit(self, r: Request, out: Output, logits: torch.Tensor, token: int, margin: float, verified: bool,
              repaired: bool) -> None:
        if self.observer is not None:
            self.observer(r, len(out.tokens), logits)
        out.tokens.append(token)
        out.margins.append(margin)
        out.verified.append(verified)
        out.repaired.append(repaired)
        if token in self.stop_ids:
            out.finish = "stop"

    def _retire(self, pool: KVPool, running: list[Request], outputs: dict[str, Output]) -> None:
        """Drop finished requests; the last running request moves into each freed slot."""
        for slot in range(len(running) - 1, -1, -1):
            out = outputs[running[slot].id]
            if self._finished(running[slot], out):
                if self.keep_layers is not None:
                    out.cache = pool.snapshot(slot, self.keep_layers)
                last = len(running) - 1
                if slot != last:
                    pool.move(last, slot)
                    running[slot] = running[last]
                running.pop()
                pool.lengths[last] = 0
