"""The warm pool (autoscaler/pool.py) on real runtimes: models claimed onto running processes and released.
(The pure placement ranking and the pool's settings: tests/autoscaler/test_placement.py.)

- a burst on real processes: the policy, driven tick by tick on a fake clock, decides +1 decode; the pool
  claims the standby runtime that was already running (no process started for the scale-up), the model is
  ready on it sooner than a cold start (process start -> ready) measured in the same run, no process starts
  while it loads, and the pool is refilled with a new standby process afterwards; scaled back down, the runtime returns to standby
  with the model's weights gone, and surplus standby runtimes are stopped.
- two models on one runtime (no standby, room for both): the second is placed beside the first, and
  unloading one leaves the other serving.
- `pdserve up` with scale-to-zero: a model idle past its time goes to zero (its runtimes return to standby,
  weights gone), and the next request is held by the gateway's activator and answered.
- a pool that cannot hold every model (pool_size 0, 1 + 1 runtimes kept up, a budget for one of two):
  requests A, B, A swap the models on the same processes (no process started or stopped), each swap's
  first token within a fraction of the cold start measured in the same run, the evicted model at 0
  replicas at once, and the nodes' RSS (sampled from /proc) never grows past their budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from autoscaler.pool import PoolConfig
from compute.node.auth import SignedAuth
from gateway import keyfile
from tests.services import admin_headers, wait_for

TOKEN = "pool-test-token"
AUTH = SignedAuth(TOKEN)


# --- real runtimes ---------------------------------------------------------------------------
def _load(url: str) -> dict:
    return httpx.get(url + "/load", auth=AUTH, timeout=5).json()


def _model_state(url: str, model: str) -> str | None:
    try:
        return (_load(url).get("models") or {}).get(model, {}).get("state")
    except httpx.HTTPError:
        return None


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_standby_runtime_is_claimed_on_a_burst_then_the_pool_is_refilled(tmp_path, real_model_store):
    from autoscaler.config import AutoscalerConfig
    from autoscaler.local import LocalActuator, LocalConfig
    from autoscaler.loop import ControlLoop
    from autoscaler.policy import RoleLoad
    from autoscaler.pool import RuntimePool
    from tests.procs import alive, started

    locations, model = real_model_store
    key = (model, "decode")
    act = LocalActuator(LocalConfig(model=None, store=list(locations), internal_token=TOKEN, threads=1, kv_blocks=128,
                                    log_dir=str(tmp_path / "logs"), ready_timeout_s=240, stop_timeout_s=5,
                                    drain_timeout_s=10, import_nice=10))  # fmt: skip
    pool = RuntimePool(act, TOKEN, PoolConfig(pool_size=1, max_runtimes={"decode": 3}, unload_timeout_s=10),
                       roles=("decode",))  # fmt: skip
    cfg = AutoscalerConfig(tick_s=1.0, target_running_streams_per_replica=4, stable_window_s=10.0, panic_window_s=2.0,
                           scale_down_delay_s=5.0, decode_min_replicas=1, decode_max_replicas=2,
                           scale_to_zero_after_s=0)  # fmt: skip
    now, streams, seen = [1000.0], [0], {}
    loop = ControlLoop(cfg, lambda: {key: RoleLoad(model=model, running_streams=streams[0])}, pool,
                       clock=lambda: now[0])  # fmt: skip

    def tick():
        now[0] += cfg.tick_s
        report = loop.tick()
        assert not report.error, report
        seen.update({p.proc.pid: seen.get(p.proc.pid) or started(p.proc.pid) for p in act.nodes})
        return report

    def ticking(fn, timeout, what):
        def once():
            tick()
            return fn()
        return wait_for(once, timeout, what, every=0.2)

    def runtimes():
        return {r["url"]: r for r in pool.status()["runtimes"]}

    try:
        # control: the first replica has no runtime to claim, so a cold process starts (spawn -> model ready)
        t0 = time.monotonic()
        ticking(lambda: any(n.ready for n in pool.current().get(key, [])), 240, "the first replica (cold)")
        cold_s = time.monotonic() - t0
        # then the pool is refilled: one standby runtime, up, holding nothing
        ticking(lambda: [u for u, r in runtimes().items() if r["state"] == "standby"], 240, "a standby runtime")
        (standby,) = [u for u, r in runtimes().items() if r["state"] == "standby"]
        before = {p.proc.pid: p.url for p in act.nodes}
        assert len(before) == 2 and _load(standby)["models"] == {}

        # the burst: 20 streams at 4 per replica (the panic window's mean: 2.5x one replica) -> the policy asks
        # for the maximum, 2 decode replicas; the standby is claimed
        streams[0] = 20
        t1 = time.monotonic()
        report = tick()
        assert report.asked == {key: 2}, report
        (claim,) = [c for c in pool.status()["claims"] if c["url"] == standby]
        assert claim["why"] == "standby runtime" and claim["error"] == "", claim
        seen_loading = []  # processes up while the claimed runtime loads: the refill waits for the load

        def claimed_ready():
            state = _model_state(standby, model)
            seen_loading.extend([len(act.nodes)] if state == "loading" else [])
            return state == "ready"

        ticking(claimed_ready, 60, "the model ready on the claimed runtime")
        claim_s = time.monotonic() - t1
        claimed_pid = next(pid for pid, url in before.items() if url == standby)
        assert {p.proc.pid for p in act.nodes if p.url == standby} == {claimed_pid}  # the same process, no new one
        assert set(seen_loading) <= {2}, seen_loading
        print(f"\nclaim -> ready {claim_s:.2f} s; cold process start -> ready {cold_s:.2f} s "
              f"({claim_s / cold_s:.0%} of it)")  # fmt: skip
        # no process start: faster than one (the ratio is a benchmark's: on a fresh VM a load's first touch of
        # memory beside other processes costs 2-4x, measured 0.3 s alone vs 1.2 s beside an idle node)
        assert claim_s < cold_s, (claim_s, cold_s)

        # the pool refills: a new standby process appears, and both replicas of the model are ready
        ticking(lambda: [u for u, r in runtimes().items() if r["state"] == "standby" and u not in before.values()],
                240, "a new standby runtime")  # fmt: skip
        assert len(pool.current()[key]) == 2 and len(act.nodes) == 3
        assert set({p.proc.pid for p in act.nodes}) - set(before), "no new process for the refill"

        # the burst ends: back to 1 replica; the unloaded runtime returns to standby with the weights gone, and
        # the surplus standby runtime is stopped (runtimes = 1 busy + pool_size)
        streams[0] = 0
        ticking(lambda: len(pool.current().get(key, [])) == 1, 60, "the scale-down to one replica")
        ticking(lambda: len(act.nodes) == 2 and sorted(r["state"] for r in runtimes().values()) == ["ready", "standby"],
                60, "one busy and one standby runtime")  # fmt: skip
        (back,) = [u for u, r in runtimes().items() if r["state"] == "standby"]
        assert _load(back)["models"] == {} and _load(back)["memory_used_bytes"] == 0, _load(back)
    finally:
        pool.close()
        act.close()
    assert not alive(seen), f"left running: {alive(seen)}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_models_share_one_runtime_and_one_is_unloaded_without_touching_the_other(tmp_path, tiny_hf):
    """No standby and room for both: the second model goes to the runtime that holds the first (memory room),
    no process is started for it; unloading one leaves the other serving on that runtime."""
    from autoscaler.local import LocalActuator, LocalConfig
    from autoscaler.pool import RuntimePool
    from paramstore import ParamStore, StoreConfig

    store = StoreConfig.local_default(str(tmp_path / "store"), k=4, m=2)
    with ParamStore(store) as ps:
        for name in ("tiny", "tiny2"):
            ps.import_model(tiny_hf[0], name, dtype="fp32")
    act = LocalActuator(LocalConfig(model=None, store=list(store.locations), internal_token=TOKEN, threads=1,
                                    kv_blocks=64, log_dir=str(tmp_path / "logs"), ready_timeout_s=120,
                                    stop_timeout_s=5))  # fmt: skip
    pool = RuntimePool(act, TOKEN, PoolConfig(pool_size=0, max_runtimes={"decode": 1}), roles=("decode",))

    def ready(model):
        return [n.url for n in pool.current().get((model, "decode"), []) if n.ready]

    try:
        pool.place(["tiny"], {"decode": 1})
        (url,) = wait_for(lambda: ready("tiny"), 120, "tiny ready on the one runtime", every=0.2)
        pids = {p.proc.pid for p in act.nodes}
        pool.scale(("tiny2", "decode"), 1)
        assert pool.status()["last_placement"]["why"].startswith("memory room"), pool.status()["last_placement"]
        assert wait_for(lambda: ready("tiny2"), 60, "tiny2 ready", every=0.1) == [url]
        assert {p.proc.pid for p in act.nodes} == pids and set(_load(url)["models"]) == {"tiny", "tiny2"}
        pool.scale(("tiny", "decode"), 0)  # unload tiny: tiny2 keeps serving on the same runtime
        wait_for(lambda: set(_load(url)["models"]) == {"tiny2"}, 60, "tiny unloaded", every=0.1)
        assert _model_state(url, "tiny2") == "ready" and ready("tiny2") == [url] and not ready("tiny")
    finally:
        pool.close()
        act.close()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_idle_model_goes_to_zero_and_the_next_request_brings_it_back(tmp_path, real_model_store):
    """`pdserve up --model M`: idle past scale_to_zero_after_s, M leaves every runtime (standby again, weights
    freed); the next request is held by the gateway's activator while the pool claims runtimes, and answered."""
    import openai

    from compute.node.launcher import Services
    from tests.procs import alive, children
    from tests.services import AUTH as UP_AUTH
    from tests.services import TOKEN as UP_TOKEN

    locations, model = real_model_store
    (tmp_path / "logs").mkdir()
    cfg = tmp_path / "pdserve.toml"
    cfg.write_text("[autoscaler]\ntick_s = 0.5\nscale_to_zero_after_s = 4\n")
    svc = Services(list(locations), model, str(tmp_path), UP_TOKEN)
    up = svc.start("up", ["up", "--log-dir", str(tmp_path / "logs"), "--config", str(cfg)])
    seen: dict[int, str] = {}
    q = [{"role": "user", "content": "What is the capital of France?"}]
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def pool() -> dict:
        seen.update(children(up.p.pid))
        return httpx.get(up.url + "/admin/status", headers=admin_headers(up.url), timeout=10).json()["supervisor"]["pool"]

    def holding(p: dict) -> list[str]:
        return [r["url"] for r in p["runtimes"] if r["models"].get(model) in ("loading", "ready")]

    try:
        up.wait_ready(240)
        answer = client.chat.completions.create(model=model, messages=q, max_tokens=12, temperature=0)
        assert "Paris" in answer.choices[0].message.content
        assert len(holding(pool())) == 1  # the default's one colocated runtime holds it

        # idle for 4 s: the model goes to zero; its runtime returns to standby with the weights freed, and the
        # pool keeps one standby runtime per role (the warm one: a refill still starting goes first)
        # (the plan's count is fixed, so its standby runtime was kept on top: one leaves, then is gone)
        p = wait_for(lambda: (p := pool()) and not holding(p) and len(p["runtimes"]) == 1
                     and all(r["state"] == "standby" for r in p["runtimes"]) and len(children(up.p.pid)) == 1 and p,
                     60, "the idle model at zero replicas", every=0.25)  # fmt: skip
        urls = {r["url"] for r in p["runtimes"]}
        for url in urls:
            ld = httpx.get(url + "/load", auth=UP_AUTH, timeout=5).json()
            assert ld["state"] == "standby" and ld["models"] == {} and ld["memory_used_bytes"] == 0, ld
        claims = p["claims_done"]
        pids = set(children(up.p.pid))

        # the next request: held while the pool places the model again on runtimes that already run, answered
        t0 = time.monotonic()
        answer = client.chat.completions.create(model=model, messages=q, max_tokens=12, temperature=0)
        back_s = time.monotonic() - t0
        assert "Paris" in answer.choices[0].message.content
        p = pool()
        assert p["claims_done"] >= claims + 1 and set(holding(p)) <= urls, p  # claimed, not started
        assert pids <= set(children(up.p.pid))
        print(f"\nscale from zero: first request -> answer {back_s:.2f} s (12 tokens)")
        out = subprocess.run([sys.executable, "-m", "autoscaler.cli", "status", "--url", up.url], capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
        assert out.returncode == 0, out.stderr  # no key typed: the one `pdserve up` wrote, readable by this user only
        assert "warm pool: " in out.stdout and f"last placement: {model}/" in out.stdout, out.stdout
        key_file = keyfile.path(up.url.rsplit(":", 1)[1])
        assert os.stat(key_file).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(key_file)).st_mode & 0o077 == 0
        up.p.send_signal(signal.SIGTERM)
        assert up.p.wait(60) == 0
        assert not os.path.exists(key_file)  # the key ends with the service
        assert not alive(seen), f"left running: {alive(seen)}"
    finally:
        up.stop()
        from tests.procs import kill_left

        kill_left(seen)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _first_token(url: str, model: str, t0: float, timeout: float = 120) -> tuple[float, list[int]]:
    """Stream one request for `model` from the node at `url`: (seconds from t0 to its first token, tokens)."""
    body = {"request_id": f"swap-{model}-{time.monotonic_ns()}", "model": model, "prompt_token_ids": [5, 17, 33, 90],
            "params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    first, toks = None, []
    with httpx.stream("POST", url + "/internal/generate", json=body, auth=AUTH, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            got = json.loads(line)["token_ids"]
            if got and first is None:
                first = time.monotonic() - t0
            toks += got
    assert first is not None and len(toks) == 8, toks
    return first, toks


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_pool_that_cannot_hold_every_model_swaps_them_on_its_runtimes(tmp_path):
    from autoscaler.local import LocalActuator, LocalConfig
    from autoscaler.pool import RuntimePool
    from compute.modeling.loader import transient_bytes
    from compute.node.config import NodeConfig
    from compute.node.held import estimate_bytes
    from paramstore import ParamStore, StoreConfig
    from tests.conftest import tiny_llama_config, tiny_llama_tensors, write_hf_folder
    from tests.procs import alive

    # ~78 MiB of fp32 weights: large beside what a process's RSS grows by for anything else while it serves
    # (allocator arenas, first-forward workspace: 6-25 MiB measured), so the budget check is about the model
    cfg = tiny_llama_config(layers=6, hidden=384, ffn=1536, heads=4, kv_heads=2, vocab=8192)
    cfg["eos_token_id"], cfg["max_position_embeddings"] = None, 2048
    store = StoreConfig.local_default(str(tmp_path / "store"), k=4, m=2)
    with ParamStore(store) as ps:
        for seed, name in ((0, "tiny-a"), (1, "tiny-b")):
            ps.import_model(write_hf_folder(tmp_path / name, cfg, tiny_llama_tensors(cfg, seed=seed)), name, dtype="fp32")
        manifest = ps.manifest("tiny-a")
    one = sum(estimate_bytes(manifest, "fp32", NodeConfig(role="decode", internal_token=TOKEN, kv_blocks=64))) + transient_bytes(manifest, 1)
    budget_gb = 1.4 * one / 2**30  # one model and the shard in flight of its load: never two models
    act = LocalActuator(LocalConfig(model=None, store=list(store.locations), internal_token=TOKEN, threads=1,
                                    kv_blocks=64, weights="fp32", log_dir=str(tmp_path / "logs"), ready_timeout_s=180,
                                    stop_timeout_s=5, extra_args=("--memory-gb", f"{budget_gb:.6f}")))  # fmt: skip
    roles = ("prefill", "decode")
    pool = RuntimePool(act, TOKEN, PoolConfig(pool_size=0, max_runtimes=dict.fromkeys(roles, 1),
                                                min_runtimes=dict.fromkeys(roles, 1)), roles=roles)  # fmt: skip
    seen: dict[int, str] = {}
    peak: dict[int, int] = {}
    stop = threading.Event()

    def sample():  # every runtime's RSS, every few ms, for the whole test
        while not stop.is_set():
            for p in list(act.nodes):
                try:
                    peak[p.proc.pid] = max(peak.get(p.proc.pid, 0), _rss(p.proc.pid))
                except (OSError, StopIteration):
                    pass
            stop.wait(0.003)

    def ready_on(model: str) -> dict[str, str]:
        out = {n.role: n.url for (m, _), ns in pool.current().items() if m == model for n in ns if n.ready}
        return out if set(out) == set(roles) else {}

    def ask(model: str, other: str | None) -> tuple[float, dict[str, str]]:
        """The activator's ask as the loop makes it: `model` to 1 replica per role (the other still wanted)."""
        pool.current()  # the loop's tick: observe, then scale
        t0 = time.monotonic()
        for role in roles:
            pool.scale((model, role), 1)
        if other is not None:  # evicted by the claim: at 0 replicas at once, not at the next observation
            st = pool.status()
            assert all(pool.replicas((other, role)) == 0 for role in roles), (st["desired"], st["claims"][-2:])
            assert all(c["evicted"] == [other] for c in pool.status()["claims"][-2:]), pool.status()["claims"]
        urls = wait_for(lambda: ready_on(model), 120, f"{model} ready on both runtimes", every=0.05)
        first = _first_token(urls["decode"], model, t0)[0]
        _first_token(urls["prefill"], model, t0)  # served on both (a P/D request would): unprotected from now on
        return first, urls

    try:
        t_start = time.monotonic()
        standby = wait_for(lambda: (pool.current() or True) and len(pool.status()["runtimes"]) == 2
                           and all(r["state"] == "standby" for r in pool.status()["runtimes"]), 180,
                           "1 + 1 standby runtimes (the floor, with pool_size 0 and nothing held)", every=0.2)  # fmt: skip
        assert standby
        pids = {p.proc.pid: p.url for p in act.nodes}
        seen.update(pids)
        base = {pid: _rss(pid) for pid in pids}
        cold_s = time.monotonic() - t_start  # the control: processes started to standby, before any load
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        first_a, urls = ask("tiny-a", None)
        swaps = {}
        for model, other in (("tiny-b", "tiny-a"), ("tiny-a", "tiny-b")):
            for role in roles:  # the other model is still wanted (the policy's cooldown): the claim evicts it
                assert pool.replicas((other, role)) == 1
            swaps[model], got = ask(model, other)
            assert got == urls  # the same runtimes
            for url in urls.values():
                assert set(_load(url)["models"]) == {model}  # one at a time: the budget holds one
            assert {p.proc.pid: p.url for p in act.nodes} == pids  # no process started or stopped
        for _ in range(5):  # a few more observations: nothing churns with nothing to do
            pool.current()
            time.sleep(0.1)
        assert {p.proc.pid: p.url for p in act.nodes} == pids
        stop.set()
        sampler.join(5)
        budget = _load(urls["decode"])["memory_budget_bytes"]
        growth = {pid: peak[pid] - base[pid] for pid in pids}
        print(f"\nfirst A {first_a:.2f} s; swaps {', '.join(f'{m} {s:.2f} s' for m, s in swaps.items())}; runtimes up "
              f"{cold_s:.2f} s; peak RSS growth {[round(g / 2**20, 1) for g in growth.values()]} MiB, budget "
              f"{budget / 2**20:.1f} MiB")  # fmt: skip
        assert all(s < 0.5 * cold_s for s in swaps.values()), (swaps, cold_s)
        assert all(0 < g <= budget for g in growth.values()), (growth, budget)
    finally:
        stop.set()
        pool.close()
        act.close()
    assert not alive(seen), f"left running: {alive(seen)}"
