"""Copies of objects into one tier, written in the background by a thread of its own.

A save lands in the first tier; the copies into the tiers below (a disk, a network
store) are queued here, so the caller never waits for them. The queue is bounded: when
the tier cannot keep up, a copy is dropped (counted) rather than the caller blocked.
A queued copy names its key and reads the object from the first tier when its turn
comes (`Backend.peek`: not a hit, and no second chance against eviction), so queueing
copies nothing; a copy that carries its own bytes (a promotion of an
object read from below, or a save the first tier could not take) holds them until
written. An object gone from the first tier before its turn is lost (counted), and so
is one that changed while it was being copied (its memory reused): the copy goes
through a reservation in the tier, aborted unless the object was still whole once
copied, so no reader of the tier ever sees torn bytes.

The thread is the copier's own: `close` waits (up to its timeout) for the queued copies,
counts those still queued as dropped, waits for the copy being written (bounded by the
tier's own timeouts), and returns once the thread has ended, so nothing of the copier
runs, or logs, after it. A copy submitted once closing began is dropped (counted).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from maru.backends.base import Backend
from maru.errors import BackendError, ConfigError
from maru.log import get_logger

log = get_logger(__name__)
STOP = object()
"""Queued by `close`: the thread ends once the copies before it are handled."""
THREAD_PREFIX = "maru-copies-to-"
"""The name of a copier's thread, followed by its tier's name."""
COUNTS = ("queued", "written", "present", "dropped", "lost", "failed")
"""What a copier counts: copies queued, written, found already in the tier, dropped
(the queue was full, or the copier was closing), lost because the object left the
first tier first, and failed in the tier."""


class _Changed(Exception):
    """The object changed while it was being copied: the copy is aborted."""


class Copier:
    """Copies into `target` of objects of `source` (the first tier); see the module
    docstring. `depth` 0 copies in the caller instead."""

    def __init__(
        self,
        source: Backend,
        target: Backend,
        depth: int,
        refused: Callable[[Backend, ConfigError], None] = lambda tier, exc: None,
    ) -> None:
        self.source, self.target = source, target
        self._refused = refused
        """Told once the tier refuses maru's settings; no copy is tried after that."""
        self.off = False
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        self._lock = threading.Lock()
        self._queue: queue.Queue[Any] | None = queue.Queue(depth) if depth else None
        self._thread: threading.Thread | None = None
        self._gate = threading.Lock()
        """Held to queue a copy and to close: nothing is queued once closing began."""
        self._closing = False

    def submit(self, key: bytes, data: Any = None) -> None:
        """Copy the object `key` into the tier: `data` if given (bytes nobody changes
        meanwhile), else the first tier's object."""
        self._count("queued")
        if self._closing:
            self._count("dropped")
        elif self._queue is None:
            self._copy(key, data)
        elif not self._enqueue((key, data)):
            self._count("dropped")
            if worth_logging(self.counts["dropped"]):
                log.warning(
                    "maru tier %s cannot keep up: %d copies dropped so far",
                    self.target.name,
                    self.counts["dropped"],
                )

    def _enqueue(self, item: tuple[bytes, Any]) -> bool:
        """Queue a copy, starting the thread if needed; False if full or closing."""
        assert self._queue is not None
        with self._gate:
            if self._closing:
                return False
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=THREAD_PREFIX + self.target.name, daemon=True
                )
                self._thread.start()
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                return False
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued copy is written (or dropped); False on timeout."""
        if self._queue is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def close(self, timeout: float) -> None:
        """Write what is queued, for up to `timeout` seconds, drop (counted) what is
        still queued then, and return once the thread has ended."""
        with self._gate:
            self._closing = True
        if self._thread is None or self._queue is None:
            return
        self.flush(timeout)
        dropped = self._drop_queued()
        if dropped:
            log.warning(
                "maru tier %s: %d queued copies dropped at close (after %.1f s)",
                self.target.name,
                dropped,
                timeout,
            )
        self._queue.put(STOP)
        self._thread.join()

    def _drop_queued(self) -> int:
        """Take every queued copy off the queue, counted as dropped; how many."""
        assert self._queue is not None
        dropped = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return dropped
            self._queue.task_done()
            self._count("dropped")
            dropped += 1

    def _run(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is STOP:
                    return
                self._copy(*item)
            finally:
                self._queue.task_done()

    def _copy(self, key: bytes, data: Any) -> None:
        """Write one copy; a failure is counted and logged (now and then: a tier that is
        down fails every copy), never raised."""
        if self.off:
            self._count("failed")
            return
        try:
            self._count(self._write(key, data))
        except ConfigError as exc:
            self._count("failed")
            self.off = True
            self._refused(self.target, exc)
        except BackendError as exc:
            self._count("failed")
            if worth_logging(self.counts["failed"]):
                log.warning(
                    "maru tier %s failed to store a copy (%d failed so far): %s",
                    self.target.name,
                    self.counts["failed"],
                    exc,
                )
        except Exception:
            self._count("failed")
            if worth_logging(self.counts["failed"]):
                log.exception("maru tier %s: copy failed", self.target.name)

    def _write(self, key: bytes, data: Any) -> str:
        """Copy one object; what to count."""
        if data is not None:
            return "written" if self.target.put(key, data) else "present"
        view = self.source.peek(key)
        if view is None:
            return "lost"
        try:
            with self.target.reserve(key, len(view.data)) as buffer:
                if buffer is None:
                    return "present"
                buffer[:] = view.data
                if not view.valid():
                    raise _Changed
        except _Changed:
            return "lost"
        return "written"

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


def worth_logging(count: int) -> bool:
    """Is the `count`th failure of a kind logged: the 1st, the 100th, every 10,000th."""
    return count in (1, 100) or count % 10_000 == 0
