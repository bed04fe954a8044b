"""LoRA adapters on a mixed batch: each row's linears add ``B (A x)`` of that row's own adapter (or nothing).

Layout: ``LoraWeights`` holds, per fused linear of the model, keyed ``(layer, slot)`` with slot one of ``qkv``,
``o``, ``gate_up``, ``down`` (the linears ``compute.modeling.model`` runs)::

    A [R, K]             the targets' A matrices stacked (q, k, v for qkv), R = the sum of their ranks
    parts [(cols, hcols, B^T [r, n])]   each target's B times its scaling, the output columns it adds to and the
                                        columns of ``h = x A^T`` that are its rank

contiguous, in ``pair_dtype`` (fp32 on an fp32 base, bf16 on a quantized one); no rank is padded to the largest
and no zeros are kept or read.

A step's rows are grouped by adapter (``LoraRows``: ``[(weights, rows slice)]``; base rows are in no group; the
runner puts each adapter's sequences next to each other). Every group of up to ``NATIVE_MAX_ROWS`` rows goes into
one native call per fused linear (``compute/kernels/native/lora.cpp``: a segmented shrink/expand, row-invariant);
a larger group (a long prompt) runs GEMMs: one for ``h`` and one per target. The update is summed in fp32 and added
in place into the base linear's output, whose kernels (int8, int4, bf16) are unchanged. What adapters cost a
decode step is now mostly their pairs' bytes (docs/benchmarks.md, ``pdserve bench lora``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compute.kernels import native
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

    def __init__(self, targets, config: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, invariant: bool = False) -> None:  # fmt: skip
        """``targets``: objects with ``layer``, ``proj``, ``a [r, K]``, ``b [N, r]``, ``scaling``
        (``paramstore.lora.LoraTarget``). ``dtype``: the pairs' storage (fp32, or bf16 for a quantized base: half
        the bytes a decode step reads, widened to fp32 in the native kernel's registers); the update is summed in
        fp32 and added in the base's output dtype. ``invariant``: every row's update by the native kernel, whose
        rows are the same alone and in any batch (``kernels = invariant``), else large groups by GEMM."""
        self.invariant = invariant
        sizes = part_sizes(config)
        grouped: dict[tuple[int, str], list] = {}
        for t in targets:
            grouped.setdefault((t.layer, SLOTS[t.proj][0]), []).append(t)
        self.pairs: dict[tuple[int, str], tuple[torch.Tensor, list[tuple[slice, slice, torch.Tensor]]]] = {}
        for (layer, slot), ts in grouped.items():
            ts.sort(key=lambda t: SLOTS[t.proj][1])
            offsets = [0]
            for n in sizes[slot]:
                offsets.append(offsets[-1] + n)
            a = torch.cat([t.a.to(torch.float32) for t in ts]).to(device, dtype).contiguous()  # A [R, K]
            parts, col = [], 0
            for t in ts:  # each target's B alone (no zeros between them): its output columns, its rank's h columns
                row, r = offsets[SLOTS[t.proj][1]], t.a.shape[0]
                b = (t.b.to(torch.float32) * t.scaling).t().to(device, dtype).contiguous()  # B^T [r, n]
                parts.append((slice(row, row + b.shape[1]), slice(col, col + r), b))
                col += r
            self.pairs[(layer, slot)] = (a, parts)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + sum(b.nbytes for _, _, b in parts) for a, parts in self.pairs.values())


@dataclass(slots=True)
class LoraRows:
    """A step's rows grouped by adapter: ``(weights, rows)``, each adapter's rows one slice (the runner orders a
    step's sequences by adapter: ``ModelRunner.run``), so a group costs views and no gather."""

    groups: list[tuple[LoraWeights, slice]]
    calls: dict = field(default_factory=dict)  # (layer, slot) -> the native call's lists, made once per groups

    @classmethod
    def of(cls, adapters: list[LoraWeights | None], query_lens: list[int], last: LoraRows | None = None
           ) -> LoraRows | None:  # fmt: skip
        """Sequence ``i`` brings ``query_lens[i]`` rows and runs ``adapters[i]`` (None: the base); None if no
        sequence runs an adapter. ValueError if one adapter's sequences are not next to each other. ``last``: the
        previous step's, returned itself when the groups are the same (its prepared calls reused)."""
        groups: list[tuple[LoraWeights, slice]] = []
        start = 0
        for w, q in zip(adapters, query_lens):
            if w is not None:
                if groups and groups[-1][0] is w and groups[-1][1].stop == start:
                    groups[-1] = (w, slice(groups[-1][1].start, start + q))
                elif any(g is w for g, _ in groups):
                    raise ValueError("an adapter's sequences must be next to each other in the batch")
                else:
                    groups.append((w, slice(start, start + q)))
            start += q
        if not groups:
            return None
        if last is not None and len(last.groups) == len(groups) and all(
                a is b and r == s for (a, r), (b, s) in zip(last.groups, groups)):  # fmt: skip
            return last
        return cls(groups)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, slot: str) -> torch.Tensor:
        """``y [T, N]`` (the base linear's output of ``x [T, K]``, written in place) plus each group's update:
        the native kernel, one call for every group of a few rows (decode); GEMMs for a group of many (prefill)."""
        native_ok = (_native() and x.dtype == y.dtype and x.dtype in NATIVE_DTYPES and x.stride(1) == 1
                     and y.stride(1) == 1)  # fmt: skip
        if native_ok:
            call = self.calls.get((layer, slot))
            if call is None:
                call = self.calls[(layer, slot)] = self._native_call(layer, slot)
            if call[1]:
                torch.ops.pdserve.lora_add(y, x, *call)
        for w, rows in self.groups:  # groups the native call leaves out: GEMMs (a few small matmuls per group)
            pair = w.pairs.get((layer, slot))
            if pair is None or (native_ok and self._native_rows(w, rows)):
                continue
            a, ps = pair
            xs, ys = x[rows], y[rows]  # views: [n, K], [n, N]
            h = torch.nn.functional.linear(xs.float(), a.float())  # [n, R] (no copy when xs and the pairs are fp32)
            for cols, hcols, b in ps:
                out = ys[:, cols]  # [n, n_part] view
                if out.dtype == torch.float32:
                    out.addmm_(h[:, hcols], b.float())
                else:
                    out.add_(torch.mm(h[:, hcols], b.float()))
        return y

    @staticmethod
    def _native_rows(w: LoraWeights, rows: slice) -> bool:
        return w.invariant or rows.stop - rows.start <= NATIVE_MAX_ROWS

    def _native_call(self, layer: int, slot: str) -> tuple[list[int], list[torch.Tensor], list[int], list[torch.Tensor]]:
        """``lora_add``'s lists for this linear: every group of at most ``NATIVE_MAX_ROWS`` rows (or invariant)."""
        groups: list[int] = []
        a_list: list[torch.Tensor] = []
        parts: list[int] = []
        b_list: list[torch.Tensor] = []
        for w, rows in self.groups:
            pair = w.pairs.get((layer, slot))
            if pair is None or not self._native_rows(w, rows):
                continue
            a, ps = pair
            first = len(b_list)
            groups += (rows.start, rows.stop, len(a_list), first, first + len(ps))
            a_list.append(a)
            for cols, hcols, b in ps:
                parts += (cols.start, hcols.start, len(b_list))
                b_list.append(b)
        return groups, a_list, parts, b_list


NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def pair_dtype(weights: str) -> torch.dtype:
    """How a base's adapters keep their pairs: fp32 on fp32 weights (the update as PEFT computes it), else bf16 (the
    base is rounded further than that: int8 / int4 / bf16; a decode step with 8 adapters of ranks 8-64 reads ~145
    instead of ~290 MB of pairs: 11.7 vs 20.5 ms per step here, docs/benchmarks.md)."""
    return torch.float32 if weights == "fp32" else torch.bfloat16


NATIVE_MAX_ROWS = 128  # a group of more rows (a prefill) runs GEMMs: 1,024 rows of a rank-8 adapter: 38 vs 61 ms


def _native() -> bool:
    """Whether ``pdserve::lora_add`` runs here (compute/kernels/native/lora.cpp; PDSERVE_NATIVE=0 turns it off)."""
    return native.available()
