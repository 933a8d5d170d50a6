"""What vLLM's `kv_role` lets an instance do, and the prefill/decode hand-off.

A producer (prefill instance) saves and loads only with `producer_loads`; a consumer
(decode instance) loads and never saves; `kv_both` does both. A producer's finished
request names, in its `kv_transfer_params`, the namespace, how many whole chunks it
stored and how many blocks its tail holds (`maru.vllm.tails`); a consumer handed them
waits for those objects (its producer's saves may still be committing) rather than miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maru.config import MaruConfig

HANDOFF = "maru"
"""The key of a producer's `kv_transfer_params`: {"namespace", "chunks", "tail"}."""


@dataclass(frozen=True)
class Handoff:
    """What a producer stored of a request: its first `chunks` chunks, then a tail of
    `tail` blocks (0: none)."""

    chunks: int
    tail: int = 0

    def found(self, hit_chunks: int, chunks: int, tail_blocks: int | None) -> bool:
        """Does a lookup that found `hit_chunks` of the prompt's `chunks` whole chunks,
        then a tail of `tail_blocks` blocks (None: this instance serves no tails), find
        all this names?"""
        named = min(self.chunks, chunks)
        if hit_chunks != named:
            return hit_chunks > named
        return tail_blocks is None or tail_blocks >= self.tail


@dataclass(frozen=True)
class Role:
    """An instance's part in a deployment, from vLLM's kv_role."""

    name: str
    loads: bool
    saves: bool

    @classmethod
    def of(cls, vllm_config: Any, config: MaruConfig) -> Role:
        name = getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both"
        return cls(name, name != "kv_producer" or config.producer_loads, name != "kv_consumer")

    @property
    def names_objects(self) -> bool:
        """Does a finished request say what it stored (`handoff`)?"""
        return self.name == "kv_producer"

    @property
    def waits(self) -> bool:
        """Does a request wait for what its producer named (`named`)?"""
        return self.name == "kv_consumer"


def handoff(namespace: str, stored: Handoff) -> dict[str, Any]:
    """A producer's `kv_transfer_params`: what it stored of the request in `namespace`."""
    return {HANDOFF: {"namespace": namespace, "chunks": stored.chunks, "tail": stored.tail}}


def named(request: Any, namespace: str) -> Handoff | None:
    """What a request's producer stored in `namespace` (its `kv_transfer_params`); None
    if it names nothing there (other params, or client input of another shape)."""
    params = getattr(request, "kv_transfer_params", None)
    entry = params.get(HANDOFF) if isinstance(params, dict) else None
    if not isinstance(entry, dict) or entry.get("namespace") != namespace:
        return None
    chunks, tail = entry.get("chunks"), entry.get("tail", 0)
    if not isinstance(chunks, int) or not isinstance(tail, int):
        return None
    return Handoff(chunks, tail)
