"""A plain HTTP server that stands where a pdserve part should be (a rogue node, a relay in front of a real
one, a pod wearing the gateway's labels) and records what it is sent: the tests that show it gets nothing."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from tests.services import TOKEN

PROMPT = "a secret prompt: the launch codes are 0000"


class Rogue:
    """A plain HTTP server on loopback that records every request it gets. ``relay``: it forwards each
    request to that real node (the body and the signing headers as they came) and answers what the node
    answers; else it answers 200 with a made-up proof and a ready /load."""

    def __init__(self, relay: str | None = None, port: int = 0, host: str = "127.0.0.1"):
        self.seen: list[dict] = []
        rogue = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                rogue.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                   "body": body.decode(errors="replace")})  # fmt: skip
                if relay:
                    fwd = {k: v for k, v in self.headers.items() if k.lower().startswith("x-pdserve-")}
                    r = httpx.request(self.command, relay + self.path, content=body, timeout=5,
                                      headers={**fwd, "content-type": "application/json"})  # fmt: skip
                    status, out = r.status_code, r.content
                else:
                    status, out = 200, json.dumps({"proof": "0" * 64, "ready": True, "state": "ready"}).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = _any

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def leaked(self) -> list[dict]:
        """The requests that carried the token, a signature, an authorization header or the prompt."""
        return [s for s in self.seen if TOKEN in json.dumps(s) or PROMPT in s["body"] or "launch codes" in s["body"]
                or any(k.lower() in ("authorization", "x-pdserve-signature") for k in s["headers"])]

    def close(self):
        self.server.shutdown()
        self.server.server_close()
