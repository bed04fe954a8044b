"""The publisher key (paramstore/publisher.py): with ``publisher_pubkey`` set, a step package or a kernel plan
is loaded from the store only when signed by the publisher's Ed25519 key, which serving nodes do not hold. A
forged package sealed with the store's HMAC key (every node has it) is refused; a process without the private
key publishes nothing; `paramstore keygen` makes the pair (run as a user runs it); a node drops a publisher key
it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paramstore import IntegrityError, InvalidRequest, ParamStore, StoreConfig
from paramstore.manifest import manifest_path
from paramstore.publisher import generate, read_private
from tests.services import TOKEN

GID = "0123456789abcdef"
PACKAGE = b"PK\x03\x04" + os.urandom(2048)
HMAC = b"the-store-hmac-key-every-node-holds"
MACHINE = "0123456789abcdef AMD EPYC|avx2|torch 2.13.0+cpu threads=2"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paramstore.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})  # fmt: skip


@pytest.fixture
def keys(tmp_path):
    r = _run("keygen", str(tmp_path / "publisher.pem"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert os.stat(tmp_path / "publisher.pem").st_mode & 0o777 == 0o600
    return out["publisher_pubkey"], read_private(str(tmp_path / "publisher.pem"))


def _store(tmp_path, pub: str | None = None, pem: bytes | None = None) -> ParamStore:
    locs = [str(tmp_path / f"loc{i}") for i in range(3)]
    return ParamStore(StoreConfig(locs, k=2, m=1, hmac_key=HMAC, publisher_pubkey=pub, publisher_key=pem))


def test_keygen_never_overwrites_a_key(tmp_path, keys):
    r = _run("keygen", str(tmp_path / "publisher.pem"))
    assert r.returncode == 2 and "never overwritten" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_package_signed_by_the_publisher_loads_and_a_forged_one_does_not(tmp_path, keys):
    pub, pem = keys
    with _store(tmp_path, pub, pem) as publisher:  # the importer, an admin, a build job
        publisher.graphs.publish(GID, {"by": "the build job"}, PACKAGE)
        publisher.plans.publish(MACHINE, {"shapes": {"576x576": "native"}})
    with _store(tmp_path, pub) as node:  # a serving node: the public key only
        assert node.graphs.get(GID)[1] == PACKAGE
        assert node.plans.get(MACHINE)["table"]["shapes"] == {"576x576": "native"}
        assert not node.graphs.can_publish and not node.plans.can_publish
        with pytest.raises(InvalidRequest, match="publisher key"):
            node.graphs.publish(GID, {"by": "a node"}, b"native code from a node")  # it cannot publish
    with _store(tmp_path) as compromised:  # holds the HMAC key, not the publisher's: it seals a forged package
        compromised.graphs.publish(GID, {"by": "an attacker"}, b"PK\x03\x04 planted native code")
        compromised.plans.publish(MACHINE, {"shapes": {"576x576": "dequant"}})
        assert compromised.graphs.get(GID)[1].endswith(b"planted native code")  # a store without a pubkey: as before
    with _store(tmp_path, pub) as node:
        with pytest.raises(IntegrityError, match="not signed by the publisher key"):
            node.graphs.get(GID)
        with pytest.raises(IntegrityError, match="not signed by the publisher key"):
            node.plans.get(MACHINE)
        assert [r["valid"] for r in node.graphs.list()] == [False]


def test_a_package_signed_by_another_key_is_refused(tmp_path, keys):
    pub, _ = keys
    other = tmp_path / "other.pem"
    generate(str(other))
    with _store(tmp_path, None, read_private(str(other))) as stranger:
        stranger.graphs.publish(GID, {"by": "another publisher"}, PACKAGE)
    with _store(tmp_path, pub) as node, pytest.raises(IntegrityError, match="not signed by the publisher key"):
        node.graphs.get(GID)
    with pytest.raises(InvalidRequest, match="does not match"):  # a key file that is not the configured key's
        _store(tmp_path, pub, read_private(str(other)))


def test_a_node_drops_a_publisher_key_it_is_given(tmp_path, keys):
    pub, _ = keys
    env = {"PDSERVE_INTERNAL_TOKEN": TOKEN, "PDSERVE_PUBLISHER_PUBKEY": pub,
           "PDSERVE_PUBLISHER_KEY_FILE": str(tmp_path / "publisher.pem")}  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "autoscaler.cli", "node", "--role", "both", "--store",
                        str(tmp_path / "loc0"), "--print-config"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})  # fmt: skip
    assert r.returncode == 0, r.stderr
    store = json.loads(r.stdout)["store"]
    assert store["publisher_pubkey"] == pub and store["publisher_key"] is False


def test_weights_load_only_from_a_manifest_the_publisher_signed(tmp_path, keys, tiny_hf):
    """The importer signs the manifest; a copy forged by a holder of the HMAC key (a new version pointing at its
    own weights) is refused where the public key is set; repair copies a signed manifest as it is."""
    pub, pem = keys
    with _store(tmp_path, pub, pem) as importer:
        importer.import_model(tiny_hf[0], "tiny", dtype="int8")
    with _store(tmp_path) as compromised:
        compromised.import_model(tiny_hf[0], "tiny", dtype="int8")  # v2, sealed with the HMAC key only
    with _store(tmp_path, pub) as node:
        assert node.manifest("tiny@v1").name == "tiny"
        with pytest.raises(IntegrityError, match="not signed by the publisher key"):
            node.manifest("tiny@v2")
        lost = tmp_path / "loc1" / manifest_path("tiny", 1)
        lost.unlink()
        node.repair("tiny@v1")  # no private key here: the signed bytes are copied, not re-sealed
        assert lost.read_bytes() == (tmp_path / "loc0" / manifest_path("tiny", 1)).read_bytes()


@pytest.mark.slow
@pytest.mark.long  # compiles the step packages: make test-long
@pytest.mark.timeout(900)
def test_the_build_job_publishes_signed_plans_and_packages_a_node_then_takes(tmp_path, keys, tiny_hf):
    """`pdserve prebuild` (compute/node/prebuild.py), run as a user runs it: without the publisher key it refuses in
    one line before loading anything; with it, it measures the kernel plan and builds every step package for
    this machine class and publishes them signed; a node holding only the public key, on an empty machine cache,
    then takes both from the store and builds nothing."""
    import httpx

    from compute.node.launcher import Services
    from tests.services import wait_for

    pub, pem = keys
    locs = [str(tmp_path / f"loc{i}") for i in range(3)]
    with ParamStore(StoreConfig(locs, k=2, m=1, publisher_pubkey=pub, publisher_key=pem)) as importer:
        importer.import_model(tiny_hf[0], "tiny", dtype="int8")
    store = [a for loc in locs for a in ("--store", loc)]
    env = {**os.environ, "PDSERVE_PUBLISHER_PUBKEY": pub, "HOME": str(tmp_path / "job-home")}
    cmd = [sys.executable, "-m", "autoscaler.cli", "prebuild", "--model", "tiny", "--max-num-seqs", "4", "--threads", "1",
           *store]  # the nodes' threads (part of the machine class), as the node below runs
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "publisher_key_file" in r.stderr
    env["PDSERVE_PUBLISHER_KEY_FILE"] = str(tmp_path / "publisher.pem")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=800, env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kernel plan measured" in r.stderr and "built" in r.stderr and "signed" in r.stderr, r.stderr[-1000:]
    with ParamStore(StoreConfig(locs, k=2, m=1, publisher_pubkey=pub)) as reader:  # checks every signature
        graphs, plans = reader.graphs.list(), reader.plans.list()
    assert graphs and plans and all(r["valid"] and r["signed"] for r in graphs + plans), (graphs, plans)

    (tmp_path / "node").mkdir()
    services = Services(locs, "tiny", str(tmp_path / "node"), TOKEN, env={"PDSERVE_PUBLISHER_PUBKEY": pub,
                                                                          "HOME": str(tmp_path / "node-home")})
    try:
        node = services.node("both", extra=("--step", "graph", "--max-num-seqs", "4")).wait_ready()
        auth = node.auth

        def model() -> dict:
            return httpx.get(node.url + "/load", auth=auth, timeout=5).json()["models"]["tiny"]

        wait_for(lambda: (model().get("graphs") or {}).get("idle"), 120, "the node's step packages taken")
        m = model()
        assert m["kernels"]["source"] == "store", m["kernels"]
        assert set(m["graphs"]["sources"].values()) == {"store"}, m["graphs"]  # built nothing
    finally:
        services.stop_all()
