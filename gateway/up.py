"""`pdserve up`: the default local service — nodes as local processes, the gateway in this process.

Lifecycle: parse -> internal token (generated unless $PDSERVE_INTERNAL_TOKEN) -> gateway
built from the store (tokenizer, chat template) -> the local actuator starts the nodes;
each registers with the gateway once ready -> optional autoscaling loop (``--autoscale``)
-> serve until Ctrl-C/SIGTERM -> every node process this command started is stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import threading


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--store", action="append", default=[], metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", type=int, default=None, help="prefill nodes (default 1)")
    p.add_argument("--decode", type=int, default=None, help="decode nodes (default 1)")
    p.add_argument("--both", type=int, default=None, help="colocated nodes (instead of a prefill/decode split)")
    p.add_argument("--kv-transport", default="tcp", choices=["nixl", "tcp"])
    p.add_argument("--threads-per-node", type=int, default=1)
    p.add_argument("--kv-blocks", type=int, default=1024)
    p.add_argument("--autoscale", action="store_true", help="run the autoscaling loop (local actuator)")
    p.add_argument("--log-dir", default=".pdserve/logs")
    p.add_argument("--log-level", default="info")


def plan(args) -> dict[str, int]:
    if args.both is not None and (args.prefill or args.decode):
        raise ValueError("use either --both N or --prefill N --decode M")
    if args.both is not None:
        return {"both": args.both}
    return {"prefill": 1 if args.prefill is None else args.prefill, "decode": 1 if args.decode is None else args.decode}


def main(args) -> int:
    import uvicorn

    from autoscaler.local import LocalActuator, LocalConfig

    from .app import create_app
    from .main import announce, build_gateway

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    roles = plan(args)
    token = os.environ.get("PDSERVE_INTERNAL_TOKEN") or secrets.token_urlsafe(24)
    os.environ["PDSERVE_INTERNAL_TOKEN"] = token
    gw = build_gateway(args.model, args.store, host=args.host, port=args.port)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    actuator = LocalActuator(LocalConfig(model=args.model, store=args.store, internal_token=token,
                                         kv_transport=args.kv_transport, threads=args.threads_per_node,
                                         kv_blocks=args.kv_blocks, log_dir=args.log_dir),
                             **registry_hooks(gw, loop))  # fmt: skip
    control = None
    try:
        for role, n in roles.items():
            actuator.scale(role, n)
        if args.autoscale:
            control = _autoscale(gw, actuator, roles)
        announce(gw, args.host)
        split = " + ".join(f"{n} {r}" for r, n in roles.items())
        print(f"pdserve up: starting {split} node(s); logs in {args.log_dir}/\n"
              f"  try:  pdserve chat \"What is the capital of France?\"\n"
              f"  or:   curl http://{gw.config.host}:{gw.config.port}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{args.model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'\n"
              f"  stop: Ctrl-C (or SIGTERM to pid {os.getpid()})", file=sys.stderr, flush=True)  # fmt: skip
        server = uvicorn.Server(uvicorn.Config(create_app(gw), host=gw.config.host, port=gw.config.port,
                                               log_level="warning", loop="asyncio"))  # fmt: skip
        loop.run_until_complete(server.serve())
    finally:
        if control is not None:
            control.stop()
        actuator.close()
        print("pdserve up: stopped every node it started", file=sys.stderr)
    return 0


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


def _autoscale(gw, actuator, roles: dict[str, int], config=None):
    """The control loop in a thread: observe the gateway and nodes, decide, scale locally."""
    from autoscaler import AutoscalerConfig, ControlLoop, RoleLoad

    def observe():
        loads = {}
        views = list(gw.registry.nodes.values())  # a copy: the gateway's loop changes the dict meanwhile
        for role in roles:
            nodes = [n for n in views if n.role == role]
            ld = [n.load for n in nodes if n.healthy]
            used = sum(x.get("kv_blocks_used", 0) for x in ld)
            total = sum(x.get("kv_blocks_total", 0) for x in ld) or 1
            loads[role] = RoleLoad(
                replicas=len(nodes), ready=len(ld), starting=0, queue_depth=gw.admission.waiting,
                queue_wait_p99_s=gw.admission.wait_p99(),
                queued_prompt_tokens=sum(x.get("queued_prompt_tokens", 0) for x in ld),
                running_streams=sum(x.get("running", 0) for x in ld), kv_utilisation=used / total,
            )  # fmt: skip
        return loads

    def publish(report, nodes):
        gw.autoscaler_status = report.to_dict()

    if "both" in roles:
        raise ValueError("--autoscale scales prefill and decode independently: use --prefill N --decode M")
    return ControlLoop(config or AutoscalerConfig(), observe=observe, actuator=actuator, publish=publish).start()
