"""Signed requests and node proofs (compute/node/auth.py): the verifier's rules, then a real node process
that takes only signed requests, refuses a replay and an expired signature, and proves only its own URL."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest

from compute.node import auth
from tests.services import AUTH, TOKEN, Services


def _signed(token=TOKEN, method="POST", target=b"/internal/abort", body=b'{"request_id": "x"}', at=None):
    at = f"{time.time() if at is None else at:.3f}"
    nonce = "ab" * 16
    return {auth.TIME: at, auth.NONCE: nonce, auth.SIGNATURE: auth.signature(token, method, target, body, at, nonce)}


def test_verifier_accepts_a_signed_request_once():
    v = auth.Verifier(TOKEN)
    h = _signed()
    assert v.check("POST", b"/internal/abort", b'{"request_id": "x"}', h) is None
    status, why = v.check("POST", b"/internal/abort", b'{"request_id": "x"}', h)  # the same request again
    assert status == 401 and "replayed" in why


@pytest.mark.parametrize("change", ["method", "target", "body", "token", "unsigned"])
def test_verifier_refuses_what_was_not_signed(change):
    v = auth.Verifier(TOKEN)
    method, target, body = "POST", b"/internal/abort", b'{"request_id": "x"}'
    h = _signed(token="another-token" if change == "token" else TOKEN)
    if change == "unsigned":
        h = {}
    got = v.check("GET" if change == "method" else method, b"/internal/drain" if change == "target" else target,
                  b'{"request_id": "y"}' if change == "body" else body, h)  # fmt: skip
    assert got is not None and got[0] == 401
    assert ("unsigned" if change == "unsigned" else "invalid signature") in got[1]


def test_verifier_refuses_a_signature_outside_its_window():
    v = auth.Verifier(TOKEN, window_s=30)
    for skew in (-31, 31):  # captured and replayed later; or dated ahead to outlive the window
        got = v.check("POST", b"/internal/abort", b'{"request_id": "x"}', _signed(at=time.time() + skew))
        assert got is not None and got[0] == 401 and "expired" in got[1]
    assert v.check("POST", b"/internal/abort", b'{"request_id": "x"}', _signed(at=time.time() - 29)) is None


def test_verifier_forgets_nonces_after_the_window():
    now = [1000.0]
    v = auth.Verifier(TOKEN, window_s=30, clock=lambda: now[0])
    for i in range(5):
        at, nonce = f"{now[0]:.3f}", f"{i:032x}"
        h = {auth.TIME: at, auth.NONCE: nonce, auth.SIGNATURE: auth.signature(TOKEN, "GET", "/load", b"", at, nonce)}
        assert v.check("GET", b"/load", b"", h) is None
    assert len(v._seen) == 5
    now[0] += 31
    at, nonce = f"{now[0]:.3f}", "f" * 32
    h = {auth.TIME: at, auth.NONCE: nonce, auth.SIGNATURE: auth.signature(TOKEN, "GET", "/load", b"", at, nonce)}
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
    h = auth.signed_headers(TOKEN, "POST", "/internal/abort", body)
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
