"""What a background load's thread does beside the engine's busy thread keeps the
interpreter's lock where handing it back would cost more than it saves: a thread that
hands it back waits for it again, up to the switch interval, each time. The pool's
mutex, taken and given without contention, and sums of objects (below 32 MiB) keep it;
waiting for a mutex another process holds hands it back."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from maru._streamcopy import SUM_STATE_BYTES, sum_feed

from maru.backends._pool.locks import Mutex, lock_descriptor, lock_region, unlock_region

SWITCH_S = 0.05
"""The switch interval the tests run under: another thread waiting for the interpreter
gets it by force only after this long, far longer than the work tested takes."""


def others_ran_during(work: Callable[[], None]) -> bool:
    """Did another thread, waiting for the interpreter all along, run during `work`?"""
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.01)  # the spinner has the interpreter; this thread waits for it
        first = count[0]
        work()
        return count[0] != first
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(before)


@pytest.fixture
def descriptors(tmp_path) -> Iterator[tuple[int, int]]:
    """Two lock descriptors of one file, as two processes with the pool open hold."""
    path = tmp_path / "pool"
    path.write_bytes(b"\0" * 4096)
    fd = os.open(path, os.O_RDWR)
    first, second = lock_descriptor(fd), lock_descriptor(fd)
    yield first, second
    for descriptor in (fd, first, second):
        os.close(descriptor)


def test_an_uncontended_mutex_keeps_the_interpreters_lock(descriptors) -> None:
    mutex = Mutex(descriptors[0])

    def take_and_give() -> None:
        for _ in range(20):
            with mutex:
                pass

    assert not others_ran_during(take_and_give)


def test_a_mutex_another_process_holds_is_waited_for_and_then_taken(descriptors) -> None:
    ours, theirs = descriptors
    mutex, entered = Mutex(ours), threading.Event()
    lock_region(theirs)

    def enter() -> None:
        with mutex:
            entered.set()

    waiter = threading.Thread(target=enter)
    waiter.start()
    assert not entered.wait(0.3), "entered while another descriptor held the mutex"
    unlock_region(theirs)
    assert entered.wait(10)
    waiter.join()


def test_sums_of_objects_keep_the_interpreters_lock() -> None:
    state, data = bytearray(SUM_STATE_BYTES), bytes(2 << 20)

    def feed() -> None:
        for _ in range(10):
            sum_feed(state, data)

    assert not others_ran_during(feed)
