"""Reference draws per second for seedless audits, with and without the shared prompt prefill.

Usage: python benchmarks/reference_draws.py [--prompts N] [--draws M] [--new-tokens L] [--repeats R]

The reference draws of a seedless audit (``verinfer.auditing.draws.reference_draws``) are M samples
of each prompt. Both sides decode the same requests (``--prompts`` chitchat prompts rendered with
the chat template, M seeded draws each, ``torch-exponential`` sampler, T = 1, ``--new-tokens``
tokens, one batch of prompts x M rows) with ``verinfer.simulate.generate.decode_batch``:

    shared     ``shared=M``: each prompt prefilled once, its KV cache copied to its M rows
    separate   ``shared=1``: every row prefills its own copy of the prompt

The script asserts that both sides draw the same tokens, and prints draws per second (CPU and wall
time) and the ratio shared / separate, with the sides alternating within each repeat.
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

import torch  # noqa: E402

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
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--draws", type=int, default=16, help="draws per prompt (M)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "reference_draws.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started, load = dt.datetime.now(dt.timezone.utc), os.getloadavg()[0]
    backend = Backend.load("smollm2-135m")
    prompts = [render(backend.tokenizer, p) for p in load_prompts("chitchat", args.prompts, seed=21)]
    m = args.draws
    params = SamplingParams(profile="torch-exponential", temperature=1.0)
    requests = [Request(f"p{i}-{j}", tuple(p), params.with_(seed=1000 * i + j)) for i, p in enumerate(prompts)
                for j in range(m)]
    stops = backend.stop_ids()
    sides = {"shared": m, "separate": 1}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    wall: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list] = {}
    for r in range(args.repeats):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            out, c, w = timed(lambda: decode_batch(backend, requests, args.new_tokens, stops, {}, shared=sides[name]))
            cpu[name].append(c)
            wall[name].append(w)
            tokens[name] = [d.tokens for d in out]
    same = tokens["shared"] == tokens["separate"]
    if not same:
        sys.exit("the shared and separate prefills drew different tokens")
    n = len(requests)
    rate = {k: (n / statistics.median(cpu[k]), n / statistics.median(wall[k])) for k in sides}
    lengths = [len(p) for p in prompts]
    command = "python benchmarks/reference_draws.py " + " ".join(sys.argv[1:])
    lines = [
        "# Reference draws per second: shared prompt prefill against one prefill per draw", "",
        f"Command: `{command.strip()}`", "",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(args.threads)}; load average at start {load:.1f}.", "",
        f"{args.prompts} chitchat prompts ({min(lengths)}-{max(lengths)} prompt tokens) x {m} draws, up to "
        f"{args.new_tokens} new tokens, one batch of {n} rows; median of {args.repeats} repeats, sides alternating; "
        "both sides drew identical tokens.", "",
        "| side | draws/s (CPU time) | draws/s (wall) |", "|---|---|---|",
        *(f"| {k} | {rate[k][0]:.2f} | {rate[k][1]:.2f} |" for k in sides),
        f"| **shared / separate** | **{rate['shared'][0] / rate['separate'][0]:.2f}x** | "
        f"{rate['shared'][1] / rate['separate'][1]:.2f}x |", "",
    ]
    print("\n".join(lines))
    write_atomic(args.out, "\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
