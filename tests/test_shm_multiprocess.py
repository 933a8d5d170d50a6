"""Several processes on one shm pool: corruption, crashes, persistence and races."""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import maru
from maru.backends._pool import attach, region
from maru.backends._pool.core import SMALL_COPY
from maru.backends.base import key_digest
from maru.testing import payload
from tests.conftest import call_with_deadline

MIB = 2**20
SPAWN = multiprocessing.get_context("spawn")
FORK = multiprocessing.get_context("fork")


def open_pool(name: str, capacity: int = 8 * MIB) -> maru.Backend:
    return maru.open_store(backend="shm", capacity=capacity, shm={"name": name})


def sized_key(i: int, size: int) -> str:
    return f"obj{i}-{size}"


def churn(name: str, seed: int, seconds: float, results) -> None:
    """Write, read and delete random objects; report every read that was wrong."""
    rng = np.random.default_rng(seed)
    sizes = [4096, 100_000, 300_000, 1_000_000]
    reads = wrong = 0
    with open_pool(name) as store:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            i, size = int(rng.integers(60)), sizes[int(rng.integers(len(sizes)))]
            key = sized_key(i, size)
            action = rng.random()
            if action < 0.45:
                store.put(key, payload(key, size))
            elif action < 0.95:
                out = bytearray(size)
                if store.get_into(key, out) is not None:
                    reads += 1
                    wrong += bytes(out) != payload(key, size)
            else:
                store.delete(key)
    results.put((reads, wrong))


@pytest.mark.slow
def test_concurrent_writers_and_readers_never_see_a_wrong_object(pool_names) -> None:
    name = pool_names()
    results = SPAWN.Queue()
    workers = [SPAWN.Process(target=churn, args=(name, seed, 4.0, results)) for seed in range(4)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert sum(reads for reads, _ in outcomes) > 100
    assert [wrong for _, wrong in outcomes] == [0, 0, 0, 0]
    with open_pool(name) as store:
        stats = store.stats()
        assert stats.evictions > 0
        assert stats.used <= stats.capacity
        assert store.pool.audit() == []


def reserve_and_hang(name: str, ready) -> None:
    store = open_pool(name)
    with store.reserve(b"doomed", 5 * MIB) as buffer:
        buffer[:MIB] = b"x" * MIB
        ready.set()
        time.sleep(600)


def test_space_of_a_writer_killed_mid_reservation_comes_back(pool_names) -> None:
    name = pool_names()
    ready = SPAWN.Event()
    writer = SPAWN.Process(target=reserve_and_hang, args=(name, ready))
    writer.start()
    assert ready.wait(60)
    with open_pool(name) as store:
        assert store.contains([b"doomed"]) == [False]
        assert store.put(b"doomed", b"other") is False, "a live writer's key is taken"
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        for i in range(8):
            assert store.put(f"after{i}", payload(f"after{i}", MIB)), i
        assert store.stats().reclaimed == 1
        assert store.put(b"doomed", b"now mine")
        assert store.get(b"doomed") == b"now mine"
        assert store.pool.audit() == []


def die_holding_the_lock(name: str, ready) -> None:
    store = open_pool(name)
    with store.pool.changing():
        store.pool.tables.add(region.OBJECTS, 1000)
        ready.set()
        time.sleep(600)


def test_a_process_killed_holding_the_lock_does_not_hang_the_others(pool_names) -> None:
    name = pool_names()
    with open_pool(name) as store:
        store.put(b"kept", b"value")
        ready = SPAWN.Event()
        holder = SPAWN.Process(target=die_holding_the_lock, args=(name, ready))
        holder.start()
        assert ready.wait(60)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
        status, stats = call_with_deadline(store.stats, 30)
        assert status == "ok", stats
        assert stats.objects == 1, "the half-made change was rolled back"
        assert store.get(b"kept") == b"value"
        assert store.pool.info()["recoveries"] == 1
        assert store.pool.audit() == []


def raise_inside_a_change(name: str) -> None:
    """Put an object, interrupted (as by Ctrl-C) halfway through the pool's change."""
    store = open_pool(name)
    real_add = store.pool.tables.add

    def add(word: int, delta: int) -> None:
        if word == region.USED:
            raise KeyboardInterrupt
        real_add(word, delta)

    store.pool.tables.add = add
    with contextlib.suppress(KeyboardInterrupt):
        store.put(b"half", b"x" * 5000)


def test_a_change_that_raises_is_repaired_by_the_next_lock_holder(pool_names) -> None:
    name = pool_names()
    with open_pool(name) as store:
        store.put(b"kept", b"value")
        child = SPAWN.Process(target=raise_inside_a_change, args=(name,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert store.pool.audit() == []
        assert store.pool.info()["recoveries"] == 1
        assert store.stats().objects == 1
        assert store.get(b"kept") == b"value"
        assert store.put(b"half", b"whole"), "the dead writer's half-made entry is reclaimed"
        assert store.get(b"half") == b"whole"


def test_a_read_that_raises_leaves_nothing_to_repair(pool_names) -> None:
    with open_pool(pool_names()) as store:
        store.put(b"k", b"0123456789")
        with pytest.raises(maru.BufferTooSmallError):
            store.get_into(b"k", bytearray(4))
        assert store.get(b"k") == b"0123456789"
        assert store.pool.info()["recoveries"] == 0


def write_and_exit(name: str) -> None:
    with open_pool(name) as store:
        store.put(b"persistent", payload("persistent", 3 * MIB))


def test_a_pool_outlives_the_process_that_wrote_it(pool_names) -> None:
    name = pool_names()
    writer = SPAWN.Process(target=write_and_exit, args=(name,))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    with open_pool(name) as store:
        assert store.get(b"persistent") == payload("persistent", 3 * MIB)


def open_and_put(name: str, index: int, barrier, results) -> None:
    barrier.wait()
    with open_pool(name) as store:
        store.put(f"from{index}", b"hello")
        barrier.wait()
        results.put((store.pool.creation_id, store.contains([f"from{i}" for i in range(4)])))
        barrier.wait()


@pytest.mark.slow
def test_racing_creators_end_up_with_one_pool(pool_names) -> None:
    name = pool_names()
    barrier, results = SPAWN.Barrier(4), SPAWN.Queue()
    racers = [
        SPAWN.Process(target=open_and_put, args=(name, i, barrier, results)) for i in range(4)
    ]
    for racer in racers:
        racer.start()
    outcomes = [results.get(timeout=120) for _ in racers]
    for racer in racers:
        racer.join(60)
    assert len({creation_id for creation_id, _ in outcomes}) == 1
    assert all(found == [True] * 4 for _, found in outcomes)


class RecycleDuringCopy:
    """Stands in for the pool's data view: recycles the object while it is being copied."""

    def __init__(self, store: maru.Backend) -> None:
        self.store, self.real = store, store.pool.tables.data_view

    def __getitem__(self, item: slice) -> memoryview:
        if item.stop - item.start > SMALL_COPY:
            self.store.pool.tables.data_view = self.real
            self.store.delete(b"big")
            for i in range(12):
                self.store.put(f"filler{i}", b"\xff" * MIB)
        return self.real[item]


def test_a_large_object_recycled_during_the_copy_is_a_miss(pool_names) -> None:
    with open_pool(pool_names()) as store:
        store.put(b"big", payload("big", 2 * MIB))
        store.pool.tables.data_view = RecycleDuringCopy(store)
        assert store.get(b"big") is None
        assert store.get(b"filler11") == b"\xff" * MIB
        assert store.stats().misses == 1


def use_inherited_store(store: maru.Backend, parent_handle, results) -> None:
    """In a forked child: churn the parent's store, and try to finish its reservation."""
    wrong = reads = 0
    for i in range(40):
        key = f"child{i}"
        assert store.put(key, payload(key, 300_000))
        for earlier in (f"child{i // 2}", "before"):
            data = store.get(earlier)
            reads += data is not None
            wrong += data is not None and data != payload(earlier, len(data))
    with store.reserve(b"child-reserved", 1000) as buffer:
        buffer[:] = payload("child-reserved", 1000)
    try:
        store._commit(parent_handle)
        inherited = "committed the parent's reservation"
    except maru.BackendError:
        store._abort(parent_handle)
        inherited = "refused"
    results.put((reads, wrong, inherited))


def test_a_forked_child_uses_the_pool_while_the_parent_writes(pool_names) -> None:
    with open_pool(pool_names()) as store:
        store.put(b"before", payload("before", 100_000))
        handle, buffer = store._begin(b"parent", 2 * MIB)
        results = FORK.Queue()
        child = FORK.Process(target=use_inherited_store, args=(store, handle, results))
        child.start()
        written = 0
        while child.is_alive() and results.empty():
            key = f"parent{written}"
            assert store.put(key, payload(key, 200_000))
            assert store.get(key) == payload(key, 200_000)
            written += 1
        reads, wrong, inherited = results.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        assert (reads > 0, wrong, inherited) == (True, 0, "refused")
        buffer[:] = payload("parent", 2 * MIB)
        store._commit(handle)
        assert store.get(b"parent") == payload("parent", 2 * MIB)
        assert store.get(b"child-reserved") == payload("child-reserved", 1000)
        assert store.stats().reclaimed == 0
        assert store.pool.audit() == []


HANDLE_ROUNDS = 6


def wait_for_allocations(pressure, amount: int) -> None:
    """Until the pressure processes have allocated `amount` more bytes (hang guard 60 s)."""
    target, deadline = pressure.value + amount, time.monotonic() + 60
    while pressure.value < target:
        assert time.monotonic() < deadline, "the pressure processes stopped allocating"
        time.sleep(0.001)


def write_with_a_second_handle(name: str, writer: int, pressure, results) -> None:
    """Reserve objects; while each is open, open and close a second handle on the pool
    and let the others allocate past the whole pool twice; then finish and commit."""
    rng, lost = np.random.default_rng(writer), 0
    with open_pool(name) as store:
        for i in range(HANDLE_ROUNDS):
            key = f"w{writer}-{i}"
            data = payload(key, int(rng.choice([MIB // 4, MIB // 2, MIB, 2 * MIB])))
            try:
                with store.reserve(key, len(data)) as buffer:
                    buffer[: len(data) // 2] = data[: len(data) // 2]
                    open_pool(name).close()
                    wait_for_allocations(pressure, 2 * 8 * MIB)
                    buffer[len(data) // 2 :] = data[len(data) // 2 :]
            except maru.BackendError:
                lost += 1
    results.put(("lost", lost))


def allocate_and_verify(name: str, index: int, pressure, done, results) -> None:
    """Put objects under eviction pressure; read back recent ones and the writers' ones,
    and count every read whose bytes are not the object's own."""
    rng, reads, wrong = np.random.default_rng(100 + index), 0, 0
    recent: collections.deque[tuple[str, bytes]] = collections.deque(maxlen=3)
    with open_pool(name) as store:
        for i in itertools.count():
            if done.is_set():
                break
            key = f"p{index}-{i}"
            data = payload(key, int(rng.choice([MIB // 4, MIB // 2])))
            if store.put(key, data):
                recent.append((key, data))
                with pressure.get_lock():
                    pressure.value += len(data)
            writer_key = f"w{rng.integers(2)}-{rng.integers(HANDLE_ROUNDS)}"
            for other, expected in [*recent, (writer_key, None)]:
                found = store.get(other)
                if found is not None:
                    reads += 1
                    wrong += found != (expected or payload(other, len(found)))
    results.put(("wrong", (reads, wrong)))


@pytest.mark.slow
def test_a_second_handle_closed_mid_reservation_keeps_the_writer_alive(pool_names) -> None:
    name = pool_names()
    pressure, done, results = SPAWN.Value("q", 0), SPAWN.Event(), SPAWN.Queue()
    with open_pool(name):
        pressers = [
            SPAWN.Process(target=allocate_and_verify, args=(name, i, pressure, done, results))
            for i in range(2)
        ]
        writers = [
            SPAWN.Process(target=write_with_a_second_handle, args=(name, w, pressure, results))
            for w in range(2)
        ]
        for process in pressers + writers:
            process.start()
        outcomes = [results.get(timeout=120) for _ in writers]
        done.set()
        outcomes += [results.get(timeout=60) for _ in pressers]
        for process in pressers + writers:
            process.join(60)
            assert process.exitcode == 0
        lost = sum(value for kind, value in outcomes if kind == "lost")
        reads = [value for kind, value in outcomes if kind == "wrong"]
        assert lost == 0, f"{lost} live reservations were reclaimed"
        assert sum(r for r, _ in reads) > 50
        assert [w for _, w in reads] == [0, 0], "a reader got another object's bytes"


def reserve_fork_and_hang(name: str, pids) -> None:
    """Hold a reservation, fork a child that never touches the pool, and wait."""
    store = open_pool(name)
    with store.reserve(b"doomed", 5 * MIB):
        child = os.fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
        pids.put(child)
        time.sleep(600)


def test_a_forked_child_does_not_keep_a_dead_parent_s_reservation_alive(pool_names) -> None:
    name = pool_names()
    pids = SPAWN.Queue()
    parent = SPAWN.Process(target=reserve_fork_and_hang, args=(name, pids))
    parent.start()
    child = pids.get(timeout=60)
    try:
        with open_pool(name) as store:
            assert store.put(b"doomed", b"other") is False, "the parent is alive"
            os.kill(parent.pid, signal.SIGKILL)
            parent.join()
            assert store.put(b"doomed", b"now mine"), "the parent's reservation is reclaimed"
            assert store.stats().reclaimed == 1
    finally:
        os.kill(child, signal.SIGKILL)


def open_put_and_report(name: str, results) -> None:
    with open_pool(name) as store:
        results.put(store.put(b"from the child", b"hello"))


def test_a_child_forked_while_a_pool_was_being_opened_can_open_pools(pool_names) -> None:
    name, results = pool_names(), FORK.Queue()
    with attach._open_pools_lock:  # as another thread of this process opening a pool holds it
        child = FORK.Process(target=open_put_and_report, args=(name, results))
        child.start()
    try:
        assert results.get(timeout=30) is True
    finally:
        child.kill()
        child.join()


def evict_by_filling(name: str) -> None:
    """In another process: write until the pool has evicted what was there."""
    with open_pool(name) as store:
        for i in range(12):
            store.put(f"filler-{i}", b"f" * MIB)


def test_evictions_by_another_process_are_read_from_the_removal_log(pool_names) -> None:
    name = pool_names()
    with open_pool(name) as store:
        ours = [f"ours-{i}".encode() for i in range(4)]
        for key in ours:
            store.put(key, b"o" * MIB)
        cursor = store.removed_since(None).cursor
        child = SPAWN.Process(target=evict_by_filling, args=(name,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        seen = store.removed_since(cursor)
        assert seen.digests is not None
        assert set(map(key_digest, ours)) <= set(seen.digests)
        assert store.contains(ours) == [False] * 4
