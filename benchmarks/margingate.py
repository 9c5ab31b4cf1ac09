"""MarginGate on the project's model: flip measurements, baselines, threshold sweep, transfer, scaling.

Usage: python benchmarks/margingate.py [--dtypes float32,bfloat16] [--n 8] [--max-new 24] ...

For each dtype it decodes the same dynamic-batch schedule under the reference (deterministic path),
the fast path, always-on verification (LLM-42 style), global batch invariance (deterministic path for
every step) and MarginGate at each swept threshold, all in one process, interleaved per repeat, so the
overhead ratios are measured side by side. Writes benchmarks/results/margingate.md (or --out).
The default run needs roughly 6 minutes of CPU time by estimate (not timed itself); longer on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from verinfer.determinism.experiment import Config, header, run_experiment  # noqa: E402


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--calibration", default="chitchat")
    ap.add_argument("--transfer", default="gsm8k", help="comma-separated prompt sets (fp32)")
    ap.add_argument("--n", type=int, default=8, help="calibration prompts (fp32)")
    ap.add_argument("--n-transfer", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batch-sizes", default="", help="extra batch sizes for the scaling table (fp32)")
    ap.add_argument("--thresholds-fp32", default="1e-3,1e-2,1e-1")
    ap.add_argument("--thresholds-bf16", default="0.5,2.0")
    ap.add_argument("--bf16-n", type=int, default=6)
    ap.add_argument("--bf16-max-new", type=int, default=24)
    ap.add_argument("--bf16-transfer", default="", help="comma-separated prompt sets for bf16 (slow on CPU)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier timings when the 2 cores are shared)")
    ap.add_argument("--out", default="benchmarks/results/margingate.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfgs = []
    for dt in args.dtypes.split(","):
        if dt == "float32":
            cfgs.append(Config(dtype=dt, calibration=args.calibration, transfer=tuple(filter(None, args.transfer.split(","))),
                               n=args.n, n_transfer=args.n_transfer, max_new_tokens=args.max_new, batch=args.batch,
                               batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",") if b),
                               thresholds=floats(args.thresholds_fp32), repeats=args.repeats))
        elif dt == "bfloat16":
            cfgs.append(Config(dtype=dt, calibration=args.calibration,
                               transfer=tuple(filter(None, args.bf16_transfer.split(","))), n=args.bf16_n,
                               n_transfer=args.n_transfer, max_new_tokens=args.bf16_max_new, batch=args.batch,
                               thresholds=floats(args.thresholds_bf16), repeats=args.repeats, mixed=False,
                               fidelity=True))
        else:
            sys.exit(f"unknown dtype {dt!r}: use float32 and/or bfloat16")
    command = "python benchmarks/margingate.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    head = header(cfgs, command.strip())
    print(head)
    parts = ["### MarginGate benchmark", head]
    for cfg in cfgs:
        rep = run_experiment(cfg)
        parts.append(f"### {cfg.dtype}\n\n" + rep.markdown())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n\n".join(parts) + "\n")  # after each dtype: nothing is lost
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
