"""`pdserve node`: one process, one engine, one role, the internal HTTP API.

Settings: flags > environment ($PDSERVE_INTERNAL_TOKEN[_FILE], $PDSERVE_CACHE_DIR) > the config
file's [node] and [store] tables (--config, $PDSERVE_CONFIG) > NodeConfig's defaults. The store is
opened with [store]'s HMAC key when one is set: a manifest with a wrong or missing signature is
refused before the node listens (one line, exit 2), so it never becomes ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys


def add_arguments(p) -> None:
    """Every flag defaults to None: unset flags fall back to $PDSERVE_* variables, then [node], then defaults."""
    from paramstore.config import add_store_arguments

    p.add_argument("--role", choices=["prefill", "decode", "both"], help="required here or as [node] role")
    p.add_argument("--model", help="paramstore reference NAME[@vN]; required here or as [node] model")
    add_store_arguments(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="default 8001")
    p.add_argument("--weights", choices=["int8", "bf16", "fp32"], help="runtime weights (default int8)")
    p.add_argument("--kv-blocks", type=int, help="KV cache blocks (default 2048)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=int, help="running sequences per step (default 64)")
    p.add_argument("--max-batched-tokens", type=int, help="tokens per step (default 512)")
    p.add_argument("--kv-transport", choices=["nixl", "tcp", "fake"], help="default tcp")
    p.add_argument("--kv-compression", choices=["none", "bf16", "fp16", "int8"], help="default none")
    p.add_argument("--kv-hold-s", type=float, help="prefill: hold KV this long for the decode side (default 30)")
    p.add_argument("--kv-timeout-s", type=float, help="decode: fail a KV transfer after this (default 10)")
    p.add_argument("--cache-dir", help="node-local shard cache directory (else $PDSERVE_CACHE_DIR, [node] cache_dir)")
    p.add_argument("--cache-gb", type=float, help="shard cache size on disk (default 8)")
    p.add_argument("--threads", type=int, help="torch threads (0: torch default)")
    p.add_argument("--token-file", default=None, help="file with the internal token (else $PDSERVE_INTERNAL_TOKEN)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as JSON and exit")


_SECRETS = {"internal_token": "set $PDSERVE_INTERNAL_TOKEN (or --token-file)",
            "store": "set the locations in [store]"}  # fmt: skip


def node_config(args):
    """(NodeConfig, StoreConfig) from flags > environment > the config file's [node] and [store] > defaults."""
    from paramstore.config import (
        ConfigError,
        config_path,
        env_secret,
        read_config,
        resolve,
        store_config,
    )

    from .config import NodeConfig

    path = config_path(args.config)
    tables = read_config(path)
    store_cfg = store_config(args, tables=tables)
    flags = {"role": args.role, "model": args.model, "host": args.host, "port": args.port, "weights": args.weights,
             "kv_blocks": args.kv_blocks, "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_batched_tokens, "kv_transport": args.kv_transport,
             "kv_compression": args.kv_compression, "kv_hold_s": args.kv_hold_s, "kv_timeout_s": args.kv_timeout_s,
             "cache_dir": args.cache_dir, "cache_gb": args.cache_gb, "threads": args.threads}  # fmt: skip
    token = env_secret("PDSERVE_INTERNAL_TOKEN", args.token_file)  # --token-file, else $PDSERVE_INTERNAL_TOKEN[_FILE]
    env = {"cache_dir": os.environ.get("PDSERVE_CACHE_DIR") or None, "internal_token": token or None}
    kw = resolve(NodeConfig, "node", tables, path, flags, env, hints=_SECRETS)
    for need in ("role", "model"):
        if need not in kw:
            raise ConfigError(f"no {need}: pass --{need} or set {need} in [node] of the config file")
    kw.setdefault("internal_token", "")
    return NodeConfig(store=store_cfg.locations, **kw), store_cfg


def _public(cfg, store_cfg) -> dict:
    """The resolved settings, secrets left out (for --print-config)."""
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "internal_token"}
    out["internal_token_set"] = bool(cfg.internal_token)
    out["store"] = {"locations": store_cfg.locations, "k": store_cfg.k, "m": store_cfg.m,
                    "shard_bytes": store_cfg.shard_bytes, "hmac": store_cfg.hmac_key is not None}  # fmt: skip
    return out


def build(cfg, loop, store_cfg):
    """Store (of ``node_config``'s StoreConfig), lazy injector (started), engine, worker, service, app."""
    import torch

    from compute.engine import Engine
    from compute.kv_transfer import KVLayout
    from compute.loader import WeightInjector
    from paramstore import ParamStore
    from paramstore.cache import CacheConfig, NodeCache

    from .server import create_app
    from .service import NodeService
    from .worker import EngineWorker

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    store = ParamStore(store_cfg)
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

    from .lifeline import hold

    hold()  # first: a node whose parent (`pdserve up`, the launcher) ends, even by SIGKILL, ends too
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg, store_cfg = node_config(args)
    if args.print_config:
        print(json.dumps(_public(cfg, store_cfg), indent=1))
        return 0
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if cfg.host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app, worker, injector = build(cfg, loop, store_cfg)
    worker.start()
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", loop="asyncio"))
    print(f"pdserve node: role={cfg.role} model={cfg.model} listening on http://{cfg.host}:{cfg.port}", file=sys.stderr,
          flush=True)  # fmt: skip
    try:
        loop.run_until_complete(server.serve())
    finally:
        worker.stop()
    return 0
