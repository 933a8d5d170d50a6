"""Space and entries: allocation with a clock hand, eviction, and freeing.

Live entries form a doubly linked list in address order (`prev`/`next`); free
entries form a list through `chain`. Allocation walks the address ring from the
clock hand (`CURSOR`): objects under the hand are evicted unless recently used
(second chance), or pending with a live writer. Every link followed and every entry
whose space is taken is checked first (`Damaged` if it fails), and the live entries
the table is rebuilt from must be sound: the rest are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from maru.backends._pool.index import Index
from maru.backends._pool.region import (
    ADDR_HEAD,
    ADDR_TAIL,
    COMMITTED,
    CURSOR,
    CURSOR_NEXT,
    DAMAGED,
    EVICTIONS,
    FREE,
    FREE_HEAD,
    NO_LINK,
    NONE,
    OBJECTS,
    PENDING,
    RECLAIMED,
    REMOVAL_LOG_SLOTS,
    REMOVALS,
    USED,
    Damaged,
    Geometry,
    Tables,
)


class Allocator:
    """Claims and frees entries and their space (caller holds the pool mutex)."""

    def __init__(
        self, tables: Tables, index: Index, geometry: Geometry, alive: Callable[[int], bool]
    ) -> None:
        self._t = tables
        self._index = index
        self._capacity = geometry.capacity
        self._entries = geometry.entries
        self._alive = alive

    def claim(self, key: bytes, hashed: int, span: int, nbytes: int, writer: int) -> int:
        """A new pending entry for `key` with room for it, or NONE."""
        t = self._t
        existing = self._index.find(key, hashed)
        if existing != NONE:
            if t.state[existing] == COMMITTED or self._alive(int(t.writer[existing])):
                return NONE
            self.evict(existing)
        if t.link(FREE_HEAD) == NONE and not self._evict_one():
            return NONE
        placed = self._allocate(span)
        if placed is None:
            return NONE
        offset, before, after = placed
        entry = self._link(FREE_HEAD)
        if entry == NONE or t.state[entry] != FREE:
            raise Damaged("the free list names an entry in use")
        t.set_link(FREE_HEAD, t.entry(t.chain[entry]))
        self._place(entry, key, hashed, offset, span, nbytes, writer, before, after)
        return entry

    def free(self, entry: int) -> None:
        """Remove an entry from every structure."""
        t = self._t
        was_committed = t.state[entry] == COMMITTED
        if was_committed:
            self._log_removal(entry)
        t.gen[entry] += 1  # first: once FREE, no reader may accept the old generation
        t.state[entry] = FREE
        self._index.remove(entry)
        before, after = t.entry(t.prev[entry]), t.entry(t.next[entry])
        if before == NONE:
            t.set_link(ADDR_HEAD, after)
        else:
            t.next[before] = after
        if after == NONE:
            t.set_link(ADDR_TAIL, before)
        else:
            t.prev[after] = before
        if t.link(CURSOR_NEXT) == entry:
            t.set_link(CURSOR_NEXT, after)
        t.add(USED, -int(t.span[entry]))
        if was_committed:
            t.add(OBJECTS, -1)
        t.chain[entry] = t.link(FREE_HEAD)
        t.set(FREE_HEAD, entry)

    def _log_removal(self, entry: int) -> None:
        """Write a committed entry's key hash into the removal log, for readers that follow
        it (`Pool.removed_since`)."""
        t = self._t
        removals = t.get(REMOVALS)
        t.removal_log[removals % REMOVAL_LOG_SLOTS] = t.hash[entry]
        t.set(REMOVALS, removals + 1)

    def evict(self, entry: int) -> None:
        """Free an entry, counted as an eviction (committed) or a reclaim (pending)."""
        self._t.add(EVICTIONS if self._t.state[entry] == COMMITTED else RECLAIMED, 1)
        self.free(entry)

    def _evictable(self, entry: int) -> bool:
        """May the allocator take this entry's space now? Clears second chances."""
        t = self._t
        if not t.sound(entry):
            raise Damaged(f"entry {entry} under the clock hand fails its checks")
        state = int(t.state[entry])
        if state == COMMITTED:
            if t.hot[entry]:
                t.hot[entry] = 0
                return False
            return True
        return state == PENDING and not self._alive(int(t.writer[entry]))

    def _allocate(self, span: int) -> tuple[int, int, int] | None:
        """(offset, prev entry, next entry) of a free range of `span` bytes, or None."""
        t, capacity = self._t, self._capacity
        start, following = t.get(CURSOR), self._link(CURSOR_NEXT)
        if start > capacity:
            raise Damaged(f"the clock hand is at {start}, beyond the pool")
        travelled = 0
        while travelled <= 2 * capacity + span:
            if start + span > capacity:
                travelled += capacity - start
                start, following = 0, self._link(ADDR_HEAD)
            victims, blocker, entry = [], NONE, following
            while entry != NONE and t.offset[entry] < start + span:
                if not self._evictable(entry):
                    blocker = entry
                    break
                victims.append(entry)
                entry = t.entry(t.next[entry])
            if blocker == NONE:
                before = t.entry(t.prev[following]) if following != NONE else self._link(ADDR_TAIL)
                for victim in victims:
                    self.evict(victim)
                return start, before, entry
            end = int(t.offset[blocker] + t.span[blocker])
            if end <= start:
                raise Damaged("the address list goes backwards")
            travelled += end - start
            start, following = end, t.entry(t.next[blocker])
        return None

    def _link(self, word: int) -> int:
        """A header word that names an entry, checked."""
        return self._t.entry(self._t.link(word))

    def _evict_one(self) -> bool:
        """Free one entry slot when the table is full (clock order from the hand)."""
        t = self._t
        entry, steps = self._link(CURSOR_NEXT), 0
        while steps < 2 * self._entries + 1:
            if entry == NONE:
                entry = self._link(ADDR_HEAD)
                if entry == NONE:
                    return False
            following = t.entry(t.next[entry])
            if self._evictable(entry):
                self.evict(entry)
                return True
            entry, steps = following, steps + 1
        return False

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
        t = self._t
        t.hash[entry] = hashed
        t.offset[entry], t.span[entry] = offset, span
        t.length[entry], t.key_len[entry] = nbytes, len(key)
        t.writer[entry], t.hot[entry] = writer, 0
        t.data_view[offset : offset + len(key)] = key
        t.prev[entry], t.next[entry] = before, after
        if before == NONE:
            t.set_link(ADDR_HEAD, entry)
        else:
            t.next[before] = entry
        if after == NONE:
            t.set_link(ADDR_TAIL, entry)
        else:
            t.prev[after] = entry
        self._index.insert(entry, hashed)
        t.state[entry] = PENDING
        t.seal(entry)
        t.add(USED, span)
        t.set(CURSOR, offset + span)
        t.set_link(CURSOR_NEXT, after)

    def live_entries(self) -> np.ndarray:
        """Entries in use, in address order; frees those that are not sound (counted as
        damaged) or overlap another."""
        a, t = self._t.arrays, self._t
        unsound = [e for e in np.flatnonzero(a.state != FREE).tolist() if not t.sound(e)]
        self._drop(unsound)
        t.add(DAMAGED, len(unsound))
        live = np.flatnonzero(a.state != FREE)
        live = live[np.argsort(a.offset[live], kind="stable")]
        overlaps = live[1:][a.offset[live[1:]] < (a.offset[live] + a.span[live])[:-1]]
        self._drop(overlaps.tolist())
        return live[a.state[live] != FREE]

    def _drop(self, entries: list[int]) -> None:
        """Mark entries free, changing their generation first (a rebuild relinks them)."""
        a = self._t.arrays
        for entry in entries:
            a.gen[entry] += 1
            a.state[entry] = FREE

    def rebuild(self, live: np.ndarray) -> None:
        """Address list, free list, counters and hand from `live_entries()` (after the
        index is rebuilt: the free list reuses `chain`)."""
        t, a = self._t, self._t.arrays
        a.prev[:] = NONE
        a.next[:] = NONE
        if len(live):
            a.prev[live[1:]] = live[:-1]
            a.next[live[:-1]] = live[1:]
        t.set(ADDR_HEAD, int(live[0]) if len(live) else NO_LINK)
        t.set(ADDR_TAIL, int(live[-1]) if len(live) else NO_LINK)
        free = np.flatnonzero(a.state == FREE)
        a.chain[free[:-1]] = free[1:]
        t.set(FREE_HEAD, int(free[0]) if len(free) else NO_LINK)
        t.set(USED, int(a.span[live].sum()))
        t.set(OBJECTS, int((a.state[live] == COMMITTED).sum()))
        if t.get(CURSOR) > self._capacity:
            t.set(CURSOR, 0)
        after = live[a.offset[live] >= t.get(CURSOR)]
        t.set_link(CURSOR_NEXT, int(after[0]) if len(after) else NONE)
