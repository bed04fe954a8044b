"""Compiled decode-step packages in the store: the package and its sealed index on every location, read from
the first location whose index is valid and whose package matches it (a corrupt, truncated or replaced
package is never handed out: a node dlopens it), signed where the store signs; `paramstore graphs` lists,
shows and removes them (run as a user runs it: a subprocess, exit codes, one-line errors)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid

import pytest

from paramstore import (
    IntegrityError,
    InvalidRequest,
    LocationUnavailable,
    NotFound,
    ParamStore,
    StoreConfig,
)
from paramstore import graphs as graphs_mod
from paramstore.graphs import index_path, package_path
from paramstore.integrity import seal

GID = "0123456789abcdef"
META = {"machine": "AMD EPYC|avx2 avx512f|torch 2.13.0+cpu", "model": "sha256:ab12", "spec": {"streams": 8}}
PACKAGE = b"PK\x03\x04" + os.urandom(4096) + b"not really a zip"  # opaque bytes to the store


def _store(tmp_path, key: bytes | None = None, locations: list[str] | None = None) -> ParamStore:
    locs = locations or [str(tmp_path / f"loc{i}") for i in range(3)]
    return ParamStore(StoreConfig(locs, k=2, m=1, hmac_key=key))


def _files(tmp_path, i: int, gid: str = GID):
    return tmp_path / f"loc{i}" / package_path(gid), tmp_path / f"loc{i}" / index_path(gid)


def test_publish_get_list_gc_delete(tmp_path):
    with _store(tmp_path) as store:
        with pytest.raises(NotFound, match=f"no step graph {GID}"):
            store.graphs.get(GID)
        body = store.graphs.publish(GID, META, PACKAGE)
        assert body["revision"] == 1 and body["size"] == len(PACKAGE) and body["meta"] == META
        assert body["sha256"] == hashlib.sha256(PACKAGE).hexdigest() and body["format"] == "pdserve-step-graph/1"
        got, data = store.graphs.get(GID)
        assert data == PACKAGE and got == body
        for i in range(3):
            pkg, idx = _files(tmp_path, i)
            assert pkg.read_bytes() == PACKAGE and json.loads(idx.read_text())["graph"] == body
        assert store.graphs.publish(GID, {**META, "spec": {"streams": 1}}, PACKAGE[::-1])["revision"] == 2
        body2, data2 = store.graphs.get(GID)
        assert data2 == PACKAGE[::-1] and body2["meta"]["spec"] == {"streams": 1}
        (row,) = store.graphs.list()
        assert row["valid"] and row["id"] == GID and row["revision"] == 2 and row["size"] == len(PACKAGE)
        assert row["meta"] == body2["meta"] and row["signed"] is False and row["by"]
        store.gc(grace_s=0)  # step graphs are not garbage of the shard collector
        assert store.graphs.get(GID)[1] == PACKAGE[::-1]
        assert store.graphs.delete(GID) == GID and store.graphs.list() == []
        assert not any(p.exists() for i in range(3) for p in _files(tmp_path, i))
        with pytest.raises(NotFound):
            store.graphs.delete(GID)


def test_a_damaged_package_is_skipped_and_no_valid_copy_is_refused(tmp_path):
    with _store(tmp_path) as store:
        store.graphs.publish(GID, META, PACKAGE)
        pkg0, _ = _files(tmp_path, 0)
        flipped = bytearray(PACKAGE)
        flipped[100] ^= 0xFF  # same size, one byte changed: only the sha256 sees it
        pkg0.write_bytes(bytes(flipped))
        assert store.graphs.get(GID)[1] == PACKAGE  # the next location's copy
        pkg1, _ = _files(tmp_path, 1)
        pkg1.write_bytes(PACKAGE[:-1])  # truncated
        assert store.graphs.get(GID)[1] == PACKAGE  # the third
        os.unlink(_files(tmp_path, 2)[0])  # index without its package
        with pytest.raises(IntegrityError, match="no valid copy of step graph") as e:
            store.graphs.get(GID)
        msg = str(e.value)
        assert "sha256" in msg and "truncated" in msg and "index without its package" in msg, msg
        (row,) = store.graphs.list()
        assert row["valid"] is False and "no valid copy" in row["error"]


def test_a_truncated_package_is_refused_before_it_is_read(tmp_path):
    with _store(tmp_path) as store:
        store.graphs.publish(GID, META, PACKAGE)
        for i in range(3):
            pkg, _ = _files(tmp_path, i)
            pkg.write_bytes(PACKAGE[: len(PACKAGE) // 2])
        half = len(PACKAGE) // 2
        with pytest.raises(IntegrityError, match=f"package is {half} bytes, its index says {len(PACKAGE)}"):
            store.graphs.get(GID)


def test_a_corrupt_index_is_skipped(tmp_path):
    with _store(tmp_path) as store:
        store.graphs.publish(GID, META, PACKAGE)
        _files(tmp_path, 0)[1].write_text("{not json")
        assert store.graphs.get(GID)[1] == PACKAGE
        assert store.graphs.publish(GID, META, PACKAGE)["revision"] == 2  # counts from the valid copy


def _replace_package(tmp_path, evil: bytes) -> None:
    """What an attacker with write access but without the key can do: swap the package on every location and
    update its index's size, sha256 and the seal's sha256 (not the HMAC: it lacks the key)."""
    for i in range(3):
        pkg, idx = _files(tmp_path, i)
        doc = json.loads(idx.read_text())
        doc["graph"].update(size=len(evil), sha256=hashlib.sha256(evil).hexdigest())
        doc["integrity"]["sha256"] = seal(doc["graph"], None)["sha256"]
        pkg.write_bytes(evil)
        idx.write_text(json.dumps(doc))


def test_a_signing_store_refuses_a_replaced_package_and_an_unsigned_index(tmp_path):
    with _store(tmp_path) as unsigned:
        unsigned.graphs.publish(GID, META, PACKAGE)  # written by a store without the key
    with _store(tmp_path, key=b"k" * 32) as signed:
        with pytest.raises(IntegrityError, match="HMAC"):
            signed.graphs.get(GID)
        signed.graphs.publish(GID, META, PACKAGE)
        assert signed.graphs.get(GID)[1] == PACKAGE and signed.graphs.list()[0]["signed"] is True
        _replace_package(tmp_path, b"\x7fELF evil code")
        with pytest.raises(IntegrityError, match="HMAC"):
            signed.graphs.get(GID)
    with _store(tmp_path, key=b"x" * 32) as wrong_key:
        with pytest.raises(IntegrityError, match="HMAC"):
            wrong_key.graphs.get(GID)
    with _store(tmp_path) as unsigned:  # what an unsigned store cannot tell: run signed where writers are untrusted
        assert unsigned.graphs.get(GID)[1] == b"\x7fELF evil code"


def test_an_index_naming_another_id_is_refused(tmp_path):
    other = "fedcba9876543210"
    with _store(tmp_path) as store:
        store.graphs.publish(other, META, PACKAGE)
        for i in range(3):
            for src, dst in zip(_files(tmp_path, i, other), _files(tmp_path, i)):
                os.rename(src, dst)
        with pytest.raises(IntegrityError, match=f"names '{other}'"):
            store.graphs.get(GID)


@pytest.mark.parametrize("gid", ["0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", "../../etc/passw",
                                 "0123456789abcdeg", "", None])  # fmt: skip
def test_a_bad_id_is_an_invalid_request(tmp_path, gid):
    with _store(tmp_path) as store:
        for call in (lambda: store.graphs.get(gid), lambda: store.graphs.delete(gid),
                     lambda: store.graphs.publish(gid, META, PACKAGE)):  # fmt: skip
            with pytest.raises(InvalidRequest, match="not a step graph id"):
                call()
    assert not (tmp_path / "loc0").exists()  # nothing written


def test_bad_packages_and_meta_are_refused_and_the_cap_holds(tmp_path, monkeypatch):
    with _store(tmp_path) as store:
        with pytest.raises(InvalidRequest, match="empty package"):
            store.graphs.publish(GID, META, b"")
        with pytest.raises(InvalidRequest, match="meta must be a JSON object"):
            store.graphs.publish(GID, ["not", "a", "dict"], PACKAGE)
        with pytest.raises(InvalidRequest, match="meta is not JSON"):
            store.graphs.publish(GID, {"f": object()}, PACKAGE)
        assert not (tmp_path / "loc0" / "graphs").exists()
        monkeypatch.setattr(graphs_mod, "MAX_PACKAGE_BYTES", 2048)
        with pytest.raises(InvalidRequest, match="over the 0 MiB cap"):
            store.graphs.publish(GID, META, PACKAGE)
        store.graphs.publish(GID, META, PACKAGE[:2000])
        monkeypatch.setattr(graphs_mod, "MAX_PACKAGE_BYTES", 1024)  # a reader with a lower cap: not read at all
        with pytest.raises(IntegrityError, match="index gives size 2000"):
            store.graphs.get(GID)


def test_a_location_that_refuses_writes_is_skipped_and_none_is_unavailable(tmp_path):
    (tmp_path / "afile").write_bytes(b"")
    dead = str(tmp_path / "afile" / "loc")  # below a regular file: every write fails
    with _store(tmp_path, locations=[dead, str(tmp_path / "loc1"), str(tmp_path / "loc2")]) as store:
        assert store.graphs.publish(GID, META, PACKAGE)["revision"] == 1
        assert store.graphs.get(GID)[1] == PACKAGE
    with _store(tmp_path, locations=[dead]) as store:
        with pytest.raises(LocationUnavailable, match="no location took it"):
            store.graphs.publish(GID, META, PACKAGE)


def test_a_package_without_an_index_is_listed_and_removable(tmp_path):
    with _store(tmp_path) as store:
        store.graphs.publish(GID, META, PACKAGE)
        for i in range(3):
            os.unlink(_files(tmp_path, i)[1])  # a publish cut short between the package and its index
        with pytest.raises(NotFound):
            store.graphs.get(GID)
        (row,) = store.graphs.list()
        assert row["valid"] is False and "without an index" in row["error"]
        assert store.graphs.delete(GID) == GID and store.graphs.list() == []


def test_an_fsspec_location_round_trips(tmp_path):
    roots = [f"memory://graphs-{uuid.uuid4().hex}/loc{i}" for i in range(3)]
    with _store(tmp_path, key=b"k" * 32, locations=roots) as store:
        store.graphs.publish(GID, META, PACKAGE)
        store.locations[0].put(package_path(GID), PACKAGE[:-3])  # truncated on the first
        assert store.graphs.get(GID)[1] == PACKAGE
        assert [r["valid"] for r in store.graphs.list()] == [True]
        store.graphs.delete(GID)
        assert all(loc.list("graphs") == [] for loc in store.locations)


def _cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    stores = sum((["--store", str(tmp_path / f"loc{i}")] for i in range(3)), [])
    return subprocess.run([sys.executable, "-m", "paramstore.cli", "-q", *stores, "graphs", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_paramstore_graphs_lists_shows_and_removes(tmp_path):
    r = _cli(tmp_path)
    assert r.returncode == 0 and "no step graphs" in r.stdout
    with _store(tmp_path) as store:
        store.graphs.publish(GID, META, PACKAGE)
    r = _cli(tmp_path, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)[0]["id"] == GID and json.loads(r.stdout)[0]["valid"]
    r = _cli(tmp_path)
    assert r.returncode == 0 and GID in r.stdout and "4.0 KiB" in r.stdout and "AMD EPYC" in r.stdout
    r = _cli(tmp_path, "show", GID)
    assert r.returncode == 0 and json.loads(r.stdout)["meta"] == META and "not really" not in r.stdout
    _files(tmp_path, 0)[0].write_bytes(b"junk")
    _files(tmp_path, 1)[0].write_bytes(b"junk")
    _files(tmp_path, 2)[0].write_bytes(b"junk")
    r = _cli(tmp_path)
    assert r.returncode == 0 and "INVALID" in r.stdout
    r = _cli(tmp_path, "show", GID)
    assert r.returncode == 2 and "no valid copy" in r.stderr and "Traceback" not in r.stderr
    r = _cli(tmp_path, "rm", GID)
    assert r.returncode == 0 and f"removed step graph {GID}" in r.stdout
    for bad in (("rm", GID), ("show", "nothex"), ("show", "0123456789ABCDEF"), ("rm",), ("ls", GID)):
        r = _cli(tmp_path, *bad)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (bad, r.stderr)
