"""The pool's format: what lies where in the mapped region, and how to check it.

A region is a header (8-byte magic, then uint64 words), an entry table (a
struct of arrays, one element per entry), a hash index (bucket heads) and the
data. Everything is fixed-width binary, so every process reads it the same way;
a region of another version or geometry is refused, never reinterpreted.

Every process of the node can write the region, so nothing read from it is trusted
before it is checked: an entry in use is `sound` only if its fields are in range and
its seal (a checksum of its fields, written with them) matches, and a link (a bucket
head, a chain, the address and free lists) only names entries that exist. What fails
a check raises `Damaged`, and the pool repairs itself (`maru.backends._pool.core`).
"""

from __future__ import annotations

import mmap
import secrets
import struct
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from maru.backends.base import MAX_KEY_BYTES
from maru.errors import BackendError, ConfigError

MAGIC = b"MARUPOOL"
FORMAT_VERSION = 8
"""8: object checksums are maru's own sum (`maru._streamcopy`), which loads compute as
they copy; 7: an object's bytes start on an ALIGN boundary after its key; 6: a seal per entry
over its fields; 5: a removal log in the header; 4: XXH3-64 key hashes and checksums;
3: a checksum field per entry; 2: 64-bit BLAKE2b key hashes (1: CRC-32 and length)."""
ALIGN = 64
PAGE = 4096
BYTES_PER_ENTRY = 64 * 1024
MIN_ENTRIES, MAX_ENTRIES = 4096, 1 << 22
WRITER_SLOTS = 4096

FREE, PENDING, COMMITTED = 0, 1, 2
"""Entry states."""
NONE = -1
"""No entry (in the int32 link arrays)."""
NO_LINK = 2**64 - 1
"""No entry (in a uint64 header word)."""

# Header words (uint64), after the 8-byte magic.
(
    VERSION,
    READY,
    CAPACITY,
    ENTRIES,
    BUCKETS,
    DATA_OFFSET,
    TOTAL,
    ID0,
    ID1,
    DIRTY,
    CURSOR,
    CURSOR_NEXT,
    ADDR_HEAD,
    ADDR_TAIL,
    FREE_HEAD,
    USED,
    OBJECTS,
    HITS,
    MISSES,
    EVICTIONS,
    RECLAIMED,
    RECOVERIES,
    CORRUPT,
    REMOVALS,
    DAMAGED,
    REPAIRS,
    CREATED,
) = range(1, 28)
"""CREATED: the creation time in nanoseconds since the epoch (0 in pools made before it
was written: the file's change time stands in for it)."""
SLOT_TOKENS = 64
"""Word index where the writer-slot tokens start (one word per slot)."""
REMOVAL_LOG = SLOT_TOKENS + WRITER_SLOTS
"""Word index where the removal log starts: a ring of the key hashes of the last
REMOVAL_LOG_SLOTS committed objects removed; removal n (counted in REMOVALS) is at n
modulo its length."""
REMOVAL_LOG_SLOTS = 4096
HEADER_BYTES = -(-(REMOVAL_LOG + REMOVAL_LOG_SLOTS) * 8 // PAGE) * PAGE

ENTRY_FIELDS = (  # name, dtype: struct of arrays, each `entries` long
    ("state", np.int64),
    ("hash", np.uint64),
    ("offset", np.int64),
    ("span", np.int64),
    ("length", np.int64),
    ("key_len", np.int64),
    ("gen", np.int64),
    ("writer", np.int64),
    ("check", np.uint64),
    ("digest", np.uint64),
)
SEAL = struct.Struct("<qQqqqqqqQ")
"""What an entry's seal (its `digest` field, XXH3-64 of these bytes) covers: state,
hash, offset, span, length, key_len, gen, writer and check; not the links and the use
bit, which the index and the allocator rebuild."""
LINK_FIELDS = ("prev", "next", "chain", "hot")  # int32 each


class Damaged(Exception):
    """Something read from the region failed its check (a stray or killed writer, a
    memory error): the pool rebuilds what it derives from the entry table, dropping
    the entries that are not sound, and the operation is a miss."""


def round_up(value: int, align: int) -> int:
    """`value` rounded up to a multiple of `align`."""
    return -(-value // align) * align


def data_start(offset: int, key_len: int) -> int:
    """Where an object's bytes start in its span: after its key, on an ALIGN boundary
    (a copy between a misaligned object and an aligned KV cache runs 10-40% slower)."""
    return offset + round_up(key_len, ALIGN)


@dataclass(frozen=True)
class Geometry:
    """Where each part of the region lives, derived from the capacity alone."""

    capacity: int
    entries: int
    buckets: int
    index_offset: int
    bucket_offset: int
    data_offset: int
    total: int

    @classmethod
    def for_capacity(cls, capacity: int, align: int = PAGE) -> Geometry:
        entries = min(MAX_ENTRIES, max(MIN_ENTRIES, capacity // BYTES_PER_ENTRY))
        buckets = 1 << (2 * entries - 1).bit_length()
        index_offset = HEADER_BYTES
        bucket_offset = index_offset + entries * (8 * len(ENTRY_FIELDS) + 4 * len(LINK_FIELDS))
        data_offset = round_up(bucket_offset + 4 * buckets, align)
        return cls(
            capacity,
            entries,
            buckets,
            index_offset,
            bucket_offset,
            data_offset,
            data_offset + round_up(capacity, align),
        )

    @property
    def overhead(self) -> int:
        """Bytes mapped beyond the capacity (header, entry table and hash index)."""
        return self.total - self.capacity


@dataclass(frozen=True)
class Header:
    """What a region's header records, read without attaching to it (`maru pool list`,
    and a tool that opens a pool with the geometry it was created with)."""

    version: int
    ready: bool
    capacity: int
    used: int
    objects: int
    created_ns: int
    creation_id: str


def read_header(fd: int, label: str, window: int = PAGE) -> Header:
    """The header of the maru region open as `fd` (read only), through a mapping of its
    first `window` bytes (a DAX device has no read(), and maps only whole alignments);
    BackendError if it is not a maru region."""
    try:
        with mmap.mmap(fd, window, mmap.MAP_SHARED, mmap.PROT_READ) as first:
            magic = bytes(first[:8])
            words = np.frombuffer(first, np.uint64, (CREATED + 1), 0).copy()
    except (OSError, ValueError) as exc:
        raise BackendError(f"{label} is not a maru pool ({exc})") from None
    if magic != MAGIC:
        raise BackendError(f"{label} is not a maru pool (no maru header)")
    return Header(
        version=int(words[VERSION]),
        ready=bool(words[READY]),
        capacity=int(words[CAPACITY]),
        used=int(words[USED]),
        objects=int(words[OBJECTS]),
        created_ns=int(words[CREATED]),
        creation_id=f"{int(words[ID0]):016x}{int(words[ID1]):016x}",
    )


def check_header(region: mmap.mmap, expected: Geometry, label: str) -> None:
    """Refuse a region of another format or geometry, never reinterpret it."""
    words = np.frombuffer(region, np.uint64, min(len(region), HEADER_BYTES) // 8, 0)
    if bytes(region[:8]) != MAGIC or len(words) <= TOTAL or not words[READY]:
        raise BackendError(f"{label} is not a maru pool (no maru header)")
    if words[VERSION] != FORMAT_VERSION:
        raise BackendError(
            f"{label} has pool format version {words[VERSION]}, this maru reads version "
            f"{FORMAT_VERSION}; destroy it (maru pool destroy) or use the maru that made it"
        )
    found = [int(words[w]) for w in (CAPACITY, ENTRIES, BUCKETS, DATA_OFFSET, TOTAL)]
    wanted = [
        expected.capacity,
        expected.entries,
        expected.buckets,
        expected.data_offset,
        expected.total,
    ]
    if found != wanted or len(region) < expected.total:
        raise ConfigError(
            f"capacity = {expected.capacity}: {label} already exists with capacity {found[0]} "
            "and another geometry; allowed: the capacity it was created with, or destroy it "
            "first (maru pool destroy)"
        )


class Arrays:
    """Numpy views of the entry fields and the buckets, for work on whole tables
    (recovery, batch lookups, audits)."""

    state: np.ndarray
    hash: np.ndarray
    offset: np.ndarray
    span: np.ndarray
    length: np.ndarray
    key_len: np.ndarray
    gen: np.ndarray
    writer: np.ndarray
    check: np.ndarray
    digest: np.ndarray
    prev: np.ndarray
    next: np.ndarray
    chain: np.ndarray
    hot: np.ndarray
    buckets: np.ndarray


class Tables:
    """Views of one mapped region: header words, entry fields, buckets, data.

    Every other part of the pool reads and writes the region through these views,
    so the format is spelled out in this module only. Entry fields and buckets are
    memoryviews here, for one item at a time (a fifth of the cost of a numpy scalar,
    and the allocator touches dozens per call), and numpy arrays in `arrays`.
    """

    state: memoryview
    hash: memoryview
    offset: memoryview
    span: memoryview
    length: memoryview
    key_len: memoryview
    gen: memoryview
    writer: memoryview
    check: memoryview
    digest: memoryview
    prev: memoryview
    next: memoryview
    chain: memoryview
    hot: memoryview
    buckets: memoryview

    def __init__(self, region: mmap.mmap, geometry: Geometry) -> None:
        g = geometry
        self._entries, self._capacity = g.entries, g.capacity
        self.header = np.frombuffer(region, np.uint64, HEADER_BYTES // 8, 0)
        self.words = memoryview(region)[:HEADER_BYTES].cast("Q")
        """The header again, for single words."""
        self.links = memoryview(region)[:HEADER_BYTES].cast("q")
        """The header as signed words: NO_LINK (all ones) reads as NONE (-1)."""
        self.removal_log = self.header[REMOVAL_LOG : REMOVAL_LOG + REMOVAL_LOG_SLOTS]
        self.arrays = Arrays()
        fields = [*ENTRY_FIELDS, *((name, np.int32) for name in LINK_FIELDS)]
        offset = g.index_offset
        for name, dtype in fields:
            self._view(name, np.frombuffer(region, dtype, g.entries, offset))
            offset += np.dtype(dtype).itemsize * g.entries
        self._view("buckets", np.frombuffer(region, np.int32, g.buckets, g.bucket_offset))
        self.data_view = memoryview(region)[g.data_offset : g.data_offset + g.capacity]

    def _view(self, name: str, array: np.ndarray) -> None:
        setattr(self.arrays, name, array)
        setattr(self, name, memoryview(array))

    def get(self, word: int) -> int:
        """A header word."""
        return self.words[word]

    def set(self, word: int, value: int) -> None:
        """Write a header word."""
        self.words[word] = int(value)

    def add(self, word: int, delta: int) -> None:
        """Add to a header word (a counter), modulo 2**64 (a damaged counter stays a
        number)."""
        self.words[word] = (self.words[word] + delta) & NO_LINK

    def link(self, word: int) -> int:
        """A header word that names an entry, or NONE (NO_LINK read as signed)."""
        return self.links[word]

    def set_link(self, word: int, entry: int) -> None:
        """Make a header word name `entry` (or nothing, for NONE)."""
        self.links[word] = entry

    def seal(self, entry: int) -> None:
        """Write the seal of an entry's fields (after every change to them)."""
        self.digest[entry] = self._seal(entry)

    def _seal(self, entry: int) -> int:
        """XXH3-64 of the sealed fields (spelt out: twice as fast as a loop over them)."""
        return xxhash.xxh3_64_intdigest(
            SEAL.pack(
                self.state[entry],
                self.hash[entry],
                self.offset[entry],
                self.span[entry],
                self.length[entry],
                self.key_len[entry],
                self.gen[entry],
                self.writer[entry],
                self.check[entry],
            )
        )

    def sound(self, entry: int) -> bool:
        """Is this an entry of the table, in use, with fields in range and its seal
        matching them?"""
        if not 0 <= entry < self._entries:
            return False
        offset, span, length, key_len = (
            self.offset[entry],
            self.span[entry],
            self.length[entry],
            self.key_len[entry],
        )
        return (
            self.state[entry] in (PENDING, COMMITTED)
            and offset >= 0
            and offset % ALIGN == 0
            and ALIGN <= span <= self._capacity - offset
            and span % ALIGN == 0
            and 0 < key_len <= MAX_KEY_BYTES
            and 0 <= length <= span - round_up(key_len, ALIGN)
            and 0 <= self.writer[entry] >> 48 < WRITER_SLOTS
            and self.digest[entry] == self._seal(entry)
        )

    def entry(self, entry: int) -> int:
        """A link read from the region, checked: an entry of the table, or NONE."""
        if not NONE <= entry < self._entries:
            raise Damaged(f"a link names entry {entry}, the table has {self._entries}")
        return entry

    def key_at(self, entry: int) -> bytes:
        """The key stored at the start of an entry's span."""
        start = int(self.offset[entry])
        return bytes(self.data_view[start : start + int(self.key_len[entry])])

    @property
    def creation_id(self) -> str:
        """Random id written when the region was created."""
        return f"{self.get(ID0):016x}{self.get(ID1):016x}"

    def write_header(self, region: mmap.mmap, geometry: Geometry) -> None:
        """Write the magic, version, geometry and a new creation id (not yet READY)."""
        region[:8] = MAGIC
        for word, value in (
            (VERSION, FORMAT_VERSION),
            (CAPACITY, geometry.capacity),
            (ENTRIES, geometry.entries),
            (BUCKETS, geometry.buckets),
            (DATA_OFFSET, geometry.data_offset),
            (TOTAL, geometry.total),
            (ID0, secrets.randbits(64)),
            (ID1, secrets.randbits(64)),
            (CREATED, time.time_ns()),
        ):
            self.set(word, value)

    def release(self) -> None:
        """Drop every view, so the mapping can be closed."""
        self.data_view.release()
        self.words.release()
        self.links.release()
        for name in ("buckets", *(n for n, _ in ENTRY_FIELDS), *LINK_FIELDS):
            getattr(self, name).release()
            delattr(self, name)
        del self.header, self.arrays, self.removal_log
