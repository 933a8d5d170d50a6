"""Per-object checksums: written at commit, verified on every load when enabled.

Whatever corrupts an object after its commit (a pool bug, a stray writer, a bad
device) then becomes a miss instead of wrong KV. The checksum is maru's own 64-bit
sum (`maru._streamcopy`), which a CPU load computes from the registers it copies
through (`Hasher.copy_rows`), so checking a hit costs its copy a few percent instead
of a second pass over its bytes; it is on unless `checksum: false`.
"""

from __future__ import annotations

from typing import Any

from maru._streamcopy import SUM_STATE_BYTES, copy_rows_summing, sum_feed, sum_value

NO_CHECKSUM = 0
"""Stored for an object written without a checksum; it is never verified."""


def checksum(data: memoryview) -> int:
    """The value stored for `data`: never NO_CHECKSUM."""
    hasher = Hasher()
    hasher.update(data)
    return hasher.checksum()


def intact(stored: int, data: memoryview, hashed: Hasher | None = None) -> bool:
    """Does `data` match the stored checksum (or was none stored)? Where `hashed` was
    fed all of `data`, its value is taken instead of hashing `data` again."""
    if stored == NO_CHECKSUM:
        return True
    if hashed is not None and hashed.fed == data.nbytes:
        return stored == hashed.checksum()
    return stored == checksum(data)


class Hasher:
    """`checksum` of bytes fed in order, piece by piece, and how many bytes it was fed."""

    __slots__ = ("_state", "fed")

    def __init__(self) -> None:
        self._state = bytearray(SUM_STATE_BYTES)
        self.fed = 0

    def update(self, data: Any) -> None:
        """Hash the next bytes (any contiguous buffer)."""
        piece = memoryview(data)
        sum_feed(self._state, piece)
        self.fed += piece.nbytes

    def copy_rows(self, dst: int, dst_stride: int, src: int, row_bytes: int, rows: int) -> None:
        """Copy `rows` consecutive rows of `row_bytes` from address `src` to rows
        `dst_stride` apart from address `dst`, hashing them as the next bytes."""
        copy_rows_summing(self._state, dst, dst_stride, src, row_bytes, rows)
        self.fed += row_bytes * rows

    def checksum(self) -> int:
        """The value `checksum` gives for everything fed so far."""
        return sum_value(self._state) or 1
