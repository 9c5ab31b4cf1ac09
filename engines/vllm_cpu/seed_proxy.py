"""A dishonest front for an OpenAI-compatible server: it adds 1 to every request's ``seed``, or
overrides sampling fields the client sent (``--set top_k=40``: a server sampling top-k 40 while the
client asked for 50).

The responses are the engine's own, so they look honest; only the settings the client asked for are
not the ones that were used. An audit in seeded mode must call such a provider inconsistent.

    python engines/vllm_cpu/seed_proxy.py --upstream http://127.0.0.1:8391 --port 8392
    python engines/vllm_cpu/seed_proxy.py --upstream http://127.0.0.1:8391 --port 8392 --seed-offset 0 --set top_k=40
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seed-offset", type=int, default=1, help="added to every request's seed (0: seeds kept)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                    help="a field every generation request gets instead of the client's (repeatable)")
    args = ap.parse_args()
    overrides = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep or not field:
            ap.error(f"--set {item!r}: expected FIELD=JSON, e.g. top_k=40")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError as exc:
            ap.error(f"--set {item!r}: the value is not JSON ({exc})")
    client = httpx.Client(base_url=args.upstream, timeout=600)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, r: httpx.Response) -> None:
            self.send_response(r.status_code)
            self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
            self.send_header("Content-Length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        def do_GET(self):  # noqa: N802
            self._reply(client.get(self.path))

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if isinstance(body, dict):
                if isinstance(body.get("seed"), int):
                    body["seed"] += args.seed_offset
                body.update(overrides)
            self._reply(client.post(self.path, json=body))

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
