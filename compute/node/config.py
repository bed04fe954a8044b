"""Configuration of one compute node runtime (one slotted dataclass, validated).

A node runtime is not bound to a model: ``model`` is only what it loads at start (None: it starts
empty, *standby*); models are loaded and unloaded through its API within ``memory_gb``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "both")


NIXL_UNBOUNDED = (
    "kv_transport = nixl lets any peer that reaches this node's UCX port READ its whole KV cache, every tenant's, "
    "and over UCX's TCP transport any memory this node ever registered, deregistered or not: use it only on a "
    "fabric whose peers are all trusted ($PDSERVE_NIXL_TRUSTED_FABRIC=1, [node] nixl_trusted_fabric = true or "
    "`pdserve node --nixl-trusted-fabric`), or keep tcp (a one-time secret per transfer)")


def nixl_trusted_env() -> bool:
    """$PDSERVE_NIXL_TRUSTED_FABRIC says the fabric's NIXL peers are all trusted (1 or true)."""
    return os.environ.get("PDSERVE_NIXL_TRUSTED_FABRIC", "").lower() in ("1", "true")


@dataclass(slots=True)
class NodeConfig:
    """What a node serves and how."""

    role: str  # prefill | decode | both
    internal_token: str = ""  # shared secret: requests are signed with it, never carry it (compute/node/auth.py; required)
    model: str | None = None  # paramstore reference NAME[@vN] loaded at start; None: start standby
    store: list[str] = field(default_factory=list)  # store locations (empty: the local default)
    host: str = "127.0.0.1"
    port: int = 8001
    advertise_url: str | None = None  # the URL callers reach this node by: the only one it proves (else its bind address)
    weights: str = "int8"  # runtime weights: int8 (as stored) | bf16 | fp32
    kv_blocks: int = 2048  # KV cache blocks (x block_size tokens)
    kv_dtype: str = "auto"  # KV cache: auto (bf16; fp32 for fp32 weights) | bfloat16 | float32
    block_size: int = 16
    prefix_cache: bool = True  # reuse full KV blocks by content across requests (compute/engine/prefix_cache.py)
    peer_kv: bool = True  # any role exports its cached prefixes to peers and pulls theirs (compute/node/peer.py;
    # a KV sender and receiver on every node, device cpu)
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # tokens per step (the prefill chunk budget)
    kv_transport: str = "tcp"  # nixl | tcp | fake (prefill and decode roles)
    # nixl only with this set: NIXL cannot bound what a peer READs (NIXL_UNBOUNDED below, docs/security.md)
    nixl_trusted_fabric: bool = False
    kv_compression: str = "none"  # none | bf16 | fp16 | int8 on the wire (prefill side chooses)
    kv_hold_s: float = 30.0  # prefill: hold a request's KV this long for the decode side
    kv_timeout_s: float = 10.0  # decode: a transfer not done by then fails (the gateway retries)
    cache_dir: str | None = None  # node-local shard cache (disk tier); None: no cache
    cache_gb: float = 8.0
    threads: int = 0  # torch threads; 0 = torch's default
    memory_gb: float = 0.0  # budget for weights + KV cache of every held model; 0 = half of MemAvailable at start
    tpot_target_s: float = 0.1  # the step time at which the capacity report's max_streams is taken
    device: str = "cpu"  # torch device of weights, KV cache and sampling (cpu | cuda | cuda:N ...)
    kernels: str = "measured"  # int8 kernels, per machine class: from the store's plan, the machine's cache
    # (cache_dir or ~/.cache/pdserve), else the safe rule until measured off the request path: measured (the fastest per M bucket) | invariant (one batch-invariant kernel per shape) | fixed (the old rule)
    weight_copies_gb: float = 0.0  # bf16 copies of int8 weights the kernel plan may keep per model, GiB: 0 = none (the
    # default: runtime weights = the int8 size; batched steps run native/w8a16/otf instead, 0.95x the copies' rate at 32
    # streams on the Zen 4 box), -1 = no limit (each linear whose measured plan runs bf16 keeps one: SmolLM2 3.0x its int8
    # size), else the copies that save the most time per byte (compute/kernels/budget.py)
    measure_share: float = 0.25  # a kernel measurement after ready (no plan in the store or the machine's cache)
    # takes at most this share of the time while the engine has work (all of it while idle); niced either way
    step: str = "auto"  # decode steps: eager | graph (pure-decode batches through the step compiled ahead of time per
    # range of batch sizes, taken after ready from this machine, the store, or built once per machine class in a
    # builder process and published: compute/engine/step_graphs.py; on cuda captured as CUDA graphs:
    # compute/engine/cuda_graphs.py) | auto (graph on the CPU where it may run: kernels measured or fixed; else eager)
    import_nice: int = 0  # heavy imports in a thread niced by this much (pool refill); serving threads are not
    max_loras: int = 16  # LoRA adapters kept in memory per model (compute/node/adapters.py; the rest fetched again)
    max_lora_mb: float = 512.0  # and their bytes at most (fp32 pairs), whichever bound comes first

    @property
    def compiled_step(self) -> bool:
        """Whether decode steps run compiled (``step``: graph, or auto on the CPU without ``invariant`` kernels; a
        prefill node decodes nothing)."""
        auto = self.step == "auto" and self.device == "cpu" and self.kernels != "invariant"
        return (self.step == "graph" or auto) and self.role != "prefill"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"invalid role {self.role!r}: one of {', '.join(ROLES)}")
        if not self.internal_token:
            raise ValueError("an internal token is required (PDSERVE_INTERNAL_TOKEN or --token-file)")
        if self.kv_transport == "nixl" and not self.nixl_trusted_fabric:
            raise ValueError(NIXL_UNBOUNDED)
        if self.advertise_url is not None and not self.advertise_url.startswith(("http://", "https://")):
            raise ValueError(f"advertise_url {self.advertise_url!r} is not an http(s) URL")
        if self.weights not in ("int8", "bf16", "fp32"):
            raise ValueError(f"invalid weights {self.weights!r}: int8, bf16 or fp32")
        if self.max_loras < 1 or self.max_lora_mb <= 0:
            raise ValueError("max_loras must be >= 1 and max_lora_mb > 0")
        if min(self.kv_blocks, self.block_size, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError("kv_blocks, block_size, max_num_seqs, max_num_batched_tokens must be >= 1")
        if not 0 < self.kv_timeout_s < self.kv_hold_s:
            raise ValueError("need 0 < kv_timeout_s < kv_hold_s")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError("model must be a non-empty NAME[@vN] (or unset: start standby)")
        if self.kv_dtype not in ("auto", "bfloat16", "float32"):  # compute.modeling.kv_cache.KV_DTYPES (no torch import here)
            raise ValueError(f"invalid kv_dtype {self.kv_dtype!r}: auto, bfloat16 or float32")
        if self.device != "cpu" and self.role != "both":
            raise ValueError(f"role {self.role!r} hands its KV over host memory: it needs device 'cpu'")
        if self.kernels not in ("measured", "invariant", "fixed"):  # compute.kernels.int8.MODES (no torch import here)
            raise ValueError(f"invalid kernels {self.kernels!r}: measured, invariant or fixed")
        if self.memory_gb < 0 or self.tpot_target_s <= 0:
            raise ValueError("need memory_gb >= 0 (0: half of MemAvailable) and tpot_target_s > 0")
        if not (self.weight_copies_gb == -1 or self.weight_copies_gb >= 0):
            raise ValueError(f"invalid weight_copies_gb {self.weight_copies_gb!r}: -1 (no limit: the bf16 copies the "
                             "measured plan picks), 0 (none: weights stay int8) or a budget in GiB > 0")
        if self.step not in ("eager", "graph", "auto"):
            raise ValueError(f"invalid step {self.step!r}: eager, graph or auto")
        if self.step == "graph" and (self.device.split(":")[0] not in ("cpu", "cuda") or self.kernels == "invariant"):
            raise ValueError("step = graph runs on device cpu (compiled) or cuda (CUDA graphs) with kernels "
                             "measured or fixed (a compiled step sums in another order than the batch-invariant "
                             "kernels): set step = eager")  # fmt: skip
        if not 0 < self.measure_share <= 1:
            raise ValueError("measure_share must be in (0, 1]")
        if not 0 <= self.import_nice <= 19:
            raise ValueError("import_nice must be in [0, 19]")
