"""What an abandoned long prompt costs the next client of ``verinfer serve`` (issue #15, item 2).

Usage: python benchmarks/abandoned_prefill.py [--prompt-tokens 8000] [--leave-after 3] [--chunks 0,512]

For each ``--prefill-chunk`` setting (0: one-pass prefill, not interruptible) a server runs on
loopback with the bundled model; a client sends a completion request with a ``--prompt-tokens``
prompt, disconnects after ``--leave-after`` seconds, and a second client then asks for 3 tokens
of a short prompt. Printed: the second client's latency (wall time from its request to its
answer) per setting, their ratio, and the latency of the same short request on an idle server,
all measured in one run on the same server code. One torch thread.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import httpx  # noqa: E402
import torch  # noqa: E402

from verinfer.api import load_model  # noqa: E402
from verinfer.files import write_atomic  # noqa: E402
from verinfer.serve import ServeConfig, serve_in_thread  # noqa: E402


def _leave(url: str, ids: list[int], after: float) -> None:
    """Send a completion request on a raw socket and close it unread after ``after`` seconds."""
    u = httpx.URL(url)
    data = json.dumps({"prompt": ids, "max_tokens": 4, "temperature": 0.0}).encode()
    with socket.create_connection((u.host, u.port)) as sock:
        sock.sendall(f"POST {u.path}/completions HTTP/1.1\r\nHost: {u.host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after)


def _short(client: httpx.Client, ids: list[int]) -> float:
    t = time.perf_counter()
    r = client.post("/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0.0})
    r.raise_for_status()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--leave-after", type=float, default=3.0)
    ap.add_argument("--chunks", default="0,512", help="comma-separated --prefill-chunk settings")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "abandoned_prefill.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = load_model("smollm2-135m")
    text = "A long story about the sea, the wind and the ships that sailed from the harbour. "
    ids = backend.tokenizer.encode(text * (args.prompt_tokens // 10 + 1))[: args.prompt_tokens]
    short = backend.tokenizer.encode("Next please")
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        config = ServeConfig(batch_wait_s=0.0, prefill_chunk_tokens=chunk, max_tokens_limit=8, queue_timeout_s=0)
        with serve_in_thread(backend, config) as url, httpx.Client(base_url=url, timeout=600) as client:
            idle = _short(client, short)
            _leave(url, ids, args.leave_after)
            waited = _short(client, short)
            health = client.get(client.base_url.join("/health")).json()
        rows.append((chunk, idle, waited, health["abandoned"]))
        print(f"prefill chunk {chunk or 'off'}: next client waited {waited:.2f} s (idle server {idle:.2f} s), "
              f"abandoned {health['abandoned']}", flush=True)
    base = rows[0][2]
    lines = [f"# Abandoned {len(ids)}-token prompt: what the next client waits",
             "", f"`python benchmarks/abandoned_prefill.py --prompt-tokens {args.prompt_tokens} --leave-after "
             f"{args.leave_after} --chunks {args.chunks}`, {dt.date.today()}, SmolLM2-135M fp32, one torch thread, "
             f"{os.cpu_count()} shared CPU cores, load average {os.getloadavg()[0]:.1f} at the end.",
             "", "| --prefill-chunk | next client's latency (s) | vs first setting | idle server (s) | abandoned |",
             "|---|---|---|---|---|"]
    lines += [f"| {c or 'off (one pass)'} | {w:.2f} | {w / base:.3f} | {i:.2f} | {a} |" for c, i, w, a in rows]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
