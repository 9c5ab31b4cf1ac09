"""CPU time to build and verify TOPLOC proofs per decode chunk, side by side with the reference library.

Usage: python benchmarks/toploc_speed.py [--repeats N] [--clock wall|cpu] [--baseline OLD/toploc.py]

Inputs are bf16 hidden states (the commit's own dtype) from a fixed seed; each figure is the median
over repeats of one call divided by the chunks in it. "1 chunk" calls pay the fixed per-call cost;
"64 chunks" calls show the per-chunk cost when a whole trace is committed at once. ``--clock cpu``
times with the process CPU clock (steadier than wall time on a shared machine; it counts every
thread, so the reference's two check threads count twice). Every implementation is called in turn
on the same tensors, so all see the same load, and the ratios are what to read.

The reference columns time ``toploc`` 0.1.6 where it is importable (run this with its own
virtualenv's python and ``PYTHONPATH=src``; building it: ``tests/fixtures/toploc/record.py``): its
``build_proofs_bytes`` over one tensor per row (its API; the list is made before timing) and its C++
``verify_proofs_bytes`` on the [rows, hidden] tensor, both on bytes as ours. The goal (issue #27)
is a ratio this / reference of at most 0.5 for both. Without the reference the column shows
REFERENCE.md section 3's CPU figures for 32 x 4096 chunks, quoted, with no ratio.

``--baseline`` loads another version of ``verinfer/commits/toploc.py`` (e.g. from ``git archive``)
with the ``toploc_*.py`` modules beside it and times it alongside (ratio this / baseline).
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
from pathlib import Path
from types import ModuleType, SimpleNamespace

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


def reference() -> SimpleNamespace | None:
    """The reference's build and verify with our signatures (decode chunks only), if importable."""
    try:
        import toploc
        from toploc.C.csrc.poly import verify_proofs_bytes
    except ImportError:
        return None
    return SimpleNamespace(
        prepare=lambda hidden: list(hidden),  # its build takes one tensor per row
        build_proofs=lambda rows, prefill: toploc.build_proofs_bytes(rows, 32, 128, skip_prefill=True),
        verify_proofs=lambda hidden, prefill, proofs: verify_proofs_bytes(hidden, proofs, 32, 128),
        passed=lambda checks: all(c.exp_mismatches == 0 for c in checks),
    )


def measure(impls: list, hidden_size: int, chunks: int, repeats: int, clock) -> list[tuple[float, float]]:
    """Per-chunk (build, verify) ms of each implementation for ``chunks`` decode chunks of 32 x hidden_size."""
    hidden = inputs(hidden_size, chunks)
    built = [getattr(m, "prepare", lambda h: h)(hidden) for m in impls]
    proofs = [m.build_proofs(b, 0) for m, b in zip(impls, built)]
    assert all(p == proofs[0] for p in proofs), "implementations built different proofs"
    for m, p in zip(impls, proofs):
        checks = m.verify_proofs(hidden, 0, p)
        assert getattr(m, "passed", lambda cs: all(c.passed for c in cs))(checks)
    build = median_ms([lambda m=m, b=b: m.build_proofs(b, 0) for m, b in zip(impls, built)], repeats, clock)
    verify = median_ms([lambda m=m, p=p: m.verify_proofs(hidden, 0, p) for m, p in zip(impls, proofs)],
                       repeats, clock)
    return [(b / chunks, v / chunks) for b, v in zip(build, verify)]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def load_baseline(path: str) -> ModuleType:
    """Another version's toploc.py, importing the toploc_*.py beside it instead of ours."""
    helpers = {f"verinfer.commits.{p.stem}": p for p in sorted(Path(path).parent.glob("toploc_*.py"))}
    ours = {name: sys.modules.get(name) for name in helpers}
    try:
        for name, helper in helpers.items():
            sys.modules[name] = _load(f"baseline_{helper.stem}", helper)
        return _load("toploc_baseline", Path(path))
    finally:
        for name, module in ours.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--baseline", help="another version's verinfer/commits/toploc.py to time alongside")
    args = parser.parse_args()
    ref = reference()
    impls = [current] + ([load_baseline(args.baseline)] if args.baseline else []) + ([ref] if ref else [])
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"numpy {np.__version__}, torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f}, k=128, seed {SEED}, median of {args.repeats}, {args.clock} clock"
    )
    head = "| chunk (rows x hidden) | chunks per call | build ms/chunk | verify ms/chunk |"
    if args.baseline:
        head += " baseline build / verify | ratio build / verify |"
        print(f"# baseline: {args.baseline}")
    head += " reference build / verify | ratio to reference build / verify |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    clock = CLOCKS[args.clock]
    for hidden_size in (4096, 576):
        for chunks in (1, 64):
            times = measure(impls, hidden_size, chunks, args.repeats, clock)
            (build, verify) = times[0]
            row = f"| 32 x {hidden_size} | {chunks} | {build:.3f} | {verify:.3f} |"
            if args.baseline:
                old_build, old_verify = times[1]
                row += f" {old_build:.3f} / {old_verify:.3f} | {build / old_build:.2f} / {verify / old_verify:.2f} |"
            if ref:
                ref_build, ref_verify = times[-1]
                row += f" {ref_build:.3f} / {ref_verify:.3f} | **{build / ref_build:.2f} / {verify / ref_verify:.2f}** |"
            elif hidden_size == 4096:
                row += f" {REFERENCE_MS['build']} / {REFERENCE_MS['verify']} (quoted) | n/a |"
            else:
                row += " n/a | n/a |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
