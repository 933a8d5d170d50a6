"""The hash index: key hashes, bucket chains, and lookups by key.

Each bucket heads a chain of entries (linked through `chain`). The hash only
narrows the search: a read compares the key in full, and a rare false positive
in `contains` becomes a miss at load time.
"""

from __future__ import annotations

import zlib

import numpy as np

from maru.backends.pool.region import COMMITTED, FREE, NONE, Tables


def key_hash(key: bytes) -> int:
    """CRC-32 of the key (low bits, which pick the bucket) and its length: the same in
    every process."""
    return len(key) << 32 | zlib.crc32(key)


def key_hashes(keys: list[bytes]) -> np.ndarray:
    """`key_hash` of many keys, as a uint64 array."""
    crcs = np.fromiter(map(zlib.crc32, keys), np.uint64, len(keys))
    lengths = np.fromiter(map(len, keys), np.uint64, len(keys))
    return lengths << np.uint64(32) | crcs


class Index:
    """Bucket chains over the entry table (caller holds the pool mutex)."""

    def __init__(self, tables: Tables, buckets: int) -> None:
        self._t = tables
        self._mask = buckets - 1

    def bucket(self, hashed: int) -> int:
        """The bucket of a key hash."""
        return hashed & self._mask

    def find(self, key: bytes, hashed: int) -> int:
        """The live entry holding `key`, or NONE."""
        t = self._t
        entry = int(t.buckets[self.bucket(hashed)])
        while entry != NONE:
            if t.hash[entry] == hashed and t.state[entry] != FREE and t.key_at(entry) == key:
                return entry
            entry = int(t.chain[entry])
        return NONE

    def insert(self, entry: int, hashed: int) -> None:
        """Put an entry at the head of its bucket's chain."""
        t, bucket = self._t, self.bucket(hashed)
        t.chain[entry] = t.buckets[bucket]
        t.buckets[bucket] = entry

    def remove(self, entry: int) -> None:
        """Take an entry out of its bucket's chain."""
        t = self._t
        bucket = self.bucket(int(t.hash[entry]))
        current = int(t.buckets[bucket])
        if current == entry:
            t.buckets[bucket] = t.chain[entry]
            return
        while current != NONE:
            following = int(t.chain[current])
            if following == entry:
                t.chain[current] = t.chain[entry]
                return
            current = following

    def committed(self, hashes: np.ndarray) -> np.ndarray:
        """For each hash, whether a committed entry has it; marks those entries used."""
        t = self._t
        current = t.buckets[(hashes & np.uint64(self._mask)).astype(np.int64)].astype(np.int64)
        found = np.zeros(len(hashes), dtype=bool)
        active = current != NONE
        while active.any():
            at = current[active]
            match = (t.hash[at] == hashes[active]) & (t.state[at] == COMMITTED)
            found[np.flatnonzero(active)[match]] = True
            t.hot[at[match]] = 1
            current[active] = np.where(match, NONE, t.chain[at])
            active = current != NONE
        return found

    def rebuild(self, live: np.ndarray) -> None:
        """Chain every live entry anew (the chain links of free entries are cleared)."""
        t = self._t
        t.buckets[:] = NONE
        t.chain[:] = NONE
        for entry in live.tolist():
            self.insert(entry, int(t.hash[entry]))
