"""Locks on the region's file: the pool mutex, and writer slots that tell whether
the writer of a pending reservation is still alive; and what a forked child resets.

Both are `fcntl` byte locks, which the kernel drops when their owner dies, so a
crashed process never hangs the others and its reservations can be reclaimed.

A forked child inherits the parent's objects but not its locks: thread locks
another thread held at the fork would never be released, and the parent's
writer slot is not the child's. Objects registered with `reset_after_fork`
start clean in every child.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import weakref
from typing import Protocol

from maru.backends.pool.region import SLOT_TOKENS, WRITER_SLOTS, Tables
from maru.errors import BackendError

MUTEX_BYTE = 0
SLOT_LOCK_BASE = 1
TOKEN_MASK = 2**48 - 1


class ForkAware(Protocol):
    def after_fork(self) -> None:
        """Drop what belongs to the parent process (runs in the child, after fork)."""


_fork_aware: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def reset_after_fork(item: ForkAware) -> None:
    """Call `item.after_fork()` in the child of every later fork, while `item` lives."""
    _fork_aware.add(item)


def _in_forked_child() -> None:
    for item in list(_fork_aware):
        item.after_fork()


os.register_at_fork(after_in_child=_in_forked_child)


class Mutex:
    """Thread lock plus an fcntl byte lock: excludes threads and processes."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._thread_lock = threading.Lock()

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, MUTEX_BYTE)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, MUTEX_BYTE)
        self._thread_lock.release()

    def after_fork(self) -> None:
        """A new thread lock: one held by another thread at the fork stays held."""
        self._thread_lock = threading.Lock()


def lock_region(fd: int) -> None:
    """Take the mutex byte without the thread lock (while the region is set up)."""
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, MUTEX_BYTE)


def unlock_region(fd: int) -> None:
    """Release what `lock_region` took."""
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, MUTEX_BYTE)


def _try_byte_lock(fd: int, offset: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
    except OSError:
        return False
    return True


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

    def writer(self) -> int:
        """This process's writer id; takes a free slot on first use."""
        if self._slot is None:
            for slot in range(WRITER_SLOTS):
                if _try_byte_lock(self._fd, SLOT_LOCK_BASE + slot):
                    self._token = secrets.randbits(62) + 1
                    self._tables.set(SLOT_TOKENS + slot, self._token)
                    self._slot = slot
                    break
            else:
                raise BackendError(f"{self._label}: all {WRITER_SLOTS} writer slots are in use")
        return self._slot << 48 | self._token & TOKEN_MASK

    def owns(self, writer: int) -> bool:
        """Is `writer` this process's writer id (so its reservations are ours)?"""
        return self._slot is not None and writer == self.writer()

    def after_fork(self) -> None:
        """Forget the parent's slot: a child takes a slot of its own when it writes."""
        self._slot, self._token = None, 0

    def alive(self, writer: int) -> bool:
        """Is the writer with this id still running (caller holds the mutex)?"""
        slot, token = writer >> 48, writer & TOKEN_MASK
        if slot == self._slot:
            return token == self._token & TOKEN_MASK
        if self._tables.get(SLOT_TOKENS + slot) & TOKEN_MASK != token:
            return False
        if _try_byte_lock(self._fd, SLOT_LOCK_BASE + slot):
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, SLOT_LOCK_BASE + slot)
            return False
        return True
