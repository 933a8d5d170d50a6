"""The disk backend's directory: its format marker, fan-out, crashed writers' files, and
what `maru pool list` says of it."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from maru.backends._disk.objects import FORMAT_VERSION, is_object_name
from maru.backends._disk.options import DiskOptions
from maru.backends.holders import user_name
from maru.backends.node import FoundStore
from maru.errors import ConfigError

MARKER = "maru-disk-format"
"""The file at the root of a store that holds its format version."""
FANOUT = [f"{i:02x}" for i in range(256)]
DIGEST_BYTES = 16
TEMP_PREFIX = ".tmp."
STALE_TEMP_SECONDS = 600
"""A temporary file this old is a crashed writer's, whoever wrote it."""


def prepare_root(root: Path) -> None:
    """Create the store's root and its format marker, or check the marker it has; a
    ConfigError naming the path if it cannot be used."""
    marker = root / MARKER
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            claim(root)
        version = marker.read_text().strip()
    except OSError as exc:
        raise unusable(root, exc) from None
    if version != str(FORMAT_VERSION):
        raise ConfigError(
            f"disk.path = {str(root)!r} holds a disk store of format {version!r} ({marker}); "
            f"this maru reads and writes format {FORMAT_VERSION}: point disk.path at another "
            f"directory, or remove this one (rm -r {root}) to start an empty store there"
        )


def claim(root: Path) -> None:
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


def unusable(root: Path, exc: OSError) -> ConfigError:
    return ConfigError(
        f"disk.path = {str(root)!r}: cannot use it as a disk store "
        f"({exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}); allowed: a "
        "directory on a local filesystem that this process can create and write"
    )


def object_names(directory: Path) -> list[str]:
    try:
        return [name for name in os.listdir(directory) if is_object_name(name)]
    except FileNotFoundError:
        return []


def scan_objects(root: Path, host: str, *, clean_temps: bool) -> list[tuple[int, str, int]]:
    """(mtime in ns, name, size) of every object file under the fan-out directories of
    `root`, least recently used first; with `clean_temps`, crashed writers' temporary
    files are removed on the way. An unreadable directory raises its OSError."""
    found: list[tuple[int, str, int]] = []
    for sub in FANOUT:
        for entry in list(os.scandir(root / sub)):
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.startswith(TEMP_PREFIX):
                if clean_temps and abandoned(entry.name, stat.st_mtime, host):
                    Path(entry.path).unlink(missing_ok=True)
            elif is_object_name(entry.name):
                found.append((stat.st_mtime_ns, entry.name, stat.st_size))
    found.sort()
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def abandoned(temp_name: str, mtime: float, host: str) -> bool:
    """Is this temporary file a crashed writer's: old, or written on `host` (this one)
    by a process that is gone?"""
    if time.time() - mtime > STALE_TEMP_SECONDS:
        return True
    parts = temp_name[len(TEMP_PREFIX) :].split(".", 2)
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    pid, writer_host = int(parts[0]), parts[2]
    return writer_host == host and not alive(pid)


def survey_root(options: DiskOptions, capacity: int) -> list[FoundStore]:
    """The store configured by `options` for `maru pool list`, its object files counted
    (none if there is none); `maru pool gc` never removes it: it is kept across restarts."""
    root = options.path.expanduser()
    try:
        marker = (root / MARKER).stat()
    except OSError:
        return []
    sizes = [f.stat().st_size for f in root.glob("*/*/*") if is_object_name(f.name)]
    found = FoundStore(
        "disk",
        str(root),
        str(root),
        user_name(marker.st_uid),
        marker.st_mtime,
        options.capacity or capacity,
        sum(sizes),
        len(sizes),
        why_unknown="its files are open only while they are read or written",
        kept_by_design="kept across restarts by design (maru pool destroy removes it)",
    )
    return [found]
