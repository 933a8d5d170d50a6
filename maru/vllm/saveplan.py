"""Which objects each step saves: every chunk a request completes, per KV cache group, and
a request's own tail once its blocks are computed (the scheduler half's saves)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maru.vllm.events import request_blocks
from maru.vllm.groups import STATE, KVGroup
from maru.vllm.metadata import NULL_BLOCK, ChunkTransfer, MaruConnectorMetadata
from maru.vllm.requests import RequestState


@dataclass
class SavePlanner:
    """Plans saves into a step's metadata, and tells the KV events what they hold."""

    groups: list[KVGroup]
    chunk_tokens: int
    block_size: int
    events: Any = None
    """The KV events (`maru.vllm.events`), told each planned object; None: not published."""

    def plan(self, state: RequestState, computed: int, meta: MaruConnectorMetadata) -> None:
        """Plan the save of every chunk that completes with `computed` tokens, per group:
        what the group stores of it, if vLLM still holds all of it; and of the request's
        own tail once its blocks are computed."""
        complete = min(computed // self.chunk_tokens, len(state.keys))
        per_chunk = self.chunk_tokens // self.block_size
        for chunk in range(state.planned_chunks, complete):
            for group in self.groups:
                block_ids = self._saved_blocks(state, group, chunk, computed)
                if block_ids is not None and not state.stored[group.index][chunk]:
                    blocks = range(chunk * per_chunk, (chunk + 1) * per_chunk)
                    self._add_save(state, state.keys[chunk], group.index, block_ids, blocks, meta)
        state.planned_chunks = max(state.planned_chunks, complete)
        tail = state.own_tail
        positions = tail.block_range(per_chunk) if tail is not None else range(0)
        if tail is not None and computed >= positions.stop * self.block_size:
            state.own_tail = None
            for group in self.groups:
                block_ids = state.block_ids[group.index][positions.start : positions.stop]
                if len(block_ids) == tail.blocks and NULL_BLOCK not in block_ids:
                    self._add_save(state, tail.key, group.index, block_ids, positions, meta)

    def _add_save(
        self,
        state: RequestState,
        key: bytes,
        group: int,
        block_ids: list[int],
        blocks: range,
        meta: MaruConnectorMetadata,
    ) -> None:
        """Save `block_ids` of `group` as object `key`, which holds the request's `blocks`
        (what its KV event names)."""
        request = state.request
        meta.saves.append(ChunkTransfer(key, block_ids, req_id=request.request_id, group=group))
        state.saving = True
        if self.events is not None and group == 0:
            self.events.planned(key, request_blocks(request, blocks, self.block_size))

    def _saved_blocks(
        self, state: RequestState, group: KVGroup, chunk: int, computed: int
    ) -> list[int] | None:
        """The blocks of `group` that chunk `chunk`'s object holds; None where vLLM no
        longer holds them all (a state is only this step's, when it ends the chunk)."""
        end = (chunk + 1) * self.chunk_tokens
        if group.kind == STATE and computed != end:
            return None
        positions = group.stored_range(chunk, self.chunk_tokens)
        block_ids = state.block_ids[group.index][positions.start : positions.stop]
        if len(block_ids) != len(positions) or NULL_BLOCK in block_ids:
            return None
        return block_ids
