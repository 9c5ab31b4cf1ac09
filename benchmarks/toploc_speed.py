"""CPU time to build and verify TOPLOC proofs per decode chunk, against the reference library.

Usage: python benchmarks/toploc_speed.py [--repeats N]

Inputs are bf16 hidden states (the commit's own dtype) from a fixed seed; each figure is the median
over repeats of one call divided by the chunks in it. "1 chunk" calls pay the fixed per-call cost;
"64 chunks" calls show the per-chunk cost when a whole trace is committed at once. The reference
figures are REFERENCE.md section 3's CPU measurements of ``toploc`` 0.1.6.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from verinfer.commits.toploc import build_proofs, verify_proofs

REFERENCE_MS = {"build": 1.3, "verify": 0.84}  # per 32x4096 chunk, REFERENCE.md section 3
SEED = 0


def median_ms(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of one call in milliseconds, after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(hidden_size: int, chunks: int, repeats: int) -> tuple[float, float]:
    """Per-chunk build and verify times (ms) for ``chunks`` decode chunks of 32 x hidden_size."""
    rng = np.random.default_rng(SEED)
    hidden = torch.from_numpy(rng.standard_normal((32 * chunks, hidden_size)).astype(np.float32)).bfloat16()
    proofs = build_proofs(hidden, 0)
    assert all(check.passed for check in verify_proofs(hidden, 0, proofs))
    build = median_ms(lambda: build_proofs(hidden, 0), repeats) / chunks
    verify = median_ms(lambda: verify_proofs(hidden, 0, proofs), repeats) / chunks
    return build, verify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"numpy {np.__version__}, torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f}, k=128, seed {SEED}, median of {args.repeats}"
    )
    print("| chunk (rows x hidden) | chunks per call | build ms/chunk | verify ms/chunk | reference build / verify |")
    print("|---|---|---|---|---|")
    for hidden_size in (4096, 576):
        for chunks in (1, 64):
            build, verify = measure(hidden_size, chunks, args.repeats)
            reference = (
                f"{REFERENCE_MS['build']} / {REFERENCE_MS['verify']}" if hidden_size == 4096 else "n/a"
            )
            print(f"| 32 x {hidden_size} | {chunks} | {build:.2f} | {verify:.2f} | {reference} |")


if __name__ == "__main__":
    main()
