"""`pdserve bench burst`'s run with the defaults: what a user gets from `pdserve up --autoscale` on a store of
several models, with no [autoscaler], [gateway] or [node] table at all.

Lifecycle of the run: the store holds ``--defaults-models`` models (the bench's model, and copies of it
under ``NAME-b``, ``NAME-c`` ... imported once) -> `pdserve up --autoscale --model A --model B ...`
(benchmarks/service.py; the default plan, 1 prefill + 1 decode, every model placed at start) -> settled:
every model ready on a prefill and a decode node and the pool's standby runtime per role up, held 3 s
(the standby runtimes' CPU measured meanwhile: ~0 is the point) -> 2 warm-up requests -> onset:
``--defaults-clients`` closed-loop streaming chats of the first model for ``--defaults-burst-s`` ->
every request finished -> the service stopped.

Reported: onset -> new ready capacity (a node that did not have the model ready at onset has it ready) and
-> first request served by it; failed requests (must be 0); the peak of node processes and of serving
nodes (holding any model) against the machine's bound; every autoscaler decision line that named a bound
(``bounds: machine: ...``); TTFT p50/p99 of the burst.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from benchmarks.common import cpu_seconds
from benchmarks.loadgen import chat_stream, closed_loop, pct
from benchmarks.service import Sampler, UpService, count_ready, count_standby

ROLES = ("prefill", "decode")


def add_arguments(p) -> None:
    p.add_argument("--defaults-models", type=int, default=3, help="models in the store for the defaults run")
    p.add_argument("--defaults-clients", type=int, default=48, help="concurrent streaming chats of the burst")
    p.add_argument("--defaults-burst-s", type=float, default=15.0, help="how long the burst's clients keep asking")


def model_names(model: str, n: int) -> list[str]:
    return [model] + [f"{model}-{chr(ord('b') + i)}" for i in range(n - 1)]


def run(args, cfg, log_dir: str) -> dict:
    """The defaults run; -> its result (JSON-ready)."""
    from benchmarks.common import ensure_model

    models = model_names(args.model, args.defaults_models)
    locations = []
    for m in models:
        locations = ensure_model(cfg, m)
    svc = UpService(models, locations, log_dir, {}, {r: 1 for r in ROLES})
    sampler = None
    try:
        svc.start()
        ready_s = svc.wait_ready()
        svc.wait_for(lambda st: all(all(count_ready(st, m).get(r, 0) >= 1 for r in ROLES) for m in models)
                     and all(count_standby(st).get(r, 0) >= 1 for r in ROLES) and not st.get("queue_depth"),
                     args.settle_max_s, "every model on 1 prefill + 1 decode, a standby runtime per role")  # fmt: skip
        standby_cpu = _standby_cpu(svc, 3.0)
        t0 = time.monotonic()
        sampler = Sampler(svc, t0, interval_s=0.1, slow_every=2).start()
        standby_at_onset = count_standby(svc.status())
        procs = {**{f"{role} {url}": pid for url, (pid, role) in svc.nodes().items()}, "pdserve up (gateway)": svc.p.pid}
        cpu0, w0 = {k: cpu_seconds(pid) for k, pid in procs.items()}, time.monotonic()
        samples, onset, end = asyncio.run(_burst(svc, args))
        cpu = {k: round((cpu_seconds(pid) - cpu0[k]) / (time.monotonic() - w0), 2) for k, pid in procs.items()}
    finally:
        if sampler is not None:
            sampler.stop()
        rc = svc.stop()
    out = _result(args, models, sampler, samples, onset, end, ready_s, standby_at_onset, rc, log_dir)
    out["standby_cpu_cores_idle"] = standby_cpu
    out["cpu_cores_during_burst"] = cpu  # per process (those up at onset), mean over the burst
    return out


def _standby_cpu(svc: UpService, seconds: float) -> dict[str, float]:
    """Cores each standby runtime (no model held) used over `seconds` of an idle service: ~0 is the point."""
    pids = svc.node_pids()
    standby = [n["url"] for n in (svc.status() or {}).get("nodes", []) if not n.get("models") and n["url"] in pids]
    before = {u: cpu_seconds(pids[u]) for u in standby}
    time.sleep(seconds)
    return {u: round((cpu_seconds(pids[u]) - before[u]) / seconds, 3) for u in standby}


async def _burst(svc: UpService, args):
    import httpx

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:
        for _ in range(2):
            await chat_stream(client, svc.url, args.model, args.prompt, args.max_tokens)
        await asyncio.sleep(1.0)
        onset = time.monotonic()
        until = onset + args.defaults_burst_s

        async def one():
            return await chat_stream(client, svc.url, args.model, args.prompt, args.max_tokens)

        samples, _ = await closed_loop(one, args.defaults_clients, 10**6, until=until)
        return samples, onset, time.monotonic()


def _result(args, models, sampler: Sampler, samples, onset_abs, end_abs, ready_s, standby, rc, log_dir) -> dict:
    onset = onset_abs - sampler.t0
    old = sampler.ready_nodes(args.model, onset)
    ready = sampler.first(args.model, onset, old, "ready")
    served = sampler.first(args.model, onset, old, "active")
    decided = sampler.first_scale_up(args.model, onset)
    rel = lambda t: None if t is None else round(t - onset, 2)  # noqa: E731
    peak_nodes = max((len(r["nodes"]) for r in sampler.rows), default=0)
    peak_serving = max((sum(1 for n in r["nodes"].values() if any(v[0] in ("loading", "ready")
                                                                  for v in n["models"].values()))
                        for r in sampler.rows), default=0)  # fmt: skip
    bounds = []
    for row in sampler.rows:
        for key, (want, cur, reason, _) in (row.get("decisions") or {}).items():
            line = f"{key}: {cur} -> {want}: {reason}"
            if any(f"bounds: {b}" in reason for b in ("machine", "memory", "schedulable", "max")) and line not in bounds:
                bounds.append(line)
    ttft = [s.ttft for s in samples if s.ok and s.ttft is not None]
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    return {
        "mode": "defaults", "models": models, "clients": args.defaults_clients, "gateway_ready_s": round(ready_s, 2),
        "requests_total": len(samples), "requests_failed": sum(1 for s in samples if not s.ok),
        "errors": sorted({s.error for s in samples if s.error})[:10], "burst_s": round(end_abs - onset_abs, 1),
        "onset_to_scale_up_decision_s": rel(decided[0]) if decided else None,
        "scale_up_reason": decided[1] if decided else None,
        "onset_to_new_capacity_ready_s": rel(min(ready.values())) if ready else None,
        "onset_to_first_served_s": rel(min(served.values())) if served else None,
        "onset_to_ready_by_role_s": {r: rel(t) for r, t in ready.items()},
        "serving_at_onset": sorted(old), "standby_at_onset": standby, "peak_node_processes": peak_nodes,
        "peak_serving_nodes": peak_serving, "cpus": len(os.sched_getaffinity(0)), "bound_lines": bounds[:20],
        "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)), "up_exit_code": rc, "log_dir": log_dir,
        "timeline": sampler.compact(args.model),
    }  # fmt: skip


def table(run: dict) -> str:
    f = lambda x: "-" if x is None else f"{x}"  # noqa: E731
    lines = [f"defaults: `pdserve up --autoscale` on {len(run['models'])} models, {run['clients']} concurrent "
             f"streaming chats of {run['models'][0]} for {run['burst_s']} s on {run['cpus']} cores:",
             f"  onset -> decision {f(run['onset_to_scale_up_decision_s'])} s, -> new capacity ready "
             f"{f(run['onset_to_new_capacity_ready_s'])} s, -> first served by it {f(run['onset_to_first_served_s'])} s; "
             f"failed {run['requests_failed']}/{run['requests_total']}; TTFT p50 {f(run['ttft_p50_ms'])} ms, "
             f"p99 {f(run['ttft_p99_ms'])} ms",
             f"  node processes at most {run['peak_node_processes']}, serving nodes at most {run['peak_serving_nodes']}"
             f" (standby at onset: {run['standby_at_onset']}, idle CPU of each {run.get('standby_cpu_cores_idle')} cores)",
             f"  the decision: {run['scale_up_reason'] or '-'}"]  # fmt: skip
    lines.append(f"  cores used during the burst: {run.get('cpu_cores_during_burst')}")
    lines += [f"  bound: {b}" for b in run["bound_lines"][:6]]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - run through `pdserve bench burst --runs defaults`
    sys.exit("run it as: pdserve bench burst --runs defaults")
