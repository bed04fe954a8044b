"""The admin CLI: exit codes, one-line errors, --json, and concurrent imports from two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paramstore.cli import main

from .damage import lose


def run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def store_args(tmp_path):
    return ["-q"] + sum((["--store", str(tmp_path / f"loc{i}")] for i in range(6)), [])


def test_import_ls_show_verify_json(store_args, tiny_hf, capsys):
    rc, out, _ = run(store_args + ["import", tiny_hf[0], "--name", "tiny", "--k", "4", "--m", "2", "--json"], capsys)
    assert rc == 0
    info = json.loads(out)
    assert info["model"] == "tiny@v1" and info["quant_error"]["rel_rmse"] > 0
    rc, out, _ = run(store_args + ["ls", "--json"], capsys)
    assert rc == 0 and json.loads(out)[0]["versions"] == ["v1"]
    rc, out, _ = run(store_args + ["show", "tiny", "--json"], capsys)
    shown = json.loads(out)
    assert rc == 0 and shown["codec"] == "zfec k=4 m=2" and all(s["health"] == "ok" for s in shown["shards"])
    assert all(len(set(s["placement"])) == 6 for s in shown["shards"])
    rc, out, _ = run(store_args + ["verify", "tiny", "--deep", "--json"], capsys)
    assert rc == 0 and json.loads(out)["summary"]["ok"] == len(shown["shards"])
    rc, out, _ = run(store_args + ["stats", "--json"], capsys)
    assert rc == 0 and json.loads(out)["models"] == 1
    rc, out, _ = run(store_args + ["show", "tiny"], capsys)
    assert rc == 0 and "0001-embed" in out


def test_verify_and_repair_exit_codes(store_args, tiny_hf, capsys):
    from paramstore import ParamStore, StoreConfig

    run(store_args + ["import", tiny_hf[0], "--name", "tiny", "--k", "4", "--m", "2"], capsys)
    cfg = StoreConfig([a for a in store_args if a not in ("-q", "--store")], k=4, m=2)
    with ParamStore(cfg) as store:
        m = store.manifest("tiny")
        lose(store, m, m.shards[2], (0, 3))
    rc, out, _ = run(store_args + ["verify", "tiny"], capsys)
    assert rc == 3 and "degraded" in out
    rc, out, _ = run(store_args + ["repair", "tiny", "--json"], capsys)
    assert rc == 0 and json.loads(out)["shards"][2]["repaired"] == 2
    rc, _, _ = run(store_args + ["verify", "tiny", "--deep"], capsys)
    assert rc == 0


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["import", "/no/such/dir", "--name", "x"], "source not found"),
        (["import", "{src}", "--name", "a/b"], "invalid model name"),
        (["import", "{src}", "--name", "x", "--k", "0"], "k >= 1"),
        (["import", "{src}", "--name", "x", "--k", "8", "--m", "3"], "at least 11"),
        (["show", "ghost"], "not found"),
        (["show", "ghost@v0"], "versions start at v1"),
        (["rm", "ghost@v2"], "not found"),
    ],
)
def test_errors_are_one_line_and_nonzero(store_args, tiny_hf, capsys, argv, msg):
    argv = [a.replace("{src}", tiny_hf[0]) for a in argv]
    rc, out, err = run(store_args + argv, capsys)
    assert rc == 2 and msg in err and err.count("\n") == 1 and "Traceback" not in err
    rc, out, _ = run(store_args + ["ls", "--json"], capsys)
    assert json.loads(out) == []  # nothing written


def test_rm_gc_warm(store_args, tiny_hf, capsys, tmp_path):
    run(store_args + ["import", tiny_hf[0], "--name", "tiny", "--k", "4", "--m", "2"], capsys)
    cache = str(tmp_path / "cache")
    rc, out, _ = run(store_args + ["warm", "tiny", "--cache-dir", cache, "--json"], capsys)
    assert rc == 0 and json.loads(out)["already_cached"] == 0
    rc, out, _ = run(store_args + ["warm", "tiny", "--cache-dir", cache, "--json"], capsys)
    assert json.loads(out)["already_cached"] == json.loads(out)["shards"]
    rc, out, _ = run(store_args + ["rm", "tiny", "--json"], capsys)
    assert rc == 0 and json.loads(out)["removed"] == ["tiny@v1"]
    rc, out, _ = run(store_args + ["gc", "--grace", "0", "--json"], capsys)
    assert rc == 0 and json.loads(out)["removed"] > 0


@pytest.mark.slow
def test_two_processes_importing_one_name(store_args, tiny_hf):
    """Real console-script processes racing on a local store: two versions, both readable."""
    exe = os.path.join(os.path.dirname(sys.executable), "paramstore")
    cmd = [exe] + store_args + ["import", tiny_hf[0], "--name", "tiny", "--k", "4", "--m", "2", "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(json.loads(o)["model"] for o, _ in outs) == ["tiny@v1", "tiny@v2"]
    ls = subprocess.run([exe] + store_args + ["verify", "tiny@v1", "--deep"], capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr


def test_import_with_a_chat_template(store_args, tiny_hf, capsys, tmp_path):
    """--chat-template replaces the checkpoint's template in the stored bundle; a bad one is one line, nothing written."""
    from paramstore import ParamStore, StoreConfig

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m }")
    for path, msg in ((bad, "not a jinja template"), (tmp_path / "none.jinja", "cannot be read")):
        rc, _, err = run(store_args + ["import", tiny_hf[0], "--name", "tiny", "--chat-template", str(path)], capsys)
        assert rc == 2 and msg in err and err.count("\n") == 1 and "Traceback" not in err
    rc, out, _ = run(store_args + ["ls", "--json"], capsys)
    assert json.loads(out) == []
    good = tmp_path / "tools.jinja"
    good.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{{ tools | tojson }}")
    rc, _, _ = run(store_args + ["import", tiny_hf[0], "--name", "tiny", "--k", "4", "--m", "2",
                                 "--chat-template", str(good)], capsys)  # fmt: skip
    assert rc == 0
    with ParamStore(StoreConfig(locations=store_args[2::2], k=4, m=2)) as store, store.reader("tiny") as r:
        assert r.bundle()["chat_template.jinja"] == good.read_bytes()
