"""A peer's blocks in the scheduler: the verbs of a peer pull, on both sides.

Exporter: ``pin_cached`` holds the cached run of a chain of block hashes in ``held`` under a negative key (seq ids
are >= 0), as a prefill node's KV is held for a decode node: ``release(key)`` (the KV sender's confirmation, an
abort or its deadline) lets go. Importer, for a request: ``add_pull`` allocates a prompt's prefix after this node's
own cached blocks (an IMPORTING sequence, as a decode node's), the transfer writes the rest, then ``admit_pulled``
names them and queues the request to compute the rest of its prompt — or ``cancel_pull`` frees them (the request is
then added as any). Importer, ahead of any request (a node joining pre-pulls hot prefixes): ``pin_for_import``
then ``land_import`` (named, let go: cached free) or ``release``. The transfers are the node's
(compute/node/peer.py); the block manager's invariant holds throughout (tests/compute/engine/test_peer_pull.py).
"""

from __future__ import annotations

import itertools

from compute.engine.sequence import Sequence, Status


def pin_keys():
    """The keys of pinned lists in a scheduler's ``held``: -1, -2, ..."""
    return itertools.count(-1, -1)


class PeerBlocks:
    """Mixed into ``Scheduler`` (its ``blocks``, ``cache``, ``held``, ``importing``, ``waiting``, ``seqs``)."""

    def pin_cached(self, hashes: list[bytes]) -> tuple[int, list[int]]:
        """Hold the cached blocks of the longest run of ``hashes`` for a peer to read (an export): ``(key,
        blocks)``, ``release(key)`` lets go; ``(0, [])`` if the first is not cached here."""
        blocks = self.blocks.match(hashes)
        if not blocks:
            return 0, []
        key = next(self._pins)
        self.held[key] = self.blocks.pin(blocks)
        return key, blocks

    def add_pull(self, seq: Sequence, num_tokens: int) -> tuple[list[int], int]:
        """``add_imported`` for a prompt whose first ``num_tokens`` (whole blocks) a peer holds cached: blocks for
        them, this node's own cached ones first (returns the table and their count); the rest is pulled, then
        ``admit_pulled`` (or ``cancel_pull``). The lookup is counted when the prefix lands."""
        out = self.add_imported(seq, num_tokens, num_tokens // self.config.block_size)
        self.cache.uncount(seq)
        return out

    def pin_for_import(self, hashes: list[bytes]) -> tuple[int, list[int], int]:
        """A pre-pull (no request): blocks for a chain of ``hashes`` a peer holds, this node's own cached run of
        it first (k blocks), fresh ones for the rest, all held under one key: ``(key, blocks, k)``; then
        ``land_import`` or ``release(key)``. ``CacheFull`` if the rest does not fit in free blocks."""
        from compute.errors import CacheFull

        own = self.blocks.match(hashes)
        taken_free = sum(self.blocks.refs(b) == 0 for b in own)
        if len(hashes) - len(own) > self.blocks.num_free - taken_free:
            raise CacheFull(f"no free KV blocks for {len(hashes) - len(own)} pulled blocks")
        key = next(self._pins)
        self.held[key] = self.blocks.pin(own) + self.blocks.take(len(hashes) - len(own))
        return key, list(self.held[key]), len(own)

    def land_import(self, key: int, hashes: list[bytes], k: int) -> int:
        """The pulled blocks [k, n) of ``pin_for_import`` have landed: named by ``hashes``, then let go (they stay
        cached, free, until their memory is needed); returns how many were named."""
        blocks = self.held.get(key)
        if blocks is None or not self.cache.enabled:
            self.release(key)
            return 0
        before = self.blocks.num_cached
        self.blocks.publish(blocks[k:], hashes[k : len(blocks)])
        self.release(key)
        return self.blocks.num_cached - before

    def admit_pulled(self, seq_id: int) -> bool:
        """``add_imported``'s blocks of a prompt prefix pulled from a peer have landed: name them, and queue
        the sequence to compute the rest of its prompt as any request (False: aborted meanwhile)."""
        seq = self.importing.pop(seq_id, None)
        if seq is None:
            return False
        self.cache.landed(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)
        return True

    def cancel_pull(self, seq_id: int) -> Sequence | None:
        """The pull failed: free its blocks; the sequence (None if aborted meanwhile) is to be ``add``ed again."""
        seq = self.importing.pop(seq_id, None)
        if seq is None:
            return None
        self.blocks.free(seq)
        self.cache.reset(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.seqs.pop(seq_id, None)
        return seq

    def transfer_ended(self, seq: Sequence) -> None:
        """The KV transfer into ``seq``'s blocks is over (done, failed or aborted: nothing writes them any more).
        A sequence that finished while it was ``landing`` (aborted mid-transfer) kept its blocks held until now:
        they are freed here, never while a receiver could still write into another request's blocks."""
        seq.landing = False
        self.release(seq.seq_id)
