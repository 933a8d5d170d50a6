"""Work shared between the calling thread and one helper thread.

One thread copying a hit into a CPU KV cache (and hashing it as it goes) gets a
fraction of what the memory can do: two copied a hit's objects 1.6x as fast as one
memcpy of them, on a 2-core VM (README, "What a hit costs"). An intra-op
thread pool splits work up front, so the caller waits whenever a pool thread has no
core (another process, vLLM's own threads). Here the caller works through the tasks
itself and the helper only takes those nobody has started: a helper that gets no
core leaves the caller doing everything, never waiting for work not begun. A caller
bound to one CPU (vLLM's CPU worker under `vllm serve`, pinned by its OpenMP
settings) does every task itself: a helper there could only take turns with it.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence


class HelperThread:
    """A daemon thread that takes a share of the tasks given to `share`."""

    def __init__(self, name: str = "maru-helper") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    def share(self, tasks: Sequence[Callable[[], None]]) -> list[Exception | None]:
        """Run every task once, each on this thread or the helper (never where this
        thread may run on one CPU only), in any order; each task's exception (or None),
        by index. Returns once all are done."""
        outcomes: list[Exception | None] = [None] * len(tasks)
        turns = itertools.count()  # next() hands out each index once, in any thread
        done = threading.Semaphore(0)

        def work() -> None:
            while (index := next(turns)) < len(tasks):
                try:
                    tasks[index]()
                except Exception as exc:
                    outcomes[index] = exc
                done.release()

        if len(tasks) > 1 and len(os.sched_getaffinity(0)) > 1:  # this thread's CPUs
            self._jobs.put(work)
        work()
        for _ in tasks:
            done.acquire()
        return outcomes


_helper: HelperThread | None = None


def helper() -> HelperThread:
    """This process's helper thread, started on first use (again in a forked child)."""
    global _helper
    if _helper is None:
        _helper = HelperThread()
    return _helper


def _forget_helper() -> None:
    global _helper
    _helper = None


os.register_at_fork(after_in_child=_forget_helper)
