"""A node runtime not bound to a model: standby start, load / unload / evict within a memory budget,
draining, per-model routing and parity, the online capacity report — on real node processes serving
tiny random Llamas from a local store (token ids only, no tokenizer)."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

from tests.conftest import tiny_llama_config, tiny_llama_tensors, write_hf_folder
from tests.services import AUTH, TOKEN, Services, wait_for

pytestmark = pytest.mark.slow

LONG = 1200  # tokens of a stream that is still running while the test acts (a few seconds)
PROMPTS = [[5, 17, 33, 2 + i, 90, 41] for i in range(6)]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny Llamas of one shape (~25 MB of fp32 weights each), different weights: (locations, a, b)."""
    from paramstore import ParamStore, StoreConfig

    cfg = tiny_llama_config(layers=4, hidden=256, ffn=1024, heads=4, kv_heads=2, vocab=4096)
    cfg["eos_token_id"], cfg["max_position_embeddings"] = None, 2048
    store = StoreConfig.local_default(str(tmp_path_factory.mktemp("models-store")), k=4, m=2)
    with ParamStore(store) as ps:
        for seed, name in ((0, "tiny-a"), (1, "tiny-b")):
            folder = write_hf_folder(tmp_path_factory.mktemp(name), cfg, tiny_llama_tensors(cfg, seed=seed))
            ps.import_model(folder, name, dtype="fp32")
    return store.locations, "tiny-a", "tiny-b"


def node(tmp, locations, model=None, extra=()):
    svc = Services(locations, None, str(tmp), TOKEN)
    return svc.node("both", kv_blocks=256, extra=("--weights", "fp32", *extra), model=model)


@pytest.fixture(scope="module")
def multi(tmp_path_factory, two_models):
    """A standby node (no --model), the default budget."""
    n = node(tmp_path_factory.mktemp("multi"), two_models[0])
    try:
        yield n.wait_ready()
    finally:
        n.stop()


def post(n, path, body, timeout=60):
    return httpx.post(n.url + path, json=body, auth=AUTH, timeout=timeout)


def load_ready(n, model, timeout=120):
    r = post(n, "/internal/models/load", {"model": model})
    assert r.status_code in (200, 202), r.text
    wait_for(lambda: n.load()["models"].get(model, {}).get("state") in ("ready", "failed"), timeout, f"{model} ready")
    m = n.load()["models"][model]
    assert m["state"] == "ready", m
    return r.json()


def generate(n, ids, model=None, max_tokens=12, rid=None, **params):
    body = {"request_id": rid or f"r{id(ids)}-{threading.get_ident()}-{max_tokens}", "prompt_token_ids": ids,
            "params": {"max_tokens": max_tokens, "temperature": 0} | params}  # fmt: skip
    if model is not None:
        body["model"] = model
    toks, reason = [], None
    with httpx.stream("POST", n.url + "/internal/generate", json=body, auth=AUTH, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            d = json.loads(line)
            toks += d["token_ids"]
            reason = d["finish_reason"] or reason
    return toks, reason


def test_standby_is_ready_at_once_and_holds_nothing(multi):
    r = httpx.get(multi.url + "/ready", timeout=5)
    assert r.status_code == 200 and r.json()["state"] in ("standby", "ready", "loading")
    load = multi.load()
    assert load["role"] == "both" and load["memory_budget_bytes"] > 0
    models = httpx.get(multi.url + "/internal/models", auth=AUTH, timeout=5).json()
    assert set(models) >= {"models", "memory_budget_bytes", "memory_used_bytes"}
    if not load["models"]:  # first test of the module: nothing loaded yet
        assert load["state"] == "standby" and load["model"] is None and load["ready"] is False
        assert load["memory_used_bytes"] == 0 and load["kv_blocks_total"] == 0 and models["models"] == []
        code, detail = generate(multi, PROMPTS[0])
        assert code == 503 and "no model" in detail


@pytest.mark.parametrize("body, code, words", [
    ({}, 400, "missing required field `model`"), ({"model": 5}, 400, "`$.model`"), ({"model": "tiny-a", "weights": "fp8"}, 400,
    "invalid weights"), ({"model": "nope"}, 404, "not in the store"), ({"model": "tiny-a@v9"}, 404, "not in the store"),
    ({"model": "bad@@name"}, 400, "bad model reference"),
])  # fmt: skip
def test_bad_load_bodies_are_refused_with_a_message(multi, body, code, words):
    r = post(multi, "/internal/models/load", body)
    assert r.status_code == code, r.text
    assert words in r.json()["detail"]


def test_bad_unload_and_request_bodies(multi):
    r = post(multi, "/internal/models/unload", {"model": "nope"})
    assert r.status_code == 404 and "not held" in r.json()["detail"]
    r = httpx.post(multi.url + "/internal/models/load", content=b"{", auth=AUTH, timeout=5)
    assert r.status_code == 400 and "JSON" in r.json()["detail"]
    code, detail = generate(multi, PROMPTS[0], model="nope")
    assert code == 503 and "not held" in detail
    r = post(multi, "/internal/generate", {"request_id": "x", "prompt_token_ids": [1], "model": "nope"})
    assert r.status_code == 503 and r.json()["kind"] == "model_not_loaded"  # the kind says: try a node holding it
    # SamplingParams is the wire type: a field the engine does not have is refused, by name, before any lookup
    r = post(multi, "/internal/generate", {"request_id": "x", "prompt_token_ids": [1], "params": {"bogus_p": 1}})
    assert r.status_code == 400 and "bogus_p" in r.json()["detail"] and r.json()["kind"] == "bad_request", r.text


def test_two_models_on_one_node_answer_as_nodes_that_hold_only_them(multi, two_models, tmp_path):
    locations, a, b = two_models
    assert load_ready(multi, a)["state"] in ("loading", "ready")
    again = post(multi, "/internal/models/load", {"model": a})
    assert again.status_code == 200 and again.json()["state"] == "ready"  # idempotent
    load_ready(multi, b)
    code, detail = generate(multi, PROMPTS[0])
    assert code == 400 and "several models" in detail
    only_a = node(tmp_path, locations, model=a)
    only_b = node(tmp_path, locations, model=b)
    try:
        only_a.wait_ready()
        only_b.wait_ready()
        assert only_a.load()["models"][a]["state"] == "ready" and only_a.load()["model"] == a
        for ids in PROMPTS[:3]:
            want_a, want_b = generate(only_a, ids), generate(only_b, ids)
            assert generate(multi, ids, model=a) == want_a
            assert generate(multi, ids, model=b) == want_b
            assert generate(only_a, ids) == want_a  # a one-model node still takes requests without "model"
            assert want_a[0] != want_b[0]
    finally:
        only_a.stop()
        only_b.stop()
    load = multi.load()
    assert load["state"] == "ready" and set(load["models"]) == {a, b}
    assert load["memory_used_bytes"] == sum(m["bytes"] for m in load["models"].values())
    assert load["kv_blocks_total"] == sum(m["kv_blocks_total"] for m in load["models"].values()) == 512


def test_capacity_is_measured_from_decode_steps(multi, two_models):
    a = two_models[1]
    load_ready(multi, a)
    for batch in (1, 4):  # two batch sizes: the step-time line can be fitted
        threads = [threading.Thread(target=generate, args=(multi, PROMPTS[i], a, 24), kwargs={"ignore_eos": True})
                   for i in range(batch)]  # fmt: skip
        [t.start() for t in threads]
        [t.join(120) for t in threads]
    cap = wait_for(lambda: (c := multi.load()["models"][a]["capacity"])["max_streams"] and c, 5, "capacity")
    assert cap["samples"] > 40 and cap["tpot_target_s"] == pytest.approx(0.1)
    assert cap["decode_step_s"]["a"] is not None and cap["decode_step_s"]["b"] is not None
    assert 1 <= cap["max_streams"] <= 64
    assert cap["decode_tokens_per_s"] > 0 and cap["prefill_tokens_per_s"] > 0


def test_unload_drains_then_frees_weights_and_kv(multi, two_models):
    _, a, b = two_models
    load_ready(multi, a)
    load_ready(multi, b)
    before = multi.load()
    held_b = before["models"][b]
    out: dict = {}
    stream = threading.Thread(target=lambda: out.update(
        answer=generate(multi, PROMPTS[1], b, LONG, rid="long", ignore_eos=True)))  # fmt: skip
    stream.start()
    wait_for(lambda: multi.load()["models"][b]["active_requests"] == 1, 30, "the stream running")
    unload = threading.Thread(target=lambda: out.update(unload=post(multi, "/internal/models/unload",
                                                                    {"model": b, "timeout_s": 60}, timeout=90)))  # fmt: skip
    unload.start()
    wait_for(lambda: multi.load()["models"].get(b, {}).get("state") == "draining", 30, "draining")
    code, detail = generate(multi, PROMPTS[2], b)
    assert code == 503 and "draining" in detail  # new requests of a draining model are refused
    assert generate(multi, PROMPTS[2], a)[1] == "length"  # the other model serves on
    stream.join(120)
    unload.join(120)
    toks, reason = out["answer"]
    assert len(toks) == LONG and reason == "length"  # the stream in flight finished
    assert out["unload"].status_code == 200 and out["unload"].json() == {"unloaded": True, "drained": True}
    after = multi.load()
    assert b not in after["models"]
    listed = httpx.get(multi.url + "/internal/models", auth=AUTH, timeout=5).json()
    assert [m["model"] for m in listed["models"]] == [a]
    assert after["memory_used_bytes"] == before["memory_used_bytes"] - held_b["bytes"]
    assert after["kv_blocks_total"] == before["kv_blocks_total"] - held_b["kv_blocks_total"]
    drop = before["rss_bytes"] - after["rss_bytes"]  # the KV cache is resident only where it was written
    assert drop > 0.8 * held_b["weights_bytes"], (drop, held_b["weights_bytes"])  # the memory went back to the OS
    code, detail = generate(multi, PROMPTS[2], b)
    assert code == 503 and "not held" in detail


def test_budget_for_one_model_evicts_the_idle_one_and_refuses_when_busy(tmp_path, two_models, multi):
    locations, a, b = two_models
    one = multi.load()["models"][a]["bytes"]
    n = node(tmp_path, locations, extra=("--memory-gb", f"{1.5 * one / 2**30:.6f}"))
    try:
        n.wait_ready()
        load_ready(n, a)
        first = generate(n, PROMPTS[0], a)
        r = load_ready(n, b)
        assert r["evicted"] == [a]
        load = n.load()
        assert set(load["models"]) == {b} and load["memory_used_bytes"] <= load["memory_budget_bytes"]
        assert load["kv_blocks_total"] == 256  # no KV block of the evicted model left
        out: dict = {}
        busy = threading.Thread(target=lambda: out.update(answer=generate(n, PROMPTS[3], b, LONG, ignore_eos=True)))
        busy.start()
        wait_for(lambda: n.load()["models"][b]["active_requests"] == 1, 30, "b busy")
        r = post(n, "/internal/models/load", {"model": a})
        assert r.status_code == 503 and "no room" in r.json()["detail"] and b in r.json()["detail"]
        busy.join(120)
        assert out["answer"][1] == "length" and len(out["answer"][0]) == LONG
        assert load_ready(n, a)["evicted"] == [b]  # idle again: evicted for a
        assert generate(n, PROMPTS[0], a) == first  # reloaded, same answers
    finally:
        n.stop()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_peak_rss_while_loading_stays_within_the_budget(tmp_path, two_models, multi):
    """The budget holds during the load, not only after: the node's RSS, sampled from /proc every few ms
    while it loads a model into a budget sized for one, grows by no more than that budget (the shards in
    flight are reserved, the pages of tensors copied into fused buffers handed back)."""
    locations, a, b = two_models
    one = multi.load()["models"].get(a, {}).get("bytes") or load_ready(multi, a) and multi.load()["models"][a]["bytes"]
    n = node(tmp_path, locations, extra=("--memory-gb", f"{1.5 * one / 2**30:.6f}"))
    try:
        n.wait_ready()
        budget = n.load()["memory_budget_bytes"]
        for model in (a, b, a):  # the second and third loads evict the one before
            base = _rss(n.p.pid)
            peak, samples, stop = [base], [0], threading.Event()

            def sample(peak=peak, samples=samples, stop=stop):
                while not stop.is_set():
                    peak[0] = max(peak[0], _rss(n.p.pid))
                    samples[0] += 1
                    stop.wait(0.002)

            t = threading.Thread(target=sample)
            t.start()
            try:
                r = load_ready(n, model)
            finally:
                stop.set()
                t.join(5)
            held = n.load()["models"][model]
            assert held["transient_bytes"] == 0 and held["progress"]["released_bytes"] > 0, held
            growth = peak[0] - base
            assert samples[0] >= 5, samples  # the load was sampled, not just its ends
            assert growth <= budget, (model, r, growth / 2**20, budget / 2**20, samples)
            assert n.load()["memory_used_bytes"] <= budget
            assert _rss(n.p.pid) - base <= budget
    finally:
        n.stop()


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_standby_prefill_and_decode_nodes_hand_off_a_loaded_model(tmp_path, two_models, transport):
    """Each model's KV endpoint is made on load and closed on unload (over NIXL: one agent per process,
    created at start; each model's cache registered on load, deregistered on unload)."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="nixl-cu12 (extra 'rdma') is not installed")
    locations, a, b = two_models
    svc = Services(locations, None, str(tmp_path), TOKEN)
    pre = svc.node("prefill", kv_blocks=256, transport=transport, model=None,
                   extra=("--weights", "fp32", "--cache-dir", str(tmp_path / "c")))  # fmt: skip
    dec = svc.node("decode", kv_blocks=256, transport=transport, extra=("--weights", "fp32"), model=None)
    try:
        pre.wait_ready()
        dec.wait_ready()
        assert pre.load()["state"] == "standby" and pre.load()["cached"].get(a) == 0.0  # surveyed, not cached
        for n in (pre, dec):
            load_ready(n, a)
            load_ready(n, b)
        assert pre.load()["cached"][a] == 1.0
        for model in (a, b):  # the handoff gives what a whole request on one node gives
            assert pd(pre, dec, PROMPTS[4], model) == generate(pre, PROMPTS[4], model=model, rid=f"w-{model}")
        wait_for(lambda: pre.load()["kv_transfers_held"] == 0 and pre.load()["kv_blocks_used"] == 0, 10, "KV released")
        for n in (pre, dec):
            assert post(n, "/internal/models/unload", {"model": b}).json() == {"unloaded": True, "drained": True}
            assert set(n.load()["models"]) == {a} and n.load()["kv_blocks_total"] == 256
        r = post(pre, "/internal/prefill", {"request_id": "gone", "prompt_token_ids": PROMPTS[0], "model": b})
        assert r.status_code == 503
        load_ready(pre, b)  # loaded again: a new endpoint over the new cache
        load_ready(dec, b)
        assert pd(pre, dec, PROMPTS[5], b) == generate(pre, PROMPTS[5], model=b, rid="again")
        assert "nixl unusable" not in pre.log() + dec.log()
    finally:
        svc.stop_all()


def pd(pre, dec, ids, model):
    """Prefill on ``pre``, KV handed to ``dec``, decoded there: (token ids, finish reason)."""
    params = {"max_tokens": 12, "temperature": 0}
    rid = f"pd-{model}-{ids[3]}-{threading.get_ident()}"
    first = post(pre, "/internal/prefill", {"request_id": rid, "prompt_token_ids": ids, "params": params,
                                            "model": model}).json()  # fmt: skip
    body = {"request_id": rid, "prompt_token_ids": ids, "first_token_id": first["token_ids"][-1], "kv": first["kv"],
            "params": dict(params, max_tokens=11), "model": model}  # fmt: skip
    toks, reason = list(first["token_ids"]), None
    with httpx.stream("POST", dec.url + "/internal/decode", json=body, auth=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            d = json.loads(line)
            toks += d["token_ids"]
            reason = d["finish_reason"] or reason
    return toks, reason


def _threads(pid: int) -> dict[str, tuple[int, int]]:
    """tid -> (nice, CPU ticks) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # ended meanwhile
        out[tid] = (int(fields[16]), int(fields[11]) + int(fields[12]))  # nice, utime + stime
    return out


def test_import_nice_nices_only_the_imports(tmp_path, two_models):
    """A pool refill's runtime imports at low priority; no thread that serves is niced."""
    locations, a, _ = two_models
    n = node(tmp_path, locations, extra=("--import-nice", "7"))
    try:
        n.wait_ready()
        load_ready(n, a)
        before = _threads(n.p.pid)
        assert generate(n, PROMPTS[0], a, 400, ignore_eos=True)[1] == "length"
        after = _threads(n.p.pid)
        worked = {tid: nice for tid, (nice, cpu) in after.items() if cpu > before.get(tid, (0, 0))[1]}
        assert worked and set(worked.values()) == {0}, (before, after)
    finally:
        n.stop()
