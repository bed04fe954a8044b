"""`pdserve up`: the default local service — nodes as local processes, the gateway in this process.

It composes nodes, gateway and the local actuator, so it lives at the top of the stack (autoscaler).

Lifecycle: parse -> internal token (generated unless $PDSERVE_INTERNAL_TOKEN[_FILE]) and admin key
(generated unless $PDSERVE_ADMIN_KEY[_FILE] or --open-admin; written 0600 for `pdserve status`:
gateway/keyfile.py, removed at stop) -> gateway
built from the store (tokenizer, chat template) -> the local actuator starts the plan's node
runtimes, empty (standby); each registers with the gateway once up -> the warm pool
(autoscaler/pool.py) places the listed models (``--model A --model B``, else the gateway's
default) on them, never runs fewer runtimes per role than the plan's (standby when nothing is held:
a pool that cannot hold every model swaps models on them) and keeps ``pool_size`` standby ones
within {role}_max_replicas runtimes -> the control loop runs
always (``--autoscale``: the [autoscaler] bounds; without: the plan's counts), and the gateway's
activator (a request for a model no node holds) wakes it -> serve until SIGTERM/SIGINT (Ctrl-C)
-> the gateway finishes its open requests (bounded) -> every runtime it started is drained
(bounded) and stopped -> one line says what was stopped. Runtimes that exit on their own
meanwhile are restarted by the actuator (backing off) and the pool places their models again;
they end with this process even if it is SIGKILLed (compute/node/lifeline.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import sys
import threading
import time

IMPORT_NICE = 10  # the runtimes' heavy imports yield the CPU to the nodes that serve (a refill under load)
STOP_GRACE_S = 30.0  # on SIGTERM/SIGINT: the gateway's open requests may finish for this long
NODE_DRAIN_S = 10.0  # then each node may drain for this long before SIGTERM (stop_timeout_s, then SIGKILL)
MAX_THREADS = 4  # a colocated node's default threads: the usable cores up to this (measured on 2 cores only)


def add_arguments(p) -> None:
    """Flags left unset fall back to the config file ([gateway], [node], [store], [autoscaler]), then defaults."""
    from paramstore.config import add_store_arguments

    p.add_argument("--model", action="append", default=None, metavar="NAME[@vN]",
                   help="a model to serve, placed at start (repeat; default: [gateway] models / model, else smollm2)")
    add_store_arguments(p)
    p.add_argument("--host", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gateway port (default 8000)")
    p.add_argument("--prefill", type=int, default=None, help="prefill nodes: a prefill/decode split (with --decode)")
    p.add_argument("--decode", type=int, default=None, help="decode nodes: a prefill/decode split (with --prefill)")
    p.add_argument("--both", type=int, default=None, help="colocated nodes, prefill and decode in one (default 1: "
                   "on one machine it serves 1.35-1.5x the 1 + 1 split's tokens/s, docs/benchmarks.md)")
    p.add_argument("--kv-transport", choices=["nixl", "tcp"], help="default: [node] kv_transport, else tcp")
    p.add_argument("--threads-per-node", type=int, help="default: [node] threads, else the usable cores (at most "
                   f"{MAX_THREADS}) for colocated nodes, 1 for a split")
    p.add_argument("--kv-blocks", type=int, help="per node (default: [node] kv_blocks, else 1024)")
    p.add_argument("--step", choices=["auto", "eager", "graph"], help="the nodes' decode steps (default: [node] step, "
                   "else auto: graph on the CPU, compiled ahead of time, built once per machine class after ready in a "
                   "builder process: docs/engine.md)")
    p.add_argument("--open-admin", action="store_true",
                   help="no admin key: leave /admin/* open to local processes (default: a key is generated)")
    p.add_argument("--autoscale", action="store_true", help="run the autoscaling loop (local actuator, [autoscaler])")
    p.add_argument("--log-dir", default=".pdserve/logs")
    p.add_argument("--log-level", default="info")


def default_threads(roles: dict[str, int]) -> int:
    """Threads per node where neither the flag nor [node] threads says: a colocated node takes the usable cores
    (at most MAX_THREADS: a small model's step gains little past them, and a bigger machine runs more nodes);
    a split's nodes take one each (its 1 + 1 on 2 cores)."""
    from .capacity import machine

    if "both" not in roles:
        return 1
    return max(1, min(MAX_THREADS, int(machine().cores + 1e-9)))


def local_service(args, token: str, admin_key: str | None = None, roles: dict[str, int] | None = None):
    """(gateway, LocalConfig, AutoscalerConfig) from flags > environment > the config file > defaults."""
    from compute.node.config import NIXL_UNBOUNDED, nixl_trusted_env
    from gateway.main import gateway_config, open_gateway
    from paramstore.config import ConfigError, config_path, read_config, store_config

    from .local import LocalConfig
    from .main import node_args, policy_config

    path = config_path(args.config)
    tables = read_config(path)
    policy = policy_config(tables, path)  # every table checked before the store is opened
    store_cfg = store_config(args, tables=tables)
    admin = {"admin_key": admin_key} if admin_key else {}
    node = tables.get("node", {})
    trusted = node.get("nixl_trusted_fabric") is True or nixl_trusted_env()
    if (args.kv_transport or node.get("kv_transport")) == "nixl" and not trusted:
        raise ConfigError(NIXL_UNBOUNDED)  # before anything starts: every node would refuse it
    gw = open_gateway(gateway_config(args, tables, path, store=list(store_cfg.locations), **admin), store_cfg)
    local = LocalConfig(model=None, store=list(store_cfg.locations), internal_token=token, import_nice=IMPORT_NICE,
                        kv_transport=args.kv_transport or node.get("kv_transport", "tcp"),
                        threads=args.threads_per_node or node.get("threads") or default_threads(roles or {}),
                        kv_blocks=args.kv_blocks or node.get("kv_blocks", 1024), weights=node.get("weights", "int8"),
                        log_dir=args.log_dir, cache_dir=os.environ.get("PDSERVE_CACHE_DIR") or node.get("cache_dir"),
                        extra_args=(*node_args(args, path), *(["--step", args.step] if args.step else [])))  # fmt: skip
    return gw, local, policy


def start_models(gw) -> list[str]:
    """The models placed at start: the listed ones (--model, [gateway] models / model), else smollm2 (the
    others the store holds are placed when a request asks for them)."""
    return list(getattr(gw.config, "models", None) or [gw.config.model or "smollm2"])


def fixed_bounds(config, roles: dict[str, int]):
    """Without --autoscale: the policy keeps each model at the plan's counts (min = max = the plan)."""
    kw = {}
    for role, n in roles.items():
        kw |= {f"{role}_min_replicas": n, f"{role}_max_replicas": max(n, 1)}
    return dataclasses.replace(config, **kw)


def plan(args) -> dict[str, int]:
    """The runtimes per role: one colocated node by default, a split when --prefill or --decode is given."""
    if args.both is not None and (args.prefill is not None or args.decode is not None):
        raise ValueError("use either --both N or --prefill N --decode M")
    if args.prefill is None and args.decode is None:
        return {"both": 1 if args.both is None else args.both}
    return {"prefill": 1 if args.prefill is None else args.prefill, "decode": 1 if args.decode is None else args.decode}


def main(args) -> int:
    import uvicorn

    from compute.node.lifeline import hold
    from gateway import keyfile
    from gateway.app import create_app
    from gateway.main import announce
    from paramstore.config import env_secret

    from .local import LocalActuator
    from .pool import RuntimePool, pool_config

    stop = _StopSignals().install()  # first: a signal while starting up stops what was started
    hold(grace_s=STOP_GRACE_S + NODE_DRAIN_S + 20)  # started by a launcher (tests): end with it, cleaning up
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    roles = plan(args)
    token = env_secret("PDSERVE_INTERNAL_TOKEN") or secrets.token_urlsafe(24)  # or $PDSERVE_INTERNAL_TOKEN_FILE
    os.environ["PDSERVE_INTERNAL_TOKEN"] = token
    made_key = None if env_secret("PDSERVE_ADMIN_KEY") or args.open_admin else secrets.token_urlsafe(24)
    gw, local, auto = local_service(args, token, made_key, roles)
    if made_key:
        print(f"pdserve up: admin key in {keyfile.write(gw.config.port, made_key)} (for `pdserve status`)",
              file=sys.stderr, flush=True)  # fmt: skip
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    actuator = LocalActuator(local, **registry_hooks(gw, loop))
    auto = auto if args.autoscale else fixed_bounds(auto, roles)
    pool = RuntimePool(actuator, token, pool_config(auto, tuple(roles), floors=roles), tuple(roles))
    stop.actuator = actuator
    gw.supervisor = lambda: {**actuator.status(), "pool": pool.status()}
    control = None
    models = start_models(gw)
    try:
        if stop.names:
            return 0
        for role, n in roles.items():
            actuator.scale(role, n)  # the plan's runtimes, standby; the pool places the models on them
        pool.place(models, roles)
        control = autoscale_in_process(gw, pool, roles, auto)
        gone = actuator.on_gone  # a runtime that died: the next tick (the pool's claim of a standby) now
        actuator.on_gone = lambda node: (gone(node), control.wake())
        announce(gw, args.host)
        split = " + ".join(f"{n} {r}" for r, n in roles.items())
        print(f"pdserve up: starting {split} node(s) for {', '.join(models)}; logs in {args.log_dir}/\n"
              f"  try:  pdserve chat \"What is the capital of France?\"\n"
              f"  or:   curl http://{gw.config.host}:{gw.config.port}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{models[0]}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'\n"
              f"  stop: Ctrl-C (or SIGTERM to pid {os.getpid()})", file=sys.stderr, flush=True)  # fmt: skip
        server = uvicorn.Server(uvicorn.Config(create_app(gw), host=gw.config.host, port=gw.config.port,
                                               log_level="warning", loop="asyncio",
                                               timeout_graceful_shutdown=STOP_GRACE_S))  # fmt: skip
        stop.server = server  # a signal from now on: the server finishes its open requests, then returns
        server.should_exit = bool(stop.names)  # one that came since the check above: serve() returns at once
        loop.run_until_complete(server.serve())
    finally:
        t0 = stop.at or time.monotonic()
        if control is not None:
            control.stop()
        pool.close()
        stopped = actuator.close(drain_s=NODE_DRAIN_S)
        if made_key:
            keyfile.remove(gw.config.port, made_key)
        cause = f" on {stop.names[0]}" if stop.names else ""
        what = f"{len(stopped)} node(s) ({', '.join(stopped)})" if stopped else "no nodes"
        print(f"pdserve up: stopped{cause}: the gateway and {what} in {time.monotonic() - t0:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    return 0


class _StopSignals:
    """SIGTERM and SIGINT for the whole life of `pdserve up`: any stop runs the cleanup in main().

    uvicorn captures both while it serves and, once serve() returns, restores the handlers it
    found and raises the signal again — with the default SIGTERM action that ended the process
    before the cleanup, leaving every node running. These handlers are the ones it finds: the
    first signal asks the server to finish its open requests (bounded by STOP_GRACE_S; before it
    serves, it makes serve() return at once), a second one makes the node cleanup hurry (no
    drain, SIGKILL). They never raise, so the `finally` in main() always runs.
    """

    def __init__(self) -> None:
        self.names: list[str] = []  # the signals received (uvicorn's re-raise included), in order
        self.at: float | None = None  # monotonic time of the first
        self.server = None  # the uvicorn.Server once there is one
        self.actuator = None  # the LocalActuator once there is one

    def install(self) -> _StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, sig: int, frame) -> None:
        self.names.append(signal.Signals(sig).name)
        self.at = self.at or time.monotonic()
        if self.server is not None:
            self.server.should_exit = True
        if len(self.names) > 1 and self.actuator is not None:
            self.actuator.hurry()


def registry_hooks(gw, loop) -> dict:
    """LocalActuator callbacks (called from its threads) that keep the gateway's registry in step.

    on_ready: register, then check the node at once (routable now, not at the next poll);
    on_draining: stop routing to it *before* the drain starts (waits until the gateway's loop
    has done it, bounded), so no new request reaches a leaving node; on_gone: deregister.
    """

    def on_ready(node):
        def add():
            gw.registry.add(node.url, node.role, "local")
            loop.create_task(gw.registry.refresh(node.url))

        loop.call_soon_threadsafe(add)

    def on_draining(node):
        done = threading.Event()

        def mark():
            try:
                gw.registry.mark_draining(node.url)
            finally:
                done.set()

        loop.call_soon_threadsafe(mark)
        done.wait(2.0)  # the loop may not run (shutting down): then the node's own 503 reroutes

    def on_gone(node):
        loop.call_soon_threadsafe(gw.registry.remove, node.url)

    return {"on_ready": on_ready, "on_draining": on_draining, "on_gone": on_gone}


def autoscale_in_process(gw, actuator, roles: dict[str, int], config=None):
    """The control loop in a thread of this process over `actuator` (the warm pool): the same observer as
    `pdserve autoscale` (autoscaler/observer.py), fed the gateway's status snapshot in-process; each report
    is stored where `pdserve status` reads it; the gateway's activator (a request held for a model no node
    holds) wakes it."""
    from gateway.routes.internal import snapshot

    from . import AutoscalerConfig
    from .observer import control_loop

    def publish(body: dict) -> None:
        gw.autoscaler_status = body  # one assignment: the gateway's loop reads it without a lock

    config = config or AutoscalerConfig()
    control = control_loop(config, lambda: snapshot(gw), publish, actuator, "local", roles=tuple(roles))
    gw.activate = lambda model=None: control.wake()
    return control.start()
