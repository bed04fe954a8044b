"""A kernel table (``compute.kernels.int8.measure``) as text, for logs and `pdserve bench engine`: per weight
shape its candidates' errors and row invariance, then per bucket the choice and every candidate's time."""

from __future__ import annotations


def format_table(table: dict) -> str:
    """The table as text: one line per shape and bucket, the choice first, then every candidate's time."""
    head = (f"kernel choice on {table['key'].split(' ', 1)[1]} (us, min of interleaved runs; error gate "
            f"{table['error_gate']:.0%} relative RMS)")  # fmt: skip
    lines = [head]
    for shape, e in table["shapes"].items():
        errs = ", ".join(f"{c} {v:.2%}" if isinstance(v, float) else f"{c} unusable" for c, v in e["error"].items())
        inv = ", ".join(c for c, ok in e["row_invariant"].items() if ok) or "none"
        lines.append(f"  {shape}: error {errs}; row-invariant: {inv} (kernels = \"invariant\": "
                     f"{e['invariant'] or 'none, the fastest per bucket'} at every M)")  # fmt: skip
        for m, choice in zip(table["probe_m"], e["choice"]):
            times = "  ".join(f"{c} {t:g}" for c, t in sorted(e["us"][str(m)].items(), key=lambda i: i[1]))
            lines.append(f"    M={m:<4} -> {choice:<8} ({times})")
    return "\n".join(lines)
