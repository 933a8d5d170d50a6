"""Which processes of this node hold a file: mapped (`/proc/PID/maps`) or open
(`/proc/PID/fd`). For `maru pool list|gc`, which show who holds each store.

Only what this user may read is seen: root sees every process, another user only its
own. So an empty answer is not proof that nobody holds a file: a pool's own holder
lock (`maru.backends._pool.locks.held`) is that proof; this module names the holders.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Holder:
    """A process holding a store: its pid, its user and its command line."""

    pid: int
    user: str
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.user}: {self.command})"


def holders_of(paths: Iterable[str]) -> dict[str, list[Holder]]:
    """For each of `paths`, the processes this user can see mapping or opening it."""
    holders: dict[str, list[Holder]] = {str(p): [] for p in paths}
    if not holders:
        return holders
    for pid_dir in _process_dirs():
        found = _files_of(pid_dir) & holders.keys()
        if not found:
            continue
        holder = _holder(pid_dir)
        if holder is not None:
            for path in sorted(found):
                holders[path].append(holder)
    return holders


def _process_dirs() -> Iterator[Path]:
    for entry in PROC.iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            yield entry


def _files_of(pid_dir: Path) -> set[str]:
    """The files a process maps or has open (empty where this user may not look)."""
    files: set[str] = set()
    try:
        with open(pid_dir / "maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    files.add(fields[5].rstrip("\n"))
        for fd in (pid_dir / "fd").iterdir():
            files.add(os.readlink(fd))
    except OSError:
        pass
    return files


def _holder(pid_dir: Path) -> Holder | None:
    """The process of `pid_dir`, or None if it has gone meanwhile."""
    try:
        uid = pid_dir.stat().st_uid
        raw = (pid_dir / "cmdline").read_bytes()
    except OSError:
        return None
    command = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return Holder(int(pid_dir.name), user_name(uid), command[:200] or f"[{pid_dir.name}]")


def user_name(uid: int) -> str:
    """The name of user `uid`, or the number where it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
