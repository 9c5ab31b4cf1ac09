"""Dashboard pages with 100,000 windows in the database against the same pages with 4,000.

Usage: python benchmarks/dashboard_pages.py [--small 4000] [--large 100000] [--series 4] [--repeats 9]

Two SQLite databases are filled through the store's models (``verinfer.production.store.Window``,
migrated by Alembic as the monitor's are; each series' newest window recorded in ``streams`` by
``store.advance_stream``, as the monitor does) with the same number of series (provider/model/profile,
60 s windows) and seeded verdict runs (mostly CONSISTENT, INCONSISTENT runs, a few windows without a
verdict), judged by the shipped bands so honest bands are drawn. Each page is rendered in process
(FastAPI's TestClient: routing, queries, Jinja, SVG) ``--repeats`` times, alternating the two
databases, after a ``gc.collect()`` each; printed: the median wall and CPU milliseconds per page at
each size and their ratio (large / small). The first render of each page (cold caches: bands
computed, templates compiled) is timed separately. Writes ``results/dashboard_pages.md``.

The claim is the ratio: both sizes show the same number of points (``--small`` holds at least 500
windows per series), so a page whose cost followed the number of windows in the database would be
~25x slower at 100,000; one whose cost follows what it shows stays near 1.
This machine is shared and has 2 cores; absolute times are not claims.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy import insert  # noqa: E402

from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.production.dashboard import create_app  # noqa: E402
from verinfer.production.store import Key, Window, advance_stream, open_store, timeline  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
T0 = dt.datetime(2026, 1, 1)
JUDGED_BY = "bands bands-smollm2-135m-greedy.json"


def fill(url: str, windows: int, series: int, seed: int = 0):
    """``windows`` windows split evenly over ``series`` series, in chunks of 10,000 rows."""
    store = open_store(url)
    rng = np.random.default_rng(seed)
    per = windows // series
    for k in range(series):
        verdicts = np.where(rng.random(per) < 0.02, None, "CONSISTENT").astype(object)
        for start in rng.choice(per, size=max(per // 500, 1), replace=False):  # INCONSISTENT runs
            verdicts[start:start + int(rng.integers(3, 30))] = "INCONSISTENT"
        tokens = rng.integers(200, 4000, size=per)
        for lo in range(0, per, 10_000):
            rows = []
            for i in range(lo, min(lo + 10_000, per)):
                start, v = T0 + dt.timedelta(minutes=i), verdicts[i]
                bad = v == "INCONSISTENT"
                rows.append(dict(provider=f"provider-{k}", model="smollm2-135m", profile="greedy", seconds=60,
                                 start_time=start, end_time=start + dt.timedelta(minutes=1), traces=8,
                                 tokens=int(tokens[i]), exact_match_rate=float(0.6 if bad else 0.995),
                                 mean_margin=float(2.0 if bad else 0.01), verdict=v,
                                 p_value=None if v is None else (1e-4 if bad else 0.5),
                                 judged_by=None if v is None else JUDGED_BY, note=v or "too few tokens",
                                 shards=1, computed=1, updated_at=start + dt.timedelta(minutes=2)))
            with store.transaction() as s:
                s.execute(insert(Window), rows)
        with store.transaction() as s:
            advance_stream(s, s.scalars(timeline(Key(f"provider-{k}", "smollm2-135m", "greedy", 60), newest=1)).one(),
                           per, int(tokens.sum()))
    return store, T0 + dt.timedelta(minutes=per)


def pages(end: dt.datetime) -> dict[str, str]:
    since = (end - dt.timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"/ (500 points per series)": "/",
            "/ one provider": "/?provider=provider-1",
            "/ last 6 h of data": f"/?since={since}",
            "/metrics": "/metrics",
            "/window/{id}": "/window/1"}


def timed(client: TestClient, path: str) -> tuple[float, float]:
    gc.collect()  # each render pays for its own garbage, not for what the one before left
    w, c = time.perf_counter(), time.process_time()
    resp = client.get(path)
    assert resp.status_code == 200, (path, resp.status_code, resp.text[:300])
    return (time.perf_counter() - w) * 1000, (time.process_time() - c) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=4000)
    ap.add_argument("--large", type=int, default=100_000)
    ap.add_argument("--series", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        sizes = (args.small, args.large)
        clients, ends, fill_s = {}, {}, {}
        for n in sizes:
            started = time.perf_counter()
            store, ends[n] = fill(f"sqlite:///{tmp}/history-{n}.db", n, args.series)
            fill_s[n] = time.perf_counter() - started
            clients[n] = TestClient(create_app(store))
            print(f"filled {n} windows in {fill_s[n]:.1f} s", file=sys.stderr, flush=True)
        rows = []
        for name in pages(ends[args.small]):
            paths = {n: pages(ends[n])[name] for n in sizes}
            cold = {n: timed(clients[n], paths[n]) for n in sizes}
            runs: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
            for _ in range(args.repeats):
                for n in sizes:
                    runs[n].append(timed(clients[n], paths[n]))
            wall = {n: statistics.median(r[0] for r in runs[n]) for n in sizes}
            cpu = {n: statistics.median(r[1] for r in runs[n]) for n in sizes}
            rows.append((name, cold[args.small][0], cold[args.large][0], wall[args.small], wall[args.large],
                         wall[args.large] / wall[args.small], cpu[args.small], cpu[args.large],
                         cpu[args.large] / cpu[args.small]))
    s, l_ = f"{args.small:,}", f"{args.large:,}"
    table = [f"| page | first render, ms ({s} / {l_}) | wall ms, {s} | wall ms, {l_} | wall ratio | CPU ms, {s} | "
             f"CPU ms, {l_} | CPU ratio |", "|---|---|---|---|---|---|---|---|"]
    table += [f"| `{r[0]}` | {r[1]:.0f} / {r[2]:.0f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.2f} | {r[6]:.1f} | {r[7]:.1f} | "
              f"{r[8]:.2f} |" for r in rows]
    text = "\n".join([
        "# dashboard_pages",
        "",
        f"Command: `python benchmarks/dashboard_pages.py --small {args.small} --large {args.large} --series "
        f"{args.series} --repeats {args.repeats}`  ",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {describe(1)}; load average "
        f"{load_before:.1f} at start, {os.getloadavg()[0]:.1f} at the end.  ",
        f"Data: SQLite (WAL), {args.series} series of 60 s windows judged by the shipped greedy bands, filled "
        f"through the store's models in {fill_s[args.small]:.1f} s / {fill_s[args.large]:.1f} s. Medians of "
        f"{args.repeats} renders in process (TestClient), alternating the two databases.",
        "",
        *table,
        ""])
    print(text)
    RESULTS.mkdir(exist_ok=True)
    write_atomic(RESULTS / "dashboard_pages.md", text)


if __name__ == "__main__":
    main()
