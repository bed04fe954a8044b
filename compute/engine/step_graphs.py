"""The decode step compiled ahead of time, per range of batch sizes: which graphs, loading one, running it.

Lifecycle of one model's graphs on one node (``[node] step = "graph"``, the default on the CPU):
 1. the node serves eagerly from ready: nothing is compiled on the request path;
 2. for every range of batch sizes over which each linear runs the same kernel (``ranges``), a package is taken
    off the request path — this machine's, the store's, or built in a builder process and published — by the
    node's ``GraphBuilder`` (``compute/node/graph_builder.py``: a machine-class artefact, like a kernel plan);
 3. a package is loaded (``load_package``: dlopen, no compile) with the model's own tensors bound as its constants
    (no copy) and posted to the engine thread, which installs it only if the model still runs the kernels it was
    built for;
 4. ``StepGraphs.decode`` runs a pure-decode batch whose size an installed graph covers; prefill, mixed batches,
    prompt logprobs and uncovered sizes stay eager. A kernel-plan swap drops every graph and the builder re-runs.

A package's id: sha256 of the machine key, the graph's spec (kernel per linear, every bound tensor's name, shape
and dtype, dims, batch range, KV dtype; not the weights' values: models of one architecture share packages) and
the source of ``compute/modeling/graph_step.py``: 16 hex digits. The graph only reads the KV cache;
``GraphStep.write`` stores the step's K/V after it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compute.kernels import int4, native
from compute.modeling.graph_step import GraphStep, step_inputs
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer

log = logging.getLogger("pdserve.node")
SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "modeling", "graph_step.py")


@dataclass(slots=True)
class Graph:
    """One installed graph: batch sizes ``lo..hi``, keys up to ``max_keys``; ``fn`` the loaded package."""

    lo: int
    hi: int
    max_keys: int
    step: GraphStep
    fn: Callable
    gid: str


def ranges(model: Transformer, max_streams: int) -> list[tuple[int, int]]:
    """Batch sizes 1..max_streams cut where a linear's kernel changes; size 1 alone (``torch.export`` takes a
    dynamic size of 1 as a constant)."""
    out: list[tuple[int, int]] = []
    last = None
    for m in range(1, max_streams + 1):
        kinds = GraphStep(model, m).kinds
        if m == 2 or kinds != last:
            out.append((m, m))
        else:
            out[-1] = (out[-1][0], m)
        last = kinds
    return out


def spec(model: Transformer, lo: int, hi: int, cache: KVCache) -> dict:
    """What a package depends on besides the machine and the model's weights (``graph_id``)."""
    c, step = model.config, GraphStep(model, lo)
    tensors = {k: [list(t.shape), str(t.dtype)] for k, t in step.named_buffers()}
    return {"batch": [lo, hi], "kinds": step.kinds, "tensors": tensors, "alias": step.alias,
            "absent": sorted(step.absent), "eps": c.rms_norm_eps, "kv_dtype": str(cache.dtype),
            "block_size": cache.block_size, "max_keys": max_keys(model, cache),
            "dims": [c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size,
                     c.vocab_size]}  # fmt: skip


def max_keys(model: Transformer, cache: KVCache) -> int:
    bs = cache.block_size
    return -(-model.config.max_position_embeddings // bs) * bs


def graph_id(machine_key: str, model_key: str, sp: dict) -> str:
    with open(SOURCE, "rb") as f:
        code = hashlib.sha256(f.read()).hexdigest()
    raw = json.dumps({"machine": machine_key, "model": model_key, "spec": sp, "code": code}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


FOLDED = "_FOLDED_CONST_"  # a constant the package computes from the bound ones at load (runtime constant folding)


def load_package(path: str, step: GraphStep) -> Callable:
    """The package at ``path`` as a callable over ``step``'s tensors (bound by reference: no copy). Besides them it
    wants one 0-d int64 constant per int4 linear, named ``constantN`` by the compiler: the kernel's group size
    (``_weight_int4pack_mm_cpu_tensor`` takes it as a tensor); any other unknown constant refuses the package."""
    native.available()  # a package that runs the native kernel calls its registered op
    fn = torch._inductor.aoti_load_package(path)
    consts = dict(step.named_buffers())
    wanted = [n for n in fn.get_constant_fqns() if not n.startswith(FOLDED)]
    unknown = sorted(set(wanted) - set(consts))
    int4s = sum(k == "int4" for k in step.kinds.values())
    if unknown and (len(unknown) != int4s or not all(n.startswith("constant") for n in unknown)):
        raise ValueError(f"step graph package wants tensors this model does not have: {unknown[:3]}")
    group = torch.tensor(int4.GROUP, dtype=torch.int64)
    bound = {k: unowned(consts[k]) for k in wanted if k in consts} | dict.fromkeys(unknown, group)
    fn.load_constants(bound, check_full_update=True, user_managed=True)
    return fn


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it alive. AOTInductor's loader keeps a reference to every
    user-managed constant for the life of the process (torch 2.13: a heap copy of each handle, never deleted, even
    once the package is dropped): bound directly, a model's weights stayed pinned after its unload (the soak: +130 to
    150 MiB per load and unload of SmolLM2). Bound through these, the weights are freed with the model; the graphs
    holding them are dropped first (the engine stops before its model is freed: compute/node/held.py ``free``)."""
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return t
    raw = torch.frombuffer((ctypes.c_char * st.nbytes()).from_address(st.data_ptr()), dtype=torch.uint8)
    return raw.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())


class StepGraphs:
    """The graphs installed on one engine (its thread only): ``decode`` a batch through one, else None."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []
        self.steps = 0  # decode steps run through a graph

    def install(self, g: Graph) -> None:
        self.graphs = [x for x in self.graphs if x.hi < g.lo or x.lo > g.hi] + [g]

    def clear(self) -> int:
        n, self.graphs = len(self.graphs), []
        return n

    def covers(self, b: int) -> Graph | None:
        return next((g for g in self.graphs if g.lo <= b <= g.hi), None)

    def decode(self, tokens: list[int], positions: list[int], tables: list[list[int]],
               cache: KVCache) -> torch.Tensor | None:  # fmt: skip
        """One decode token per sequence -> logits [B, V] fp32 and the cache written; None: no graph covers it."""
        g = self.covers(len(tokens))
        bs = cache.block_size
        n = -(-(max(positions) + 1) // bs) * bs
        if g is None or n > g.max_keys or n < 2:
            return None
        ids, pos, slots, ctx_slots, ctx_lens = step_inputs(tokens, positions, tables, bs, n)
        try:
            logits, fresh = g.fn(ids, pos, ctx_slots, ctx_lens, cache.kv)
        except Exception as e:  # noqa: BLE001 - the graph only read the cache: this step runs eagerly instead
            log.error("step graph %s (batch %d-%d) failed and is dropped, eager from now: %s: %s", g.gid, g.lo, g.hi,
                      type(e).__name__, e)  # fmt: skip
            self.graphs = [x for x in self.graphs if x is not g]
            return None
        g.step.write(cache.kv, slots, fresh)
        self.steps += 1
        return logits
