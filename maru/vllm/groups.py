"""The KV cache groups maru serves, and what a chunk stores of each.

Since vLLM's hybrid KV cache manager a model's KV cache is a set of groups (full
attention, sliding window, Mamba or linear-attention state), each with its own layers,
block size and block ids. The groups alias one block pool: block id `b` of one group and
of another can be the same bytes, so a group's block ids are copied only through its own
layers, and block 0 is vLLM's null block (what a group holds where it dropped a block),
never loaded into or saved from.

Per chunk and group, maru stores what that group needs to resume at the chunk's end, by
vLLM's own rule for that kind of group (docs/vllm-hybrid-groups.md, section 3):

- full attention: every block of the chunk (a hit needs every block before it);
- sliding window: the chunk's last cdiv(window - 1, block size) blocks (a hit needs only
  the last window before it; vLLM drops the blocks behind it);
- Mamba / linear-attention state: the chunk's last block, which holds the state after its
  last token (vLLM's `mamba_cache_mode="align"`).

A hit is where every group can be served. A group of any other kind turns the connector
off with one error naming it, never a guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from maru.errors import ConfigError, MaruError
from maru.vllm.compat import has_hook, vllm_version

FULL, WINDOW, STATE = "full attention", "sliding window", "state"
SPEC_KINDS = {
    "FullAttentionSpec": FULL,
    "MLAAttentionSpec": FULL,
    "SlidingWindowSpec": WINDOW,
    "MambaSpec": STATE,
}
"""Specs by exact class name (their subclasses, such as sink or chunked-local attention,
keep other blocks) and the kind of group each makes."""
SIGNATURE_FIELDS = {
    WINDOW: ("sliding_window", "extra_retained_tokens"),
    STATE: ("shapes", "dtypes", "mamba_type"),
}
"""What, besides kind and block size, makes one group's chunks another's (a window's
size; a state's tensors and their dtypes, and the recurrence that made them)."""


class UnservedGroups(MaruError):
    """The KV cache has a group maru cannot serve; the connector stays off."""


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group as maru serves it."""

    index: int
    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    window: int = 0
    """Tokens a sliding window keeps (vLLM's window plus any extra retained tokens)."""
    signature: str = ""
    """What makes chunks of this group interchangeable (goes into the namespace)."""

    def stored_blocks(self, chunk_tokens: int) -> int:
        """Blocks of this group an object of one chunk holds."""
        per_chunk = chunk_tokens // self.block_size
        if self.kind == WINDOW:
            return min(per_chunk, -(-(self.window - 1) // self.block_size))
        return 1 if self.kind == STATE else per_chunk

    def stored_range(self, chunk: int, chunk_tokens: int) -> range:
        """The group's block positions (in the request's block table) that chunk `chunk`'s
        object holds: always the chunk's last ones."""
        end = (chunk + 1) * (chunk_tokens // self.block_size)
        return range(end - self.stored_blocks(chunk_tokens), end)

    def fresh_range(self, local_tokens: int, hit_tokens: int) -> range:
        """The block positions vLLM gives this group new blocks for when `hit_tokens`
        are computed, `local_tokens` of them from its own cache: what a load fills."""
        start, end = local_tokens // self.block_size, -(-hit_tokens // self.block_size)
        if self.kind == WINDOW:
            start = max(start, max(0, hit_tokens - self.window + 1) // self.block_size)
        elif self.kind == STATE:
            start = max(start, end - 1)
        return range(start, end)

    @property
    def described(self) -> str:
        return f"group {self.index} ({self.kind}, {len(self.layer_names)} layers)"


def kv_groups(kv_cache_config: Any, block_size: int) -> list[KVGroup]:
    """The groups of a KV cache configuration; one full-attention group where this vLLM
    hands the connector none. UnservedGroups names a group of another kind, or says why
    this release cannot have several."""
    specs = getattr(kv_cache_config, "kv_cache_groups", None)
    if not specs:
        return [KVGroup(0, FULL, block_size, (), signature=f"{FULL}/{block_size}")]
    groups = [_group(index, spec) for index, spec in enumerate(specs)]
    if len(groups) > 1 and not has_hook("get_transfer_results"):
        raise UnservedGroups(
            f"this model's KV cache has {len(groups)} groups, and vLLM {vllm_version()} "
            "cannot take a failed load of one request on such a model (it raises on "
            "block-level load errors with several groups; KVConnectorTransferResults came "
            "later): upgrade vLLM, or start it with --disable-hybrid-kv-cache-manager where "
            "the model allows"
        )
    return groups


def _group(index: int, group: Any) -> KVGroup:
    specs = _layer_specs(group.kv_cache_spec)
    kinds = {SPEC_KINDS.get(type(spec).__name__) for spec in specs}
    names = "/".join(sorted({type(spec).__name__ for spec in specs}))
    where = f"KV cache group {index} ({names} of {len(group.layer_names)} layers)"
    if None in kinds or len(kinds) != 1:
        raise UnservedGroups(f"{where}: maru serves groups of {', '.join(sorted(SPEC_KINDS))} only")
    spec, kind = specs[0], kinds.pop()
    if kind == STATE and getattr(spec, "mamba_cache_mode", "none") != "align":
        raise UnservedGroups(
            f"{where} keeps its state only at the end of the prompt (mamba_cache_mode "
            f"{getattr(spec, 'mamba_cache_mode', 'none')!r}); maru needs it at block "
            "boundaries: mamba_cache_mode 'align', vLLM's default with prefix caching"
        )
    window = (
        spec.sliding_window + getattr(spec, "extra_retained_tokens", 0) if kind == WINDOW else 0
    )
    return KVGroup(
        index, kind, spec.block_size, tuple(group.layer_names), window, _signature(kind, spec)
    )


def _signature(kind: str, spec: Any) -> str:
    fields = [name for name in SIGNATURE_FIELDS.get(kind, ()) if hasattr(spec, name)]
    described = [f"{name}={getattr(spec, name)}" for name in fields]
    return "/".join([kind, str(spec.block_size), *described])


def _layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs behind a group's spec (a uniform group wraps several)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) else [spec]


def check_chunk_tokens(groups: list[KVGroup], chunk_tokens: int) -> None:
    """A chunk must end on a block boundary of every group; ConfigError names the
    group that it does not."""
    for group in groups:
        if chunk_tokens % group.block_size:
            allowed = math.lcm(*(g.block_size for g in groups))
            where = (
                "vLLM's block size" if len(groups) == 1 else f"the block size of {group.described}"
            )
            raise ConfigError(
                f"chunk_tokens = {chunk_tokens}: not a multiple of {where} "
                f"({group.block_size}); allowed: a multiple of {allowed}"
            )


def loads_async(groups: list[KVGroup]) -> bool:
    """Do loads end per request (`get_finished`), a failed one failing its request, not
    its blocks? With several groups that is vLLM's only failure path
    (`KVConnectorTransferResults.failed_recving`, asynchronous loads only)."""
    return len(groups) > 1


def hit_tokens(chunks: int, prompt_tokens: int, chunk_tokens: int, tail_tokens: int = 0) -> int:
    """Tokens a hit of `chunks` whole chunks (and a tail's tokens after them) lets vLLM
    skip (never the last prompt token, which must be computed to sample)."""
    return min(chunks * chunk_tokens + tail_tokens, prompt_tokens - 1)


def hit_chunks(
    groups: list[KVGroup],
    stored: list[list[bool]],
    local_tokens: int,
    prompt_tokens: int,
    chunk_tokens: int,
) -> int:
    """The most chunks at whose end every group can be served: each group's new blocks
    there are in objects the store holds (`stored`, per group and chunk); at least the
    chunks vLLM holds itself (`local_tokens`)."""
    local = local_tokens // chunk_tokens
    chunks = len(stored[0]) if stored else 0
    for group in groups:
        if group.kind == FULL:  # every chunk from the local hit on: a leading run
            run = local
            while run < chunks and stored[group.index][run]:
                run += 1
            chunks = run
        else:  # a window or a state is stored only at a chunk's very end
            chunks = min(chunks, (prompt_tokens - 1) // chunk_tokens)
    for candidate in range(chunks, local, -1):
        hit = hit_tokens(candidate, prompt_tokens, chunk_tokens)
        if hit > local_tokens and all(
            stored[g.index][position // (chunk_tokens // g.block_size)]
            for g in groups
            if g.kind != FULL
            for position in g.fresh_range(local_tokens, hit)
        ):
            return candidate
    return local
