"""The memory behind a pool: reserved at creation, populated ahead of use, huge
pages wherever the kernel can make them.

A pool's region is a file (tmpfs for shm, any file for emulated cxl). A sparse
file opens at any size, and the first write to a page the filesystem cannot
back kills the writing process with SIGBUS; so a new region is allocated in
full when it is created (`reserve`), an existing one is checked and completed
when it is attached (`ensure_backed`), and either refuses with a `ConfigError`
that says how to get more memory. DAX devices are memory: nothing to reserve.

A page is mapped into a process on its first touch, one fault per 4 KiB page,
which makes a fresh mapping's first pass a fraction of memory speed. A
`Populator` maps pages ahead of use with `MADV_POPULATE_WRITE` (Linux 5.14): a new
region whole, at creation, before the pool's first use (its first pass then runs at
memory speed); in a process that attaches to an existing pool, each object's range
when it is first read or written (so attaching walks nothing, and a process maps only
what it uses: eight engines on a 512 GiB pool do not each map all of it).

Small pages cost a hit dearly: mapping a new process's 34 MB of a hit took longer than
copying them, and each 4 KiB page is a TLB miss. A tmpfs gives huge pages only when
mounted with `huge=` (a plain /dev/shm is not), so a new region on one that gives small
pages is made of huge pages at its creation (`Populator.collapse`), and every process
maps it at a 2 MiB boundary (`mapping`), one page-table entry per 2 MiB.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from maru.backends._pool.locks import reset_after_fork
from maru.backends._pool.mapping import Mapping
from maru.errors import BackendError, ConfigError
from maru.hugepages import HUGE_PAGE, MADV_COLLAPSE, MADV_HUGEPAGE, madvise
from maru.log import get_logger
from maru.sizes import format_size

log = get_logger(__name__)

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
"""madvise(2) advice (Linux 5.14): fault pages in, readable or writable, without
touching them (read-only mappings are the cheaper: 6.3 against 5.0 GB/s of first reads
in a new process, `benchmarks/pool_attach.py`)."""
POPULATE_CHUNK = 64 * 2**20
"""Bytes populated per madvise call when populating a whole region: progress granularity."""
GRANULE = HUGE_PAGE
"""Bytes mapped at once on first use (a huge page's worth: one madvise maps many pages)."""
READABLE, WRITABLE = 1, 2
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
MOUNTINFO = Path("/proc/self/mountinfo")
SMAPS = Path("/proc/self/smaps")


# --- reserving the backing -----------------------------------------------------


def reserve(fd: int, size: int, capacity: int, label: str) -> None:
    """Allocate every byte of the region's file now, so that no later write can SIGBUS.

    Raises ConfigError naming the capacity asked for, the space available and how to
    get more. Allocating only fills holes: data already there is never changed.
    """
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise BackendError(f"cannot reserve memory for {label}: {exc.strerror}") from None
        raise no_room(fd, size, capacity, label, exc.errno) from None


def no_room(fd: int, size: int, capacity: int, label: str, code: int) -> ConfigError:
    """The error for a region that does not fit in the memory behind its file."""
    vfs = os.fstatvfs(fd)
    held = os.fstat(fd).st_blocks * 512
    available = vfs.f_bavail * vfs.f_frsize + held
    if code == errno.ENOMEM:
        why = "the system (or this container's memory limit) has not enough memory"
    else:
        why = f"its filesystem has {format_size(available)} ({available} bytes) for it"
    fits = max(0, available - (size - capacity))
    return ConfigError(
        f"capacity = {capacity}: {label} needs {format_size(size)} ({size} bytes, "
        f"with its index), but {why}; allowed: a capacity that fits (at most about "
        f"{format_size(fits)}), or more memory behind the pool: a larger /dev/shm "
        f"(docker run --shm-size=..., whose default is 64 MiB; Kubernetes: an emptyDir "
        f"with medium: Memory and a sizeLimit) or a larger memory limit"
    )


def backed(fd: int, size: int) -> bool:
    """Whether the first `size` bytes of the file have memory or blocks behind them."""
    info = os.fstat(fd)
    return not stat.S_ISREG(info.st_mode) or info.st_blocks * 512 >= size


def ensure_backed(fd: int, size: int, capacity: int, label: str) -> None:
    """Complete the backing of an existing region (one created sparse, by an older
    maru or by hand), or refuse it with the error of `reserve`."""
    if not backed(fd, size):
        reserve(fd, size, capacity, label)


# --- huge pages ------------------------------------------------------------------


@dataclass(frozen=True)
class HugePages:
    """Whether the region's file can get transparent huge pages, and why."""

    mode: str
    """The effective policy: always, within_size, advise, never, or device (DAX)."""
    reason: str
    collapsible: bool = False
    """A tmpfs that gives small pages, whose pages maru makes huge at creation (`collapse`)."""


def selected(sysfs_text: str) -> str:
    """The bracketed choice of a sysfs policy file: 'advise' from 'always [advise] never'."""
    found = re.search(r"\[([a-z_]+)\]", sysfs_text)
    return found.group(1) if found else sysfs_text.strip() or "never"


def huge_policy(shmem_enabled: str, fs_type: str, mount_options: str) -> HugePages:
    """The huge-page policy for a file, from the shmem_enabled sysfs text and the
    type and options of the filesystem the file is on.

    A tmpfs file (/dev/shm) follows its mount's `huge=` option (absent: never),
    unless shmem_enabled is `deny` or `force`, which override every mount.
    """
    system = selected(shmem_enabled)
    if system == "deny":
        return HugePages("never", "shmem_enabled is deny")
    if fs_type != "tmpfs":
        return HugePages("never", f"not on tmpfs ({fs_type or 'unknown filesystem'})")
    if system == "force":
        return HugePages("always", "shmem_enabled is force")
    found = re.search(r"(?:^|,)huge=([a-z_]+)", mount_options)
    mode = found.group(1) if found else "never"
    reason = f"tmpfs mounted with huge={mode}, shmem_enabled [{system}]"
    return HugePages(mode, reason, collapsible=mode == "never")


def mount_of(fd: int, mountinfo: str) -> tuple[str, str]:
    """(filesystem type, superblock options) of the mount holding the open file."""
    device = os.fstat(fd).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, rest = fields.split(), tail.split()
        if len(parts) > 2 and parts[2] == wanted and len(rest) >= 3:
            return rest[0], rest[2]
    return "", ""


def huge_pages_for(fd: int) -> HugePages:
    """The huge-page policy that applies to the open file `fd`."""
    if stat.S_ISCHR(os.fstat(fd).st_mode):
        return HugePages("device", "a DAX device: pages of the device's alignment")
    fs_type, options = mount_of(fd, _read(MOUNTINFO))
    return huge_policy(_read(SHMEM_ENABLED) or "[never]", fs_type, options)


def advise_huge(region: Mapping, policy: HugePages) -> None:
    """Ask for huge pages where the policy leaves it to the mapping (huge=advise); a
    kernel without them refuses, and the pool gets small pages (reported)."""
    if policy.mode == "advise":
        madvise(region.address, len(region), MADV_HUGEPAGE)


def huge_page_bytes_at(address: int) -> int:
    """Bytes of the mapping at `address` that this process maps with huge pages (smaps)."""
    start = f"{address:x}-"
    counting, total = False, 0
    for line in _read(SMAPS).splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            counting = line.startswith(start)
        elif counting and re.match(r"^(Shmem|File)PmdMapped:", line):
            total += int(line.split()[1]) * 1024
    return total


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# --- populating ------------------------------------------------------------------


class Populator:
    """Maps a region's pages into this process ahead of use.

    `run` maps the whole region (a new pool before its first use, `prefault`, `maru
    pool create`); `ensure` maps one range on its first use, in big granules, so a
    process that attaches to an existing pool maps only what it reads or writes, in one
    madvise per granule rather than a fault per 4 KiB page, and never walks the rest.
    `state`: no, in progress, yes, unsupported or failed. A forked child starts over at
    "no": fork copies no page tables of a shared file mapping.
    """

    def __init__(self, region: Mapping, label: str) -> None:
        self.address = region.address
        self.total = len(region)
        self.done = 0
        self.state = "no"
        self.error = ""
        self._label = label
        self._granules = bytearray(-(-self.total // GRANULE))
        """Per GRANULE of the region, what `ensure` mapped into this process: 0 nothing,
        READABLE, WRITABLE."""
        reset_after_fork(self)

    @property
    def mapped_bytes(self) -> int:
        """Bytes this process has mapped ahead of use: all, or the granules used so far."""
        if self.state == "yes":
            return self.total
        return min(self.total, sum(map(bool, self._granules)) * GRANULE)

    def after_fork(self) -> None:
        """In a forked child: nothing populated."""
        self.done, self.state, self.error = 0, "no", ""
        self._granules = bytearray(len(self._granules))

    def run(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Populate the whole region now, calling `progress(done, total)` after each chunk."""
        if self.state == "yes":
            return
        self.state, self.done = "in progress", 0
        while self.done < self.total:
            length = min(POPULATE_CHUNK, self.total - self.done)
            if not self._populate(self.done, length):
                return
            self.done += length
            if progress:
                progress(self.done, self.total)
        self.state = "yes"

    def ensure(self, offset: int, length: int, writable: bool) -> None:
        """Map the granules of the region's bytes [offset, offset + length) that this
        process has not mapped yet, for reading or for writing (where populating works
        at all)."""
        if self.state in ("yes", "unsupported", "failed") or length <= 0:
            return
        wanted = WRITABLE if writable else READABLE
        first, end = offset // GRANULE, -(-(offset + length) // GRANULE)
        granule = first
        while granule < end:
            if self._granules[granule] >= wanted:
                granule += 1
                continue
            run = granule
            while run < end and self._granules[run] < wanted:
                run += 1
            start = granule * GRANULE
            if not self._populate(start, min(run * GRANULE, self.total) - start, writable):
                return
            self._granules[granule:run] = bytes([wanted]) * (run - granule)
            granule = run

    def collapse(self) -> int:
        """Make a new region's memory huge pages, where its tmpfs would give it small
        ones; the bytes made huge. Each whole granule gets its first page (a populate,
        which fails where a write would SIGBUS), then they are collapsed into huge pages
        (MADV_COLLAPSE, Linux 6.1) a chunk at a time: cheaper than allocating the region
        page by page, and every process then maps it 2 MiB at a time. Best effort: it
        stops at the first refusal (an older kernel, no free huge page, no room), leaving
        the rest to `reserve`."""
        started = 0
        while started + GRANULE <= self.total:
            if _populate(self.address + started, mmap.PAGESIZE, MADV_POPULATE_WRITE):
                break
            started += GRANULE
        made = 0
        while made < started:
            length = min(POPULATE_CHUNK, started - made)
            if madvise(self.address + made, length, MADV_COLLAPSE):
                break
            made += length
        return made

    def _populate(self, offset: int, length: int, writable: bool = True) -> bool:
        """madvise one range; False (and the state says why) if the kernel refused."""
        advice = MADV_POPULATE_WRITE if writable else MADV_POPULATE_READ
        code = _populate(self.address + offset, length, advice)
        if code:
            unsupported = code == errno.EINVAL
            needs = "MADV_POPULATE_READ/WRITE need Linux 5.14 or newer"
            self.error = needs if unsupported else os.strerror(code)
            self.state = "unsupported" if unsupported else "failed"
        return not code

    def check(self) -> None:
        """Raise BackendError if populating did not succeed (for `prefault: true`)."""
        if self.state in ("failed", "unsupported"):
            raise BackendError(f"cannot prefault {self._label}: {self.error}")


def _populate(address: int, length: int, advice: int) -> int:
    """madvise(advice) on a range; 0 or the errno (EINTR, EAGAIN retried)."""
    while code := madvise(address, length, advice):
        if code not in (errno.EINTR, errno.EAGAIN):
            return code
    return 0


# --- a pool's memory ---------------------------------------------------------------


@dataclass
class Memory:
    """What a pool's mapping got: its huge-page policy and its populator."""

    huge: HugePages
    populator: Populator

    def report(self) -> dict[str, str | int]:
        """Huge pages (yes, no, or device: a DAX device's own page size) and why; populated
        (no, in progress, yes, unsupported, failed) and how far."""
        mapped = huge_page_bytes_at(self.populator.address)
        made = ", made huge at the pool's creation" if self.huge.collapsible and mapped else ""
        return {
            "huge_pages": "device" if self.huge.mode == "device" else "yes" if mapped else "no",
            "huge_page_bytes": mapped,
            "huge_page_policy": self.huge.reason + made,
            "populated": self.populator.state,
            "populated_bytes": self.populator.mapped_bytes,
        }


def prepare(
    fd: int, region: Mapping, capacity: int, label: str, *, new: bool, fresh: bool
) -> Memory:
    """Reserve a new region's backing (or complete an existing one's), with huge pages
    where they are offered, and populate a `fresh` one (a pool about to be initialized);
    the others' pages are mapped as they are used (`Populator.ensure`).

    On a tmpfs mounted with huge=advise, allocating the file would take small pages,
    so the region is populated first, through a mapping that asked for huge pages; on
    one that gives small pages (a plain /dev/shm), they are made huge (`collapse`).
    """
    huge = huge_pages_for(fd)
    advise_huge(region, huge)
    populator = Populator(region, label)
    if not new:
        ensure_backed(fd, len(region), capacity, label)
    else:
        if huge.mode == "advise":
            populator.run()
            if populator.state == "failed":
                raise no_room(fd, len(region), capacity, label, errno.ENOSPC)
        elif huge.collapsible:
            _collapse_new(populator, label)
        reserve(fd, len(region), capacity, label)
    if fresh:
        _populate_new(populator, label)
    return Memory(huge, populator)


def _collapse_new(populator: Populator, label: str) -> None:
    started = time.monotonic()
    made = populator.collapse()
    log.info(
        "%s: %s of %s made huge pages in %.2f s",
        label,
        format_size(made),
        format_size(populator.total),
        time.monotonic() - started,
    )


def _populate_new(populator: Populator, label: str) -> None:
    """Map a new region's pages before its first use: the first pass over a fresh pool
    then runs at memory speed instead of a page fault per 4 KiB (it costs the creating
    process about half a second per GiB, once; processes that attach map each object's
    pages on its first use)."""
    if populator.state != "no":
        return
    started = time.monotonic()
    log.info("populating %s (%s) ...", label, format_size(populator.total))
    populator.run()
    log.info(
        "populated %s in %.1f s: %s",
        label,
        time.monotonic() - started,
        populator.state if not populator.error else f"{populator.state} ({populator.error})",
    )
