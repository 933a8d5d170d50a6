"""Tiers: several backends in order, the cheapest first (e.g. shm on this node, then Redis).

A put goes to every tier; a read is served by the first tier that has the
object and copies it into the tiers above; `contains` asks a lower tier only
about the keys the tiers above lack. A tier that fails counts as a miss for
that call, so a failing lower tier never breaks the tiers above it; only when
every tier fails is the call a `BackendError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, ClassVar, TypeVar

from pydantic import Field, field_validator

from maru.backends.base import Backend, StoreStats
from maru.config import Options
from maru.errors import BackendError
from maru.hookspecs import hookimpl

log = logging.getLogger(__name__)
T = TypeVar("T")


class TieredOptions(Options):
    """The `tiered:` config section; each tier is configured by its own section."""

    tiers: list[str] = Field(["shm", "redis"], min_length=2,
                             description="backend names, the cheapest (tried first) first")

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
        from maru.plugins import get_plugin_manager

        super().__init__(config)
        manager = get_plugin_manager()
        self.tiers: list[Backend] = []
        try:
            for tier in self.options.tiers:
                self.tiers.append(manager.backend(tier)(config))
        except BaseException:
            self._close()
            raise
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    @classmethod
    def describe(cls, options: Any) -> str:
        return " in front of ".join(options.tiers)

    def _each(self, call: Callable[[Backend], T], what: str) -> list[tuple[Backend, T]]:
        """`call` on every tier that does not fail; BackendError if all fail."""
        answers, failures = [], []
        for tier in self.tiers:
            try:
                answers.append((tier, call(tier)))
            except BackendError as exc:
                failures.append(f"{tier.name}: {exc}")
        if not answers:
            raise BackendError(f"every tier failed to {what}: " + "; ".join(failures))
        for failure in failures:
            log.warning("maru tier failed to %s, treated as a miss: %s", what, failure)
        return answers

    def _put(self, key: bytes, data: memoryview) -> bool:
        """The first tier that answers decides (first writer wins); the rest get copies."""
        for index, tier in enumerate(self.tiers):
            try:
                stored = tier.put(key, data)
            except BackendError as exc:
                log.warning("maru tier %s failed to store, skipped: %s", tier.name, exc)
                continue
            if stored:
                self._store_in(self.tiers[index + 1:], key, data)
            return stored
        raise BackendError("every tier failed to put")

    @staticmethod
    def _store_in(tiers: list[Backend], key: bytes, data: Any) -> None:
        """Copies for other tiers: one that fails only loses its copy."""
        for tier in tiers:
            try:
                tier.put(key, data)
            except BackendError as exc:
                log.warning("maru tier %s failed to store a copy: %s", tier.name, exc)

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        stack = ExitStack()
        try:
            buffer = stack.enter_context(self.tiers[0].reserve(key, nbytes))
        except BackendError as exc:
            log.warning("maru tier %s failed to reserve, buffering locally: %s",
                        self.tiers[0].name, exc)
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
        failures = 0
        for index, tier in enumerate(self.tiers):
            try:
                found = read(tier)
            except BackendError as exc:
                failures += 1
                log.warning("maru tier %s failed to read, treated as a miss: %s", tier.name, exc)
                continue
            if found is not None:
                self._count(hit=True)
                return index, found
        if failures == len(self.tiers):
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
            try:
                found = tier.contains([keys[i] for i in missing])
            except BackendError as exc:
                failures += 1
                log.warning("maru tier %s failed a lookup, treated as misses: %s", tier.name, exc)
                continue
            for index, present in zip(missing, found, strict=True):
                answers[index] = present
            missing = [i for i, present in zip(missing, found, strict=True) if not present]
        if failures == len(self.tiers):
            raise BackendError("every tier failed a lookup")
        return answers

    def _delete(self, key: bytes) -> bool:
        return any(gone for _, gone in self._each(lambda t: t.delete(key), "delete"))

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
            return StoreStats(top.capacity, top.used, top.objects, self._hits, self._misses,
                              top.evictions, top.reclaimed)

    def _close(self) -> None:
        for tier in self.tiers:
            tier.close()


@hookimpl
def maru_backends() -> list[type[Backend]]:
    return [TieredBackend]
