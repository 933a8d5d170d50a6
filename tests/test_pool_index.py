"""The pool's key index: keys whose hashes collide never get each other's objects."""

from __future__ import annotations

import multiprocessing
import zlib

import numpy as np

import maru
from maru.backends._pool import core
from maru.testing import payload

SPAWN = multiprocessing.get_context("spawn")
CRC_TWINS = (b"chunk-b97186618aa1434e", b"chunk-2f6843fd71907689")
"""Two keys of one length and one CRC-32, which the old key hash could not tell apart."""


def open_pool(name: str) -> maru.Backend:
    return maru.open_store(backend="shm", capacity=8 * 2**20, shm={"name": name})


def test_keys_with_one_crc32_are_told_apart(pool_names) -> None:
    first, second = CRC_TWINS
    assert len(first) == len(second) and zlib.crc32(first) == zlib.crc32(second)
    with open_pool(pool_names()) as store:
        store.put(first, b"first")
        assert store.contains([first, second]) == [True, False]


def colliding_hash(key: bytes) -> int:
    """One hash for every key: one bucket, one tag; only the full keys differ."""
    return 12345


def colliding_hashes(keys: list[bytes]) -> np.ndarray:
    return np.full(len(keys), colliding_hash(b""), dtype=np.uint64)


def write_colliding_keys(name: str, prefix: str, other: str, results) -> None:
    core.key_hash, core.key_hashes = colliding_hash, colliding_hashes
    with open_pool(name) as store:
        results.put(write_then_check(store, prefix, other))


def write_then_check(store: maru.Backend, prefix: str, other: str) -> list[str]:
    """Write 30 keys under `prefix`, delete every third, and report every object that
    reads back wrong: any of `prefix`, and any of `other` (which another process may be
    writing meanwhile) that is not its own bytes."""
    for i in range(30):
        key = f"{prefix}{i}"
        assert store.put(key, payload(key, 1000 + i)), key
        with store.reserve(f"{key}-r", 100) as buffer:
            buffer[:] = payload(f"{key}-r", 100)
    for i in range(0, 30, 3):
        assert store.delete(f"{prefix}{i}")
    problems = []
    for p in (prefix, other):
        for i in range(30):
            key = f"{p}{i}"
            expected = payload(key, 1000 + i)
            if p == other:
                allowed: tuple = (None, expected)
            else:
                allowed = (None,) if i % 3 == 0 else (expected,)
            if store.get(key) not in allowed:
                problems.append(f"{key} read back wrong")
            if store.get(f"{key}-r") not in (None, payload(f"{key}-r", 100)):
                problems.append(f"{key}-r read back wrong")
    return problems


def test_colliding_hashes_still_return_the_right_objects(pool_names, monkeypatch) -> None:
    monkeypatch.setattr(core, "key_hash", colliding_hash)
    monkeypatch.setattr(core, "key_hashes", colliding_hashes)
    name, results = pool_names(), SPAWN.Queue()
    with open_pool(name) as store:
        child = SPAWN.Process(target=write_colliding_keys, args=(name, "child", "parent", results))
        child.start()
        assert write_then_check(store, "parent", "child") == []
        assert results.get(timeout=60) == []
        child.join(60)
        assert child.exitcode == 0
        assert write_then_check(store, "late", "child") == []
        assert store.get(b"child1") == payload("child1", 1001)
        assert store.pool.audit() == []
