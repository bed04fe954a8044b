"""Attention over the paged KV cache, on CPU with ``F.scaled_dot_product_attention``.

Per layer: write this step's K/V into their slots, then

- each prefill (or prefill chunk) gathers its own context and attends with a
  causal mask shifted by the cached prefix (query at position ``p`` sees keys
  ``<= p``);
- all single-token decodes gather their contexts padded to the longest one (K and
  V in one ``index_select`` over the per-step slot table of ``ForwardBatch``) and
  attend in one batched call with a key-padding mask (none when nothing is padded).
  A batch of decodes only skips the row gather and scatter.

GQA/MQA uses SDPA's ``enable_gqa`` (no repeated K/V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compute.batch import DecodeGroup, ForwardBatch
from compute.kv_cache import KVCache


def paged_attention(
    q: torch.Tensor,  # [T, H, Dh]
    k: torch.Tensor,  # [T, KVH, Dh]
    v: torch.Tensor,  # [T, KVH, Dh]
    layer: int,
    cache: KVCache,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Returns ``[T, H, Dh]``; stores ``k, v`` in ``cache`` as a side effect."""
    cache.write(layer, batch.slot_mapping, k, v)
    gqa = q.shape[1] != k.shape[1]
    d = batch.decodes
    if d is not None and d.only:
        return _decode(q, layer, cache, d, scale, gqa)
    out = torch.empty_like(q)
    for s in batch.prefills:
        kc, vc = cache.gather(layer, s.blocks)  # [nb*BS, KVH, Dh]
        kc, vc = kc[: s.context_len].transpose(0, 1), vc[: s.context_len].transpose(0, 1)  # [KVH, ctx, Dh]
        qs = q[s.start : s.end].transpose(0, 1)  # [H, q, Dh]
        o = F.scaled_dot_product_attention(
            qs, kc.to(q.dtype), vc.to(q.dtype), attn_mask=s.mask, is_causal=s.mask is None, scale=scale, enable_gqa=gqa
        )
        out[s.start : s.end] = o.transpose(0, 1)
    if d is not None:
        out[d.rows] = _decode(q[d.rows], layer, cache, d, scale, gqa)
    return out


def _decode(q: torch.Tensor, layer: int, cache: KVCache, d: DecodeGroup, scale: float, gqa: bool) -> torch.Tensor:
    """q: [B, H, Dh], one query per sequence -> [B, H, Dh]."""
    kv = cache.gather_slots(layer, d.slots).to(q.dtype)  # [2, B, L, KVH, Dh]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [B, H, 1, Dh]
        kv[0].transpose(1, 2),  # [B, KVH, L, Dh]
        kv[1].transpose(1, 2),
        attn_mask=d.mask,
        scale=scale,
        enable_gqa=gqa,
    )  # [B, H, 1, Dh]
    return o[:, :, 0, :]
