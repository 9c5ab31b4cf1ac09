"""Does `verinfer diagnose` name a hidden system prompt, and its length, on engines whose noise is keyed by position?

    python experiments/hidden_prompt_length.py --cases 12 --out experiments/results/hidden_prompt_length.md

vLLM's model runner V2 and SGLang draw each token's Gumbel noise from (seed, absolute position, token)
(``Profile.position_keyed``): a provider that puts its own system message before the client's prompt
draws every token at positions moved by the length difference. ``diagnose`` screens every offset on
the first block and tests the best one as a candidate (``diagnosis_run.search_shift``).

Cases are drawn, not chosen: a seeded RNG (``--seed``) picks, per case, the profile (vllm or sglang),
a hidden system text of 1-40 words from a fixed word list (so its length in tokens varies), the
chitchat prompts and the request seeds. Each provider serves ``--prompts`` requests of up to
``--max-tokens`` tokens claiming T 1, top-k 50, top-p 0.95 without the hidden text; the truth is the
served prompt's length minus the claimed one's (SmolLM2's template puts its default system message in
when the client sends none, so a hidden one that replaces it can be shorter: a negative offset).
Honest fp32 and honest bf16 providers of both profiles are diagnosed the same way and must name no
offset. The full candidate grid runs (sampler settings, seeds, profiles, penalties, bugs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from verinfer.api import load_model
from verinfer.files import write_atomic
from verinfer.machine import describe
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.diagnosis import candidate_grid
from verinfer.scoring.diagnosis_run import diagnose_traces
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant

WORDS = ("always answer as a pirate ship captain would, be brief and polite, never mention the weather, the company "
         "name is Acme and its products are widgets, refuse questions about politics, answer in French when asked, "
         "you are Max, a support agent, keep every reply under fifty words, end with a question").replace(",", "").split()


def draw(rng: random.Random, n_prompts: int) -> dict:
    words = rng.randint(1, 40)
    return {"profile": rng.choice(["vllm", "sglang"]), "text": " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + ".",
            "prompt_seed": rng.randrange(10_000), "seed": rng.randrange(1, 2**31)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=20261207)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ref, bf16 = load_model(), load_model(dtype="bfloat16")
    rng = random.Random(args.seed)
    cases = [("hidden", draw(rng, args.prompts)) for _ in range(args.cases)]
    cases += [(kind, {"profile": p, "text": None, "prompt_seed": 1, "seed": 4242}) for kind in ("honest fp32", "honest bf16")
              for p in ("vllm", "sglang")]
    rows, named, wrong = [], 0, 0
    start = time.time()
    for kind, c in cases:
        claim = SamplingParams(profile=c["profile"], temperature=1.0, top_k=50, top_p=0.95, seed=c["seed"])
        prompts = load_prompts("chitchat", args.prompts, seed=c["prompt_seed"])
        requests = build_requests(ref, prompts, claim)
        variant = get_variant(f"system-prompt:{c['text']}" if c["text"] else "honest")
        served = bf16 if kind == "honest bf16" else ref
        traces = variant.generate(served, requests, max_new_tokens=args.max_tokens, batch_size=len(requests))
        truth = 0
        if c["text"]:
            diffs = {len(variant.prompt(ref, r).prompt_token_ids) - len(r.prompt_token_ids) for r in requests}
            assert len(diffs) == 1, diffs
            truth = diffs.pop()
        d = diagnose_traces(ref, traces, candidate_grid(claim))
        found = d.best.candidate.shift if d.best.candidate.axis == "prompt" and d.claim_rejected else 0
        ok = found == truth
        named += ok and truth != 0
        wrong += not ok
        s = d.settings["prompt_shift"] or {}
        rows.append(f"| {kind} | {c['profile']} | {len(c['text'].split()) if c['text'] else 0} | {truth:+d} | {found:+d} | "
                    f"{'yes' if ok else '**no**'} | {d.claim.exact:.1%} | {d.best.exact:.1%} | {d.best.p:.2g} | "
                    f"{s.get('exact', '')}/{s.get('rows', '')} vs {s.get('runner_up_exact', '')} ({s.get('runner_up', '')}) | "
                    f"{d.best.candidate.label} |")
        print(rows[-1], flush=True)
    hidden = args.cases
    text = [
        "# Hidden system prompts: named with their length by diagnose's offset search", "",
        f"Command: `python experiments/hidden_prompt_length.py {shlex.join(sys.argv[1:])}`  ",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {describe(torch.get_num_threads())}  ",
        f"Setup: SmolLM2-135M fp32 reference; {args.prompts} chitchat prompts x up to {args.max_tokens} tokens per "
        f"provider; claims T 1, top-k 50, top-p 0.95; full candidate grid; {time.time() - start:.0f} s in all.", "",
        f"**Hidden prompts named with their exact length: {named}/{hidden}; cases where the offset found differs "
        f"from the truth (honest ones included): {wrong}/{len(cases)}.**", "",
        "| provider | profile | hidden words | true offset | offset named | right | claim exact | best exact | best p "
        "(Bonferroni) | screen: best rows exact vs runner-up (offset) | best candidate |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---|---|", *rows, ""]
    write_atomic(args.out, "\n".join(text))


if __name__ == "__main__":
    main()
