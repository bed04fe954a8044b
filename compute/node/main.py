"""`pdserve node`: one runtime process of one role, the internal HTTP API, the models it is asked to hold.

Without a model (no --model, no [node] model) it starts *standby*: imports done (in a thread niced
by --import-nice when the pool refills in the background), HTTP API up, the KV-transfer endpoint's
process-wide part (the NIXL agent) created, /ready 200 at once; models are loaded through
/internal/models/load. With --model it loads that one at start and is ready once it is.

Settings: flags > environment ($PDSERVE_INTERNAL_TOKEN[_FILE], $PDSERVE_CACHE_DIR, $PDSERVE_ADVERTISE_URL, $PDSERVE_STEP,
$PDSERVE_NIXL_TRUSTED_FABRIC) > the config
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
import signal
import sys


def add_arguments(p) -> None:
    """Every flag defaults to None: unset flags fall back to $PDSERVE_* variables, then [node], then defaults."""
    from paramstore.config import add_store_arguments

    p.add_argument("--role", choices=["prefill", "decode", "both"], help="required here or as [node] role")
    p.add_argument("--model", help="paramstore reference NAME[@vN] to load at start (else standby: load on demand)")
    p.add_argument("--standby", action="store_true",
                   help="start empty even if [node] model is set (the warm pool's runtimes read the shared config)")
    add_store_arguments(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="default 8001")
    p.add_argument("--weights", choices=["int8", "bf16", "fp32"], help="runtime weights (default int8)")
    p.add_argument("--kv-blocks", type=int, help="KV cache blocks (default 2048)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=int, help="running sequences per step (default 64)")
    p.add_argument("--max-batched-tokens", type=int, help="tokens per step (default 512)")
    p.add_argument("--kv-transport", choices=["nixl", "tcp", "fake"], help="default tcp")
    p.add_argument("--nixl-trusted-fabric", action="store_const", const=True, default=None,
                   help="allow --kv-transport nixl: every peer that can reach this node's UCX port is trusted "
                        "(NIXL cannot bound what a peer READs; $PDSERVE_NIXL_TRUSTED_FABRIC=1)")  # fmt: skip
    p.add_argument("--kv-dtype", choices=["auto", "bfloat16", "float32"],
                   help="KV cache dtype (default auto: bf16, fp32 for fp32 weights)")  # fmt: skip
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const", const=False, default=None,
                   help="compute every prompt from its first token (default: reuse cached KV blocks by content)")
    p.add_argument("--no-peer-kv", dest="peer_kv", action="store_const", const=False, default=None,
                   help="neither export cached prefixes to peers nor pull theirs (default: both, on a cpu device)")
    p.add_argument("--kv-compression", choices=["none", "bf16", "fp16", "int8"], help="default none")
    p.add_argument("--kv-hold-s", type=float, help="prefill: hold KV this long for the decode side (default 30)")
    p.add_argument("--kv-timeout-s", type=float, help="decode: fail a KV transfer after this (default 10)")
    p.add_argument("--cache-dir", help="node-local shard cache directory (else $PDSERVE_CACHE_DIR, [node] cache_dir)")
    p.add_argument("--cache-gb", type=float, help="shard cache size on disk (default 8)")
    p.add_argument("--threads", type=int, help="torch threads (0: torch default)")
    p.add_argument("--memory-gb", type=float, help="budget for weights + KV of all held models (0: half MemAvailable)")
    p.add_argument("--tpot-target-s", type=float, help="TPOT target of the capacity report (default 0.1)")
    p.add_argument("--import-nice", type=int, help="do the heavy imports in a thread niced by N (default 0)")
    p.add_argument("--device", help="torch device of weights, KV cache and sampling (default cpu)")
    p.add_argument("--kernels", choices=("measured", "invariant", "fixed"),
                   help="int8 kernels planned per machine class (the store's plan, else this machine's cache, else the "
                        "safe rule until measured in the background): the fastest per batch size (measured, "
                        "default), one batch-invariant kernel per shape (invariant), or the fixed rule")  # fmt: skip
    p.add_argument("--weight-copies-gb", type=float,
                   help="bf16 copies of int8 weights the kernel plan may keep per model, GiB: 0 none (default: "
                        "weights stay int8), -1 no limit (the fastest batched plan, ~3x the int8 size), else the "
                        "copies that save the most time per byte")  # fmt: skip
    p.add_argument("--step", choices=("auto", "eager", "graph"),
                   help="decode steps: graph (the step compiled ahead of time per range of batch sizes, from this "
                        "machine, the store, or built once per machine class after ready, in a builder process), eager, "
                        "or auto (default: graph on the CPU unless kernels = invariant; $PDSERVE_STEP)")
    p.add_argument("--max-loras", type=int, help="LoRA adapters kept in memory per model (default 16)")
    p.add_argument("--max-lora-mb", type=float, help="and their fp32 bytes at most, MiB (default 512)")
    p.add_argument("--measure-share", type=float,
                   help="a kernel measurement after ready takes at most this share of the time while serving (0.25)")
    p.add_argument("--advertise-url", help="the URL callers reach this node by, the only one it proves "
                   "(else $PDSERVE_ADVERTISE_URL, [node] advertise_url; default: its bind address and port)")
    p.add_argument("--token-file", default=None, help="file with the internal token (else $PDSERVE_INTERNAL_TOKEN)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as JSON and exit")


_SECRETS = {"internal_token": "set $PDSERVE_INTERNAL_TOKEN (or --token-file)",
            "store": "set the locations in [store]"}  # fmt: skip


def node_config(args, publisher: bool = False):
    """(NodeConfig, StoreConfig) from flags > environment > the config file's [node] and [store] > defaults.
    ``publisher``: keep the store's publisher key (the build job, compute/node/prebuild.py; a node drops it)."""
    from compute.node.config import NodeConfig, nixl_trusted_env
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
    store_cfg = store_config(args, tables=tables)
    if store_cfg.publisher_key is not None and not publisher:  # a serving process never holds what signs native code
        logging.getLogger("pdserve.node").warning("publisher key ignored: a serving node never holds it "
                                                  "(paramstore/publisher.py), it checks publisher_pubkey only")
        store_cfg = dataclasses.replace(store_cfg, publisher_key=None)
    flags = {"role": args.role, "model": args.model, "host": args.host, "port": args.port, "weights": args.weights,
             "kv_blocks": args.kv_blocks, "kv_dtype": args.kv_dtype, "block_size": args.block_size,
             "prefix_cache": args.prefix_cache, "peer_kv": args.peer_kv,
             "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_batched_tokens, "kv_transport": args.kv_transport,
             "kv_compression": args.kv_compression, "kv_hold_s": args.kv_hold_s, "kv_timeout_s": args.kv_timeout_s,
             "cache_dir": args.cache_dir, "cache_gb": args.cache_gb, "threads": args.threads,
             "memory_gb": args.memory_gb, "tpot_target_s": args.tpot_target_s,
             "import_nice": args.import_nice, "kernels": args.kernels, "device": args.device,
             "measure_share": args.measure_share, "weight_copies_gb": args.weight_copies_gb, "step": args.step,
             "advertise_url": args.advertise_url, "max_loras": args.max_loras,
             "max_lora_mb": args.max_lora_mb, "nixl_trusted_fabric": args.nixl_trusted_fabric}  # fmt: skip
    token = env_secret("PDSERVE_INTERNAL_TOKEN", args.token_file)  # --token-file, else $PDSERVE_INTERNAL_TOKEN[_FILE]
    env = {"cache_dir": os.environ.get("PDSERVE_CACHE_DIR") or None, "internal_token": token or None,
           "advertise_url": os.environ.get("PDSERVE_ADVERTISE_URL") or None, "step": os.environ.get("PDSERVE_STEP") or None,
           "nixl_trusted_fabric": True if nixl_trusted_env() else None}
    kw = resolve(NodeConfig, "node", tables, path, flags, env, hints=_SECRETS)
    if "role" not in kw:
        raise ConfigError("no role: pass --role or set role in [node] of the config file")
    kw.setdefault("internal_token", "")
    if getattr(args, "standby", False):
        if args.model:
            raise ConfigError("--standby and --model exclude each other: a standby runtime starts empty")
        kw.pop("model", None)  # [node] model is "load this at start" for a node of its own, not for a pool runtime
    return NodeConfig(store=store_cfg.locations, **kw), store_cfg


def _public(cfg, store_cfg) -> dict:
    """The resolved settings, secrets left out (for --print-config)."""
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "internal_token"}
    out["internal_token_set"] = bool(cfg.internal_token)
    out["store"] = {"locations": store_cfg.locations, "k": store_cfg.k, "m": store_cfg.m,
                    "shard_bytes": store_cfg.shard_bytes, "hmac": store_cfg.hmac_key is not None,
                    "publisher_pubkey": store_cfg.publisher_pubkey, "publisher_key": store_cfg.publisher_key is not None}  # fmt: skip
    return out


def heavy_imports(cfg) -> None:
    """Everything a model load needs, imported now (not on the first load)."""
    import importlib

    import torch  # noqa: F401
    import uvicorn  # noqa: F401

    import compute.engine.engine
    import compute.modeling.loader  # noqa: F401
    import paramstore.cache  # noqa: F401
    from compute.node import held, server  # noqa: F401

    if cfg.role != "both":
        from compute.kv_transfer.factory import BACKENDS

        try:
            importlib.import_module(BACKENDS[cfg.kv_transport][0])
        except ImportError:
            pass  # nixl not installed: the factory falls back to tcp at the first load


def import_niced(cfg) -> None:
    """``heavy_imports`` in a thread niced by ``cfg.import_nice`` (only that thread: the ones that
    serve are created later by the un-niced main thread)."""
    import threading

    failed: list[BaseException] = []

    def run():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), cfg.import_nice)
            heavy_imports(cfg)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            failed.append(e)

    t = threading.Thread(target=run, name="imports", daemon=True)
    t.start()
    t.join()
    if failed:
        raise failed[0]


def build(cfg, loop, store_cfg):
    """Store (of ``node_config``'s StoreConfig), node cache, model host (the start model's load begun), app."""
    import torch

    from compute.node.models import ModelHost
    from compute.node.server import create_app
    from paramstore import ParamStore
    from paramstore.cache import CacheConfig, NodeCache

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    store = ParamStore(store_cfg)
    cache = None
    if cfg.cache_dir:
        cache = NodeCache(CacheConfig(dir=cfg.cache_dir, disk_bytes=int(cfg.cache_gb * 2**30), memory_bytes=0))
    if (cfg.role != "both" or cfg.peer_kv) and cfg.kv_transport == "nixl":
        _nixl_agent()
    host = ModelHost(cfg, store, cache, loop)
    if cache is not None:
        import threading

        threading.Thread(target=host.survey, name="cache-survey", daemon=True).start()
    if cfg.model:
        from compute.node.errors import NodeBusy

        store.manifest(cfg.model)  # a missing model or a bad signature: one line, exit 2, before listening
        try:
            loop.run_until_complete(host.load(cfg.model, cfg.weights))
        except NodeBusy as e:
            raise ValueError(f"cannot load {cfg.model}: {e}") from None
    return create_app(host), host


def _nixl_agent() -> None:
    """This process's NIXL agent, created now (~0.5 s) rather than on the first load."""
    try:
        from compute.kv_transfer.nixl_agent import process_agent

        process_agent()
    except Exception as e:  # noqa: BLE001 - the factory falls back to tcp (logged, counted) at load
        logging.getLogger("pdserve.node").warning("nixl agent unavailable at start: %s", e)


def main(args) -> int:
    import uvicorn

    from compute.node.lifeline import hold

    hold()  # first: a node whose parent (`pdserve up`, the launcher) ends, even by SIGKILL, ends too
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg, store_cfg = node_config(args)
    if args.print_config:
        print(json.dumps(_public(cfg, store_cfg), indent=1))
        return 0
    if cfg.host in ("0.0.0.0", "::", "") and not cfg.advertise_url:
        logging.getLogger("pdserve.node").warning(
            "bound to %s without --advertise-url: this node proves itself for any host on port %d (a relay on "
            "another host and the same port could pass its proof off as its own); set $PDSERVE_ADVERTISE_URL",
            cfg.host or "*", cfg.port)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if cfg.host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if cfg.import_nice:
        import_niced(cfg)
    else:
        heavy_imports(cfg)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app, host = build(cfg, loop, store_cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", loop="asyncio"))
    print(f"pdserve node: role={cfg.role} model={cfg.model or '(standby)'} listening on http://{cfg.host}:{cfg.port}",
          file=sys.stderr, flush=True)  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal it stopped on, with the handler it
        signal.signal(sig, _stopping)  # found: this one, so that the close below runs (the default would end us first)
    try:
        loop.run_until_complete(server.serve())
    finally:
        host.close()  # engine threads, KV endpoints, a step-graph build (its builder process group killed) stopped
    return 0


def _stopping(signum: int, frame) -> None:
    """The stop signal again, after uvicorn's graceful shutdown: the node is closing already (a close that hangs is
    ended by the launcher's SIGKILL)."""
