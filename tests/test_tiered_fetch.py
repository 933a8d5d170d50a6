"""A tiered store's background fetch (`fetch_many`): what its lower tiers hold is read
straight into the first tier's memory, the promotion at no extra copy, and handed over
as the first tier's views; where the first tier has no room for it, privately."""

from __future__ import annotations

import numpy as np
import pytest

from maru.testing import payload
from tests.conftest import failing


def address(data: memoryview) -> int:
    return np.frombuffer(data, np.uint8).ctypes.data


def in_memory(data: memoryview, memory: memoryview) -> bool:
    start = address(memory)
    return start <= address(data) and address(data) + data.nbytes <= start + memory.nbytes


def test_what_a_lower_tier_holds_is_read_into_the_first_tier_and_viewed_there(
    tiered, monkeypatch
) -> None:
    store = tiered()
    shm, redis = store.tiers
    shm.put(b"top", payload("top", 300))
    redis.put(b"below", payload("below", 5000))
    monkeypatch.setattr(shm, "put", lambda *a: pytest.fail("promoted by a copy"))
    top, below, nowhere = store.fetch_many([b"top", b"below", b"nowhere"], [300, 5000, 64])
    assert bytes(top.data) == payload("top", 300) and bytes(below.data) == payload("below", 5000)
    assert nowhere is None
    assert in_memory(below.data, shm.host_memory()), "the first tier's memory"
    assert below.valid()
    assert shm.contains([b"below"]) == [True], "promoted"
    assert (store.stats().hits, store.stats().misses) == (2, 1)


def test_an_object_of_another_size_is_fetched_privately_and_its_room_given_back(tiered) -> None:
    store = tiered()
    shm, redis = store.tiers
    redis.put(b"tail", payload("tail", 3000))
    used = shm.stats().used
    (view,) = store.fetch_many([b"tail"], [8000])
    assert bytes(view.data) == payload("tail", 3000) and view.valid()
    assert shm.contains([b"tail"]) == [False] and shm.stats().used == used
    assert shm.put(b"tail", b"later"), "the reservation was aborted, not left behind"


def test_a_key_being_written_in_the_first_tier_is_fetched_privately(tiered) -> None:
    store = tiered()
    shm, redis = store.tiers
    redis.put(b"k", payload("k", 4000))
    with shm.reserve(b"k", 4000) as buffer:
        buffer[:] = payload("k", 4000)
        (view,) = store.fetch_many([b"k"], [4000])
        assert bytes(view.data) == payload("k", 4000)
        assert not in_memory(view.data, shm.host_memory())


def test_a_failing_lower_tier_is_a_miss_and_frees_the_room_reserved(tiered, monkeypatch) -> None:
    store = tiered()
    shm, redis = store.tiers
    shm.put(b"top", b"x")
    used = shm.stats().used
    monkeypatch.setattr(redis, "get_many_into", failing("down"))
    top, below = store.fetch_many([b"top", b"below"], [8, 4096])
    assert bytes(top.data) == b"x" and below is None
    assert shm.stats().used == used


def test_three_tiers_promote_a_fetched_redis_object_into_memory_and_disk(
    shm_disk, redis_server
) -> None:
    store = shm_disk(tiers=("shm", "disk", "redis"), redis=redis_server.url)
    shm, disk, redis = store.tiers
    redis.put(b"k", payload("k", 5000))
    (view,) = store.fetch_many([b"k"], [5000])
    assert bytes(view.data) == payload("k", 5000)
    assert store.flush(10)
    assert shm.get(b"k") == payload("k", 5000) and disk.get(b"k") == payload("k", 5000)
