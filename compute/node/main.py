"""`pdserve node`: one process, one engine, one role, the internal HTTP API."""

from __future__ import annotations

import asyncio
import logging
import os
import sys


def add_arguments(p) -> None:
    p.add_argument("--role", required=True, choices=["prefill", "decode", "both"])
    p.add_argument("--model", required=True, help="paramstore reference NAME[@vN]")
    p.add_argument("--store", action="append", default=[], metavar="URL", help="store location (repeat)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--weights", default="int8", choices=["int8", "bf16", "fp32"])
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--kv-transport", default="tcp", choices=["nixl", "tcp", "fake"])
    p.add_argument("--kv-compression", default="none", choices=["none", "bf16", "fp16", "int8"])
    p.add_argument("--kv-hold-s", type=float, default=30.0, help="prefill: hold KV this long for the decode side")
    p.add_argument("--kv-timeout-s", type=float, default=10.0, help="decode: fail a KV transfer after this")
    p.add_argument("--cache-dir", default=None, help="node-local shard cache directory")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--token-file", default=None, help="file with the internal token (else $PDSERVE_INTERNAL_TOKEN)")
    p.add_argument("--log-level", default="info")


def _token(args) -> str:
    if args.token_file:
        with open(args.token_file) as f:
            return f.read().strip()
    return os.environ.get("PDSERVE_INTERNAL_TOKEN", "").strip()


def build(cfg, loop):
    """Store, lazy injector (started), engine, worker, service, app — in that order."""
    import torch

    from compute.engine import Engine
    from compute.kv_transfer import KVLayout
    from compute.loader import WeightInjector
    from paramstore import ParamStore, StoreConfig
    from paramstore.cache import CacheConfig, NodeCache

    from .server import create_app
    from .service import NodeService
    from .worker import EngineWorker

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    store = ParamStore(StoreConfig(locations=cfg.store) if cfg.store else StoreConfig.local_default())
    cache = None
    if cfg.cache_dir:
        cache = NodeCache(CacheConfig(dir=cfg.cache_dir, disk_bytes=int(cfg.cache_gb * 2**30), memory_bytes=0))
    injector = WeightInjector(store, cfg.model, cfg.weights, cache=cache).start()
    model = injector.model
    engine = Engine.for_model(model, num_blocks=cfg.kv_blocks, block_size=cfg.block_size,
                              max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                              eos_token_ids=(tuple(injector.bundle.eos_token_ids) if injector.bundle else ())
                              or model.config.eos_token_ids)  # fmt: skip
    worker = EngineWorker(engine, loop)
    svc = NodeService(cfg, worker, model.config.vocab_size)
    cache_t = engine.runner.cache
    layout = KVLayout(model.config.num_layers, cfg.block_size, model.config.num_kv_heads, model.config.head_dim,
                      cache_t.dtype)  # fmt: skip
    if cfg.role == "prefill":
        from .prefill import make_sender

        make_sender(svc, layout, cache_t.kv)
    elif cfg.role == "decode":
        from .decode import make_receiver

        make_receiver(svc, layout, cache_t.kv)
    return create_app(svc, injector), worker, injector


def main(args) -> int:
    import uvicorn

    from .config import NodeConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    cfg = NodeConfig(role=args.role, model=args.model, internal_token=_token(args), store=args.store,
                     host=args.host, port=args.port, weights=args.weights, kv_blocks=args.kv_blocks,
                     block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_batched_tokens, kv_transport=args.kv_transport,
                     kv_compression=args.kv_compression, kv_hold_s=args.kv_hold_s, kv_timeout_s=args.kv_timeout_s,
                     cache_dir=args.cache_dir, threads=args.threads)  # fmt: skip
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app, worker, injector = build(cfg, loop)
    worker.start()
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", loop="asyncio"))
    print(f"pdserve node: role={cfg.role} model={cfg.model} listening on http://{cfg.host}:{cfg.port}", file=sys.stderr,
          flush=True)  # fmt: skip
    try:
        loop.run_until_complete(server.serve())
    finally:
        worker.stop()
    return 0
