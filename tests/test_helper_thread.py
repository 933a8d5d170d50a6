"""Work shared with a helper thread: every task runs once, both threads take tasks, a
helper that gets no core never holds the caller up, a caller bound to one CPU works
alone, and a forked child has its own."""

from __future__ import annotations

import os
import threading
import time

from maru.helper_thread import HelperThread, helper

WAIT_S = 30
"""How long a test waits for a thread it needs before it fails (never reached when
the code is right)."""


def test_every_task_runs_once_and_failures_come_back_by_index() -> None:
    ran: list[int] = []

    def task(index: int):
        def run() -> None:
            ran.append(index)
            if index % 3 == 0:
                raise ValueError(f"task {index}")

        return run

    outcomes = HelperThread().share([task(i) for i in range(10)])
    assert sorted(ran) == list(range(10))
    assert [str(exc) if exc else None for exc in outcomes] == [
        f"task {i}" if i % 3 == 0 else None for i in range(10)
    ]


def test_the_helper_takes_tasks_beside_the_caller() -> None:
    """Two tasks that can only finish together: each must run on a thread of its own."""
    together = threading.Barrier(2, timeout=WAIT_S)
    names: set[str] = set()

    def task() -> None:
        names.add(threading.current_thread().name)
        together.wait()

    assert HelperThread(name="the-helper").share([task, task]) == [None, None]
    assert names == {threading.current_thread().name, "the-helper"}


def test_a_helper_without_a_core_never_holds_the_caller_up() -> None:
    """The helper is stuck in another caller's task: this caller runs every task itself."""
    shared, held, release = HelperThread(name="the-helper"), threading.Event(), threading.Event()
    together = threading.Barrier(2, timeout=WAIT_S)

    def hold_the_helper() -> None:
        together.wait()  # one task on each thread
        if threading.current_thread().name == "the-helper":
            held.set()
            release.wait(WAIT_S)

    other = threading.Thread(target=shared.share, args=([hold_the_helper] * 2,))
    other.start()
    names: list[str] = []
    try:
        assert held.wait(WAIT_S)
        outcomes = shared.share([lambda: names.append(threading.current_thread().name)] * 5)
    finally:
        release.set()
        other.join(WAIT_S)
    assert outcomes == [None] * 5 and set(names) == {threading.current_thread().name}


def test_a_caller_bound_to_one_cpu_runs_every_task_itself() -> None:
    """vLLM's pinned CPU worker: the first task pauses, which a helper free to run would
    use to take the second (a helper on the caller's only CPU just takes turns)."""
    shared, names, outcomes = HelperThread(), [], []

    def record() -> None:
        names.append(threading.current_thread().name)

    def pinned_caller() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread only
        outcomes.extend(shared.share([lambda: time.sleep(0.5), record, record]))

    caller = threading.Thread(target=pinned_caller, name="pinned-caller")
    caller.start()
    caller.join(WAIT_S)
    assert outcomes == [None] * 3 and names == ["pinned-caller"] * 2


def test_a_forked_child_shares_with_a_helper_of_its_own() -> None:
    """Where Intel's OpenMP is loaded (vLLM 0.18's environment) a forked child starts bound
    to one CPU, where it would work alone: it gets the parent's CPUs back first."""
    helper().share([lambda: None, lambda: None])  # the parent's helper has started
    cpus = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, cpus)
        together = threading.Barrier(2, timeout=WAIT_S)
        try:
            ok = helper().share([together.wait, together.wait]) == [None, None]
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
