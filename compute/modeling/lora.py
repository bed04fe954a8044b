"""LoRA adapters on a mixed batch: each row's linears add ``B (A x)`` of that row's own adapter (or nothing).

Layout: ``LoraWeights`` holds one pair per fused linear of the model, keyed ``(layer, slot)`` with slot one of
``qkv``, ``o``, ``gate_up``, ``down`` (the linears ``compute.modeling.model`` runs)::

    A [R, K]   the targets' A matrices stacked by rows (q, k, v for qkv), R = the sum of their ranks
    B [N, R]   block-diagonal: each target's B (times its scaling) in its own output rows and rank columns

so a fused linear takes one pair of small matmuls whatever subset of its parts an adapter targets.

A step's rows are grouped by adapter (``LoraRows``: ``[(weights, rows [n] long)]``; base rows are in no group).
Each group costs a gather of its rows, two matmuls of its own rank (none padded to the largest in the batch) and
one ``index_add_`` into the base linear's output, whose kernels (int8, int4, bf16) are unchanged. The update is
computed in fp32 and added in the output's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compute.modeling.config import ModelConfig

# PEFT's target name -> (this model's fused linear, which of its parts)
SLOTS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
         "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}  # fmt: skip


def part_sizes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Output rows of each part of each fused linear."""
    return {"qkv": (c.q_size, c.kv_size, c.kv_size), "o": (c.hidden_size,),
            "gate_up": (c.intermediate_size, c.intermediate_size), "down": (c.hidden_size,)}  # fmt: skip


class LoraWeights:
    """One adapter's pairs, fused as the model's linears are (see the module's docstring)."""

    def __init__(self, targets, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        """``targets``: objects with ``layer``, ``proj``, ``a [r, K]``, ``b [N, r]``, ``scaling``
        (``paramstore.lora.LoraTarget``)."""
        sizes = part_sizes(config)
        grouped: dict[tuple[int, str], list] = {}
        for t in targets:
            grouped.setdefault((t.layer, SLOTS[t.proj][0]), []).append(t)
        self.pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, slot), ts in grouped.items():
            ts.sort(key=lambda t: SLOTS[t.proj][1])
            offsets = [0]
            for n in sizes[slot]:
                offsets.append(offsets[-1] + n)
            a = torch.cat([t.a.to(torch.float32) for t in ts])  # [R, K]
            b = torch.zeros(offsets[-1], a.shape[0], dtype=torch.float32)  # [N, R]
            col = 0
            for t in ts:
                row = offsets[SLOTS[t.proj][1]]
                b[row : row + t.b.shape[0], col : col + t.a.shape[0]] = t.b.to(torch.float32) * t.scaling
                col += t.a.shape[0]
            self.pairs[(layer, slot)] = (a.to(device).contiguous(), b.to(device).contiguous())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


@dataclass(slots=True)
class LoraRows:
    """A step's rows grouped by adapter; ``rows`` None: every row of the step."""

    groups: list[tuple[LoraWeights, torch.Tensor | None]]

    @classmethod
    def of(cls, adapters: list[LoraWeights | None], query_lens: list[int]) -> LoraRows | None:
        """Sequence ``i`` brings ``query_lens[i]`` rows and runs ``adapters[i]`` (None: the base); None if no
        sequence runs an adapter."""
        if not any(w is not None for w in adapters):
            return None
        if all(w is adapters[0] for w in adapters):
            return cls([(adapters[0], None)])
        rows: dict[int, tuple[LoraWeights, list[int]]] = {}
        start = 0
        for w, q in zip(adapters, query_lens):
            if w is not None:
                rows.setdefault(id(w), (w, []))[1].extend(range(start, start + q))
            start += q
        return cls([(w, torch.tensor(r, dtype=torch.long)) for w, r in rows.values()])

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, slot: str) -> torch.Tensor:
        """``y [T, N]`` (the base linear's output of ``x [T, K]``, written in place) plus each group's update."""
        for w, rows in self.groups:
            pair = w.pairs.get((layer, slot))
            if pair is None:
                continue
            a, b = pair
            xs = x if rows is None else x.index_select(0, rows)  # [n, K]
            d = torch.mm(torch.mm(xs.to(torch.float32), a.t()), b.t())  # [n, R] -> [n, N]
            if rows is None:
                y.add_(d.to(y.dtype))
            else:
                y.index_add_(0, rows, d.to(y.dtype))
        return y
