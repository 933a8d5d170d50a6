"""Per-object checksums: written at commit, verified on every load when enabled.

Whatever corrupts an object after its commit (a pool bug, a stray writer, a bad
device) then becomes a miss instead of wrong KV. The checksum is XXH3-64, which
runs near memory speed: it reads every byte once more, which costs a bare load a lot
(+71% at 4 MiB) but a hit inside vLLM about 6% of its time to first token (README,
"The shared pool"), under the tenth that makes it worth having by default: it is on
unless `checksum: false`. A reader that copies an object can hash it as it goes
(`Hasher`), while the bytes are in its CPU's caches, and spare that extra pass.
"""

from __future__ import annotations

from typing import Any

import xxhash

NO_CHECKSUM = 0
"""Stored for an object written without a checksum; it is never verified."""


def checksum(data: memoryview) -> int:
    """The value stored for `data`: never NO_CHECKSUM."""
    return xxhash.xxh3_64_intdigest(data) or 1


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
        self._state = xxhash.xxh3_64()
        self.fed = 0

    def update(self, data: Any) -> None:
        """Hash the next bytes (any contiguous buffer)."""
        piece = memoryview(data)
        self._state.update(piece)
        self.fed += piece.nbytes

    def checksum(self) -> int:
        """The value `checksum` gives for everything fed so far."""
        return self._state.intdigest() or 1
