"""The latency of a short request behind long ones on ``verinfer serve`` (continuous batching, issue 27.2).

Usage: python benchmarks/serve_latency.py [--long-tokens 256] [--short-tokens 8] [--behind 0,1,4,7] [--rounds 3]

A server runs on loopback with the bundled model (no stop token, so long requests run to their
length). For each k in ``--behind``, k long requests (``--long-tokens`` each, sent on raw sockets)
are decoding when a short request (``--short-tokens``) is sent; printed: the short request's wall
latency (median over ``--rounds``), its ratio to the same request on an idle server (k = 0,
measured in the same run, alternating), and whether all k long requests were still running when
it was answered. Static batching is gone, so there is no old scheduler to run beside it; the last
column gives what static batching cost instead: the time one long request takes alone, a lower
bound on what a request arriving behind a full batch of them waited. One torch thread.
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

import httpx  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.audit_servers
from tests.audit_servers import health, open_request, until  # noqa: E402
from verinfer.api import load_model  # noqa: E402
from verinfer.files import write_atomic  # noqa: E402
from verinfer.serve import ServeConfig, serve_in_thread  # noqa: E402


def _short(client: httpx.Client, body: dict) -> float:
    t = time.perf_counter()
    r = client.post("/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-tokens", type=int, default=256)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--behind", default="0,1,4,7", help="comma-separated numbers of long requests ahead")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve_latency.md")
    args = ap.parse_args()
    ks = [int(k) for k in args.behind.split(",")]
    if 0 not in ks:
        ks = [0, *ks]
    torch.set_num_threads(1)
    backend = load_model("smollm2-135m")
    backend.stop_ids = lambda: set()  # long requests run to their length
    short = {"prompt": "Name a colour.", "max_tokens": args.short_tokens, "seed": 1}
    config = ServeConfig(batch_wait_s=0.0, max_batch=8, max_tokens_limit=args.long_tokens)
    latency: dict[int, list[float]] = {k: [] for k in ks}
    still: dict[int, bool] = {k: True for k in ks}
    with serve_in_thread(backend, config) as url, httpx.Client(base_url=url, timeout=600) as client:
        t = time.perf_counter()
        client.post("/completions", json={"prompt": "Tell me a story.", "max_tokens": args.long_tokens, "seed": 0})
        long_alone = time.perf_counter() - t
        for r in range(args.rounds):
            for k in ks:
                socks = [open_request(url, "/completions", {"prompt": f"Tell me a long story number {i}.", "max_tokens": args.long_tokens,
                                     "seed": 100 * r + i}) for i in range(k)]
                try:
                    before = until(client, lambda h: h["running"] == k and h["queued"] == 0, f"{k} long requests "
                                   "running", guard_s=600)
                    latency[k].append(_short(client, short))
                    after = health(client)
                    still[k] &= after["requests"] == before["requests"] + 1  # only the short one finished
                finally:
                    for s in socks:
                        s.close()
                until(client, lambda h: h["running"] == 0, "no request running", guard_s=600)
                print(f"round {r + 1}: short request behind {k} long: {latency[k][-1]:.3f} s", flush=True)
    base = statistics.median(latency[0])
    lines = [f"# A {args.short_tokens}-token request behind k requests of {args.long_tokens} tokens (continuous batching)",
             "", f"`python benchmarks/serve_latency.py --long-tokens {args.long_tokens} --short-tokens "
             f"{args.short_tokens} --behind {args.behind} --rounds {args.rounds}`, {dt.date.today()}, SmolLM2-135M fp32, "
             f"one torch thread, {os.cpu_count()} shared CPU cores, load average {os.getloadavg()[0]:.1f} at the end. "
             "Wall time, median of the rounds.",
             "", "| long requests ahead | short request's latency (s) | vs idle server | long ones still running | "
                 "one long request alone (s) |",
             "|---|---|---|---|---|"]
    for k in ks:
        m = statistics.median(latency[k])
        lines.append(f"| {k} | {m:.3f} | {m / base:.2f} | {'yes' if k and still[k] else ('-' if not k else 'no')} "
                     f"| {long_alone:.2f} |")
    write_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
