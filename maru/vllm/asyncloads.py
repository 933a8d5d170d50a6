"""Which loads run in the background: a hit read from a slow tier never stalls the step.

A hit whose objects are in this machine's memory (shm, cxl, mock, or the first tier of
a tiered store) is copied inside the engine's step: it costs a memory copy. One that
must come from a slow tier (a store or tier whose `medium` is "disk" or "remote") is
loaded asynchronously: vLLM parks the request in WAITING_FOR_REMOTE_KVS, the worker
reads the objects on its own threads (`maru.vllm.fetcher`) and copies them into the
request's blocks once they are there, and other requests decode meanwhile. Where the
store is tiered over a shm or cxl pool, the scheduler first reads the hit into that pool
(`maru.vllm.staging`), and it then loads as a memory hit.

Settings (maru's config): `async_loads` is "auto" (slow tiers only, the default),
"always" or "never"; `async_load_timeout` is the seconds a background read of a request
may take, plus one second per `LOAD_RATE_FLOOR` bytes, before it counts as failed and
vLLM recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maru.backends.base import Backend

SLOW_MEDIA = ("disk", "remote")
"""Media a read of which waits for a device or the network, not memory."""
LOAD_RATE_FLOOR = 100 * 2**20
"""Bytes per second the slowest acceptable background read moves (its deadline grows
by one second per this many bytes)."""


@dataclass(frozen=True)
class AsyncLoads:
    """When and for how long loads run in the background."""

    mode: str = "auto"
    timeout: float = 10.0

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a background read of `nbytes` may take."""
        return self.timeout + nbytes / LOAD_RATE_FLOOR


def async_loads(config: Any) -> AsyncLoads:
    """The settings of maru's config (validated there)."""
    return AsyncLoads(config.async_loads, config.async_load_timeout)


def in_background(settings: AsyncLoads, store: Backend | None, keys: Sequence[bytes]) -> bool:
    """Does a hit on these objects load in the background? In "auto" mode where reading
    them waits for a slow tier (or the store is gone meanwhile: the load fails there)."""
    if settings.mode != "auto":
        return settings.mode == "always"
    return store is None or reads_slowly(store, keys)


def reads_slowly(store: Backend, keys: Sequence[bytes]) -> bool:
    """Would reading these objects wait for a slow tier? A tiered store answers per key
    (`media`: its first tier's medium where that holds the key, else the slowest below)."""
    if store.medium in SLOW_MEDIA:
        return True
    media = getattr(store, "media", None)
    return media is not None and any(medium in SLOW_MEDIA for medium in media(list(keys)))


def first_slow(store: Backend, keys: Sequence[bytes]) -> bytes:
    """The first of `keys` that a read would fetch from a slow tier (else the first)."""
    media = getattr(store, "media", None)
    if media is None:
        return keys[0]
    return next(
        (k for k, m in zip(keys, media(list(keys)), strict=True) if m in SLOW_MEDIA), keys[0]
    )
