"""What a reference API costs the rank test in power: exact scores against what the API returns.

    python experiments/remote_reference_power.py --out experiments/results/remote_reference_power.md

With ``--reference-url`` (``verinfer.auditing.remote_reference``) the reference's draws are exact
samples (the API samples them), but the rank test's score (the centred log-probability,
``draws.CompletionScores``) needs each position's expectation under the whole distribution, and the
API returns only the top 20 logprobs and the claimed token's. This experiment scores the very same
completions and draws both ways from one prefill of the local reference: exactly (``api_view`` over
the whole vocabulary, equal to ``completion_scores``: tests/test_remote_reference.py) and as the API
would see them (``api_view`` with k = 20, then ``position_moments``), and reports the rank test's
rejection rate at 1% FPR with each. (The draws-free surprise test is not measured: its exact null
needs each position's cumulant generating function under the whole distribution, which an API's top
20 cannot give, so ``--mode surprise`` is refused against a reference API.)

Pools (the in-process provider simulator, cached under ``$VERINFER_CACHE/studies/remote_reference``):
``--prompts`` chitchat prompts (prompt seed 22), ``--per-prompt`` completions each at T = 1, up to
``--max-tokens`` tokens, from honest fp32, 4-bit weights (w4) and temperature 1.1 claimed as 1.0;
``--samples`` reference draws per completion (``draws.reference_draws``). A budget of B queries is B
completions; each cell resamples B of them without replacement ``--resamplings`` times (the pool is
small, so cells at larger B are correlated draws of few distinct sets).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from verinfer.auditing.draws import CompletionScores, reference_draws
from verinfer.auditing.rank import rank_p_values, rank_score, rank_verdict, split
from verinfer.auditing.remote_reference import ECHO_TOP, api_view, position_moments
from verinfer.auditing.store import ResponseStore
from verinfer.files import write_atomic
from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.models.load import cache_root
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import Request, build_requests
from verinfer.simulate.variants import get_variant

CLAIMED = SamplingParams(profile="torch-exponential", temperature=1.0)
VARIANTS = {"honest fp32": "honest", "4-bit (w4)": "w4", "temperature 1.1": "temperature-1.1"}
BUDGETS = (10, 25)


@torch.inference_mode()
def both_scores(backend, prompt_ids, outputs, params: SamplingParams, k: int = ECHO_TOP):
    """(exact, API-view) CompletionScores of ``outputs`` after ``prompt_ids`` from one prefill."""
    sums = np.zeros((2, 3, len(outputs)))
    seqs = [list(p) + list(o) for p, o in zip(prompt_ids, outputs)]
    starts = [len(p) for p in prompt_ids]
    for block in backend.prefill(seqs, starts, token_budget=2048, row_block=128):
        rows = torch.log_softmax(block.logits.double(), dim=-1).numpy()
        items = block.items.numpy()
        targets = np.array([seqs[i][starts[i] + s] for i, s in zip(items.tolist(), block.steps.tolist())])
        for view, width in enumerate((rows.shape[1], k)):
            for part, values in enumerate(position_moments(*api_view(rows, targets, width), params)):
                np.add.at(sums[view, part], items, values)
    tokens = np.array([len(o) for o in outputs])
    return tuple(CompletionScores(s[0], s[1], s[2], tokens) for s in sums)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--per-prompt", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--resamplings", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/remote_reference_power.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    backend = Backend.load("smollm2-135m")
    c, m, L = args.per_prompt, args.samples, args.max_tokens
    cache = cache_root() / "studies" / "remote_reference" / f"p{args.prompts}-c{c}-t{L}-m{m}"
    base = build_requests(backend, load_prompts("chitchat", args.prompts, seed=22, distinct=True),
                          CLAIMED.with_(seed=60_000), seed_stride=c)
    units = [Request(f"{r.id}#{j}", r.prompt_token_ids, r.params.with_(seed=r.params.seed + j), r.messages)
             for r in base for j in range(c)]
    prompt_ids = [list(u.prompt_token_ids) for u in units]
    draws = reference_draws(backend, [(u.id, u.prompt_token_ids) for u in units], CLAIMED, m, 9, L,
                            ResponseStore(cache / "draws.jsonl"), on_stage=print)
    exact_d, api_d = both_scores(backend, [p for p in prompt_ids for _ in range(m)], [o for d in draws for o in d],
                                 CLAIMED)
    print(f"draws drawn and scored ({time.time() - started:.0f} s)", flush=True)
    rng = np.random.default_rng(0)
    lines = []
    ranked = {"exact": split(rank_score(exact_d), [m] * len(units)), "api": split(rank_score(api_d), [m] * len(units))}
    for label, name in VARIANTS.items():
        variant = get_variant(name)
        traces = variant.generate(backend, units, L, 16, backend=variant.build(backend))
        outputs = [list(t.output_token_ids) for t in traces]
        exact, api = both_scores(backend, prompt_ids, outputs, CLAIMED)
        tokens = np.array([len(o) for o in outputs])
        row = []
        for budget in BUDGETS:
            if budget > len(units):
                row.append("-")
                continue
            rejected = {kind: 0 for kind in ("exact", "api")}
            for _ in range(args.resamplings):
                pick = rng.choice(len(units), size=budget, replace=False)
                tie = int(rng.integers(1 << 31))
                for kind, own in (("exact", exact), ("api", api)):
                    u = rank_p_values(rank_score(own)[pick], [ranked[kind][i] for i in pick], np.random.default_rng(tie))
                    rejected[kind] += not rank_verdict(u, tokens[pick], m, 0.01).consistent
            row.append(" / ".join(f"{rejected[kind] / args.resamplings:.3f}" for kind in ("exact", "api")))
        gap = float(np.mean(np.abs(exact.expected - api.expected) / np.maximum(exact.tokens, 1)))
        lines.append(f"| {label} | " + " | ".join(row) + f" | {gap:.4f} |")
        print(lines[-1], flush=True)
    command = "python experiments/remote_reference_power.py " + shlex.join(sys.argv[1:])
    text = "\n".join([
        "# Rank test power: exact scores vs a reference API's top-20 view",
        "",
        f"`{command}` ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {time.time() - started:.0f} s; "
        f"{describe(1)})",
        "",
        f"{args.prompts} chitchat prompts x {c} completions = {len(units)} completions per provider, T = 1, "
        f"{L} tokens, {m} reference draws each, {args.resamplings} resamplings per cell, 1% FPR. "
        "Each cell: the exact rank test's rejection rate with exact scores / with the API's top-20 view "
        "(`position_moments`). "
        "Last column: mean |exact - approximated| expectation per token.",
        "",
        "| provider | " + " | ".join(f"rank, {b} queries" for b in BUDGETS) + " | expectation gap / token |",
        "|---|" + "---|" * (len(BUDGETS) + 1),
        *lines, ""])
    write_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
