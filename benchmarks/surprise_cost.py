"""What the surprise test's exact null costs per query: scoring with and without its tilts.

Usage: python benchmarks/surprise_cost.py [--prompts N] [--completions C] [--new-tokens L] [--repeats R]

The surprise mode scores each provider completion with one prefill of the reference
(``verinfer.auditing.draws.completion_scores``). Its test martingale (``verinfer.auditing.surprise``)
also needs, at every scored position, the cumulant generating function of the centred
log-probability at each of ``surprise.TILTS`` (one exp and one sum over the vocabulary per tilt).
Both sides score the same completions (``--prompts`` chitchat prompts x ``--completions`` honest
completions sampled once, T = 1, up to ``--new-tokens`` tokens):

    plain    ``completion_scores(...)``: log-probability, mean and variance (the old z-test's cost)
    tilted   ``completion_scores(..., tilts=TILTS)``: the same, plus the cgf at every tilt

and the script checks that both give the same log-probabilities, then prints completions per second
(CPU and wall time), seconds per completion, and the ratio tilted / plain, sides alternating.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verinfer.auditing.draws import completion_scores  # noqa: E402
from verinfer.auditing.surprise import TILTS  # noqa: E402
from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.prompts import load_prompts, render  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402
from verinfer.simulate.generate import Request, decode_batch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--completions", type=int, default=4, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "surprise_cost.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started, load = dt.datetime.now(dt.timezone.utc), os.getloadavg()[0]
    backend = Backend.load("smollm2-135m")
    prompts = [render(backend.tokenizer, p) for p in load_prompts("chitchat", args.prompts, seed=21)]
    params = SamplingParams(profile="torch-exponential", temperature=1.0)
    c = args.completions
    requests = [Request(f"p{i}-{j}", tuple(p), params.with_(seed=1000 * i + j)) for i, p in enumerate(prompts)
                for j in range(c)]
    outputs = [d.tokens for d in decode_batch(backend, requests, args.new_tokens, backend.stop_ids(), {}, shared=c)]
    ids = [list(r.prompt_token_ids) for r in requests]
    sides = {"plain": (), "tilted": TILTS}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    wall: dict[str, list[float]] = {k: [] for k in sides}
    scores = {}
    for r in range(args.repeats):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            scores[name], cs, ws = timed(lambda: completion_scores(backend, ids, outputs, params, tilts=sides[name]))
            cpu[name].append(cs)
            wall[name].append(ws)
    if not np.allclose(scores["plain"].logprob, scores["tilted"].logprob, atol=1e-4):
        sys.exit("the two sides scored the completions differently")
    n, tokens = len(outputs), int(sum(map(len, outputs)))
    rate = {k: (n / statistics.median(cpu[k]), n / statistics.median(wall[k])) for k in sides}
    command = "python benchmarks/surprise_cost.py " + " ".join(sys.argv[1:])
    lines = [
        "# The surprise test's exact null: scoring cost with and without its tilts", "",
        f"Command: `{command.strip()}`", "",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(args.threads)}; load average at start {load:.1f}.", "",
        f"smollm2-135m (vocabulary {backend.vocab_size}), {args.prompts} chitchat prompts x {c} honest completions "
        f"= {n} completions, {tokens} tokens scored ({tokens / n:.1f} per completion), {len(TILTS)} tilts; median "
        f"of {args.repeats} repeats, sides alternating; same log-probabilities on both sides.", "",
        "| side | completions/s (CPU time) | completions/s (wall) | CPU s per completion |", "|---|---|---|---|",
        *(f"| {k} | {rate[k][0]:.2f} | {rate[k][1]:.2f} | {1 / rate[k][0]:.3f} |" for k in sides),
        f"| **tilted / plain, time per completion** | **{rate['plain'][0] / rate['tilted'][0]:.2f}x** | "
        f"{rate['plain'][1] / rate['tilted'][1]:.2f}x | +{1 / rate['tilted'][0] - 1 / rate['plain'][0]:.3f} |", "",
    ]
    print("\n".join(lines))
    write_atomic(args.out, "\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
