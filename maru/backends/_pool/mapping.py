"""A region's file mapped into this process at a huge-page boundary.

A file's huge pages are mapped 2 MiB at a time (one page-table entry, one TLB entry,
one madvise to map them) only where the mapping's address is 2 MiB-aligned, and the
kernel aligns mappings of tmpfs files only on mounts that offer huge pages (not on a
plain /dev/shm, whose pages `memory` makes huge at the pool's creation). So maru maps
every region itself, at an address aligned to HUGE_PAGE (or to a device's larger
alignment), inside an anonymous reservation that Python's mmap owns: views of the
region keep that reservation, and so the mapping, alive until they are released.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os

from maru.hugepages import HUGE_PAGE

MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)


class Mapping:
    """The first `length` bytes of the file `fd`, mapped shared and writable at an
    address aligned to `alignment`: `view` is the region's bytes, `address` their start.
    Where no address space can be reserved for that (strict overcommit, which ignores
    MAP_NORESERVE), the file is mapped wherever the kernel puts it.
    """

    def __init__(self, fd: int, length: int, alignment: int = HUGE_PAGE) -> None:
        try:
            self._owner = address_space(length + alignment)
        except OSError:
            self._owner = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.address = address_of(self._owner)
            self.view = memoryview(self._owner)
            return
        base = address_of(self._owner)
        start = -base % alignment
        self.address = base + start
        got = _libc.mmap(
            self.address,
            length,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_SHARED | MAP_FIXED,
            fd,
            0,
        )
        if got != self.address:
            code = ctypes.get_errno()
            self._owner.close()
            raise OSError(code, os.strerror(code))
        self.view = memoryview(self._owner)[start : start + length]

    def __len__(self) -> int:
        return len(self.view)

    def close(self) -> None:
        """Unmap, unless views are still exported: the last one's release unmaps."""
        with contextlib.suppress(BufferError):
            self.view.release()
            self._owner.close()


def address_space(length: int) -> mmap.mmap:
    """Anonymous address space to map a region into (MAP_NORESERVE: it commits no memory,
    and the region's mapping replaces all of it that is used)."""
    return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)


def address_of(memory: mmap.mmap | memoryview) -> int:
    """The start address of writable memory (the temporary buffer export ends at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(memory))
