"""Tiers: several backends in order, the cheapest first (e.g. shm on this node, then Redis).

A put goes to every tier; a read is served by the first tier that has the
object and copies it into the tiers above; `contains` asks a lower tier only
about the keys the tiers above lack. A tier that fails counts as a miss for
that call, so a failing lower tier never breaks the tiers above it; only when
every tier fails is the call a `BackendError`. A tier that cannot do an operation
at all (`UnsupportedOperationError`, e.g. listing keys) is left out of it; only
when no tier can is the call unsupported. The store's bytes live where its first
tier's do (`medium`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, ClassVar

from pydantic import Field, field_validator

from maru.backends.base import Backend, StoreStats
from maru.backends.registry import backend_class
from maru.config import Options
from maru.errors import BackendError, UnsupportedOperationError
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
        try:
            for tier in self.options.tiers:
                self.tiers.append(backend_class(tier)(config))
        except BaseException:
            self._close()
            raise
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self.medium = self.tiers[0].medium
        self.lists_keys = any(tier.lists_keys for tier in self.tiers)

    @classmethod
    def describe(cls, options: Any) -> str:
        return " in front of ".join(options.tiers)

    @staticmethod
    def _attempt(
        tier: Backend, call: Callable[[Backend], Any], what: str, optional: bool = False
    ) -> Any:
        """`call(tier)`, or FAILED if the tier fails: for this call, a miss (logged). A
        tier that cannot do an `optional` operation at all gives UNSUPPORTED."""
        try:
            return call(tier)
        except UnsupportedOperationError:
            if optional:
                return UNSUPPORTED
            raise
        except BackendError as exc:
            log.warning("maru tier %s failed to %s, treated as a miss: %s", tier.name, what, exc)
            return FAILED

    def _put(self, key: bytes, data: memoryview) -> bool:
        """The first tier that answers decides (first writer wins); the rest get copies."""
        for index, tier in enumerate(self.tiers):
            stored = self._attempt(tier, lambda t: t.put(key, data), "store")
            if stored is not FAILED:
                if stored:
                    self._store_in(self.tiers[index + 1 :], key, data)
                return stored
        raise BackendError("every tier failed to put")

    def _store_in(self, tiers: list[Backend], key: bytes, data: Any) -> None:
        """Copies for other tiers: one that fails only loses its copy."""
        for tier in tiers:
            self._attempt(tier, lambda t: t.put(key, data), "store a copy")

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
        self._store_in(self.tiers[1:], key, buffer)
        if stack is not None:
            stack.close()

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
            self._store_in(self.tiers[:index], key, data)
        return data

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        index, size = self._read(lambda tier: tier.get_into(key, out))
        if index > 0:
            self._store_in(self.tiers[:index], key, out[:size])
        return size

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
        answers = [self._attempt(tier, lambda t: t.delete(key), "delete") for tier in self.tiers]
        if all(answer is FAILED for answer in answers):
            raise BackendError("every tier failed to delete")
        return any(answer is True for answer in answers)

    def _keys(self, prefix: bytes) -> list[bytes]:
        answers = self._answers(lambda t: t.keys(prefix), "list its keys", "keys")
        return sorted({key for answer in answers for key in answer})

    def _delete_prefix(self, prefix: bytes) -> int:
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
        """The first tier's space and evictions; hits and misses of the tiers together."""
        top = self.tiers[0].stats()
        with self._lock:
            return StoreStats(
                top.capacity,
                top.used,
                top.objects,
                self._hits,
                self._misses,
                top.evictions,
                top.reclaimed,
            )

    def _close(self) -> None:
        for tier in self.tiers:
            tier.close()


@hookimpl
def maru_backends() -> list[type[Backend]]:
    return [TieredBackend]
