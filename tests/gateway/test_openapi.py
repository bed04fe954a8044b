"""The API contract: /openapi.json describes what the gateway really returns, and `schemathesis run`
against a running gateway (real prefill + decode nodes, loopback) finds no failure.

The nodes serve a tiny random Llama carrying the real SmolLM2 tokenizer and chat template (a
vocabulary of 49152), so that each of the several hundred generated requests costs milliseconds,
not the real model's hundreds: the contract is the gateway's, the tokenizer and template are real.
"""

from __future__ import annotations

import os
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
def svc(tmp_path_factory, chat_tiny_store):
    locations, name = chat_tiny_store
    tmp = tmp_path_factory.mktemp("contract")
    conf = tmp / "pdserve.toml"
    conf.write_text(f"[gateway]\nmax_tokens_limit = {MAX_TOKENS}\n")
    with running_service(tmp, locations, name, ["prefill", "decode"],
                         env={"PDSERVE_API_KEYS": KEY, "PDSERVE_ADMIN_KEY": KEY},
                         extra=("--config", str(conf))) as svc:  # fmt: skip
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


def test_405_names_every_allowed_method(svc):
    url, auth = svc["gw"].url, {"Authorization": f"Bearer {KEY}"}
    r = httpx.request("PUT", url + "/admin/nodes", headers=auth)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, POST"
    r = httpx.request("TRACE", url + "/v1/chat/completions", headers=auth)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


def test_schemathesis_finds_no_failure(svc, tmp_path):
    """Every check, coverage and fuzzing phases, bounded examples. POST /admin/nodes is left out: fuzzed
    node URLs would send the gateway's health polls to arbitrary hosts."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", svc["gw"].url + "/openapi.json",
           "--checks", "all", "--phases", "coverage,fuzzing", "--max-examples", "5", "--workers", "1",
           "--seed", "20261204", "--generation-database", "none", "--request-timeout", "30",
           "--exclude-operation-id", "add_node_admin_nodes_post", "--header", f"Authorization: Bearer {KEY}",
           "--no-color", "--output-sanitize", "false"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "No issues found" in out, out[-6000:]
    assert "Tested: 11" in out, out[-3000:]  # every operation of the document but the one left out
