"""Which int8 linears keep a bf16 copy of their weight: the measured plan, weighed by memory.

The measured plan (``compute.kernels.int8``) picks the ``bf16`` kernel where it is fastest (batched decode and
prefill on an avx512_bf16 CPU), and each linear whose plan names it keeps a bf16 copy of its weight beside the
int8 one (+2 bytes per parameter: SmolLM2 holds 3.0x its int8 size). A node's ``weight_copies_gb`` bounds that:

1. ``copy_plans(shapes, table, mode, budget)`` gets the ``(N, K)`` of every int8 linear of a model, in order;
2. a linear's copy is worth the time it saves: over the buckets whose kernel is ``bf16``, the measured time of the
   fastest kernel without a copy (``NO_COPY``) less the bf16 kernel's, at the bucket's probe M (each bucket alike:
   the workload's mix is not known here); its cost is its bytes;
3. copies are kept greedily by time saved per byte, largest first, while they fit the budget (a copy that does not
   fit is skipped and smaller ones still tried); every other linear takes ``no_copy`` of its plan: each ``bf16``
   bucket runs the fastest kernel without a copy (under ``invariant``: the fastest row-invariant one).

No budget (None) gives the table's plans as they are; a budget of 0 gives no copy at all (weights stay int8).
"""

from __future__ import annotations

from collections.abc import Sequence

from compute.kernels import int8

NO_COPY = tuple(k for k in int8.KERNELS if k != "bf16")  # kernels that need nothing beside the int8 weight


def copy_bytes_of(shape: tuple[int, int]) -> int:
    """Bytes of one bf16 copy of an [N, K] weight."""
    return 2 * shape[0] * shape[1]


def no_copy(entry: dict, mode: str) -> tuple[str, ...]:
    """``entry``'s plan under ``mode`` with every ``bf16`` bucket replaced by the fastest measured kernel that
    needs no copy (``invariant``: the row-invariant one of least total time, so the model stays batch-invariant)."""
    plan = int8.plan_of(entry, mode)
    if "bf16" not in plan:
        return plan
    us = entry.get("us", {})
    if mode == "invariant" and entry.get("invariant"):
        inv = [k for k, ok in entry.get("row_invariant", {}).items() if ok and k in NO_COPY]
        total = {k: sum(us.get(str(m), {}).get(k, float("inf")) for m in int8.PROBE_M) for k in inv}
        if total:
            return (min(total, key=total.get),) * len(int8.BUCKETS)
    out = []
    for m, k in zip(int8.PROBE_M, plan):
        times = {c: t for c, t in us.get(str(m), {}).items() if c in NO_COPY}
        out.append(k if k != "bf16" else min(times, key=times.get) if times else "dequant")
    return tuple(out)


def saved_us(entry: dict, mode: str) -> float:
    """Microseconds a bf16 copy saves this shape over one call per bucket (0 where the plan needs no copy)."""
    plan, fallback = int8.plan_of(entry, mode), no_copy(entry, mode)
    us = entry.get("us", {})
    total = 0.0
    for m, k, f in zip(int8.PROBE_M, plan, fallback):
        t = us.get(str(m), {})
        if k == "bf16" and k in t and f in t:
            total += max(0.0, t[f] - t[k])
    return total


def copy_plans(shapes: Sequence[tuple[int, int]], table: dict, mode: str,
               budget: int | None) -> list[tuple[str, ...]]:  # fmt: skip
    """The plan of each int8 linear (``shapes``: its ``(N, K)``, one per linear, in order) under a budget of
    ``budget`` bytes of bf16 copies (None: no limit, the table's plans; 0: none)."""
    entries = [table["shapes"][f"{n}x{k}"] for n, k in shapes]
    plans = [int8.plan_of(e, mode) for e in entries]
    if budget is None:
        return plans
    if budget < 0:
        raise ValueError(f"a copy budget is >= 0 bytes (None: no limit), got {budget}")
    wants = [i for i, p in enumerate(plans) if "bf16" in p]
    gain = {i: saved_us(entries[i], mode) / copy_bytes_of(shapes[i]) for i in wants}
    left = budget
    for i in sorted(wants, key=lambda i: (-gain[i], i)):  # most time saved per byte first; ties in model order
        if gain[i] > 0 and copy_bytes_of(shapes[i]) <= left:
            left -= copy_bytes_of(shapes[i])
        else:
            plans[i] = no_copy(entries[i], mode)
    return plans


def planned_copy_bytes(shapes: Sequence[tuple[int, int]], table: dict | None, mode: str,
                       budget: int | None) -> int:  # fmt: skip
    """Bytes of the bf16 copies ``copy_plans`` keeps; with no table yet, every copy up to the budget (an upper
    bound for a node's memory estimate)."""
    if table is None or any(f"{n}x{k}" not in table.get("shapes", {}) for n, k in shapes):
        total = sum(copy_bytes_of(s) for s in shapes)
        return total if budget is None else min(total, budget)
    plans = copy_plans(shapes, table, mode, budget)
    return sum(copy_bytes_of(s) for s, p in zip(shapes, plans) if "bf16" in p)
