"""A node cut off from part of the parameter store while it starts: the store's S3 locations on another host (a real
moto server there, tests/net/lab.py), the rest local (k = 2 of n = 4: the local two suffice). With the S3 host
black-holed (connects hang, nothing is refused) the node must load from the fragments it can reach and serve in
seconds: S3 calls give up after the timeouts paramstore/locations.py chooses (not botocore's 60 s per connect), and
a location that failed lately or did not answer a listing within its grace is asked last, and not at all for a
replicated object another location has answered for (paramstore/catalog.py, reader.py). Before: the node never
became ready (the catalog waited for every location's listing); then 73 s, 36 s, 21 s as each wait was found.
Healed, a second node loads with every location and computes the same tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from compute.node.launcher import Services
from tests.net.lab import NetLab
from tests.services import TOKEN, node_generate, wait_for

pytestmark = [pytest.mark.long, pytest.mark.skipif(NetLab.why_not() is not None, reason=str(NetLab.why_not()))]


@pytest.fixture(scope="module")
def s3_lab(tmp_path_factory, tiny_hf):
    pytest.importorskip("moto")
    from paramstore import ParamStore, StoreConfig

    lab = NetLab()
    s3, a, b = lab.host(), lab.host(), lab.host()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    moto = subprocess.Popen(s3.argv + [exe, "-H", s3.address, "-p", "5000"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    services = None
    try:
        endpoint = f"http://{s3.address}:5000"
        opts = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
        import s3fs

        fs = s3fs.S3FileSystem(**opts)
        deadline = time.monotonic() + 30
        while True:
            try:
                fs.mkdir("models")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                assert time.monotonic() < deadline, "moto_server did not start in 30 s"
                time.sleep(0.2)
        local = tmp_path_factory.mktemp("net-store-local")
        locations = ["s3://models/loc0", "s3://models/loc1", str(local / "loc2"), str(local / "loc3")]
        cfg = StoreConfig(locations=locations, k=2, m=2, shard_bytes=64 * 1024, storage_options={"s3": opts})
        with ParamStore(cfg) as ps:
            ps.import_model(tiny_hf[0], "tiny", dtype="int8")
        conf = tmp_path_factory.mktemp("net-store-conf") / "pdserve.toml"
        conf.write_text(f'[store.storage_options.s3]\nkey = "testing"\nsecret = "testing"\nendpoint_url = "{endpoint}"\n')
        services = Services(locations, "tiny", str(tmp_path_factory.mktemp("net-store-logs")), TOKEN,
                            env={"PDSERVE_CONFIG": str(conf)})  # fmt: skip
        yield {"lab": lab, "hosts": (s3, a, b), "services": services}
    finally:
        if services is not None:
            services.stop_all()
        moto.terminate()
        moto.wait(10)
        lab.close()


def test_a_node_loads_from_the_fragments_it_can_reach(s3_lab):
    lab, (s3, a, b), services = s3_lab["lab"], s3_lab["hosts"], s3_lab["services"]
    lab.black_hole(a, s3)
    t0 = time.monotonic()
    node = services.node("both", kv_blocks=64, extra=("--step", "eager"), on=a).wait_ready(timeout=120)
    took = time.monotonic() - t0
    print(f"node ready with the S3 host black-holed: {took:.1f} s")
    assert len(node_generate(node, "r1", [5, 6, 7], 4)) == 4
    lab.heal()
    t0 = time.monotonic()
    other = services.node("both", kv_blocks=64, extra=("--step", "eager"), on=b).wait_ready(timeout=120)
    print(f"node ready with every location: {time.monotonic() - t0:.1f} s")
    assert node_generate(other, "r2", [5, 6, 7], 4) == node_generate(node, "r3", [5, 6, 7], 4)  # the same weights
    assert took < 20, f"the partitioned node took {took:.1f} s to load: it waited for the unreachable location"


def _progress(node) -> dict:
    try:
        return node.load().get("progress") or {}
    except Exception:  # noqa: BLE001 - not listening yet
        return {}


def test_a_node_cut_off_mid_injection_finishes_from_the_fragments_it_can_reach(s3_lab):
    """The S3 host's answers slowed (``tc tbf``) so that the injection lasts seconds; once some shards are in, the S3
    host is black-holed: reads in flight there hang, and the node must finish from the local fragments in seconds
    (paramstore/reader.py: a read stalled past the hedge gives its slot back and is not waited for), then answer as a
    node that loaded everything."""
    lab, (s3, _, b), services = s3_lab["lab"], s3_lab["hosts"], s3_lab["services"]
    c = lab.host()
    lab.throttle(s3, 1, burst_kb=16)  # a fragment (~17 KB) in ~0.15 s: the 6 shards in seconds
    try:
        node = services.node("both", kv_blocks=64, extra=("--step", "eager"), on=c)
        seen = wait_for(lambda: (p := _progress(node)) and 0 < p["shards_loaded"] < p["shards_total"] and p, 60,
                        "some shards injected, not all", every=0.05)  # fmt: skip
        lab.black_hole(c, s3)
        t0 = time.monotonic()
        node.wait_ready(timeout=120)
        took = time.monotonic() - t0
    finally:
        lab.heal()
        lab.unthrottle(s3)
    print(f"cut after {seen['shards_loaded']}/{seen['shards_total']} shards: ready {took:.1f} s later")
    other = services.node("both", kv_blocks=64, extra=("--step", "eager"), on=b).wait_ready(timeout=120)
    assert node_generate(node, "r4", [5, 6, 7], 4) == node_generate(other, "r5", [5, 6, 7], 4)
    # the reads in flight to S3 are raced by the local fragments after the hedge (2 s) and not waited for: before,
    # the stalled reads held every io thread and the reader's close until their timeouts (47 s, then 27 s)
    assert took < 10, f"{took:.1f} s from the cut to ready"
