"""`PoolBackend`: the Backend contract over a mapped Pool (the base of shm and cxl)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pydantic import Field

from maru.backends._pool.attach import RegionSpec, attach, detach, memory_of
from maru.backends._pool.core import SMALL_COPY, Handle
from maru.backends.base import Backend, ReadView, Removals, StoreStats
from maru.config import Options


class PoolOptions(Options):
    """What every pool backend's section has (shm and cxl add where the pool lives)."""

    checksum: bool = Field(
        True,
        description="write a 64-bit checksum with every object and verify every load (a "
        "corrupt object is a miss); a load into a CPU cache computes it as it copies; off: "
        "damaged object bytes go undetected",
    )
    prefault: bool = Field(
        False,
        description="map every page at open (else each object's pages on first use)",
    )


class PoolBackend(Backend):
    """A Backend over a mapped Pool; subclasses say where the mapping comes from."""

    medium = "host"
    zero_copy = True
    removal_log = True
    lists_keys = True
    wraps = True

    def __init__(self, config: Any, *, create: bool = True) -> None:
        super().__init__(config)
        self.checksum = self.options.checksum
        """Write a checksum with every object and verify every load against it."""
        spec = self.region_spec()
        self.pool = attach(spec if create else replace(spec, create=False, adopt=True))

    @abstractmethod
    def region_spec(self) -> RegionSpec:
        """Where this backend's pool lives."""

    @classmethod
    def open_existing(cls, config: Any) -> PoolBackend:
        """The configured pool, or BackendError if it does not exist; never populated.
        It is opened with the capacity recorded in it: the configured one only matters
        to the process that creates it."""
        return cls(config, create=False)

    @property
    def label(self) -> str:
        return self.pool.label

    def clear(self) -> int:
        return self.pool.clear()

    def info(self) -> dict[str, Any]:
        """The pool's label, creation id, geometry and recovery counters."""
        return self.pool.info()

    def populate(self, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Map every page of this mapping now; huge pages and population."""
        memory = memory_of(self.pool)
        memory.populator.run(progress)
        return memory.report()

    def _put(self, key: bytes, data: memoryview) -> bool:
        if data.nbytes <= SMALL_COPY:
            return self.pool.put_small(key, data, self.checksum)
        return super()._put(key, data)

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        return self.pool.reserve(key, nbytes)

    def _commit(self, handle: Handle) -> None:
        self.pool.commit(handle, self.checksum)

    def _abort(self, handle: Handle) -> None:
        self.pool.abort(handle)

    def _get(self, key: bytes) -> bytes | None:
        view = self.pool.read(key, lambda size: memoryview(bytearray(size)), self.checksum)
        return None if view is None else bytes(view)

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        def fits(size: int) -> memoryview:
            if size > out.nbytes:
                raise self.too_small(key, size, out.nbytes)
            return out

        view = self.pool.read(key, fits, self.checksum)
        return None if view is None else view.nbytes

    def _view(self, key: bytes) -> ReadView | None:
        return self.pool.view(key, self.checksum)

    def _peek(self, key: bytes) -> ReadView | None:
        return self.pool.view(key, self.checksum, counted=False)

    def host_memory(self) -> memoryview:
        return self.pool.tables.data_view

    def _contains(self, keys: list[bytes]) -> list[bool]:
        return self.pool.contains(keys)

    def _delete(self, key: bytes) -> bool:
        return self.pool.delete(key)

    def _keys(self, prefix: bytes) -> list[bytes]:
        return self.pool.keys(prefix)

    def _delete_prefix(self, prefix: bytes) -> int:
        return self.pool.delete_prefix(prefix)

    def _removed_since(self, cursor: int | None) -> Removals:
        return self.pool.removed_since(cursor)

    def _stats(self) -> StoreStats:
        return self.pool.stats()

    def _close(self) -> None:
        detach(self.pool)
