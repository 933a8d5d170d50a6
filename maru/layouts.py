"""Layout adapters: how a vLLM KV cache sits in memory, as whole pages by block id.

vLLM hands the connector one tensor per layer (or, up to 0.18, `layer.kv_cache`
is a list indexed by virtual engine). Shapes and strides differ by release and
attention backend (see docs/vllm-kv-facts.md). An adapter says which dimension
indexes blocks; from the strides, every layer is then cut into *segments*:
int8 views of shape (num_blocks, run_bytes), where run_bytes is the largest
dense run of bytes inside a block. A block of a layer is its segments' runs
(two for K/V-first tensors, one per head for head-outer layouts, one for
block-first dense pages). `maru.transfer` copies them as opaque bytes, never
reshaped, so nothing is silently copied or reinterpreted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from maru.errors import MaruError
from maru.hookspecs import hookimpl

MAX_SEGMENTS_PER_LAYER = 4096
"""A page cut into more runs than this means the layout was misread."""


class LayoutError(MaruError):
    """No adapter recognises the KV cache; the connector is disabled."""


def kv_tensor(container: Any, forward_context: Any = None) -> Any:
    """The KV tensor of one layer: a list/tuple is indexed by virtual engine (vLLM <= 0.18)."""
    if isinstance(container, (list, tuple)):
        return container[getattr(forward_context, "virtual_engine", 0)]
    return container


@dataclass(frozen=True)
class Segment:
    """One dense run of bytes per block: an int8 view of shape (num_blocks, run_bytes)."""

    view: Any

    @property
    def run_bytes(self) -> int:
        return int(self.view.shape[1])


def _byte_base(tensor: Any) -> Any:
    """A 1-D int8 tensor over the whole storage of `tensor` (no copy)."""
    import torch

    return torch.empty(0, dtype=torch.int8, device=tensor.device).set_(tensor.untyped_storage())


@dataclass(frozen=True)
class LayerCut:
    """A layer cut into per-block runs, and the order its page bytes are stored in:
    the dimensions that split a page into runs (outer, in logical order), then the
    dimensions inside a run (in memory order). Caches with equal orders, dtypes and
    shapes have interchangeable pages, wherever the pages sit."""

    segments: list[Segment]
    block_dim: int
    byte_order: tuple[tuple[int, ...], tuple[int, ...]]


def segments_of(tensor: Any, block_dim: int) -> LayerCut | None:
    """Cut a layer's tensor into per-block dense runs; None if the strides do not allow it."""
    import torch

    shape, strides, item = tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size()
    block_stride = strides[block_dim]
    others = sorted(
        (d for d in range(len(shape)) if d != block_dim and shape[d] > 1), key=lambda d: strides[d]
    )
    run, dense = [], 1
    for dim in others:
        if strides[dim] != dense or strides[dim] >= block_stride:
            break
        run.append(dim)
        dense *= shape[dim]
    parts = sorted(d for d in others if d not in run)
    if math.prod(shape[d] for d in parts) > MAX_SEGMENTS_PER_LAYER or dense > block_stride:
        return None
    base = _byte_base(tensor)
    segments = []
    for index in _indices([shape[d] for d in parts]):
        offset = tensor.storage_offset() + sum(
            i * strides[d] for i, d in zip(index, parts, strict=True)
        )
        view = torch.as_strided(
            base, (shape[block_dim], dense * item), (block_stride * item, 1), offset * item
        )
        segments.append(Segment(view))
    return LayerCut(segments, block_dim, (tuple(parts), tuple(reversed(run))))


def _indices(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    indices: list[tuple[int, ...]] = [()]
    for size in sizes:
        indices = [(*index, i) for index in indices for i in range(size)]
    return indices


def describe_tensor(tensor: Any) -> str:
    """Shape, strides, dtype and storage offset, for error messages."""
    if not hasattr(tensor, "stride"):
        return type(tensor).__name__
    return (
        f"shape {tuple(tensor.shape)} strides {tuple(tensor.stride())} {tensor.dtype} "
        f"offset {tensor.storage_offset()}"
    )


class LayoutAdapter:
    """Where the pages of every layer of a KV cache are, by block id.

    Subclasses say which dimension indexes blocks (`block_dim`); a plugin with
    an exotic layout may also override `segments`.
    """

    name: ClassVar[str]

    @classmethod
    def block_dim(cls, tensor: Any, num_blocks: int) -> int | None:
        """The dimension that indexes blocks, or None if this is not our layout."""
        raise NotImplementedError

    @classmethod
    def cut(cls, tensor: Any, num_blocks: int) -> LayerCut | None:
        """The layer cut into per-block runs, or None if not recognised."""
        if not hasattr(tensor, "stride") or tensor.dim() < 2:
            return None
        dim = cls.block_dim(tensor, num_blocks)
        return None if dim is None else segments_of(tensor, dim)

    def __init__(self, cuts: Mapping[str, LayerCut], fingerprint: str) -> None:
        self.layers = {name: cut.segments for name, cut in cuts.items()}
        self.fingerprint = fingerprint
        self.layer_block_bytes = {
            name: sum(s.run_bytes for s in segs) for name, segs in self.layers.items()
        }
        self.block_bytes = sum(self.layer_block_bytes.values())

    def layer_offsets(self, num_blocks: int) -> dict[str, int]:
        """Where each layer's pages start in an object holding `num_blocks` blocks."""
        offsets, position = {}, 0
        for name, size in self.layer_block_bytes.items():
            offsets[name] = position
            position += size * num_blocks
        return offsets


class BlocksFirst(LayoutAdapter):
    """(NB, ...) tensors: (NB, 2, BS, H, D), (NB, H, BS, 2D), MLA (NB, BS, D), and the
    vLLM >= 0.29 views into one shared buffer, block-first (cross-layer) layouts included."""

    name = "blocks-first"
    description = "(NB, ...) tensors and vLLM >= 0.29 views, any KVCacheLayout"

    @classmethod
    def block_dim(cls, tensor: Any, num_blocks: int) -> int | None:
        return 0 if tensor.shape[0] == num_blocks else None


class KVFirst(LayoutAdapter):
    """(2, NB, ...) tensors: K and V half a buffer apart, so a block is two half-pages."""

    name = "kv-first"
    description = "(2, NB, ...) tensors: K and V half a buffer apart"

    @classmethod
    def block_dim(cls, tensor: Any, num_blocks: int) -> int | None:
        return 1 if tensor.dim() >= 3 and tensor.shape[:2] == (2, num_blocks) else None


def cpu_page_packing() -> str:
    """What decides how vLLM's CPU attention packs bytes inside a page (AMX, AVX-512,
    NEON, ... kernels each have their own order): the machine and its matrix and vector
    units. Pages written by one packing are garbage to another."""
    import platform

    import torch

    units = [
        name
        for name, probe in (("amx", "_is_amx_tile_supported"), ("avx512", "_is_avx512_supported"))
        if getattr(torch.cpu, probe, lambda: False)()
    ]
    return "+".join([platform.machine(), *units])


def fingerprint(adapter_name: str, tensors: Mapping[str, Any], cuts: Mapping[str, LayerCut]) -> str:
    """What makes two caches' pages interchangeable: adapter, dtype, shapes, the order
    of the bytes in a page (not where pages sit, nor how many blocks there are), and on
    the CPU how its attention kernels pack them."""
    described: list[Any] = []
    if next(iter(tensors.values())).device.type == "cpu":
        described.append(cpu_page_packing())
    for name, tensor in tensors.items():
        shape = [size for dim, size in enumerate(tensor.shape) if dim != cuts[name].block_dim]
        described.append(
            [
                str(tensor.dtype),
                shape,
                cuts[name].byte_order,
                [s.run_bytes for s in cuts[name].segments],
            ]
        )
    text = json.dumps([adapter_name, len(described), described])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def recognise(
    kv_caches: Mapping[str, Any], num_blocks: int, adapters: Sequence[type[LayoutAdapter]]
) -> LayoutAdapter:
    """The first adapter that recognises every layer, or a LayoutError naming what was seen."""
    tensors = {name: kv_tensor(value) for name, value in kv_caches.items()}
    if not tensors:
        raise LayoutError("register_kv_caches gave no KV cache tensors")
    for adapter in adapters:
        cuts = {name: adapter.cut(tensor, num_blocks) for name, tensor in tensors.items()}
        if all(cuts.values()):
            return adapter(cuts, fingerprint(adapter.name, tensors, cuts))
    seen = sorted({describe_tensor(tensor) for tensor in tensors.values()})
    raise LayoutError(
        f"no layout adapter recognises this KV cache ({len(tensors)} layers, {num_blocks} "
        f"blocks; seen: {'; '.join(seen)}); adapters tried: "
        f"{', '.join(a.name for a in adapters)}. The maru connector is disabled; a plugin "
        "can add an adapter through the maru_layout_adapters hook"
    )


@hookimpl
def maru_layout_adapters() -> list[type[LayoutAdapter]]:
    return [KVFirst, BlocksFirst]


def guess_num_blocks(kv_caches: dict[str, Any]) -> int:
    """Without a KVCacheConfig's block count (old vLLM): the leading dimension, after
    a K/V split."""
    tensor = kv_tensor(next(iter(kv_caches.values())))
    return int(tensor.shape[1] if tensor.dim() >= 3 and tensor.shape[0] == 2 else tensor.shape[0])
