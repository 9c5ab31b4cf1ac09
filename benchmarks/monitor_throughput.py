"""Can one monitor keep up with one engine? Verified tokens per second of ``verinfer monitor`` against
generated tokens per second of the engine, on the same machine, in one run.

Usage: python benchmarks/monitor_throughput.py [--traces 48] [--shards 8] [--max-tokens 48]
                                               [--postgres URL] [--no-ray]

(a) The engine: ``verinfer.api.generate`` (the provider simulator: vLLM's sampler, T = 1, top-k 50,
    top-p 0.95) on the bundled smollm2-135m, fp32, one torch thread, ``--traces`` requests decoded
    in batches of 16; its output tokens per second of wall time.
(b) The monitor: the same traces, split into ``--shards`` Parquet shards with request times (as the
    gateway writes them), verified and recorded by ``Monitor.run_once`` (the code ``verinfer monitor
    --once`` runs) into a fresh SQLite database (and PostgreSQL with ``--postgres``), one torch
    thread, the model loaded once beforehand; verified output tokens per second of wall time, and
    the share of that time spent outside verification (claims, recording, window recomputation).
    Rates per wall second (what keeping up means) and per CPU second of this process (less disturbed
    by the other jobs of a shared machine; not for Ray, whose workers are other processes).
(c) Ray: the same with ``--ray`` and 1 and 2 workers (each a model replica with one thread), whole
    pass (cluster start and replica loads included) and steady rate between the first and the last
    shard to finish, timed by their records as ``benchmarks/ray_scaling.py`` does.

Printed and written to ``benchmarks/results/monitor_throughput.md``: each rate and its ratio to the
engine's. The machine is shared and has 2 cores: the ratios measured side by side are the claims.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_scaling import steady_rate  # noqa: E402

from verinfer import api  # noqa: E402
from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.production.monitor import Monitor  # noqa: E402
from verinfer.production.store import open_store  # noqa: E402
from verinfer.trace import Trace, write_traces  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def shards_of(traces: list[Trace], n: int, directory: Path) -> None:
    """The traces as the gateway would write them: ``n`` Parquet shards, request times one second apart."""
    t0 = dt.datetime(2026, 1, 1)
    timed = [Trace(**{**t.__dict__, "provider": "engine",
                      "meta": {"request_time": (t0 + dt.timedelta(seconds=i)).isoformat() + "Z"}})
             for i, t in enumerate(traces)]
    directory.mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(len(timed)), n)):
        write_traces([timed[j] for j in part], directory / f"shard{i:03d}.parquet")


def monitor_pass(shard_dir: Path, out: Path, url: str, backend, tokens: int, **kwargs) -> dict:
    store = open_store(url)
    mon = Monitor(shard_dir, store, out_dir=out, window_s=60, backend=backend, **kwargs)
    t0, c0 = time.perf_counter(), time.process_time()
    outcome = mon.run_once()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert len(outcome.verified) == len(list(shard_dir.iterdir())) and not outcome.failed, outcome
    from sqlalchemy import text

    with store.engine.connect() as conn:
        recorded = conn.execute(text("SELECT SUM(tokens) FROM windows")).scalar()
        verify_s = conn.execute(text("SELECT SUM(verify_s) FROM shards")).scalar()
    store.close()
    assert recorded == tokens, (recorded, tokens)
    return {"wall": wall, "rate": tokens / wall, "cpu_rate": None if kwargs.get("use_ray") else tokens / cpu,
            "outside": 1 - verify_s / wall if not kwargs.get("use_ray") else None,
            "steady": steady_rate(out) if kwargs.get("use_ray") else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=48)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--postgres", help="also record into this PostgreSQL database (postgresql://...)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray runs")
    ap.add_argument("--out", type=Path, default=RESULTS / "monitor_throughput.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    started, load = dt.datetime.now(dt.timezone.utc), os.getloadavg()
    backend = api.load_model("smollm2-135m")
    api.generate("chitchat", n=2, max_tokens=4, backend=backend)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    traces = api.generate("chitchat", n=args.traces, max_tokens=args.max_tokens, seed=4000, backend=backend,
                          batch_size=16)
    gen_wall, gen_cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(t.output_token_ids) for t in traces)
    engine, engine_cpu = tokens / gen_wall, tokens / gen_cpu
    print(f"engine: {tokens} tokens in {gen_wall:.1f} s = {engine:.1f} tokens/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards_of(traces, args.shards, root / "shards")
        runs = [("monitor, SQLite, in process", f"sqlite:///{root}/a.db", {})]
        if args.postgres:
            runs.append(("monitor, PostgreSQL, in process", args.postgres, {}))
        if not args.no_ray:
            runs += [(f"monitor --ray, {w} worker(s), SQLite", f"sqlite:///{root}/r{w}.db",
                      {"use_ray": True, "workers": w}) for w in (1, 2)]
        for i, (name, url, kwargs) in enumerate(runs):
            r = monitor_pass(root / "shards", root / f"out{i}", url, backend, tokens, **kwargs)
            rows.append((name, r))
            print(f"{name}: {r['wall']:.1f} s, {r['rate']:.1f} tokens/s ({r['rate'] / engine:.2f}x the engine)",
                  flush=True)
    lines = ["# Monitor throughput against the engine", "",
             f"Command: `python benchmarks/monitor_throughput.py --traces {args.traces} --shards {args.shards} "
             f"--max-tokens {args.max_tokens}{' --postgres URL' if args.postgres else ''}"
             f"{' --no-ray' if args.no_ray else ''}`  ",
             f"Date: {started:%Y-%m-%d %H:%M} UTC  ", f"Machine: {describe(1)}  ",
             f"Load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}  ",
             f"Data: {args.traces} seeded vLLM-sampler traces (T = 1, top-k 50, top-p 0.95) of smollm2-135m fp32, "
             f"{tokens} output tokens, generated in batches of 16 and split into {args.shards} Parquet shards.", "",
             "| run | wall s | output tokens / s (wall) | vs the engine | tokens / CPU s (this process) | vs the engine "
             "| share of wall time outside verification | steady tokens / s (first to last shard) | vs the engine |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| engine (api.generate) | {gen_wall:.1f} | {engine:.1f} | 1.00x | {engine_cpu:.1f} | 1.00x | | | |"]
    for name, r in rows:
        outside = f"{r['outside']:.1%}" if r["outside"] is not None else ""
        steady = f"{r['steady']:.1f} | {r['steady'] / engine:.2f}x" if r["steady"] is not None else " | "
        cpu = f"{r['cpu_rate']:.1f} | {r['cpu_rate'] / engine_cpu:.2f}x" if r["cpu_rate"] is not None else " | "
        lines.append(f"| {name} | {r['wall']:.1f} | {r['rate']:.1f} | {r['rate'] / engine:.2f}x | {cpu} | {outside} | "
                     f"{steady} |")
    write_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
