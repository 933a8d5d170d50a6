"""MaruKVConnector: vLLM's KV connector over a maru store.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "shm", "capacity": "8GiB"}}'

The scheduler half looks up, in one batch per request, which whole chunks are
stored, tells vLLM how many tokens it can load, and plans the saves of the
chunks the store lacks (also those vLLM holds in its own prefix cache); the
worker half copies chunks between the store and the KV cache blocks. One object
per chunk (`chunk_tokens`) per tensor-parallel rank holds every layer's pages,
written into a reservation as layers are saved and committed only when whole.
Only chunk keys and block ids travel from scheduler to workers.

The store is best-effort: a lookup error is a miss, a chunk that cannot be
loaded is reported through `get_block_ids_with_load_errors` so vLLM recomputes
it, and after an error the store is skipped for `error_backoff` seconds. What
retrying cannot fix (bad configuration, an unknown tensor-parallel rank) turns
the half off with one error instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

import maru
from maru.config import MaruConfig, load_config
from maru.errors import (
    ConfigError,
    InvalidKeyError,
    MaruError,
    ObjectTooLargeError,
    PluginError,
)
from maru.kv_events import StoreEvents, chunks_held, request_chunk
from maru.layouts import LayoutError, kv_tensor, recognise
from maru.model_identity import model_identity
from maru.namespaces import differing_fields, namespaces, write_record
from maru.plugins import get_plugin_manager
from maru.transfer import (
    Blocks,
    ChunkCopy,
    Marker,
    TransferEngine,
    UnsupportedDeviceError,
    host_tensor,
    pin,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # vLLM < 0.11 has no connector stats
    KVConnectorStats = object  # type: ignore[assignment,misc]

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM < 0.32 does not count hits by source
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("vllm.maru")
"""Under "vllm" so that vLLM's log configuration shows maru's lines with its own."""

OPTIONAL_HOOKS = {
    "build_prom_metrics": "maru's Prometheus metrics (its counters still reach vLLM's stats)",
    "take_events": "KV events for routers",
    "reset_cache": "clearing the store through /reset_prefix_cache",
}
"""Connector hooks of recent vLLM releases, and what is missing where a release lacks one."""

RECORD_REFRESH_S = 60.0
"""How often an active instance refreshes its namespace record's time of activity."""
HEADER_BYTES = 64
HEADER_MAGIC = b"MARUKV01"
NO_DATA_PATH = "unrecognised"
"""The fingerprint a worker reports when its layout or device has no data path."""
PERMANENT_ERRORS = (ConfigError, PluginError, InvalidKeyError, ObjectTooLargeError)
"""Store errors that retrying cannot fix: they turn the half off instead of backing off."""


# --- what travels between the halves -----------------------------------------


@dataclass
class ChunkTransfer:
    """One chunk to load or save: its key and the blocks it covers."""

    key: bytes
    block_ids: list[int]
    first_block: int = 0
    """Index, in the chunk, of block_ids[0] (a load may skip locally computed blocks)."""
    req_id: str = ""


@dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    """Scheduler to workers, every step: chunk keys and block ids only."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    preempted: bool = False
    """Requests were preempted: their blocks may be reused, so saves still copying
    from them must finish first."""


@dataclass
class MaruHandshake(KVConnectorHandshakeMetadata):
    """Worker to scheduler, once: the layout that goes into the key namespace."""

    layout_fingerprint: str


STAT_FIELDS = ("lookups", "lookup_errors", "hit_tokens", "miss_tokens", "loads",
               "loaded_bytes", "load_seconds", "load_errors", "saves", "saved_bytes",
               "save_seconds", "save_errors", "skipped_seconds")
"""Counters. `load_seconds` and `save_seconds` are the time the worker spent in maru's
calls (issuing copies, and on the CPU making them; waiting for them; committing);
`miss_tokens` are whole-chunk prompt tokens the store was asked for and lacked;
`skipped_seconds` is how long errors made a half skip the store (its back-off)."""

LATENCY_FIELDS = ("load_latencies", "save_latencies")
"""Per chunk, seconds from issuing its copies to its load being done or its object
committed (for histograms; not in log lines)."""

GAUGE_FIELDS = ("store_capacity", "store_used", "store_objects", "store_evictions")
"""The store's own figures when the scheduler last reported (latest value wins)."""


@dataclass
class MaruConnectorStats(KVConnectorStats):
    """Counters, latencies and store gauges since the last report; summed (latencies
    joined, gauges replaced) across workers and intervals."""

    data: dict[str, Any] = field(default_factory=dict)
    lifetime: dict[str, Any] = field(default_factory=dict, repr=False)
    """The counters since start-up (reports reset `data`, not this)."""

    def __post_init__(self) -> None:
        for name in STAT_FIELDS:
            self.data.setdefault(name, 0)
            self.lifetime.setdefault(name, 0)
        for name in LATENCY_FIELDS:
            self.data.setdefault(name, [])

    def add(self, **counts: float) -> None:
        """Add to counters."""
        for name, value in counts.items():
            self.data[name] += value
            self.lifetime[name] += value

    def observe(self, latency: str, seconds: float) -> None:
        """Record one chunk's latency."""
        self.data[latency].append(seconds)

    @contextmanager
    def timing(self, counter: str) -> Iterator[None]:
        """Add the seconds spent inside the block to `counter`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{counter: time.perf_counter() - started})

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_FIELDS, 0)
        self.data.update({name: [] for name in LATENCY_FIELDS})

    def aggregate(self, other: KVConnectorStats) -> MaruConnectorStats:
        for name in STAT_FIELDS:
            self.data[name] += other.data.get(name, 0)
        for name in LATENCY_FIELDS:
            self.data[name] = [*self.data[name], *other.data.get(name, ())]
        for name in GAUGE_FIELDS:
            if name in other.data:
                self.data[name] = other.data[name]
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) if isinstance(value, float) else value
                for name, value in self.data.items() if name in STAT_FIELDS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in (*STAT_FIELDS, *LATENCY_FIELDS))

    def take(self) -> MaruConnectorStats | None:
        """A copy of the counters, which are then reset; None if nothing happened."""
        if self.is_empty():
            return None
        taken = MaruConnectorStats(dict(self.data))
        self.reset()
        return taken


# --- shared helpers ----------------------------------------------------------


class StoreGuard:
    """Opens the store lazily and keeps it out of the way for a while after errors."""

    def __init__(self, config: MaruConfig, half: str, stats: MaruConnectorStats) -> None:
        self.config = config
        self.half = half
        """Which half ("scheduler" or "worker"), for the logs."""
        self.stats = stats
        self._store: maru.Backend | None = None
        self._retry_at = 0.0
        self.disabled = False

    def available(self) -> maru.Backend | None:
        """The store, or None while backing off after an error or once disabled."""
        if self.disabled or time.monotonic() < self._retry_at:
            return None
        if self._store is None:
            try:
                self._store = maru.open_store(self.config)
            except Exception as exc:
                self.failed(exc)
                return None
        return self._store

    def failed(self, exc: BaseException) -> None:
        """Note an error: skip the store for `error_backoff` seconds, or for good if permanent."""
        if isinstance(exc, PERMANENT_ERRORS):
            self.disable(f"the {self.config.backend} store cannot work as configured: "
                         f"{type(exc).__name__}: {exc}")
            return
        log.warning("maru store error, skipping it for %.0f s: %s: %s",
                    self.config.error_backoff, type(exc).__name__, exc)
        self._retry_at = time.monotonic() + self.config.error_backoff
        self.stats.add(skipped_seconds=self.config.error_backoff)

    def disable(self, reason: str) -> None:
        """Stop using the store until restart, saying why once."""
        if not self.disabled:
            self.disabled = True
            log.error("maru: %s; the connector's %s half is off (vLLM computes everything "
                      "itself) until restart", reason, self.half)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def rank_key(key: bytes, rank: int) -> bytes:
    """The object key of one tensor-parallel rank's share of a chunk."""
    return b"%s@%d" % (key, rank)


def object_header(key: bytes, layout: str, payload_bytes: int) -> bytes:
    """What a worker checks before trusting an object: magic, key and layout, size."""
    digest = hashlib.sha256(key + b"|" + layout.encode()).digest()[:24]
    return (HEADER_MAGIC + digest + payload_bytes.to_bytes(8, "little")).ljust(HEADER_BYTES,
                                                                              b"\0")


# --- scheduler half ----------------------------------------------------------


@dataclass
class RequestState:
    """What the scheduler half remembers about a request between calls."""

    request: Any
    keys: list[bytes]
    stored: list[bool]
    """Per chunk: not to save, as the store held it at the lookup (or, without an answer,
    vLLM computed it earlier)."""
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0
    planned_chunks: int = 0
    """Chunks before this one are stored or have had their save planned."""
    saving: bool = False
    """A save was planned: the worker reports when it is done, and vLLM keeps the blocks
    until then."""
    loads: list[ChunkTransfer] = field(default_factory=list)


class MaruScheduler:
    """Lookups and load/save plans; runs in vLLM's scheduler."""

    def __init__(self, vllm_config: VllmConfig, config: MaruConfig) -> None:
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = config.chunk_tokens
        if self.chunk_tokens % self.block_size:
            raise ConfigError(
                f"chunk_tokens = {self.chunk_tokens}: not a multiple of vLLM's block size "
                f"({self.block_size}); allowed: a multiple of {self.block_size}"
            )
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.stats = MaruConnectorStats()
        self.store = StoreGuard(config, "scheduler", self.stats)
        self.requests: dict[str, RequestState] = {}
        self._vllm_config = vllm_config
        self._config = config
        self._layout = "unknown"
        self._prefix: bytes | None = None
        self._gauges: dict[str, int] = {}
        self._record_at = -RECORD_REFRESH_S
        self._gauges_read_at = -1.0
        self.events = store_events(vllm_config, config, self.shares)
        self._reset_events: list[Any] = []
        model = vllm_config.model_config
        self.model_identity = model_identity(model.model, model.revision)
        log.info("maru: model %s is %s in the key namespace", model.model, self.model_identity)
        warn_if_hash_seed_is_per_process(vllm_config)
        say_what_this_release_lacks()
        self.store.available()  # at start-up: a new pool is set up here, not in a request

    def reset(self) -> bool:
        """Remove this instance's namespace from the store (never another model's or
        tenant's); False if the store could not."""
        store = self.store.available()
        if store is None:
            log.warning("maru: reset_cache: the store is unavailable; nothing removed")
            return False
        prefix = self.key_prefix()
        try:
            removed = store.delete_prefix(prefix)
        except MaruError as exc:
            log.warning("maru: reset_cache removed nothing: %s: %s", type(exc).__name__, exc)
            return False
        log.info("maru: reset_cache removed %d objects under %s", removed, prefix.decode())
        if self.events is not None:
            self._reset_events.extend(self.events.cleared())
        return True

    def take_events(self) -> list[Any]:
        """KV events since the last step (`maru.kv_events`); none unless vLLM publishes
        KV events."""
        if self.events is None:
            return []
        taken, self._reset_events = self._reset_events, []
        store = self.store.available()
        if store is not None:
            try:
                taken.extend(self.events.poll(store))
            except Exception as exc:  # events are best effort: never fail a step for them
                self.store.failed(exc)
        return taken

    def report(self) -> MaruConnectorStats | None:
        """The stats since the last report, with the store's gauges (read at most once a
        second: a remote store's figures cost a round trip)."""
        taken = self.stats.take()
        if taken is None:
            return None
        if time.monotonic() - self._gauges_read_at >= 1.0:
            self._gauges_read_at = time.monotonic()
            store = self.store.available()
            try:
                figures = store.stats() if store is not None else None
            except Exception as exc:  # gauges are best effort: never fail a step for them
                log.debug("maru: store stats unavailable: %s", exc)
                figures = None
            if figures is not None:
                self._gauges = dict(zip(GAUGE_FIELDS, (figures.capacity, figures.used,
                                                       figures.objects, figures.evictions),
                                        strict=True))
        taken.data.update(self._gauges)
        return taken

    def set_layout(self, fingerprints: set[str]) -> None:
        """Take the workers' layout fingerprint into the namespace; stop looking up
        chunks no worker could load (a worker without a data path said why)."""
        if NO_DATA_PATH in fingerprints:
            self.store.disabled = True
            log.info("maru: a worker has no data path for its KV cache; no lookups either")
        self._layout = ",".join(sorted(fingerprints))
        self._prefix = None

    def namespace(self) -> dict[str, Any]:
        """What the key digest covers (see `namespace_parts`)."""
        return namespace_parts(self._vllm_config, self._config, self._layout,
                               self.model_identity)

    def key_prefix(self) -> bytes:
        """`maru/<namespace>/<digest>/`: the digest covers everything that changes the bytes."""
        if self._prefix is None:
            parts = self.namespace()
            digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
            self._prefix = f"maru/{self._config.namespace}/{digest[:32]}/".encode()
            self._record_at = -RECORD_REFRESH_S
        return self._prefix

    def record(self) -> dict[str, Any]:
        """This instance's namespace record (`maru.namespaces`)."""
        return namespace_record(self._vllm_config, self._config, self.namespace())

    def keep_record(self, store: maru.Backend) -> None:
        """Write the namespace record once the layout is known, then refresh its time of
        activity at most every RECORD_REFRESH_S; the first time, say how namespaces of the
        same model in the store differ from this one."""
        if self._layout == "unknown" or time.monotonic() - self._record_at < RECORD_REFRESH_S:
            return
        first = self._record_at < 0
        self._record_at = time.monotonic()
        prefix, record = self.key_prefix(), self.record()
        try:
            if first:
                self._compare_with_peers(store, record)
        except MaruError as exc:  # e.g. a backend that cannot list its keys
            log.debug("maru: namespaces in the store not compared: %s", exc)
        try:
            write_record(store, prefix, record)
        except MaruError as exc:
            log.debug("maru: namespace record not kept: %s", exc)

    def _compare_with_peers(self, store: maru.Backend, record: dict[str, Any]) -> None:
        name = "/".join(self.key_prefix().decode().split("/")[1:3])
        for peer in namespaces(store, other_than=name):
            if peer.record.get("model") != record["model"]:
                continue
            fields = differing_fields(record, peer.record)
            log.warning("maru: this instance will not share with namespace %s (%d objects, "
                        "same model): %s", peer.name, peer.objects,
                        "; ".join(f"{field} is {ours!r} here, {theirs!r} there"
                                  for field, (ours, theirs) in fields.items()))

    def chunk_keys(self, request: Any) -> list[bytes]:
        """One key per whole prompt chunk: the hash of its last block (hashes are chained)."""
        hashes = request.block_hashes
        count = min(len(hashes) // self.blocks_per_chunk,
                    request.num_prompt_tokens // self.chunk_tokens)
        prefix = self.key_prefix()
        return [prefix + bytes(hashes[(c + 1) * self.blocks_per_chunk - 1]) for c in range(count)]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` that can be loaded from the store.

        Every chunk is looked up, also those vLLM holds itself: the store may have
        lost them (restarted, evicted, down earlier), and then they are saved again.
        """
        if self.store.disabled:  # nothing to load, and no worker could save
            return 0
        keys = self.chunk_keys(request)
        local = num_computed_tokens // self.chunk_tokens
        stored = self._stored(keys)
        if stored is None:  # no answer: take vLLM's own chunks as stored, save the rest
            stored = [chunk < local for chunk in range(len(keys))]
        self.requests[request.request_id] = RequestState(request, keys, stored,
                                                         local_tokens=num_computed_tokens)
        hit_chunks = local
        while hit_chunks < len(keys) and stored[hit_chunks]:
            hit_chunks += 1
        self.stats.add(miss_tokens=(len(keys) - hit_chunks) * self.chunk_tokens)
        hit_tokens = min(hit_chunks * self.chunk_tokens, request.num_prompt_tokens - 1)
        return max(0, hit_tokens - num_computed_tokens)

    def _stored(self, keys: list[bytes]) -> list[bool] | None:
        """Per chunk, whether the store holds every rank's share; None if it cannot say."""
        if not keys:
            return []
        store = self.store.available()
        if store is None:
            return None
        try:
            held = chunks_held(store, keys, self.shares)
        except Exception as exc:
            self.stats.add(lookups=1, lookup_errors=1)
            self.store.failed(exc)
            return None
        self.stats.add(lookups=1)
        self.keep_record(store)
        return held

    def shares(self, key: bytes) -> list[bytes]:
        """A chunk key's objects in the store: one per tensor-parallel rank."""
        return [rank_key(key, rank) for rank in range(self.tp_size)]

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Plan the loads of the external tokens into the allocated blocks."""
        state = self.requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = list(block_ids)
        state.loads = []
        if num_external_tokens <= 0:
            return
        self.stats.add(hit_tokens=num_external_tokens)
        first_block = state.local_tokens // self.block_size
        end_block = -(-(state.local_tokens + num_external_tokens) // self.block_size)
        for chunk in range(first_block // self.blocks_per_chunk,
                           -(-end_block // self.blocks_per_chunk)):
            start = max(first_block, chunk * self.blocks_per_chunk)
            stop = min(end_block, (chunk + 1) * self.blocks_per_chunk)
            state.loads.append(ChunkTransfer(state.keys[chunk], state.block_ids[start:stop],
                                             start - chunk * self.blocks_per_chunk))

    def build_connector_meta(self, scheduler_output: Any) -> MaruConnectorMetadata:
        """This step's loads and the saves of every chunk that completes in it."""
        meta = MaruConnectorMetadata(
            preempted=bool(getattr(scheduler_output, "preempted_req_ids", None)))
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(state, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            new_block_ids = cached.new_block_ids[index]
            if req_id in getattr(cached, "resumed_req_ids", ()):
                state.block_ids = list(new_block_ids[0]) if new_block_ids else []
            elif new_block_ids:
                state.block_ids.extend(new_block_ids[0])
            self._plan(state, cached.num_computed_tokens[index] + scheduled[req_id], meta)
        return meta

    def _plan(self, state: RequestState, computed: int, meta: MaruConnectorMetadata) -> None:
        meta.loads.extend(state.loads)
        state.loads = []
        complete = min(computed // self.chunk_tokens, len(state.keys))
        k = self.blocks_per_chunk
        for chunk in range(state.planned_chunks, complete):
            block_ids = state.block_ids[chunk * k:(chunk + 1) * k]
            if not state.stored[chunk] and len(block_ids) == k:
                meta.saves.append(ChunkTransfer(state.keys[chunk], block_ids,
                                                req_id=state.request.request_id))
                state.saving = True
                if self.events is not None:
                    self.events.planned(state.keys[chunk], request_chunk(
                        state.request, chunk, k, self.block_size))
        state.planned_chunks = max(state.planned_chunks, complete)

    def request_finished(self, request: Any) -> bool:
        """Forget the request; True if vLLM must keep its blocks until the worker reports
        its saves done (`get_finished`)."""
        state = self.requests.pop(request.request_id, None)
        return state is not None and state.saving


def store_events(vllm_config: VllmConfig, config: MaruConfig,
                 shares: Callable[[bytes], list[bytes]]) -> StoreEvents | None:
    """The KV-event tracker, where vLLM publishes KV events and lets connectors add to
    them; None (and nothing tracked) otherwise."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if not (events_config and events_config.enable_kv_cache_events):
        return None
    if not hasattr(KVConnectorBase_V1, "take_events"):
        return None  # said at start-up (`say_what_this_release_lacks`)
    return StoreEvents(f"maru:{config.backend}", vllm_config.cache_config.block_size, shares)


def missing_hooks() -> list[str]:
    """What this vLLM release cannot ask of a connector, in words."""
    missing = [what for hook, what in OPTIONAL_HOOKS.items()
               if not hasattr(KVConnectorBase_V1, hook)]
    if CacheHitSource is None:
        missing.append("hit counts by source (loaded tokens count as external prefix-cache "
                       "hits only)")
    return missing


def say_what_this_release_lacks() -> None:
    """Say once, at start-up, which optional hooks this vLLM lacks: the connector runs
    without them, and no KV is lost."""
    from vllm import __version__ as vllm_version

    if missing := missing_hooks():
        log.info("maru: vLLM %s lacks %s; loads and saves work as ever, nothing is lost",
                 vllm_version, "; ".join(missing))


def namespace_parts(vllm_config: VllmConfig, config: MaruConfig, layout: str,
                    model_id: str) -> dict[str, Any]:
    """Everything besides the token hashes that changes the bytes of a chunk; the model
    by what identifies its weights (`maru.model_identity`), not by its path.

    Not the vLLM release: releases whose hashes and pages agree share. A release that
    hashes blocks differently makes other keys (and its seed, NONE_HASH, is here); one
    that lays pages out differently has another layout fingerprint."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    algorithm = getattr(cache, "prefix_caching_hash_algo", "unknown")
    return {
        "model": model_id, "dtype": str(model.dtype),
        "kv_dtype": str(cache.cache_dtype), "layout": layout, "block_size": cache.block_size,
        "chunk_tokens": config.chunk_tokens,
        "tp_size": vllm_config.parallel_config.tensor_parallel_size,
        "hash_algorithm": algorithm, "hash_seed": none_hash_hex(),
    }


def namespace_record(vllm_config: VllmConfig, config: MaruConfig,
                     parts: dict[str, Any]) -> dict[str, Any]:
    """An instance's namespace record: the parts its key digest covers, its tenant, whether
    its block-hash seed is the same in every process, and the vLLM release."""
    from vllm import __version__ as vllm_version

    return parts | {"vllm": vllm_version, "namespace": config.namespace,
                    "hash_seed_shared": hash_seed_advice(vllm_config) is None}


def none_hash_hex() -> str:
    """vLLM's NONE_HASH, the seed of every block hash chain (empty if not set yet)."""
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        return ""
    return bytes(getattr(kv_cache_utils, "NONE_HASH", b"")).hex()


def hash_seed_advice(vllm_config: VllmConfig) -> str | None:
    """What makes block hashes match across processes here, if they cannot yet (None)."""
    from vllm import __version__ as vllm_version

    if os.environ.get("PYTHONHASHSEED") is not None:
        return None
    algorithm = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", ""))
    major_minor = tuple(int(p) for p in vllm_version.split(".")[:2] if p.isdigit())
    if len(major_minor) == 2 and major_minor < (0, 29):
        return ("set PYTHONHASHSEED to one value everywhere (before vLLM 0.29 every "
                "algorithm takes its seed from it)")
    if algorithm.startswith("xxhash"):
        return "set PYTHONHASHSEED to one value everywhere, or use a sha256 algorithm"
    return None


def warn_if_hash_seed_is_per_process(vllm_config: VllmConfig) -> None:
    """Say once when block hashes cannot match across processes, and what fixes it here."""
    from vllm import __version__ as vllm_version

    advice = hash_seed_advice(vllm_config)
    if advice is None:
        return
    algorithm = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", ""))
    log.warning("maru: vLLM's block-hash seed is random per process here (hash %s, vLLM %s, "
                "no PYTHONHASHSEED), so other instances can never hit this one's chunks; %s",
                algorithm, vllm_version, advice)


HOST_MEMORY_BACKENDS = frozenset({"shm", "cxl", "mock"})
"""Backends whose objects are in this machine's memory: hits from them are `host` hits."""


def hit_source(backend: str) -> Any:
    """Where vLLM should count tokens loaded from `backend`: host memory or elsewhere."""
    if backend in HOST_MEMORY_BACKENDS:
        return CacheHitSource.HOST
    return CacheHitSource.EXTERNAL_UNSPECIFIED


# --- worker half -------------------------------------------------------------


@dataclass
class PendingLoad:
    """A chunk whose pages are being copied into its blocks."""

    transfer: ChunkTransfer
    copy: ChunkCopy
    still_valid: Callable[[], bool]
    """Were the bytes copied from the committed object? (Checked once copies are done.)"""
    started: float = field(default_factory=time.perf_counter)


@dataclass
class PendingSave:
    """A chunk being saved: its reservation, filled layer by layer, committed once its
    copies are done."""

    key: bytes
    req_id: str
    copy: ChunkCopy
    reservation: torch.Tensor
    """The reservation's memory (the copies land in `copy.payload`, here or in staging)."""
    staged: bool
    stack: ExitStack
    layers_done: set[str] = field(default_factory=set)
    copied: Marker | None = None
    """Set once every layer is queued: done when the copies are."""
    started: float = field(default_factory=time.perf_counter)


class MaruWorker:
    """Copies chunks between the store and the KV cache; runs in each vLLM worker."""

    def __init__(self, vllm_config: VllmConfig, config: MaruConfig,
                 kv_cache_config: Any) -> None:
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self.blocks_per_chunk = config.chunk_tokens // vllm_config.cache_config.block_size
        self.stats = MaruConnectorStats()
        self.store = StoreGuard(config, "worker", self.stats)
        rank, tp_size = tensor_parallel_rank(), vllm_config.parallel_config.tensor_parallel_size
        if rank is None and tp_size > 1:  # guessing 0 would load rank 0's share everywhere
            self.store.disable(f"this worker's tensor-parallel rank is unknown with "
                               f"tensor_parallel_size = {tp_size}")
        self.rank = rank or 0
        self.engine: TransferEngine | None = None
        self.fingerprint = NO_DATA_PATH
        self.pinned = False
        """The store's memory is page-locked, so device transfers use it directly."""
        self.failed_blocks: set[int] = set()
        self.loading: list[PendingLoad] = []
        self.pending: dict[bytes, PendingSave] = {}
        self.in_flight: list[PendingSave] = []
        self.saving_requests: set[str] = set()
        """Requests with a planned save: their blocks are freed once they are reported."""
        self.finishing: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Find the layout adapter and the data path for the cache's device; a layout or
        device the data path cannot handle disables the connector, loudly."""
        adapters = [p.cls for p in get_plugin_manager().layout_adapters.values()]
        num_blocks = self.num_blocks or _guess_num_blocks(kv_caches)
        try:
            adapter = recognise(kv_caches, num_blocks, adapters)
            self.engine = TransferEngine(adapter)
        except LayoutError as exc:
            log.error("maru: %s", exc)
            return
        except UnsupportedDeviceError as exc:
            self.store.disable(str(exc))
            return
        self.fingerprint = adapter.fingerprint
        store = self.store.available()  # at start-up: a new pool is set up here, not in a request
        if self.engine.on_device and store is not None and store.zero_copy:
            self.pinned = pin(store.host_memory())
        log.info("maru: KV layout %s (fingerprint %s), %d layers, %d bytes per block, on %s%s",
                 adapter.name, adapter.fingerprint, len(adapter.layers), adapter.block_bytes,
                 self.engine.device, ", store memory page-locked" if self.pinned else "")

    def handshake(self) -> MaruHandshake:
        return MaruHandshake(self.fingerprint)

    def object_bytes(self, blocks: int) -> int:
        return HEADER_BYTES + self.engine.payload_bytes(blocks)

    def _host_direct(self, store: maru.Backend) -> bool:
        """Can copies use the store's memory itself (else a staging buffer)?"""
        return not self.engine.on_device or (store.zero_copy and self.pinned)

    # loads

    def load(self, transfers: list[ChunkTransfer]) -> None:
        """Start copying every planned chunk into its blocks (on the CPU: copy them)."""
        with self.stats.timing("load_seconds"):
            self._start_loads(transfers)

    def _start_loads(self, transfers: list[ChunkTransfer]) -> None:
        opened = []
        for transfer in transfers:
            pending = self._open(transfer) if self.engine else None
            if pending is None:
                self._load_failed(transfer)
            else:
                opened.append(pending)
        failed = self.engine.load([p.copy for p in opened]) if opened else set()
        for index, pending in enumerate(opened):
            if index in failed:
                self._load_failed(pending.transfer)
            else:
                self.loading.append(pending)
        if self.engine and not self.engine.on_device:
            self._finish_loads()

    def _open(self, transfer: ChunkTransfer) -> PendingLoad | None:
        """The chunk's object, checked, as host memory the copies can read; None if absent
        or not to be trusted."""
        store = self.store.available()
        if store is None:
            return None
        key = rank_key(transfer.key, self.rank)
        try:
            view = store.view(key)
        except Exception as exc:
            self.store.failed(exc)
            return None
        expected = self.object_bytes(self.blocks_per_chunk)
        if view is None or len(view.data) != expected or not self._trusted(key, view.data):
            return None
        payload, still_valid = host_tensor(view.data[HEADER_BYTES:]), view.valid
        if not self._host_direct(store):
            payload = self.engine.staging(payload.numel()).copy_(payload)
            if not view.valid():
                return None
            still_valid = _always
        copy = ChunkCopy(Blocks(transfer.block_ids), payload, self.blocks_per_chunk,
                         transfer.first_block)
        return PendingLoad(transfer, copy, still_valid)

    def _trusted(self, key: bytes, data: memoryview) -> bool:
        """The object is this key's, in this layout, and whole."""
        expected = object_header(key, self.fingerprint, len(data) - HEADER_BYTES)
        return data[:HEADER_BYTES] == expected

    def wait_for_layer(self, name: str) -> None:
        if self.engine is not None:
            self.engine.wait_layer(name)

    def finish_loads(self) -> None:
        """Wait for the loads' copies; a chunk whose object changed meanwhile failed."""
        if self.loading:
            with self.stats.timing("load_seconds"):
                self._finish_loads()

    def _finish_loads(self) -> None:
        self.engine.loads_done().wait()
        size = self.object_bytes(self.blocks_per_chunk)
        for pending in self.loading:
            if pending.still_valid():
                self.stats.add(loads=1, loaded_bytes=size)
                self.stats.observe("load_latencies", time.perf_counter() - pending.started)
            else:
                self._load_failed(pending.transfer)
        self.loading = []

    def _load_failed(self, transfer: ChunkTransfer) -> None:
        self.stats.add(load_errors=1)
        self.failed_blocks.update(transfer.block_ids)

    def take_failed_blocks(self) -> set[int]:
        self.finish_loads()
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    # saves

    def save_layer(self, layer_name: str, transfers: list[ChunkTransfer]) -> None:
        """Queue one layer's pages of every chunk to save, after the layer's compute."""
        with self.stats.timing("save_seconds"):
            self._queue_layer(layer_name, transfers)

    def _queue_layer(self, layer_name: str, transfers: list[ChunkTransfer]) -> None:
        if self.engine is None or layer_name not in self.engine.adapter.layers:
            return
        chunks = []
        for transfer in transfers:
            pending = self._pending(transfer)
            if pending is not None and layer_name not in pending.layers_done:
                pending.layers_done.add(layer_name)
                chunks.append(pending.copy)
        if chunks:
            self.engine.save_layer(layer_name, chunks)

    def _pending(self, transfer: ChunkTransfer) -> PendingSave | None:
        key = rank_key(transfer.key, self.rank)
        if key in self.pending:
            return self.pending[key]
        store = self.store.available()
        if store is None:
            return None
        stack = ExitStack()
        size = self.object_bytes(len(transfer.block_ids))
        try:
            buffer = stack.enter_context(store.reserve(key, size))
        except Exception as exc:
            stack.close()
            self.stats.add(save_errors=1)
            self.store.failed(exc)
            return None
        if buffer is None:
            stack.close()
            return None
        reservation = torch.frombuffer(buffer, dtype=torch.int8)
        header = object_header(key, self.fingerprint, size - HEADER_BYTES)
        reservation[:HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.int8)
        staged = not self._host_direct(store)
        pages = reservation[HEADER_BYTES:]
        if staged:
            pages = self.engine.staging(pages.numel())
        copy = ChunkCopy(Blocks(transfer.block_ids), pages, len(transfer.block_ids))
        pending = PendingSave(key, transfer.req_id, copy, reservation, staged, stack)
        self.pending[key] = pending
        return pending

    def finish_saves(self, transfers: list[ChunkTransfer]) -> None:
        """Queue the layers no save_kv_layer call delivered; every chunk of this step is
        then committed once its copies are done (on the CPU: now)."""
        with self.stats.timing("save_seconds"):
            for name in self.engine.adapter.layers if self.engine else ():
                self._queue_layer(name, transfers)
            if self.pending:
                done = self.engine.saves_done()
                for pending in self.pending.values():
                    pending.copied = done
                    self.in_flight.append(pending)
                self.pending.clear()
        self.commit_copied()

    def commit_copied(self, wait: bool = False) -> None:
        """Commit every save whose copies are done (with `wait`: all of them)."""
        still = []
        for pending in self.in_flight:
            if wait:
                with self.stats.timing("save_seconds"):
                    pending.copied.wait()
            if pending.copied.done():
                self._commit(pending)
            else:
                still.append(pending)
        self.in_flight = still

    def _commit(self, pending: PendingSave) -> None:
        try:
            with self.stats.timing("save_seconds"):
                if pending.staged:
                    pending.reservation[HEADER_BYTES:].copy_(pending.copy.payload)
                pending.stack.close()
        except Exception as exc:
            self.stats.add(save_errors=1)
            self.store.failed(exc)
            return
        self.stats.add(saves=1, saved_bytes=int(pending.reservation.numel()))
        self.stats.observe("save_latencies", time.perf_counter() - pending.started)

    def abort_saves(self, exc: BaseException) -> None:
        """Drop every open reservation (their space returns to the store)."""
        if self.engine is not None:
            self.engine.saves_done().wait()  # queued copies may still write into them
        for pending in [*self.pending.values(), *self.in_flight]:
            pending.stack.__exit__(type(exc), exc, exc.__traceback__)
        self.pending.clear()
        self.in_flight = []

    def expect_saves(self, transfers: list[ChunkTransfer]) -> None:
        """Note the requests these saves belong to (the scheduler holds their blocks)."""
        self.saving_requests.update(t.req_id for t in transfers)

    def finished_saving(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose saves are all committed (or dropped): vLLM may free
        their blocks now."""
        self.commit_copied()
        self.finishing |= finished_req_ids & self.saving_requests
        busy = {pending.req_id for pending in self.in_flight}
        done = self.finishing - busy
        self.finishing -= done
        self.saving_requests -= done
        return done

    def close(self) -> None:
        """Commit what is being saved, then close the store."""
        self.commit_copied(wait=True)
        self.store.close()


def _always() -> bool:
    return True


def _guess_num_blocks(kv_caches: dict[str, Any]) -> int:
    """Without a KVCacheConfig (old vLLM): the leading dimension, after a K/V split."""
    tensor = kv_tensor(next(iter(kv_caches.values())))
    return int(tensor.shape[1] if tensor.dim() >= 3 and tensor.shape[0] == 2 else tensor.shape[0])


def tensor_parallel_rank() -> int | None:
    """This worker's tensor-parallel rank; None when vLLM cannot tell (no distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:
        return None


# --- the connector vLLM loads --------------------------------------------------


class MaruKVConnector(KVConnectorBase_V1):
    """vLLM KV connector that shares prompt KV through a maru store."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.config = load_config(extra_config=extra)
        if CacheHitSource is not None:
            self._cache_hit_source = hit_source(self.config.backend)
        recompute_failed_loads(vllm_config)
        self._scheduler: MaruScheduler | None = None
        self._worker: MaruWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = MaruScheduler(vllm_config, self.config)
        else:
            self._worker = MaruWorker(vllm_config, self.config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """maru's metrics on vLLM's /metrics (`maru.metrics`)."""
        from maru.metrics import MaruPromMetrics

        return MaruPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads and saves are issued per layer, between graph pieces (a whole-model CUDA
        graph would replay the forward without them)."""
        return True

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> MaruHandshake | None:
        return self._worker.handshake() if self._worker else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and connector_metadata.saves:
            self._worker.expect_saves(connector_metadata.saves)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if kv_connector_metadata.preempted:  # their blocks are reused from this step on
            self._worker.commit_copied(wait=True)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if metadata.loads:
            self._worker.load(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if metadata.saves:
            try:
                self._worker.save_layer(layer_name, metadata.saves)
            except Exception as exc:  # a failed save is a future miss, never a failed step
                self._worker.abort_saves(exc)
                self._worker.store.failed(exc)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        saves = self._get_connector_metadata().saves
        try:
            self._worker.finish_saves(saves)
        except Exception as exc:
            self._worker.abort_saves(exc)
            self._worker.store.failed(exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        return (self._worker.finished_saving(finished_req_ids) or None) if self._worker \
            else None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker else set()

    def get_kv_connector_stats(self) -> MaruConnectorStats | None:
        if self._worker is not None:
            return self._worker.stats.take()
        assert self._scheduler is not None
        return self._scheduler.report()

    def reset_cache(self) -> bool | None:
        """`/reset_prefix_cache` with the connector: clear this instance's namespace."""
        return self._scheduler.reset() if self._scheduler is not None else None

    def describe(self) -> dict[str, Any]:
        """What this half decided at start-up: the layout adapter a worker picked, the key
        namespace the scheduler uses (for logs, tests and `maru doctor`-style reports)."""
        if self._worker is not None:
            engine = self._worker.engine
            return {"layout_adapter": engine.adapter.name if engine else None,
                    "layout_fingerprint": self._worker.fingerprint}
        assert self._scheduler is not None
        return {"namespace": self._scheduler.namespace()}

    def lifetime_stats(self) -> dict[str, Any]:
        """This half's counters since start-up (lookups here, loads and saves in workers)."""
        half = self._worker or self._scheduler
        return dict(half.stats.lifetime)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> MaruConnectorStats | None:
        return MaruConnectorStats(dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        else:
            self._scheduler.store.close()

    # scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks.get_block_ids()[0],
                                                 num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> MaruConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._scheduler is not None and self._scheduler.events is not None:
            self._scheduler.events.settled(set(connector_output.finished_sending or ()))

    def take_events(self) -> list[Any]:
        return self._scheduler.take_events() if self._scheduler is not None else []

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request), None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        fingerprints = {m.layout_fingerprint for m in metadata.values()
                        if isinstance(m, MaruHandshake)}
        if fingerprints:
            self._scheduler.set_layout(fingerprints)


def recompute_failed_loads(vllm_config: VllmConfig) -> None:
    """A best-effort cache must never fail a request: have vLLM recompute failed loads."""
    transfer = vllm_config.kv_transfer_config
    if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
        log.info("maru: setting kv_load_failure_policy to 'recompute' (a failed load from a "
                 "cache is recomputed, never an error)")
        transfer.kv_load_failure_policy = "recompute"
