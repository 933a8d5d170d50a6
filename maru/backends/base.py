"""The Backend contract every storage backend honours.

Semantics, for every backend:

- Keys are bytes (a str is UTF-8 encoded), 1 to `MAX_KEY_BYTES` long.
- First writer wins: `put` or `reserve` of a key that is stored, or being
  written by someone else, stores nothing (`False` / `None`).
- A reservation is invisible until committed; an exception inside the `with`
  block aborts it and releases its space.
- A full store evicts least-recently-used objects instead of failing; an
  object larger than the whole store raises `ObjectTooLargeError`.
- A miss is `None`/`False`; a broken backend raises `BackendError`.
- `get_into` with a buffer smaller than the object raises
  `BufferTooSmallError` and copies nothing.
- Every removal of a committed object (eviction, delete) is logged where the
  backend can keep a log: `removed_since` hands out the `key_digest`s of the
  objects removed since a cursor, so a reader learns of evictions by any
  process without scanning the store.
- `view` reads a committed object without copying it where the backend keeps
  objects in memory it can expose (`zero_copy`: shm, cxl); the reader checks
  `ReadView.valid()` after reading, because an evicted object's memory is
  reused. Other backends (network stores, most plugins) hand over a private
  copy, always valid.

Declared capabilities (class attributes; a store may set its own, as the tiered
backend does from its tiers), so that callers and the contract tests ask the
backend instead of knowing backend names:

- `medium`: where a store's bytes live: "host" (this machine's memory), "disk"
  (local storage) or "remote" (another machine); the default is "remote", so a
  backend that says nothing never claims host memory.
- `zero_copy`: views and reservations point into `host_memory()`.
- `removal_log`: `removed_since` names removals (else its digests are None).
- `lists_keys`: `keys` and `delete_prefix` work (else UnsupportedOperationError).
- `wraps`: the store is one fixed region, mapped when it is created, that writes
  go round and reuse (evicting) once full, so a fresh store's first pass differs
  from its steady state.

Batch operations, `get_many_into` and `put_many`: many objects in one call, one round
trip per server where the backend can (Redis); their defaults loop over `get_into` and
`put`. A key whose part of the store failed is a miss (None / False) where the backend
can tell that part from the rest (a cluster's nodes), and `BackendError` otherwise.

Optional operations, for tools (`maru pool`, `maru bench`): `open_existing`,
`destroy`, `clear`, `info`, `populate`, `private_options` and `label`. Their
defaults either do the plain thing (`open_existing` just opens, `private_options`
says "no private store", `label` names the backend) or raise
`UnsupportedOperationError` naming the backend and the operation.

Subclasses implement the underscored primitives; this class validates keys and
buffers once, so every backend treats bad input the same way.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

import xxhash
from pydantic import BaseModel

from maru.backends.buffers import MAX_KEY_BYTES, Key, byte_view, normalize_key
from maru.backends.node import FoundStore
from maru.errors import (
    BackendError,
    BufferTooSmallError,
    UnsupportedOperationError,
)

Medium = Literal["host", "disk", "remote"]
"""Where a store's bytes live: this machine's memory, its local storage, or another machine."""
MEDIA: tuple[Medium, ...] = ("host", "disk", "remote")


def key_digest(key: bytes) -> int:
    """The key's 64-bit digest (XXH3) as removal logs hold it, the same in every process."""
    return xxhash.xxh3_64_intdigest(key)


class Removals(NamedTuple):
    """What `Backend.removed_since` saw: the cursor to pass next, and the digests of the
    objects removed since the cursor given, oldest first; `digests` is None when the store
    cannot say (it keeps no log, or more was removed than its log holds): the reader then
    checks the keys it cares about with `contains`."""

    cursor: int
    digests: list[int] | None


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's counters."""

    capacity: int
    used: int
    objects: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    reclaimed: int = 0
    dropped: int = 0
    """Copies into a lower tier not written because it could not keep up (tiered:
    dropped from a full queue, or still queued when the store closed), counted by this
    process."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for JSON and logs)."""
        return asdict(self)


class Hashing(Protocol):
    """Takes the bytes a reader copies, in order (`ReadView.hasher`)."""

    def update(self, data: Any) -> None: ...

    def copy_rows(self, dst: int, dst_stride: int, src: int, row_bytes: int, rows: int) -> None:
        """Copy `rows` consecutive rows of `row_bytes` bytes at address `src` to rows
        `dst_stride` apart from address `dst`, and take them as the next bytes."""


class ReadView:
    """A committed object's bytes, read in place or from a private copy.

    Bytes read in place count only if `valid()` is True after reading them: the
    object may have been evicted, and its memory reused, meanwhile. Where the store
    checks what is read against a checksum, `valid()` hashes `data` again; a reader
    that copies the bytes can feed them, in order, to `hasher()` as it copies them
    (while they are in its CPU's caches) and hand that to `valid` instead.
    """

    __slots__ = ("_hasher", "_valid", "data")

    def __init__(
        self,
        data: memoryview,
        valid: Callable[..., bool] | None = None,
        hasher: Callable[[], Hashing] | None = None,
    ) -> None:
        self.data = data
        """The object's bytes (read-only)."""
        self._valid = valid
        """Called without arguments, or with a fed `hasher()` where there is one."""
        self._hasher = hasher

    def hasher(self) -> Hashing | None:
        """A new hasher for `valid`, or None where `valid()` reads no bytes."""
        return None if self._hasher is None else self._hasher()

    def valid(self, hashed: Hashing | None = None) -> bool:
        """Were `data` the committed object's bytes throughout, up to now, and do they
        match their checksum where the store keeps one? `hashed` is this view's
        `hasher()` fed `data`; fed less than all of it, `data` is hashed again."""
        if self._valid is None:
            return True
        return self._valid() if hashed is None else self._valid(hashed)


class Backend(ABC):
    """A key-value store for opaque byte objects. See the module docstring."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]]
    description: ClassVar[str] = ""
    medium: Medium = "remote"
    """Where the store's bytes live: "host" (this machine's memory), "disk" (local
    storage) or "remote" (another machine). The vLLM connector reads it on an open
    store; the default never wrongly claims host memory."""
    zero_copy: ClassVar[bool] = False
    """`view` reads objects in place and `reserve` writes them in place, in the memory
    `host_memory()` returns; False: one copy through a private buffer each way."""
    removal_log: bool = False
    """`removed_since` names the removed objects (until its log overflows); False: its
    digests are always None, and readers check their keys with `contains`."""
    lists_keys: bool = False
    """`keys` and `delete_prefix` work; False: they raise UnsupportedOperationError."""
    wraps: ClassVar[bool] = False
    """The store is one fixed region, mapped when it is created, that writes go round
    and reuse (evicting) once it is full: `maru bench` measures it after it has wrapped,
    and on a fresh store's first pass."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.options = config.backend_options(self.name)
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def describe(cls, options: BaseModel) -> str:
        """What a store with these options is, in a few words (`maru info`)."""
        return cls.description

    # --- optional operations, for tools (`maru pool`, `maru bench`) ----------

    @classmethod
    def open_existing(cls, config: Any) -> Backend:
        """The configured store, without creating one that does not exist (for tools
        that inspect a store); the default just opens it."""
        return cls(config)

    @classmethod
    def find_stores(cls, config: Any) -> list[FoundStore]:
        """This backend's stores on this node, the configured ones and any others it
        can find (`maru pool list|gc`). The default: none (a store in the process or
        on other machines)."""
        return []

    @classmethod
    def private_options(cls, tag: str, prefault: bool) -> dict[str, Any] | None:
        """The options section of a private, throwaway store named by `tag`, populated
        when opened if `prefault`, so that `maru bench` and `maru demo` never touch a
        serving store.
        The default, None: there is no private store, and the benchmark measures the
        configured one under a namespace of its own and deletes what it wrote."""
        return None

    @property
    def label(self) -> str:
        """The store in a few words, for messages (e.g. "shm pool 'default' (...)")."""
        return f"{self.name} store"

    def destroy(self) -> None:
        """Remove the store itself, not just its objects (`maru pool destroy`)."""
        raise self.unsupported("destroy", "remove its store")

    def clear(self) -> int:
        """Remove every object; how many were removed (`maru pool clear`)."""
        raise self.unsupported("clear", "remove all its objects")

    def info(self) -> dict[str, Any]:
        """Details beyond `stats()`, for `maru pool stats`; at least "label", and
        "entries" (an int) where the store holds at most that many objects at once (a
        fixed table of them, as a pool's), by which `maru bench` sizes its working set."""
        raise self.unsupported("info", "report details of its store")

    def populate(self, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Wait until a new store's memory is populated, calling `progress(done, total)`
        in bytes meanwhile; what the memory got (`maru pool create`)."""
        raise self.unsupported("populate", "populate its memory")

    def unsupported(self, operation: str, what: str) -> UnsupportedOperationError:
        """The error for an optional operation this backend does not offer."""
        return UnsupportedOperationError(
            f"the {self.name} backend does not support {operation}(): it cannot {what}"
        )

    def put(self, key: Key, data: Any) -> bool:
        """Store `data` under `key`; False if the key exists or there is no room."""
        return self._put(self._open_key(key), byte_view(data))

    @contextmanager
    def reserve(self, key: Key, nbytes: int) -> Iterator[memoryview | None]:
        """Yield a writable buffer of `nbytes` in the store, committed on exit.

        Yields None if the key is stored or being written by someone else.
        An exception inside the block aborts the write and frees the space.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        reservation = self._begin(self._open_key(key), nbytes)
        if reservation is None:
            yield None
            return
        handle, buffer = reservation
        try:
            yield buffer
        except BaseException:
            self._abort(handle)
            raise
        self._commit(handle)

    def get(self, key: Key) -> bytes | None:
        """The object stored under `key`, or None."""
        return self._get(self._open_key(key))

    def get_into(self, key: Key, out: Any) -> int | None:
        """Copy the object into `out` (any writable buffer); its size, or None on a miss.

        If `out` is too small, raises BufferTooSmallError and copies nothing.
        """
        return self._get_into(self._open_key(key), byte_view(out, writable=True))

    def get_many_into(self, keys: Sequence[Key], outs: Sequence[Any]) -> list[int | None]:
        """Copy each key's object into its buffer in `outs`: one size per key, None for a
        miss (or a failed part of the store: see the module docstring). A buffer too
        small for its object raises BufferTooSmallError and gets nothing (the others may
        have been filled)."""
        self._check_open()
        if len(outs) != len(keys):
            raise ValueError(
                f"outs holds {len(outs)} buffers for {len(keys)} keys; allowed: one per key"
            )
        return self._get_many_into(
            [normalize_key(key) for key in keys], [byte_view(out, writable=True) for out in outs]
        )

    def fetch_many(self, keys: Sequence[Key], sizes: Sequence[int]) -> list[ReadView | None]:
        """Each key's object (of at most its `sizes` bytes) read for a copy that follows,
        as a view (None: a miss): what a background load reads. The store picks the
        memory: private buffers here; a tiered store its first tier's, promoting what it
        finds below in place. A buffer too small raises as `get_many_into` does."""
        self._check_open()
        if len(sizes) != len(keys):
            raise ValueError(f"{len(sizes)} sizes for {len(keys)} keys; allowed: one per key")
        return self._fetch_many([normalize_key(key) for key in keys], list(sizes))

    def put_many(self, items: Sequence[tuple[Key, Any]]) -> list[bool]:
        """`put` each (key, data), in order: one answer per item, False where the key was
        taken (by an earlier item too), there was no room, or its part of the store failed."""
        self._check_open()
        return self._put_many([(normalize_key(key), byte_view(data)) for key, data in items])

    def view(self, key: Key) -> ReadView | None:
        """The object's bytes without a copy where `zero_copy`; None on a miss."""
        return self._view(self._open_key(key))

    def peek(self, key: Key) -> ReadView | None:
        """`view`, not counted as a use of the object (no hit or miss, no recency): what
        copies of an object into another tier read. The default is `view`."""
        return self._peek(self._open_key(key))

    def host_memory(self) -> memoryview | None:
        """The memory views and reservations point into (for page-locking it with a
        device runtime once), or None where objects go through private copies."""
        return None

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """One answer per key, in order."""
        self._check_open()
        return self._contains(
            [
                key if type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES else normalize_key(key)
                for key in keys
            ]
        )

    def delete(self, key: Key) -> bool:
        """Remove a committed object; False if there was none."""
        return self._delete(self._open_key(key))

    def keys(self, prefix: bytes = b"") -> list[bytes]:
        """The keys of the committed objects that start with `prefix` (a scan: for tools
        and start-up checks, not for hot paths)."""
        self._check_open()
        return self._keys(bytes(prefix))

    def delete_prefix(self, prefix: bytes) -> int:
        """Remove every committed object whose key starts with `prefix` (e.g. one model's
        or tenant's namespace); how many were removed."""
        self._check_open()
        return self._delete_prefix(bytes(prefix))

    def removed_since(self, cursor: int | None) -> Removals:
        """The objects removed (evicted or deleted, by any process) since `cursor`; None
        starts from now. Cheap enough to call on every engine step."""
        self._check_open()
        return self._removed_since(cursor)

    def stats(self) -> StoreStats:
        """The store's counters."""
        self._check_open()
        return self._stats()

    def close(self) -> None:
        """Release the store's resources; later calls raise BackendError."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open_key(self, key: Key) -> bytes:
        self._check_open()
        return normalize_key(key)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"{self.name} store is closed")

    def _put(self, key: bytes, data: memoryview) -> bool:
        reservation = self._begin(key, data.nbytes)
        if reservation is None:
            return False
        handle, buffer = reservation
        try:
            buffer[:] = data
        except BaseException:
            self._abort(handle)
            raise
        self._commit(handle)
        return True

    @staticmethod
    def too_small(key: bytes, size: int, room: int) -> BufferTooSmallError:
        """The error for an output buffer of `room` bytes that cannot hold the object."""
        return BufferTooSmallError(
            f"output buffer holds {room} bytes but object {key!r} is {size} bytes"
        )

    @abstractmethod
    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        """Reserve space: (handle, writable buffer), or None if the key is taken."""

    @abstractmethod
    def _commit(self, handle: Any) -> None:
        """Make a reserved object visible."""

    @abstractmethod
    def _abort(self, handle: Any) -> None:
        """Drop a reservation and free its space."""

    @abstractmethod
    def _get(self, key: bytes) -> bytes | None: ...

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        """Default: `_get`, then one copy; backends that can read in place override it."""
        data = self._get(key)
        return None if data is None else self.copy_out(key, data, out)

    def _get_many_into(self, keys: list[bytes], outs: list[memoryview]) -> list[int | None]:
        """Default: `_get_into` each; backends that batch round trips override it."""
        return [self._get_into(key, out) for key, out in zip(keys, outs, strict=True)]

    def _fetch_many(self, keys: list[bytes], sizes: list[int]) -> list[ReadView | None]:
        """Default: one `_get_many_into` into private buffers of `sizes`."""
        buffers = [bytearray(size) for size in sizes]
        got = self._get_many_into(keys, [memoryview(buffer) for buffer in buffers])
        return [
            None if size is None else ReadView(memoryview(buffer)[:size].toreadonly())
            for buffer, size in zip(buffers, got, strict=True)
        ]

    def _put_many(self, items: list[tuple[bytes, memoryview]]) -> list[bool]:
        """Default: `_put` each; backends that batch round trips override it."""
        return [self._put(key, data) for key, data in items]

    def _view(self, key: bytes) -> ReadView | None:
        """Default: a private copy (backends with `zero_copy` read in place)."""
        data = self._get(key)
        return None if data is None else ReadView(memoryview(data).toreadonly())

    def _peek(self, key: bytes) -> ReadView | None:
        """Default: `_view` (backends that count uses override it)."""
        return self._view(key)

    def copy_out(self, key: bytes, data: Any, out: memoryview) -> int:
        """Copy an object into `out`, or raise the too-small error and copy nothing."""
        size = len(data)
        if size > out.nbytes:
            raise self.too_small(key, size, out.nbytes)
        out[:size] = data
        return size

    @abstractmethod
    def _contains(self, keys: list[bytes]) -> list[bool]: ...

    @abstractmethod
    def _delete(self, key: bytes) -> bool: ...

    def _keys(self, prefix: bytes) -> list[bytes]:
        """Backends that can list their keys (`lists_keys`) override this."""
        raise self.unsupported("keys", "list its keys")

    def _delete_prefix(self, prefix: bytes) -> int:
        """Backends that can list their keys (`lists_keys`) override this."""
        raise self.unsupported("delete_prefix", "delete objects by key prefix")

    def _removed_since(self, cursor: int | None) -> Removals:
        """Backends that keep a removal log (`removal_log`) override this."""
        return Removals(0, None)

    @abstractmethod
    def _stats(self) -> StoreStats: ...

    @abstractmethod
    def _close(self) -> None: ...
