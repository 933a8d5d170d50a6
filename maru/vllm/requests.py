"""What the scheduler half remembers about a request between calls."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from maru.vllm.metadata import ChunkTransfer
from maru.vllm.tails import Tail


@dataclass
class RequestState:
    """What the scheduler half remembers about a request between calls."""

    request: Any
    keys: list[bytes]
    stored: list[list[bool]]
    """Per group, per chunk: not to save, as the store held it at the lookup (or, without
    an answer, vLLM computed it earlier)."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Per group: the request's block table (0 where vLLM holds its null block)."""
    local_tokens: int = 0
    planned_chunks: int = 0
    """Chunks before this one are stored or have had their save planned."""
    saving: bool = False
    """A save was planned: the worker reports when it is done, and vLLM keeps the blocks
    until then."""
    loads: list[ChunkTransfer] = field(default_factory=list)
    hit_chunks: int = 0
    """The lookup's answer: chunks at whose end every group can be served."""
    tail: Tail | None = None
    """The rest of the answer: a tail object of blocks after those chunks."""
    own_tail: Tail | None = None
    """The request's own tail, to save once its prompt is computed (None: the store
    holds it, or the prompt has none)."""
    looked_up_at: float = field(default_factory=time.monotonic)
    allocated: bool = False
    """vLLM allocated the request's blocks: its lookup's outcome is counted."""
    background: bool = False
    """Its hit loads in the background: vLLM waits for it (`maru.vllm.asyncloads`)."""
    judged: bool = False
    """Its hit on a slow tier has the policy's verdict (`maru.vllm.loadpolicy`)."""
    staging: bool = False
    """Its slow hit is being read into the node's memory (`maru.vllm.staging`)."""
    staged: bool = False
    """Its slow hit's staging read ended: what it loads is settled."""
