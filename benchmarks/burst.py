"""`pdserve bench burst`: autoscaling under a 10x burst, real model, local actuator.

    pdserve bench burst [--store URL ...] [--model smollm2] [--rate 0.2] [--burst-x 10] [--steady-s 30]
                        [--burst-s 30] [--after-max-s 100] [--max-replicas 2] [--out bench-results/burst.json]

What runs is `pdserve up --prefill 1 --decode 1 --autoscale` in this process — the gateway, the
LocalActuator starting `pdserve node` processes (1 torch thread each), the ControlLoop with
autoscaler/up.py's observe() — but with an AutoscalerConfig sized for a seconds-scale demo
(``demo_config``: 0.5 s ticks, 10 s stable / 2 s panic windows, 8 s cooldown, max 2 per role on
this 2-core box). An open-loop client (arrivals at a fixed rate, each a streaming chat of
``--max-tokens`` tokens) sends: ``--rate`` req/s for ``--steady-s``, ``--burst-x`` times that for
``--burst-s``, then ``--rate`` again until the replicas are back to 1 + 1 (+ 5 s), at most
``--after-max-s``.

Reported (table, JSON, PNG): seconds from burst onset to the first node started by the burst
being ready, and to the first token of the first request routed to such a new node; TTFT
p50/p99 of the requests that started before / during / after the burst; replicas per role over
time (plot: asked and ready, with the requests' TTFT below); requests failed (must be 0);
seconds from the end of the burst until the scale-down began and until it was back to 1 + 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import tempfile
import threading
import time
from contextlib import aclosing

from benchmarks.common import ensure_model
from benchmarks.loadgen import Sample, chat_stream, pct

PROMPT = "Give me one tip for learning Python."
ROLES = ("prefill", "decode")


def demo_config(max_replicas: int = 2):
    """Knobs for a seconds-scale demo on a small CPU box (defaults are sized for minutes and GPUs)."""
    from autoscaler import AutoscalerConfig

    return AutoscalerConfig(
        tick_s=0.5,
        target_queued_prompt_tokens_per_replica=64,  # ~2 chat prompts waiting per prefill node
        target_running_streams_per_replica=2,  # a 1-thread CPU decode node slows down per step beyond ~2 streams
        target_queue_wait_p99_s=0.0,  # off: the gateway's p99 is over its last 256 waits, not a time window
        prefill_min_replicas=1, prefill_max_replicas=max_replicas,
        decode_min_replicas=1, decode_max_replicas=max_replicas,
        stable_window_s=10.0, panic_window_s=2.0, panic_threshold=2.0,
        scale_down_delay_s=20.0,  # longer than a node takes to start on a busy 2-core box (10-20 s): no flapping
        max_scale_down_fraction=0.5, max_scale_down_step=1,
    )  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="smollm2", help="model in the store (imported from the real GGUF if absent)")
    p.add_argument("--rate", type=float, default=0.2, help="steady arrivals per second")
    p.add_argument("--burst-x", type=float, default=10.0, help="burst rate = rate x this")
    p.add_argument("--steady-s", type=float, default=30.0)
    p.add_argument("--burst-s", type=float, default=30.0)
    p.add_argument("--after-max-s", type=float, default=100.0, help="low load after the burst, at most this long")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--max-replicas", type=int, default=2, help="per role")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--log-dir", default=None, help="node logs (default: a temporary folder)")
    p.add_argument("--out", default="bench-results/burst.json")
    p.add_argument("--plot", default="bench-results/burst.png")


class Service:
    """`pdserve up --prefill 1 --decode 1 --autoscale`, in threads of this process."""

    def __init__(self, args, locations: list[str], log_dir: str):
        import uvicorn

        from autoscaler.local import LocalActuator, LocalConfig
        from autoscaler.up import registry_hooks
        from compute.node.launcher import free_port
        from gateway.app import create_app
        from gateway.main import build_gateway

        token = secrets.token_urlsafe(24)
        os.environ["PDSERVE_INTERNAL_TOKEN"] = token
        for k in ("PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEY"):
            os.environ.pop(k, None)
        port = free_port()
        self.gw = build_gateway(args.model, locations, port=port, max_running=128, max_queue=512,
                                queue_timeout_s=120.0)  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.loop = asyncio.new_event_loop()
        self.served: list[tuple[float, tuple[str, ...]]] = []  # (first token time, route) per request
        self._wrap_relay()
        self.ready_at: dict[str, float] = {}  # node url -> when the actuator saw it ready
        hooks = registry_hooks(self.gw, self.loop)
        on_ready = hooks["on_ready"]

        def ready(node):
            self.ready_at[node.url] = time.monotonic()
            on_ready(node)

        hooks["on_ready"] = ready
        self.actuator = LocalActuator(LocalConfig(model=args.model, store=locations, internal_token=token, threads=1,
                                                  kv_blocks=1024, log_dir=log_dir), **hooks)  # fmt: skip
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.gw), host="127.0.0.1", port=port,
                                                    log_level="warning", loop="asyncio"))  # fmt: skip
        self.thread = threading.Thread(target=self._serve, name="gateway", daemon=True)
        self.control = None
        self.args = args

    def _wrap_relay(self) -> None:
        """Note which nodes served each request's first token (for 'first request on a new node')."""
        relay, run = self.gw.relay, self.gw.relay.run

        async def traced(req):
            first = True
            async with aclosing(run(req)) as stream:
                async for toks, reason in stream:
                    if first and toks:
                        first = False
                        self.served.append((time.monotonic(), req.route.nodes() if req.route else ()))
                    yield toks, reason

        relay.run = traced

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> None:
        import httpx

        from autoscaler.up import autoscale_in_process

        self.thread.start()
        for role in ROLES:
            self.actuator.scale(role, 1)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError("the first prefill/decode pair was not ready in 180 s")
        self.control = autoscale_in_process(self.gw, self.actuator, {r: 1 for r in ROLES},
                                            demo_config(self.args.max_replicas))  # fmt: skip

    def close(self) -> None:
        if self.control is not None:
            self.control.stop()
        self.actuator.close()
        self.server.should_exit = True
        self.thread.join(10)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("pdserve.autoscaler").setLevel(logging.INFO)
    from paramstore.config import store_config

    locations = ensure_model(store_config(args), args.model)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-burst-")
    svc = Service(args, locations, log_dir)
    timeline: list[dict] = []
    stop_sampling = threading.Event()
    try:
        t_start = time.monotonic()
        svc.start()
        print(f"first pair ready in {time.monotonic() - t_start:.1f} s; node logs in {log_dir}", file=sys.stderr)
        t0 = time.monotonic()
        sampler = threading.Thread(target=_sample, args=(svc, t0, timeline, stop_sampling), daemon=True)
        sampler.start()
        samples, marks = asyncio.run(_drive(svc, args, t0, timeline))
    finally:
        stop_sampling.set()
        svc.close()
    report = _report(args, svc, samples, marks, timeline, t0)
    print(_table(report))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    if _plot(report, samples, marks, timeline, t0, args.plot):
        print(f"wrote {args.plot}")
    return 1 if report["requests_failed"] else 0


def _sample(svc: Service, t0: float, timeline: list[dict], stop: threading.Event) -> None:
    """Every 0.5 s: nodes per role (asked = running or starting, ready) and routable at the gateway."""
    while not stop.wait(0.5):
        try:
            cur = svc.actuator.current()
            views = svc.gw.registry.views()
        except Exception as e:  # noqa: BLE001 - a missed sample is a gap in the plot
            logging.getLogger("pdserve.bench").debug("sample failed: %s", e)
            continue
        row = {"t": round(time.monotonic() - t0, 2), "queue_depth": svc.gw.admission.waiting,
               "running": svc.gw.admission.running}  # fmt: skip
        for r in ROLES:
            row[f"{r}_asked"] = len(cur.get(r, []))
            row[f"{r}_ready"] = sum(1 for n in cur.get(r, []) if n.ready)
            row[f"{r}_routable"] = sum(1 for v in views if v.role == r and v.routable)
        d = svc.control.last_decision if svc.control else None
        if d is not None:
            row["reason"] = d.reason
        timeline.append(row)


async def _drive(svc: Service, args, t0: float, timeline: list[dict]):
    """Open-loop arrivals: steady, burst, steady until back at 1 + 1 (+5 s); -> (samples, phase marks)."""
    import httpx

    samples: list[tuple[str, Sample]] = []
    tasks: list[asyncio.Task] = []
    marks: dict[str, float] = {}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0), limits=limits) as client:

        async def one(phase: str):
            s = await chat_stream(client, svc.url, args.model, args.prompt, args.max_tokens)
            samples.append((phase, s))

        async def phase(name: str, rate: float, until, max_s: float):
            start = time.monotonic()
            marks[name] = start
            k = 0
            while time.monotonic() - start < max_s and not until():
                tasks.append(asyncio.create_task(one(name)))
                k += 1
                await asyncio.sleep(max(0.0, start + k / rate - time.monotonic()))
            marks[name + "_end"] = time.monotonic()

        for _ in range(2):  # warm-up, not counted
            await chat_stream(client, svc.url, args.model, args.prompt, args.max_tokens)
        never = lambda: False
        await phase("before", args.rate, never, args.steady_s)
        marks["nodes_at_burst"] = list(svc.gw.registry.nodes)  # type: ignore[assignment]
        await phase("during", args.rate * args.burst_x, never, args.burst_s)
        back: dict[str, float] = {}

        def settled() -> bool:
            last = timeline[-1] if timeline else None
            if last and last["t"] + t0 > marks["during_end"] and all(last[f"{r}_asked"] == 1 for r in ROLES):
                back.setdefault("t", time.monotonic())
            return "t" in back and time.monotonic() - back["t"] > 5.0

        await phase("after", args.rate, settled, args.after_max_s)
        print(f"load done; waiting for {sum(not t.done() for t in tasks)} requests in flight", file=sys.stderr)
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    return samples, marks


def _report(args, svc: Service, samples, marks, timeline, t0) -> dict:
    burst0, burst1 = marks["during"], marks["during_end"]
    old = set(marks["nodes_at_burst"])
    new_ready = sorted(t for url, t in svc.ready_at.items() if url not in old and t >= burst0)
    new_served = sorted(t for t, route in svc.served if t >= burst0 and any(u not in old for u in route))
    peak = {r: max([row[f"{r}_asked"] for row in timeline] or [0]) for r in ROLES}

    def first_after(pred, after):
        for row in timeline:
            if row["t"] + t0 >= after and pred(row):
                return row["t"] + t0
        return None

    total = lambda row: sum(row[f"{r}_asked"] for r in ROLES)
    at_end = next((total(row) for row in timeline if row["t"] + t0 >= burst1), 2)
    if at_end > 2:  # still scaled up when the burst ended: when did it start coming down, and get back?
        down_began = first_after(lambda row: total(row) < at_end, burst1)
        back = first_after(lambda row: total(row) == 2, burst1)
    else:  # already back at 1 + 1 when the burst ended (e.g. a node flapped down during it)
        down_began = back = burst1
    phases = {}
    for name in ("before", "during", "after"):
        ss = [s for p, s in samples if p == name]
        ok = [s for s in ss if s.ok]
        ttft = [s.ttft for s in ok if s.ttft is not None]
        ms = lambda x: None if x is None else round(x * 1000, 1)
        phases[name] = {"requests": len(ss), "failed": len(ss) - len(ok), "ttft_p50_ms": ms(pct(ttft, 50)),
                        "ttft_p99_ms": ms(pct(ttft, 99)),
                        "seconds": round(marks[name + "_end"] - marks[name], 1),
                        "rate_per_s": round(args.rate * (args.burst_x if name == "during" else 1), 2)}  # fmt: skip
    rel = lambda t, base: None if t is None else round(t - base, 2)
    cfg = demo_config(args.max_replicas)
    return {
        "model": args.model, "max_tokens": args.max_tokens, "prompt": args.prompt, "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(), "autoscaler_config": {k: getattr(cfg, k) for k in cfg.__slots__},
        "phases": phases,
        "requests_total": len(samples), "requests_failed": sum(1 for _, s in samples if not s.ok),
        "errors": sorted({s.error for _, s in samples if s.error})[:10],
        "burst_to_new_node_ready_s": rel(new_ready[0] if new_ready else None, burst0),
        "burst_to_first_request_on_new_node_s": rel(new_served[0] if new_served else None, burst0),
        "requests_on_new_nodes": len(new_served),
        "peak_replicas": peak, "replicas_at_burst_end": at_end,
        "scale_down_began_after_burst_s": rel(down_began, burst1),
        "back_to_baseline_after_burst_s": rel(back, burst1),
        "burst_window_s": [round(burst0 - t0, 2), round(burst1 - t0, 2)],
        "timeline": timeline,
        "requests": [{"phase": p, "start_s": round(s.start - t0, 3), "ok": s.ok, "ttft_ms": None if s.ttft is None
                      else round(s.ttft * 1000, 1), "tokens": s.tokens} for p, s in samples],
    }


def _table(r: dict) -> str:
    f = lambda x: "-" if x is None else f"{x}"
    lines = [f"{'phase':<8} {'req/s':>6} {'secs':>6} {'requests':>8} {'failed':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}"]
    lines.append("-" * len(lines[0]))
    for name, p in r["phases"].items():
        lines.append(f"{name:<8} {p['rate_per_s']:>6} {p['seconds']:>6} {p['requests']:>8} {p['failed']:>6} "
                     f"{f(p['ttft_p50_ms']):>12} {f(p['ttft_p99_ms']):>12}")  # fmt: skip
    lines += [
        "",
        f"burst onset -> first new node ready:             {f(r['burst_to_new_node_ready_s'])} s",
        (f"burst onset -> first request served by a new node: {f(r['burst_to_first_request_on_new_node_s'])} s"
         f"  ({r['requests_on_new_nodes']} requests had a new node on their route)"),
        "peak replicas:                                    "
        + ", ".join(f"{k} {v}" for k, v in r["peak_replicas"].items()),
        f"burst end -> scale-down began:                    {f(r['scale_down_began_after_burst_s'])} s",
        f"burst end -> back to 1 prefill + 1 decode:        {f(r['back_to_baseline_after_burst_s'])} s",
        f"requests failed:                                  {r['requests_failed']} of {r['requests_total']}",
    ]  # fmt: skip
    return "\n".join(lines)


def _plot(report, samples, marks, timeline, t0, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    b0, b1 = report["burst_window_s"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    ts = [row["t"] for row in timeline]
    for role, color in zip(ROLES, ("tab:blue", "tab:orange")):
        ax.step(ts, [row[f"{role}_asked"] for row in timeline], where="post", color=color, label=f"{role} asked")
        ax.step(ts, [row[f"{role}_routable"] for row in timeline], where="post", color=color, linestyle="--",
                label=f"{role} routable")  # fmt: skip
    for a in (ax, ax2):
        a.axvspan(b0, b1, color="tab:red", alpha=0.1, label="burst" if a is ax else None)
    ax.set_ylabel("replicas")
    ax.set_ylim(0, max(report["peak_replicas"].values()) + 0.5)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"pdserve bench burst: {report['model']}, {report['phases']['during']['rate_per_s']} req/s burst")
    ok = [(s.start - t0, s.ttft) for _, s in samples if s.ok and s.ttft is not None]
    bad = [s.start - t0 for _, s in samples if not s.ok]
    ax2.scatter([x for x, _ in ok], [y for _, y in ok], s=6, label="TTFT (s)")
    if bad:
        ax2.scatter(bad, [0] * len(bad), marker="x", color="red", label="failed")
    ax2.set_ylabel("TTFT (s) by request start")
    ax2.set_xlabel("seconds")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
