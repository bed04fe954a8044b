"""The engine's decode step as one pure-tensor function a compiler can take whole.

    GraphStep(model, streams)(ids, positions, ctx_slots, ctx_lens, kv) -> (logits [B, V] fp32, new K/V)
    GraphStep.write(kv, slots, new K/V)

``model`` is a loaded ``compute.modeling.model.Transformer`` with the int8 runtime (fp32 activations and residual,
int8 or int4 linears, a bf16 KV cache); its tensors are registered here as buffers by reference (no copy), and
each linear's kernel is fixed at construction from its plan for ``streams`` rows (``compute.kernels.int8.bucket``:
int8mm / bf16 copy; int4mm), so the function holds no Python decision that depends on a tensor's value or address.
Per layer it does what ``Transformer.forward`` does for a batch of decodes (``paged_attention`` with
``DecodeGroup.only``), in the same dtypes and order, as index ops on the cache tensor ``kv`` it is handed:

1. RMSNorm, the fused qkv linear (bf16 out), RoPE on q and k in fp32 rounded once to bf16;
2. the context gathered at ``ctx_slots`` (``[B, L]``, ``L`` a fixed bucket) from the cache as it was, this step's
   own K/V put in at each row's position (``torch.where``: the values a write then a read would give); keys at or
   past ``ctx_lens`` masked by an additive -inf bias made inside the graph; two fp32 batched matmuls, a softmax,
   o_proj;
4. the MLP (gate/up fused, SiLU * up, down); the final norm and the head (int8, tied to the embedding).

The graph reads the cache and returns the step's K/V of every layer; ``write`` stores them (one ``index_copy_``).
Writing inside the graph (``index_copy_`` on the input, then the gather) made inductor copy each layer's whole
cache per step (a functionalized mutation read back: 294 ms per step on a 512-block cache, vs 15 ms eager).

``step_inputs`` turns the engine's plain lists (tokens, positions, block tables) into those tensors for a bucket.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from compute.kernels import int4, int8
from compute.kernels.nocopy import w8a16
from compute.modeling.model import Transformer, apply_rope, rope_cos_sin

BUCKET_MULTIPLE = 64  # context keys per call are padded to a multiple of this (one graph per bucket)


def bucket_len(ctx: int, multiple: int = BUCKET_MULTIPLE) -> int:
    return -(-ctx // multiple) * multiple


class GraphStep(nn.Module):
    """One decode step of ``streams`` sequences over a paged KV cache, as a pure-tensor function (module doc)."""

    def __init__(self, model: Transformer, streams: int) -> None:
        super().__init__()
        c = model.config
        if model.dtype != torch.float32:
            raise ValueError(f"GraphStep mirrors the int8 runtime (fp32 activations), got {model.dtype}")
        self.nl, self.h, self.kvh, self.dh = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
        self.f, self.eps, self.scale = c.intermediate_size, c.rms_norm_eps, c.head_dim**-0.5
        self.exact = math.frexp(self.scale)[0] == 0.5  # a power of two: the score matmul's alpha (as ``_decode``)
        self.kinds: dict[str, str] = {}  # linear name -> kernel: int4 | int8mm | bf16 | float
        self.alias: dict[str, str] = {}  # a tensor kept twice (the tied head's weight) -> the buffer that holds it
        self.absent: set[str] = set()  # tensors the model does not have (biases)
        self._keep("inv_freq", model.inv_freq)
        emb = model.model.embed_tokens
        self._keep("emb_w", emb.weight)
        self._keep("emb_s", emb.weight_scale if emb.is_int8 else None)
        for i, layer in enumerate(model.model.layers):
            self._keep(f"n{i}_in", layer.input_layernorm.weight)
            self._keep(f"n{i}_post", layer.post_attention_layernorm.weight)
            self._linear(f"l{i}_qkv", layer.self_attn.qkv, streams)
            self._linear(f"l{i}_o", layer.self_attn.o_proj, streams)
            self._linear(f"l{i}_gu", layer.mlp.gate_up, streams)
            self._linear(f"l{i}_down", layer.mlp.down_proj, streams)
        self._keep("n_final", model.model.norm.weight)
        self._linear("head", model.lm_head, streams)

    @classmethod
    def skeleton(cls, spec: dict) -> GraphStep:
        """A step of random tensors with ``spec``'s names, shapes, dtypes, aliases, absent tensors and kernels
        (``compute.engine.step_graphs.spec``): what a builder process traces. A package holds no weights (a node
        binds its own tensors at load), but inductor folds a constant whose elements are all equal into the code
        (``constant_fold_uniform_value``): zeros would be compiled in, so no two elements are alike here."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.nl, self.h, self.kvh, self.dh, _, self.f, _ = spec["dims"]
        self.eps, self.scale = spec["eps"], self.dh**-0.5
        self.exact = math.frexp(self.scale)[0] == 0.5
        self.kinds, self.alias, self.absent = dict(spec["kinds"]), dict(spec["alias"]), set(spec["absent"])
        gen = torch.Generator().manual_seed(0)
        for name, (shape, dtype) in spec["tensors"].items():
            dt = getattr(torch, dtype.removeprefix("torch."))
            if dt.is_floating_point:
                t = (torch.rand(shape, generator=gen) + 0.5).to(dt)
            else:
                info = torch.iinfo(dt)
                t = torch.randint(max(info.min, -127), min(info.max, 127) + 1, shape, generator=gen, dtype=dt)
            self.register_buffer(name, t, persistent=False)
        return self

    def _keep(self, name: str, t: torch.Tensor | None) -> None:
        """Register ``t`` as a buffer by reference, once (``torch.export`` rejects one tensor under two names)."""
        if t is None:
            self.absent.add(name)
            return
        same = [k for k, b in self._buffers.items() if b is t]
        if same:
            self.alias[name] = same[0]
        else:
            self.register_buffer(name, t, persistent=False)

    def _t(self, name: str) -> torch.Tensor | None:
        return None if name in self.absent else getattr(self, self.alias.get(name, name))

    def _linear(self, name: str, lin, m: int) -> None:
        """Register ``lin``'s tensors as ``{name}_w`` (+ ``_s``, ``_b``) and fix its kernel for ``m`` rows."""
        bias = getattr(lin, "b", None) if hasattr(lin, "parts") else lin.bias
        self._keep(f"{name}_b", bias)
        q4, q8 = lin.int4_weight(), lin.int8_weight()
        if q4 is not None:
            if lin.w_bf16 is not None and m > int4.COPY_MIN_M:
                self.kinds[name] = "bf16"
                self._keep(f"{name}_w", lin.w_bf16)
            else:
                self.kinds[name] = "int4"
                self._keep(f"{name}_w", q4[0])
                self._keep(f"{name}_s", q4[1])
            return
        if q8 is None:
            self.kinds[name] = "float"
            self._keep(f"{name}_w", lin.w if hasattr(lin, "parts") else lin.weight)
            return
        if lin.plan is not None:
            kernel = lin.plan[int8.bucket(m)]
        else:  # the fixed rule (``compute.kernels.linear.matmul``): int8mm on the host, dequantized elsewhere
            host = q8[0].device.type == "cpu" and q8[0].shape[1] % int8.INT8MM_K_MULTIPLE == 0
            kernel = "int8mm" if host and m <= lin.int8mm_max_m else "dequant"
        if kernel not in ("int8mm", "bf16", "w8a16", "otf", "dequant", "native"):
            raise ValueError(f"{name}: the graph step runs int8mm, w8a16, otf, dequant, native or a bf16 copy, the plan "
                             f"says {kernel!r} at M = {m}")  # fmt: skip
        self.kinds[name] = kernel
        if kernel == "bf16":
            self._keep(f"{name}_w", lin.w_bf16)
        elif kernel in ("w8a16", "dequant", "native"):
            self._keep(f"{name}_w", q8[0])
            self._keep(f"{name}_s", q8[1])  # fp32 [N]
        else:
            self._keep(f"{name}_w", q8[0])
            scale_bf16 = lin.scale_bf16 if hasattr(lin, "parts") else lin._scale_act
            self._keep(f"{name}_s", scale_bf16)

    def _lin(self, name: str, x: torch.Tensor, cast: bool) -> torch.Tensor:
        # x: [M, K] fp32 -> [M, N]: bf16 from a kernel (cast=False), else x's dtype (as ``compute.kernels.linear``)
        kind, w, b = self.kinds[name], self._t(f"{name}_w"), self._t(f"{name}_b")
        if kind == "float":
            return F.linear(x, w, b)  # as ``compute.kernels.linear.matmul`` for a float weight
        if kind == "int4":  # (compiled, the group size becomes a 0-d int64 constant of the package)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), w, int4.GROUP,
                                                           self._t(f"{name}_s"))  # fmt: skip
        elif kind == "int8mm":
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), w, self._t(f"{name}_s"))
        elif kind == "native":  # fp32 out (``compute.kernels.native``: a registered op, traced by its fake kernel)
            y = torch.ops.pdserve.int8_linear(x, w, self._t(f"{name}_s"))
        elif kind == "w8a16":  # fp32 out (``compute.kernels.nocopy``)
            y = w8a16(x, w, self._t(f"{name}_s"))
        elif kind == "dequant":  # fp32 (``compute.kernels.int8.dequantize_scratch``): a device without int8mm
            y = F.linear(x.to(torch.float32), w * self._t(f"{name}_s")[:, None])
        elif kind == "otf":  # the int8 weight as bf16 for this call only (``compute.kernels.nocopy.otf_weight``)
            y = F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).mul_(self._t(f"{name}_s"))
        else:  # bf16 copy
            y = F.linear(x.to(torch.bfloat16), w)
        if cast and y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if b is None else y + b

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.rms_norm(x, w.shape, w, self.eps)  # fp32, <= 64 rows: RMSNorm.forward's path

    def _attention(self, i: int, x, cos, sin, kvl, new, flat, bias, b: int, n: int) -> tuple[torch.Tensor, ...]:
        # x: [B, D] -> [B, D] bf16, and this step's K/V [2, B, KVH*Dh]; kvl: [2, NB*BS, KVH*Dh] (layer i of the
        # cache, read only: read at flat, this step's own key taken where new [B, L] is true)
        h, kvh, dh = self.h, self.kvh, self.dh
        qkv = self._lin(f"l{i}_qkv", x, cast=False).view(b, h + 2 * kvh, dh)  # [B, H + 2 KVH, Dh] bf16
        qk = apply_rope(qkv[:, : h + kvh], cos, sin).to(kvl.dtype)  # [B, H + KVH, Dh]: rounded once
        src = torch.stack((qk[:, h:].reshape(b, kvh * dh), qkv[:, h + kvh :].reshape(b, kvh * dh)))  # [2, B, KVH*Dh]
        src = src.to(kvl.dtype)
        ctx = kvl.index_select(1, flat).view(2, b, n, kvh * dh)  # [2, B, L, KVH*Dh]: the cache before this step
        ctx = torch.where(new[None, :, :, None], src[:, :, None, :], ctx).view(2, b, n, kvh, dh)  # as if written
        kv32 = ctx.transpose(2, 3).to(torch.float32).reshape(2, b * kvh, n, dh)  # [2, B*KVH, L, Dh]
        qg = qk[:, :h].to(torch.float32)
        qg = (qg if self.exact else qg * self.scale).reshape(b * kvh, h // kvh, dh)  # [B*KVH, G, Dh]
        s = torch.baddbmm(bias, qg, kv32[0].transpose(1, 2), alpha=self.scale if self.exact else 1.0)  # [B*KVH, G, L]
        o = torch.bmm(torch.softmax(s, -1), kv32[1]).view(b, h * dh).to(kvl.dtype)  # [B, H*Dh]
        return self._lin(f"l{i}_o", o, cast=False), src

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx_slots: torch.Tensor, ctx_lens: torch.Tensor,
                kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # ids, positions, ctx_lens: [B] long; ctx_slots: [B, L] long; kv: [NL, 2, NB, BS, KVH, Dh], read only
        # -> logits [B, V] fp32, this step's K/V [NL, 2, B, KVH*Dh] (``write`` stores them)
        b, n = ctx_slots.shape
        kvs = kv.view(self.nl, 2, -1, self.kvh * self.dh)  # [NL, 2, NB*BS, KVH*Dh]
        if self._t("emb_s") is None:
            x = F.embedding(ids, self._t("emb_w"))
        else:
            x = self._t("emb_w")[ids].to(torch.float32) * self._t("emb_s")[ids, None]  # [B, D] fp32
        cos, sin = rope_cos_sin(self._t("inv_freq"), positions, torch.float32)  # [B, 1, Dh]
        g = self.h // self.kvh
        off = torch.arange(n, device=ids.device)[None, :] >= ctx_lens[:, None]  # [B, L]: past the context
        bias = torch.zeros(b, n, device=ids.device).masked_fill(off, float("-inf"))
        bias = bias.view(b, 1, 1, n).expand(b, self.kvh, g, n).reshape(b * self.kvh, g, n)  # [B*KVH, G, L]
        flat = ctx_slots.reshape(-1)
        new = torch.arange(n, device=ids.device)[None, :] == positions[:, None]  # [B, L]: this step's key
        fresh = []
        for i in range(self.nl):
            y, kv_i = self._attention(i, self._norm(x, self._t(f"n{i}_in")), cos, sin, kvs[i], new, flat,
                                      bias, b, n)  # fmt: skip
            x, fresh = x + y, fresh + [kv_i]
            gu = self._lin(f"l{i}_gu", self._norm(x, self._t(f"n{i}_post")), cast=True)  # [B, 2F] fp32
            x = x + self._lin(f"l{i}_down", F.silu(gu[:, : self.f]) * gu[:, self.f :], cast=False)
        return self._lin("head", self._norm(x, self._t("n_final")), cast=True).to(torch.float32), torch.stack(fresh)

    def write(self, kv: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> None:
        """Store a step's K/V (``forward``'s second output, ``[NL, 2, B, KVH*Dh]``) at ``slots: [B]`` of every layer:
        one ``index_copy_``, outside the graph (inside, the compiler copies each layer's whole cache: measured)."""
        kv.view(self.nl, 2, -1, self.kvh * self.dh).index_copy_(2, slots, fresh)


def step_inputs(tokens: list[int], positions: list[int], tables: list[list[int]], block_size: int,
                n: int | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One decode token per sequence -> (ids, positions, slots, ctx_slots [B, n], ctx_lens) for ``GraphStep``;
    ``n``: the bucket's keys (default: the longest context rounded up to ``BUCKET_MULTIPLE``); padding -> slot 0."""
    ctx = [p + 1 for p in positions]
    n = n or bucket_len(max(ctx))
    nb = -(-n // block_size)
    padded = torch.tensor([t[:nb] + [0] * (nb - len(t[:nb])) for t in tables], dtype=torch.long)  # [B, nb]
    ctx_slots = (padded[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :n].contiguous()
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    return (torch.tensor(tokens, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
            torch.tensor(slots, dtype=torch.long), ctx_slots, torch.tensor(ctx, dtype=torch.long))  # fmt: skip


def graph_args(inputs: tuple[torch.Tensor, ...], kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``step_inputs``' tensors and the cache -> ``GraphStep.forward``'s arguments (the slots are ``write``'s)."""
    ids, positions, _, ctx_slots, ctx_lens = inputs
    return ids, positions, ctx_slots, ctx_lens, kv


def decode(fn, step: GraphStep, inputs: tuple[torch.Tensor, ...], kv: torch.Tensor) -> torch.Tensor:
    """One step through ``fn`` (``step`` itself, or it compiled) -> logits [B, V]; the cache written."""
    logits, fresh = fn(*graph_args(inputs, kv))
    step.write(kv, inputs[2], fresh)
    return logits
