"""The API contract: /openapi.json describes what the gateway really returns, and `schemathesis run`
against a running gateway (real prefill + decode nodes, loopback) finds no failure.

The nodes serve a tiny random Llama carrying the real SmolLM2 tokenizer and chat template (a
vocabulary of 49152), so that each of the several hundred generated requests costs milliseconds,
not the real model's hundreds: the contract is the gateway's, the tokenizer and template are real.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from tests.conftest import tiny_llama_config, tiny_llama_tensors, write_hf_folder
from tests.services import running_service

pytestmark = pytest.mark.slow
KEY = "sk-contract"  # API key and admin key: one header reaches /v1 and /admin
MAX_TOKENS = 8  # [gateway] max_tokens_limit: the document's max_tokens maximum


@pytest.fixture(scope="module")
def chat_tiny_store(tmp_path_factory, real_model_store):
    """A tiny Llama with SmolLM2's tokenizer bundle, imported into its own store: (locations, name)."""
    from paramstore import ParamStore, StoreConfig

    locations, name = real_model_store
    with ParamStore(StoreConfig(locations=locations)) as ps, ps.reader(ps.manifest(name)) as r:
        files = r.bundle()
    # a context of 4096: the fuzzer's longest conversations fit (too long a prompt is a 400 no schema can state)
    cfg = tiny_llama_config(vocab=49152, tied=True) | {"max_position_embeddings": 4096}
    folder = write_hf_folder(tmp_path_factory.mktemp("tiny-chat"), cfg, tiny_llama_tensors(cfg), files=1)
    for fname, data in files.items():
        with open(os.path.join(folder, fname), "wb") as f:
            f.write(data)
    store = StoreConfig.local_default(str(tmp_path_factory.mktemp("tiny-chat-store")), k=4, m=2)
    with ParamStore(store) as ps:
        ps.import_model(folder, "tiny-chat")
    return store.locations, "tiny-chat"


@pytest.fixture(scope="module")
def dead_proxy():
    """A loopback port bound and never listened on: every connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def svc(tmp_path_factory, chat_tiny_store, dead_proxy):
    """Prefill + decode nodes and a gateway. The gateway reaches hosts other than loopback only through a
    proxy that refuses every connection: the nodes the fuzzer registers (POST /admin/nodes) are polled
    without a DNS lookup or a packet leaving this machine, and fail their health checks at once."""
    locations, name = chat_tiny_store
    tmp = tmp_path_factory.mktemp("contract")
    conf = tmp / "pdserve.toml"
    conf.write_text(f"[gateway]\nmax_tokens_limit = {MAX_TOKENS}\n")
    env = {"PDSERVE_API_KEYS": KEY, "PDSERVE_ADMIN_KEY": KEY, "NO_PROXY": "127.0.0.1,localhost",
           **{v: dead_proxy for v in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}}  # fmt: skip
    with running_service(tmp, locations, name, ["prefill", "decode"], env=env, extra=("--config", str(conf))) as svc:
        yield svc


def test_document_lists_the_errors_the_api_returns(svc):
    doc = httpx.get(svc["gw"].url + "/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "401", "404", "429", "503"} <= set(chat["responses"]) and "422" not in chat["responses"]
    assert chat["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["security"] == [{"api_key": []}]
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["model"]["enum"] == [svc["name"]]
    assert {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS} in props["max_tokens"]["anyOf"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_document_describes_responses_model_retrieval_and_tokenize(svc):
    doc = httpx.get(svc["gw"].url + "/openapi.json").json()
    resp = doc["paths"]["/v1/responses"]["post"]
    assert {"200", "400", "401", "404", "429", "503"} <= set(resp["responses"])
    assert set(resp["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for path in ("/v1/responses", "/tokenize", "/detokenize", "/v1/models/{model}"):
        op = next(iter(doc["paths"][path].values()))
        assert op["security"] == [{"api_key": []}] and "401" in op["responses"], path
    assert "404" in doc["paths"]["/v1/models/{model}"]["get"]["responses"]
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert props["model"]["enum"] == [svc["name"]]
    assert {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS} in props["max_output_tokens"]["anyOf"]
    assert props["store"]["anyOf"] == [{"type": "boolean", "const": False}, {"type": "null"}]
    tokens = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"]["maximum"] == 49151


def test_405_names_every_allowed_method(svc):
    url, auth = svc["gw"].url, {"Authorization": f"Bearer {KEY}"}
    r = httpx.request("PUT", url + "/admin/nodes", headers=auth)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, POST"
    r = httpx.request("TRACE", url + "/v1/chat/completions", headers=auth)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


@pytest.mark.long  # the fuzzer's minutes: make test-long
def test_schemathesis_finds_no_failure(svc, tmp_path):
    """Every check, coverage and fuzzing phases, every operation, bounded: a fixed seed, a few examples per
    operation, a time limit. (Fuzzing POST /admin/nodes found a 500: a host httpx cannot encode.)"""
    cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", svc["gw"].url + "/openapi.json",
           "--checks", "all", "--phases", "coverage,fuzzing", "--max-examples", "8", "--workers", "1",
           "--seed", "20261204", "--generation-database", "none", "--request-timeout", "30",
           "--header", f"Authorization: Bearer {KEY}", "--no-color", "--output-sanitize", "false"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "No issues found" in out, out[-6000:]
    assert "Tested: 16" in out, out[-3000:]  # every operation of the document
    assert "Fuzzing" in out and "Coverage" in out, out[-3000:]


BAD_NODE_URLS = [
    b'"http://\\udbe8\\udc94"',  # the fuzzer's: one astral character, no IDNA form (was a 500)
    b'"http://\\ud800:8001"',  # a lone surrogate
    b'"http://[::1"', b'"http://[::::1]:8001"', b'"http://127.0.0.1:99999"', b'"http://127.0.0.1:0"',
    b'"ftp://127.0.0.1:8001"', b'"http://"', b'"http://u:p@127.0.0.1:8001"', b'"http://127.0.0.1:8001?x=1"',
    b'"http://999.0.0.1:8001"', b'"http://a..b:8001"', b'"http://-a:8001"', b'"http://127.0.0.1:8001\\n"',
    b'"http://' + b"a" * 64 + b'.b:8001"', b'"http://' + b"a" * 2100 + b'"',
]  # fmt: skip


def test_admin_refuses_a_bad_node_url_with_400_and_registers_nothing(svc):
    url, auth = svc["gw"].url, {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    before = [n["url"] for n in httpx.get(url + "/admin/nodes", headers=auth, timeout=10).json()["nodes"]]
    for raw in BAD_NODE_URLS:
        r = httpx.post(url + "/admin/nodes", content=b'{"url": ' + raw + b', "role": "both"}', headers=auth, timeout=10)
        assert r.status_code == 400 and "invalid node URL" in r.json()["error"]["message"], (raw[:80], r.text[:300])
        assert r.json()["error"]["param"] == "url"
    r = httpx.post(url + "/admin/nodes", content=b'{"url": "http://127.0.0.1:1/", "role": "both", "source": "\\ud800"}',
                   headers=auth, timeout=10)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "source", r.text
    after = [n["url"] for n in httpx.get(url + "/admin/nodes", headers=auth, timeout=10).json()["nodes"]]
    assert after == before  # nothing registered
    ok = ["http://127.0.0.1:1/", "http://[::1]:1", "https://pdserve-decode-0.pdserve.svc.cluster.local:8001/api"]
    for good in ok:
        r = httpx.post(url + "/admin/nodes", json={"url": good, "role": "decode"}, headers=auth, timeout=10)
        assert r.status_code == 200 and r.json() == {"added": good.rstrip("/"), "proven": False}, r.text  # unreachable
    try:
        listed = {n["url"]: n for n in httpx.get(url + "/admin/nodes", headers=auth, timeout=10).json()["nodes"]}
        assert {u.rstrip("/") for u in ok} <= set(listed) and listed["http://127.0.0.1:1"]["state"] == "unproven"
    finally:
        for good in ok:
            r = httpx.delete(url + "/admin/nodes", params={"url": good}, headers=auth, timeout=10)
            assert r.json() == {"removed": True}, r.text


def test_admin_status_with_a_lone_surrogate_in_a_report_is_200(svc):
    """JSON lets a body carry "\\ud800"; echoed back (the autoscaler's report in /admin/status) it is that
    escape again, not a 500 from the UTF-8 encoder."""
    url, auth = svc["gw"].url, {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(url + "/admin/autoscaler", content=b'{"reason": "x\\ud800y"}', headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    r = httpx.get(url + "/admin/status", headers=auth, timeout=10)
    assert r.status_code == 200 and b'"x\\ud800y"' in r.content and r.json()["autoscaler"]["reason"] == "x\ud800y"


def test_a_node_url_httpx_refuses_is_never_registered():
    """A static or discovered node whose URL httpx cannot parse (or any URL that is not a node's) is refused
    where it is registered, with the reason: it is never challenged, polled or routed to."""
    from gateway.routing.registry import NodeRegistry

    reg = NodeRegistry("t", interval_s=60, failures=1)
    for url, role in (("http://[::1", "both"), ("http://user@10.0.0.5:8001", "both"), ("http://10.0.0.5:8001", "x")):
        with pytest.raises(ValueError, match="invalid node"):
            reg.add(url, role)
    assert reg.nodes == {}
