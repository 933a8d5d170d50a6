"""Transparent huge pages for the memory maru copies between: a pool's region and a
CPU KV cache.

A copy between memories of 4 KiB pages misses the TLB once per page on each side (a
nested page walk in a VM) and each new process maps them one at a time; with 2 MiB
pages, once per 2 MiB. A tmpfs gives huge pages only when mounted with `huge=`, and
torch gives a CPU tensor huge pages only where the system's THP setting is `always`
(the usual default is `madvise`), so maru asks for them: `MADV_HUGEPAGE` for pages
not yet touched, `MADV_COLLAPSE` (Linux 6.1) for those already there, which copies
them into huge pages (synchronously, compacting memory where it must).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterable

from maru.log import get_logger
from maru.sizes import format_size

log = get_logger(__name__)

HUGE_PAGE = 2 * 2**20
"""The PMD size of x86-64 and arm64 with 4 KiB base pages: a transparent huge page."""
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) on a range: 0, or the errno."""
    return ctypes.get_errno() if _libc.madvise(address, length, advice) else 0


def huge_interior(address: int, length: int) -> tuple[int, int]:
    """(start, length) of the whole huge pages inside a range (length 0 if none)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, end - start)


def put_on_huge_pages(ranges: Iterable[tuple[int, int]]) -> int:
    """Back memory ranges (address, length: a CPU KV cache's tensors) with huge pages,
    as far as the whole huge pages inside each go; the bytes now on huge pages. Best
    effort: a kernel that refuses leaves small pages; the contents never change."""
    started, done = time.monotonic(), 0
    for address, length in sorted(set(ranges)):
        start, length = huge_interior(address, length)
        if length and not madvise(start, length, MADV_HUGEPAGE):
            done += 0 if madvise(start, length, MADV_COLLAPSE) else length
    if done:
        log.info(
            "maru: %s of the KV cache put on huge pages in %.2f s",
            format_size(done),
            time.monotonic() - started,
        )
    return done
