"""A Llama-family decoder (Llama, Qwen2, Mistral without sliding window) in plain PyTorch.

Module names mirror transformers' (``model.layers.3.self_attn.q_proj.weight``),
so the parameter store's HF-named tensors load by name. The model is built on
the meta device and filled by ``load_weights``, which *assigns* tensors (int8
stays int8; a float weight is converted at most once, to the activation dtype).
``load_weights`` may be called many times with parts of the checkpoint (one
shard at a time); ``ready`` turns true once nothing is missing.

Shapes: T tokens in the flat batch, D hidden, H / KVH heads, Dh head dim,
F FFN width, V vocab, N rows with logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from compute.errors import WeightMismatch
from compute.kernels import int4
from compute.kernels.budget import copy_bytes_of, copy_plans
from compute.kernels.linear import (
    INT8MM_MAX_M,
    Embedding,
    FusedLinear,
    Linear,
    aligned,
    is_aligned,
)
from compute.modeling.attention import paged_attention
from compute.modeling.batch import ForwardBatch
from compute.modeling.config import ModelConfig
from compute.modeling.kv_cache import KVCache
from compute.modeling.lora import LoraRows

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here
RMS_NORM_MAX_ROWS = 64  # torch.rms_norm up to this many rows (decode: fewer calls), the in-place formula beyond


def linear_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """``(N, K)`` of every weight matmul of one forward, fused as built below (qkv, o, gate_up, down per
    layer; the LM head): what a memory estimate needs before any weight exists."""
    layer = [(c.q_size + 2 * c.kv_size, c.hidden_size), (c.hidden_size, c.q_size),
             (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]  # fmt: skip
    return layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, computed in fp32 like transformers."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps, self.dtype = eps, dtype
        self.register_buffer("weight", torch.empty(dim))

    def load(self, leaf: str, t: torch.Tensor) -> None:
        if leaf != "weight" or tuple(t.shape) != tuple(self.weight.shape):
            raise WeightMismatch(f"RMSNorm: unexpected {leaf} of shape {tuple(t.shape)}")
        self.weight = aligned(t if t.dtype == self.dtype else t.to(self.dtype))

    def missing(self) -> list[str]:
        return ["weight"] if self.weight.is_meta else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # bitwise the numbers of the formula below, in fewer calls (tests/compute/modeling/test_layer_ops.py):
            # torch.rms_norm (one call; it copies its input twice inside: 1.5x slower at 512 rows, 1 thread), or
            # the formula with its passes in place (products commute)
            if x.shape[0] <= RMS_NORM_MAX_ROWS:
                return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps))  # [T, 1]
            return torch.mul(x, r).mul_(self.weight)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions: [T] -> cos, sin: [T, 1, Dh] in ``dtype`` (non-interleaved halves, as HF).

    ``sin`` comes with the sign of ``rotate_half`` folded in (first half negated), so
    ``apply_rope`` only swaps the halves: ``[-x2, x1] * sin == [x2, x1] * [-sin1, sin2]`` exactly.
    """
    freqs = positions[:, None].to(torch.float32) * inv_freq[None, :]  # [T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
    sin = emb.sin()
    sin[:, : freqs.shape[1]].neg_()
    return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, Dh] -> ``x * cos + [x2, x1] * sin`` in cos's dtype (sin signed: see ``rope_cos_sin``).

    x is converted once, up front: a product of a bf16 and an fp32 tensor converts inside its loop, off the
    vectorized path (a 512-token prefill's RoPE took 1.3x as long that way, 1 thread); the halves are swapped by
    one ``roll``; the sum is taken in the other order (addition commutes: the same numbers)."""
    xf = x if x.dtype == cos.dtype else x.to(cos.dtype)  # [T, heads, Dh]
    return xf.roll(x.shape[-1] // 2, -1).mul_(sin).add_(xf * cos)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, dtype: torch.dtype, int8mm_max_m: int) -> None:
        super().__init__()
        self.layer, self.h, self.kvh, self.dh = layer, c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.qkv = FusedLinear(c.hidden_size, (c.q_size, c.kv_size, c.kv_size), c.qkv_bias, dtype, int8mm_max_m)
        self.q_proj, self.k_proj, self.v_proj = self.qkv.parts  # HF names; rows of qkv
        self.o_proj = Linear(c.q_size, c.hidden_size, c.o_bias, dtype, int8mm_max_m)
        self.aligned = False  # prefill queries in position-aligned blocks (kernels = invariant: Transformer.use_kernels)

    def forward(self, x, cos, sin, cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        t, h, kvh = x.shape[0], self.h, self.kvh
        # bf16 from int8mm as it is (RoPE promotes it to fp32 exactly); q and k rotated together, then rounded
        # once to the cache dtype, the dtype attention, the cache and o_proj's kernel read (the values of
        # rounding q, k and the output each on its own, with 3 fewer conversions per layer)
        qkv = self.qkv(x, cast=False)  # [T, (H + 2 KVH) Dh]
        if batch.lora is not None:  # each row's adapter (compute/modeling/lora.py)
            batch.lora.add(qkv, x, self.layer, "qkv")
        qkv = qkv.view(t, h + 2 * kvh, self.dh)  # [T, H + 2 KVH, Dh]
        qk = qkv[:, : h + kvh]  # [T, H + KVH, Dh]
        if qkv.dtype == cache.dtype:  # rotated q, k written back over their rows: q | k | v in one buffer, so the
            qk.copy_(apply_rope(qk, cos, sin))  # cache takes k and v in one write
            q, kv = qk[:, :h], qkv[:, h:]  # [T, H, Dh], [T, 2 KVH, Dh]
        else:
            qk = apply_rope(qk, cos, sin).to(cache.dtype)
            q, kv = qk[:, :h], torch.cat((qk[:, h:], qkv[:, h + kvh :].to(cache.dtype)), 1)  # [T, 2 KVH, Dh]
        o = paged_attention(q, kv, self.layer, cache, batch, self.scale, self.aligned)  # [T, H, Dh]
        o = o.reshape(t, h * self.dh)  # [T, H Dh]
        y = self.o_proj(o, cast=False)  # bf16 from int8mm: the residual add promotes
        return y if batch.lora is None else batch.lora.add(y, o, self.layer, "o")


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, dtype: torch.dtype, int8mm_max_m: int) -> None:
        super().__init__()
        self.layer, self.f = layer, c.intermediate_size
        self.gate_up = FusedLinear(c.hidden_size, (self.f, self.f), False, dtype, int8mm_max_m)
        self.gate_proj, self.up_proj = self.gate_up.parts  # HF names; rows of gate_up
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, False, dtype, int8mm_max_m)

    def forward(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        # x: [T, D] -> [T, 2F] -> [T, F] -> [T, D]
        # both halves to x's dtype in one contiguous conversion (a strided half, or a product of mixed dtypes,
        # converts off the vectorized path: 1.2x the time at 512 rows), then SiLU and the product in place
        gu = self.gate_up(x)  # [T, 2F] in x's dtype, a fresh tensor
        if lora is not None:
            lora.add(gu, x, self.layer, "gate_up")
        h = F.silu(gu[:, : self.f], inplace=True).mul_(gu[:, self.f :])  # [T, F]
        y = self.down_proj(h, cast=False)
        return y if lora is None else lora.add(y, h, self.layer, "down")


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, dtype: torch.dtype, int8mm_max_m: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, layer, dtype, int8mm_max_m)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c, layer, dtype, int8mm_max_m)

    def forward(self, x, cos, sin, cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, D], the forward's own residual stream (added to in place); the sublayers' outputs may be bf16
        # (int8 kernels): ``x += y`` stays in x's dtype
        x += self.self_attn(self.input_layernorm(x), cos, sin, cache, batch)
        return x.add_(self.mlp(self.post_attention_layernorm(x), batch.lora))


class DecoderStack(nn.Module):
    """transformers' ``model.*``: embedding, layers, final norm."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype, int8mm_max_m: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, int8mm_max_m) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)


class Transformer(nn.Module):
    """Causal LM over a paged KV cache: ``forward(batch, cache) -> logits [N, V] fp32``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, int8mm_max_m: int = INT8MM_MAX_M,
                 device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.model = DecoderStack(config, dtype, int8mm_max_m)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, int8mm_max_m)
        self.inv_freq = config.inv_freq(self.device)  # [Dh/2] fp32, a plain attribute (never on meta)
        self.aligned_copies = 0  # misaligned tensors ``load_weights`` got: each copied once, to aligned memory
        self._ready = False

    @classmethod
    def build(cls, config: ModelConfig, dtype: torch.dtype = torch.float32, **kw) -> Transformer:
        """Construct on the meta device: no memory until ``load_weights`` assigns tensors (moved to
        ``device``, one config value: the host by default)."""
        with torch.device("meta"):
            return cls(config, dtype, **kw).eval()

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Assign HF-named tensors (any subset, any order); returns how many were taken."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        taken = 0
        for name, t in items:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.config.tie_word_embeddings and name.startswith("lm_head."):
                continue  # tied: lm_head uses embed_tokens' tensors
            prefix, _, leaf = name.rpartition(".")
            try:
                module = self.get_submodule(prefix)
            except AttributeError:
                raise WeightMismatch(f"unknown tensor {name!r}") from None
            if not hasattr(module, "load"):
                raise WeightMismatch(f"unknown tensor {name!r}")
            if t.device != self.device:
                t = t.to(self.device)
            self.aligned_copies += not is_aligned(t)  # an older shard layout's view: ``load`` copies it once
            try:
                module.load(leaf, t)
            except WeightMismatch as e:
                raise WeightMismatch(f"{name}: {e}") from None
            taken += 1
        if self.config.tie_word_embeddings:
            self.lm_head.share(self.model.embed_tokens)
        self._ready = not self.missing_weights()
        return taken

    def missing_weights(self) -> list[str]:
        """HF names of tensors not loaded yet."""
        out = []
        for name, module in self.named_modules():
            if name == "lm_head" and self.config.tie_word_embeddings:
                continue
            if hasattr(module, "missing"):
                out.extend(f"{name}.{leaf}" for leaf in module.missing())
        return out

    @property
    def ready(self) -> bool:
        return self._ready

    def layers_loaded(self) -> int:
        """Decoder layers with every tensor present (progress of lazy injection)."""
        return sum(
            not any(hasattr(m, "missing") and m.missing() for m in layer.modules()) for layer in self.model.layers
        )

    # -- kernels ---------------------------------------------------------------------------

    def kernel_modules(self) -> list[Linear | FusedLinear]:
        """The linears that run a matmul with int8 weights (``use_kernels`` plans them)."""
        return [m for m in self.modules() if isinstance(m, (Linear, FusedLinear)) and m.int8_weight() is not None]

    def int8_shapes(self) -> list[tuple[int, int]]:
        """Distinct ``(N, K)`` of the int8 matmuls: what ``compute.kernels.int8.plan_for`` measures."""
        return sorted({tuple(m.int8_weight()[0].shape) for m in self.kernel_modules()})

    def kernel_plans(self, table: dict, mode: str = "measured", copy_budget: int | None = None) -> list:
        """(linear, its plan) for each int8 linear: the kernels ``table`` gives its shape under ``mode``, with bf16
        copies only within ``copy_budget`` bytes (None: no limit; ``compute.kernels.budget``)."""
        mods = self.kernel_modules()
        return list(zip(mods, copy_plans([tuple(m.int8_weight()[0].shape) for m in mods], table, mode, copy_budget)))

    def use_kernels(self, table: dict | None, mode: str = "measured", copy_budget: int | None = None) -> None:
        """Each int8 linear takes the kernels ``table`` gives its shape under ``mode`` (measured: the fastest
        per M bucket; invariant: one batch-invariant kernel; ``compute.kernels.int8.plan_of``), keeping bf16
        copies within ``copy_budget`` bytes (None: no limit); table None: the fixed rule."""
        if table is None:
            for m in self.kernel_modules():
                m.use_kernels(None)
        for m, plan in self.kernel_plans(table, mode, copy_budget) if table is not None else ():
            m.use_kernels(plan)
        for m in self.modules():
            if isinstance(m, Attention):  # a row's numbers independent of its prefill chunking too
                m.aligned = mode == "invariant"
        int8_copies = sum(copy_bytes_of(tuple(m.int8_weight()[0].shape)) for m in self.kernel_modules()
                          if "bf16" in (m.plan or ()))  # fmt: skip
        self.use_int4_copies(None if copy_budget is None else max(0, copy_budget - int8_copies),
                             mode if table is not None else "fixed")  # fmt: skip

    def int4_modules(self) -> list[Linear | FusedLinear]:
        """The linears that run int4 weights (``compute.kernels.int4``)."""
        return [m for m in self.modules() if isinstance(m, (Linear, FusedLinear)) and m.int4_weight() is not None]

    def use_int4_copies(self, budget: int | None, mode: str = "measured", faster=int4.copy_faster) -> int:
        """bf16 copies of int4 weights, in model order, while they fit ``budget`` bytes, under ``measured`` only and
        where ``faster(N, K)`` (this machine's bf16 GEMM beats int4mm at prefill M); no budget (None): none, the
        int4 size is the point of an int4 import (``compute.kernels.int4``). -> bytes of copies kept."""
        kept = 0
        for m in self.int4_modules():
            w, sz = m.int4_weight()
            n, k = w.shape[0], sz.shape[0] * int4.GROUP
            if budget is not None and mode == "measured" and kept + 2 * n * k <= budget and faster(n, k):
                if m.w_bf16 is None:
                    m.w_bf16 = aligned(int4.dequantized(w, sz, torch.bfloat16))
                kept += 2 * n * k
            else:
                m.w_bf16 = None
        return kept

    def prepare_kernels(self, table: dict, mode: str = "measured", copy_budget: int | None = None) -> None:
        """Make the copies ``table``'s plan needs (bf16 weights) without switching to it: ``use_kernels`` then
        only assigns plans (cheap, between two steps)."""
        for m, plan in self.kernel_plans(table, mode, copy_budget):
            m.prepare_plan(plan)

    # -- compute ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        if not self._ready:
            raise WeightMismatch(f"weights missing: {self.missing_weights()[:5]}...")
        x = self.model.embed_tokens(batch.input_ids)  # [T, D]
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, self.dtype)  # [T, 1, Dh]
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, batch)
        x = self.model.norm(x[batch.logits_rows])  # [N, D]: norm is per row, so select first
        return self.lm_head(x).to(torch.float32)  # [N, V]
