"""One config file for every command, run as the user runs it: `pdserve …` / `paramstore …` subprocesses.

Precedence for each setting is flag > environment variable > config file > default, checked with
`--print-config` (what a command resolved); a bad file is one line on stderr and exit 2, never a
traceback, for every command that reads it.
"""

from __future__ import annotations

import json

import pytest

from tests.cli import PARAMSTORE, PDSERVE, resolved, run


@pytest.fixture
def config(tmp_path):
    """A config file with every table; returns its path."""
    path = tmp_path / "pdserve.toml"
    locs = ", ".join(f'"{tmp_path / f"loc{i}"}"' for i in range(3))
    path.write_text(f"""
[store]
locations = [{locs}]
k = 2
m = 1
[node]
model = "from-file"
kv_blocks = 77
cache_dir = "/file/cache"
[gateway]
model = "from-file"
port = 18901
url = "http://gateway.example:18901"
nodes = ["decode=http://127.0.0.1:1"]
[autoscaler]
decode_max_replicas = 3
tick_s = 2.0
[autoscaler.local]
ready_timeout_s = 33.0
""")
    return str(path)


def test_node_precedence_flag_over_env_over_file_over_default(config):
    node = PDSERVE + ["node", "--role", "decode"]
    token = {"PDSERVE_INTERNAL_TOKEN": "t"}
    bare = resolved(node + ["--model", "m"], token)
    assert bare["kv_blocks"] == 2048 and bare["cache_dir"] is None and bare["store"]["k"] == 8  # defaults
    f = resolved(node + ["--config", config], token)
    assert (f["model"], f["kv_blocks"], f["cache_dir"]) == ("from-file", 77, "/file/cache")
    assert f["store"]["k"] == 2 and len(f["store"]["locations"]) == 3 and f["internal_token_set"]
    e = resolved(node, {**token, "PDSERVE_CONFIG": config, "PDSERVE_CACHE_DIR": "/env/cache"})
    assert e["cache_dir"] == "/env/cache" and e["kv_blocks"] == 77  # env over file, file still read
    fl = resolved(node + ["--cache-dir", "/flag", "--kv-blocks", "5", "--model", "m"],
                  {**token, "PDSERVE_CONFIG": config, "PDSERVE_CACHE_DIR": "/env/cache"})  # fmt: skip
    assert (fl["cache_dir"], fl["kv_blocks"], fl["model"]) == ("/flag", 5, "m")
    alias = resolved(node, {**token, "PARAMSTORE_CONFIG": config})  # the older variable still names the file
    assert alias["model"] == "from-file"
    pool_runtime = resolved(node + ["--config", config, "--standby"], token)  # the file's other settings still hold
    assert pool_runtime["model"] is None and pool_runtime["kv_blocks"] == 77


def test_gateway_and_autoscale_read_their_tables(config, tmp_path):
    g = resolved(PDSERVE + ["gateway", "--config", config])
    assert (g["port"], g["model"], g["nodes"]) == (18901, "from-file", [["decode", "http://127.0.0.1:1"]])
    keys = tmp_path / "keys"
    keys.write_text("k1,k2\n")
    g = resolved(PDSERVE + ["gateway", "--config", config, "--port", "18902"],
                 {"PDSERVE_API_KEYS_FILE": str(keys), "PDSERVE_ADMIN_KEY": "adm", "PDSERVE_INTERNAL_TOKEN": "t"})
    assert g["port"] == 18902 and g["api_keys"] == 2 and g["admin_key_set"] and g["internal_token_set"]
    a = resolved(PDSERVE + ["autoscale"], {"PDSERVE_CONFIG": config, "PDSERVE_INTERNAL_TOKEN": "t"})
    assert a["gateways"] == ["http://gateway.example:18901"] and a["actuator"] == "local"
    assert a["autoscaler"]["decode_max_replicas"] == 3 and a["autoscaler"]["tick_s"] == 2.0
    assert a["local"]["model"] is None and a["local"]["kv_blocks"] == 77  # [node] fills LocalConfig; runtimes standby
    assert a["local"]["ready_timeout_s"] == 33.0 and a["local"]["extra_args"] == ["--config", config]
    a = resolved(PDSERVE + ["autoscale", "--config", config, "--tick-s", "0.5", "--gateway", "http://127.0.0.1:9"],
                 {"PDSERVE_INTERNAL_TOKEN": "t"})  # fmt: skip
    assert a["autoscaler"]["tick_s"] == 0.5 and a["gateways"] == ["http://127.0.0.1:9"]


def test_paramstore_reads_store_table_and_flags_win(config, tmp_path, tiny_hf):
    r = run(PARAMSTORE + ["-q", "import", tiny_hf[0], "--name", "tiny", "--json"], {"PDSERVE_CONFIG": config})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["codec"] == "zfec k=2 m=1"  # k, m and locations from [store]
    r = run(PARAMSTORE + ["ls", "--json"], {"PARAMSTORE_CONFIG": config})
    assert r.returncode == 0 and json.loads(r.stdout)[0]["name"] == "tiny"
    other = [str(tmp_path / f"other{i}") for i in range(3)]
    r = run(PARAMSTORE + sum((["--store", u] for u in other), []) + ["ls", "--json"], {"PDSERVE_CONFIG": config})
    assert r.returncode == 0 and json.loads(r.stdout) == []  # --store replaces [store] locations


BAD = {
    "unknown key": ("[node]\nkv_blockz = 3\n", "unknown key 'kv_blockz' in [node]"),
    "unknown table": ("[nodes]\nmodel = 'x'\n", "unknown table or key 'nodes'"),
    "wrong type": ("[store]\nk = 'eight'\n", "[store] k = 'eight': expected int"),
    "secret in file": ("[gateway]\napi_keys = ['k']\n", "PDSERVE_API_KEYS"),
    "bad policy key": ("[autoscaler]\ntick = 1\n", "unknown autoscaler config keys: tick"),
    "not toml": ("[gateway\n", "is not valid TOML"),
    "bad node url": ("[gateway]\nnodes = ['decode=http://user@10.0.0.5:8001']\n", "invalid node URL"),
    "bad node role": ("[gateway]\nnodes = ['decoder=http://10.0.0.5:8001']\n", "role 'decoder' is not one of"),
}
COMMANDS = {  # each reads the tables the bad files above touch
    "node": PDSERVE + ["node", "--role", "decode", "--model", "m"],
    "gateway": PDSERVE + ["gateway"],
    "up": PDSERVE + ["up"],
    "autoscale": PDSERVE + ["autoscale"],
    "generate": PDSERVE + ["generate", "--model", "m", "--prompt", "hi"],
    "paramstore": PARAMSTORE + ["ls"],
}
# every command reads the file (unknown table); the other cases go through the same reader and table checks
WHO_READS = {"unknown key": ("node",), "unknown table": tuple(COMMANDS), "wrong type": ("generate", "paramstore"),
             "secret in file": ("gateway", "up"), "bad policy key": ("autoscale", "up"),
             "not toml": ("node", "up"), "bad node url": ("gateway",), "bad node role": ("gateway",)}  # fmt: skip


@pytest.mark.parametrize("case,command", [(c, m) for c, ms in WHO_READS.items() for m in ms])
def test_bad_config_is_one_line_and_exit_2(tmp_path, case, command):
    text, expect = BAD[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    # in an empty folder: no ./.pdserve/store to open, so a bad file must be caught before the store is
    r = run(COMMANDS[command], {"PDSERVE_CONFIG": str(path), "PDSERVE_INTERNAL_TOKEN": "t"}, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert expect in lines[0] and str(path) in lines[0], lines[0]


def test_missing_file_and_missing_settings_are_one_line(tmp_path):
    r = run(PDSERVE + ["node", "--role", "decode", "--config", str(tmp_path / "nope.toml")])
    assert r.returncode == 2 and "cannot read config" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run(PDSERVE + ["node"], {"PDSERVE_INTERNAL_TOKEN": "t"}, cwd=tmp_path)  # no --model is a standby node; no role
    assert r.returncode == 2 and "no role: pass --role" in r.stderr and "Traceback" not in r.stderr
    r = run(PDSERVE + ["node", "--role", "decode", "--standby", "--model", "m"], {"PDSERVE_INTERNAL_TOKEN": "t"})
    assert r.returncode == 2 and "exclude each other" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run(PDSERVE + ["autoscale", "--gateway", "http://127.0.0.1:9", "--max-ticks", "1"])
    assert r.returncode == 2 and "PDSERVE_INTERNAL_TOKEN" in r.stderr and "Traceback" not in r.stderr


def test_nixl_is_refused_unless_its_peers_are_trusted(tmp_path):
    """NIXL cannot bound what a peer READs (compute/node/config.py NIXL_UNBOUNDED; a READ with a handle whose
    memory was deregistered still lands over UCX's TCP transport): `pdserve node` and `pdserve up` refuse
    --kv-transport nixl in one line, before anything starts, unless the operator says the fabric is trusted."""
    env = {"PDSERVE_INTERNAL_TOKEN": "t"}
    for cmd in (PDSERVE + ["node", "--role", "decode", "--standby", "--kv-transport", "nixl"],
                PDSERVE + ["up", "--kv-transport", "nixl", "--port", "9"]):  # fmt: skip
        r = run(cmd, env, cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "nixl_trusted_fabric" in lines[0], r.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
    node = PDSERVE + ["node", "--role", "decode", "--standby", "--kv-transport", "nixl"]
    assert resolved(node + ["--nixl-trusted-fabric"], env)["kv_transport"] == "nixl"
    assert resolved(node, {**env, "PDSERVE_NIXL_TRUSTED_FABRIC": "1"})["nixl_trusted_fabric"] is True
