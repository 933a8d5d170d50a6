"""What vLLM's `kv_role` lets an instance do, and the prefill/decode hand-off.

A producer (prefill instance) saves and loads only with `producer_loads`; a consumer
(decode instance) loads and never saves; `kv_both` does both. A producer's finished
request names, in its `kv_transfer_params`, the namespace and how many whole chunks it
stored; a consumer handed them waits for those chunks (its producer's saves may still be
committing) rather than miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maru.config import MaruConfig

HANDOFF = "maru"
"""The key of a producer's `kv_transfer_params`: {"namespace", "chunks"} it stored."""


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
    def names_chunks(self) -> bool:
        """Does a finished request say what it stored (`handoff`)?"""
        return self.name == "kv_producer"

    @property
    def waits(self) -> bool:
        """Does a request wait for the chunks its producer named (`named_chunks`)?"""
        return self.name == "kv_consumer"


def handoff(namespace: str, chunks: int) -> dict[str, Any]:
    """A producer's `kv_transfer_params`: its first `chunks` chunks are in `namespace`."""
    return {HANDOFF: {"namespace": namespace, "chunks": chunks}}


def named_chunks(request: Any, namespace: str) -> int | None:
    """The chunks a request's producer stored in `namespace` (its `kv_transfer_params`);
    None if it names none there (other params, or client input of another shape)."""
    params = getattr(request, "kv_transfer_params", None)
    named = params.get(HANDOFF) if isinstance(params, dict) else None
    if not isinstance(named, dict) or named.get("namespace") != namespace:
        return None
    chunks = named.get("chunks")
    return chunks if isinstance(chunks, int) else None
