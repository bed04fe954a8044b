"""Signed manifests reach the nodes: a node opened with the store's HMAC key refuses a tampered manifest.

The attacker here can write the store (every copy of the manifest) and recomputes the manifest's
own sha256, so only the HMAC signature can tell: without the key the tampered manifest reads as
valid (the control), with the key `pdserve node` exits 2 with one line naming the signature and
never becomes ready, while the same node over the untampered store does.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from compute.node.launcher import ServiceProc, Services

TOKEN = "hmac-test-token"
PARAMSTORE = [sys.executable, "-m", "paramstore.cli"]


@pytest.fixture
def signed_store(tmp_path, tiny_hf):
    """(config path, locations, key bytes): the tiny model imported with a key; config names the key file."""
    key = tmp_path / "manifest.key"
    key.write_text("a-secret-signing-key\n")
    locs = [str(tmp_path / f"loc{i}") for i in range(3)]
    cfg = tmp_path / "pdserve.toml"
    cfg.write_text("[store]\nlocations = [%s]\nk = 2\nm = 1\nhmac_key_file = \"%s\"\n[node]\nmodel = \"tiny\"\n"
                   % (", ".join(f'"{u}"' for u in locs), key))  # fmt: skip
    r = subprocess.run(PARAMSTORE + ["-q", "--config", str(cfg), "import", tiny_hf[0], "--name", "tiny", "--dtype",
                                     "fp32"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return str(cfg), locs, b"a-secret-signing-key"


def tamper(locations: list[str]) -> int:
    """Edit the body of every copy of the manifest and fix its sha256 (not its HMAC); returns copies edited."""
    n = 0
    for path in [p for loc in locations for p in glob.glob(os.path.join(loc, "models", "tiny", "v*.json"))]:
        with open(path) as f:
            doc = json.load(f)
        doc["manifest"]["config"]["rms_norm_eps"] = 0.5  # a model that computes something else
        canon = json.dumps(doc["manifest"], sort_keys=True, separators=(",", ":")).encode()
        doc["integrity"]["sha256"] = hashlib.sha256(canon).hexdigest()
        with open(path, "w") as f:
            json.dump(doc, f)
        n += 1
    return n


def start_node(tmp_path, cfg: str) -> ServiceProc:
    """`pdserve node --role both` (the launcher's command) with the store and its key from the config file alone."""
    return Services([], "tiny", str(tmp_path), TOKEN).node("both", kv_blocks=64, extra=("--config", cfg))


def test_node_with_the_key_serves_a_signed_manifest_and_refuses_a_tampered_one(tmp_path, signed_store):
    import httpx

    cfg, locs, _ = signed_store
    node = start_node(tmp_path, cfg)
    try:
        node.wait_ready(timeout=120)  # untampered: ready
    finally:
        node.stop()

    assert tamper(locs) == len(locs)
    plain = subprocess.run(PARAMSTORE + sum((["--store", u] for u in locs), []) + ["show", "tiny", "--json"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert plain.returncode == 0, plain.stderr  # control: without the key the edit is not detectable
    assert json.loads(plain.stdout)["config"]["rms_norm_eps"] == 0.5

    node = start_node(tmp_path, cfg)
    try:
        deadline = time.monotonic() + 120
        while node.p.poll() is None and time.monotonic() < deadline:
            try:
                assert httpx.get(node.url + "/ready", auth=node.auth, timeout=1).status_code != 200
            except httpx.HTTPError:
                pass  # not listening: what a refusing node must be
            time.sleep(0.1)
        assert node.p.returncode == 2, node.log()
        lines = [ln for ln in node.log().splitlines() if ln.strip()]
        assert "Traceback" not in node.log() and len(lines) == 1, node.log()
        assert lines[0].startswith("pdserve node: error:") and "HMAC signature" in lines[0], lines[0]
    finally:
        node.stop()


def test_injector_with_the_key_refuses_a_tampered_manifest(signed_store):
    from compute.modeling.loader import WeightInjector
    from paramstore import IntegrityError, ParamStore, StoreConfig

    cfg, locs, key = signed_store
    with ParamStore(StoreConfig(locs, k=2, m=1, hmac_key=key)) as store:
        assert WeightInjector(store, "tiny", "fp32").start().wait(60)  # signed and intact: loads
    tamper(locs)
    with ParamStore(StoreConfig(locs, k=2, m=1, hmac_key=key)) as store:
        with pytest.raises(IntegrityError, match="HMAC signature"):
            WeightInjector(store, "tiny", "fp32")
