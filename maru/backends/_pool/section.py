"""The pool's critical sections: the mutex held, half-done changes recovered, damage
repaired.

A changing section marks the pool dirty until it completes; any section first rebuilds
what an earlier holder left half done (it died or raised midway: `recoveries`), and a
section in which damage was found (`Damaged`) rebuilds before it lets go of the mutex
(`repairs`), marked dirty meanwhile so that a repair cut short is done by the next
holder.
"""

from __future__ import annotations

from collections.abc import Callable

from maru.backends._pool.locks import Mutex
from maru.backends._pool.region import DIRTY, RECOVERIES, REPAIRS, Damaged, Tables


class Section:
    """The pool mutex held around a critical section (a class, not a generator: it is
    taken twice per put or get)."""

    __slots__ = ("_changing", "_mutex", "_rebuild", "_tables")

    def __init__(
        self, mutex: Mutex, tables: Tables, rebuild: Callable[[], None], changing: bool
    ) -> None:
        self._mutex, self._tables, self._rebuild = mutex, tables, rebuild
        self._changing = changing

    def __enter__(self) -> None:
        self._mutex.__enter__()
        try:
            self._recover()
            if self._changing:
                self._tables.set(DIRTY, 1)
        except BaseException:
            self._mutex.__exit__(None, None, None)
            raise

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        try:
            if kind is not None and issubclass(kind, Damaged):
                self._repair()
            elif self._changing and kind is None:
                self._tables.set(DIRTY, 0)
        finally:
            self._mutex.__exit__(None, None, None)

    def _recover(self) -> None:
        """Rebuild if the last change was left half done."""
        if self._tables.get(DIRTY):
            self._rebuild()
            self._tables.add(RECOVERIES, 1)
            self._tables.set(DIRTY, 0)

    def _repair(self) -> None:
        """Rebuild after damage was found."""
        self._tables.set(DIRTY, 1)
        self._rebuild()
        self._tables.add(REPAIRS, 1)
        self._tables.set(DIRTY, 0)
