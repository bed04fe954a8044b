"""``step_graphs.unowned``: the tensors a step graph package is bound to alias the model's weights without keeping
them alive (AOTInductor's loader never lets go of a user-managed constant: bound directly, a model's weights stayed
pinned after its unload; a node's RSS grew by the model's size at every load and unload of it)."""

from __future__ import annotations

import gc
import weakref

import torch

from compute.engine.step_graphs import unowned


def test_the_alias_reads_and_writes_the_same_memory_with_the_same_shape_and_strides():
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    for t in (base, base[1:5, 2:7], base.t(), base.to(torch.bfloat16), base.to(torch.int8)[::2]):
        a = unowned(t)
        assert a.dtype == t.dtype and a.shape == t.shape and a.stride() == t.stride() and torch.equal(a, t)
        assert a.data_ptr() == t.data_ptr()
    a = unowned(base)
    a[0, 0] = -1.0
    assert base[0, 0] == -1.0
    assert unowned(torch.empty(0)).numel() == 0


def test_the_alias_does_not_keep_the_weights_alive():
    t = torch.ones(1 << 20)
    ref = weakref.ref(t)
    alias = unowned(t)
    del t
    gc.collect()
    assert ref() is None and alias.numel() == 1 << 20  # the weights' owner decides when they go
