"""Tails: a prompt's whole blocks after its last whole chunk, stored as one short object.

vLLM's own prefix cache hits every whole block of a prompt it has seen; whole chunks
alone leave up to a chunk less one block to compute again (a 1057-token prompt in
256-token chunks: 33 tokens instead of 1). So a request that computed its prompt also
saves the blocks after its whole chunks as one object, keyed like a chunk by the hash of
its last block (hashes are chained: it names the whole prefix). The same prompt finds it
with its chunks; a longer one that begins with it (a chat's next turn) finds it by
probing, after the whole chunks its lookup stopped at, the keys ending at each block of
the next chunk, longest first.

Only where every KV cache group is full attention: a window's or a state's object holds
what resumes at a chunk's end, and a tail ends elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maru.vllm.groups import FULL, KVGroup
from maru.vllm.keys import chunk_key


@dataclass(frozen=True)
class Tail:
    """An object of `blocks` blocks (fewer than a chunk's) that follows `chunk` whole
    chunks."""

    key: bytes
    chunk: int
    blocks: int

    def block_range(self, blocks_per_chunk: int) -> range:
        """The tail's positions in the request's block table."""
        start = self.chunk * blocks_per_chunk
        return range(start, start + self.blocks)


def serves_tails(groups: list[KVGroup], block_size: int, hash_block_size: int) -> bool:
    """Can this KV cache have tails: full attention only, hashed per block?"""
    return bool(groups) and hash_block_size == block_size and all(g.kind == FULL for g in groups)


def whole_blocks(request: Any, block_size: int) -> int:
    """The prompt's whole blocks that have a hash."""
    return min(request.num_prompt_tokens // block_size, len(request.block_hashes))


def own_tail(request: Any, prefix: bytes, blocks_per_chunk: int, block_size: int) -> Tail | None:
    """The request's own tail: its prompt's whole blocks after its whole chunks; None
    where the prompt's whole blocks end on a chunk boundary."""
    blocks = whole_blocks(request, block_size)
    chunk, rest = divmod(blocks, blocks_per_chunk)
    if not rest:
        return None
    return Tail(chunk_key(prefix, request.block_hashes[blocks - 1]), chunk, rest)


def candidates(
    request: Any, prefix: bytes, chunk: int, blocks_per_chunk: int, block_size: int, past: int
) -> list[Tail]:
    """Every tail that could follow the request's first `chunk` whole chunks and ends
    after token `past` (vLLM's own hit), longest first (within the prompt's whole
    blocks)."""
    start = chunk * blocks_per_chunk
    longest = min(blocks_per_chunk - 1, whole_blocks(request, block_size) - start)
    shortest = max(1, past // block_size - start + 1)
    hashes = request.block_hashes
    return [
        Tail(chunk_key(prefix, hashes[start + blocks - 1]), chunk, blocks)
        for blocks in range(longest, shortest - 1, -1)
    ]
