"""The node's prefix-cache setting as a user sets it: on by default, ``--no-prefix-cache``, ``[node] prefix_cache``
(resolved by ``pdserve node --print-config``, flag > file > default); and the node's engine built with it."""

from __future__ import annotations

from tests.cli import PDSERVE, resolved

TOKEN = {"PDSERVE_INTERNAL_TOKEN": "t"}


def test_prefix_cache_is_on_by_default_off_by_flag_or_file(tmp_path):
    node = PDSERVE + ["node", "--role", "both", "--model", "m"]
    assert resolved(node, TOKEN)["prefix_cache"] is True
    assert resolved(node + ["--no-prefix-cache"], TOKEN)["prefix_cache"] is False
    path = tmp_path / "pdserve.toml"
    path.write_text("[node]\nprefix_cache = false\n")
    assert resolved(node + ["--config", str(path)], TOKEN)["prefix_cache"] is False


def test_node_config_refuses_a_non_boolean(tmp_path):
    from tests.cli import run

    path = tmp_path / "pdserve.toml"
    path.write_text('[node]\nprefix_cache = "no"\n')
    r = run(PDSERVE + ["node", "--role", "both", "--config", str(path), "--print-config"], TOKEN)
    assert r.returncode == 2 and "prefix_cache" in r.stderr
