"""Opening pools: create or attach to a region, map it, and share it in-process.

A process maps each pool once (keyed by the file's device and inode); every
store that opens it is one more user, and the last one to close unmaps it. A new
region's memory is reserved and populated before it is used; every other mapping
maps each object's pages when it is first used (see `memory`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from maru.backends._pool.core import Pool
from maru.backends._pool.locks import lock_region, unlock_region
from maru.backends._pool.mapping import Mapping
from maru.backends._pool.memory import Memory, prepare
from maru.backends._pool.region import (
    HEADER_BYTES,
    MAGIC,
    PAGE,
    Geometry,
    Header,
    check_header,
    read_header,
)
from maru.errors import BackendError, ConfigError
from maru.hugepages import HUGE_PAGE

_open_pools: dict[tuple[int, int], Pool] = {}
_memory: dict[Pool, Memory] = {}
_open_pools_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    """In a forked child: another thread may have held the lock at the fork."""
    global _open_pools_lock
    _open_pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


@dataclass(frozen=True)
class RegionSpec:
    """Where a pool's mapping comes from and how to make it.

    `device_size` is set for a device that cannot be resized (devdax): the pool
    must fit in it. `adopt` opens an existing pool with the capacity recorded in it,
    whatever `capacity` says (tools that inspect, clear or destroy a pool).
    `before_init` runs on a new mapping before any page is written or reserved (NUMA
    binding). `prefault` maps every page into this process before returning (else each
    object's pages are mapped on first use).
    """

    path: str
    capacity: int
    label: str
    align: int = PAGE
    mode: int = 0o600
    create: bool = True
    adopt: bool = False
    prefault: bool = False
    device_size: int | None = None
    before_init: Callable[[memoryview], None] | None = None


def attach(spec: RegionSpec) -> Pool:
    """The pool at `spec.path`, created atomically if missing; shared within the process."""
    if spec.adopt:
        spec = replace(spec, capacity=recorded_header(spec).capacity, create=False)
    geometry = Geometry.for_capacity(spec.capacity, spec.align)
    if spec.device_size is not None and geometry.total > spec.device_size:
        raise ConfigError(
            f"capacity = {spec.capacity}: needs {geometry.total} bytes with the index, but "
            f"{spec.label} has {spec.device_size}; allowed: at most "
            f"{spec.device_size - geometry.overhead} bytes"
        )
    pool = _attach_file(spec, geometry)
    if spec.prefault:
        populator = _memory[pool].populator
        populator.run()
        populator.check()
    return pool


class _Removed(Exception):
    """The file was removed (`maru pool gc` or destroy) between its open and its lock."""


def _attach_file(spec: RegionSpec, geometry: Geometry) -> Pool:
    """Open and map the pool's file, or share this process's mapping of it; open again
    if the file was removed meanwhile (a new one is then created, or BackendError)."""
    for _ in range(3):
        try:
            return _attach_once(spec, geometry)
        except _Removed:
            continue
    raise BackendError(f"{spec.label} was removed three times while it was being opened")


def _attach_once(spec: RegionSpec, geometry: Geometry) -> Pool:
    fd = _open_file(spec)
    try:
        identity = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        with _open_pools_lock:
            pool = _open_pools.get(identity)
            if pool is None:
                pool, memory = _map(fd, spec, geometry)
                _open_pools[identity] = pool
                _memory[pool] = memory
                fd = -1
            elif pool.geometry != geometry:
                check_header(pool.region.view, geometry, pool.label)
            pool.users += 1
    finally:
        if fd >= 0:
            os.close(fd)
    return pool


def recorded_header(spec: RegionSpec) -> Header:
    """The header of the existing pool at `spec.path`, read without attaching to it."""
    try:
        fd = os.open(spec.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BackendError(f"{spec.label} does not exist") from None
    except OSError as exc:
        raise BackendError(f"cannot open {spec.label}: {exc.strerror or exc}") from None
    try:
        return read_header(fd, spec.label, max(PAGE, spec.align))
    finally:
        os.close(fd)


def memory_of(pool: Pool) -> Memory:
    """The memory report of an attached pool (huge pages, populated)."""
    return _memory[pool]


def detach(pool: Pool) -> None:
    """Release one user of the pool; the last one unmaps it."""
    with _open_pools_lock:
        pool.users -= 1
        if pool.users:
            return
        for identity, candidate in list(_open_pools.items()):
            if candidate is pool:
                del _open_pools[identity]
        del _memory[pool]
    pool.close()


def _open_file(spec: RegionSpec) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        if spec.create and spec.device_size is None:
            try:
                fd = os.open(spec.path, flags | os.O_CREAT | os.O_EXCL, spec.mode)
                os.fchmod(fd, spec.mode)
                return fd
            except FileExistsError:
                pass
        return os.open(spec.path, flags)
    except FileNotFoundError:
        raise BackendError(f"{spec.label} does not exist") from None
    except OSError as exc:
        raise BackendError(f"cannot open {spec.label}: {exc.strerror or exc}") from None


def _map(fd: int, spec: RegionSpec, geometry: Geometry) -> tuple[Pool, Memory]:
    """Map the region and make it a pool: initialize a new one, check an existing one;
    its memory reserved (see `memory.prepare`)."""
    lock_region(fd)
    try:
        device = spec.device_size is not None
        if not device and os.fstat(fd).st_nlink == 0:
            raise _Removed
        size = spec.device_size if device else os.fstat(fd).st_size
        if size == 0:
            os.ftruncate(fd, geometry.total)
        elif size < HEADER_BYTES:
            raise BackendError(f"{spec.label} is not a maru pool (only {size} bytes)")
        length = geometry.total if size == 0 or device else size
        region = _mapping(fd, length, spec)
        fresh = size == 0 or (device and bytes(region.view[:8]) != MAGIC)
        if not fresh:
            check_header(region.view, geometry, spec.label)
        if spec.before_init:
            spec.before_init(region.view)
        memory = _prepare(fd, region, spec, new=size == 0, fresh=fresh)
        pool = Pool(fd, region, geometry, spec.label, memory.populator.ensure)
        if fresh:
            if device:
                region.view[: geometry.data_offset] = bytes(geometry.data_offset)
            pool.initialize()
        return pool, memory
    finally:
        unlock_region(fd)


def _mapping(fd: int, length: int, spec: RegionSpec) -> Mapping:
    """The region mapped at a huge-page boundary (or a device's larger alignment)."""
    try:
        return Mapping(fd, length, max(HUGE_PAGE, spec.align))
    except OSError as exc:
        raise BackendError(f"cannot map {spec.label}: {exc.strerror}") from None


def _prepare(fd: int, region: Mapping, spec: RegionSpec, *, new: bool, fresh: bool) -> Memory:
    """`memory.prepare`; a new file that does not fit is removed, leaving nothing behind."""
    try:
        if new and os.fstat(fd).st_nlink == 0:
            raise BackendError(f"{spec.label} was removed while it was being created")
        return prepare(fd, region, spec.capacity, spec.label, new=new, fresh=fresh)
    except BaseException:
        region.close()
        if new:
            os.ftruncate(fd, 0)
            _unlink_if_same(spec.path, fd)
        raise


def _unlink_if_same(path: str, fd: int) -> None:
    """Remove `path` if it is still the file open as `fd`."""
    opened = os.fstat(fd)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return
    if (found.st_dev, found.st_ino) == (opened.st_dev, opened.st_ino):
        os.unlink(path)
