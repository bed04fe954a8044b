"""`pdserve chat` (run as a user runs it) waits through a 503 with Retry-After — a gateway whose model is still
loading says so — with one progress line, and gives up with one error line when there is nothing to wait for.

The server here is a twin of the gateway's HTTP surface (stdlib, loopback): it answers exactly what the
gateway answers in those states, so the client's behaviour can be driven state by state."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class _Twin(BaseHTTPRequestHandler):
    plan: list = []  # per POST: (status, headers) or "stream"
    posts = 0

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        step = type(self).plan[min(type(self).posts, len(type(self).plan) - 1)]
        type(self).posts += 1
        if step in ("stream", "stream+usage"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for word in ("Paris", "."):
                self.wfile.write(f"data: {json.dumps({'choices': [{'delta': {'content': word}}]})}\n\n".encode())
            if step == "stream+usage":  # stream_options.include_usage: the last chunk
                usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        status, headers = step
        body = json.dumps({"error": {"message": "model smollm2 is loading", "type": "server_error"}}).encode()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def twin():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Twin)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _chat(url: str, wait: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoscaler.cli", "chat", "Capital of France?", "--url", url,
                           "--wait", str(wait)], capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_answer_then_the_speed_it_got_from_the_streams_usage(twin):
    _Twin.plan, _Twin.posts = ["stream+usage"], 0
    r = _chat(twin[1])
    assert r.returncode == 0 and r.stdout.strip() == "Paris.", r.stderr
    assert r.stderr.startswith("pdserve chat: 2 tokens, the first after ") and r.stderr.count("\n") == 1, r.stderr


def test_a_503_with_retry_after_is_waited_through_with_one_line(twin):
    _Twin.plan, _Twin.posts = [(503, {"Retry-After": "1"})] * 2 + ["stream"], 0
    r = _chat(twin[1])
    assert r.returncode == 0 and r.stdout.strip() == "Paris.", r.stderr
    assert _Twin.posts == 3 and r.stderr.count("\n") == 1 and "retrying" in r.stderr and "loading" in r.stderr


@pytest.mark.parametrize("step", [(503, {}), (400, {}), (503, {"Retry-After": "30"})],
                         ids=["503 without Retry-After", "400", "a Retry-After past --wait"])  # fmt: skip
def test_nothing_to_wait_for_is_one_error_line(twin, step):
    _Twin.plan, _Twin.posts = [step, "stream"], 0
    r = _chat(twin[1], wait=5)
    assert r.returncode == 2 and _Twin.posts == 1, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"pdserve chat: error {step[0]}"), r.stderr
