"""Shard buffers: fresh, writable, and 64-byte aligned (page-aligned when large).

Tensors are ``torch.frombuffer`` views of these buffers, and CPU kernels need their data
64-byte aligned (see ``compute.kernels.linear.aligned``): a packed shard puts tensor data at 64-byte
offsets, so an aligned buffer gives aligned tensors without a copy. Neither a large
``bytearray`` (glibc puts a 16-byte header before an mmap'd chunk) nor a small one (malloc
aligns to 16) is 64-byte aligned: small buffers are a 64-byte aligned window of a slightly
larger ``bytearray``.
"""

from __future__ import annotations

import ctypes
import mmap

# bytes: the start of every buffer ``alloc`` returns, of tensor data in a packed shard
# (``shards.pack``) and of every tensor a CPU kernel gets (``compute.kernels.linear.aligned``)
ALIGN = 64
_MMAP_MIN = 2**20  # from this size on, an anonymous mmap


def alloc(n: int) -> mmap.mmap | memoryview:
    """A fresh writable buffer of n bytes whose start is ``ALIGN``-byte aligned.

    Large ones are anonymous mmaps (page-aligned) with MAP_POPULATE: pages are faulted in by
    the kernel in one go (~2x faster here than first-touch faults of a bytearray)."""
    if n >= _MMAP_MIN and hasattr(mmap, "MAP_POPULATE"):
        return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    raw = bytearray(n + ALIGN)
    start = -address(raw) % ALIGN
    return memoryview(raw)[start : start + n]


def address(buf) -> int:
    """The address of a writable buffer's first byte."""
    c = (ctypes.c_char * 1).from_buffer(buf)  # an export of buf while it lives: dropped on return
    return ctypes.addressof(c)
