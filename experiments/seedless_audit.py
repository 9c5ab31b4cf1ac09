"""Queries and tokens each audit mode needs for a 1%-FPR verdict, with and without seeds.

    python experiments/seedless_audit.py --out experiments/results/seedless_audit.md

For each provider configuration (honest fp32, 4-bit and 8-bit weights, fp8 KV cache, sampling at
T = 1.1 while claiming T = 1, a hidden system prompt (``system-prompt:TEXT``), a smaller model of
the same family with the same tokenizer (``layers-N``: the first N of the 30 decoder layers), and
the greedy-only cheat ``greedy-honest:w4``) the provider
simulator generates, on the same chitchat prompts, n sampled completions per prompt at T = 1 with
known seeds (the ``torch-exponential`` sampler) and one greedy completion per prompt. Every mode
judges them with the verdict the audit uses, looked at on doubling prefixes at FPR / looks:

- ``seeded`` (Token-DiFR): the first completion of each prompt replayed under its seed; mean
  clipped margin against an honest band of the honest provider's other completions (other seeds);
- ``greedy``: the greedy completions against the shipped greedy bands (fp32 and bf16 honest);
- ``rank`` (RUT): the first completion's rank among m reference draws (``verinfer.auditing.rank``);
- ``mmd`` (Model Equality Testing): all n completions against n reference draws per prompt;
- ``logprobs`` (LOGIC): the first completion's top-5 logprobs as the provider would return them
  (the raw log-softmax of the provider's own model at each position, the sampled token first)
  against the reference's for the same tokens (``verinfer.auditing.logprobs``).

``greedy-honest:w4`` needs no generation of its own: its greedy traffic is the honest provider's
and its sampled traffic the 4-bit one's, which is what ``verinfer serve --misconfig
greedy-honest:w4`` does (``tests/test_serve_stream.py``). "Completions needed" is the number of
provider completions up to the first look that rejects (requests: the same for ``rank``,
``seeded`` and ``greedy``; completions / n for ``mmd``, which asks with ``n``). One run per cell,
no repetitions: the table is an illustration of the sizes involved, not a power estimate.

Generated traces and reference draws are cached under ``$VERINFER_CACHE/experiments/seedless_audit``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from verinfer.auditing.bands import find_bands
from verinfer.auditing.draws import completion_scores, reference_draws
from verinfer.auditing.logprobs import logprob_verdict, provider_values, reference_values, returned_logprobs
from verinfer.auditing.mmd import mmd_verdict
from verinfer.auditing.plan import AuditSpec
from verinfer.auditing.rank import rank_p_values, rank_verdict
from verinfer.auditing.store import ResponseStore
from verinfer.files import write_atomic
from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.models.load import cache_root
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.traces import score_traces
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant
from verinfer.stats.pooling import MARGIN_CLIP, finite_percentile, sequence_stats
from verinfer.stats.verdict import Verdict, pooled_verdict
from verinfer.trace import read_traces, write_traces

MODES = ("seeded", "greedy", "rank", "mmd", "logprobs")
TOP_LOGPROBS = 5
CHEAT = "greedy-honest:w4"


def traces(backend, built, variant: str, requests, max_tokens: int, path: Path):
    """A variant's traces for ``requests``, generated once and cached."""
    if path.exists():
        return read_traces(path)
    out = get_variant(variant).generate(backend, requests, max_tokens, 16, backend=built)
    write_traces(out, path)
    return out


def needed(v: Verdict, tokens: np.ndarray, per_unit: int) -> tuple[int | None, int | None]:
    """(completions, tokens) up to the first rejecting look, from per-unit token counts."""
    if v.consistent or v.tokens_needed is None:
        return None, None
    k = int(np.searchsorted(np.cumsum(tokens), v.tokens_needed) + 1)
    return k * per_unit, int(v.tokens_needed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--samples", type=int, default=9, help="reference draws per prompt (rank)")
    ap.add_argument("--per-prompt", type=int, default=4, help="provider completions per prompt (mmd; the first "
                    "is the one rank and seeded judge)")
    ap.add_argument("--variants", default="honest,w4,w8,fp8-kv,temperature-1.1")
    ap.add_argument("--fpr", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/seedless_audit.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started, t0 = dt.datetime.now(dt.timezone.utc), time.time()
    load = os.getloadavg()[0]
    backend = Backend.load("smollm2-135m")
    prompts = load_prompts("chitchat", args.n, seed=21)
    n, L, m = args.per_prompt, args.max_tokens, args.samples
    cache = cache_root() / "experiments" / "seedless_audit" / f"n{args.n}-t{L}-k{n}"
    cache.mkdir(parents=True, exist_ok=True)
    sampled = SamplingParams(profile="torch-exponential", temperature=1.0, seed=50_000)
    seeded_reqs = build_requests(backend, prompts, sampled, seed_stride=n)
    requests = [r.__class__(f"{r.id}#{j}", r.prompt_token_ids, r.params.with_(seed=r.params.seed + j), r.messages)
                for r in seeded_reqs for j in range(n)]  # prompt i, completion j: seed 50000 + i * n + j
    greedy_reqs = build_requests(backend, prompts, SamplingParams(profile="greedy", temperature=0.0))
    prompt_ids = [list(r.prompt_token_ids) for r in seeded_reqs]
    store = ResponseStore(cache / "draws.jsonl")
    draws = reference_draws(backend, [(r.id, r.prompt_token_ids) for r in seeded_reqs], sampled.with_(seed=None),
                            m, 7, L, store, batch_size=32, on_stage=print)
    ref_scores = [completion_scores(backend, [p] * m, d, sampled).logprob for p, d in zip(prompt_ids, draws)]
    greedy_bands = find_bands(backend.model_id, AuditSpec(mode="greedy").signature())

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    data: dict[str, dict] = {}
    for name in variants:
        print(f"{name}: generating", flush=True)
        built = get_variant(name).build(backend)
        stem = re.sub(r"[^\w.+-]", "_", name)  # system-prompt:TEXT holds spaces and a colon
        s = traces(backend, built, name, requests, L, cache / f"{stem}.sampled.jsonl")
        g = traces(backend, built, name, greedy_reqs, L, cache / f"{stem}.greedy.jsonl")
        print(f"{name}: scoring", flush=True)
        data[name] = {"sampled": [[list(t.output_token_ids) for t in s[i * n:(i + 1) * n]] for i in range(args.n)],
                      "first": [s[i * n] for i in range(args.n)], "rest": [t for i, t in enumerate(s) if i % n],
                      "greedy": score_traces(backend, g).columns}
        data[name]["seeded"] = score_traces(backend, data[name]["first"]).columns
        rewrite = get_variant(name).prompt  # a hidden system prompt: the provider's model sees another prompt
        seen = [list(rewrite(built, r).prompt_token_ids) for r in seeded_reqs] if rewrite else prompt_ids
        data[name]["logprobs"] = returned_logprobs(built, prompt_ids, [seq[0] for seq in data[name]["sampled"]], seen,
                                                   TOP_LOGPROBS)
    if "honest" not in data:
        raise SystemExit("--variants must include honest (its other completions are the seeded band)")
    band_cols = score_traces(backend, data["honest"]["rest"]).columns
    spread = finite_percentile(band_cols["margin"], 99.9)
    seeded_clip = float(spread) if spread > 0 else MARGIN_CLIP
    seeded_band = sequence_stats(band_cols, seeded_clip)
    if "w4" in data:
        data[CHEAT] = {**data["w4"], "greedy": data["honest"]["greedy"]}

    rows = []
    for name, d in data.items():
        firsts = [seq[0] for seq in d["sampled"]]
        obs = completion_scores(backend, prompt_ids, firsts, sampled).logprob
        u = rank_p_values(obs, ref_scores, np.random.default_rng(0))
        first_tokens = np.array([len(f) for f in firsts])
        seeded_seq = sequence_stats(d["seeded"], seeded_clip)
        greedy_seq = sequence_stats(d["greedy"], greedy_bands.clip)
        verdicts = {
            "seeded": (pooled_verdict(seeded_seq, [seeded_band], args.fpr, clip=seeded_clip), seeded_seq[:, 0], 1),
            "greedy": (pooled_verdict(greedy_seq, greedy_bands.honest_bands(), args.fpr, clip=greedy_bands.clip),
                       greedy_seq[:, 0], 1),
            "rank": (rank_verdict(u, first_tokens, m, args.fpr), first_tokens, 1),
            "mmd": (mmd_verdict(d["sampled"], [dr[:n] for dr in draws], L, args.fpr),
                    np.array([sum(len(x) for x in seqs) for seqs in d["sampled"]]), n),
            "logprobs": (logprob_verdict(provider_values(d["logprobs"]), reference_values(backend, d["logprobs"]),
                                         first_tokens, args.fpr), first_tokens, 1),
        }
        row = {"provider": name}
        for mode, (v, tokens, per) in verdicts.items():
            completions, toks = needed(v, tokens, per)
            row[mode] = {"consistent": v.consistent, "p": v.p_value, "statistic": v.statistic,
                         "completions_needed": completions, "tokens_needed": toks,
                         "completions": int(len(tokens) * per), "tokens": int(tokens.sum())}
        rows.append(row)
        print(name, {k: ("ok" if row[k]["consistent"] else f"flagged@{row[k]['completions_needed']}")
                     for k in MODES}, flush=True)

    def cell(r: dict) -> str:
        if r["consistent"]:
            return f"not flagged (p = {r['p']:.2g})"
        return f"**{r['completions_needed']} / {r['tokens_needed']}** (p = {r['p']:.2g})"

    command = "python experiments/seedless_audit.py " + shlex.join(sys.argv[1:])
    lines = [
        "# Queries to a 1%-FPR verdict, by audit mode", "",
        f"Command: `{command}`", "",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(args.threads)}; load average at start "
        f"{load:.1f}; took {time.time() - t0:.0f} s.", "",
        f"Model smollm2-135m (fp32 reference); {args.n} chitchat prompts (prompt seed 21), up to {L} new tokens; "
        f"sampled at T = 1 (no top-k/top-p), {n} completions per prompt; rank: {m} reference draws per prompt; "
        f"mmd: {n} reference draws per prompt. Seeded band: the honest provider's other {len(seeded_band)} "
        f"completions (clip {seeded_clip:.4g}); greedy: the shipped greedy bands (fp32 and bf16 honest). "
        f"One run per cell.", "",
        "Cells: completions / tokens up to the first rejecting look (mmd: completions = requests x n), or "
        "'not flagged' with the sequential p-value over all of them "
        f"({args.n} completions for seeded, greedy, rank and logprobs; {args.n * n} for mmd).", "",
        "| provider | seeded Token-DiFR | greedy | rank (RUT) | mmd (MET) | logprobs (LOGIC) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['provider']} | " + " | ".join(cell(r[k]) for k in MODES) + " |" for r in rows]
    lines += ["", "```json", json.dumps(rows, indent=1), "```", ""]
    write_atomic(args.out, "\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
