"""`pdserve gateway`: the OpenAI-compatible gateway in front of already-running nodes."""

from __future__ import annotations

import logging
import sys


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="paramstore reference NAME[@vN] the nodes serve")
    p.add_argument("--store", action="append", default=[], metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--node", action="append", default=[], metavar="ROLE=URL", help="a static node (repeat)")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--queue-timeout", type=float, default=30.0)
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--log-level", default="info")


def build_gateway(model: str, store: list[str], **kw):
    """GatewayConfig (keys from the environment) + the model's text bundle from the store -> Gateway."""
    from compute.tokenizer import TextBundle
    from paramstore import ParamStore, StoreConfig

    from .config import GatewayConfig, keys_from_env
    from .service import Gateway

    cfg = GatewayConfig(model=model, store=store, **keys_from_env(), **kw)
    with ParamStore(StoreConfig(locations=store) if store else StoreConfig.local_default()) as ps:
        m = ps.manifest(model)
        with ps.reader(m) as r:
            bundle = TextBundle.from_files(r.bundle())
    return Gateway(cfg, bundle, int(m.config.get("max_position_embeddings", 2048)))


def announce(gw, requested_host: str) -> None:
    cfg = gw.config
    if cfg.open:
        note = " (no API key configured: listening on 127.0.0.1 only)" if requested_host != cfg.host else ""
        print(f"pdserve gateway: no API key set — open to local clients{note}", file=sys.stderr)
    print(f"pdserve gateway: model {cfg.model} on http://{cfg.host}:{cfg.port}/v1", file=sys.stderr, flush=True)


def main(args) -> int:
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    nodes = []
    for spec in args.node:
        role, _, url = spec.partition("=")
        nodes.append((role, url))
    gw = build_gateway(args.model, args.store, host=args.host, port=args.port, nodes=nodes,
                       max_running=args.max_running, max_queue=args.max_queue,
                       queue_timeout_s=args.queue_timeout, retry_attempts=args.retries)  # fmt: skip
    announce(gw, args.host)
    uvicorn.run(create_app(gw), host=gw.config.host, port=gw.config.port, log_level="warning")
    return 0
