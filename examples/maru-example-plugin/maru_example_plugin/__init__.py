"""A maru backend plugin that keeps each object in a file of one directory.

One open store owns its directory, and its objects live while it is open;
writes go to a temporary file renamed into place on commit, so a reader never
sees half an object.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import maru
from maru.backends.base import Backend, StoreStats


class DirStoreOptions(BaseModel):
    """The `dirstore:` config section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path = Field(
        Path(tempfile.gettempdir()) / "maru-dirstore",
        description="directory that holds the objects",
    )


class DirStore(Backend):
    """Objects as files, least recently used deleted first when over capacity."""

    name = "dirstore"
    Options = DirStoreOptions
    description = "example plugin: one file per object"
    medium = "disk"
    """Its bytes live in files on this machine. It keeps no removal log and cannot list
    its keys (`removal_log` and `lists_keys` keep their default, False), and it has no
    private store for `maru bench` (`private_options` keeps its default)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._dir = self.options.path / config.namespace
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._pending: set[str] = set()
        self._used = self._hits = self._misses = self._evictions = 0

    def _file(self, name: str) -> Path:
        return self._dir / name

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        if nbytes > self.config.capacity:
            raise maru.ObjectTooLargeError(
                f"object of {nbytes} bytes is larger than the store ({self.config.capacity} bytes)"
            )
        name = hashlib.sha256(key).hexdigest()
        with self._lock:
            if name in self._sizes or name in self._pending:
                return None
            while self._used + nbytes > self.config.capacity and self._sizes:
                evicted, size = self._sizes.popitem(last=False)
                self._file(evicted).unlink(missing_ok=True)
                self._used -= size
                self._evictions += 1
            if self._used + nbytes > self.config.capacity:
                return None
            self._pending.add(name)
            self._used += nbytes
        buffer = bytearray(nbytes)
        return (name, buffer), memoryview(buffer)

    def _commit(self, handle: tuple[str, bytearray]) -> None:
        name, buffer = handle
        temporary = self._file(f"{name}.tmp")
        temporary.write_bytes(buffer)
        os.replace(temporary, self._file(name))
        with self._lock:
            self._pending.discard(name)
            self._sizes[name] = len(buffer)

    def _abort(self, handle: tuple[str, bytearray]) -> None:
        name, buffer = handle
        with self._lock:
            self._pending.discard(name)
            self._used -= len(buffer)

    def _get(self, key: bytes) -> bytes | None:
        name = hashlib.sha256(key).hexdigest()
        with self._lock:
            if name not in self._sizes:
                self._misses += 1
                return None
            self._sizes.move_to_end(name)
            self._hits += 1
            return self._file(name).read_bytes()

    def _contains(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [hashlib.sha256(key).hexdigest() in self._sizes for key in keys]

    def _delete(self, key: bytes) -> bool:
        name = hashlib.sha256(key).hexdigest()
        with self._lock:
            size = self._sizes.pop(name, None)
            if size is None:
                return False
            self._file(name).unlink(missing_ok=True)
            self._used -= size
            return True

    def _stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                self.config.capacity,
                self._used,
                len(self._sizes),
                self._hits,
                self._misses,
                self._evictions,
            )

    def _close(self) -> None:
        with self._lock:
            for name in self._sizes:
                self._file(name).unlink(missing_ok=True)
            self._sizes.clear()


@maru.hookimpl
def maru_backends() -> list[type[Backend]]:
    return [DirStore]
