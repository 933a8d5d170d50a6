"""The mapped KV pool shared by the shm and cxl backends.

One mapped region holds everything: a header (magic, format version, geometry,
creation id, statistics), an entry table, a hash index, and the data. There is
no server: processes coordinate through the region and `fcntl` locks on its
file, which the kernel releases when a process dies.

- Mutual exclusion: one byte lock. The holder sets `dirty` while it mutates; a
  process that takes the lock and finds `dirty` set knows the previous holder
  died mid-mutation and rebuilds the derived state (index, address list, free
  list, counters) from the entry table, which is written so that every entry is
  either whole or free.
- Writers hold a per-process slot lock for as long as the pool is open. A
  pending reservation records its writer's slot and token; once that slot's
  lock is free (or held by someone with another token) the writer is dead and
  the space is reclaimed.
- Readers take no pins. Each entry has a generation that changes whenever it
  is freed; a large object is copied outside the lock and the copy counts only
  if the generation is unchanged afterwards, so a reader gets the committed
  bytes or a miss, never a recycled object.
- Allocation walks a ring with a clock hand: objects under the hand are evicted
  unless recently used (second chance), pending, or owned by a live writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import threading
import zlib
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from maru.backends.base import Backend, StoreStats
from maru.errors import BackendError, ConfigError, ObjectTooLargeError

MAGIC = b"MARUPOOL"
FORMAT_VERSION = 1
ALIGN = 64
PAGE = 4096
ENTRY_BYTES = 72
BYTES_PER_ENTRY = 64 * 1024
MIN_ENTRIES, MAX_ENTRIES = 4096, 1 << 22
WRITER_SLOTS = 4096
SMALL_COPY = 1024 * 1024
"""Objects up to this size are copied under the lock (one critical section, about
60 us at most); larger ones outside it, checked by generation afterwards."""

FREE, PENDING, COMMITTED = 0, 1, 2
NONE = -1

# Header words (uint64), after the 8-byte magic.
(
    VERSION,
    READY,
    CAPACITY,
    ENTRIES,
    BUCKETS,
    DATA_OFFSET,
    TOTAL,
    ID0,
    ID1,
    DIRTY,
    CURSOR,
    CURSOR_NEXT,
    ADDR_HEAD,
    ADDR_TAIL,
    FREE_HEAD,
    USED,
    OBJECTS,
    HITS,
    MISSES,
    EVICTIONS,
    RECLAIMED,
    RECOVERIES,
) = range(1, 23)
SLOT_TOKENS = 64  # word index where the writer-slot tokens start
HEADER_BYTES = -(-(SLOT_TOKENS + WRITER_SLOTS) * 8 // PAGE) * PAGE
NO_LINK = 2**64 - 1
MUTEX_BYTE = 0
SLOT_LOCK_BASE = 1

_ENTRY_FIELDS = (  # name, dtype: struct of arrays, each max_entries long
    ("state", np.int64),
    ("hash", np.uint64),
    ("offset", np.int64),
    ("span", np.int64),
    ("length", np.int64),
    ("key_len", np.int64),
    ("gen", np.int64),
    ("writer", np.int64),
)
_LINK_FIELDS = ("prev", "next", "chain", "hot")  # int32 each
_ENTRY_WORDS = len(_ENTRY_FIELDS)


@dataclass(frozen=True)
class Geometry:
    """Where each part of the region lives, derived from the capacity alone."""

    capacity: int
    entries: int
    buckets: int
    index_offset: int
    bucket_offset: int
    data_offset: int
    total: int

    @classmethod
    def for_capacity(cls, capacity: int, align: int = PAGE) -> Geometry:
        entries = min(MAX_ENTRIES, max(MIN_ENTRIES, capacity // BYTES_PER_ENTRY))
        buckets = 1 << (2 * entries - 1).bit_length()
        index_offset = HEADER_BYTES
        bucket_offset = index_offset + entries * (8 * _ENTRY_WORDS + 4 * len(_LINK_FIELDS))
        data_offset = _round_up(bucket_offset + 4 * buckets, align)
        return cls(
            capacity,
            entries,
            buckets,
            index_offset,
            bucket_offset,
            data_offset,
            data_offset + _round_up(capacity, align),
        )

    @property
    def overhead(self) -> int:
        """Bytes mapped beyond the capacity (header, entry table and hash index)."""
        return self.total - self.capacity


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def check_header(region: mmap.mmap, expected: Geometry, label: str) -> None:
    """Refuse a region of another format or geometry, never reinterpret it."""
    words = np.frombuffer(region, np.uint64, min(len(region), HEADER_BYTES) // 8, 0)
    if bytes(region[:8]) != MAGIC or len(words) <= TOTAL or not words[READY]:
        raise BackendError(f"{label} is not a maru pool (no maru header)")
    if words[VERSION] != FORMAT_VERSION:
        raise BackendError(
            f"{label} has pool format version {words[VERSION]}, this maru reads version "
            f"{FORMAT_VERSION}; destroy it (maru pool destroy) or use the maru that made it"
        )
    found = [int(words[w]) for w in (CAPACITY, ENTRIES, BUCKETS, DATA_OFFSET, TOTAL)]
    wanted = [
        expected.capacity,
        expected.entries,
        expected.buckets,
        expected.data_offset,
        expected.total,
    ]
    if found != wanted or len(region) < expected.total:
        raise ConfigError(
            f"capacity = {expected.capacity}: {label} already exists with capacity {found[0]} "
            "and another geometry; allowed: the capacity it was created with, or destroy it "
            "first (maru pool destroy)"
        )


def key_hash(key: bytes) -> int:
    """CRC-32 of the key (low bits, which pick the bucket) and its length: the same in
    every process. It only narrows the search: keys are compared in full before a read,
    and a rare false positive in `contains` becomes a miss at load time."""
    return len(key) << 32 | zlib.crc32(key)


def key_hashes(keys: list[bytes]) -> np.ndarray:
    """`key_hash` of many keys, as a uint64 array."""
    crcs = np.fromiter(map(zlib.crc32, keys), np.uint64, len(keys))
    lengths = np.fromiter(map(len, keys), np.uint64, len(keys))
    return lengths << np.uint64(32) | crcs


class _Lock:
    """Thread lock plus an fcntl byte lock: excludes threads and processes."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._thread_lock = threading.Lock()

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, MUTEX_BYTE)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, MUTEX_BYTE)
        self._thread_lock.release()


def _try_byte_lock(fd: int, offset: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
    except OSError:
        return False
    return True


class Pool:
    """One mapped pool, shared by every store of this process that opened it."""

    def __init__(self, fd: int, region: mmap.mmap, geometry: Geometry, label: str) -> None:
        self.fd = fd
        self.region = region
        self.geometry = geometry
        self.label = label
        self.users = 0
        self._lock = _Lock(fd)
        self._slot: int | None = None
        self._token = 0
        g = geometry
        self._header = np.frombuffer(region, np.uint64, HEADER_BYTES // 8, 0)
        offset = g.index_offset
        for name, dtype in _ENTRY_FIELDS:
            setattr(self, name, np.frombuffer(region, dtype, g.entries, offset))
            offset += 8 * g.entries
        for name in _LINK_FIELDS:
            setattr(self, name, np.frombuffer(region, np.int32, g.entries, offset))
            offset += 4 * g.entries
        self.buckets = np.frombuffer(region, np.int32, g.buckets, g.bucket_offset)
        self.data = np.frombuffer(region, np.uint8, g.capacity, g.data_offset)
        self._data_view = memoryview(region)[g.data_offset : g.data_offset + g.capacity]

    # --- header access -------------------------------------------------------

    def _get(self, word: int) -> int:
        return int(self._header[word])

    def _set(self, word: int, value: int) -> None:
        self._header[word] = value

    def _add(self, word: int, delta: int) -> None:
        self._header[word] = self._get(word) + delta

    @property
    def creation_id(self) -> str:
        """Random id written when the region was created."""
        return f"{self._get(ID0):016x}{self._get(ID1):016x}"

    # --- creation ------------------------------------------------------------

    def initialize(self) -> None:
        """Write a fresh, empty pool (caller holds the file lock; region is zero)."""
        g = self.geometry
        self.region[:8] = MAGIC
        for word, value in (
            (VERSION, FORMAT_VERSION),
            (CAPACITY, g.capacity),
            (ENTRIES, g.entries),
            (BUCKETS, g.buckets),
            (DATA_OFFSET, g.data_offset),
            (TOTAL, g.total),
            (ID0, secrets.randbits(64)),
            (ID1, secrets.randbits(64)),
        ):
            self._set(word, value)
        self._rebuild()
        self._set(READY, 1)

    # --- locking and recovery --------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the pool lock; recover first if the last holder died mid-change."""
        with self._lock:
            if self._get(DIRTY):
                self._rebuild()
                self._add(RECOVERIES, 1)
            self._set(DIRTY, 1)
            try:
                yield
            finally:
                self._set(DIRTY, 0)

    def _rebuild(self) -> None:
        """Derive index, address list, free list and counters from the entry table."""
        g = self.geometry
        live = np.flatnonzero(self.state != FREE)
        bad = live[(self.offset[live] < 0) | (self.offset[live] + self.span[live] > g.capacity)]
        live = live[np.argsort(self.offset[live], kind="stable")]
        overlaps = live[1:][self.offset[live[1:]] < (self.offset[live] + self.span[live])[:-1]]
        for entry in np.concatenate([bad, overlaps]):
            self.state[entry] = FREE
            self.gen[entry] += 1
        live = live[self.state[live] != FREE]
        self.prev[:] = NONE
        self.next[:] = NONE
        if len(live):
            self.prev[live[1:]] = live[:-1]
            self.next[live[:-1]] = live[1:]
        self._set(ADDR_HEAD, int(live[0]) if len(live) else NO_LINK)
        self._set(ADDR_TAIL, int(live[-1]) if len(live) else NO_LINK)
        self.buckets[:] = NONE
        self.chain[:] = NONE
        for entry in live.tolist():
            bucket = int(self.hash[entry]) & (g.buckets - 1)
            self.chain[entry] = self.buckets[bucket]
            self.buckets[bucket] = entry
        free = np.flatnonzero(self.state == FREE)
        self.chain[free[:-1]] = free[1:]
        self._set(FREE_HEAD, int(free[0]) if len(free) else NO_LINK)
        self._set(USED, int(self.span[live].sum()))
        self._set(OBJECTS, int((self.state[live] == COMMITTED).sum()))
        after = live[self.offset[live] >= self._get(CURSOR)]
        self._set(CURSOR_NEXT, int(after[0]) if len(after) else NO_LINK)

    def _link(self, word: int) -> int:
        value = self._get(word)
        return NONE if value == NO_LINK else value

    def _set_link(self, word: int, entry: int) -> None:
        self._set(word, NO_LINK if entry == NONE else entry)

    # --- writers -------------------------------------------------------------

    def _writer_slot(self) -> tuple[int, int]:
        if self._slot is None:
            for slot in range(WRITER_SLOTS):
                if _try_byte_lock(self.fd, SLOT_LOCK_BASE + slot):
                    self._token = secrets.randbits(62) + 1
                    self._set(SLOT_TOKENS + slot, self._token)
                    self._slot = slot
                    break
            else:
                raise BackendError(f"{self.label}: all {WRITER_SLOTS} writer slots are in use")
        return self._slot, self._token

    def _writer_alive(self, writer: int) -> bool:
        slot, token = writer >> 48, writer & (2**48 - 1)
        if slot == self._slot:
            return token == self._token & (2**48 - 1)
        if self._get(SLOT_TOKENS + slot) & (2**48 - 1) != token:
            return False
        if _try_byte_lock(self.fd, SLOT_LOCK_BASE + slot):
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, SLOT_LOCK_BASE + slot)
            return False
        return True

    # --- the index -----------------------------------------------------------

    def _find(self, key: bytes, hashed: int) -> int:
        entry = int(self.buckets[hashed & (self.geometry.buckets - 1)])
        while entry != NONE:
            if (
                self.hash[entry] == hashed
                and self.state[entry] != FREE
                and self._key_at(entry) == key
            ):
                return entry
            entry = int(self.chain[entry])
        return NONE

    def _key_at(self, entry: int) -> bytes:
        start = int(self.offset[entry])
        return bytes(self._data_view[start : start + int(self.key_len[entry])])

    def _unchain(self, entry: int) -> None:
        bucket = int(self.hash[entry]) & (self.geometry.buckets - 1)
        current = int(self.buckets[bucket])
        if current == entry:
            self.buckets[bucket] = self.chain[entry]
            return
        while current != NONE:
            following = int(self.chain[current])
            if following == entry:
                self.chain[current] = self.chain[entry]
                return
            current = following

    def _free(self, entry: int) -> None:
        """Remove an entry from every structure (caller holds the lock)."""
        was_committed = self.state[entry] == COMMITTED
        self.state[entry] = FREE
        self.gen[entry] += 1
        self._unchain(entry)
        before, after = int(self.prev[entry]), int(self.next[entry])
        if before == NONE:
            self._set_link(ADDR_HEAD, after)
        else:
            self.next[before] = after
        if after == NONE:
            self._set_link(ADDR_TAIL, before)
        else:
            self.prev[after] = before
        if self._link(CURSOR_NEXT) == entry:
            self._set_link(CURSOR_NEXT, after)
        self._add(USED, -int(self.span[entry]))
        if was_committed:
            self._add(OBJECTS, -1)
        self.chain[entry] = self._link(FREE_HEAD)
        self._set(FREE_HEAD, entry)

    # --- allocation ----------------------------------------------------------

    def _evictable(self, entry: int) -> bool:
        """May the allocator take this entry's space now? Clears second chances."""
        state = int(self.state[entry])
        if state == COMMITTED:
            if self.hot[entry]:
                self.hot[entry] = 0
                return False
            return True
        return state == PENDING and not self._writer_alive(int(self.writer[entry]))

    def _evict(self, entry: int) -> None:
        self._add(EVICTIONS if self.state[entry] == COMMITTED else RECLAIMED, 1)
        self._free(entry)

    def _allocate(self, span: int) -> tuple[int, int, int] | None:
        """(offset, prev entry, next entry) of a free range of `span` bytes, or None."""
        capacity = self.geometry.capacity
        start, following = self._get(CURSOR), self._link(CURSOR_NEXT)
        travelled = 0
        while travelled <= 2 * capacity + span:
            if start + span > capacity:
                travelled += capacity - start
                start, following = 0, self._link(ADDR_HEAD)
            victims, blocker, entry = [], NONE, following
            while entry != NONE and self.offset[entry] < start + span:
                if not self._evictable(entry):
                    blocker = entry
                    break
                victims.append(entry)
                entry = int(self.next[entry])
            if blocker == NONE:
                before = int(self.prev[following]) if following != NONE else self._link(ADDR_TAIL)
                for victim in victims:
                    self._evict(victim)
                return start, before, entry
            end = int(self.offset[blocker] + self.span[blocker])
            travelled += end - start
            start, following = end, int(self.next[blocker])
        return None

    def _evict_one(self) -> bool:
        """Free one entry slot when the table is full (clock order from the hand)."""
        entry, steps = self._link(CURSOR_NEXT), 0
        while steps < 2 * self.geometry.entries + 1:
            if entry == NONE:
                entry = self._link(ADDR_HEAD)
                if entry == NONE:
                    return False
            following = int(self.next[entry])
            if self._evictable(entry):
                self._evict(entry)
                return True
            entry, steps = following, steps + 1
        return False

    def reserve(self, key: bytes, nbytes: int) -> tuple[tuple[int, int], memoryview] | None:
        """Reserve space for `key`; (handle, writable view), or None if taken or no room."""
        span, hashed, writer = self._prepare(key, nbytes)
        with self.locked():
            entry = self._claim(key, hashed, span, nbytes, writer)
            if entry == NONE:
                return None
            generation = int(self.gen[entry])
        start = int(self.offset[entry]) + len(key)
        return (entry, generation), self._data_view[start : start + nbytes]

    def put_small(self, key: bytes, data: memoryview) -> bool:
        """Store a small object in one critical section (cheaper than reserve + commit)."""
        span, hashed, writer = self._prepare(key, data.nbytes)
        with self.locked():
            entry = self._claim(key, hashed, span, data.nbytes, writer)
            if entry == NONE:
                return False
            start = int(self.offset[entry]) + len(key)
            self._data_view[start : start + data.nbytes] = data
            self.state[entry] = COMMITTED
            self._add(OBJECTS, 1)
            return True

    def _prepare(self, key: bytes, nbytes: int) -> tuple[int, int, int]:
        span = _round_up(len(key) + nbytes, ALIGN) or ALIGN
        if span > self.geometry.capacity:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes is larger than the pool "
                f"({self.geometry.capacity} bytes): {self.label}"
            )
        slot, token = self._writer_slot()
        return span, key_hash(key), slot << 48 | token & (2**48 - 1)

    def _claim(self, key: bytes, hashed: int, span: int, nbytes: int, writer: int) -> int:
        """A new pending entry for `key` with room for it, or NONE (caller holds the lock)."""
        existing = self._find(key, hashed)
        if existing != NONE:
            if self.state[existing] == COMMITTED or self._writer_alive(int(self.writer[existing])):
                return NONE
            self._evict(existing)
        if self._link(FREE_HEAD) == NONE and not self._evict_one():
            return NONE
        placed = self._allocate(span)
        if placed is None:
            return NONE
        offset, before, after = placed
        entry = self._link(FREE_HEAD)
        self._set_link(FREE_HEAD, int(self.chain[entry]))
        self._place(entry, key, hashed, offset, span, nbytes, writer, before, after)
        return entry

    def _place(
        self,
        entry: int,
        key: bytes,
        hashed: int,
        offset: int,
        span: int,
        nbytes: int,
        writer: int,
        before: int,
        after: int,
    ) -> None:
        self.hash[entry] = hashed
        self.offset[entry], self.span[entry] = offset, span
        self.length[entry], self.key_len[entry] = nbytes, len(key)
        self.writer[entry], self.hot[entry] = writer, 0
        self._data_view[offset : offset + len(key)] = key
        self.prev[entry], self.next[entry] = before, after
        if before == NONE:
            self._set_link(ADDR_HEAD, entry)
        else:
            self.next[before] = entry
        if after == NONE:
            self._set_link(ADDR_TAIL, entry)
        else:
            self.prev[after] = entry
        bucket = hashed & (self.geometry.buckets - 1)
        self.chain[entry] = self.buckets[bucket]
        self.buckets[bucket] = entry
        self.state[entry] = PENDING
        self._add(USED, span)
        self._set(CURSOR, offset + span)
        self._set_link(CURSOR_NEXT, after)

    def commit(self, handle: tuple[int, int]) -> None:
        """Make a reservation visible."""
        entry, generation = handle
        with self.locked():
            if self.gen[entry] != generation or self.state[entry] != PENDING:
                raise BackendError(f"{self.label}: reservation was reclaimed before commit")
            self.state[entry] = COMMITTED
            self._add(OBJECTS, 1)

    def abort(self, handle: tuple[int, int]) -> None:
        """Drop a reservation and free its space."""
        entry, generation = handle
        with self.locked():
            if self.gen[entry] == generation and self.state[entry] == PENDING:
                self._free(entry)

    # --- readers -------------------------------------------------------------

    def read(self, key: bytes, out_for: Callable[[int], memoryview]) -> memoryview | None:
        """Copy the object into `out_for(size)`; the filled view, or None on a miss."""
        hashed = key_hash(key)
        with self.locked():
            entry = self._find(key, hashed)
            if entry == NONE or self.state[entry] != COMMITTED:
                self._add(MISSES, 1)
                return None
            self.hot[entry] = 1
            start = int(self.offset[entry] + self.key_len[entry])
            size, generation = int(self.length[entry]), int(self.gen[entry])
            out = out_for(size)[:size]
            if size <= SMALL_COPY:
                out[:] = self._data_view[start : start + size]
                self._add(HITS, 1)
                return out
        out[:] = self._data_view[start : start + size]
        with self.locked():
            if self.gen[entry] != generation:
                self._add(MISSES, 1)
                return None
            self._add(HITS, 1)
        return out

    def contains(self, keys: list[bytes]) -> list[bool]:
        """One answer per key, in one pass over the index."""
        if not keys:
            return []
        hashes = key_hashes(keys)
        mask = np.uint64(self.geometry.buckets - 1)
        with self.locked():
            current = self.buckets[(hashes & mask).astype(np.int64)].astype(np.int64)
            found = np.zeros(len(keys), dtype=bool)
            active = current != NONE
            while active.any():
                at = current[active]
                match = (self.hash[at] == hashes[active]) & (self.state[at] == COMMITTED)
                found[np.flatnonzero(active)[match]] = True
                self.hot[at[match]] = 1
                current[active] = np.where(match, NONE, self.chain[at])
                active = current != NONE
        return found.tolist()

    def delete(self, key: bytes) -> bool:
        """Remove a committed object."""
        with self.locked():
            entry = self._find(key, key_hash(key))
            if entry == NONE or self.state[entry] != COMMITTED:
                return False
            self._free(entry)
            return True

    def clear(self) -> int:
        """Remove every committed object; how many were removed."""
        with self.locked():
            committed = np.flatnonzero(self.state == COMMITTED).tolist()
            for entry in committed:
                self._free(entry)
            return len(committed)

    def stats(self) -> StoreStats:
        """The counters kept in the region."""
        with self.locked():
            return StoreStats(
                self.geometry.capacity,
                self._get(USED),
                self._get(OBJECTS),
                self._get(HITS),
                self._get(MISSES),
                self._get(EVICTIONS),
                self._get(RECLAIMED),
            )

    def audit(self) -> list[str]:
        """Problems found by recomputing the derived state from the entry table."""
        with self.locked():
            live = np.flatnonzero(self.state != FREE)
            ordered = live[np.argsort(self.offset[live])]
            ends = (self.offset[ordered] + self.span[ordered])[:-1]
            problems = []
            if (self.offset[ordered[1:]] < ends).any():
                problems.append("objects overlap")
            if self._get(USED) != int(self.span[live].sum()):
                problems.append(
                    f"used is {self._get(USED)}, entries hold {int(self.span[live].sum())}"
                )
            committed = int((self.state == COMMITTED).sum())
            if self._get(OBJECTS) != committed:
                problems.append(f"objects is {self._get(OBJECTS)}, {committed} are committed")
            if self._get(USED) > self.geometry.capacity:
                problems.append("used exceeds capacity")
            for entry in live.tolist():
                if self._find(self._key_at(entry), int(self.hash[entry])) != entry:
                    problems.append(f"entry {entry} is not reachable through the index")
                    break
            return problems

    def info(self) -> dict[str, int | str]:
        """Geometry and counters beyond StoreStats, for `maru pool stats`."""
        g = self.geometry
        return {
            "label": self.label,
            "creation_id": self.creation_id,
            "entries": g.entries,
            "index_overhead_bytes": g.overhead,
            "recoveries": self._get(RECOVERIES),
        }

    def close(self) -> None:
        """Unmap and close (views still exported keep the mapping alive until released)."""
        del self._header, self.buckets, self.data
        for name, _ in _ENTRY_FIELDS:
            delattr(self, name)
        for name in _LINK_FIELDS:
            delattr(self, name)
        self._data_view.release()
        with contextlib.suppress(BufferError):
            self.region.close()
        os.close(self.fd)


# --- opening regions ----------------------------------------------------------

_open_pools: dict[tuple[int, int], Pool] = {}
_open_pools_lock = threading.Lock()


@dataclass(frozen=True)
class RegionSpec:
    """Where a pool's mapping comes from and how to make it.

    `device_size` is set for a device that cannot be resized (devdax): the pool
    must fit in it. `before_init` runs on a new mapping before any page is
    written (NUMA binding).
    """

    path: str
    capacity: int
    label: str
    align: int = PAGE
    mode: int = 0o600
    create: bool = True
    prefault: bool = False
    device_size: int | None = None
    before_init: Callable[[mmap.mmap], None] | None = None


def attach(spec: RegionSpec) -> Pool:
    """The pool at `spec.path`, created atomically if missing; shared within the process."""
    geometry = Geometry.for_capacity(spec.capacity, spec.align)
    if spec.device_size is not None and geometry.total > spec.device_size:
        raise ConfigError(
            f"capacity = {spec.capacity}: needs {geometry.total} bytes with the index, but "
            f"{spec.label} has {spec.device_size}; allowed: at most "
            f"{spec.device_size - geometry.overhead} bytes"
        )
    fd = _open_file(spec)
    try:
        identity = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        with _open_pools_lock:
            pool = _open_pools.get(identity)
            if pool is None:
                pool = _map(fd, spec, geometry)
                _open_pools[identity] = pool
                fd = -1
            elif pool.geometry != geometry:
                check_header(pool.region, geometry, pool.label)
            pool.users += 1
    finally:
        if fd >= 0:
            os.close(fd)
    if spec.prefault:
        _prefault(pool)
    return pool


def detach(pool: Pool) -> None:
    """Release one user of the pool; the last one unmaps it."""
    with _open_pools_lock:
        pool.users -= 1
        if pool.users:
            return
        for identity, candidate in list(_open_pools.items()):
            if candidate is pool:
                del _open_pools[identity]
    pool.close()


def _open_file(spec: RegionSpec) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        if spec.create and spec.device_size is None:
            try:
                fd = os.open(spec.path, flags | os.O_CREAT | os.O_EXCL, spec.mode)
                os.fchmod(fd, spec.mode)
                return fd
            except FileExistsError:
                pass
        return os.open(spec.path, flags)
    except FileNotFoundError:
        raise BackendError(f"{spec.label} does not exist") from None
    except OSError as exc:
        raise BackendError(f"cannot open {spec.label}: {exc.strerror or exc}") from None


def _map(fd: int, spec: RegionSpec, geometry: Geometry) -> Pool:
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, MUTEX_BYTE)
    try:
        device = spec.device_size is not None
        size = spec.device_size if device else os.fstat(fd).st_size
        if size == 0:
            os.ftruncate(fd, geometry.total)
        elif size < HEADER_BYTES:
            raise BackendError(f"{spec.label} is not a maru pool (only {size} bytes)")
        length = geometry.total if size == 0 or device else size
        region = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        fresh = size == 0 or (device and bytes(region[:8]) != MAGIC)
        if not fresh:
            check_header(region, geometry, spec.label)
        if spec.before_init:
            spec.before_init(region)
        pool = Pool(fd, region, geometry, spec.label)
        if fresh:
            if device:
                region[: geometry.data_offset] = bytes(geometry.data_offset)
            pool.initialize()
        return pool
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, MUTEX_BYTE)


def _prefault(pool: Pool) -> None:
    g = pool.geometry
    try:
        pool.region.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), g.data_offset, g.capacity)
    except OSError as exc:
        raise BackendError(
            f"cannot prefault {pool.label}: {exc.strerror or exc} (needs Linux 5.14 or newer)"
        ) from None


class PoolBackend(Backend):
    """A Backend over a mapped Pool; subclasses say where the mapping comes from."""

    def __init__(self, config: Any, *, create: bool = True) -> None:
        super().__init__(config)
        spec = self.region_spec()
        self.pool = attach(spec if create else replace(spec, create=False))

    @abstractmethod
    def region_spec(self) -> RegionSpec:
        """Where this backend's pool lives."""

    def _put(self, key: bytes, data: memoryview) -> bool:
        if data.nbytes <= SMALL_COPY:
            return self.pool.put_small(key, data)
        return super()._put(key, data)

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        return self.pool.reserve(key, nbytes)

    def _commit(self, handle: tuple[int, int]) -> None:
        self.pool.commit(handle)

    def _abort(self, handle: tuple[int, int]) -> None:
        self.pool.abort(handle)

    def _get(self, key: bytes) -> bytes | None:
        view = self.pool.read(key, lambda size: memoryview(bytearray(size)))
        return None if view is None else bytes(view)

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        def fits(size: int) -> memoryview:
            if size > out.nbytes:
                raise self.too_small(key, size, out)
            return out

        view = self.pool.read(key, fits)
        return None if view is None else view.nbytes

    def _contains(self, keys: list[bytes]) -> list[bool]:
        return self.pool.contains(keys)

    def _delete(self, key: bytes) -> bool:
        return self.pool.delete(key)

    def _stats(self) -> StoreStats:
        return self.pool.stats()

    def _close(self) -> None:
        detach(self.pool)
