"""The native LoRA kernel (compute/kernels/native/lora.cpp): every adapter of a step in one call, equal to the fp64
sum on every body this CPU has (odd K, n and ranks, bf16 pairs and outputs, strided rows), a row's update bitwise the
same alone and in any batch, and clear errors on bad arguments."""

from __future__ import annotations

import pytest
import torch

from compute.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.why_unavailable()}")


def _adapter(k: int, targets: list[tuple[int, int, int]], dtype: torch.dtype, gen: torch.Generator):
    """A fused linear's pairs: ``targets`` (col, rank, n) -> A [R, K] and parts [(col, h, B^T [r, n])]."""
    a = torch.randn(sum(r for _, r, _ in targets), k, generator=gen).to(dtype)
    parts, h = [], 0
    for col, r, n in targets:
        parts.append((col, h, (torch.randn(r, n, generator=gen) * 0.3).to(dtype)))
        h += r
    return a, parts


def _call(y, x, groups):
    """``groups``: [(rows slice, (A, parts))] -> one ``lora_add`` call, as compute/modeling/lora.py makes it."""
    flat, a_list, parts, b_list = [], [], [], []
    for rows, (a, ps) in groups:
        flat += (rows.start, rows.stop, len(a_list), len(b_list), len(b_list) + len(ps))
        a_list.append(a)
        for col, h, b in ps:
            parts += (col, h, len(b_list))
            b_list.append(b)
    torch.ops.pdserve.lora_add(y, x, flat, a_list, parts, b_list)


def _reference(y, x, groups):
    out = y.double().clone()
    for rows, (a, ps) in groups:
        h = x[rows].double() @ a.double().T
        for col, hc, b in ps:
            out[rows, col : col + b.shape[1]] += h[:, hc : hc + b.shape[0]] @ b.double()
    return out


@pytest.mark.parametrize("pairs", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,targets", [(64, [(0, 8, 64), (96, 4, 32)]), (100, [(3, 3, 45)]), (37, [(0, 1, 70)]),
                                       (576, [(0, 64, 576), (576, 16, 192), (768, 64, 192)])])  # fmt: skip
def test_lora_add_equals_the_fp64_sum(isa, pairs, k, targets):
    gen = torch.Generator().manual_seed(k + len(targets))
    n = max(col + w for col, _, w in targets) + 5
    adapters = [_adapter(k, targets, pairs, gen) for _ in range(3)]
    x = torch.randn(23, k, generator=gen)
    y = torch.randn(23, n, generator=gen)
    groups = [(slice(0, 1), adapters[0]), (slice(3, 12), adapters[1]), (slice(12, 23), adapters[2])]  # rows 1-2: base
    want, before = _reference(y, x, groups), y.clone()
    _call(y, x, groups)
    assert float((y.double() - want).norm() / want.norm()) < 1e-6
    assert torch.equal(y[1:3], before[1:3])  # the base's rows untouched


def test_bf16_rows_and_strided_outputs(isa):
    gen = torch.Generator().manual_seed(3)
    a = _adapter(48, [(0, 8, 40)], torch.bfloat16, gen)
    x = torch.randn(6, 48, generator=gen)
    wide = torch.randn(6, 100, generator=gen)
    before = wide.clone()
    y = wide[:, 10:50]  # a column view: rows strided by 100
    want = _reference(y, x, [(slice(0, 6), a)])
    _call(y, x, [(slice(0, 6), a)])
    assert float((y.double() - want).abs().max()) < 1e-4
    assert torch.equal(wide[:, :10], before[:, :10]) and torch.equal(wide[:, 50:], before[:, 50:])
    yb, xb = torch.randn(6, 40, generator=gen).bfloat16(), x.bfloat16()
    want = _reference(yb, xb, [(slice(0, 6), a)])
    _call(yb, xb, [(slice(0, 6), a)])
    assert float((yb.double() - want).abs().max()) <= 2 ** -6 * float(want.abs().max())  # one bf16 rounding


def test_a_rows_update_is_bitwise_the_same_alone_and_in_any_batch(isa):
    """Rows are computed in blocks of up to 4 sharing the pairs' loads; where a row sits in its group, how many rows
    the group has and which other groups run beside it never change its sums."""
    gen = torch.Generator().manual_seed(4)
    a, b = _adapter(576, [(0, 16, 576), (600, 8, 192)], torch.bfloat16, gen), _adapter(576, [(5, 32, 64)],
                                                                                     torch.bfloat16, gen)  # fmt: skip
    x = torch.randn(13, 576, generator=gen)
    base = torch.randn(13, 800, generator=gen)
    big = base.clone()
    _call(big, x, [(slice(0, 9), a), (slice(9, 13), b)])
    for rows in (slice(0, 1), slice(2, 3), slice(0, 5), slice(3, 8), slice(4, 9)):
        alone = base[rows].clone()
        _call(alone, x[rows], [(slice(0, rows.stop - rows.start), a)])
        assert torch.equal(alone, big[rows]), rows
    alone = base[11:12].clone()
    _call(alone, x[11:12], [(slice(0, 1), b)])
    assert torch.equal(alone[0], big[11])


def test_bad_arguments_raise_a_clear_error():
    gen = torch.Generator().manual_seed(5)
    a, ps = _adapter(16, [(0, 4, 8)], torch.float32, gen)
    x, y = torch.randn(3, 16), torch.zeros(3, 8)
    cases = [
        (dict(groups=[0, 4, 0, 0, 1]), "rows fall outside"),
        (dict(groups=[0, 3, 1, 0, 1]), "names no A"),
        (dict(parts=[1, 0, 0]), "columns fall outside"),
        (dict(parts=[0, 2, 0]), "rank falls outside"),
        (dict(a=[a.t().contiguous()]), r"A must be contiguous \[R, K\]"),
        (dict(b=[ps[0][2].bfloat16()]), "one dtype"),
        (dict(x=x.bfloat16()), "both fp32 or both bf16"),
    ]
    for change, message in cases:
        args = dict(y=y, x=x, groups=[0, 3, 0, 0, 1], a=[a], parts=[0, 0, 0], b=[ps[0][2]]) | change
        with pytest.raises(RuntimeError, match=message):
            torch.ops.pdserve.lora_add(args["y"], args["x"], args["groups"], args["a"], args["parts"], args["b"])
    assert torch.equal(y, torch.zeros(3, 8))  # a refused call wrote nothing
