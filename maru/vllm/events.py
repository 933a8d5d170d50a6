"""KV events for cache-aware routers: which prompt chunks this instance made available in
the store, and which the store no longer has.

vLLM's scheduler publishes what `take_events` returns beside its own block events, so a
router that follows vLLM's KV events learns, per instance, the prefixes it can load from
maru: `BlockStored` once a chunk this instance saved is committed in the store (checked
in the store, so a failed or skipped save is never announced), `BlockRemoved` once the
store no longer holds it, whoever evicted or deleted it. Removals are read from the
store's removal log (`Backend.removed_since`); where a store keeps none, or this reader
fell behind it, the chunks announced are checked with `contains` at most once per
VERIFY_INTERVAL_S. The medium is `maru:<backend>`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from maru.backends.base import Backend, key_digest
from maru.config import MaruConfig
from maru.vllm import compat

Chunked = TypeVar("Chunked")

VERIFY_INTERVAL_S = 1.0
"""How often the announced chunks are checked where the store keeps no removal log."""


@dataclass
class Chunk:
    """A chunk whose save was planned: what its `BlockStored` event says."""

    req_id: str
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    lora_id: int | None = None
    lora_name: str | None = None


class StoreEvents:
    """Tracks the chunks this instance saved, from plan to commit to removal, and turns
    each change into a vLLM KV event (scheduler half, one step at a time)."""

    def __init__(
        self, medium: str, block_size: int, shares: Callable[[bytes], list[bytes]]
    ) -> None:
        self.medium = medium
        self.block_size = block_size
        self._shares = shares
        """A chunk key's objects in the store (one per tensor-parallel rank)."""
        self._planned: dict[bytes, Chunk] = {}
        self._announced: dict[bytes, list[bytes]] = {}
        self._by_digest: dict[int, bytes] = {}
        self._settled: set[str] = set()
        self._cursor: int | None = None
        self._verified_at = 0.0

    def planned(self, key: bytes, chunk: Chunk) -> None:
        """A save of this chunk was planned; it is announced once the store has it."""
        if key not in self._announced:
            self._planned[key] = chunk

    def settled(self, req_ids: set[str]) -> None:
        """The worker reported these requests' saves done: chunks of theirs the store
        still lacks after the next poll were not saved, and are forgotten."""
        self._settled |= req_ids

    def poll(self, store: Backend) -> list[Any]:
        """The events since the last poll: removals first, then new chunks."""
        events = self._removed(self._gone(store))
        events.extend(self._stored(store))
        return events

    def cleared(self) -> list[Any]:
        """Every announced chunk is gone (this instance's namespace was reset)."""
        events = self._removed(list(self._announced))
        self._planned.clear()
        return events

    def _gone(self, store: Backend) -> list[bytes]:
        """Announced chunks the store no longer holds, from its removal log where it
        keeps one."""
        removals = store.removed_since(self._cursor)
        self._cursor = removals.cursor
        if removals.digests is None:
            if time.monotonic() - self._verified_at < VERIFY_INTERVAL_S:
                return []
            self._verified_at = time.monotonic()
            candidates = list(self._announced)
        else:
            candidates = list(
                dict.fromkeys(self._by_digest[d] for d in removals.digests if d in self._by_digest)
            )
        # an object may have been stored again since it was logged as removed
        return [
            key
            for key, held in zip(candidates, self._held(store, candidates), strict=True)
            if not held
        ]

    def _stored(self, store: Backend) -> list[Any]:
        """`BlockStored` for each planned chunk the store now holds."""
        keys = list(self._planned)
        events = []
        for key, held in zip(keys, self._held(store, keys), strict=True):
            chunk = self._planned[key]
            if held:
                del self._planned[key]
                self._announce(key, chunk)
                events.append(self._stored_event(chunk))
            elif chunk.req_id in self._settled:
                del self._planned[key]
        self._settled.clear()
        return events

    def _held(self, store: Backend, keys: list[bytes]) -> list[bool]:
        return chunks_held(store, keys, self._shares)

    def _announce(self, key: bytes, chunk: Chunk) -> None:
        self._announced[key] = chunk.block_hashes
        for share in self._shares(key):
            self._by_digest[key_digest(share)] = key

    def _removed(self, keys: list[bytes]) -> list[Any]:
        """Forget these announced chunks: one `BlockRemoved` for all their blocks."""
        hashes = []
        for key in keys:
            hashes.extend(self._announced.pop(key))
            for share in self._shares(key):
                self._by_digest.pop(key_digest(share), None)
        if not hashes:
            return []
        from vllm.distributed.kv_events import BlockRemoved

        return [BlockRemoved(block_hashes=[external_hash(h) for h in hashes], medium=self.medium)]

    def _stored_event(self, chunk: Chunk) -> Any:
        from vllm.distributed.kv_events import BlockStored

        parent = chunk.parent_block_hash
        return BlockStored(
            block_hashes=[external_hash(h) for h in chunk.block_hashes],
            parent_block_hash=external_hash(parent) if parent is not None else None,
            token_ids=chunk.token_ids,
            block_size=self.block_size,
            lora_id=chunk.lora_id,
            medium=self.medium,
            lora_name=chunk.lora_name,
        )


def chunks_held(
    store: Backend, keys: Sequence[Chunked], shares: Callable[[Chunked], list[bytes]]
) -> list[bool]:
    """Per chunk (a key, or a key and its group): does the store hold every one of its
    shares (one per tensor-parallel rank)? One `contains` for all of them."""
    if not keys:
        return []
    groups = [shares(key) for key in keys]
    found = iter(store.contains([share for group in groups for share in group]))
    return [all([next(found) for _ in group]) for group in groups]


def external_hash(block_hash: bytes) -> Any:
    """A block hash as vLLM's own KV events carry it (bytes, or an int where
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` says so)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(block_hash)


def request_blocks(request: Any, blocks: range, block_size: int) -> Chunk:
    """What the `BlockStored` of an object of a request's `blocks` (a chunk's, or a
    tail's) says: their hashes, the hash of the block before them, their tokens, and the
    request's LoRA adapter."""
    first, end = blocks.start, blocks.stop
    hashes = request.block_hashes
    lora = getattr(request, "lora_request", None)
    return Chunk(
        req_id=request.request_id,
        block_hashes=[bytes(h) for h in hashes[first:end]],
        parent_block_hash=bytes(hashes[first - 1]) if first else None,
        token_ids=list(request.all_token_ids[first * block_size : end * block_size]),
        lora_id=lora.lora_int_id if lora else None,
        lora_name=lora.lora_name if lora else None,
    )


def store_events(
    vllm_config: Any, config: MaruConfig, shares: Callable[[bytes], list[bytes]]
) -> StoreEvents | None:
    """The KV-event tracker, where vLLM publishes KV events and lets connectors add to
    them; None (and nothing tracked) otherwise."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if not (events_config and events_config.enable_kv_cache_events):
        return None
    if not compat.has_hook("take_events"):
        return None  # said at start-up (`compat.say_what_this_release_lacks`)
    return StoreEvents(f"maru:{config.backend}", vllm_config.cache_config.block_size, shares)
