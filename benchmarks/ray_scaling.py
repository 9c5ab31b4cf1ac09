"""Sharded verification: one process against Ray with 1 and 2 workers, and the merge's memory by shard count.

Usage: python benchmarks/ray_scaling.py [--traces 32] [--shards 8] [--max-tokens 48]

(a) The same shards (``--traces`` seeded vLLM traces of the bundled model, split evenly into
    ``--shards`` JSONL files) are verified three ways into fresh output directories, in one run:
    ``run_local`` (this process, one torch thread, model already loaded), and ``run_ray`` on a local
    cluster with 1 and with 2 CPU workers (each a model replica with one torch thread; the wall time
    includes starting the cluster and loading the replicas, which a long run pays once). Printed:
    wall seconds, output tokens per second (whole run, and between the first and the last shard to
    finish, timed by their records: ``steady_rate``), the ratios, and whether every shard's scores
    are bit-identical across the three.
(b) Memory of the merge is flat in the number of shards: the same traces split into 4 and into 64
    shards are verified, then each output directory is merged in a fresh process; the peak RSS of
    those processes is compared (the merge holds per-token columns, so it grows with tokens, not files).

This machine is shared and has 2 cores: ratios measured side by side in this run are the claims.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verinfer import api, sharded  # noqa: E402
from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.scoring.scores import read_scores  # noqa: E402
from verinfer.trace import write_traces  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MERGE = ("import resource, sys; from pathlib import Path; from verinfer import sharded; "
         "s = sharded.merge(Path(sys.argv[1]), sharded.find_shards(sys.argv[2])); "
         "print(s.tokens, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def split(traces, n: int, directory: Path) -> list[Path]:
    directory.mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(len(traces)), n)):
        write_traces([traces[j] for j in part], directory / f"shard{i:03d}.jsonl")
    return sharded.find_shards(directory)


def same_scores(dirs: list[Path], shards: list[Path]) -> bool:
    for shard in shards:
        cols = [read_scores(sharded.ShardFiles.of(d, shard).scores) for d in dirs]
        for c in cols[1:]:
            if not all(np.array_equal(cols[0][k], c[k], equal_nan=cols[0][k].dtype.kind == "f") for k in c):
                return False
    return True


def steady_rate(out: Path) -> float:
    """Output tokens per second between the first and the last shard to finish, timed by the
    modification times of their ``.done.json`` records (written by whichever process verified the
    shard, the moment it finished). Not by when the driver hears of them: Ray Data hands results
    back in batches, which once made a Ray worker look 1.5x faster than this process."""
    records = sorted((p.stat().st_mtime, json.loads(p.read_text())["tokens"]) for p in out.glob("*.done.json"))
    return sum(n for _, n in records[1:]) / (records[-1][0] - records[0][0])


def merge_peak(out: Path, shard_dir: Path) -> tuple[int, int]:
    proc = subprocess.run([sys.executable, "-c", MERGE, str(out), str(shard_dir)], capture_output=True, text=True,
                          check=True)
    tokens, kib = proc.stdout.split()
    return int(tokens), int(kib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=32)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=RESULTS / "ray_scaling.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    started, load = dt.datetime.now(dt.timezone.utc), os.getloadavg()
    backend = api.load_model("smollm2-135m")
    traces = api.generate("chitchat", n=args.traces, max_tokens=args.max_tokens, seed=4000, backend=backend,
                          batch_size=16)
    tokens = sum(len(t.output_token_ids) for t in traces)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = split(traces, args.shards, root / "shards")
        rows, dirs = [], []
        for name, run in (("one process (run_local)", lambda out, cb: sharded.run_local(shards, out, backend,
                                                                                          on_shard=cb)),
                          ("Ray, 1 worker", lambda out, cb: sharded.run_ray(shards, out, backend.model_id, workers=1,
                                                                            on_shard=cb)),
                          ("Ray, 2 workers", lambda out, cb: sharded.run_ray(shards, out, backend.model_id, workers=2,
                                                                             on_shard=cb))):
            out = root / f"out{len(dirs)}"
            done: list[tuple[float, int]] = []
            t0 = time.perf_counter()
            result = run(out, lambda row: done.append((time.perf_counter(), int(row["tokens"]))))
            wall = time.perf_counter() - t0
            assert len(result.verified) == len(shards) and not result.errors, result.errors
            steady = steady_rate(out)
            rows.append((name, wall, steady, done[0][0] - t0))
            dirs.append(out)
            print(f"{name}: {wall:.1f} s, {steady:.1f} tokens/s from the first to the last shard", flush=True)
        identical = same_scores(dirs, shards)
        few, many = split(traces, 4, root / "s4"), split(traces, 64, root / "s64")
        sharded.run_local(few, root / "m4", backend)
        sharded.run_local(many, root / "m64", backend)
        mem = {n: merge_peak(root / f"m{n}", root / f"s{n}") for n in (4, 64)}
    base = rows[0][1]
    lines = ["# Sharded verification with Ray", "",
             f"Command: `python benchmarks/ray_scaling.py --traces {args.traces} --shards {args.shards} "
             f"--max-tokens {args.max_tokens}`  ",
             f"Date: {started:%Y-%m-%d %H:%M} UTC  ", f"Machine: {describe(1)}  ",
             f"Load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}  ",
             f"Data: {args.traces} seeded vLLM traces (T = 1, top-k 50, top-p 0.95) of smollm2-135m fp32, "
             f"{tokens} output tokens, in {args.shards} JSONL shards.", "",
             "| run | wall s (cluster start, model loads included) | first shard reported after s | output tokens / s, "
             "whole run | vs one process | output tokens / s, first to last shard (by their records) | vs one process |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {wall:.1f} | {first:.1f} | {tokens / wall:.1f} | {base / wall:.2f}x | {steady:.1f} | "
              f"{steady / rows[0][2]:.2f}x |" for name, wall, steady, first in rows]
    lines += ["", f"Per-shard scores bit-identical across the three runs: {'yes' if identical else 'NO'}.", "",
              "| shards | merged tokens | merge process peak RSS (MiB) |", "|---:|---:|---:|"]
    lines += [f"| {n} | {mem[n][0]} | {mem[n][1] / 1024:.0f} |" for n in (4, 64)]
    lines += ["", f"Peak RSS ratio, 64 shards / 4 shards: {mem[64][1] / mem[4][1]:.3f}."]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
