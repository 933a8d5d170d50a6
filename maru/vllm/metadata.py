"""What travels between the halves: the scheduler's plan for each step, to the workers,
and each worker's layout, once, to the scheduler. Only keys and block ids travel: the
pages move between the store and the KV cache inside each worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from maru.vllm import compat

NO_DATA_PATH = "unrecognised"
"""The fingerprint a worker reports when its layout or device has no data path."""
NULL_BLOCK = 0
"""vLLM's null block: what a group's table holds where it dropped or skipped a block
(shared by every group, never loaded into or saved from)."""


@dataclass
class ChunkTransfer:
    """One chunk of one KV cache group to load or save: its key and the group's blocks
    it covers."""

    key: bytes
    block_ids: list[int]
    first_block: int = 0
    """Index, in the object, of block_ids[0] (a load may skip locally computed blocks)."""
    req_id: str = ""
    group: int = 0
    """The KV cache group (`maru.vllm.groups`): its layers' pages, its block ids."""
    background: bool = False
    """A load read off the engine's thread and reported by `get_finished`
    (`maru.vllm.asyncloads`)."""


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
    """Worker to scheduler, once at start-up: the layout that goes into the key namespace.
    (MultiConnector hands every child its first child's handshake, so behind another
    connector this one may never arrive: `MaruWorkerMeta` carries the same.)"""

    layout_fingerprint: str
    block_bytes: frozenset[tuple[int, int, int]] = frozenset()
    """As `MaruWorkerMeta.block_bytes`, known before the first request."""


@dataclass(frozen=True)
class MaruWorkerMeta(compat.KVConnectorWorkerMetadata):
    """Worker to scheduler, every step, on the channel vLLM keeps per connector (also
    behind MultiConnector): the workers' layouts, and the bytes of one block of each
    worker's objects of each KV cache group, as (worker, group, bytes)."""

    layout_fingerprints: frozenset[str]
    block_bytes: frozenset[tuple[int, int, int]] = frozenset()

    def aggregate(self, other: MaruWorkerMeta) -> MaruWorkerMeta:
        return MaruWorkerMeta(
            self.layout_fingerprints | other.layout_fingerprints,
            self.block_bytes | other.block_bytes,
        )
