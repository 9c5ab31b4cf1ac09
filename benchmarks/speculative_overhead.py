"""What speculative decoding costs the verifier and the provider's records (issue 17, item 5).

Usage: python benchmarks/speculative_overhead.py [--prompts N] [--new-tokens N] [--rounds N]

On the bundled model (SmolLM2-135M, fp32, vLLM sampler T=1 top-k 50 top-p 0.95, draft ``layers:28``,
k = 4), the same prompts are decoded speculatively and plainly, then measured side by side:

(a) metadata: bytes per output token that ``spec_modes`` adds to the trace file (JSONL and Parquet),
    and the share of the file it is;
(b) verification CPU time per token, medians over rounds with the runs alternating (A/B, B/A):
      plain:          plain traces through ``verify_traces`` (one target prefill + Token-DiFR);
      spec + modes:   speculative traces with recorded modes (target and draft prefill, scored by mode);
      spec, no modes: the same traces without ``spec_modes`` (modes read from the claims);
    reported as ratios to ``plain``. Only the ratios are claims (shared, noisy machine); one torch thread.
Results are appended to ``benchmarks/results/speculative_overhead.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402
from verinfer.scoring.token_difr import verify_traces  # noqa: E402
from verinfer.simulate.generate import build_requests, generate  # noqa: E402
from verinfer.simulate.speculative import generate_speculative  # noqa: E402
from verinfer.trace import Trace, write_traces  # noqa: E402

SPEC = {"draft": "layers:28", "k": 4}
PARAMS = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=500, speculative=SPEC)


def cpu_time(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend = Backend.load()
    requests = build_requests(backend, load_prompts("chitchat", args.prompts, seed=5), PARAMS)
    spec = generate_speculative(backend, requests, args.new_tokens)
    plain = generate(backend, [r.__class__(r.id, r.prompt_token_ids, r.params.with_(speculative=None))
                               for r in requests], args.new_tokens, batch_size=8)
    bare = [Trace.from_dict({**t.to_dict(), "spec_modes": None}, "bench") for t in spec]
    n_spec = sum(len(t.output_token_ids) for t in spec)
    n_plain = sum(len(t.output_token_ids) for t in plain)

    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for suffix in ("jsonl", "parquet"):
            with_modes = write_traces(spec, Path(tmp) / f"a.{suffix}").stat().st_size
            without = write_traces(bare, Path(tmp) / f"b.{suffix}").stat().st_size
            sizes[suffix] = {"bytes_per_token": (with_modes - without) / n_spec,
                             "share_of_file": (with_modes - without) / with_modes}

    runs = {"plain": (plain, n_plain), "spec + modes": (spec, n_spec), "spec, no modes": (bare, n_spec)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            traces, n = runs[name]
            times[name].append(cpu_time(lambda: list(verify_traces(backend, traces))) / n)
    per_token = {k: statistics.median(v) for k, v in times.items()}
    ratios = {k: per_token[k] / per_token["plain"] for k in per_token}
    modes = "".join(t.spec_modes for t in spec)
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": describe(args.threads),
        "load_average": os.getloadavg()[0], "prompts": args.prompts, "new_tokens": args.new_tokens,
        "rounds": args.rounds, "spec_tokens": n_spec, "plain_tokens": n_plain,
        "acceptance": {m: modes.count(m) / len(modes) for m in "arb"}, "metadata": sizes,
        "verify_ms_per_token": {k: v * 1e3 for k, v in per_token.items()}, "verify_ratio_to_plain": ratios,
    }
    print(f"{n_spec} speculative tokens (modes a/r/b: "
          + "/".join(f"{record['acceptance'][m]:.0%}" for m in "arb") + f"), {n_plain} plain tokens")
    for suffix, s in sizes.items():
        print(f"spec_modes in {suffix}: {s['bytes_per_token']:.2f} bytes per token ({s['share_of_file']:.1%} of the file)")
    for name in runs:
        print(f"verify {name:15s} {per_token[name] * 1e3:7.2f} ms/token  ratio to plain {ratios[name]:.2f}")
    out = Path(__file__).parent / "results" / "speculative_overhead.jsonl"
    with open(out, "a") as fh:
        fh.write(json.dumps(record) + "\n")
    print(f"appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
