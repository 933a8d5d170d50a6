"""Local disk: one file per object in a directory shared by every process on the node.

Layout: `path/maru-disk-format` holds the format version; each namespace is a
directory `path/<namespace>/` of 256 fan-out directories `00`..`ff`, and an object
is the file named by the hex digest of its key. A file is a header (magic, format
version, key length, payload length, xxh3 checksum of all of it), the key, then the
payload. Files never change once published, so a reader that opened one reads a
whole object even if it is deleted meanwhile.

- First writer wins across processes: a writer fills a temporary file in the same
  directory and publishes it with `os.link`, which fails if the name exists. A
  writer killed before the link leaves only a temporary file, removed at the next
  open once its writer is gone (same host, dead pid) or older than ten minutes.
- A file whose length or checksum is wrong is deleted and read as a miss; a file
  holding another key (a digest collision) is a miss, never served.
- Capacity (`disk.capacity`, else the config's `capacity`, counted in file bytes)
  is enforced with least-recently-used eviction; a filesystem that fills up first
  (ENOSPC, EDQUOT) evicts too, and a write that still finds no room stores nothing.
  Recency is each file's mtime, set on every write and read hit, so every process
  sees the same order. Each process keeps its own index of the directory (sizes, in
  recency order), rebuilt by scanning it at open and again before it evicts or
  reports stats, at most every `scan_interval` seconds. Between scans a process
  does not see other processes' writes, so several writers may overshoot the
  capacity by what the others wrote since their last scan. Hits, misses and
  evictions are counted per process.
- No fsync: a crash of the machine may leave a published file with bad contents,
  which its checksum catches on the next read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from maru.backends._disk.directory import (
    FANOUT,
    MARKER,
    TEMP_PREFIX,
    object_names,
    prepare_root,
    scan_objects,
    survey_root,
    unusable,
)
from maru.backends._disk.index import Index
from maru.backends._disk.objects import (
    CHECKSUM,
    FORMAT_VERSION,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    OPEN_READ,
    OPEN_WRITE,
    Corrupt,
    OtherKey,
    digest,
    object_checksum,
    parse,
    read_all,
    stored_key,
    touch,
    unlink_if_same,
    write_all,
)
from maru.backends._disk.options import DiskOptions, default_path
from maru.backends.base import Backend, ReadView, StoreStats
from maru.backends.node import FoundStore
from maru.errors import BackendError, ObjectTooLargeError
from maru.hookspecs import hookimpl

FULL_DISK_RETRIES = 4
"""Times a write that found the filesystem full evicts and tries again."""


@dataclass
class _Pending:
    """A write this process has room reserved for and has not published yet."""

    key: bytes
    name: str
    path: Path
    size: int


class DiskBackend(Backend):
    """Objects as files in a local directory, shared by the node's processes."""

    name: ClassVar[str] = "disk"
    Options = DiskOptions
    description: ClassVar[str] = "files in a local directory, kept across restarts"
    medium = "disk"
    lists_keys = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._root = self.options.path.expanduser()
        self._capacity: int = self.options.capacity or config.capacity
        self._dir = self._root / config.namespace
        self._lock = threading.Lock()
        self._index = Index()
        self._pending: dict[str, int] = {}
        self._hits = self._misses = self._evictions = self._full = 0
        self._scanned = 0.0
        self._host = socket.gethostname()
        prepare_root(self._root)
        self._prepare_dir()
        with self._lock:
            self._scan(clean_temps=True)

    @classmethod
    def describe(cls, options: Any) -> str:
        """Where the store's files are, for `maru info`."""
        return f"files under {options.path} (local disk)"

    @classmethod
    def open_existing(cls, config: Any) -> DiskBackend:
        """The configured store, or BackendError if its directory holds no disk store
        (tools never create one by looking)."""
        root = config.backend_options(cls.name).path.expanduser()
        if not (root / MARKER).is_file():
            raise BackendError(f"disk store {root} does not exist (no {MARKER} there)")
        return cls(config)

    @classmethod
    def find_stores(cls, config: Any) -> list[FoundStore]:
        """The configured store, if there is one (`maru pool gc` never removes it)."""
        return survey_root(config.backend_options(cls.name), config.capacity)

    @classmethod
    def private_options(cls, tag: str, prefault: bool) -> dict[str, Any]:
        """A store of its own under the user's cache directory, named `tag`."""
        return {"path": str(default_path().parent / "disk-private" / tag)}

    @property
    def label(self) -> str:
        return f"disk store {self._dir}"

    def destroy(self) -> None:
        """Remove this namespace's directory, and the store's root once it holds nothing
        else."""
        with self._lock:
            self._index = Index()
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self._dir)
            if os.listdir(self._root) == [MARKER]:
                (self._root / MARKER).unlink()
                self._root.rmdir()

    def clear(self) -> int:
        """Remove every object of this namespace; how many were removed."""
        self._check_open()
        return self._delete_prefix(b"")

    def info(self) -> dict[str, Any]:
        """The store's directory and format beside its counters."""
        stats = self.stats()
        return {
            "label": self.label,
            "path": str(self._dir),
            "format": FORMAT_VERSION,
            "capacity": stats.capacity,
            "used": stats.used,
            "objects": stats.objects,
            "not_stored_disk_full": self._full,
        }

    # --- setup ---------------------------------------------------------------

    def _prepare_dir(self) -> None:
        """Create this namespace's fan-out directories and check that files can be
        written there, or raise ConfigError naming the path."""
        try:
            for sub in FANOUT:
                (self._dir / sub).mkdir(parents=True, exist_ok=True)
            probe = self._dir / FANOUT[0] / self._temp_name()
            os.close(os.open(probe, OPEN_WRITE, 0o600))
            probe.unlink()
        except OSError as exc:
            raise unusable(self._root, exc) from None

    # --- writing -------------------------------------------------------------

    def _put(self, key: bytes, data: memoryview) -> bool:
        pending = self._reserve(key, data.nbytes)
        return pending is not None and self._publish(pending, data)

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        pending = self._reserve(key, nbytes)
        if pending is None:
            return None
        buffer = bytearray(nbytes)
        return (pending, buffer), memoryview(buffer)

    def _commit(self, handle: tuple[_Pending, bytearray]) -> None:
        pending, buffer = handle
        self._publish(pending, memoryview(buffer))

    def _abort(self, handle: tuple[_Pending, bytearray]) -> None:
        with self._lock:
            del self._pending[handle[0].name]

    def _reserve(self, key: bytes, nbytes: int) -> _Pending | None:
        """Room for the object, evicting if needed; None if the key is stored or being
        written by this process."""
        size = HEADER_BYTES + len(key) + nbytes
        capacity = self._capacity
        if size > capacity:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes ({size} with its header) is larger than the store "
                f"({capacity} bytes, the configured capacity)"
            )
        name = digest(key)
        path = self._path(name)
        with self._lock:
            if name in self._pending or path.exists() or not self._make_room(size):
                return None
            self._pending[name] = size
        return _Pending(key, name, path, size)

    def _make_room(self, size: int) -> bool:
        """Evict least recently used objects until `size` more bytes fit (lock held)."""
        capacity = self._capacity
        if self._used() + size > capacity and self._scan_due():
            self._scan()
        while self._used() + size > capacity and self._index:
            self._evict_oldest()
        return self._used() + size <= capacity

    def _evict_oldest(self) -> int:
        """Remove the least recently used object (lock held); the bytes it held."""
        name, size = self._index.oldest()
        try:
            self._path(name).unlink()
            self._evictions += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._io_error("evict", self._path(name), exc) from None
        return size

    def _free_disk(self, size: int) -> bool:
        """After the filesystem ran out of space: evict least recently used objects
        holding at least `size` bytes; False if there was nothing left to evict."""
        with self._lock:
            if not self._index:
                self._scan()
            freed = 0
            while freed < size and self._index:
                freed += self._evict_oldest()
            return freed > 0

    def _publish(self, pending: _Pending, payload: memoryview) -> bool:
        """Write the object and link it into place; False if another writer was first."""
        linked = False
        try:
            linked = self._write(pending, payload)
        finally:
            with self._lock:
                del self._pending[pending.name]
                if linked:
                    self._index.add(pending.name, pending.size)
        return linked

    def _write(self, pending: _Pending, payload: memoryview) -> bool:
        """Write and link the object, evicting when the filesystem is full; False if
        another writer was first or no room could be made."""
        for _ in range(FULL_DISK_RETRIES):
            try:
                return self._write_once(pending, payload)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise self._io_error("write", pending.path, exc) from None
                if pending.size > self._filesystem_bytes() or not self._free_disk(pending.size):
                    break
        with self._lock:
            self._full += 1
        return False

    def _filesystem_bytes(self) -> int:
        """The size of the filesystem the store is on (an object larger never fits)."""
        found = os.statvfs(self._dir)
        return found.f_blocks * found.f_frsize

    def _write_once(self, pending: _Pending, payload: memoryview) -> bool:
        temporary = pending.path.with_name(self._temp_name())
        prefix = HEADER.pack(MAGIC, FORMAT_VERSION, len(pending.key), payload.nbytes)
        checksum = CHECKSUM.pack(object_checksum(prefix, pending.key, payload))
        try:
            fd = os.open(temporary, OPEN_WRITE, 0o666)
            try:
                write_all(fd, [prefix + checksum + pending.key, payload])
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            finally:
                os.close(fd)
            try:
                os.link(temporary, pending.path)
            except FileExistsError:
                return False
            return True
        finally:
            temporary.unlink(missing_ok=True)

    def _temp_name(self) -> str:
        return f"{TEMP_PREFIX}{os.getpid()}.{secrets.token_hex(6)}.{self._host}"

    # --- reading -------------------------------------------------------------

    def _get(self, key: bytes) -> bytes | None:
        buffer = self._read_new(key)
        return None if buffer is None else bytes(buffer)

    def _view(self, key: bytes) -> ReadView | None:
        buffer = self._read_new(key)
        return None if buffer is None else ReadView(memoryview(buffer).toreadonly())

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        def into(size: int) -> memoryview:
            if size > out.nbytes:
                raise self.too_small(key, size, out.nbytes)
            return out[:size]

        return self._read(key, into)

    def _read_new(self, key: bytes) -> bytearray | None:
        """The object in a buffer of its own, or None."""
        buffers: list[bytearray] = []

        def new(size: int) -> memoryview:
            buffers.append(bytearray(size))
            return memoryview(buffers[0])

        return None if self._read(key, new) is None else buffers[0]

    def _read(self, key: bytes, target: Callable[[int], memoryview]) -> int | None:
        """Read the object into `target(size)`; its size, or None on a miss."""
        name = digest(key)
        path = self._path(name)
        try:
            fd = os.open(path, OPEN_READ)
        except FileNotFoundError:
            return self._missed(name)
        except OSError as exc:
            raise self._io_error("read", path, exc) from None
        try:
            size = self._read_open(fd, key, path, target)
        finally:
            os.close(fd)
        if size is None:
            return self._missed(name)
        with self._lock:
            self._hits += 1
            self._index.touch(name)
        return size

    def _read_open(
        self, fd: int, key: bytes, path: Path, target: Callable[[int], memoryview]
    ) -> int | None:
        """Read and check the open object file; None if it is another key's or corrupt
        (then it is deleted)."""
        try:
            stat = os.fstat(fd)
            header = os.pread(fd, HEADER_BYTES + len(key), 0)
            size, checksum = parse(header, key, stat.st_size)
            view = target(size)
            read_all(fd, view, HEADER_BYTES + len(key))
            if object_checksum(header[: HEADER.size], key, view) != checksum:
                raise Corrupt
            touch(fd)
        except OtherKey:
            return None
        except Corrupt:
            unlink_if_same(path, stat)
            return None
        except OSError as exc:
            raise self._io_error("read", path, exc) from None
        return size

    def _missed(self, name: str) -> None:
        with self._lock:
            self._misses += 1
            self._index.discard(name)

    def _contains(self, keys: list[bytes]) -> list[bool]:
        directory = str(self._dir)
        return [
            os.path.exists(f"{directory}/{name[:2]}/{name}")
            for name in (digest(key) for key in keys)
        ]

    # --- removing and listing ------------------------------------------------

    def _delete(self, key: bytes) -> bool:
        name = digest(key)
        path = self._path(name)
        if self._stored_key(path) != key:
            return False
        return self._remove(name)

    def _remove(self, name: str) -> bool:
        """Unlink an object file; False if it was gone."""
        with self._lock:
            self._index.discard(name)
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._io_error("delete", self._path(name), exc) from None
        return True

    def _keys(self, prefix: bytes) -> list[bytes]:
        return [key for _, key in self._stored(prefix)]

    def _delete_prefix(self, prefix: bytes) -> int:
        return sum(self._remove(name) for name, _ in self._stored(prefix))

    def _stored(self, prefix: bytes) -> Iterator[tuple[str, bytes]]:
        """(name, key) of every object file whose key starts with `prefix` (a scan that
        reads each file's header)."""
        for sub in FANOUT:
            for name in object_names(self._dir / sub):
                key = self._stored_key(self._dir / sub / name)
                if key is not None and key.startswith(prefix):
                    yield name, key

    def _stored_key(self, path: Path) -> bytes | None:
        """The key in an object file's header, or None if it is gone or not well formed."""
        try:
            return stored_key(path)
        except OSError as exc:
            raise self._io_error("read", path, exc) from None

    # --- the index -----------------------------------------------------------

    def _used(self) -> int:
        return self._index.bytes + sum(self._pending.values())

    def _scan_due(self) -> bool:
        return time.monotonic() - self._scanned >= self.options.scan_interval

    def _scan(self, *, clean_temps: bool = False) -> None:
        """Rebuild the index from the directory, least recently used first (lock held);
        with `clean_temps`, remove crashed writers' temporary files."""
        try:
            found = scan_objects(self._dir, self._host, clean_temps=clean_temps)
        except OSError as exc:
            raise self._io_error("scan", Path(exc.filename or self._dir), exc) from None
        self._index = Index(OrderedDict((name, size) for _, name, size in found))
        self._scanned = time.monotonic()

    def _stats(self) -> StoreStats:
        with self._lock:
            if self._scan_due():
                self._scan()
            return StoreStats(
                self._capacity,
                self._used(),
                len(self._index),
                self._hits,
                self._misses,
                self._evictions,
            )

    def _path(self, name: str) -> Path:
        return self._dir / name[:2] / name

    def _io_error(self, operation: str, path: Path, exc: OSError) -> BackendError:
        return BackendError(f"disk store: {operation} of {path} failed: {exc.strerror or exc}")

    def _close(self) -> None:
        with self._lock:
            self._index = Index()


@hookimpl
def maru_backends() -> list[type[Backend]]:
    return [DiskBackend]
