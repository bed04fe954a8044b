"""One forward step's input: a flat batch of tokens from many sequences.

Like nano-vllm, tokens of every sequence in the step are concatenated
(``input_ids: [T]``), whatever each sequence is doing: a whole prompt, one chunk
of a long prompt (chunked prefill), or one decode token. Per sequence ``i``:

- ``query_lens[i]``: tokens it brings to this step (rows ``starts[i]:starts[i]+q``),
- ``context_lens[i]``: tokens in its KV after this step (cached + new),
- ``block_tables[i]``: its KV blocks, in position order.

``positions`` and ``slot_mapping`` say where each token sits; ``logits_rows``
which rows get logits (by default the last token of each sequence). Everything
attention needs per layer is derived once here, on the CPU, from plain lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from compute.modeling.lora import LoraRows

# Keys per attention call are padded (masked) to a multiple of this. SDPA's CPU kernel sums a tail of
# fewer than 16 keys another way than a masked full vector, so a row's result depended on how many keys
# its call had: alone vs padded in a decode batch, or a 10-token chunk vs the whole prompt (measured:
# 8 of 12 SmolLM2 answers changed in a batch). With every call's keys a multiple of 16, the masked
# extra keys add exact zeros and a row's numbers no longer depend on its batch or chunking.
KEY_MULTIPLE = 16


def padded_keys(n: int) -> int:
    return -(-n // KEY_MULTIPLE) * KEY_MULTIPLE


@dataclass(slots=True)
class PrefillSeq:
    """A sequence bringing more than one token: attends causally over its context."""

    start: int  # first row in the flat batch
    end: int  # one past its last row
    blocks: torch.Tensor  # [nb] long: its block table
    context_len: int  # keys to attend over
    mask: torch.Tensor  # [q, padded_keys(context_len)] bool (True = attend): causal, shifted by the cached prefix
    fresh: bool  # no cached prefix: its keys are this step's own (no gather)
    _bias: dict = field(default_factory=dict)  # dtype -> score_bias, made by the first layer, reused by the rest

    def score_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as SDPA's additive bias ``[q, L]`` in ``dtype`` (0 attend, -inf not): what SDPA makes of a
        bool mask itself on every call (the same tensor, so the same numbers), made once per step."""
        bias = self._bias.get(dtype)
        if bias is None:
            bias = self._bias[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            bias.masked_fill_(~self.mask, float("-inf"))
        return bias


@dataclass(slots=True)
class DecodeGroup:
    """Sequences bringing exactly one token: attended together, padded to the longest context."""

    rows: torch.Tensor  # [B] long: their rows in the flat batch
    slots: torch.Tensor  # [B, L] long: KV slot of each key position (L = padded_keys(longest); padding -> slot 0)
    mask: torch.Tensor | None  # [B, 1, 1, L] bool: key is inside the context; None when no row is padded
    only: bool  # the whole batch is these decodes, in order (rows == arange(T)): no row gather needed
    _bias: dict = field(default_factory=dict)  # (KVH, G) -> score_bias, made by the first layer, reused by the rest

    def score_bias(self, kvh: int, g: int) -> torch.Tensor | None:
        """The key mask as scores' additive bias ``[B*KVH, G, L]`` fp32 (0 inside a context, -inf past it), in
        the layout of ``compute.modeling.attention._decode``'s scores; None when no row is padded."""
        if self.mask is None:
            return None
        bias = self._bias.get((kvh, g))
        if bias is None:
            b, n = self.mask.shape[0], self.mask.shape[-1]
            bias = torch.zeros((b, kvh, g, n), device=self.mask.device)
            bias.masked_fill_(~self.mask.view(b, 1, 1, n), float("-inf"))
            bias = self._bias[(kvh, g)] = bias.view(b * kvh, g, n)
        return bias


@dataclass(slots=True)
class ForwardBatch:
    """Flat token batch plus the per-sequence bookkeeping of the paged KV cache."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: KV slot of each token
    query_lens: list[int]  # per sequence
    context_lens: list[int]  # per sequence
    block_tables: list[list[int]]  # per sequence
    block_size: int
    logits_rows: torch.Tensor  # [N] long: rows whose logits are computed
    prefills: list[PrefillSeq] = field(default_factory=list)  # derived
    decodes: DecodeGroup | None = None  # derived
    lora: LoraRows | None = None  # rows by adapter (compute/modeling/lora.py); None: every row runs the base

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        start_positions: list[int],
        block_tables: list[list[int]],
        block_size: int,
        all_logits: bool | list[bool] = False,
    ) -> ForwardBatch:
        """Sequence ``i`` brings ``token_ids[i]`` at positions ``start_positions[i]...``; its logits are
        computed for its last row, or for every row where ``all_logits`` (or ``all_logits[i]``) is true."""
        every = all_logits if isinstance(all_logits, list) else [all_logits] * len(token_ids)
        assert len(token_ids) == len(start_positions) == len(block_tables)
        ids, pos, slots, qlens, ctxs, rows = [], [], [], [], [], []
        for toks, start, table, full in zip(token_ids, start_positions, block_tables, every):
            assert toks, "a sequence must bring at least one token"
            end = start + len(toks)
            assert len(table) * block_size >= end, "block table too short for the context"
            ids.extend(toks)
            pos.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            qlens.append(len(toks))
            ctxs.append(end)
            rows.extend(range(len(ids) - len(toks), len(ids)) if full else [len(ids) - 1])
        batch = cls(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            query_lens=qlens,
            context_lens=ctxs,
            block_tables=[list(t) for t in block_tables],
            block_size=block_size,
            logits_rows=torch.tensor(rows, dtype=torch.long),
        )
        batch.plan()
        return batch

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch with its tensors on ``device`` (itself when they are there already)."""
        if self.input_ids.device == device:
            return self

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        self.input_ids, self.positions = mv(self.input_ids), mv(self.positions)
        self.slot_mapping, self.logits_rows = mv(self.slot_mapping), mv(self.logits_rows)
        for s in self.prefills:
            s.blocks, s.mask = mv(s.blocks), mv(s.mask)
            s._bias.clear()
        d = self.decodes
        if d is not None:
            d.rows, d.slots, d.mask = mv(d.rows), mv(d.slots), mv(d.mask)
            d._bias.clear()
        if self.lora is not None:
            self.lora.groups = [(w, mv(rows)) for w, rows in self.lora.groups]
        return self

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def plan(self) -> None:
        """Derive the attention plan (``prefills``, ``decodes``) from the per-sequence lists."""
        self.prefills, dec_rows, dec_tables, dec_ctx = [], [], [], []
        start = 0
        for q, ctx, table in zip(self.query_lens, self.context_lens, self.block_tables):
            nb = -(-ctx // self.block_size)  # blocks holding the context
            if q == 1:
                dec_rows.append(start)
                dec_tables.append(table[:nb])
                dec_ctx.append(ctx)
            else:
                first = ctx - q  # position of the first query
                # an explicit mask, also from position 0: SDPA's is_causal path stops each row's keys at the
                # diagonal, which sums differently from a masked full vector (see KEY_MULTIPLE)
                qpos = torch.arange(first, ctx)[:, None]  # [q, 1]
                mask = torch.arange(padded_keys(ctx))[None, :] <= qpos  # [q, L]: keys past ctx are off
                blocks = torch.tensor(table[:nb], dtype=torch.long)
                self.prefills.append(PrefillSeq(start, start + q, blocks, ctx, mask, first == 0))
            start += q
        self.decodes = None
        if dec_rows:
            self.decodes = _decode_group(dec_rows, dec_tables, dec_ctx, self.block_size, start)


def _decode_group(rows: list[int], tables: list[list[int]], ctx: list[int], block_size: int, tokens: int):
    """The slot of every key of every decode, once per step (every layer reuses it)."""
    longest = padded_keys(max(ctx))
    width = max(max(len(t) for t in tables), -(-longest // block_size))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)  # [B, nb]
    slots = (padded[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :longest].contiguous()  # [B, L]
    mask = None
    if min(ctx) != longest:
        mask = (torch.arange(longest)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]  # [B, 1, 1, L]
    return DecodeGroup(torch.tensor(rows, dtype=torch.long), slots, mask, len(rows) == tokens)
