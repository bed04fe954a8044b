"""Attention over the paged KV cache, on CPU with ``F.scaled_dot_product_attention``.

Per layer: write this step's K/V into their slots, then

- each prefill (or prefill chunk) gathers its own context and attends with a
  causal mask shifted by the cached prefix (query at position ``p`` sees keys
  ``<= p``);
- all single-token decodes gather their contexts padded to the longest one (K and
  V in one ``index_select`` over the per-step slot table of ``ForwardBatch``) and
  attend together with a key-padding mask (none when nothing is padded): two batched
  fp32 matmuls and a softmax, 1.2-2.8x faster than SDPA for one query per row (``_decode``).
  A batch of decodes only skips the row gather and scatter.

Every call's keys are a multiple of ``compute.modeling.batch.KEY_MULTIPLE`` (16), the extra ones masked,
and the causal mask is explicit: that keeps a row's numbers independent of its batch (the reason is
in ``compute/modeling/batch.py``). Independent of its prefill chunking too only with ``aligned`` (the model sets
it under ``kernels = invariant``): SDPA's CPU kernel computes a query row by the block of queries it
falls in, so queries then go in blocks aligned to absolute positions (``_aligned_prefill``).

GQA/MQA uses SDPA's ``enable_gqa`` (no repeated K/V); decodes view q's heads by their KV head instead.
Prefill attention runs in the cache's dtype (bf16 by default: q is cast once, K/V are read as stored);
decode attention reads K/V as stored and computes in fp32; both return q's dtype. Every SDPA call gets 4-D
``[B, heads, L, Dh]`` inputs: with 3-D ones torch 2.13 falls back to its math kernel on CPU (measured:
a 512-token causal prefill, 9/3 heads, fp32 12.9 ms vs 2.9 ms per layer on the flash kernel; bf16 24.6
vs 1.0 ms). A prefill with no cached prefix attends over its own fresh K/V (rounded to the cache dtype,
as a read-back would give) instead of gathering them back from the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compute.modeling.batch import DecodeGroup, ForwardBatch, padded_keys
from compute.modeling.kv_cache import KVCache

Q_BLOCK = 32  # prefill queries per SDPA block, aligned to absolute positions (``_aligned_prefill``)


def paged_attention(
    q: torch.Tensor,  # [T, H, Dh]
    kv: torch.Tensor,  # [T, 2 KVH, Dh]: K heads, then V heads
    layer: int,
    cache: KVCache,
    batch: ForwardBatch,
    scale: float,
    aligned: bool = False,
) -> torch.Tensor:
    """Returns ``[T, H, Dh]`` in q's dtype; stores ``kv`` in ``cache`` as a side effect (one write for K and V).
    ``aligned``: prefill queries in position-aligned blocks (``_aligned_prefill``: a row's numbers independent of
    its chunking, for ``kernels = invariant``; ~1.2x the attention time of a 512-token prefill, so only there)."""
    cache.write_kv(layer, batch.slot_mapping, kv)
    d, dt = batch.decodes, cache.dtype
    if d is not None and d.only:
        o = _decode(q if q.dtype == dt else q.to(dt), layer, cache, d, scale)  # [T, H, Dh] in dt
        return o if o.dtype == q.dtype else o.to(q.dtype)
    kvh = kv.shape[1] // 2
    k, v = kv[:, :kvh], kv[:, kvh:]  # [T, KVH, Dh]
    gqa = q.shape[1] != kvh
    out = torch.empty_like(q)
    for s in batch.prefills:
        n = padded_keys(s.context_len)  # keys of this call (see compute.modeling.batch.KEY_MULTIPLE), masked past ctx
        if s.fresh:  # no cached prefix: its context is this step's own K/V
            kc, vc = _padded(k[s.start : s.end].to(dt), n), _padded(v[s.start : s.end].to(dt), n)  # [L, KVH, Dh]
        else:
            kc, vc = cache.gather(layer, s.blocks)  # [nb*BS, KVH, Dh]
            kc, vc = _padded(kc, n), _padded(vc, n)  # [L, KVH, Dh]
        qs = q[s.start : s.end].to(dt)
        if aligned:
            out[s.start : s.end] = _aligned_prefill(qs, kc, vc, s.mask, s.context_len, scale, gqa)
            continue
        o = F.scaled_dot_product_attention(
            qs[None].transpose(1, 2),  # [1, H, q, Dh]
            kc[None].transpose(1, 2),  # [1, KVH, L, Dh]
            vc[None].transpose(1, 2),
            attn_mask=s.score_bias(qs.dtype),  # the bool mask as SDPA's own additive form, made once per step
            scale=scale,
            enable_gqa=gqa,
        )  # [1, H, q, Dh]
        out[s.start : s.end] = o[0].transpose(0, 1)
    if d is not None:
        out[d.rows] = _decode(q[d.rows].to(dt), layer, cache, d, scale)
    return out


def _aligned_prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor, ctx: int,
                     scale: float, gqa: bool) -> torch.Tensor:  # fmt: skip
    """q: [T, H, Dh] (positions ctx-T .. ctx-1), kc/vc: [L, KVH, Dh], mask: [T, L] -> [T, H, Dh].

    Queries go in blocks of ``Q_BLOCK`` rows aligned to absolute positions (rows outside the chunk are zero
    queries on key 0, dropped), one batch entry per block: SDPA's CPU kernel computes a row by the block of
    queries it falls in (its size and the row's place in it), so a row's numbers would otherwise depend on
    where a prefill chunk starts and how many rows it has (tests/compute/modeling/test_realmodel.py)."""
    t, first = q.shape[0], ctx - q.shape[0]
    lead = first % Q_BLOCK
    nb = -(-(lead + t) // Q_BLOCK)
    qp = q.new_zeros(nb * Q_BLOCK, *q.shape[1:])  # [nb*QB, H, Dh]
    qp[lead : lead + t] = q
    mp = torch.zeros(nb * Q_BLOCK, mask.shape[1], dtype=torch.bool, device=mask.device)
    mp[:, 0] = True  # a padding row attends to key 0 only (never a fully masked row: NaN)
    mp[lead : lead + t] = mask
    qb = qp.view(nb, Q_BLOCK, *q.shape[1:]).transpose(1, 2)  # [nb, H, QB, Dh]
    kb = kc.transpose(0, 1)[None].expand(nb, -1, -1, -1)  # [nb, KVH, L, Dh]
    vb = vc.transpose(0, 1)[None].expand(nb, -1, -1, -1)
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mp.view(nb, 1, Q_BLOCK, -1), scale=scale,
                                       enable_gqa=gqa)  # [nb, H, QB, Dh]  # fmt: skip
    return o.transpose(1, 2).reshape(nb * Q_BLOCK, *q.shape[1:])[lead : lead + t]


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t: [m, ...]`` cut or zero-padded to ``n`` rows."""
    if t.shape[0] >= n:
        return t[:n]
    return torch.cat((t, t.new_zeros((n - t.shape[0], *t.shape[1:]))))


def _decode(q: torch.Tensor, layer: int, cache: KVCache, d: DecodeGroup, scale: float) -> torch.Tensor:
    """q: [B, H, Dh], one query per sequence -> [B, H, Dh] in q's dtype.

    Two batched fp32 matmuls and a softmax rather than SDPA: with one query per sequence SDPA's CPU flash
    kernel spends its time on blocking a single row (measured on the Zen 4 box, 2 threads, 9/3 heads, bf16:
    B = 1, 64 keys 61 vs 49 us; B = 8 401 vs 161 us; B = 32, 80 keys 1,479 vs 533 us per layer), and scores
    in fp32 are closer to an fp32 reference than its bf16 path (max error 0.0019 vs 0.0024). A row's numbers
    stay independent of its batch: the keys are a multiple of ``KEY_MULTIPLE`` and masked ones give exact
    zeros (tests/compute/modeling/test_realmodel.py).

    The key mask is an additive bias (0 or -inf, made once per step: ``DecodeGroup.score_bias``) that the
    score matmul adds (``baddbmm``), and a power-of-two ``scale`` (head_dim 64, 256, ...) is its ``alpha``:
    the same numbers as scaling q, ``bmm`` and ``masked_fill_``, in one call instead of four
    (tests/compute/modeling/test_layer_ops.py)."""
    b, h, dh = q.shape
    kv = cache.gather_slots(layer, d.slots)  # [2, B, L, KVH, Dh] in the cache dtype
    n, kvh = kv.shape[2], kv.shape[3]
    # one contiguous fp32 layout whatever B: a strided batch (B = 1 folds, B > 1 does not) takes another GEMM
    # path in bmm, and a row's numbers would then depend on its batch
    kv32 = torch.empty((2, b * kvh, n, dh), dtype=torch.float32, device=q.device)  # [2, B*KVH, L, Dh]
    kv32.view(2, b, kvh, n, dh).copy_(kv.transpose(2, 3))
    exact = math.frexp(scale)[0] == 0.5  # x * 2^e is exact in fp32: scaling inside the GEMM gives the same numbers
    qg = (q.to(torch.float32) if exact else q.to(torch.float32) * scale).reshape(b * kvh, h // kvh, dh)  # [B*KVH, G, Dh]
    # (reshape: an fp32 q is a view of the qkv buffer, its rows strided: copied here, as the scaling did before)
    kt = kv32[0].transpose(1, 2)  # [B*KVH, Dh, L]: head i of q reads KV head i // G
    bias = d.score_bias(kvh, h // kvh)  # [B*KVH, G, L] or None
    if bias is None:
        s = torch.bmm(qg, kt) if not exact else torch.baddbmm(qg.new_empty(()), qg, kt, beta=0, alpha=scale)
    else:
        s = torch.baddbmm(bias, qg, kt, alpha=scale if exact else 1.0)  # [B*KVH, G, L]
    o = torch.bmm(torch.softmax(s, -1), kv32[1])  # [B*KVH, G, Dh]
    return o.view(b, h, dh).to(q.dtype)
