"""Races around scale from zero and the warm pool's claims, on real processes.

`pdserve up --both 1 --autoscale` (both_max_replicas 4; the gateway's activator waking the loop) serving every
model of a store of four tiny chat models, each runtime's memory budget holding one model only; tiny-a
asked for first (placed on the plan's runtime; the pool then starts one standby runtime beside it):
- two requests held at once for two models at zero with one standby runtime: one model claims the
  standby, the other a runtime some other way (an idle model evicted, or a runtime started for it): both
  are answered (the design's alternative, a 503 with Retry-After at the hold's deadline, never came);
  each model claimed once, held by one runtime;
- eight requests held at once for one model at zero: one claim, one runtime holds it, all answered.
The pool and its node runtimes directly (no gateway):
- a claim racing a scale-down on the same runtime: model X unloads (draining a stream still running)
  while model Y is claimed onto that runtime, the only one: Y is loaded there once X has drained, the
  stream completes, and nothing is loaded twice.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from compute.node.launcher import Services
from tests.conftest import import_tiny_chat_models, tiny_llama_config, tiny_llama_tensors, write_hf_folder
from tests.procs import alive, children, kill_left
from tests.services import AUTH, TOKEN, admin_headers, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
openai = pytest.importorskip("openai")
MODELS = ("tiny-a", "tiny-b", "tiny-c", "tiny-d")
Q = [{"role": "user", "content": "What is the capital of France?"}]
KV_BLOCKS = 64
STREAM_TOKENS = 500  # (c): seconds of a stream on the larger tiny model, well within the unload's 30 s bound


@pytest.fixture(scope="module")
def four_models(tmp_path_factory, real_model_store):
    """Four tiny Llamas (different weights) with SmolLM2's tokenizer bundle in one store: (locations, GiB that
    holds one of them on a node and never two)."""
    from compute.modeling.loader import transient_bytes
    from compute.node.config import NodeConfig
    from compute.node.held import estimate_bytes
    from paramstore import ParamStore

    store = import_tiny_chat_models(tmp_path_factory, *real_model_store, MODELS, "races-store")
    with ParamStore(store) as ps:
        manifest = ps.manifest("tiny-a")
    node = NodeConfig(role="both", internal_token=TOKEN, kv_blocks=KV_BLOCKS, kernels="fixed")
    held = sum(estimate_bytes(manifest, "int8", node))
    need = held + transient_bytes(manifest, 1)  # what a load reserves; once ready, it holds about `held`
    return store.locations, (need + 0.5 * held) / 2**30  # room for one load, never for a second model


class Up:
    """`pdserve up` in the background; every process it starts is remembered and killed if left."""

    def __init__(self, tmp, locations: list[str], *args: str):
        os.makedirs(tmp / "logs", exist_ok=True)
        self.proc = Services(locations, None, str(tmp), TOKEN).start("up", ["up", "--log-dir", str(tmp / "logs"),
                                                                          *args])  # fmt: skip
        self.url, self.seen = self.proc.url, {}

    def status(self) -> dict:
        self.seen.update(children(self.proc.p.pid))
        assert self.proc.p.poll() is None, self.proc.log()[-3000:]
        return httpx.get(self.url + "/admin/status", headers=admin_headers(self.url), timeout=10).json()

    def pool(self) -> dict:
        return self.status()["supervisor"]["pool"]

    def close(self) -> None:
        try:
            self.proc.stop()
        finally:
            kill_left(self.seen)


def _holders(pool: dict, model: str) -> list[str]:
    return [r["url"] for r in pool["runtimes"] if r["models"].get(model) in ("loading", "ready")]


def _claims(pool: dict, model: str) -> list[dict]:
    return [c for c in pool["claims"] if c["model"] == model and not c["error"]]


def _ask_all(url: str, models: list[str], timeout: float) -> list[dict]:
    """One chat request per entry of `models`, all at once (threads): each {"model", "status", "text" | "error",
    "retry_after", "took"}; every thread joined within `timeout`."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    out: list[dict] = [{"model": m} for m in models]
    start = threading.Barrier(len(models))

    def ask(o: dict) -> None:
        start.wait(10)
        t0 = time.monotonic()
        try:
            r = client.chat.completions.create(model=o["model"], messages=Q, max_tokens=4, temperature=0,
                                               extra_body={"ignore_eos": True})  # fmt: skip
            o.update(status=200, text=r.choices[0].message.content, tokens=r.usage.completion_tokens)
        except openai.APIStatusError as e:
            o.update(status=e.status_code, error=e.message, retry_after=e.response.headers.get("retry-after"))
        except Exception as e:  # noqa: BLE001 - a hang or a broken connection: reported by the asserts
            o.update(status=None, error=repr(e))
        o["took"] = time.monotonic() - t0

    threads = [threading.Thread(target=ask, args=(o,), daemon=True) for o in out]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 10
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"requests still open after {timeout + 10:g} s: {out}"
    return out


def _answered_or_clear_503(results: list[dict]) -> None:
    for o in results:
        if o["status"] == 503:  # the design's other outcome: the hold's deadline, said so, with Retry-After
            assert o["retry_after"] and "not loaded" in o["error"], o
        else:
            assert o["status"] == 200 and o["tokens"] == 4, o


def test_held_requests_for_models_at_zero_claim_once_each_and_are_answered(tmp_path, four_models):
    locations, budget_gb = four_models
    conf = tmp_path / "pdserve.toml"
    conf.write_text(f'[node]\nmemory_gb = {budget_gb:.6f}\nkernels = "fixed"\n[autoscaler]\npool_size = 1\n'
                    "tick_s = 0.2\nboth_max_replicas = 4\n[gateway]\nqueue_timeout_s = 90\n")  # fmt: skip
    up = Up(tmp_path, locations, "--both", "1", "--autoscale", "--kv-blocks", str(KV_BLOCKS), "--config",
            str(conf))  # room for a runtime per model: each held request claims a runtime, never evicts another's
    try:
        up.proc.wait_ready(240, path="/health")
        _answered_or_clear_503(_ask_all(up.url, ["tiny-a"], 90))  # placed on the first runtime; a standby follows

        def settled():  # tiny-a on one runtime, one standby runtime beside it, nothing loading
            try:
                p = up.pool()
            except httpx.HTTPError:
                return None  # not listening yet
            states = sorted(r["state"] for r in p["runtimes"])
            return len(_holders(p, "tiny-a")) == 1 and states == ["ready", "standby"] and p
        wait_for(settled, 240, "tiny-a placed and one standby runtime", every=0.2)

        # (a) two models at zero, one standby runtime, two requests held at once
        t0 = time.monotonic()
        results = _ask_all(up.url, ["tiny-b", "tiny-c"], 90)
        took = time.monotonic() - t0
        _answered_or_clear_503(results)
        assert all(o["status"] == 200 for o in results), results  # 90 s hold: room for a runtime to start
        p = up.pool()
        for m in ("tiny-b", "tiny-c"):
            assert len(_claims(p, m)) == 1, (m, p["claims"])
            assert len(_holders(p, m)) <= 1, (m, p["runtimes"])  # (one answered may be swapped out already)
        how = {m: _claims(p, m)[0]["why"] for m in ("tiny-b", "tiny-c")}
        assert "standby runtime" in how.values(), how
        print(f"\n(a) two models from zero, one standby: answered in {took:.1f} s; claims: {how}")

        # (b) eight requests held at once for one model at zero: one claim
        done = p["claims_done"]
        results = _ask_all(up.url, ["tiny-d"] * 8, 90)
        _answered_or_clear_503(results)
        assert all(o["status"] == 200 for o in results), results
        p = up.pool()
        assert len(_claims(p, "tiny-d")) == 1 and p["claims_done"] == done + 1, p["claims"]
        assert len(_holders(p, "tiny-d")) == 1, p["runtimes"]
        loads = [httpx.get(r["url"] + "/load", auth=AUTH, timeout=5).json() for r in p["runtimes"]
                 if r["state"] != "starting"]  # fmt: skip
        assert sum("tiny-d" in (ld.get("models") or {}) for ld in loads) == 1, loads
        print(f"(b) 8 held requests for tiny-d: 1 claim ({_claims(p, 'tiny-d')[0]['why']}), "
              f"answered in {max(o['took'] for o in results):.1f} s")
        up.status()  # still up
    finally:
        up.close()
    assert not alive(up.seen), f"left running: {alive(up.seen)}"


def test_held_requests_for_a_model_at_zero_claim_one_runtime_per_role_under_the_autoscaler(tmp_path, four_models):
    """`pdserve up --prefill 1 --decode 1 --autoscale`: eight requests held at once for a model at zero wake the
    control loop (each hold calls activate); the policy places one replica per role: one claim per role."""
    locations, _ = four_models
    conf = tmp_path / "pdserve.toml"
    conf.write_text('[node]\nkernels = "fixed"\n[autoscaler]\npool_size = 1\ntick_s = 0.2\n'
                    "[gateway]\nqueue_timeout_s = 90\n")  # fmt: skip
    up = Up(tmp_path, locations, "--prefill", "1", "--decode", "1", "--autoscale", "--kv-blocks", str(KV_BLOCKS),
            "--config", str(conf))  # fmt: skip
    try:
        up.proc.wait_ready(240, path="/health")
        wait_for(lambda: sorted(r["state"] for r in up.pool()["runtimes"]) == ["standby", "standby"], 240,
                 "one standby runtime per role", every=0.2)  # fmt: skip
        results = _ask_all(up.url, ["tiny-b"] * 8, 90)
        _answered_or_clear_503(results)
        assert all(o["status"] == 200 for o in results), results
        p = up.pool()
        for role in ("prefill", "decode"):
            mine = [c for c in _claims(p, "tiny-b") if c["role"] == role]
            assert len(mine) == 1, (role, p["claims"], p["desired"])
            assert len([r for r in p["runtimes"] if r["role"] == role and r["models"].get("tiny-b")]) == 1, p
        print(f"\n8 held requests under the autoscaler: one claim per role, answered in "
              f"{max(o['took'] for o in results):.1f} s; desired {p['desired']}")
    finally:
        up.close()
    assert not alive(up.seen), f"left running: {alive(up.seen)}"


def _stream(url: str, model: str, max_tokens: int, out: dict) -> None:
    """One request streamed from the node at `url` (thread target): out["first"] set at its first token,
    out["tokens"] and out["finish"] at its end (or out["error"])."""
    body = {"request_id": f"race-{model}-{time.monotonic_ns()}", "model": model, "prompt_token_ids": [5, 17, 33, 90],
            "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    import json

    toks, finish = [], None
    try:
        with httpx.stream("POST", url + "/internal/generate", json=body, auth=AUTH, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                msg = json.loads(line)
                toks += msg["token_ids"]
                finish = msg.get("finish_reason") or finish
                out.setdefault("first", time.monotonic())
        out.update(tokens=len(toks), finish=finish)
    except Exception as e:  # noqa: BLE001 - reported by the test's asserts
        out["error"] = repr(e)


def test_a_claim_racing_an_unload_on_the_same_runtime_loads_the_model_once(tmp_path):
    """Two runtimes, X streaming on R1 and Z on R2 (no idle model: the ranking ties and R1 comes first). X is
    scaled to 0 (its unload drains the stream still running) and Y claimed in the same breath: R1, draining X,
    must not take Y behind the pool's back after the claim went elsewhere. Y is held by one runtime at every
    observation; the streams complete."""
    from autoscaler.local import LocalActuator, LocalConfig
    from autoscaler.pool import PoolConfig, RuntimePool
    from paramstore import ParamStore, StoreConfig

    cfg = tiny_llama_config(layers=6, hidden=384, ffn=1536, heads=4, kv_heads=2, vocab=8192)  # streams of seconds
    cfg["eos_token_id"], cfg["max_position_embeddings"] = None, 2048
    store = StoreConfig.local_default(str(tmp_path / "store"), k=4, m=2)
    with ParamStore(store) as ps:
        for seed, name in enumerate(("x", "y", "z")):
            ps.import_model(write_hf_folder(tmp_path / name, cfg, tiny_llama_tensors(cfg, seed=seed)), name, dtype="fp32")
    act = LocalActuator(LocalConfig(model=None, store=list(store.locations), internal_token=TOKEN, threads=1,
                                    kv_blocks=160, weights="fp32", log_dir=str(tmp_path / "logs"), ready_timeout_s=180,
                                    stop_timeout_s=5, extra_args=("--kernels", "fixed")))  # fmt: skip
    pool = RuntimePool(act, TOKEN, PoolConfig(pool_size=0, min_runtimes={"both": 2}, max_runtimes={"both": 2}),
                       roles=("both",))  # fmt: skip
    seen: dict[int, str] = {}
    streams: dict[str, dict] = {"x": {}, "z": {}}
    threads = []
    try:
        wait_for(lambda: (pool.current() or True) and [r["state"] for r in pool.status()["runtimes"]]
                 == ["standby", "standby"], 180, "two standby runtimes", every=0.2)  # fmt: skip
        seen.update({p.proc.pid: str(p.proc.pid) for p in act.nodes})
        r1, r2 = sorted(r["url"] for r in pool.status()["runtimes"])
        for url, model in ((r1, "x"), (r2, "z")):  # placed by hand on the runtimes the test chose
            r = httpx.post(url + "/internal/models/load", json={"model": model}, auth=AUTH, timeout=30)
            assert r.status_code == 202, r.text
        pool.place(["x", "z"], {"both": 1})
        wait_for(lambda: all((pool.current().get((m, "both")) or [None])[0] and pool.current()[(m, "both")][0].ready
                             for m in ("x", "z")), 120, "x on R1, z on R2", every=0.2)  # fmt: skip
        for url, model in ((r1, "x"), (r2, "z")):
            threads.append(threading.Thread(target=_stream, args=(url, model, STREAM_TOKENS, streams[model]), daemon=True))
            threads[-1].start()
        wait_for(lambda: all("first" in s or "error" in s for s in streams.values()), 60, "both streams flowing")
        pool.current()  # observed busy: neither runtime has an idle model

        pool.scale(("x", "both"), 0)  # the unload drains x's stream on R1
        wait_for(lambda: httpx.get(r1 + "/load", auth=AUTH, timeout=5).json()["models"]["x"]["state"]
                 == "draining", 10, "x draining on R1", every=0.02)  # fmt: skip
        assert all("tokens" not in s for s in streams.values()), streams  # still streaming: the race is on
        t0 = time.monotonic()  # the node's side of it: a load that cannot start within wait_s is refused, and not done
        r = httpx.post(r1 + "/internal/models/load", json={"model": "y", "wait_s": 0.3}, auth=AUTH, timeout=10)
        assert r.status_code == 503 and "unloading x" in r.json()["detail"] and time.monotonic() - t0 < 2, r.text
        r = httpx.post(r1 + "/internal/models/load", json={"model": "y", "wait_s": "soon"}, auth=AUTH, timeout=10)
        assert r.status_code == 400 and "wait_s" in r.json()["detail"], r.text
        pool.scale(("y", "both"), 1)  # the claim, while R1 drains
        most = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the loop's ticks, until the streams end and things settle
            pool.current()
            holders = [u for u in (r1, r2) if "y" in (httpx.get(u + "/load", auth=AUTH, timeout=5).json()
                                                       .get("models") or {})]  # fmt: skip
            most = max(most, len(holders))
            if all("tokens" in s or "error" in s for s in streams.values()) and holders and not pool._unloading:
                settle = time.monotonic() + 3.0  # a load that was waiting behind the drain has had time to land
                while time.monotonic() < settle:
                    pool.current()
                    most = max(most, sum("y" in (httpx.get(u + "/load", auth=AUTH, timeout=5).json()
                                                 .get("models") or {}) for u in (r1, r2)))  # fmt: skip
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        st = pool.status()
        claims = [c for c in st["claims"] if c["model"] == "y" and not c["error"]]
        print(f"\nclaim racing an unload: claims of y {[(c['url'] == r1 and 'R1' or 'R2', c['why']) for c in claims]}, "
              f"most runtimes holding y at once: {most}")
        assert most == 1, (most, st["runtimes"], st["claims"])
        assert len(claims) == 1, st["claims"]
        assert "x" not in (httpx.get(r1 + "/load", auth=AUTH, timeout=5).json().get("models") or {})
        for s in streams.values():  # x's drain waited for its stream (within the unload's bound)
            assert s.get("tokens") == STREAM_TOKENS and s["finish"] == "length", streams
    finally:
        for t in threads:
            t.join(60)
        pool.close()
        act.close()
    assert not alive({p: s for p, s in children(os.getpid()).items() if p in seen}), "a runtime left running"
