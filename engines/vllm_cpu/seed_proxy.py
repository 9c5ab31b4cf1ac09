"""A dishonest front for an OpenAI-compatible server: it adds 1 to every request's ``seed``.

The responses are the engine's own, so they look honest; only the seed the client asked for is not
the one that was used. An audit in seeded mode must call such a provider inconsistent.

    python engines/vllm_cpu/seed_proxy.py --upstream http://127.0.0.1:8391 --port 8392
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
    args = ap.parse_args()
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
            if isinstance(body, dict) and isinstance(body.get("seed"), int):
                body["seed"] += 1
            self._reply(client.post(self.path, json=body))

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
