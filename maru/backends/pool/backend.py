"""`PoolBackend`: the Backend contract over a mapped Pool (the base of shm and cxl)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace
from typing import Any

from maru.backends.base import Backend, StoreStats
from maru.backends.pool.attach import RegionSpec, attach, detach
from maru.backends.pool.core import SMALL_COPY, Handle


class PoolBackend(Backend):
    """A Backend over a mapped Pool; subclasses say where the mapping comes from."""

    def __init__(self, config: Any, *, create: bool = True) -> None:
        super().__init__(config)
        # Write a checksum with every object and verify every load against it (the
        # `checksum` option; a backend whose options lack it never does).
        self.checksum = bool(getattr(self.options, "checksum", False))
        spec = self.region_spec()
        self.pool = attach(spec if create else replace(spec, create=False, populate=False))

    @abstractmethod
    def region_spec(self) -> RegionSpec:
        """Where this backend's pool lives."""

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
                raise self.too_small(key, size, out)
            return out

        view = self.pool.read(key, fits, self.checksum)
        return None if view is None else view.nbytes

    def _contains(self, keys: list[bytes]) -> list[bool]:
        return self.pool.contains(keys)

    def _delete(self, key: bytes) -> bool:
        return self.pool.delete(key)

    def _stats(self) -> StoreStats:
        return self.pool.stats()

    def _close(self) -> None:
        detach(self.pool)
