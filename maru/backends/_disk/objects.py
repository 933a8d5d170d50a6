"""Object files of the disk backend: their header, checksum and whole reads and writes.

A file is a header (magic, format version, key length, payload length, an xxh3
checksum of all of it), the key, then the payload; files never change once published.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from hashlib import blake2b
from pathlib import Path
from typing import Any

import xxhash

from maru.backends.base import MAX_KEY_BYTES

FORMAT_VERSION = 1
"""Version of the directory layout and of every object file's header."""
MAGIC = b"MKVD"
HEADER = struct.Struct("<4sHHQ")
"""magic, format version, key length, payload length; then the checksum, the key and
the payload."""
CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = HEADER.size + CHECKSUM.size
DIGEST_BYTES = 16
OPEN_READ = os.O_RDONLY | os.O_CLOEXEC
OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


class Corrupt(Exception):
    """An object file whose header, length or checksum is wrong."""


class OtherKey(Exception):
    """A well-formed object file of another key (a digest collision)."""


def digest(key: bytes) -> str:
    return blake2b(key, digest_size=DIGEST_BYTES).hexdigest()


def is_object_name(name: str) -> bool:
    return len(name) == 2 * DIGEST_BYTES and all(c in "0123456789abcdef" for c in name)


def object_checksum(prefix: bytes, key: bytes, payload: memoryview) -> int:
    """xxh3 of the header's fields, the key and the payload."""
    hasher = xxhash.xxh3_64(prefix)
    hasher.update(key)
    hasher.update(payload)
    return hasher.intdigest()


def parse(header: bytes, key: bytes, file_size: int) -> tuple[int, int]:
    """(payload size, checksum) from an object file's header; Corrupt if it is not
    well formed or the file's length disagrees, OtherKey if it holds another key."""
    if len(header) < HEADER_BYTES:
        raise Corrupt
    magic, version, key_length, size = HEADER.unpack_from(header)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise Corrupt
    if file_size != HEADER_BYTES + key_length + size:
        raise Corrupt
    if header[HEADER_BYTES:] != key or key_length != len(key):
        raise OtherKey
    return size, CHECKSUM.unpack_from(header, HEADER.size)[0]


def write_all(fd: int, buffers: list[Any]) -> None:
    """Write every buffer, in order, in as few syscalls as the kernel takes."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if views:
            views[0] = views[0][written:]


def read_all(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from the file at `offset`; Corrupt if the file ends first."""
    while view.nbytes:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise Corrupt
        view, offset = view[got:], offset + got


def touch(fd: int) -> None:
    """Mark the object as just used (its mtime is its recency for every process); a
    file another user owns keeps its time."""
    now = time.time_ns()
    with contextlib.suppress(PermissionError):
        os.utime(fd, ns=(now, now))


def unlink_if_same(path: Path, stat: os.stat_result) -> None:
    """Delete a corrupt file, unless another writer has replaced it meanwhile."""
    try:
        if os.stat(path).st_ino == stat.st_ino:
            path.unlink()
    except FileNotFoundError:
        pass


def stored_key(path: Path) -> bytes | None:
    """The key in an object file's header, or None if it is gone or not well formed;
    OSError for other failures to read it."""
    try:
        with open(path, "rb", buffering=0) as file:
            header = file.read(HEADER_BYTES + MAX_KEY_BYTES)
    except FileNotFoundError:
        return None
    if len(header) < HEADER_BYTES:
        return None
    magic, version, key_length, _ = HEADER.unpack_from(header)
    if magic != MAGIC or version != FORMAT_VERSION or len(header) < HEADER_BYTES + key_length:
        return None
    return header[HEADER_BYTES : HEADER_BYTES + key_length]
