"""`pdserve gateway`: the OpenAI-compatible gateway in front of already-running nodes.

Settings: flags > environment ($PDSERVE_API_KEYS, $PDSERVE_ADMIN_KEY, $PDSERVE_INTERNAL_TOKEN,
each also as *_FILE) > the config file's [gateway] and [store] tables (--config, $PDSERVE_CONFIG)
> GatewayConfig's defaults. [gateway] takes GatewayConfig's fields (secrets excepted: `models =
["a", "b@v2"]`, or `model = "a"` for one; neither: every model in the store), `nodes` as a list
of "ROLE=URL" strings, and `url`: where other processes (autoscale, status, chat) reach this
gateway — the gateway itself does not read it. `--model` (repeatable) replaces the file's models.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

SECRETS = {"api_keys": "set $PDSERVE_API_KEYS (or $PDSERVE_API_KEYS_FILE)",
           "admin_key": "set $PDSERVE_ADMIN_KEY (or $PDSERVE_ADMIN_KEY_FILE)",
           "internal_token": "set $PDSERVE_INTERNAL_TOKEN (or $PDSERVE_INTERNAL_TOKEN_FILE)",
           "store": "set the locations in [store]"}  # fmt: skip
CLIENT_KEYS = ("url", "nodes", "discovery")  # [gateway] keys that are not GatewayConfig fields as such


def add_arguments(p) -> None:
    """Every flag defaults to None: unset flags fall back to the environment, then [gateway], then defaults."""
    from paramstore.config import add_store_arguments

    p.add_argument("--model", action="append", default=None, metavar="NAME[@vN]",
                   help="a model to serve (repeat for several; replaces [gateway] model/models); "
                        "default: every model in the store")  # fmt: skip
    add_store_arguments(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1; loopback only without API keys)")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--node", action="append", default=None, metavar="ROLE=URL",
                   help="a static node (repeat; replaces [gateway] nodes)")  # fmt: skip
    p.add_argument("--open-admin", action="store_true",
                   help="without an admin key, leave /admin/* open to local processes (default: closed, 401)")
    p.add_argument("--max-running", type=int, help="requests in flight to nodes at once (default 64)")
    p.add_argument("--max-queue", type=int, help="requests waiting for admission (default 256)")
    p.add_argument("--queue-timeout", type=float, help="longest wait for admission, s (default 30)")
    p.add_argument("--retries", type=int, help="extra attempts after a node failure (default 3)")
    p.add_argument("--routing", choices=("cache", "load"), help="route by each node's cached prefix and load "
                   "(cache, the default) or by load only")  # fmt: skip
    p.add_argument("--no-peer-pull", dest="peer_pull", action="store_const", const=False, default=None,
                   help="never have a node pull a prompt's cached prefix from a peer (default: when cheaper)")
    p.add_argument("--report-cached-tokens", choices=("isolated", "always", "never"),
                   help="usage's cached_tokens: only where each API key has its own cache (isolated, the default), "
                        "always (one user's box, benchmarks) or never")  # fmt: skip
    p.add_argument("--log-level", default="info")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as JSON and exit")


def parse_nodes(specs, where: str) -> list[tuple[str, str]]:
    """["ROLE=URL", ...] -> [(role, url), ...]; a malformed entry is a ConfigError naming `where`."""
    from gateway.routing.registry import NODE_ROLES, node_url
    from paramstore.config import ConfigError

    out = []
    for spec in specs or []:
        role, sep, url = spec.partition("=") if isinstance(spec, str) else ("", "", "")
        if not sep or not url:
            raise ConfigError(f"{where}: node {spec!r} is not ROLE=URL")
        if role not in NODE_ROLES:
            raise ConfigError(f"{where}: node {spec!r}: role {role!r} is not one of {', '.join(NODE_ROLES)}")
        try:
            out.append((role, node_url(url)))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return out


def gateway_config(args, tables: dict, path: str | None, **fixed):
    """GatewayConfig from flags (`args`, `fixed`) > environment > [gateway] > defaults."""
    from gateway.config import GatewayConfig, keys_from_env
    from paramstore.config import resolve

    g = tables.get("gateway", {})
    flags = {"host": getattr(args, "host", None),
             "port": getattr(args, "port", None), "max_running": getattr(args, "max_running", None),
             "max_queue": getattr(args, "max_queue", None), "queue_timeout_s": getattr(args, "queue_timeout", None),
             "retry_attempts": getattr(args, "retries", None), "routing": getattr(args, "routing", None),
             "peer_pull": getattr(args, "peer_pull", None),
             "report_cached_tokens": getattr(args, "report_cached_tokens", None),
             "admin_open": True if getattr(args, "open_admin", False) else None, **fixed}  # fmt: skip
    node_flags = getattr(args, "node", None)
    flags["nodes"] = parse_nodes(node_flags, "--node") if node_flags else None
    kw = resolve(GatewayConfig, "gateway", tables, path, flags, keys_from_env(), hints=SECRETS, skip=CLIENT_KEYS)
    models = getattr(args, "model", None)
    if isinstance(models, str):
        models = [models]
    if models:  # --model: exactly these (the file's model / models replaced)
        kw.pop("model", None)
        kw["models"] = list(models)
    if "nodes" not in kw and "nodes" in g:
        kw["nodes"] = parse_nodes(g["nodes"], f"config {path}: [gateway] nodes")
    return GatewayConfig(**kw)


def gateway_url(tables: dict, flag: str | None = None) -> str:
    """Where clients reach the gateway: the flag, else [gateway] url, else http://127.0.0.1:<[gateway] port>."""
    g = tables.get("gateway", {})
    return (flag or g.get("url") or f"http://127.0.0.1:{g.get('port', 8000)}").rstrip("/")


def open_gateway(cfg, store_cfg):
    """The store (opened with its HMAC key, if any; kept open for the models' text bundles, read on
    first use) -> Gateway. Every listed model must be in the store (NotFound: one line at the CLI);
    with none listed, the store's models are listed now."""
    from gateway.models import ModelCatalogue
    from gateway.service import Gateway
    from paramstore import ParamStore

    cfg.store = list(store_cfg.locations)
    ps = ParamStore(store_cfg)
    try:
        for ref in cfg.models:
            ps.manifest(ref)  # NotFound / IntegrityError naming the model
        catalogue = ModelCatalogue(ps, cfg.models, cfg.models_refresh_s, cfg.max_model_len)
        catalogue.relist()
    except BaseException:
        ps.close()
        raise
    if not catalogue.names:
        logging.getLogger("pdserve.gateway").warning("the store holds no model yet: nothing served until one is "
                                                     "imported (listed again every %g s)", cfg.models_refresh_s)
    return Gateway(cfg, catalogue)


def build_gateway(model, store: list[str], store_cfg=None, **kw):
    """GatewayConfig (keys from the environment) + the store -> Gateway. `model`: one name, a list,
    or None/empty (every model in the store)."""
    from gateway.config import GatewayConfig, keys_from_env
    from paramstore import StoreConfig

    models = [model] if isinstance(model, str) else list(model or [])
    cfg = GatewayConfig(models=models, store=store, **keys_from_env(), **kw)
    if store_cfg is None:
        store_cfg = StoreConfig(locations=store) if store else StoreConfig.local_default()
    return open_gateway(cfg, store_cfg)


def add_discovery(gw, tables: dict, path: str | None) -> None:
    """[gateway.discovery] (gateway.routing.discovery.DiscoveryConfig): the registry source that finds the nodes."""
    from gateway.routing.discovery import DiscoveryConfig, make_source
    from paramstore.config import ConfigError, table_kwargs

    table = tables.get("gateway", {}).get("discovery", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config {path}: [gateway] discovery must be a table [gateway.discovery]")
    kw = table_kwargs(DiscoveryConfig, table, "gateway.routing.discovery", path)  # unknown keys, wrong types: one line
    try:
        source = make_source(DiscoveryConfig(**kw), gw.registry)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config {path}: [gateway.discovery]: {e}") from None
    if source is not None:
        gw.sources.append(source)


def public(cfg, store_cfg) -> dict:
    """The resolved settings, secrets left out (for --print-config)."""
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("api_keys", "admin_key", "internal_token")}
    out.update(api_keys=len(cfg.api_keys), admin_key_set=bool(cfg.admin_key),
               internal_token_set=bool(cfg.internal_token))  # fmt: skip
    out["store"] = {"locations": store_cfg.locations, "k": store_cfg.k, "m": store_cfg.m,
                    "hmac": store_cfg.hmac_key is not None}  # fmt: skip
    return out


def announce(gw, requested_host: str | None) -> None:
    cfg = gw.config
    if cfg.open:
        moved = (requested_host or cfg.host) != cfg.host
        note = " (no API key configured: listening on 127.0.0.1 only)" if moved else ""
        print(f"pdserve gateway: no API key set — open to local clients{note}", file=sys.stderr)
    if cfg.admin_open and not cfg.admin_key:
        print("pdserve gateway: WARNING: --open-admin: the admin API (/admin/*: register nodes, read status) is open "
              "to every local process, with no key", file=sys.stderr)  # fmt: skip
    elif cfg.admin_closed:
        print("pdserve gateway: no admin key set — the admin API is closed (set $PDSERVE_ADMIN_KEY to use it)",
              file=sys.stderr)  # fmt: skip
    names = gw.models.names
    what = f"model{'s' if len(names) != 1 else ''} {', '.join(names)}" if names else "no model yet"
    every = " (every model in the store)" if not cfg.models else ""
    print(f"pdserve gateway: {what}{every} on http://{cfg.host}:{cfg.port}/v1", file=sys.stderr, flush=True)


def main(args) -> int:
    import uvicorn

    from compute.node.lifeline import hold
    from gateway.app import create_app
    from paramstore.config import config_path, read_config, store_config

    hold()  # started by pdserve up, a launcher or a test: end with that parent, even on SIGKILL
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    path = config_path(args.config)
    tables = read_config(path)
    store_cfg = store_config(args, tables=tables)
    requested_host = args.host or tables.get("gateway", {}).get("host")
    cfg = gateway_config(args, tables, path, store=list(store_cfg.locations))
    if args.print_config:
        print(json.dumps(public(cfg, store_cfg), indent=1))
        return 0
    gw = open_gateway(cfg, store_cfg)
    add_discovery(gw, tables, path)
    announce(gw, requested_host)
    uvicorn.run(create_app(gw), host=gw.config.host, port=gw.config.port, log_level="warning")
    return 0
