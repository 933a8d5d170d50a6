"""Tiers: several backends in order, the cheapest first (e.g. shm, then a local disk,
then Redis).

A save lands in the first tier, in the caller; its copies into the tiers below are
written in the background (`maru.backends._tiered.copier`: a bounded queue per tier
that drops rather than blocks), so an object evicted from memory stays below. A read
is served by the first tier that has the object; one found below is promoted into the
tiers above (into the first in the background where it can hand over a private
copy). `contains` asks a lower tier only about the keys the tiers above lack, one
batch per tier. A tier that fails counts as a miss for that call, so a failing lower
tier never breaks the tiers above it; only when every tier fails is the call a
`BackendError`. A lower tier whose settings are refused (a `ConfigError`: credentials a
server refuses, a TLS file that is missing), at open or later, is turned off with one
error naming it, and the store goes on with the tiers above; the first tier's are the
store's own. A tier that cannot do an operation at all
(`UnsupportedOperationError`, e.g. listing keys) is left out of it; only when no tier
can is the call unsupported. The store's bytes live where its first tier's do
(`medium`, `zero_copy`, `host_memory`). Closing the store writes the queued copies for
up to `close_wait` seconds, counts those still queued as dropped, and stops and joins
the copiers' threads before it closes the tiers: nothing of the store runs after
`close()` returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, ClassVar

from pydantic import Field, field_validator

from maru.backends._tiered.copier import Copier
from maru.backends._tiered.reservation import Reservation
from maru.backends.base import MEDIA, Backend, Key, Medium, ReadView, StoreStats
from maru.backends.registry import backend_class
from maru.config import Options
from maru.errors import BackendError, ConfigError, UnsupportedOperationError
from maru.hookspecs import hookimpl
from maru.log import get_logger

log = get_logger(__name__)
FAILED = object()
"""What `_attempt` returns for a tier that failed."""
UNSUPPORTED = object()
"""What `_attempt` returns for a tier that cannot do the operation at all."""


class TieredOptions(Options):
    """The `tiered:` config section; each tier is configured by its own section."""

    tiers: list[str] = Field(
        ["shm", "redis"],
        min_length=2,
        description="backend names, the cheapest (tried first) first",
    )

    write_queue: int = Field(
        256,
        ge=0,
        le=1_000_000,
        description="copies waiting to be written into each lower tier in the background; "
        "when full, a copy is dropped (counted) rather than the save waiting; 0: write "
        "copies in the caller",
    )
    close_wait: float = Field(
        10.0,
        ge=0,
        description="seconds closing the store waits for queued copies; those still "
        "queued then are dropped (counted)",
    )

    @field_validator("tiers")
    @classmethod
    def _distinct_and_not_nested(cls, tiers: list[str]) -> list[str]:
        if "tiered" in tiers:
            raise ValueError("a tier cannot itself be 'tiered'")
        if len(set(tiers)) != len(tiers):
            raise ValueError(f"each backend may appear once, got {tiers}")
        return tiers


class TieredBackend(Backend):
    """Backends composed in order; see the module docstring."""

    name: ClassVar[str] = "tiered"
    Options = TieredOptions
    description: ClassVar[str] = "several backends in order, e.g. shm in front of redis"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.tiers: list[Backend] = []
        self._refused: set[Backend] = set()
        """The tiers turned off because their settings were refused."""
        try:
            for position, name in enumerate(self.options.tiers):
                self._open_tier(position, name, config)
        except BaseException:
            self._close()
            raise
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        top = self.tiers[0]
        self.copiers = [
            Copier(top, tier, self.options.write_queue, refused=self._refuse) for tier in self.tiers
        ]
        """One per tier: the copies written into it in the background."""
        self.medium = top.medium
        self.zero_copy = top.zero_copy
        self.lists_keys = any(tier.lists_keys for tier in self.tiers)

    @classmethod
    def describe(cls, options: Any) -> str:
        return " in front of ".join(options.tiers)

    def _open_tier(self, position: int, name: str, config: Any) -> None:
        """Open a tier; a lower one whose settings are refused is left out (`_refuse`)."""
        try:
            self.tiers.append(backend_class(name)(config))
        except ConfigError as exc:
            if position == 0:
                raise
            log.error("maru tier %s turned off, its settings were refused: %s", name, exc)

    def _refuse(self, tier: Backend, exc: ConfigError) -> None:
        """Turn off a lower tier whose settings were refused (once, with one error)."""
        if tier is self.tiers[0]:
            raise exc
        if tier not in self._refused:
            self._refused.add(tier)
            log.error("maru tier %s turned off, its settings were refused: %s", tier.name, exc)

    def _attempt(
        self, tier: Backend, call: Callable[[Backend], Any], what: str, optional: bool = False
    ) -> Any:
        """`call(tier)`, or FAILED if the tier fails: for this call, a miss (logged). A
        tier that cannot do an `optional` operation at all gives UNSUPPORTED."""
        if tier in self._refused:
            return FAILED
        try:
            return call(tier)
        except UnsupportedOperationError:
            if optional:
                return UNSUPPORTED
            raise
        except ConfigError as exc:
            self._refuse(tier, exc)
            return FAILED
        except BackendError as exc:
            log.warning("maru tier %s failed to %s, treated as a miss: %s", tier.name, what, exc)
            return FAILED

    def host_memory(self) -> memoryview | None:
        return self.tiers[0].host_memory()

    @property
    def promotes_into_shared_memory(self) -> bool:
        """Does `fetch_many` promote what lower tiers hold into memory that every process
        on the node maps (a shm or cxl first tier), where they all can read it?"""
        return self.tiers[0].zero_copy

    def media(self, keys: list[Key]) -> list[Medium]:
        """Per key, where a read of it goes: the first tier's medium where the first tier
        holds it, else the slowest medium below. Asks the first tier only, so answering
        costs no trip to a lower tier (the vLLM connector reads slow tiers in the
        background)."""
        held = self._attempt(self.tiers[0], lambda t: t.contains(keys), "look up")
        below = max((tier.medium for tier in self.tiers), key=MEDIA.index)
        if held is FAILED:
            return [below] * len(keys)
        return [self.medium if present else below for present in held]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued copy is written into its tier; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(
            copier.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for copier in self.copiers
        )

    def info(self) -> dict[str, Any]:
        """Each tier's counters, and what became of the copies queued for it; the first
        tier's "entries" where it has a fixed table of them (`Backend.info`)."""
        details = {
            "label": self.label,
            "tiers": {
                tier.name: {**self._tier_stats(tier), "copies": dict(copier.counts)}
                for tier, copier in zip(self.tiers, self.copiers, strict=True)
            },
        }
        entries = self._first_tier_entries()
        return details if entries is None else details | {"entries": entries}

    def _first_tier_entries(self) -> int | None:
        """The first tier's `info()["entries"]`, or None where it gives none."""
        try:
            return self.tiers[0].info().get("entries")
        except (UnsupportedOperationError, BackendError):
            return None

    def _tier_stats(self, tier: Backend) -> dict[str, int]:
        found = self._attempt(tier, lambda t: t.stats().as_dict(), "report its counters")
        return {} if found is FAILED else found

    def _put(self, key: bytes, data: memoryview) -> bool:
        """The first tier decides (first writer wins) and the rest get copies in the
        background; if it fails, the first tier below that answers decides, in the
        caller, and the tiers below that get copies of the bytes (the caller's buffer is
        the caller's again once this returns)."""
        stored = self._attempt(self.tiers[0], lambda t: t.put(key, data), "store")
        if stored is not FAILED:
            if stored:
                self._copy_below(key)
            return stored
        for index, tier in enumerate(self.tiers[1:], start=1):
            stored = self._attempt(tier, lambda t: t.put(key, data), "store")
            if stored is not FAILED:
                if stored:
                    self._store_in(range(index + 1, len(self.tiers)), key, bytes(data))
                return stored
        raise BackendError("every tier failed to put")

    def _copy_below(self, key: bytes) -> None:
        """Queue copies of the first tier's object `key` for every tier below it."""
        for copier in self.copiers[1:]:
            copier.submit(key)

    def _store_in(self, tiers: range, key: bytes, data: Any) -> None:
        """Copies, carrying their bytes, for the tiers at these positions."""
        for index in tiers:
            self.copiers[index].submit(key, data)

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        stack = ExitStack()
        try:
            buffer = stack.enter_context(self.tiers[0].reserve(key, nbytes))
        except BackendError as exc:
            log.warning(
                "maru tier %s failed to reserve, buffering locally: %s", self.tiers[0].name, exc
            )
            stack.close()
            buffer, stack = memoryview(bytearray(nbytes)), None
        if buffer is None:
            stack.close()
            return None
        return (key, buffer, stack), buffer

    def _commit(self, handle: tuple[bytes, memoryview, ExitStack | None]) -> None:
        key, buffer, stack = handle
        if stack is None:
            self._store_in(range(1, len(self.tiers)), key, buffer)
            return
        stack.close()
        self._copy_below(key)

    def _abort(self, handle: tuple[bytes, memoryview, ExitStack | None]) -> None:
        stack = handle[2]
        if stack is not None:
            aborted = RuntimeError("reservation aborted")
            stack.__exit__(RuntimeError, aborted, None)

    def _read(self, read: Callable[[Backend], Any]) -> tuple[int, Any]:
        """(index of the first tier that has it, what it returned), or (-1, None)."""
        answers = []
        for index, tier in enumerate(self.tiers):
            found = self._attempt(tier, read, "read")
            if found is not FAILED and found is not None:
                self._count(hit=True)
                return index, found
            answers.append(found)
        if all(answer is FAILED for answer in answers):
            raise BackendError("every tier failed to read")
        self._count(hit=False)
        return -1, None

    def _get(self, key: bytes) -> bytes | None:
        index, data = self._read(lambda tier: tier.get(key))
        if index > 0:
            self._store_in(range(index), key, data)
        return data

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        """A hit below is promoted into the first tier in the caller (the caller reuses
        `out`), and into the tiers between in the background."""
        index, size = self._read(lambda tier: tier.get_into(key, out))
        if index > 0:
            self._promote(key, out[:size], index)
        return size

    def _get_many_into(self, keys: list[bytes], outs: list[memoryview]) -> list[int | None]:
        """One batched read per tier, of the keys the tiers above lacked (one round trip
        per Redis node for a lower Redis tier); hits below are promoted as by `get_into`."""
        sizes, found_in = self._read_many(keys, outs, first=0)
        for key, out, size, index in zip(keys, outs, sizes, found_in, strict=True):
            if size is not None and index > 0:
                self._promote(key, out[:size], index)
        self._count_many(sizes)
        return sizes

    def _count_many(self, answers: list[Any]) -> None:
        """Count each answer as a hit, or a miss where it is None."""
        hits = sum(answer is not None for answer in answers)
        with self._lock:
            self._hits += hits
            self._misses += len(answers) - hits

    def _read_many(
        self, keys: list[bytes], outs: list[memoryview], first: int
    ) -> tuple[list[int | None], list[int]]:
        """Each object read into its buffer from the first tier from `first` on that has
        it, one batch per tier: sizes (None: a miss) and the tiers they came from. Only
        when every tier fails is it an error (from a lower tier on, a miss)."""
        sizes: list[int | None] = [None] * len(keys)
        found_in = [-1] * len(keys)
        missing, failures = list(range(len(keys))), 0
        for index in range(first, len(self.tiers)):
            if not missing:
                break
            asked = [keys[i] for i in missing], [outs[i] for i in missing]
            got = self._attempt(
                self.tiers[index], lambda t, asked=asked: t.get_many_into(*asked), "read"
            )
            if got is FAILED:
                failures += 1
                continue
            for position, size in zip(missing, got, strict=True):
                sizes[position], found_in[position] = size, index
            missing = [position for position in missing if sizes[position] is None]
        if failures == len(self.tiers):
            raise BackendError("every tier failed to read")
        return sizes, found_in

    def _fetch_many(self, keys: list[bytes], sizes: list[int]) -> list[ReadView | None]:
        """Objects the first tier holds are its views; those found below are read straight
        into reservations in the first tier (their promotion, which then costs no copy)
        and viewed there; where there is no reservation (no room, the key being written)
        or an object's size is not the one reserved, into a private buffer."""
        first = self.tiers[0]
        views = self._attempt(first, lambda t: [t.view(key) for key in keys], "read")
        if not first.zero_copy or views is FAILED:
            return super()._fetch_many(keys, sizes)
        for key, view, size in zip(keys, views, sizes, strict=True):
            if view is not None and view.data.nbytes > size:
                raise self.too_small(key, view.data.nbytes, size)
        missing = [i for i, view in enumerate(views) if view is None]
        with ExitStack() as stack:
            reserved = {i: Reservation(first, keys[i], sizes[i]) for i in missing}
            for reservation in reserved.values():
                stack.callback(reservation.end, commit=False)  # unless committed first
            outs = [reserved[i].buffer for i in missing]
            got, found_in = self._read_many([keys[i] for i in missing], outs, first=1)
            for i, size, index in zip(missing, got, found_in, strict=True):
                views[i] = self._fetched(keys[i], reserved[i], size, index)
        self._count_many(views)
        return views

    def _fetched(
        self, key: bytes, reservation: Reservation, size: int | None, found_in: int
    ) -> ReadView | None:
        """The view of an object read into its reservation: the first tier's once
        committed, else a private copy (None: a miss)."""
        if reservation.held and size == reservation.buffer.nbytes:
            reservation.end(commit=True)
            for copier in self.copiers[1:found_in]:
                copier.submit(key)
            return self.tiers[0].view(key)
        data = None if size is None else bytes(reservation.buffer[:size])
        reservation.end(commit=False)
        return None if data is None else ReadView(memoryview(data))

    def _put_many(self, items: list[tuple[bytes, memoryview]]) -> list[bool]:
        """One batched put into the first tier, copies below in the background; if the
        first tier fails, each item as `put` (the first tier below that answers)."""
        stored = self._attempt(self.tiers[0], lambda t: t.put_many(items), "store")
        if stored is FAILED:
            return [self._put(key, data) for key, data in items]
        for (key, _), taken in zip(items, stored, strict=True):
            if taken:
                self._copy_below(key)
        return stored

    def _view(self, key: bytes) -> ReadView | None:
        """The first tier's view where it has the object; a private copy from below is
        promoted in the background, one that may change (another zero-copy tier's)
        in the caller."""
        index, view = self._read(lambda tier: tier.view(key))
        if index > 0:
            if self.tiers[index].zero_copy:
                self._promote(key, view.data, index)
            else:
                self._store_in(range(index), key, view.data)
        return view

    def _promote(self, key: bytes, data: memoryview, found_in: int) -> None:
        """Copy an object found in tier `found_in` into the first tier now, and into the
        tiers between in the background."""
        if self._attempt(self.tiers[0], lambda t: t.put(key, data), "store a copy") is True:
            for copier in self.copiers[1:found_in]:
                copier.submit(key)

    def _contains(self, keys: list[bytes]) -> list[bool]:
        answers = [False] * len(keys)
        missing = list(range(len(keys)))
        failures = 0
        for tier in self.tiers:
            if not missing:
                break
            asked = [keys[i] for i in missing]
            found = self._attempt(tier, lambda t, asked=asked: t.contains(asked), "look up")
            if found is FAILED:
                failures += 1
                continue
            for index, present in zip(missing, found, strict=True):
                answers[index] = present
            missing = [i for i, present in zip(missing, found, strict=True) if not present]
        if failures == len(self.tiers):
            raise BackendError("every tier failed a lookup")
        return answers

    def _delete(self, key: bytes) -> bool:
        self.flush(self.options.close_wait)
        answers = [self._attempt(tier, lambda t: t.delete(key), "delete") for tier in self.tiers]
        if all(answer is FAILED for answer in answers):
            raise BackendError("every tier failed to delete")
        return any(answer is True for answer in answers)

    def _keys(self, prefix: bytes) -> list[bytes]:
        self.flush(self.options.close_wait)
        answers = self._answers(lambda t: t.keys(prefix), "list its keys", "keys")
        return sorted({key for answer in answers for key in answer})

    def _delete_prefix(self, prefix: bytes) -> int:
        self.flush(self.options.close_wait)
        answers = self._answers(
            lambda t: t.delete_prefix(prefix), "delete by prefix", "delete_prefix"
        )
        return max(answers)

    def _answers(self, call: Callable[[Backend], Any], what: str, operation: str) -> list[Any]:
        """What every tier that can do an optional operation answered: an
        UnsupportedOperationError if no tier can, a BackendError if all that can failed."""
        answers = [self._attempt(tier, call, what, optional=True) for tier in self.tiers]
        able = [answer for answer in answers if answer is not UNSUPPORTED]
        if not able:
            raise self.unsupported(
                operation,
                f"{what}: none of its tiers ({', '.join(t.name for t in self.tiers)}) can",
            )
        answered = [answer for answer in able if answer is not FAILED]
        if not answered:
            raise BackendError(f"every tier failed to {what}")
        return answered

    def _count(self, *, hit: bool) -> None:
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    def _stats(self) -> StoreStats:
        """The first tier's space and evictions; hits and misses of the tiers together,
        and the copies dropped for every tier."""
        top = self.tiers[0].stats()
        with self._lock:
            hits, misses = self._hits, self._misses
        dropped = sum(copier.counts["dropped"] for copier in self.copiers)
        return StoreStats(
            top.capacity, top.used, top.objects, hits, misses, top.evictions, top.reclaimed, dropped
        )

    def _close(self) -> None:
        """Write the queued copies (for up to `close_wait` seconds; the rest are dropped,
        counted), stop the copiers' threads, then close the tiers."""
        deadline = time.monotonic() + self.options.close_wait
        for copier in getattr(self, "copiers", []):
            copier.close(max(0.0, deadline - time.monotonic()))
        for tier in self.tiers:
            tier.close()


@hookimpl
def maru_backends() -> list[type[Backend]]:
    return [TieredBackend]
