"""CPU time to build and verify TOPLOC proofs per decode chunk, against the reference library.

Usage: python benchmarks/toploc_speed.py [--repeats N] [--clock wall|cpu] [--baseline OLD/toploc.py]

Inputs are bf16 hidden states (the commit's own dtype) from a fixed seed; each figure is the median
over repeats of one call divided by the chunks in it. "1 chunk" calls pay the fixed per-call cost;
"64 chunks" calls show the per-chunk cost when a whole trace is committed at once. ``--clock cpu``
times with the process CPU clock (steadier than wall time on a shared machine; with one torch thread
it is the work done). ``--baseline`` loads another version of ``verinfer/commits/toploc.py`` (e.g.
from ``git archive``) and times it alternately with this one on the same tensors, so both see the
same load, and prints the ratio this / baseline.

The reference column measures ``toploc`` 0.1.6 on the same tensors where it is importable (run with
its own virtualenv's python and ``PYTHONPATH=src``, see ``tests/fixtures/toploc/record.py``): its
``build_proofs_base64`` over one tensor per row and its C++ ``verify_proofs_base64``. Elsewhere it
shows REFERENCE.md section 3's CPU figures for 32 x 4096 chunks.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from verinfer.commits import toploc as current

REFERENCE_MS = {"build": 1.3, "verify": 0.84}  # per 32x4096 chunk, REFERENCE.md section 3
SEED = 0
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_ms(calls: list[Callable[[], object]], repeats: int, clock: Callable[[], float]) -> list[float]:
    """Median time of each call in milliseconds, the calls taken in turn, after one warm-up round."""
    for call in calls:
        call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, record in zip(calls, times):
            start = clock()
            call()
            record.append(clock() - start)
    return [statistics.median(t) * 1e3 for t in times]


def inputs(hidden_size: int, chunks: int) -> torch.Tensor:
    rng = np.random.default_rng(SEED)
    return torch.from_numpy(rng.standard_normal((32 * chunks, hidden_size)).astype(np.float32)).bfloat16()


def measure(modules: list[ModuleType], hidden_size: int, chunks: int, repeats: int, clock) -> list[tuple[float, float]]:
    """Per-chunk (build, verify) ms of each module for ``chunks`` decode chunks of 32 x hidden_size."""
    hidden = inputs(hidden_size, chunks)
    proofs = [m.build_proofs(hidden, 0) for m in modules]
    for m, p in zip(modules, proofs):
        assert all(check.passed for check in m.verify_proofs(hidden, 0, p))
    build = median_ms([lambda m=m: m.build_proofs(hidden, 0) for m in modules], repeats, clock)
    verify = median_ms([lambda m=m, p=p: m.verify_proofs(hidden, 0, p) for m, p in zip(modules, proofs)],
                       repeats, clock)
    return [(b / chunks, v / chunks) for b, v in zip(build, verify)]


def measure_reference(hidden_size: int, chunks: int, repeats: int, clock) -> str:
    """The reference library's build / verify ms per chunk on the same tensor, if it is importable."""
    try:
        import toploc
        from toploc.C.csrc.poly import verify_proofs_base64
    except ImportError:
        return f"{REFERENCE_MS['build']} / {REFERENCE_MS['verify']} (quoted)" if hidden_size == 4096 else "n/a"
    hidden = inputs(hidden_size, chunks)
    rows = list(hidden)
    proofs = toploc.build_proofs_base64(rows, 32, 128, skip_prefill=True)
    assert all(r.exp_mismatches == 0 for r in verify_proofs_base64(hidden, proofs, 32, 128))
    (build,) = median_ms([lambda: toploc.build_proofs_base64(rows, 32, 128, skip_prefill=True)], repeats, clock)
    (verify,) = median_ms([lambda: verify_proofs_base64(hidden, proofs, 32, 128)], repeats, clock)
    return f"{build / chunks:.2f} / {verify / chunks:.2f}"


def load_baseline(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("toploc_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--baseline", help="another version's verinfer/commits/toploc.py to time alongside")
    args = parser.parse_args()
    modules = [current] + ([load_baseline(args.baseline)] if args.baseline else [])
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"numpy {np.__version__}, torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f}, k=128, seed {SEED}, median of {args.repeats}, {args.clock} clock"
    )
    head = "| chunk (rows x hidden) | chunks per call | build ms/chunk | verify ms/chunk |"
    if args.baseline:
        head += " baseline build / verify | ratio build / verify |"
        print(f"# baseline: {args.baseline}")
    head += " reference build / verify |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    clock = CLOCKS[args.clock]
    for hidden_size in (4096, 576):
        for chunks in (1, 64):
            times = measure(modules, hidden_size, chunks, args.repeats, clock)
            (build, verify) = times[0]
            row = f"| 32 x {hidden_size} | {chunks} | {build:.2f} | {verify:.2f} |"
            if args.baseline:
                old_build, old_verify = times[1]
                row += f" {old_build:.2f} / {old_verify:.2f} | {build / old_build:.2f} / {verify / old_verify:.2f} |"
            print(row + f" {measure_reference(hidden_size, chunks, args.repeats, clock)} |")


if __name__ == "__main__":
    main()
