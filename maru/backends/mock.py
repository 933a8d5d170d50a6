"""In-process backend for tests and CI, with opt-in fault injection.

Stores opened with the same `name` in one process share their objects (the
scheduler and worker halves of a connector in one process see one store).
Fault injection makes operations fail, slow down, or lose objects between a
lookup and a load, so failure handling can be tested without a broken server.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict, deque
from typing import Any, ClassVar

from pydantic import Field

from maru.backends.base import Backend, Removals, StoreStats, key_digest
from maru.config import Options
from maru.errors import BackendError, ConfigError, ObjectTooLargeError
from maru.hookspecs import hookimpl

REMOVAL_LOG_LENGTH = 4096
"""Removals the log keeps (as many as a shared-memory pool's)."""


class MockOptions(Options):
    """Options of the mock backend."""

    name: str = Field("default", min_length=1, description="stores with one name share objects")
    fail_rate: float = Field(0.0, ge=0, le=1, description="fraction of operations that fail")
    drop_rate: float = Field(
        0.0, ge=0, le=1, description="fraction of reads that find the object gone"
    )
    latency: float = Field(0.0, ge=0, le=10, description="seconds added to every operation")
    seed: int | None = Field(None, description="seed for reproducible faults")


class _Pool:
    """The objects and counters shared by every mock store with one name."""

    def __init__(self, capacity: int) -> None:
        self.lock = threading.Lock()
        self.capacity = capacity
        self.objects: OrderedDict[bytes, bytearray] = OrderedDict()
        self.pending: dict[bytes, int] = {}
        self.used = 0
        self.hits = self.misses = self.evictions = 0
        self.users = 0
        self.removal_log: deque[int] = deque(maxlen=REMOVAL_LOG_LENGTH)
        self.removals = 0

    def make_room(self, nbytes: int) -> bool:
        while self.used + nbytes > self.capacity and self.objects:
            self.remove(next(iter(self.objects)))
            self.evictions += 1
        return self.used + nbytes <= self.capacity

    def remove(self, key: bytes) -> bool:
        data = self.objects.pop(key, None)
        if data is None:
            return False
        self.used -= len(data)
        self.removal_log.append(key_digest(key))
        self.removals += 1
        return True

    def removed_since(self, cursor: int | None) -> Removals:
        """The removal log from `cursor` on, as `Backend.removed_since` promises."""
        if cursor is None or cursor == self.removals:
            return Removals(self.removals, [])
        behind = self.removals - cursor
        if not 0 <= behind <= len(self.removal_log):
            return Removals(self.removals, None)
        return Removals(self.removals, list(self.removal_log)[len(self.removal_log) - behind :])

    def lookup(self, key: bytes) -> bytearray | None:
        data = self.objects.get(key)
        if data is None:
            self.misses += 1
            return None
        self.objects.move_to_end(key)
        self.hits += 1
        return data


_pools: dict[str, _Pool] = {}
_pools_lock = threading.Lock()


class MockBackend(Backend):
    """Thread-safe in-memory store with LRU eviction and fault injection."""

    name: ClassVar[str] = "mock"
    Options = MockOptions
    description: ClassVar[str] = "in-process memory, for tests; optional fault injection"
    medium = "host"
    removal_log = True
    lists_keys = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._random = random.Random(self.options.seed)
        self._pool_name = f"{config.namespace}/{self.options.name}"
        with _pools_lock:
            pool = _pools.setdefault(self._pool_name, _Pool(config.capacity))
            if pool.capacity != config.capacity:
                raise ConfigError(
                    f"capacity = {config.capacity}: mock store {self.options.name!r} is already "
                    f"open in this process with capacity {pool.capacity}; allowed: the same "
                    "capacity, or another mock.name"
                )
            pool.users += 1
        self._pool = pool

    @classmethod
    def private_options(cls, tag: str, prefault: bool) -> dict[str, Any]:
        """A store of its own, named `tag` (gone when closed)."""
        return {"name": tag}

    def _inject(self, operation: str) -> None:
        if self.options.latency:
            time.sleep(self.options.latency)
        if self.options.fail_rate and self._random.random() < self.options.fail_rate:
            raise BackendError(f"mock: injected failure in {operation}")

    def _dropped(self, key: bytes) -> None:
        if self.options.drop_rate and self._random.random() < self.options.drop_rate:
            self._pool.remove(key)

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        self._inject("reserve")
        pool = self._pool
        if nbytes > pool.capacity:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes is larger than the store ({pool.capacity} bytes)"
            )
        with pool.lock:
            if key in pool.objects or key in pool.pending or not pool.make_room(nbytes):
                return None
            pool.pending[key] = nbytes
            pool.used += nbytes
        buffer = bytearray(nbytes)
        return (key, buffer), memoryview(buffer)

    def _commit(self, handle: tuple[bytes, bytearray]) -> None:
        key, buffer = handle
        with self._pool.lock:
            del self._pool.pending[key]
            self._pool.objects[key] = buffer

    def _abort(self, handle: tuple[bytes, bytearray]) -> None:
        key, buffer = handle
        with self._pool.lock:
            del self._pool.pending[key]
            self._pool.used -= len(buffer)

    def _get(self, key: bytes) -> bytes | None:
        self._inject("get")
        with self._pool.lock:
            self._dropped(key)
            data = self._pool.lookup(key)
            return None if data is None else bytes(data)

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        self._inject("get_into")
        with self._pool.lock:
            self._dropped(key)
            data = self._pool.lookup(key)
            return None if data is None else self.copy_out(key, data, out)

    def _contains(self, keys: list[bytes]) -> list[bool]:
        self._inject("contains")
        with self._pool.lock:
            found = [key in self._pool.objects for key in keys]
            for key, present in zip(keys, found, strict=True):
                if present:
                    self._pool.objects.move_to_end(key)
            return found

    def _delete(self, key: bytes) -> bool:
        self._inject("delete")
        with self._pool.lock:
            return self._pool.remove(key)

    def _keys(self, prefix: bytes) -> list[bytes]:
        with self._pool.lock:
            return [key for key in self._pool.objects if key.startswith(prefix)]

    def _delete_prefix(self, prefix: bytes) -> int:
        self._inject("delete")
        with self._pool.lock:
            doomed = [key for key in self._pool.objects if key.startswith(prefix)]
            return sum(self._pool.remove(key) for key in doomed)

    def _removed_since(self, cursor: int | None) -> Removals:
        with self._pool.lock:
            return self._pool.removed_since(cursor)

    def _stats(self) -> StoreStats:
        pool = self._pool
        with pool.lock:
            return StoreStats(
                pool.capacity, pool.used, len(pool.objects), pool.hits, pool.misses, pool.evictions
            )

    def _close(self) -> None:
        with _pools_lock:
            self._pool.users -= 1
            if self._pool.users == 0:
                _pools.pop(self._pool_name, None)


@hookimpl
def maru_backends() -> list[type[Backend]]:
    return [MockBackend]
