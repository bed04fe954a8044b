"""Signed requests and node proofs (compute/node/auth.py): the verifier's rules, then real node processes that
take only signed requests, refuse a replay and an expired signature, a request signed for another node (a
captured one replayed across the fleet), one captured before a restart, and a body before its sender is known
(an unsigned 60 MiB upload is refused on its headers), and prove only their own URL."""

from __future__ import annotations

import hashlib
import socket
import time

import httpx
import pytest

from compute.node import auth
from tests.services import AUTH, TOKEN, Services

TO = "http://127.0.0.1:8001"


def _signed(token=TOKEN, method="POST", target=b"/internal/abort", body=b'{"request_id": "x"}', at=None, to=TO):
    at = f"{time.time() if at is None else at:.3f}"
    nonce = "ab" * 16
    return {auth.TIME: at, auth.NONCE: nonce, auth.TO: to,
            auth.SIGNATURE: auth.signature(token, method, target, body, at, nonce, to)}


def test_verifier_accepts_a_signed_request_once():
    v = auth.Verifier(TOKEN)
    h = _signed()
    assert v.check("POST", b"/internal/abort", b'{"request_id": "x"}', h) is None
    status, why = v.check("POST", b"/internal/abort", b'{"request_id": "x"}', h)  # the same request again
    assert status == 401 and "replayed" in why


@pytest.mark.parametrize("change", ["method", "target", "body", "token", "unsigned", "receiver"])
def test_verifier_refuses_what_was_not_signed(change):
    v = auth.Verifier(TOKEN)
    method, target, body = "POST", b"/internal/abort", b'{"request_id": "x"}'
    h = _signed(token="another-token" if change == "token" else TOKEN)
    if change == "unsigned":
        h = {}
    if change == "receiver":  # signed for 8001, the header rewritten to pass for this receiver: the MAC says no
        h[auth.TO] = "http://127.0.0.1:8002"
    got = v.check("GET" if change == "method" else method, b"/internal/drain" if change == "target" else target,
                  b'{"request_id": "y"}' if change == "body" else body, h)  # fmt: skip
    assert got is not None and got[0] == 401
    assert ("unsigned" if change == "unsigned" else "invalid signature") in got[1]


def test_verifier_refuses_a_request_for_another_receiver_or_an_earlier_run():
    v = auth.Verifier(TOKEN, names=lambda to, local: to == TO)
    body = b'{"request_id": "x"}'
    got = v.check("POST", b"/internal/abort", body, _signed(to="http://127.0.0.1:8002"))  # signed for node B
    assert got is not None and got[0] == 401 and "another receiver" in got[1]
    got = v.check("POST", b"/internal/abort", body, _signed(at=v.started - 2))  # made before this process started
    assert got is not None and got[0] == 401 and "before this process started" in got[1]
    assert v.check("POST", b"/internal/abort", body, _signed()) is None


def test_verifier_refuses_a_signature_outside_its_window():
    v = auth.Verifier(TOKEN, window_s=30)
    v.started = time.time() - 60  # (started a minute ago)
    for skew in (-31, 31):  # captured and replayed later; or dated ahead to outlive the window
        got = v.check("POST", b"/internal/abort", b'{"request_id": "x"}', _signed(at=time.time() + skew))
        assert got is not None and got[0] == 401 and "expired" in got[1]
    assert v.check("POST", b"/internal/abort", b'{"request_id": "x"}', _signed(at=time.time() - 29)) is None


def test_verifier_forgets_nonces_after_the_window():
    now = [1000.0]
    v = auth.Verifier(TOKEN, window_s=30, clock=lambda: now[0])
    for i in range(5):
        at, nonce = f"{now[0]:.3f}", f"{i:032x}"
        h = {auth.TIME: at, auth.NONCE: nonce, auth.TO: TO,
             auth.SIGNATURE: auth.signature(TOKEN, "GET", "/load", b"", at, nonce, TO)}
        assert v.check("GET", b"/load", b"", h) is None
    assert len(v._seen) == 5
    now[0] += 31
    at, nonce = f"{now[0]:.3f}", "f" * 32
    h = {auth.TIME: at, auth.NONCE: nonce, auth.TO: TO, auth.SIGNATURE: auth.signature(TOKEN, "GET", "/load", b"", at,
                                                                                      nonce, TO)}  # fmt: skip
    assert v.check("GET", b"/load", b"", h) is None
    assert list(v._seen) == [nonce]  # the expired ones are gone: memory bounded by the window's traffic


def test_signed_auth_signs_what_httpx_sends():
    """The signature covers the bytes httpx puts on the wire: the path with its query, the JSON body."""
    req = httpx.Request("POST", "http://127.0.0.1:1/internal/drain?timeout_s=5", json={"a": 1})
    signed = next(AUTH.auth_flow(req))
    assert "authorization" not in signed.headers and TOKEN not in str(signed.headers)
    v = auth.Verifier(TOKEN)
    assert v.check("POST", b"/internal/drain?timeout_s=5", req.content, dict(signed.headers)) is None
    assert hashlib.sha256(req.content).hexdigest() not in str(signed.headers)  # the digest is signed, not sent


@pytest.mark.parametrize(("identity", "url", "names"), [
    (auth.Identity("127.0.0.1", 8001), "http://127.0.0.1:8001", True),
    (auth.Identity("127.0.0.1", 8001), "http://localhost:8001/", True),
    (auth.Identity("127.0.0.1", 8001), "http://127.0.0.1:8002", False),  # a relay on another port
    (auth.Identity("127.0.0.1", 8001), "http://10.0.0.5:8001", False),
    (auth.Identity("10.0.0.5", 8001), "http://10.0.0.5:8001", True),
    (auth.Identity("10.0.0.5", 8001), "http://10.0.0.6:8001", False),
    (auth.Identity("0.0.0.0", 8001), "http://10.0.0.6:8001", True),  # wildcard bind, nothing advertised: port only
    (auth.Identity("0.0.0.0", 8001, "http://10.0.0.5:8001"), "http://10.0.0.6:8001", False),
    (auth.Identity("0.0.0.0", 8001, "http://10.0.0.5:8001"), "http://10.0.0.5:8001", True),
    (auth.Identity("127.0.0.1", 8001), "ftp://127.0.0.1:8001", False),
    (auth.Identity("127.0.0.1", 8001), "http://[::1", False),
])  # fmt: skip
def test_identity_names_only_this_node(identity, url, names):
    assert identity.names(url) is names


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A standby node process (no model: the API and its auth are all this module needs)."""
    svc = Services([str(tmp_path_factory.mktemp("store"))], None, str(tmp_path_factory.mktemp("logs")), TOKEN)
    n = svc.node("both", model=None)
    try:
        yield n.wait_ready(60)
    finally:
        n.stop()


def test_node_takes_only_signed_requests(node):
    assert httpx.get(node.url + "/load", timeout=5).status_code == 401
    bearer = httpx.get(node.url + "/load", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert bearer.status_code == 401 and "unsigned" in bearer.json()["detail"]  # the token itself is no credential
    assert httpx.get(node.url + "/load", auth=auth.SignedAuth("not-the-token"), timeout=5).status_code == 401
    assert httpx.get(node.url + "/load", auth=AUTH, timeout=5).json()["state"] == "standby"
    for path in ("/health", "/ready", "/metrics"):  # what a kubelet probes and Prometheus scrapes
        assert httpx.get(node.url + path, timeout=5).status_code == 200


def test_node_refuses_a_replayed_or_expired_request(node):
    body = b'{"request_id": "nobody"}'
    h = auth.signed_headers(TOKEN, "POST", node.url + "/internal/abort", body)
    first = httpx.post(node.url + "/internal/abort", content=body, headers=h, timeout=5)
    assert first.status_code == 200 and first.json() == {"aborted": False}
    again = httpx.post(node.url + "/internal/abort", content=body, headers=h, timeout=5)  # captured and replayed
    assert again.status_code == 401 and "replayed" in again.json()["detail"]
    late = _signed(at=time.time() - auth.WINDOW_S - 5, body=body)  # captured a window ago, replayed now
    r = httpx.post(node.url + "/internal/abort", content=body, headers=late, timeout=5)
    assert r.status_code == 401 and "expired" in r.json()["detail"]


def test_node_proves_its_own_url_only(node):
    nonce = auth.challenge()
    r = httpx.post(node.url + "/prove", json={"nonce": nonce, "url": node.url}, timeout=5)
    assert r.status_code == 200 and auth.check_proof(TOKEN, nonce, node.url, r.json()["proof"])
    assert not auth.check_proof("another-token", nonce, node.url, r.json()["proof"])
    relay = "http://127.0.0.1:1"  # a relay that forwards the gateway's challenge for its own URL
    r = httpx.post(node.url + "/prove", json={"nonce": nonce, "url": relay}, timeout=5)
    assert r.status_code == 403 and "does not name this node" in r.json()["detail"]
    assert httpx.post(node.url + "/prove", json={"nonce": "short", "url": node.url}, timeout=5).status_code == 400
    assert httpx.post(node.url + "/prove", content=b"{", timeout=5).status_code == 400


def _headers_only(url: str, path: str, headers: dict[str, str], length: int, timeout: float = 5.0) -> tuple[int, float]:
    """POST ``path`` declaring a ``length``-byte body and sending none of it: (status, seconds to the answer)."""
    host, port = url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n{head}\r\n".encode())  # fmt: skip
        status = int(s.recv(4096).split(b" ", 2)[1])  # answered with the body still unsent: it was never read
    return status, time.monotonic() - t0


def test_a_body_is_not_read_before_its_sender_is_known(node):
    status, took = _headers_only(node.url, "/internal/generate", {}, 60 << 20)  # unsigned, 60 MiB declared
    assert status == 401 and took < 2.0, (status, took)
    signed = auth.signed_headers(TOKEN, "POST", node.url + "/internal/generate", b"")  # signed for an empty body
    status, _ = _headers_only(node.url, "/internal/generate", signed, auth.MAX_BODY + 1)  # declared over the cap
    assert status == 413
    status, _ = _headers_only(node.url, "/internal/generate", {**signed, auth.TIME: "1"}, 100)  # expired
    assert status == 401


def test_a_request_signed_for_one_node_is_refused_by_another_and_after_a_restart(tmp_path, node):
    svc = Services([str(tmp_path / "store")], None, str(tmp_path), TOKEN)
    other = svc.node("both", model=None)
    try:
        other.wait_ready(60)
        body = b'{"request_id": "nobody"}'
        for_node = auth.signed_headers(TOKEN, "POST", node.url + "/internal/abort", body)  # captured on its way
        r = httpx.post(other.url + "/internal/abort", content=body, headers=for_node, timeout=5)  # replayed elsewhere
        assert r.status_code == 401 and "another receiver" in r.json()["detail"], r.text
        for_other = auth.signed_headers(TOKEN, "POST", other.url + "/internal/abort", body)  # captured, not yet sent
        port = int(other.url.rsplit(":", 1)[1])
        other.stop()
        again = svc.node("both", model=None, port=port).wait_ready(60)  # the same node, restarted: a new process
        r = httpx.post(again.url + "/internal/abort", content=body, headers=for_other, timeout=5)
        assert r.status_code == 401 and "before this process started" in r.json()["detail"], r.text
        fresh = auth.signed_headers(TOKEN, "POST", again.url + "/internal/abort", body)
        assert httpx.post(again.url + "/internal/abort", content=body, headers=fresh, timeout=5).status_code == 200
        assert httpx.post(node.url + "/internal/abort", content=body, headers=for_node, timeout=5).status_code == 200
    finally:
        svc.stop_all()
