"""Per-object checksums: written at commit, verified on every load when enabled.

Whatever corrupts an object after its commit (a pool bug, a stray writer, a bad
device) then becomes a miss instead of wrong KV. The checksum is CRC-32 (zlib):
of what the standard library offers, the fastest that still catches reordered
bytes. It costs several times a load's copy (see README, "The shared pool"), so
it is an option, off by default.
"""

from __future__ import annotations

import zlib

NO_CHECKSUM = 0
"""Stored for an object written without a checksum; it is never verified."""


def checksum(data: memoryview) -> int:
    """The value stored for `data`: never NO_CHECKSUM."""
    return 1 << 32 | zlib.crc32(data)


def intact(stored: int, data: memoryview) -> bool:
    """Does `data` match the stored checksum (or was none stored)?"""
    return stored == NO_CHECKSUM or stored == checksum(data)
