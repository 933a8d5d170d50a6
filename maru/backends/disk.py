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
- Capacity (the config's `capacity`, counted in file bytes) is enforced with
  least-recently-used eviction. Recency is each file's mtime, set on every write
  and read hit, so every process sees the same order. Each process keeps its own
  index of the directory (sizes, in recency order), rebuilt by scanning it at open
  and again before it evicts or reports stats, at most every `scan_interval`
  seconds. Between scans a process does not see other processes' writes, so
  several writers may overshoot the capacity by what the others wrote since their
  last scan. Hits, misses and evictions are counted per process.
- No fsync: a crash of the machine may leave a published file with bad contents,
  which its checksum catches on the next read.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any, ClassVar

import xxhash
from pydantic import Field

from maru.backends.base import MAX_KEY_BYTES, Backend, ReadView, StoreStats
from maru.config import Options
from maru.errors import BackendError, ConfigError, ObjectTooLargeError
from maru.hookspecs import hookimpl

FORMAT_VERSION = 1
"""Version of the directory layout and of every object file's header."""
MARKER = "maru-disk-format"
"""The file at the root of a store that holds its format version."""
MAGIC = b"MKVD"
HEADER = struct.Struct("<4sHHQ")
"""magic, format version, key length, payload length; then the checksum, the key and
the payload."""
CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = HEADER.size + CHECKSUM.size
FANOUT = [f"{i:02x}" for i in range(256)]
DIGEST_BYTES = 16
TEMP_PREFIX = ".tmp."
STALE_TEMP_SECONDS = 600
"""A temporary file this old is a crashed writer's, whoever wrote it."""
OPEN_READ = os.O_RDONLY | os.O_CLOEXEC
OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def default_path() -> Path:
    """`$XDG_CACHE_HOME/maru/disk`, or `~/.cache/maru/disk`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "maru" / "disk"


class DiskOptions(Options):
    """The `disk:` config section."""

    path: Path = Field(
        default_factory=default_path,
        description="directory of the store, on a local filesystem; every process on the "
        "node that names it shares its objects",
    )
    scan_interval: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="seconds a process trusts its index of the directory before it scans "
        "it again to learn other processes' writes",
    )


class _Corrupt(Exception):
    """An object file whose header, length or checksum is wrong."""


class _OtherKey(Exception):
    """A well-formed object file of another key (a digest collision)."""


class _Index:
    """This process's view of the object files: their sizes, least recently used first."""

    def __init__(self, sizes: OrderedDict[str, int] | None = None) -> None:
        self.sizes = sizes or OrderedDict()
        self.bytes = sum(self.sizes.values())

    def __len__(self) -> int:
        return len(self.sizes)

    def add(self, name: str, size: int) -> None:
        self.discard(name)
        self.sizes[name] = size
        self.bytes += size

    def discard(self, name: str) -> None:
        self.bytes -= self.sizes.pop(name, 0)

    def oldest(self) -> str:
        """Remove and return the least recently used name."""
        name, size = self.sizes.popitem(last=False)
        self.bytes -= size
        return name

    def touch(self, name: str) -> None:
        if name in self.sizes:
            self.sizes.move_to_end(name)


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
        self._dir = self._root / config.namespace
        self._lock = threading.Lock()
        self._index = _Index()
        self._pending: dict[str, int] = {}
        self._hits = self._misses = self._evictions = 0
        self._scanned = 0.0
        self._host = socket.gethostname()
        _prepare_root(self._root)
        self._prepare_dir()
        with self._lock:
            self._scan(clean_temps=True)

    @classmethod
    def describe(cls, options: Any) -> str:
        """Where the store's files are, for `maru info`."""
        return f"files under {options.path} (local disk)"

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
            self._index = _Index()
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
            raise _unusable(self._root, exc) from None

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
        capacity = self.config.capacity
        if size > capacity:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes ({size} with its header) is larger than the store "
                f"({capacity} bytes, the configured capacity)"
            )
        name = _digest(key)
        path = self._path(name)
        with self._lock:
            if name in self._pending or path.exists() or not self._make_room(size):
                return None
            self._pending[name] = size
        return _Pending(key, name, path, size)

    def _make_room(self, size: int) -> bool:
        """Evict least recently used objects until `size` more bytes fit (lock held)."""
        capacity = self.config.capacity
        if self._used() + size > capacity and self._scan_due():
            self._scan()
        while self._used() + size > capacity and self._index:
            name = self._index.oldest()
            try:
                self._path(name).unlink()
                self._evictions += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise self._io_error("evict", self._path(name), exc) from None
        return self._used() + size <= capacity

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
        temporary = pending.path.with_name(self._temp_name())
        prefix = HEADER.pack(MAGIC, FORMAT_VERSION, len(pending.key), payload.nbytes)
        checksum = CHECKSUM.pack(_checksum(prefix, pending.key, payload))
        try:
            fd = os.open(temporary, OPEN_WRITE, 0o666)
            try:
                _write_all(fd, [prefix + checksum + pending.key, payload])
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            finally:
                os.close(fd)
            try:
                os.link(temporary, pending.path)
            except FileExistsError:
                return False
            return True
        except OSError as exc:
            raise self._io_error("write", pending.path, exc) from None
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
                raise self.too_small(key, size, out)
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
        name = _digest(key)
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
            size, checksum = _parse(header, key, stat.st_size)
            view = target(size)
            _read_all(fd, view, HEADER_BYTES + len(key))
            if _checksum(header[: HEADER.size], key, view) != checksum:
                raise _Corrupt
            _touch(fd)
        except _OtherKey:
            return None
        except _Corrupt:
            _unlink_if_same(path, stat)
            return None
        except OSError as exc:
            raise self._io_error("read", path, exc) from None
        return size

    def _missed(self, name: str) -> None:
        with self._lock:
            self._misses += 1
            self._index.discard(name)

    def _contains(self, keys: list[bytes]) -> list[bool]:
        return [self._path(_digest(key)).exists() for key in keys]

    # --- removing and listing ------------------------------------------------

    def _delete(self, key: bytes) -> bool:
        name = _digest(key)
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
            for name in _object_names(self._dir / sub):
                key = self._stored_key(self._dir / sub / name)
                if key is not None and key.startswith(prefix):
                    yield name, key

    def _stored_key(self, path: Path) -> bytes | None:
        """The key in an object file's header, or None if it is gone or not well formed."""
        try:
            with open(path, "rb", buffering=0) as file:
                header = file.read(HEADER_BYTES + MAX_KEY_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._io_error("read", path, exc) from None
        if len(header) < HEADER_BYTES:
            return None
        magic, version, key_length, _ = HEADER.unpack_from(header)
        if magic != MAGIC or version != FORMAT_VERSION or len(header) < HEADER_BYTES + key_length:
            return None
        return header[HEADER_BYTES : HEADER_BYTES + key_length]

    # --- the index -----------------------------------------------------------

    def _used(self) -> int:
        return self._index.bytes + sum(self._pending.values())

    def _scan_due(self) -> bool:
        return time.monotonic() - self._scanned >= self.options.scan_interval

    def _scan(self, *, clean_temps: bool = False) -> None:
        """Rebuild the index from the directory, least recently used first (lock held);
        with `clean_temps`, remove crashed writers' temporary files."""
        found: list[tuple[int, str, int]] = []
        for sub in FANOUT:
            try:
                entries = list(os.scandir(self._dir / sub))
            except OSError as exc:
                raise self._io_error("scan", self._dir / sub, exc) from None
            for entry in entries:
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(TEMP_PREFIX):
                    if clean_temps and self._abandoned(entry.name, stat.st_mtime):
                        Path(entry.path).unlink(missing_ok=True)
                elif _is_object_name(entry.name):
                    found.append((stat.st_mtime_ns, entry.name, stat.st_size))
        found.sort()
        self._index = _Index(OrderedDict((name, size) for _, name, size in found))
        self._scanned = time.monotonic()

    def _abandoned(self, temp_name: str, mtime: float) -> bool:
        """Is this temporary file a crashed writer's: old, or written on this host by a
        process that is gone?"""
        if time.time() - mtime > STALE_TEMP_SECONDS:
            return True
        parts = temp_name[len(TEMP_PREFIX) :].split(".", 2)
        if len(parts) != 3 or not parts[0].isdigit():
            return False
        pid, host = int(parts[0]), parts[2]
        return host == self._host and not _alive(pid)

    def _stats(self) -> StoreStats:
        with self._lock:
            if self._scan_due():
                self._scan()
            return StoreStats(
                self.config.capacity,
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
            self._index = _Index()


def _prepare_root(root: Path) -> None:
    """Create the store's root and its format marker, or check the marker it has; a
    ConfigError naming the path if it cannot be used."""
    marker = root / MARKER
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            _claim(root)
        version = marker.read_text().strip()
    except OSError as exc:
        raise _unusable(root, exc) from None
    if version != str(FORMAT_VERSION):
        raise ConfigError(
            f"disk.path = {str(root)!r} holds a disk store of format {version!r} ({marker}); "
            f"this maru reads and writes format {FORMAT_VERSION}: point disk.path at another "
            f"directory, or remove this one (rm -r {root}) to start an empty store there"
        )


def _claim(root: Path) -> None:
    """Write the format marker into a directory that holds nothing else (another
    process may be doing so at the same time: the first marker stays)."""
    others = [name for name in os.listdir(root) if not name.startswith(TEMP_PREFIX)]
    if others and MARKER not in others:
        raise ConfigError(
            f"disk.path = {str(root)!r} is a directory that holds other files ({others[0]}, "
            "...) and no disk store; allowed: a missing or empty directory, or one that "
            "holds a disk store"
        )
    temporary = root / f"{TEMP_PREFIX}{os.getpid()}.{secrets.token_hex(6)}.marker"
    try:
        temporary.write_text(f"{FORMAT_VERSION}\n")
        os.link(temporary, root / MARKER)
    except FileExistsError:
        pass
    finally:
        temporary.unlink(missing_ok=True)


def _unusable(root: Path, exc: OSError) -> ConfigError:
    return ConfigError(
        f"disk.path = {str(root)!r}: cannot use it as a disk store "
        f"({exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}); allowed: a "
        "directory on a local filesystem that this process can create and write"
    )


def _digest(key: bytes) -> str:
    return blake2b(key, digest_size=DIGEST_BYTES).hexdigest()


def _is_object_name(name: str) -> bool:
    return len(name) == 2 * DIGEST_BYTES and all(c in "0123456789abcdef" for c in name)


def _object_names(directory: Path) -> list[str]:
    try:
        return [name for name in os.listdir(directory) if _is_object_name(name)]
    except FileNotFoundError:
        return []


def _checksum(prefix: bytes, key: bytes, payload: memoryview) -> int:
    """xxh3 of the header's fields, the key and the payload."""
    hasher = xxhash.xxh3_64(prefix)
    hasher.update(key)
    hasher.update(payload)
    return hasher.intdigest()


def _parse(header: bytes, key: bytes, file_size: int) -> tuple[int, int]:
    """(payload size, checksum) from an object file's header; _Corrupt if it is not
    well formed or the file's length disagrees, _OtherKey if it holds another key."""
    if len(header) < HEADER_BYTES:
        raise _Corrupt
    magic, version, key_length, size = HEADER.unpack_from(header)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise _Corrupt
    if file_size != HEADER_BYTES + key_length + size:
        raise _Corrupt
    if header[HEADER_BYTES:] != key or key_length != len(key):
        raise _OtherKey
    return size, CHECKSUM.unpack_from(header, HEADER.size)[0]


def _write_all(fd: int, buffers: list[Any]) -> None:
    """Write every buffer, in order, in as few syscalls as the kernel takes."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if views:
            views[0] = views[0][written:]


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from the file at `offset`; _Corrupt if the file ends first."""
    while view.nbytes:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise _Corrupt
        view, offset = view[got:], offset + got


def _touch(fd: int) -> None:
    """Mark the object as just used (its mtime is its recency for every process); a
    file another user owns keeps its time."""
    now = time.time_ns()
    with contextlib.suppress(PermissionError):
        os.utime(fd, ns=(now, now))


def _unlink_if_same(path: Path, stat: os.stat_result) -> None:
    """Delete a corrupt file, unless another writer has replaced it meanwhile."""
    try:
        if os.stat(path).st_ino == stat.st_ino:
            path.unlink()
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@hookimpl
def maru_backends() -> list[type[Backend]]:
    return [DiskBackend]
