"""Helpers to damage a store on purpose."""

from __future__ import annotations


def frag_location(store, m, shard, index):
    return store.location(m.locations[shard.fragments[index].location]), shard.fragment_path(m.k, m.n, index)


def lose(store, m, shard, indexes):
    for i in indexes:
        loc, rel = frag_location(store, m, shard, i)
        loc.remove(rel)


def flip_bit(store, m, shard, index, byte=0):
    loc, rel = frag_location(store, m, shard, index)
    data = bytearray(loc.get(rel))
    data[byte] ^= 0x01
    loc.put(rel, bytes(data))
