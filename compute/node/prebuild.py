"""`pdserve prebuild --model M`: the build job of a machine class. What a node would measure and compile for this
machine (the int8 kernel plan, then one compiled decode step per batch range) is made here and published to the
store signed with the publisher key, so that serving nodes, which hold only the public key and never publish,
take it from the store at load instead of each building its own (paramstore/publisher.py, docs/security.md).

Lifecycle: the node's own model host loads M in this process as a `both` node with the compiled step would (no
HTTP, nothing served), on a machine cache of its own (a temporary folder: what this machine cached before is
neither trusted nor published by that); the kernel plan is taken from the store or measured and published; then
each batch range's package is taken from the store or built (by the node's builder process) and published;
once every one is taken (``--timeout-s`` at most) it prints where each came from and exits 0. Without the
publisher key: one line, exit 2, before anything loads. Run it on one machine of each class (a CI job, an
admin's box, a Kubernetes Job with the key's Secret), after each import, with the nodes' ``--threads`` and
``--max-num-seqs`` (the thread count is part of the machine class; the batch ranges follow the sequences).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import sys
import tempfile
import time


def add_arguments(p) -> None:
    from compute.node.main import add_arguments as node_arguments

    node_arguments(p)
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up after this long (default 3600)")


def main(args) -> int:
    from compute.node.main import build, heavy_imports, node_config
    from paramstore.config import ConfigError

    args.role, args.step, args.standby = args.role or "both", "graph", False
    if not args.model:
        raise ConfigError("--model NAME[@vN]: the model whose kernel plan and step packages to build")
    os.environ.setdefault("PDSERVE_INTERNAL_TOKEN", secrets.token_hex(16))  # nothing listens: nothing to sign
    cfg, store_cfg = node_config(args, publisher=True)
    if store_cfg.publisher_key is None:
        raise ConfigError("prebuild publishes what it builds, signed: set [store] publisher_key_file or "
                          "$PDSERVE_PUBLISHER_KEY_FILE (made by `paramstore keygen`)")  # fmt: skip
    heavy_imports(cfg)
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory(prefix="pdserve-prebuild-") as tmp:
        cfg = dataclasses.replace(cfg, cache_dir=tmp, cache_gb=1.0)
        _, host = build(cfg, loop, store_cfg)  # loads the model: its kernel plan is taken or measured now
        try:
            held = host.models[cfg.model]
            deadline = time.monotonic() + args.timeout_s
            while held.state == "loading" and time.monotonic() < deadline:  # the load runs in a thread of its own
                time.sleep(0.1)
            if held.state != "ready":
                raise RuntimeError(f"{cfg.model} did not load: {held.error or held.state}")
            if not held.injector.plan_settled(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the kernel plan was not settled in {args.timeout_s:g} s")
            if held.graphs is None:
                raise ConfigError(f"{cfg.model}: no compiled decode step for these weights ({cfg.weights})")
            if not held.graphs.wait_idle(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the step packages were not all taken in {args.timeout_s:g} s")
            kernels = held.injector.kernel_state()
            graphs = held.graphs.state(None)["sources"]
        finally:
            host.close()
            loop.close()
    print(f"pdserve prebuild: {cfg.model}: kernel plan {kernels['source'] or 'none'} ({kernels['measure']}); "
          + ", ".join(f"step package {gid} {source}" for gid, source in sorted(graphs.items()))
          + " — in the store, signed", file=sys.stderr)  # fmt: skip
    return 0
