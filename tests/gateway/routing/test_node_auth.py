"""Nobody in where they don't belong: a process that is not a pdserve node registers itself with a real
gateway (real node, real HTTP, a plain HTTP server as the rogue) and gets neither the internal token nor a
prompt; nor does one squatting on a dead node's port (the gateway challenges a node again after any failed
poll); the admin API is closed without a key; the gateway's /internal/* takes only signed requests; the public
API and /tokenize refuse a body on its headers (no key, or over max_body_bytes) before reading it."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import import_tiny_chat_models
from tests.rogue import PROMPT, Rogue
from tests.services import AUTH, TOKEN, Services, wait_for

pytestmark = pytest.mark.slow
MODEL = "tiny-a"


@pytest.fixture(scope="module")
def svc(tmp_path_factory, real_model_store):
    store = import_tiny_chat_models(tmp_path_factory, *real_model_store, [MODEL], "auth-store").locations
    services = Services(store, MODEL, str(tmp_path_factory.mktemp("logs")), TOKEN)
    try:
        node = services.node("both").wait_ready(120)
        gw = services.gateway([("both", node)]).wait_ready(60)
        yield {"gw": gw, "node": node, "services": services}
    finally:
        services.stop_all()


def _chat(gw) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def rogue():
    r = Rogue()
    yield r
    r.close()


def test_registration_without_the_admin_key_is_refused(svc, rogue):
    gw = svc["gw"].url
    spec = {"url": rogue.url, "role": "both"}
    r = httpx.post(gw + "/admin/nodes", json=spec, timeout=10)
    assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
    r = httpx.post(gw + "/admin/nodes", json=spec, headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    time.sleep(1.0)  # two health polls
    assert rogue.seen == []


def test_a_rogue_node_is_refused_and_gets_neither_token_nor_prompt(svc, rogue):
    gw, admin = svc["gw"].url, svc["gw"].admin_headers
    r = httpx.post(gw + "/admin/nodes", json={"url": rogue.url, "role": "both"}, headers=admin, timeout=10)
    assert r.status_code == 403, r.text
    assert "did not" in r.json()["error"]["message"] or "does not match" in r.json()["error"]["message"]
    listed = httpx.get(gw + "/admin/nodes", headers=admin, timeout=10).json()
    assert rogue.url not in {n["url"] for n in listed["nodes"]} and rogue.url in listed["refused"]
    for _ in range(3):  # users' requests go on, to the real node only
        assert _chat(svc["gw"])["choices"][0]["finish_reason"] in ("stop", "length")
    time.sleep(1.5)  # three health polls: a refused node is never polled again
    assert [(s["method"], s["path"]) for s in rogue.seen] == [("POST", "/prove")]  # the challenge, nothing more
    assert set(json.loads(rogue.seen[0]["body"])) == {"nonce", "url"}
    assert rogue.leaked() == []


def test_a_relay_in_front_of_a_real_node_is_refused(svc):
    """The relay forwards the gateway's challenge to the real node, which proves only its own URL."""
    relay = Rogue(relay=svc["node"].url)
    try:
        gw, admin = svc["gw"].url, svc["gw"].admin_headers
        r = httpx.post(gw + "/admin/nodes", json={"url": relay.url, "role": "both"}, headers=admin, timeout=10)
        assert r.status_code == 403 and "does not name this node" in r.json()["error"]["message"]
        _chat(svc["gw"])
        time.sleep(1.0)
        assert [s["path"] for s in relay.seen] == ["/prove"] and relay.leaked() == []
    finally:
        relay.close()


def test_a_real_node_registered_by_hand_is_proven(svc):
    gw, admin, node = svc["gw"].url, svc["gw"].admin_headers, svc["node"].url
    r = httpx.post(gw + "/admin/nodes", json={"url": node, "role": "both"}, headers=admin, timeout=10)
    assert r.status_code == 200 and r.json()["proven"] is True


def test_gateway_internal_api_takes_only_signed_requests(svc):
    gw = svc["gw"].url
    assert httpx.get(gw + "/internal/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 401
    assert httpx.get(gw + "/internal/status", auth=AUTH, timeout=10).json()["served"] == [MODEL]


def test_admin_api_closed_without_a_key_and_open_only_when_asked(svc, rogue):
    """A gateway with no admin key refuses /admin/* (saying how to open it); a static node URL that cannot
    prove is refused at the first poll; --open-admin opens the admin API, with a warning at start."""
    s = svc["services"]
    closed = s.gateway([("both", svc["node"]), ("both", rogue)], env={"PDSERVE_ADMIN_KEY": ""}).wait_ready(60)
    opened = s.gateway([("both", svc["node"])], extra=("--open-admin",), env={"PDSERVE_ADMIN_KEY": ""}).wait_ready(60)
    try:
        r = httpx.get(closed.url + "/admin/status", timeout=10)
        assert r.status_code == 401 and "closed" in r.json()["error"]["message"]
        assert httpx.get(closed.url + "/admin/status", headers=svc["gw"].admin_headers, timeout=10).status_code == 401
        _chat(closed)  # the real node serves; the rogue one never does
        wait_for(lambda: "node refused" in closed.log(), 10, "the refusal in the gateway's log")
        assert [s["path"] for s in rogue.seen] == ["/prove"] and rogue.leaked() == []
        st = httpx.get(opened.url + "/admin/status", timeout=10)
        assert st.status_code == 200 and st.json()["served"] == [MODEL]
        assert "WARNING: --open-admin" in opened.log()
    finally:
        closed.stop()
        opened.stop()


def test_a_squatter_on_a_dead_nodes_port_gets_nothing(svc):
    """A proven node dies; another process takes its port: the gateway challenges whatever answers there before
    it routes or polls, so the squatter gets the challenge only, and the users' requests go on elsewhere."""
    s, gw, admin = svc["services"], svc["gw"].url, svc["gw"].admin_headers
    victim = s.node("both").wait_ready(120)
    r = httpx.post(gw + "/admin/nodes", json={"url": victim.url, "role": "both"}, headers=admin, timeout=10)
    assert r.status_code == 200 and r.json()["proven"] is True
    port = int(victim.url.rsplit(":", 1)[1])
    victim.kill9()
    squatter = None
    try:
        wait_for(lambda: any(n["url"] == victim.url and n["state"] != "ready" for n in
                             httpx.get(gw + "/admin/nodes", headers=admin, timeout=10).json()["nodes"]),
                 10, "the dead node out of routing", every=0.1)  # fmt: skip
        squatter = Rogue(port=port)
        wait_for(lambda: victim.url in httpx.get(gw + "/admin/nodes", headers=admin, timeout=10).json()["refused"],
                 10, "the squatter refused at its challenge", every=0.1)  # fmt: skip
        for _ in range(3):
            _chat(svc["gw"])
        assert [s["path"] for s in squatter.seen] == ["/prove"] and squatter.leaked() == [], squatter.seen
    finally:
        if squatter is not None:
            squatter.close()


def _declared(url: str, path: str, length: int, headers: str = "") -> int:
    """POST ``path`` declaring a ``length``-byte body, none of it sent: the status that comes back."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as c:
        c.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{headers}"
                  f"Content-Length: {length}\r\n\r\n".encode())  # fmt: skip
        return int(c.recv(4096).split(b" ", 2)[1])


def test_bodies_are_refused_on_their_headers_before_they_are_read(svc, tmp_path):
    """With API keys: /tokenize and /v1/* without a key answer 401 to a 60 MiB upload not yet sent; with the
    key, a body over max_body_bytes is 413 (declared, or streamed past it); 64 prompts x best_of 16 is 400 (at
    most 64 sequences a request); within the limits, served."""
    conf = tmp_path / "pdserve.toml"
    conf.write_text("[gateway]\nmax_body_bytes = 65536\n")
    gw = svc["services"].gateway([("both", svc["node"])], extra=("--config", str(conf)),
                                 env={"PDSERVE_API_KEYS": "sk-limits"}).wait_ready(60)  # fmt: skip
    try:
        for path in ("/tokenize", "/detokenize", "/v1/chat/completions"):
            assert _declared(gw.url, path, 60 << 20) == 401, path
        key = "Authorization: Bearer sk-limits\r\n"
        assert _declared(gw.url, "/v1/chat/completions", 60 << 20, key) == 413
        assert _declared(gw.url, "/v1/chat/completions", 65537, key) == 413
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]}).encode()
        r = httpx.post(gw.url + "/v1/chat/completions", content=iter([big[:40000], big[40000:]]), timeout=10,
                       headers={"authorization": "Bearer sk-limits", "content-type": "application/json"})  # chunked
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"], r.text
        fan = {"model": MODEL, "prompt": ["a"] * 64, "best_of": 16, "max_tokens": 1}  # 1,024 sequences asked
        r = httpx.post(gw.url + "/v1/completions", json=fan, timeout=10, headers={"authorization": "Bearer sk-limits"})
        assert r.status_code == 400 and "1024 sequences" in r.json()["error"]["message"], r.text
        r = httpx.post(gw.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=10,
                       headers={"authorization": "Bearer sk-limits"})  # fmt: skip
        assert r.status_code == 200 and r.json()["count"] >= 1, r.text
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60, headers={"authorization": "Bearer sk-limits"})
        assert r.status_code == 200, r.text
    finally:
        gw.stop()


def test_without_api_keys_only_a_loopback_host_is_answered(svc):
    """DNS rebinding: a page served from evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(svc["gw"].url + "/v1/chat/completions", json=body, headers={"host": "evil.example:8000"}, timeout=10)
    assert r.status_code == 400 and PROMPT not in r.text
    r = httpx.post(svc["gw"].url.replace("127.0.0.1", "localhost") + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_status_sends_the_local_admin_key_to_a_local_gateway_only(tmp_path):
    """`pdserve status --url` another host's gateway on the port of a local `pdserve up`: its key is not sent."""
    import subprocess
    import sys

    other = Rogue(host="127.0.0.2")  # another host (a loopback address, so the test reaches it) on some port
    try:
        port = other.url.rsplit(":", 1)[1]
        env = {**__import__("os").environ, "PDSERVE_RUN_DIR": str(tmp_path), "PDSERVE_ADMIN_KEY": ""}
        (tmp_path / "keys").mkdir(mode=0o700)
        (tmp_path / "keys" / f"admin-{port}.key").write_text("local-admin-key\n")
        subprocess.run([sys.executable, "-m", "autoscaler.cli", "status", "--url", other.url], env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
        assert other.seen and all("local-admin-key" not in json.dumps(s) for s in other.seen), other.seen
    finally:
        other.close()
