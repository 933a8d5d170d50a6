"""Pools found on this node, read and removed without attaching to them (`maru pool
list|gc`): attaching would make the tool a holder of what it inspects."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from maru.backends._pool.locks import held, try_lock_region, unlock_region
from maru.backends._pool.region import FORMAT_VERSION, PAGE, read_header
from maru.backends.holders import Holder, user_name
from maru.backends.node import FoundStore
from maru.errors import BackendError


def survey_pool(
    path: Path, backend: str, name: str, holders: list[Holder], window: int = PAGE
) -> FoundStore | None:
    """The pool at `path` as its header and holder lock tell (`window`: how much of a
    device to map to read the header); None if it has gone meanwhile."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    found = FoundStore(
        backend, name, str(path), user_name(info.st_uid), info.st_ctime, holders=holders
    )
    device = stat.S_ISCHR(info.st_mode)
    if device:
        found.kept_by_design = "a DAX device is not removed (maru pool clear empties it)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        found.why_unknown = f"this user cannot open it ({exc.strerror}; owner {found.owner})"
        return found
    try:
        found.held = held(fd)
        _read_header(found, fd, window)
    finally:
        os.close(fd)
    if not device:
        found.remove = lambda: remove_unheld(path)
    return found


def _read_header(found: FoundStore, fd: int, window: int) -> None:
    """Fill in what the pool's header records; a problem where it is no pool of ours."""
    try:
        header = read_header(fd, found.path, window)
    except BackendError as exc:
        found.problem = str(exc)
        return
    found.capacity, found.used, found.objects = header.capacity, header.used, header.objects
    if header.created_ns:
        found.created = header.created_ns / 1e9
    if header.version != FORMAT_VERSION:
        found.problem = f"pool format version {header.version} (this maru reads {FORMAT_VERSION})"
    elif not header.ready:
        found.problem = "not initialized (its creator stopped while creating it?)"


def remove_unheld(path: Path) -> str:
    """Remove the pool at `path` unless a process holds it; why it was kept, or "".
    Holding the pool's mutex meanwhile, so no process attaches between the check and
    the removal."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"this user cannot remove it ({exc.strerror})"
    try:
        if not try_lock_region(fd):
            return "a process is using it right now"
        try:
            if held(fd):
                return "a process opened it meanwhile"
            path.unlink(missing_ok=True)
        except OSError as exc:
            return f"this user cannot remove it ({exc.strerror})"
        finally:
            unlock_region(fd)
    finally:
        os.close(fd)
    return ""
