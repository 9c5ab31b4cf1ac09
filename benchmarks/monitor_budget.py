"""Does ``verinfer monitor --sample`` keep up with traffic faster than it verifies? Its backlog over time
under traffic ``--speedup`` times its own verification rate, sampling ``--sample`` against every trace,
and ``--sample`` with ``--keep-up`` (each shard thinned by the shards waiting), side by side in one run.

Usage: python benchmarks/monitor_budget.py [--speedup 10] [--sample 0.1] [--seconds 90] [--shard-traces 100]
       [--out FILE]

First the monitor's own rate: the real command (``verinfer monitor DIR --once``, one torch thread) over
``--calibration-shards`` shards of ``--shard-traces`` honest traces (24 tokens, vLLM's sampler at the
shipped settings) gives R traces per second of wall time, its start-up excluded. Then, for each setting (every trace, ``--sample``,
``--sample --keep-up``): a fresh directory and database, the monitor as a long-running process (``--poll 0.5
--metrics-port``), and a writer that drops a shard of ``--shard-traces`` traces (copies of the pool with
fresh ids and request times; the gateway closes a shard after 1,000 traces or 60 s) every
``shard_traces / (speedup * R)`` seconds for ``--seconds`` seconds. A shard costs the monitor a fixed
part (hashing, reading, files, one transaction) beside its verified traces: small shards show it. Every 2 s the backlog
(``verinfer_monitor_backlog_shards`` from the monitor's own /metrics) is read. Printed per fraction: shards
written, verified, the backlog at 25/50/75/100% of the run and its largest value; bounded means the
backlog at the end is no larger than at the middle plus a shard or two of jitter. With ``--keep-up``
the mean fraction the shards were verified at (from the database) is printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from verinfer.machine import describe
from verinfer.trace import Trace, write_traces

ROOT = Path(__file__).resolve().parents[1]


def pool() -> list[Trace]:
    from verinfer import api

    return api.generate("chitchat", n=40, max_tokens=24, seed=3000)


def shard(traces: list[Trace], k: int, directory: Path, size: int = 10) -> None:
    """Shard ``k``: ``size`` copies of the pool's traces (cycled) with fresh ids and request times."""
    now = dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")
    copies = [dataclasses.replace(t, id=f"{t.id}#{k}.{j}", meta={**(t.meta or {}), "request_time": now})
              for j, t in enumerate(traces[(k * size + j) % len(traces)] for j in range(size))]
    write_traces(copies, directory / f"traces-{k:06d}.parquet")


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def own_rate(traces: list[Trace], shards: int, work: Path, size: int) -> float:
    """Traces per second the real command verifies (wall time of its pass, start-up excluded: two runs,
    one shard and ``shards`` shards, the difference over the extra traces)."""
    times = []
    for n in (1, shards + 1):
        d = work / f"rate-{n}"
        d.mkdir(parents=True)
        for k in range(n):
            shard(traces, k, d, size)
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "verinfer.cli", "monitor", str(d), "--db", f"sqlite:///{d}/h.db",
                        "--once", "--threads", "1"], env=env(), check=False, capture_output=True)
        times.append(time.monotonic() - began)
    return shards * size / (times[1] - times[0])


def backlog_run(traces: list[Trace], fraction: float, interval: float, seconds: float, work: Path,
                size: int, keep_up: bool = False) -> dict:
    from verinfer.sockets import bind

    probe = bind("127.0.0.1", 0)  # a free port for the monitor's /metrics
    name = f"{fraction:g}{'-keep-up' if keep_up else ''}"
    d, port = work / f"run-{name}", probe.getsockname()[1]
    probe.close()
    d.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "verinfer.cli", "monitor", str(d), "--db", f"sqlite:///{d}/h.db",
                             "--threads", "1", "--poll", "0.5", "--sample", str(fraction), "--metrics-port", str(port),
                             *(["--keep-up"] if keep_up else [])],
                            env=env(), stdout=subprocess.DEVNULL, stderr=open(work / f"monitor-{name}.log", "w"))
    try:
        deadline = time.monotonic() + 120
        while True:  # listening (the model loads after): then the clock starts
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "the monitor did not start"
                time.sleep(0.5)
        began, k, samples, next_read = time.monotonic(), 0, [], 0.0
        while (now := time.monotonic() - began) < seconds:
            if now >= k * interval:
                shard(traces, k, d, size)
                k += 1
            if now >= next_read:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                value = next(float(line.split()[-1]) for line in text.splitlines()
                             if line.startswith("verinfer_monitor_backlog_shards "))
                samples.append((now, value + max(0, k - _found(text))))  # shards written, not yet found, too
                next_read += 2.0
            time.sleep(min(0.05, interval / 4))
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        done = _value(text, 'verinfer_monitor_shards{status="done"}')
    finally:
        proc.terminate()
        proc.wait(60)
    with sqlite3.connect(d / "h.db") as db:  # the fraction each verified shard was verified at
        mean_sample = db.execute("SELECT AVG(COALESCE(sample, 1.0)) FROM shards WHERE status = 'done'").fetchone()[0]
    return {"written": k, "done": done, "samples": samples, "mean_sample": mean_sample}


def _value(text: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def _found(text: str) -> int:
    return int(sum(_value(text, f'verinfer_monitor_shards{{status="{s}"}}') for s in ("pending", "claimed", "done",
                                                                                       "failed")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--sample", type=float, default=0.1)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--calibration-shards", type=int, default=2)
    parser.add_argument("--shard-traces", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    traces = pool()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rate = own_rate(traces, args.calibration_shards, work, args.shard_traces)
        print(f"the monitor verifies {rate:.2f} traces/s", flush=True)
        interval = args.shard_traces / (args.speedup * rate)
        lines = [f"# Monitor backlog under traffic {args.speedup:g}x its verification rate\n",
                 f"`{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}` on {describe(1)}, "
                 f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. The monitor verifies {rate:.2f} traces/s "
                 f"(24 tokens each); traffic: a shard of {args.shard_traces} traces every {interval:.2f} s = "
                 f"{args.shard_traces / interval:.1f} "
                 f"traces/s for {args.seconds:g} s.\n",
                 "| sampled | mean fraction verified | shards written | shards verified | backlog (shards) at "
                 "25% / 50% / 75% / 100% of the run | largest | bounded |", "|---|---|---|---|---|---|---|"]
        for fraction, keep_up in ((1.0, False), (args.sample, False), (args.sample, True)):
            r = backlog_run(traces, fraction, interval, args.seconds, work, args.shard_traces, keep_up)
            s = r["samples"]
            at = [min(s, key=lambda x: abs(x[0] - q * args.seconds))[1] for q in (0.25, 0.5, 0.75, 1.0)]
            mean = "-" if r["mean_sample"] is None else f"{r['mean_sample']:.1%}"
            lines.append(f"| {fraction:.0%}{' --keep-up' if keep_up else ''} | {mean} | {r['written']} | {r['done']:.0f} | "
                         f"{' / '.join(f'{v:.0f}' for v in at)} | {max(v for _, v in s):.0f} | "
                         f"{'yes' if at[3] <= at[1] + 2 else 'no: it grows'} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
