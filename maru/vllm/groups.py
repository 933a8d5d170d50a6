"""Which KV cache groups maru can serve: one group of full attention.

Since vLLM's hybrid KV cache manager a model's KV cache is a set of groups (full
attention, sliding window, Mamba state, ...), each with its own block ids. maru stores
whole chunks of one full-attention group. A group that drops blocks (a sliding window
frees the blocks behind it and hands out the null block in their place) or keeps a
state instead of pages would make maru save pages it no longer owns and load into the
null block: another instance would then read wrong KV. So anything else turns the
connector off with one error naming the group, never a guess (the connector declares
vLLM's `SupportsHMA`, so vLLM keeps its hybrid allocator on and such models start). How
vLLM handles groups, for the support to come: docs/vllm-hybrid-groups.md.
"""

from __future__ import annotations

from typing import Any

FULL_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
"""Specs (by exact class: their subclasses, such as sink or reference-sliding-window
attention, evict blocks) whose every block stays the request's until it finishes."""


def unsupported_groups(kv_cache_config: Any) -> str | None:
    """Why maru cannot serve this KV cache configuration; None if it can (or if this vLLM
    hands the connector no configuration to tell)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return None
    if len(groups) > 1:
        kinds = ", ".join(_described(group) for group in groups)
        advice = PROMOTE if all(_promotable(group) for group in groups) else ""
        return (
            f"this model's KV cache has {len(groups)} groups ({kinds}); maru serves "
            f"one group of full attention{advice}"
        )
    specs = _layer_specs(groups[0].kv_cache_spec)
    if not all(type(spec).__name__ in FULL_ATTENTION_SPECS for spec in specs):
        return (
            f"this model's KV cache group is {_described(groups[0])}; maru serves only "
            "full attention, whose blocks stay the request's"
        )
    return None


PROMOTE = (
    " (to share its KV through maru, start vLLM with --disable-hybrid-kv-cache-manager: "
    "it then keeps every token of the sliding-window layers, as for full attention, at "
    "that memory cost)"
)
PROMOTED_SPECS = (
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "SlidingWindowMLASpec",
    "ChunkedLocalAttentionSpec",
)
"""Specs that vLLM, with its hybrid allocator off, turns into one full-attention group."""


def _promotable(group: Any) -> bool:
    specs = _layer_specs(group.kv_cache_spec)
    return all(type(spec).__name__ in PROMOTED_SPECS for spec in specs)


def _layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs behind a group's spec (a uniform group wraps several)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) else [spec]


def _described(group: Any) -> str:
    kinds = sorted({type(spec).__name__ for spec in _layer_specs(group.kv_cache_spec)})
    return f"{'/'.join(kinds)} of {len(group.layer_names)} layers"
