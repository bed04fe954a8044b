"""Shard buffers: fresh, writable, and page-aligned when large.

Tensors are ``torch.frombuffer`` views of these buffers, and CPU kernels need their data
64-byte aligned (see ``compute.linear.aligned``): a packed shard puts tensor data at 64-byte
offsets, so a page-aligned buffer gives aligned tensors without a copy. A large ``bytearray``
is not page-aligned (glibc puts a 16-byte header before an mmap'd chunk).
"""

from __future__ import annotations

import mmap


def alloc(n: int):
    """A fresh writable buffer of n bytes. Large ones are anonymous mmaps (page-aligned) with
    MAP_POPULATE: pages are faulted in by the kernel in one go (~2x faster here than first-touch
    faults of a bytearray)."""
    if n < 2**20 or not hasattr(mmap, "MAP_POPULATE"):
        return bytearray(n)
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
