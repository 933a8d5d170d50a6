"""The hash index: key hashes, bucket chains, and lookups by key.

Each bucket heads a chain of entries (linked through `chain`). The key hash is a
64-bit XXH3: its low bits pick the bucket and the rest (at least 41 bits,
independent of the bucket's) tell the keys of one bucket apart. The hash only
narrows the search: reads and writes compare the key in full, and a false
positive in `contains` (about one in 2**41 per key) becomes a miss at load time.
"""

from __future__ import annotations

import numpy as np
import xxhash

from maru.backends._pool.region import COMMITTED, FREE, NONE, Damaged, Tables
from maru.backends.base import key_digest

key_hash = key_digest
"""The key's 64-bit hash (XXH3), the same in every process (and in removal logs)."""


def key_hashes(keys: list[bytes]) -> np.ndarray:
    """`key_hash` of many keys, as a uint64 array."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, keys), np.uint64, len(keys))


class Index:
    """Bucket chains over the entry table (caller holds the pool mutex). Every link is
    checked as it is followed, and a chain longer than the table is a loop: either is
    `Damaged`, as is an entry of the key's hash that is not sound."""

    def __init__(self, tables: Tables, buckets: int, entries: int) -> None:
        self._t = tables
        self._mask = buckets - 1
        self._entries = entries

    def bucket(self, hashed: int) -> int:
        """The bucket of a key hash."""
        return hashed & self._mask

    def find(self, key: bytes, hashed: int) -> int:
        """The live entry holding `key`, or NONE."""
        t = self._t
        entry = t.entry(t.buckets[self.bucket(hashed)])
        for _ in range(self._entries):
            if entry == NONE:
                return NONE
            if t.hash[entry] == hashed and t.state[entry] != FREE:
                if not t.sound(entry):
                    raise Damaged(f"entry {entry} fails its checks")
                if t.key_at(entry) == key:
                    return entry
            entry = t.entry(t.chain[entry])
        raise Damaged("a bucket's chain loops")

    def insert(self, entry: int, hashed: int) -> None:
        """Put an entry at the head of its bucket's chain."""
        t, bucket = self._t, self.bucket(hashed)
        t.chain[entry] = t.buckets[bucket]
        t.buckets[bucket] = entry

    def remove(self, entry: int) -> None:
        """Take an entry out of its bucket's chain."""
        t = self._t
        bucket = self.bucket(int(t.hash[entry]))
        current = t.entry(t.buckets[bucket])
        if current == entry:
            t.buckets[bucket] = t.entry(t.chain[entry])
            return
        for _ in range(self._entries):
            if current == NONE:
                return
            following = t.entry(t.chain[current])
            if following == entry:
                t.chain[current] = t.entry(t.chain[entry])
                return
            current = following
        raise Damaged("a bucket's chain loops")

    def committed(self, hashes: np.ndarray) -> np.ndarray:
        """For each hash, whether a committed entry has it; marks those entries used.

        Walks all the chains at once, one step per round, over the keys still unresolved
        (a match is not checked further: a load checks the entry, and a damaged one is a
        miss there)."""
        t = self._t.arrays
        heads = t.buckets[(hashes & np.uint64(self._mask)).view(np.int64)]
        found = np.zeros(len(hashes), dtype=bool)
        pending = np.flatnonzero(heads != NONE)
        at = self._checked(heads[pending])
        for _ in range(self._entries):
            if not len(at):
                return found
            match = (t.hash[at] == hashes[pending]) & (t.state[at] == COMMITTED)
            found[pending[match]] = True
            t.hot[at[match]] = 1
            at, pending = self._checked(t.chain[at[~match]]), pending[~match]
            more = at != NONE
            at, pending = at[more], pending[more]
        raise Damaged("a bucket's chain loops")

    def _checked(self, links: np.ndarray) -> np.ndarray:
        """Links read from the region, each an entry of the table or NONE."""
        if len(links) and (links.min() < NONE or links.max() >= self._entries):
            raise Damaged("a bucket's chain names an entry beyond the table")
        return links

    def rebuild(self, live: np.ndarray) -> None:
        """Chain every live entry anew (the chain links of free entries are cleared):
        sorted by bucket, each entry links to the next of its bucket, in one pass."""
        t = self._t.arrays
        t.buckets[:] = NONE
        t.chain[:] = NONE
        buckets = (t.hash[live] & np.uint64(self._mask)).view(np.int64)
        order = np.argsort(buckets, kind="stable")
        entries, buckets = live[order], buckets[order]
        same = buckets[1:] == buckets[:-1]
        t.chain[entries[:-1][same]] = entries[1:][same]
        heads = np.flatnonzero(np.concatenate(([True], ~same)))[: len(entries)]
        t.buckets[buckets[heads]] = entries[heads]
