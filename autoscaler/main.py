"""`pdserve autoscale`: the control loop as a process of its own.

Lifecycle: settings (flags > environment > the config file's [autoscaler], [gateway], [node],
[store] > defaults) -> a GatewayClient for every --gateway URL (else [gateway] url) with
$PDSERVE_INTERNAL_TOKEN -> the runtime actuator (`kubernetes`: the node Deployments' scale
subresource; `local`: standby `pdserve node` processes on this machine, registered with the
gateway as they come up) under the warm pool (autoscaler/pool.py: models claimed onto
runtimes per (model, role); --model places one at start) -> tick (observe the gateway over HTTP, decide, act, publish the
report to the gateway for `pdserve status`) every tick_s until SIGTERM/SIGINT or
--max-ticks -> the actuator is closed (local: every node it started is drained and stopped).

[autoscaler] takes AutoscalerConfig's fields (autoscaler/config.py), `actuator`
(local | kubernetes), and two sub-tables: [autoscaler.local] (LocalConfig, autoscaler/local.py)
and [autoscaler.kubernetes] (KubernetesConfig, autoscaler/kubernetes.py; not `backoff`).
"""

from __future__ import annotations

import json
import logging
import signal
import sys

ACTUATORS = ("local", "kubernetes", "fake")
OWN_KEYS = ("actuator", "local", "kubernetes")  # [autoscaler] keys that are not AutoscalerConfig fields
NODE_KEYS = ("kv_transport", "weights", "threads", "kv_blocks", "cache_dir")  # LocalConfig fields [node] also sets
_SECRETS = {"internal_token": "set $PDSERVE_INTERNAL_TOKEN", "store": "set the locations in [store]",
            "backoff": "not configurable from the file"}  # fmt: skip


def add_arguments(p) -> None:
    from paramstore.config import add_store_arguments

    p.add_argument("--actuator", choices=ACTUATORS, help="what runs the nodes ([autoscaler] actuator; default local)")
    p.add_argument("--gateway", action="append", default=None, metavar="URL",
                   help="a gateway to observe and report to (repeat; else [gateway] url, else http://127.0.0.1:8000)")
    add_store_arguments(p)
    p.add_argument("--model", action="append", default=None,
                   help="a model to place at start, at each role's minimum (repeat); others follow demand")
    p.add_argument("--tick-s", type=float, help="seconds between ticks ([autoscaler] tick_s)")
    p.add_argument("--max-ticks", type=int, default=None, help="stop after this many ticks (default: until SIGTERM)")
    p.add_argument("--kubeconfig", default=None, help="kubernetes actuator outside a pod (else $KUBECONFIG)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as JSON and exit")


def policy_config(tables: dict, path: str | None):
    """AutoscalerConfig from [autoscaler] (its actuator keys aside); a bad value is a ConfigError naming the file."""
    from paramstore.config import ConfigError

    from .config import AutoscalerConfig

    policy = {k: v for k, v in tables.get("autoscaler", {}).items() if k not in OWN_KEYS}
    try:
        return AutoscalerConfig.from_mapping(policy)
    except ValueError as e:
        raise ConfigError(f"config {path}: [autoscaler]: {e}") from None


def node_args(args, path: str | None) -> list[str]:
    """The flags every local node gets: the config file (the nodes read [node] and [store], HMAC key included,
    themselves) and --hmac-key-file when given."""
    extra = ["--config", path] if path else []
    if args.hmac_key_file:
        extra += ["--hmac-key-file", args.hmac_key_file]
    return extra


def settings(args) -> dict:
    """Everything `pdserve autoscale` runs with: AutoscalerConfig, actuator kind and its config, gateways."""
    import dataclasses
    import os

    from gateway.main import gateway_url
    from paramstore.config import (
        ConfigError,
        config_path,
        env_secret,
        read_config,
        resolve,
        store_config,
    )

    path = config_path(args.config)
    tables = read_config(path)
    a = dict(tables.get("autoscaler", {}))
    config = policy_config(tables, path)
    if args.tick_s is not None:
        config = dataclasses.replace(config, tick_s=args.tick_s)
    kind = args.actuator or a.get("actuator", "local")
    if kind not in ACTUATORS:
        raise ConfigError(f"config {path}: [autoscaler] actuator = {kind!r}: one of {', '.join(ACTUATORS)}")
    urls = args.gateway or [gateway_url(tables)]
    token = env_secret("PDSERVE_INTERNAL_TOKEN") or ""
    out = {"config": config, "actuator": kind, "gateways": [u.rstrip("/") for u in urls], "token": token,
           "path": path, "models": list(args.model or [])}  # fmt: skip
    if kind == "local":
        from .local import LocalConfig

        store_cfg = store_config(args, tables=tables)
        sub = {"autoscaler.local": a.get("local", {})}
        env = {"cache_dir": os.environ.get("PDSERVE_CACHE_DIR") or None}
        kw = resolve(LocalConfig, "autoscaler.local", sub, path, {}, env, hints=_SECRETS)
        kw.setdefault("import_nice", 10)  # the pool's refills yield the CPU to the nodes that serve
        node = tables.get("node", {})  # the nodes' own settings, unless [autoscaler.local] sets them
        for key in NODE_KEYS:
            if key in node:
                kw.setdefault(key, node[key])
        extra = list(kw.pop("extra_args", ())) + node_args(args, path)
        out["local"] = LocalConfig(store=list(store_cfg.locations), internal_token=token or "unset",
                                   extra_args=tuple(extra), **kw)  # fmt: skip
    elif kind == "kubernetes":
        from .kubernetes import KubernetesConfig

        sub = {"autoscaler.kubernetes": a.get("kubernetes", {})}
        kw = resolve(KubernetesConfig, "autoscaler.kubernetes", sub, path, {}, hints=_SECRETS,
                     skip=("gateway_service",))  # fmt: skip
        out["kubernetes"] = KubernetesConfig(**kw)
        service = sub["autoscaler.kubernetes"].get("gateway_service")
        if service is not None and not isinstance(service, str):
            raise ConfigError(f"config {path}: [autoscaler.kubernetes] gateway_service must be a Service name")
        out["gateway_service"] = None if args.gateway else service  # --gateway wins
        # in a cluster the config says what is served: [gateway] models (without --model), each placed at its
        # roles' minimum replicas at start; a minimum of 0 places nothing (the first request wakes the model)
        g = tables.get("gateway", {})
        served = [g["model"]] if isinstance(g.get("model"), str) else []
        out["served"] = [] if args.model else list(dict.fromkeys([*served, *(g.get("models") or [])]))
    return out


def _public(s: dict) -> dict:
    import dataclasses

    out = {"actuator": s["actuator"], "gateways": s["gateways"], "internal_token_set": bool(s["token"]),
           "autoscaler": dataclasses.asdict(s["config"]), "models": s["models"]}  # fmt: skip
    if "local" in s:
        out["local"] = {k: v for k, v in dataclasses.asdict(s["local"]).items() if k != "internal_token"}
    if "kubernetes" in s:
        k = s["kubernetes"]
        out["kubernetes"] = {"namespace": k.namespace, "deployments": k.deployments, "services": k.services,
                             "gateway_service": s.get("gateway_service"), "served": s.get("served", [])}  # fmt: skip
    return out


def make(s: dict, client, kubeconfig: str | None = None):
    """The runtime actuator `s` names, wired to `client` (local nodes are registered with the gateways)."""
    from .actuator import make_actuator

    if s["actuator"] == "local":
        return make_actuator("local", config=s["local"], on_ready=client.register, on_draining=client.draining,
                             on_gone=client.deregister)  # fmt: skip
    if s["actuator"] == "kubernetes":
        return make_actuator("kubernetes", config=s["kubernetes"], kubeconfig=kubeconfig)
    return make_actuator("fake")


def make_pool(s: dict, runtimes):
    """The warm pool over `runtimes`, the loop's actuator; the --model ones asked for at each role's minimum."""
    from .config import ROLES
    from .pool import RuntimePool, pool_config

    pool = RuntimePool(runtimes, s["token"], pool_config(s["config"], ROLES), ROLES)
    for m in s["models"]:
        pool.place([m], {r: max(1, s["config"].bounds(r)[0]) for r in ROLES})
    lows = {r: s["config"].bounds(r)[0] for r in ROLES}
    if any(lows.values()):  # kubernetes: the config's served models at their minimum
        pool.place(s.get("served", []), lows)
    return pool


def main(args) -> int:
    from compute.node.lifeline import hold

    from .observer import GatewayClient, control_loop

    hold()  # started by pdserve up, a launcher or a test: end with that parent, even on SIGKILL
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    s = settings(args)
    if args.print_config:
        print(json.dumps(_public(s), indent=1))
        return 0
    if args.max_ticks is not None and args.max_ticks < 1:
        raise ValueError("--max-ticks must be >= 1")
    def gateway_pods() -> list[str]:  # every ready gateway pod: their queues add up, each shows the report
        return [n.url for n in actuator.endpoints_of(s["gateway_service"], "gateway") if n.ready]

    client = GatewayClient(gateway_pods if s.get("gateway_service") else s["gateways"], s["token"])
    actuator = pool = None
    try:
        actuator = make(s, client, args.kubeconfig)
        pool = make_pool(s, actuator)
        def observe():  # the gateways' snapshot; their node lists made to match the local nodes (a lost
            st = client.status()  # registration sent again, a lost deregistration too)
            if s["actuator"] == "local":
                client.reconcile([n for ns in actuator.current().values() for n in ns])
            return st

        loop = control_loop(s["config"], observe, client.publish, pool, s["actuator"])
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: loop.stop(timeout=0))
        print(f"pdserve autoscale: {s['actuator']} actuator, observing {', '.join(s['gateways'])} every "
              f"{s['config'].tick_s:g} s", file=sys.stderr, flush=True)  # fmt: skip
        ticks = loop.run(max_ticks=args.max_ticks)
        last = loop.last
        error = f"; last error: {last.error}" if last and last.error else ""
        print(f"pdserve autoscale: stopped after {ticks} tick(s){error}", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.close()
        if actuator is not None:
            stop(actuator, client, s["actuator"])
        client.close()
    return 0


def stop(actuator, client, kind: str) -> None:
    """Close the actuator; local nodes (which end with this process) leave the gateways first.

    A Kubernetes actuator only closes its API client: the Deployments keep their nodes.
    """
    nodes = []
    if kind == "local":
        try:
            nodes = [n for ns in actuator.current().values() for n in ns]
        except Exception:  # noqa: BLE001 - stopping goes on without the list
            pass
        for n in nodes:
            client.draining(n)  # route nothing new to them while they drain
    actuator.close()
    for n in nodes:
        client.deregister(n)
