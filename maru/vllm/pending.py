"""What a worker has in flight: chunks whose pages are being copied into their blocks
(loads) or into their reservations (saves)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from maru.transfer import ChunkCopy, Marker
from maru.vllm.metadata import ChunkTransfer


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
    group: int
    copy: ChunkCopy
    reservation: torch.Tensor
    """The reservation's memory (the copies land in `copy.payload`, here or in staging)."""
    staged: bool
    stack: ExitStack
    layers_done: set[str] = field(default_factory=set)
    copied: Marker | None = None
    """Set once every layer is queued: done when the copies are."""
    started: float = field(default_factory=time.perf_counter)
