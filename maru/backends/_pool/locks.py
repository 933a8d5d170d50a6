"""Locks on the region's file: the pool mutex, writer slots that tell whether the
writer of a pending reservation is still alive, the holder lock that tells whether any
process has the pool open; and what a forked child resets.

Both are byte locks on the region's file, which the kernel drops when their owner
goes, so a crashed process never hangs the others and its reservations can be
reclaimed. They are open-file-description (OFD) locks, not POSIX record locks:
a POSIX lock belongs to the process and is dropped when the process closes *any*
descriptor of the file (a second store handle on the pool, or anything else that
opens and closes /dev/shm/maru-NAME), which silently made a live writer look
dead. An OFD lock belongs to the descriptor that took it and lasts until that
descriptor, the pool's own, is closed: a writer stays live as long as its
process lives with the pool open.

OFD locks do not exclude threads that share a descriptor (a thread lock does),
and a forked child shares its parent's descriptor and so its locks: each child
gets a descriptor of its own, fresh thread locks and no writer slot (objects
registered with `reset_after_fork`), so it never holds, or releases, or keeps
alive, what is its parent's.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import secrets
import struct
import threading
import weakref
from typing import Protocol

from maru.backends._pool.region import SLOT_TOKENS, WRITER_SLOTS, Tables
from maru.errors import BackendError

MUTEX_BYTE = 0
SLOT_LOCK_BASE = 1
HOLDER_BYTE = SLOT_LOCK_BASE + WRITER_SLOTS
"""Every process with the pool open holds a shared lock on this byte: a pool whose byte
nobody holds is held by no process (`maru pool gc`), whoever's processes they are."""
TOKEN_MASK = 2**48 - 1
_FLOCK = "hhqqi4x"
"""struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)."""
_LOST = (
    "this pool was inherited across fork and this process could not open it again; "
    "open the store again in the child"
)


@functools.cache
def _flock(kind: int, offset: int) -> bytes:
    """The struct flock of one byte (cached: packing it costs as much as the lock)."""
    return struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0)


def _fcntl_lock(fd: int, command: int, kind: int, offset: int) -> bytes:
    """One OFD lock call on the byte at `offset`; returns the kernel's struct flock."""
    if fd < 0:
        raise BackendError(_LOST)
    return fcntl.fcntl(fd, command, _flock(kind, offset))


_LIBC = ctypes.PyDLL(None, use_errno=True)
"""libc, called without handing back the interpreter's lock (ctypes.PyDLL)."""
_LIBC.fcntl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_char_p)
_LIBC.fcntl.restype = ctypes.c_int


def _set_holding_interpreter(fd: int, flock: bytes) -> bool:
    """F_OFD_SETLK (`flock`: take or give a lock), which never waits, without handing
    back the interpreter's lock: Python's fcntl hands it back for every call, and a
    thread that does so beside a busy one (a background load beside the engine's
    thread) waits for it again each time, up to the switch interval. False where
    another descriptor holds the byte."""
    if _LIBC.fcntl(fd, fcntl.F_OFD_SETLK, flock) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EAGAIN, errno.EACCES):
        return False
    raise OSError(code, os.strerror(code))


def _lock(fd: int, offset: int) -> None:
    _fcntl_lock(fd, fcntl.F_OFD_SETLKW, fcntl.F_WRLCK, offset)


def _unlock(fd: int, offset: int) -> None:
    _fcntl_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, offset)


def _try_lock(fd: int, offset: int) -> bool:
    try:
        _fcntl_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, offset)
    except (BlockingIOError, PermissionError):
        return False
    return True


def hold(fd: int) -> None:
    """Mark the pool open in this process, through its lock descriptor `fd`, until
    that descriptor is closed."""
    _fcntl_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK, HOLDER_BYTE)


def held(fd: int) -> bool:
    """Does any process hold the pool open as `fd` (a descriptor that holds nothing)?"""
    return _locked_by_another(fd, HOLDER_BYTE)


def try_lock_region(fd: int) -> bool:
    """Take the mutex byte without waiting; False if another holds it."""
    return _try_lock(fd, MUTEX_BYTE)


def _locked_by_another(fd: int, offset: int) -> bool:
    """Does another descriptor hold the byte? (Asks without taking it.)"""
    kind = struct.unpack(_FLOCK, _fcntl_lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, offset))[0]
    return kind != fcntl.F_UNLCK


class ForkAware(Protocol):
    def after_fork(self) -> None:
        """Drop what belongs to the parent process (runs in the child, after fork)."""


_fork_aware: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def reset_after_fork(item: ForkAware) -> None:
    """Call `item.after_fork()` in the child of every later fork, until forgotten."""
    _fork_aware.add(item)


def forget_after_fork(item: ForkAware) -> None:
    """Stop calling `item.after_fork()`."""
    _fork_aware.discard(item)


def _in_forked_child() -> None:
    for item in list(_fork_aware):
        item.after_fork()


os.register_at_fork(after_in_child=_in_forked_child)


def lock_descriptor(fd: int) -> int:
    """A descriptor of `fd`'s file with an open file description of its own, to take
    the pool's locks through. Not `fd` itself: mmap keeps a duplicate of the descriptor
    it maps, and every duplicate (a forked child's too) would keep those locks alive."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise BackendError(f"cannot open the pool's file for its locks: {exc}") from None


def lock_descriptor_in_child(inherited: int) -> int:
    """In a forked child: close the inherited lock descriptor (the parent's, with the
    parent's locks) and open one of the child's own; -1 if that fails, and then every
    lock refuses with a BackendError."""
    try:
        return lock_descriptor(inherited)
    except BackendError:
        return -1
    finally:
        os.close(inherited)


class Mutex:
    """Thread lock plus an OFD byte lock: excludes threads and processes. Taken and
    given without handing back the interpreter's lock, unless another process holds
    it (then waiting for it does)."""

    _TAKE = _flock(fcntl.F_WRLCK, MUTEX_BYTE)
    _GIVE = _flock(fcntl.F_UNLCK, MUTEX_BYTE)

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._thread_lock = threading.Lock()

    def __enter__(self) -> None:
        if self._fd < 0:
            raise BackendError(_LOST)
        self._thread_lock.acquire()
        try:
            if not _set_holding_interpreter(self._fd, self._TAKE):  # another process has it
                fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, self._TAKE)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        _set_holding_interpreter(self._fd, self._GIVE)
        self._thread_lock.release()

    def after_fork(self, fd: int) -> None:
        """Lock through `fd` from now on, with a new thread lock (one held by another
        thread at the fork would stay held)."""
        self._fd = fd
        self._thread_lock = threading.Lock()


def lock_region(fd: int) -> None:
    """Take the mutex byte without the thread lock (while the region is set up)."""
    _lock(fd, MUTEX_BYTE)


def unlock_region(fd: int) -> None:
    """Release what `lock_region` took."""
    _unlock(fd, MUTEX_BYTE)


class WriterSlots:
    """This process's writer slot, and the liveness of other processes' writers.

    A writer id is `slot << 48 | token`: the slot's lock is held for as long as the
    pool is open, and the token, written into the header, tells a reused slot apart.
    """

    def __init__(self, fd: int, tables: Tables, label: str) -> None:
        self._fd = fd
        self._tables = tables
        self._label = label
        self._slot: int | None = None
        self._token = 0
        self._taking = threading.Lock()

    def writer(self) -> int:
        """This process's writer id; takes a free slot on first use (one thread takes
        it: the threads of a process share the descriptor, so each would get the
        same slot, and all but the last token written would look dead)."""
        if self._slot is None:
            with self._taking:
                if self._slot is None:
                    self._take_slot()
        return self._slot << 48 | self._token & TOKEN_MASK

    def _take_slot(self) -> None:
        for slot in range(WRITER_SLOTS):
            if _try_lock(self._fd, SLOT_LOCK_BASE + slot):
                self._token = secrets.randbits(62) + 1
                self._tables.set(SLOT_TOKENS + slot, self._token)
                self._slot = slot
                return
        raise BackendError(f"{self._label}: all {WRITER_SLOTS} writer slots are in use")

    def owns(self, writer: int) -> bool:
        """Is `writer` this process's writer id (so its reservations are ours)?"""
        return self._slot is not None and writer == self.writer()

    def after_fork(self, fd: int) -> None:
        """Forget the parent's slot: the child takes one of its own (through `fd`, its
        own descriptor) when it first writes."""
        self._fd = fd
        self._slot, self._token = None, 0
        self._taking = threading.Lock()

    def release(self) -> None:
        """Give up this process's slot (the pool is being closed)."""
        if self._slot is not None:
            _unlock(self._fd, SLOT_LOCK_BASE + self._slot)
            self._slot, self._token = None, 0

    def alive(self, writer: int) -> bool:
        """Is the writer with this id still running (caller holds the mutex)?"""
        slot, token = writer >> 48, writer & TOKEN_MASK
        if slot == self._slot:
            return token == self._token & TOKEN_MASK
        if self._tables.get(SLOT_TOKENS + slot) & TOKEN_MASK != token:
            return False
        return _locked_by_another(self._fd, SLOT_LOCK_BASE + slot)
