"""What an ``--mode auto`` audit costs the customer beside the single modes it runs (issue #42 item 2).

Usage: python benchmarks/auto_cost.py [--queries N] [--max-tokens N] [--repeats N] [--rank-samples M]

An honest ``verinfer serve`` (SmolLM2-135M fp32, vLLM sampler, no seeds asked) runs in a child process,
so that only the auditor's work is timed: ``run_audit`` over real HTTP with the local fp32 reference,
``--queries`` chitchat prompts, T = 1, ``--max-tokens`` tokens, for each mode

    surprise    every completion scored by one prefill (no reference draws)
    logprobs    the returned top-5 logprobs against one reference prefill per completion
    auto        what auto runs on these responses (surprise + logprobs: no seeds, one completion each)
    rank        ``--rank-samples`` reference draws per completion (what auto ran before issue #42)

Each audit writes to a fresh directory (every request sent again); the modes rotate within each
repeat; process CPU time of the auditing process (client, parsing, reference work), medians. The
claim is auto over the cheapest mode it runs (issue #42: at most 2x).
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from verinfer.auditing.client import Endpoint  # noqa: E402
from verinfer.auditing.plan import AuditSpec  # noqa: E402
from verinfer.auditing.reference import LocalReference  # noqa: E402
from verinfer.auditing.run import run_audit  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 2.0


def _serve(queue) -> None:
    """The honest provider, in its own process (its CPU is not the auditor's)."""
    import threading

    from verinfer.serve import ServeConfig, serve_in_thread

    torch.set_num_threads(1)
    with serve_in_thread(Backend.load(), ServeConfig(sampler="vllm", max_batch=16)) as url:
        queue.put(url)
        threading.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=25)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank-samples", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "auto_cost.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    command = " ".join(["python benchmarks/auto_cost.py", *sys.argv[1:]])
    started = dt.datetime.now().astimezone()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    mach = describe(1)
    print(f"# {mach}", flush=True)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    server = ctx.Process(target=_serve, args=(queue,), daemon=True)
    server.start()
    url = queue.get(timeout=300)
    backend = Backend.load()
    reference = LocalReference(backend)
    prompts = load_prompts("chitchat", args.queries, seed=0, distinct=True)
    base = dict(temperature=1.0, max_tokens=args.max_tokens, seed=3)
    specs = {"surprise": AuditSpec(mode="surprise", **base), "logprobs": AuditSpec(mode="logprobs", **base),
             "auto": AuditSpec(mode="auto", **base), "rank": AuditSpec(mode="rank", samples=args.rank_samples, **base)}
    cpu: dict[str, list[float]] = {m: [] for m in specs}
    ran: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = list(specs)[r % len(specs):] + list(specs)[:r % len(specs)]
            for mode in order:
                t0 = time.process_time()
                result = run_audit([Endpoint("honest", url, backend.model_id, None)], prompts, specs[mode], reference,
                                   Path(tmp) / f"{mode}-{r}")
                cpu[mode].append(time.process_time() - t0)
                a = result.providers[0]
                ran[mode] = (", ".join(t["test"] for t in a.tests if t["ran"]) if a.tests else mode)
                print(f"repeat {r + 1}: {mode}: {cpu[mode][-1]:.1f} s CPU; {a.verdict.label} (p {a.verdict.p_value:.3g}); "
                      f"ran {ran[mode]}", flush=True)
    server.terminate()
    med = {m: statistics.median(v) for m, v in cpu.items()}
    included = [m for m in ("surprise", "logprobs", "rank") if m in ran["auto"].split(", ")]
    cheapest = min(included, key=lambda m: med[m])
    ratio = med["auto"] / med[cheapest]
    rows = [f"| {m} | {ran[m]} | {med[m]:.1f} | {', '.join(f'{x:.1f}' for x in cpu[m])} | {med[m] / med[cheapest]:.2f} |"
            for m in specs]
    table = ["| mode | tests run | CPU s (median) | per repeat | / cheapest mode auto runs |", "|---|---|---:|---|---:|",
             *rows]
    verdict = (f"auto / {cheapest} (the cheapest mode auto runs) = **{ratio:.2f}** "
               f"({'meets' if ratio <= GOAL else 'misses'} issue #42's 2x)")
    lines = ["# Cost of an auto audit beside the modes it runs", "", f"Command: `{command}`  ",
             f"Date: {started:%Y-%m-%d %H:%M %Z}  ", f"Machine: {mach}  ", f"Load average at start {load}  ",
             f"{args.queries} chitchat queries, T = 1, {args.max_tokens} tokens, honest `verinfer serve` in a child "
             f"process; {args.repeats} repeats, modes rotating; CPU time of the auditing process.", "", *table, "",
             verdict, ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(table) + "\n\n" + verdict + f"\n\nwrote {args.out}")


if __name__ == "__main__":
    main()
