"""A pool's audit: its derived state recomputed from the entry table and compared, for
tests and tools (never on a serving path: it reads every entry under the lock)."""

from __future__ import annotations

import numpy as np

from maru.backends._pool.index import Index
from maru.backends._pool.region import COMMITTED, FREE, OBJECTS, USED, Damaged, Tables


def audit(t: Tables, index: Index, capacity: int) -> list[str]:
    """Problems found (caller holds the pool lock): overlapping objects, counters that
    disagree with the entries, entries that fail their checks, entries the index cannot
    reach."""
    a = t.arrays
    live = np.flatnonzero(a.state != FREE)
    ordered = live[np.argsort(a.offset[live])]
    ends = (a.offset[ordered] + a.span[ordered])[:-1]
    problems = []
    if (a.offset[ordered[1:]] < ends).any():
        problems.append("objects overlap")
    held = int(a.span[live].sum())
    if t.get(USED) != held:
        problems.append(f"used is {t.get(USED)}, entries hold {held}")
    committed = int((a.state == COMMITTED).sum())
    if t.get(OBJECTS) != committed:
        problems.append(f"objects is {t.get(OBJECTS)}, {committed} are committed")
    if t.get(USED) > capacity:
        problems.append("used exceeds capacity")
    unsound = [entry for entry in live.tolist() if not t.sound(entry)]
    if unsound:
        problems.append(f"{len(unsound)} entries fail their checks")
    try:
        for entry in sorted(set(live.tolist()) - set(unsound)):
            if index.find(t.key_at(entry), int(t.hash[entry])) != entry:
                problems.append(f"entry {entry} is not reachable through the index")
                break
    except Damaged as exc:
        problems.append(f"the index is damaged: {exc}")
    return problems
