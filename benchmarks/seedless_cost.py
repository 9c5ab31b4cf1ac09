"""What a seedless audit costs per query: reference draws (shared prompt prefill or not) and the
surprise test's scoring (with and without its exact null's tilts).

Usage: python benchmarks/seedless_cost.py [--prompts N] [--draws M] [--completions C] [--new-tokens L] [--repeats R]

Two side-by-side comparisons on ``--prompts`` chitchat prompts rendered with the chat template
(``torch-exponential`` sampler, T = 1, up to ``--new-tokens`` tokens), each side run ``--repeats``
times with the sides alternating, medians reported:

- **draws** (``rank``, ``mmd``: ``verinfer.auditing.draws.reference_draws``): M seeded draws of each
  prompt decoded as one batch of prompts x M rows by ``verinfer.simulate.generate.decode_batch``,

      shared     ``shared=M``: each prompt prefilled once, its KV cache copied to its M rows
      separate   ``shared=1``: every row prefills its own copy of the prompt

  (both sides must draw the same tokens);
- **surprise** (no draws: ``verinfer.auditing.draws.completion_scores``, one prefill per completion
  judged): ``--completions`` honest completions per prompt scored

      plain      log-probability, mean and variance at every position (the retired z-test's cost)
      tilted     the same plus the cumulant generating function at each of ``surprise.TILTS``, which
                 the test martingale needs

  (both sides must give the same log-probabilities).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

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
PARAMS = SamplingParams(profile="torch-exponential", temperature=1.0)


def alternate(sides: dict[str, Callable[[], object]], repeats: int) -> tuple[dict, dict[str, tuple[float, float]]]:
    """Run each side ``repeats`` times, alternating which goes first: (each side's last output,
    side -> (median CPU s, median wall s))."""
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    wall: dict[str, list[float]] = {k: [] for k in sides}
    out = {}
    for r in range(repeats):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            c0, w0 = time.process_time(), time.perf_counter()
            out[name] = sides[name]()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return out, {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in sides}


def requests(prompts: list[list[int]], per_prompt: int, seed: int) -> list[Request]:
    return [Request(f"p{i}-{j}", tuple(p), PARAMS.with_(seed=seed + 1000 * i + j)) for i, p in enumerate(prompts)
            for j in range(per_prompt)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--draws", type=int, default=16, help="reference draws per prompt (M)")
    ap.add_argument("--completions", type=int, default=4, help="provider completions per prompt scored for surprise")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "seedless_cost.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started, load = dt.datetime.now(dt.timezone.utc), os.getloadavg()[0]
    backend = Backend.load("smollm2-135m")
    stops = backend.stop_ids()
    prompts = [render(backend.tokenizer, p) for p in load_prompts("chitchat", args.prompts, seed=21)]
    lengths = [len(p) for p in prompts]
    m, c = args.draws, args.completions

    draws = requests(prompts, m, 0)
    drawn, draw_time = alternate({"shared": lambda: decode_batch(backend, draws, args.new_tokens, stops, {}, shared=m),
                                  "separate": lambda: decode_batch(backend, draws, args.new_tokens, stops, {}, shared=1)},
                                 args.repeats)
    if [d.tokens for d in drawn["shared"]] != [d.tokens for d in drawn["separate"]]:
        sys.exit("the shared and separate prefills drew different tokens")

    judged = requests(prompts, c, 500_000)
    outputs = [d.tokens for d in decode_batch(backend, judged, args.new_tokens, stops, {}, shared=c)]
    ids = [list(r.prompt_token_ids) for r in judged]
    scored, score_time = alternate({"plain": lambda: completion_scores(backend, ids, outputs, PARAMS),
                                    "tilted": lambda: completion_scores(backend, ids, outputs, PARAMS, tilts=TILTS)},
                                   args.repeats)
    if not np.allclose(scored["plain"].logprob, scored["tilted"].logprob, atol=1e-4):
        sys.exit("the two sides scored the completions differently")

    per_s = {k: (len(draws) / cs, len(draws) / ws) for k, (cs, ws) in draw_time.items()}
    n, tokens = len(outputs), int(sum(map(len, outputs)))
    command = "python benchmarks/seedless_cost.py " + " ".join(sys.argv[1:])
    lines = [
        "# What a seedless audit costs per query: reference draws and the surprise test's scoring", "",
        f"Command: `{command.strip()}`", "",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(args.threads)}; load average at start {load:.1f}.", "",
        f"smollm2-135m, {args.prompts} chitchat prompts ({min(lengths)}-{max(lengths)} prompt tokens), up to "
        f"{args.new_tokens} new tokens; median of {args.repeats} repeats per side, sides alternating.", "",
        f"Reference draws (`rank`, `mmd`): {m} draws per prompt, one batch of {len(draws)} rows; both sides drew "
        "identical tokens.", "",
        "| side | draws/s (CPU time) | draws/s (wall) |", "|---|---|---|",
        *(f"| {k} | {per_s[k][0]:.2f} | {per_s[k][1]:.2f} |" for k in per_s),
        f"| **shared / separate** | **{per_s['shared'][0] / per_s['separate'][0]:.2f}x** | "
        f"{per_s['shared'][1] / per_s['separate'][1]:.2f}x |", "",
        f"Surprise scoring (no draws): {c} honest completions per prompt = {n} completions, {tokens} tokens "
        f"({tokens / n:.1f} per completion), {len(TILTS)} tilts; both sides gave the same log-probabilities.", "",
        "| side | completions/s (CPU time) | completions/s (wall) | CPU s per completion |", "|---|---|---|---|",
        *(f"| {k} | {n / cs:.2f} | {n / ws:.2f} | {cs / n:.3f} |" for k, (cs, ws) in score_time.items()),
        f"| **tilted / plain, time per completion** | **{score_time['tilted'][0] / score_time['plain'][0]:.2f}x** | "
        f"{score_time['tilted'][1] / score_time['plain'][1]:.2f}x | "
        f"+{(score_time['tilted'][0] - score_time['plain'][0]) / n:.3f} |", "",
    ]
    print("\n".join(lines))
    write_atomic(args.out, "\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
