"""Work shared between the calling thread and one helper thread.

One thread copying a hit into a CPU KV cache (and hashing it as it goes) gets a
fraction of what the memory can do: two copied a hit's objects 1.6x as fast as one
memcpy of them, on a 2-core VM (README, "What a hit costs"). An intra-op
thread pool splits work up front, so the caller waits whenever a pool thread has no
core (another process, vLLM's own threads). Here the caller works through the tasks
itself and the helper only takes those nobody has started: a helper that gets no
core leaves the caller doing everything, never waiting for work not begun.

A thread starts pinned where the thread that started it is. vLLM's CPU workers run
under an OpenMP runtime that pins the calling thread to one CPU (`vllm serve`: torch's
libgomp preloaded, `GOMP_CPU_AFFINITY`), so the helper moves itself to the process's
other CPUs before its first task (see `move_off_the_starters_cpu`).
"""

from __future__ import annotations

import contextlib
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
        placed = False
        while True:
            job = self._jobs.get()
            placed = placed or move_off_the_starters_cpu()
            job()

    def share(self, tasks: Sequence[Callable[[], None]]) -> list[Exception | None]:
        """Run every task once, each on this thread or the helper, in any order; each
        task's exception (or None), by index. Returns once all are done."""
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

        if len(tasks) > 1:
            self._jobs.put(work)
        work()
        for _ in tasks:
            done.acquire()
        return outcomes


def move_off_the_starters_cpu() -> bool:
    """Where this thread is pinned to one CPU (as it inherited from the thread that
    started it), let it run on the CPUs the process's other threads may use instead;
    whether that is settled. Not yet where no other thread has another CPU (an OpenMP
    runtime starts its threads at its first parallel work)."""
    if not hasattr(os, "sched_getaffinity"):
        return True
    mine = os.sched_getaffinity(0)
    if len(mine) > 1:
        return True
    others = process_cpus() - mine
    if not others:
        return False
    with contextlib.suppress(OSError):  # a CPU set restricted meanwhile: stay
        os.sched_setaffinity(0, others)
    return True


def process_cpus() -> set[int]:
    """The CPUs any thread of this process may run on."""
    cpus: set[int] = set()
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # it ended meanwhile
            cpus |= os.sched_getaffinity(int(thread))
    return cpus


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
