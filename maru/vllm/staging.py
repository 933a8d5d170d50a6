"""Slow hits staged by the scheduler: read into the node's memory before vLLM schedules them.

A tiered store whose first tier is memory every process on the node maps (shm, cxl)
promotes what it reads from a lower tier into that tier (`Backend.fetch_many`). The
scheduler half starts that read as soon as a lookup finds a hit on a slow tier (and
the load policy says it is worth loading), on a thread of its own, and answers vLLM
"not yet" (None) each step until the read ends; then the hit is in memory and loads
as any memory hit does, a copy inside the next step.

Why the scheduler and not the worker: it sees the hit a step before a worker could
start reading; its process does not run the forward, so a read thread there seldom
waits for the interpreter's lock; and the request is scheduled at the first step
after its bytes arrive, where a worker's background load is reported at the end of
a step and scheduled at the next. Where the store cannot stage (another kind of
store, workers that have not yet said what their objects weigh) or a staging read
fails or misses, the hit loads in the worker's background as before
(`maru.vllm.background`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from maru.backends.base import Backend
from maru.vllm.asyncloads import AsyncLoads
from maru.vllm.fetcher import Fetched, Fetcher
from maru.vllm.groups import KVGroup
from maru.vllm.keys import HEADER_BYTES, rank_key
from maru.vllm.loadpolicy import LoadPolicy
from maru.vllm.requests import RequestState

THREADS = 1
"""Staging reads run one at a time: they share one link, and in turn each hit arrives a
whole transfer sooner than if all shared it and ended together (two nodes, four
requests at a time: the remote hit's TTFT 1.58-1.64x its own hit plus a transfer with
one thread, 1.68-1.76x with two, 1.9x with four). A read that hangs is ended by the
store's own deadline, which grows with its bytes."""
CLOSE_WAIT_S = 1.0
"""How long closing waits for staging reads still running (each has its deadline)."""


@dataclass(frozen=True)
class StagedObject:
    """One object of a hit: its key, the worker (share) and KV cache group it is of, and
    its blocks."""

    key: bytes
    share: int
    group: int
    blocks: int


def hit_shares(
    state: RequestState, groups: list[KVGroup], shares: int, chunk_tokens: int
) -> list[StagedObject]:
    """The objects of the request's hit beyond vLLM's own: each chunk's, then its tail's,
    per KV cache group, per worker (`keys.rank_key`)."""
    chunks = state.keys[state.local_tokens // chunk_tokens : state.hit_chunks]
    tail = [(state.tail.key, state.tail.blocks)] if state.tail else []
    objects = [(key, None) for key in chunks] + tail
    return [
        StagedObject(
            rank_key(key, share, group.index),
            share,
            group.index,
            group.stored_blocks(chunk_tokens) if blocks is None else blocks,
        )
        for key, blocks in objects
        for group in groups
        for share in range(shares)
    ]


def can_stage(store: Backend | None) -> bool:
    """Does reading this store's lower tiers promote into memory every worker on the node
    maps (a tiered store over a shm or cxl pool)?"""
    return bool(store is not None and getattr(store, "promotes_into_shared_memory", False))


class Staging:
    """Staging reads in flight and ended, by request; see the module docstring."""

    def __init__(self, settings: AsyncLoads, policy: LoadPolicy) -> None:
        self.settings = settings
        self.policy = policy
        """Learns the load rate from each staging read (`maru.vllm.loadpolicy`)."""
        self.fetcher = Fetcher(threads=THREADS)
        self.block_bytes: dict[tuple[int, int], int] = {}
        """Bytes of one block of a worker's (share's) object of a KV cache group, as the
        workers report them (`MaruWorkerMeta`)."""
        self._reading: set[str] = set()
        """Requests whose staging read was started and not asked for since it ended."""
        self._ended: dict[str, bool] = {}
        """Requests whose staging read ended: did every object arrive?"""

    def learn(self, block_bytes: Iterable[tuple[int, int, int]]) -> None:
        """What the workers said their objects' blocks weigh: (share, group, bytes)."""
        self.block_bytes.update(((s, g), b) for s, g, b in block_bytes)

    def start(self, req_id: str, store: Backend, objects: list[StagedObject], tokens: int) -> bool:
        """Start reading the objects (of a hit of `tokens` tokens) into the store's first
        tier; False where that cannot start (an object's size unknown, or the queue
        full): load them in the background."""
        sizes = [self.block_bytes.get((o.share, o.group)) for o in objects]
        if not objects or None in sizes:
            return False
        nbytes = [HEADER_BYTES + o.blocks * size for o, size in zip(objects, sizes, strict=True)]
        keys = [o.key for o in objects]
        seconds = self.settings.deadline_s(sum(nbytes))
        if not self.fetcher.submit(req_id, lambda: store.fetch_many(keys, nbytes), seconds):
            return False
        self._reading.add(req_id)
        self.policy.load_planned(req_id, tokens, groups=len({o.group for o in objects}))
        return True

    def ended(self, req_id: str) -> bool | None:
        """None while the request's staging read runs; then whether every object arrived."""
        for fetched in self.fetcher.take():
            if fetched.tag in self._reading:
                self._ended[fetched.tag] = _arrived(fetched)
        arrived = self._ended.pop(req_id, None)
        if arrived is not None:
            self._reading.discard(req_id)
            self.policy.load_ended(req_id, loaded=arrived)
        return arrived

    def forget(self, req_id: str) -> None:
        """The request is gone (finished, aborted): what its read brings is dropped."""
        self._reading.discard(req_id)
        self._ended.pop(req_id, None)

    def close(self) -> None:
        self.fetcher.close(CLOSE_WAIT_S)


def _arrived(fetched: Fetched) -> bool:
    return fetched.error is None and all(view is not None for view in fetched.result)
