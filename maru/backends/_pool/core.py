"""`Pool`: one mapped pool, composed of its format, locks, index and allocator.

- Mutual exclusion: one byte lock. The holder sets `dirty` while it mutates and
  clears it only once the change is complete; a process that takes the lock and
  finds `dirty` set knows the previous holder died or raised mid-change and
  rebuilds the derived state (index, address list, free list, counters) from the
  entry table, which is written so that every entry is either whole or free.
- Writers hold a per-process slot lock for as long as the pool is open. A
  pending reservation records its writer's slot and token; once that slot's
  lock is free (or held by someone with another token) the writer is dead and
  the space is reclaimed.
- Readers take no pins. Each entry has a generation that changes whenever it
  is freed; a large object is copied outside the lock and the copy counts only
  if the generation is unchanged afterwards, so a reader gets the committed
  bytes or a miss, never a recycled object.
- Damage (bytes in the region no maru wrote) is found by the checks of `region`,
  `index` and `allocator`, which raise `Damaged` inside a section: the section then
  rebuilds the derived state from the entry table, dropping the entries that are
  not sound (counted in `damaged`, the repair in `repairs`), and the operation is a
  miss (a read) or is tried once more (a write, a lookup, a listing).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from maru.backends._pool.allocator import Allocator
from maru.backends._pool.audit import audit
from maru.backends._pool.checksum import NO_CHECKSUM, Hasher, intact
from maru.backends._pool.checksum import checksum as object_checksum
from maru.backends._pool.index import Index, key_hash, key_hashes
from maru.backends._pool.locks import (
    Mutex,
    WriterSlots,
    forget_after_fork,
    hold,
    lock_descriptor,
    lock_descriptor_in_child,
    reset_after_fork,
)
from maru.backends._pool.mapping import Mapping
from maru.backends._pool.region import (
    ALIGN,
    COMMITTED,
    CORRUPT,
    DAMAGED,
    EVICTIONS,
    HITS,
    MISSES,
    NONE,
    OBJECTS,
    PENDING,
    READY,
    RECLAIMED,
    RECOVERIES,
    REMOVAL_LOG_SLOTS,
    REMOVALS,
    REPAIRS,
    USED,
    Damaged,
    Geometry,
    Tables,
    data_start,
    round_up,
)
from maru.backends._pool.section import Section
from maru.backends.base import ReadView, Removals, StoreStats
from maru.errors import BackendError, ObjectTooLargeError

SMALL_COPY = 1024 * 1024
"""Objects up to this size are copied under the lock (one critical section, about
60 us at most); larger ones outside it, checked by generation afterwards."""

Handle = tuple[int, int]
"""A reservation: (entry, generation)."""
_T = TypeVar("_T")


class Pool:
    """One mapped pool, shared by every store of this process that opened it."""

    def __init__(
        self,
        fd: int,
        region: Mapping,
        geometry: Geometry,
        label: str,
        map_range: Callable[[int, int, bool], None] = lambda offset, length, writable: None,
    ) -> None:
        self.fd = fd
        self._map_range = map_range
        """Maps the region's bytes [offset, offset + length) into this process ahead of
        their use, for writing or not (`memory.Populator.ensure`)."""
        self.region = region
        self.geometry = geometry
        self.label = label
        self.users = 0
        self.tables = Tables(region.view, geometry)
        self.index = Index(self.tables, geometry.buckets, geometry.entries)
        self._lock_fd = lock_descriptor(fd)
        hold(self._lock_fd)
        self.writers = WriterSlots(self._lock_fd, self.tables, label)
        self.allocator = Allocator(self.tables, self.index, geometry, self.writers.alive)
        self._mutex = Mutex(self._lock_fd)
        self._reading = Section(self._mutex, self.tables, self._rebuild, changing=False)
        self._changing = Section(self._mutex, self.tables, self._rebuild, changing=True)
        reset_after_fork(self)

    def after_fork(self) -> None:
        """In a forked child: a lock descriptor of its own (holding the pool open), fresh
        thread locks, no writer slot and no reservation of the parent's (it takes a slot
        when it first writes)."""
        self._lock_fd = lock_descriptor_in_child(self._lock_fd)
        if self._lock_fd >= 0:
            hold(self._lock_fd)
        self._mutex.after_fork(self._lock_fd)
        self.writers.after_fork(self._lock_fd)

    @property
    def creation_id(self) -> str:
        """Random id written when the region was created."""
        return self.tables.creation_id

    def initialize(self) -> None:
        """Write a fresh, empty pool (caller holds the file lock; region is zero)."""
        self.tables.write_header(self.region.view, self.geometry)
        self._rebuild()
        self.tables.set(READY, 1)

    # --- locking and recovery --------------------------------------------------

    def locked(self) -> Section:
        """Hold the pool lock to read (counters and use bits may change, nothing else);
        recover first if an earlier change was left half done."""
        return self._reading

    def changing(self) -> Section:
        """Hold the pool lock to change it. The pool stays marked dirty unless the change
        completes: a holder that dies or raises midway leaves the rebuild to the next."""
        return self._changing

    def _rebuild(self) -> None:
        """Derive index, address list, free list and counters from the entry table."""
        live = self.allocator.live_entries()
        self.index.rebuild(live)
        self.allocator.rebuild(live)

    # --- writers -------------------------------------------------------------

    def reserve(self, key: bytes, nbytes: int) -> tuple[Handle, memoryview] | None:
        """Reserve space for `key`; (handle, writable view), or None if taken or no room."""
        span, hashed, writer = self._prepare(key, nbytes)
        t = self.tables

        def claim() -> Handle | None:
            with self.changing():
                entry = self.allocator.claim(key, hashed, span, nbytes, writer)
                return None if entry == NONE else (entry, int(t.gen[entry]))

        handle = self._retried(claim)
        if handle is None:
            return None
        start = data_start(int(t.offset[handle[0]]), len(key))
        self._map_data(start, nbytes, writable=True)
        return handle, t.data_view[start : start + nbytes]

    def put_small(self, key: bytes, data: memoryview, checksum: bool = False) -> bool:
        """Store a small object in one critical section (cheaper than reserve + commit);
        with `checksum`, loads that verify will check it against the bytes given."""
        span, hashed, writer = self._prepare(key, data.nbytes)
        check = object_checksum(data) if checksum else NO_CHECKSUM
        t = self.tables

        def put() -> bool:
            with self.changing():
                entry = self.allocator.claim(key, hashed, span, data.nbytes, writer)
                if entry == NONE:
                    return False
                start = data_start(int(t.offset[entry]), len(key))
                t.data_view[start : start + data.nbytes] = data
                self._publish(entry, check)
                return True

        return self._retried(put)

    def _retried(self, operation: Callable[[], _T]) -> _T:
        """`operation()`, once more if it found damage (repaired meanwhile); damage found
        again is a BackendError."""
        try:
            return operation()
        except Damaged:
            pass
        try:
            return operation()
        except Damaged as exc:
            raise BackendError(f"{self.label} is damaged beyond repair here: {exc}") from None

    def _map_data(self, start: int, size: int, writable: bool) -> None:
        """Map an object's bytes (at `start` of the data area) before they are copied."""
        self._map_range(self.geometry.data_offset + start, size, writable)

    def _prepare(self, key: bytes, nbytes: int) -> tuple[int, int, int]:
        """(span, key hash, writer id) of a new object; refuses one larger than the pool."""
        span = data_start(0, len(key)) + round_up(nbytes, ALIGN)
        if span > self.geometry.capacity:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes is larger than the pool "
                f"({self.geometry.capacity} bytes): {self.label}"
            )
        return span, key_hash(key), self.writers.writer()

    def commit(self, handle: Handle, checksum: bool = False) -> None:
        """Make a reservation visible; refused unless it is still this process's own.
        With `checksum`, loads that verify will check it against the bytes as they are now."""
        check = self._reserved_checksum(handle[0]) if checksum else NO_CHECKSUM
        with self.changing():
            ours = self._own_reservation(handle)
            if ours:
                self._publish(handle[0], check)
        if not ours:
            raise BackendError(
                f"{self.label}: reservation was reclaimed before commit, or belongs to "
                "another process (a reservation is never inherited across fork)"
            )

    def abort(self, handle: Handle) -> None:
        """Drop a reservation and free its space (if it is still this process's own; a
        repair after damage found meanwhile frees it too, or leaves it to reclaiming)."""
        with contextlib.suppress(Damaged), self.changing():
            if self._own_reservation(handle):
                self.allocator.free(handle[0])

    def _reserved_checksum(self, entry: int) -> int:
        """The checksum of a reservation's bytes. Read without the lock: the reservation
        is this process's, and if it was reclaimed meanwhile commit refuses it anyway."""
        t = self.tables
        start = data_start(int(t.offset[entry]), int(t.key_len[entry]))
        return object_checksum(t.data_view[start : start + int(t.length[entry])])

    def _publish(self, entry: int, check: int) -> None:
        """Commit a pending entry with its checksum (caller is changing the pool)."""
        self.tables.check[entry] = check
        self.tables.state[entry] = COMMITTED
        self.tables.seal(entry)
        self.tables.add(OBJECTS, 1)

    def _own_reservation(self, handle: Handle) -> bool:
        """Is the reservation still pending, unreclaimed, and written by this process?"""
        entry, generation = handle
        t = self.tables
        return (
            t.gen[entry] == generation
            and t.state[entry] == PENDING
            and t.sound(entry)
            and self.writers.owns(int(t.writer[entry]))
        )

    # --- readers -------------------------------------------------------------

    def read(
        self, key: bytes, out_for: Callable[[int], memoryview], verify: bool = False
    ) -> memoryview | None:
        """Copy the object into `out_for(size)`; the filled view, or None on a miss.

        With `verify`, an object whose bytes do not match the checksum written at its
        commit is a miss, and is removed (counted in `corrupt`)."""
        copied = self._missed_if_damaged(lambda: self._copy(key, out_for))
        if copied is None:
            return None
        out, entry, generation, check = copied
        if verify and not intact(check, out):
            self._discard_corrupt(entry, generation)
            return None
        return out

    def _find_committed(
        self, key: bytes, counted: bool = True
    ) -> tuple[int, int, int, int, int] | None:
        """(entry, data start, size, generation, stored checksum) of the committed object,
        marked used; None, counted as a miss, if there is none (caller holds the lock).
        Not `counted`: neither marked used nor a miss."""
        t = self.tables
        entry = self.index.find(key, key_hash(key))
        if entry == NONE or t.state[entry] != COMMITTED:
            if counted:
                t.add(MISSES, 1)
            return None
        if counted:
            t.hot[entry] = 1
        start = data_start(int(t.offset[entry]), int(t.key_len[entry]))
        return entry, start, int(t.length[entry]), int(t.gen[entry]), int(t.check[entry])

    def _copy(
        self, key: bytes, out_for: Callable[[int], memoryview]
    ) -> tuple[memoryview, int, int, int] | None:
        """(filled view, entry, generation, stored checksum) of a committed object, or
        None on a miss; counts the hit or the miss."""
        t = self.tables
        with self.locked():
            found = self._find_committed(key)
            if found is None:
                return None
            entry, start, size, generation, check = found
            out = out_for(size)[:size]
            if size <= SMALL_COPY:
                out[:] = t.data_view[start : start + size]
                t.add(HITS, 1)
                return out, entry, generation, check
        self._map_data(start, size, writable=False)
        out[:] = t.data_view[start : start + size]
        with self.locked():
            if t.gen[entry] != generation:
                t.add(MISSES, 1)
                return None
            t.add(HITS, 1)
        return out, entry, generation, check

    def view(self, key: bytes, verify: bool = False, counted: bool = True) -> ReadView | None:
        """The committed object's bytes in place, or None on a miss. Counted as a hit
        now; `valid()` takes that back (a miss) if the object was freed meanwhile, or,
        with `verify`, if its bytes do not match its checksum (it is then removed). Not
        `counted` (a copy into another tier): no hit, no miss, no second chance."""
        t = self.tables
        found = self._missed_if_damaged(lambda: self._found_for_view(key, counted))
        if found is None:
            return None
        entry, start, size, generation, check = found
        self._map_data(start, size, writable=False)
        data = t.data_view[start : start + size].toreadonly()
        verified = verify and check != NO_CHECKSUM

        def valid(hashed: Hasher | None = None) -> bool:
            if verified and not intact(check, data, hashed):
                self._discard_corrupt(entry, generation, counted)
                return False
            with self.locked():
                if t.gen[entry] == generation:
                    return True
                if counted:
                    t.add(HITS, -1)
                    t.add(MISSES, 1)
                return False

        return ReadView(data, valid, Hasher if verified else None)

    def _found_for_view(self, key: bytes, counted: bool) -> tuple[int, int, int, int, int] | None:
        """`_find_committed` in a section of its own, counted as a hit if `counted`."""
        with self.locked():
            found = self._find_committed(key, counted)
            if found is not None and counted:
                self.tables.add(HITS, 1)
            return found

    @staticmethod
    def _missed_if_damaged(read: Callable[[], _T]) -> _T | None:
        """`read()`, or a miss if it found damage (repaired meanwhile)."""
        try:
            return read()
        except Damaged:
            return None

    def _discard_corrupt(self, entry: int, generation: int, counted: bool = True) -> None:
        """Count a load that failed its checksum (as a miss, if it was `counted` as a
        hit), and free the object."""
        t = self.tables
        with contextlib.suppress(Damaged), self.changing():
            t.add(CORRUPT, 1)
            if counted:
                t.add(HITS, -1)
                t.add(MISSES, 1)
            if t.gen[entry] == generation:
                self.allocator.free(entry)

    def contains(self, keys: list[bytes]) -> list[bool]:
        """One answer per key, in one pass over the index."""
        if not keys:
            return []
        hashes = key_hashes(keys)

        def look_up() -> list[bool]:
            with self.locked():
                return self.index.committed(hashes).tolist()

        return self._retried(look_up)

    def delete(self, key: bytes) -> bool:
        """Remove a committed object."""

        def delete() -> bool:
            with self.changing():
                entry = self.index.find(key, key_hash(key))
                if entry == NONE or self.tables.state[entry] != COMMITTED:
                    return False
                self.allocator.free(entry)
                return True

        return self._retried(delete)

    def clear(self) -> int:
        """Remove every committed object; how many were removed."""
        return self.delete_prefix(b"")

    def _entries_under(self, prefix: bytes) -> list[int]:
        """The committed entries whose key starts with `prefix` (the lock held)."""
        t = self.tables
        committed = np.flatnonzero(t.arrays.state == COMMITTED).tolist()
        if not all(t.sound(entry) for entry in committed):
            raise Damaged("a committed entry fails its checks")
        return [e for e in committed if t.key_at(e).startswith(prefix)]

    def keys(self, prefix: bytes) -> list[bytes]:
        """The keys of the committed objects under `prefix`."""

        def listed() -> list[bytes]:
            with self.locked():
                return [self.tables.key_at(entry) for entry in self._entries_under(prefix)]

        return self._retried(listed)

    def delete_prefix(self, prefix: bytes) -> int:
        """Remove every committed object whose key starts with `prefix`; how many."""

        def delete() -> int:
            with self.changing():
                doomed = self._entries_under(prefix)
                for entry in doomed:
                    self.allocator.free(entry)
                return len(doomed)

        return self._retried(delete)

    def removed_since(self, cursor: int | None) -> Removals:
        """The key hashes the removal log holds from `cursor` on (None: from now); no
        list if the log has been overwritten since (more removals than it holds)."""
        t = self.tables
        with self.locked():
            removals = t.get(REMOVALS)
            if cursor is None or cursor == removals:
                return Removals(removals, [])
            if not 0 <= removals - cursor <= REMOVAL_LOG_SLOTS:
                return Removals(removals, None)
            slots = np.arange(cursor, removals) % REMOVAL_LOG_SLOTS
            return Removals(removals, t.removal_log[slots].tolist())

    def stats(self) -> StoreStats:
        """The counters kept in the region."""
        t = self.tables
        with self.locked():
            return StoreStats(
                self.geometry.capacity,
                t.get(USED),
                t.get(OBJECTS),
                t.get(HITS),
                t.get(MISSES),
                t.get(EVICTIONS),
                t.get(RECLAIMED),
            )

    def audit(self) -> list[str]:
        """Problems found by recomputing the derived state from the entry table (tests
        and tools; `maru.backends._pool.audit`)."""
        with self.locked():
            return audit(self.tables, self.index, self.geometry.capacity)

    def info(self) -> dict[str, int | str]:
        """Geometry and counters beyond StoreStats, for `maru pool stats`."""
        g = self.geometry
        return {
            "label": self.label,
            "creation_id": self.creation_id,
            "entries": g.entries,
            "index_overhead_bytes": g.overhead,
            "recoveries": self.tables.get(RECOVERIES),
            "corrupt": self.tables.get(CORRUPT),
            "damaged": self.tables.get(DAMAGED),
            "repairs": self.tables.get(REPAIRS),
        }

    def close(self) -> None:
        """Unmap and close (views still exported keep the mapping alive until released)."""
        forget_after_fork(self)
        if self._lock_fd >= 0:
            self.writers.release()
            os.close(self._lock_fd)
        self.tables.release()
        self.region.close()
        os.close(self.fd)
