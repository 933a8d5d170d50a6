"""A worker's background loads: each request's objects read on the fetcher's threads.

The scheduler half marks the loads of a hit in a slow tier `background`
(`maru.vllm.asyncloads`); vLLM keeps their request in WAITING_FOR_REMOTE_KVS and does not
touch its blocks. Here each such request's objects are read in one job, off the engine's
thread, with one batched read (`fetch_many`: one round trip per Redis node) into memory
the store picks: a tiered store reads what its lower tiers hold straight into its first
tier (the promotion, at no extra copy) and hands over views of it; other stores into
private buffers of a whole object each, which live until the copy (staging bounded by
the fetcher's queue).
The worker takes what arrived each step, checks and copies it into the request's blocks
with its usual data path, and reports the request finished: loaded, or failed where a
read failed, missed or passed its deadline (vLLM recomputes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from maru.backends.base import Backend, ReadView
from maru.errors import BufferTooSmallError
from maru.vllm.asyncloads import AsyncLoads
from maru.vllm.fetcher import Fetcher, FetchTimeout
from maru.vllm.metadata import ChunkTransfer

OWN_ERRORS = (FetchTimeout, BufferTooSmallError)
CLOSE_WAIT_S = 10.0
"""How long closing waits for reads still running."""


@dataclass(frozen=True)
class Arrived:
    """A request's background read, ended: one view (None: a miss) per transfer, or the
    error that ended it."""

    req_id: str
    transfers: list[ChunkTransfer]
    views: list[ReadView | None]
    error: BaseException | None

    @property
    def store_failed(self) -> bool:
        """Did the store fail, beyond this read (not merely slow, or an object too big
        for a chunk: those fail their request only)?"""
        return self.error is not None and not isinstance(self.error, OWN_ERRORS)


class BackgroundLoads:
    """Reads requests' objects off the engine's thread; see the module docstring."""

    def __init__(self, settings: AsyncLoads) -> None:
        self.settings = settings
        self.fetcher = Fetcher()
        self.reading: dict[str, list[ChunkTransfer]] = {}
        """Requests being read, and their transfers."""

    def start(
        self,
        store: Backend | None,
        transfers: list[ChunkTransfer],
        key: Callable[[ChunkTransfer], bytes],
        nbytes: Callable[[ChunkTransfer], int],
    ) -> list[ChunkTransfer]:
        """Start reading each request's objects (`key` names a transfer's, of at most
        `nbytes`); the transfers that could not start (no store, a full queue), which
        have failed."""
        by_request: dict[str, list[ChunkTransfer]] = {}
        for transfer in transfers:
            by_request.setdefault(transfer.req_id, []).append(transfer)
        refused: list[ChunkTransfer] = []
        for req_id, chunks in by_request.items():
            keys, sizes = [key(t) for t in chunks], [nbytes(t) for t in chunks]
            read, seconds = _reader(store, keys, sizes), self.settings.deadline_s(sum(sizes))
            if store is not None and self.fetcher.submit(req_id, read, seconds):
                self.reading[req_id] = chunks  # a request's loads are all in one step
            else:
                refused.extend(chunks)
        return refused

    def take(self) -> list[Arrived]:
        """The requests whose reads ended since the last call."""
        arrived = []
        for fetched in self.fetcher.take():
            transfers = self.reading.pop(fetched.tag)
            views = fetched.result if fetched.error is None else [None] * len(transfers)
            arrived.append(Arrived(fetched.tag, transfers, views, fetched.error))
        return arrived

    def close(self) -> None:
        """Stop reading and join the threads (nothing is reported any more)."""
        self.fetcher.close(CLOSE_WAIT_S)
        self.reading = {}


def _reader(
    store: Backend | None, keys: list[bytes], sizes: list[int]
) -> Callable[[], list[ReadView | None]]:
    """One batched read of every object named, each of at most its `sizes` (runs on a
    fetcher thread): their views, in order (None: a miss)."""
    return lambda: store.fetch_many(keys, sizes)
