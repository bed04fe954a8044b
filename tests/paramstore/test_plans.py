"""Kernel plans in the store: published on every location, read from the first valid copy, signed where the
store signs, refused when corrupt, unsigned, tampered or naming another machine; `paramstore plans` lists,
shows and removes them (run as a user runs it: a subprocess, exit codes, one-line errors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paramstore import IntegrityError, NotFound, ParamStore, StoreConfig
from paramstore.plans import plan_path

KEY = "0123456789abcdef AMD EPYC|avx2 avx512f|dispatch AVX512|torch 2.13.0+cpu|1 threads"
TABLE = {"version": 7, "key": KEY, "shapes": {"64x64": {"choice": ["int8mm"] * 4, "invariant": "int8mm"}}}


def _store(tmp_path, key: bytes | None = None) -> ParamStore:
    return ParamStore(StoreConfig([str(tmp_path / f"loc{i}") for i in range(3)], k=2, m=1, hmac_key=key))


def test_publish_get_list_delete(tmp_path):
    with _store(tmp_path) as store:
        with pytest.raises(NotFound):
            store.plans.get(KEY)
        body = store.plans.publish(KEY, TABLE)
        assert body["revision"] == 1 and store.plans.get(KEY)["table"] == TABLE
        assert all(os.path.exists(tmp_path / f"loc{i}" / plan_path("0123456789abcdef")) for i in range(3))
        assert store.plans.publish(KEY, TABLE)["revision"] == 2  # versioned: each publish a new revision
        (row,) = store.plans.list()
        assert row["valid"] and row["key"] == KEY and row["shapes"] == 1 and row["revision"] == 2
        assert store.plans.get("0123456789abcdef")["key"] == KEY  # by id too
        store.gc(grace_s=0)  # plans are not garbage of the shard collector
        assert store.plans.get(KEY)["revision"] == 2
        assert store.plans.delete(KEY) == "0123456789abcdef" and store.plans.list() == []
        with pytest.raises(NotFound):
            store.plans.delete(KEY)


def test_a_damaged_copy_is_skipped_and_no_valid_copy_is_refused(tmp_path):
    with _store(tmp_path) as store:
        store.plans.publish(KEY, TABLE)
        first = tmp_path / "loc0" / plan_path("0123456789abcdef")
        doc = json.loads(first.read_text())
        doc["plan"]["table"]["shapes"]["64x64"]["choice"] = ["bf16"] * 4  # edited, hash not updated
        first.write_text(json.dumps(doc))
        assert store.plans.get(KEY)["table"] == TABLE  # the next location's copy
        for i in (1, 2):
            (tmp_path / f"loc{i}" / plan_path("0123456789abcdef")).write_text("{not json")
        with pytest.raises(IntegrityError, match="no valid copy"):
            store.plans.get(KEY)
        assert store.plans.list()[0]["valid"] is False


def test_a_plan_for_another_machine_under_this_id_is_refused(tmp_path):
    with _store(tmp_path) as store:
        other = KEY.replace("torch 2.13.0", "torch 2.99.0")  # same id, another machine key: never trusted
        store.plans.publish(other, {**TABLE, "key": other})
        with pytest.raises(IntegrityError, match="not this machine"):
            store.plans.get(KEY)


def test_a_signing_store_signs_and_refuses_unsigned_or_tampered(tmp_path):
    with _store(tmp_path) as unsigned:
        unsigned.plans.publish(KEY, TABLE)  # written by a store without the key
    with _store(tmp_path, key=b"k" * 32) as signed:
        with pytest.raises(IntegrityError, match="HMAC"):
            signed.plans.get(KEY)
        signed.plans.publish(KEY, TABLE)
        assert signed.plans.get(KEY)["table"] == TABLE
    with _store(tmp_path, key=b"x" * 32) as wrong_key:
        with pytest.raises(IntegrityError, match="HMAC"):
            wrong_key.plans.get(KEY)


def _cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    stores = sum((["--store", str(tmp_path / f"loc{i}")] for i in range(3)), [])
    return subprocess.run([sys.executable, "-m", "paramstore.cli", "-q", *stores, "plans", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_paramstore_plans_lists_shows_and_removes(tmp_path):
    r = _cli(tmp_path)
    assert r.returncode == 0 and "no kernel plans" in r.stdout
    with _store(tmp_path) as store:
        store.plans.publish(KEY, TABLE)
    r = _cli(tmp_path, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)[0]["id"] == "0123456789abcdef"
    r = _cli(tmp_path)
    assert r.returncode == 0 and "AMD EPYC" in r.stdout and "0123456789abcdef" in r.stdout
    r = _cli(tmp_path, "show", "0123456789abcdef")
    assert r.returncode == 0 and json.loads(r.stdout)["table"] == TABLE
    r = _cli(tmp_path, "rm", "0123456789abcdef")
    assert r.returncode == 0 and "removed kernel plan 0123456789abcdef" in r.stdout
    for bad in (("rm", "0123456789abcdef"), ("show", "nothex"), ("rm",)):
        r = _cli(tmp_path, *bad)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (bad, r.stderr)
