"""Every statistic the connector keeps, in one table, and the stats object vLLM carries.

Each `Stat` says what it counts, how it adds up, and the Prometheus metric it feeds
(`maru.vllm.metrics`); code counts with the module's constants (`stats.add(LOADS, 1)`),
so a misspelt statistic is an import error, not a KeyError inside a worker step. vLLM
moves `MaruConnectorStats.data` between processes and sums it over workers and
intervals (`aggregate`), then logs `reduce()` and hands `data` to the metrics. The
store's own figures feed the gauges (`store_gauges`) and the dropped copies
(`DroppedCopies`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from maru.backends.base import Backend
from maru.log import get_logger
from maru.vllm.compat import KVConnectorStats

log = get_logger(__name__)

Kind = Literal["counter", "error", "latency", "gauge"]


@dataclass(frozen=True)
class Stat:
    """One statistic: its key in the stats data, how it adds up, its metric."""

    key: str
    kind: Kind
    help: str
    metric: str | None = None
    """Prometheus name (errors: the `kind` label of vllm:maru_errors); None: not exported."""


LOOKUPS = Stat(
    "lookups", "counter", "Store lookups (one batched lookup per request).", "vllm:maru_lookups"
)
HIT_TOKENS = Stat(
    "hit_tokens", "counter", "Prompt tokens loaded from the store.", "vllm:maru_hit_tokens"
)
MISS_TOKENS = Stat(
    "miss_tokens",
    "counter",
    "Whole-chunk prompt tokens the store was asked for and lacked.",
    "vllm:maru_miss_tokens",
)
LOADS = Stat(
    "loads", "counter", "Chunks loaded (per tensor-parallel rank).", "vllm:maru_chunks_loaded"
)
BACKGROUND_LOADS = Stat(
    "background_loads",
    "counter",
    "Of loads, the chunks read off the engine's thread (from a slow tier) while vLLM ran "
    "other requests (`async_loads`).",
    "vllm:maru_chunks_loaded_in_background",
)
STAGED_TOKENS = Stat(
    "staged_tokens",
    "counter",
    "Prompt tokens of slow hits the scheduler read into the node's memory before vLLM "
    "scheduled them (a tiered store over shm or cxl), loaded then as memory hits.",
    "vllm:maru_staged_hit_tokens",
)
SLOW_HITS_RECOMPUTED = Stat(
    "slow_hits_recomputed",
    "counter",
    "Prompt tokens a slow tier held that were recomputed, because loading them was "
    "expected to take longer than computing them (`slow_hits`).",
    "vllm:maru_slow_hit_tokens_recomputed",
)
SAVES = Stat(
    "saves", "counter", "Chunks saved (per tensor-parallel rank).", "vllm:maru_chunks_saved"
)
LOADED_BYTES = Stat(
    "loaded_bytes", "counter", "Bytes copied from the store.", "vllm:maru_loaded_bytes"
)
SAVED_BYTES = Stat(
    "saved_bytes", "counter", "Bytes copied into the store.", "vllm:maru_saved_bytes"
)
COPIES_DROPPED = Stat(
    "copies_dropped",
    "counter",
    "Saved chunks whose copy into a lower tier (e.g. disk) was dropped because the tier "
    "could not keep up: kept in the first tier only.",
    "vllm:maru_copies_dropped",
)
SKIPPED_SECONDS = Stat(
    "skipped_seconds",
    "counter",
    "Seconds the store was skipped after errors (error_backoff).",
    "vllm:maru_store_skipped_seconds",
)
LOAD_SECONDS = Stat(
    "load_seconds",
    "counter",
    "Seconds the worker spent in maru's load calls (issuing copies, and on "
    "the CPU making them; waiting for them).",
)
LOAD_OPEN_SECONDS = Stat(
    "load_open_seconds",
    "counter",
    "Of load_seconds, the seconds spent getting each chunk's object from the store (a "
    "lookup where the store is memory, a read where it is not) and checking its header; "
    "the rest made (or issued) the copies and verified them.",
)
SAVE_SECONDS = Stat(
    "save_seconds",
    "counter",
    "Seconds the worker spent in maru's save calls (issuing copies, waiting for them, committing).",
)
LOOKUP_ERRORS = Stat("lookup_errors", "error", "Lookups that failed (a miss).", "lookup")
LOAD_ERRORS = Stat("load_errors", "error", "Chunks that failed to load (recomputed).", "load")
SAVE_ERRORS = Stat("save_errors", "error", "Chunks that failed to save (a future miss).", "save")
LOAD_LATENCIES = Stat(
    "load_latencies",
    "latency",
    "Seconds from issuing a chunk's copies to its load being done.",
    "vllm:maru_load_seconds",
)
SAVE_LATENCIES = Stat(
    "save_latencies",
    "latency",
    "Seconds from a chunk's first copy to its object committed.",
    "vllm:maru_save_seconds",
)
STORE_CAPACITY = Stat(
    "store_capacity", "gauge", "The store's capacity in bytes.", "vllm:maru_store_capacity_bytes"
)
STORE_USED = Stat(
    "store_used", "gauge", "Bytes the store's objects take.", "vllm:maru_store_used_bytes"
)
STORE_OBJECTS = Stat("store_objects", "gauge", "Objects in the store.", "vllm:maru_store_objects")
STORE_EVICTIONS = Stat(
    "store_evictions",
    "gauge",
    "Objects the store has evicted since it was created.",
    "vllm:maru_store_evictions",
)
PREFILL_RATE = Stat(
    "prefill_tokens_per_s",
    "gauge",
    "The engine's prefill rate as the connector learned it (tokens per second).",
    "vllm:maru_prefill_tokens_per_second",
)
SLOW_LOAD_RATE = Stat(
    "slow_load_tokens_per_s",
    "gauge",
    "The rate at which hits load from slow tiers, as the connector learned it (tokens "
    "per second and KV cache group).",
    "vllm:maru_slow_load_tokens_per_second",
)

TABLE = (
    LOOKUPS,
    LOOKUP_ERRORS,
    HIT_TOKENS,
    MISS_TOKENS,
    LOADS,
    BACKGROUND_LOADS,
    STAGED_TOKENS,
    SLOW_HITS_RECOMPUTED,
    LOADED_BYTES,
    LOAD_SECONDS,
    LOAD_OPEN_SECONDS,
    LOAD_ERRORS,
    SAVES,
    SAVED_BYTES,
    SAVE_SECONDS,
    SAVE_ERRORS,
    COPIES_DROPPED,
    SKIPPED_SECONDS,
    LOAD_LATENCIES,
    SAVE_LATENCIES,
    STORE_CAPACITY,
    STORE_USED,
    STORE_OBJECTS,
    STORE_EVICTIONS,
    PREFILL_RATE,
    SLOW_LOAD_RATE,
)
"""Every statistic, in the order logs show them."""


def of_kind(*kinds: Kind) -> tuple[Stat, ...]:
    return tuple(stat for stat in TABLE if stat.kind in kinds)


COUNTED = tuple(stat.key for stat in of_kind("counter", "error"))
"""What adds up (counters and errors); the rest are latencies and gauges."""
LATENCIES = tuple(stat.key for stat in of_kind("latency"))
GAUGES = tuple(stat.key for stat in of_kind("gauge"))


@dataclass
class MaruConnectorStats(KVConnectorStats):
    """Counters, latencies and store gauges since the last report; summed (latencies
    joined, gauges replaced) across workers and intervals."""

    data: dict[str, Any] = field(default_factory=dict)
    lifetime: dict[str, Any] = field(default_factory=dict, repr=False)
    """The counters since start-up (reports reset `data`, not this; logged at shutdown)."""

    def __post_init__(self) -> None:
        for key in COUNTED:
            self.data.setdefault(key, 0)
            self.lifetime.setdefault(key, 0)
        for key in LATENCIES:
            self.data.setdefault(key, [])

    def add(self, stat: Stat, value: float = 1) -> None:
        """Add to a counter."""
        self.data[stat.key] += value
        self.lifetime[stat.key] += value

    def observe(self, stat: Stat, seconds: float) -> None:
        """Record one chunk's latency."""
        self.data[stat.key].append(seconds)

    def set_gauges(self, values: dict[Stat, int]) -> None:
        """The store's latest figures."""
        self.data.update({stat.key: value for stat, value in values.items()})

    @contextmanager
    def timing(self, stat: Stat) -> Iterator[None]:
        """Add the seconds spent inside the block to a counter."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(stat, time.perf_counter() - started)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTED, 0) | {key: [] for key in LATENCIES}

    def aggregate(self, other: KVConnectorStats) -> MaruConnectorStats:
        for key in COUNTED:
            self.data[key] += other.data.get(key, 0)
        for key in LATENCIES:
            self.data[key] = [*self.data[key], *other.data.get(key, ())]
        for key in GAUGES:
            if key in other.data:
                self.data[key] = other.data[key]
        return self

    def reduce(self) -> dict[str, int | float]:
        return {
            key: round(value, 4) if isinstance(value, float) else value
            for key, value in self.data.items()
            if key in COUNTED
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in (*COUNTED, *LATENCIES))

    def take(self) -> MaruConnectorStats | None:
        """A copy of the counters, which are then reset; None if nothing happened."""
        if self.is_empty():
            return None
        taken = MaruConnectorStats(dict(self.data))
        self.reset()
        return taken


def store_gauges(store: Backend) -> dict[Stat, int] | None:
    """The store's own figures as the gauges report them; None if it cannot say (gauges
    are best effort: never a failed step for them)."""
    try:
        figures = store.stats()
    except Exception as exc:
        log.debug("maru: store stats unavailable: %s", exc)
        return None
    if figures is None:
        return None
    return {
        STORE_CAPACITY: figures.capacity,
        STORE_USED: figures.used,
        STORE_OBJECTS: figures.objects,
        STORE_EVICTIONS: figures.evictions,
    }


DROPPED_REFRESH_S = 1.0
"""How often a worker asks its store how many lower-tier copies it dropped."""


class DroppedCopies:
    """Counts into `stats` the copies into lower tiers the store dropped since the last
    look (its `StoreStats.dropped`, counted in the process that saves), at most once
    every DROPPED_REFRESH_S."""

    def __init__(self, stats: MaruConnectorStats) -> None:
        self.stats = stats
        self._seen = 0
        self._read_at = 0.0

    def refresh(self, available: Callable[[], Backend | None]) -> None:
        """Look again if it is time; `available` gives the store (None: skipped)."""
        if time.monotonic() - self._read_at < DROPPED_REFRESH_S:
            return
        self._read_at = time.monotonic()
        store = available()
        if store is None:
            return
        try:
            dropped = store.stats().dropped
        except Exception as exc:  # counters are best effort: never fail a step for them
            log.debug("maru: store stats unavailable: %s", exc)
            return
        if dropped > self._seen:
            self.stats.add(COPIES_DROPPED, dropped - self._seen)
            self._seen = dropped
