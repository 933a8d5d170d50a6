"""Reads off the engine's thread: a few worker-owned threads and a bounded queue.

The engine's thread submits a read (a function) with a deadline and, every step, takes
the reads that are done or past their deadline; it never waits for one. A full queue
refuses a read (the caller fails it at once, so vLLM recomputes) rather than let reads
pile up. The threads start with the first read and are joined by `close`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maru.log import get_logger

log = get_logger(__name__)

THREADS = 4
QUEUE = 256
"""Reads waiting for a thread at most (one per request)."""


class FetchTimeout(TimeoutError):
    """A read did not end by its deadline."""


@dataclass
class Fetch:
    """One read: written by its thread, then `done` set."""

    tag: str
    read: Callable[[], Any]
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Fetched:
    """What became of a read, as the engine's thread takes it: its result, or the error
    (a FetchTimeout past its deadline)."""

    tag: str
    result: Any
    error: BaseException | None


class Fetcher:
    """Runs reads on its own threads (named `maru-load-N`); see the module docstring."""

    def __init__(self, threads: int = THREADS, queued: int = QUEUE) -> None:
        self._threads: list[threading.Thread] = []
        self._size = threads
        self._queue: queue.Queue[Fetch | None] = queue.Queue(queued)
        self._fetches: list[Fetch] = []
        """Submitted and not taken yet, oldest first (the engine's thread's only)."""
        self._closed = False

    def submit(self, tag: str, read: Callable[[], Any], seconds: float) -> bool:
        """Run `read` on a thread within `seconds`; False if the queue is full or closed."""
        if self._closed:
            return False
        fetch = Fetch(tag, read, time.monotonic() + seconds)
        try:
            self._queue.put_nowait(fetch)
        except queue.Full:
            return False
        self._fetches.append(fetch)
        self._start()
        return True

    def _start(self) -> None:
        while len(self._threads) < self._size:
            thread = threading.Thread(
                target=self._run, name=f"maru-load-{len(self._threads)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _run(self) -> None:
        while (fetch := self._queue.get()) is not None:
            if time.monotonic() >= fetch.deadline:  # not worth starting
                fetch.error = FetchTimeout("not started by its deadline")
            else:
                try:
                    fetch.result = fetch.read()
                except Exception as exc:
                    fetch.error = exc
            fetch.done.set()

    def take(self) -> list[Fetched]:
        """The reads done, and those past their deadline (failed; what their threads
        still return is dropped), since the last call."""
        now, taken, still = time.monotonic(), [], []
        for fetch in self._fetches:
            if fetch.done.is_set():
                taken.append(Fetched(fetch.tag, fetch.result, fetch.error))
            elif now >= fetch.deadline:
                taken.append(Fetched(fetch.tag, None, FetchTimeout("past its deadline")))
            else:
                still.append(fetch)
        self._fetches = still
        return taken

    def close(self, wait: float) -> None:
        """Drop the reads not started, stop the threads, and join them (a read still
        running is waited for up to `wait` seconds in all)."""
        self._closed = True
        self._fetches = []
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("maru: %s still reading after %.0f s; left behind", thread.name, wait)
        self._threads = []
