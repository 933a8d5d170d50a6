"""The disk backend's `disk:` config section."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from maru.config import Options, Size


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
    capacity: Size | None = Field(
        None,
        description="bytes of object files the store may hold (default: the top-level "
        "capacity); in a tier below memory, typically many times the memory's",
    )
    scan_interval: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="seconds a process trusts its index of the directory before it scans "
        "it again to learn other processes' writes",
    )
