"""benchmarks/service.py: the config it writes is one `pdserve up` reads (keys this tree does not know are
left out and named), and its /load readers see a model on a per-model node and on a one-model node."""

from __future__ import annotations

from autoscaler.main import policy_config
from benchmarks.service import (
    count_ready,
    count_standby,
    node_active,
    node_model_state,
    write_config,
)
from paramstore.config import read_config


def test_written_config_is_read_back(tmp_path):
    path = str(tmp_path / "pdserve.toml")
    skipped = write_config(path, {"autoscaler": {"tick_s": 0.5, "pool_size": 1, "no_such_knob": 3},
                                  "gateway": {"queue_timeout_s": 120.0, "models": ["a", "b"]},
                                  "node": {"threads": 1, "cache_dir": '/tmp/x "y"', "kv_blocks": None}})  # fmt: skip
    assert skipped == ["autoscaler.no_such_knob"]
    tables = read_config(path)
    assert tables["gateway"] == {"queue_timeout_s": 120.0, "models": ["a", "b"]}
    assert tables["node"] == {"threads": 1, "cache_dir": '/tmp/x "y"'}  # None: left unset
    cfg = policy_config(tables, path)  # the check `pdserve up` runs on [autoscaler]
    assert (cfg.tick_s, cfg.pool_size) == (0.5, 1)


def test_load_readers_both_shapes():
    per_model = {"role": "decode", "state": "ready", "models": {
        "a": {"state": "ready", "active_requests": 2}, "b": {"state": "loading", "active_requests": 0}}}
    one_model = {"role": "prefill", "model": "a", "ready": True, "running": 1, "queued": 2}
    standby = {"role": "prefill", "state": "standby", "models": {}}
    assert [node_model_state(x, "a") for x in (per_model, one_model, standby)] == ["ready", "ready", None]
    assert node_model_state(per_model, "b") == "loading" and node_model_state(one_model, "b") is None
    assert (node_active(per_model, "a"), node_active(one_model, "a"), node_active(standby, "a")) == (2, 3, 0)
    status = {"nodes": [{"role": "decode", "state": "ready", "load": per_model},
                        {"role": "prefill", "state": "ready", "load": one_model},
                        {"role": "prefill", "state": "ready", "load": standby},
                        {"role": "decode", "state": "unhealthy", "load": per_model}]}  # fmt: skip
    assert count_ready(status, "a") == {"decode": 1, "prefill": 1}
    assert count_standby(status) == {"prefill": 1}
