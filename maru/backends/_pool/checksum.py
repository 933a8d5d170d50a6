"""Per-object checksums: written at commit, verified on every load when enabled.

Whatever corrupts an object after its commit (a pool bug, a stray writer, a bad
device) then becomes a miss instead of wrong KV. The checksum is XXH3-64, which
runs near memory speed; still, it reads every byte once more, which costs more than
a tenth of a load's copy (see README, "The shared pool"), so it is an option, off
by default.
"""

from __future__ import annotations

import xxhash

NO_CHECKSUM = 0
"""Stored for an object written without a checksum; it is never verified."""


def checksum(data: memoryview) -> int:
    """The value stored for `data`: never NO_CHECKSUM."""
    return xxhash.xxh3_64_intdigest(data) or 1


def intact(stored: int, data: memoryview) -> bool:
    """Does `data` match the stored checksum (or was none stored)?"""
    return stored == NO_CHECKSUM or stored == checksum(data)
