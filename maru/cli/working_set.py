"""The working set of `maru bench`: how many objects of one size it reads back while
measuring, sized from what the store holds at once (its capacity, and its entries where
it has a fixed table of them, as a pool has), so that the puts meanwhile never evict
them, at every size the benchmark accepts."""

from __future__ import annotations

from dataclasses import dataclass

import maru
from maru.errors import UnsupportedOperationError
from maru.sizes import format_size

MAX_WORKING_SET = 16_384
"""Most objects read back while measuring one size (tiny objects on a large store)."""


@dataclass(frozen=True)
class WorkingSet:
    """The objects of one size read back while measuring: `objects` of those written
    before (0: each read is of the object just written, as no older one survives a
    put), out of the `holds` the store keeps at once; `bound` names what bounds them
    ("entries", "capacity", "buffers" or "limit")."""

    objects: int
    holds: int
    bound: str
    entries: int | None
    capacity: int

    def describe(self, size: int) -> str:
        """One line for people, e.g. "working set 1024 objects of 4 KiB: bounded by
        the store's 4096 entries"."""
        what = (
            f"1 object of {format_size(size)}, the one just written"
            if self.objects == 0
            else f"{self.objects} object{'s' * (self.objects > 1)} of {format_size(size)}"
        )
        return f"working set {what}: bounded by {self._bound_text()}"

    def _bound_text(self) -> str:
        return {
            "entries": f"the store's {self.entries} entries",
            "capacity": f"the store's capacity ({format_size(self.capacity)}, "
            f"{self.holds} of them at once)",
            "buffers": "the benchmark's rotating buffers",
            "limit": f"the benchmark's limit of {MAX_WORKING_SET} objects",
        }[self.bound]


def store_entries(store: maru.Backend) -> int | None:
    """How many objects the store holds at most, where it has a fixed table of entries
    (`info()["entries"]`); None where only its capacity bounds them."""
    try:
        entries = store.info().get("entries")
    except UnsupportedOperationError:
        return None
    return entries if isinstance(entries, int) else None


def working_set(store: maru.Backend, size: int, buffer_bytes: int) -> WorkingSet:
    """The objects of `size` read back while measuring: at most a quarter of what the
    store holds at once (by its capacity, less one object's room for keys and headers,
    and by its entries), so that the objects put meanwhile never evict them."""
    capacity, entries = store.stats().capacity, store_entries(store)
    by_bytes = max(1, capacity // size - 1)
    holds = by_bytes if entries is None else min(by_bytes, entries)
    if holds < 2:
        return WorkingSet(
            0, holds, "capacity" if holds == by_bytes else "entries", entries, capacity
        )
    limits = {} if entries is None else {"entries": entries // 4}
    limits |= {
        "capacity": by_bytes // 4,
        "buffers": buffer_bytes // size,
        "limit": MAX_WORKING_SET,
    }
    bound = min(limits, key=limits.__getitem__)
    return WorkingSet(max(1, limits[bound]), holds, bound, entries, capacity)
