"""What `verinfer diagnose` costs next to one `verinfer verify` of the same traces, side by side.

Usage: python benchmarks/diagnose_cost.py [--prompts 16] [--max-tokens 64] [--rounds 2] [--out PATH]

Traces: chitchat prompts on the bundled SmolLM2-135M (fp32), vLLM's sampler claiming T=1, top-k 50,
top-p 0.95. In each round, alternating: one ``verify`` (one prefill + Token-DiFR scoring), the
prefill alone, one ``diagnose`` over the whole candidate grid without model variants, and one with
the default ones (``--variants default``: bf16, w8-channel, w4-g128, fp8-kv; one prefill each, but
fp8-kv, whose prefill is not its decode, is replayed by a teacher-forced KV-cache decode).
Times are medians over rounds, in wall seconds and in CPU seconds of this process (the machine is shared; CPU time is what the
work itself costs). Candidates per second: the replayed candidates (the grid less the claim and the
bug candidates, which are read from the claim's replay) over the diagnosis time beyond its prefill.
Acceptance (issue #28): a diagnosis of 50 candidates costs less than 3 verifies.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402
from verinfer.scoring.diagnosis import candidate_grid  # noqa: E402
from verinfer.scoring.diagnosis_run import DEFAULT_BANDS, diagnose  # noqa: E402
from verinfer.scoring.traces import score_traces  # noqa: E402
from verinfer.simulate.generate import build_requests, generate  # noqa: E402

CLAIM = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=7000)
RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "diagnose_cost.md")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ref = Backend.load()
    traces = generate(ref, build_requests(ref, load_prompts("chitchat", args.prompts), CLAIM), args.max_tokens,
                      args.prompts)
    tokens = sum(len(t.output_token_ids) for t in traces)
    grid = candidate_grid(CLAIM)
    replayed = sum(1 for c in grid[1:] if c.replays)
    seqs = [t.prompt_token_ids + t.output_token_ids for t in traces]
    starts = [len(t.prompt_token_ids) for t in traces]
    runs = {"verify": lambda: score_traces(ref, traces), "prefill": lambda: list(ref.prefill(seqs, starts)),
            "diagnose": lambda: diagnose(traces, ref),
            "diagnose --variants default": lambda: diagnose(traces, ref, bands=list(DEFAULT_BANDS))}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    diagnose(traces, ref)  # warm-up: compiled kernels, caches
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    v = med["verify"]
    lines = [f"| {k} | {w:.2f} | {c:.2f} | {w / v[0]:.2f} | {c / v[1]:.2f} |" for k, (w, c) in med.items()]
    replay_w, replay_c = (med["diagnose"][i] - med["prefill"][i] for i in (0, 1))
    text = "\n".join([
        "# diagnose cost", "",
        f"Command: `python benchmarks/{Path(__file__).name} {shlex.join(sys.argv[1:])}`  ",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {describe(torch.get_num_threads())}; "
        f"load average {os.getloadavg()[0]:.1f} (shared machine)  ",
        f"Data: {len(traces)} traces, {tokens} output tokens, {ref.model_id} fp32, claim vLLM T=1 top-k 50 top-p 0.95; "
        f"grid: {len(grid)} candidates ({replayed} replayed, {len(grid) - 1 - replayed} bug candidates read from the "
        f"claim's replay); medians of {args.rounds} rounds", "",
        "| run | wall s | CPU s | wall / verify | CPU / verify |", "|---|---|---|---|---|", *lines, "",
        f"Candidates per second (replays beyond the prefill): {replayed / replay_w:.1f} by wall time, "
        f"{replayed / replay_c:.1f} by CPU time ({tokens * replayed / replay_c:.0f} candidate-tokens per CPU "
        "second).  ",
        f"Target (50 candidates < 3 verifies): diagnose = {med['diagnose'][1] / v[1]:.2f} verifies by CPU time, "
        f"{med['diagnose'][0] / v[0]:.2f} by wall time: "
        f"{'met' if med['diagnose'][1] / v[1] < 3 else 'MISSED'} (CPU).", ""])
    print(text)
    write_atomic(args.out, text)


if __name__ == "__main__":
    main()
