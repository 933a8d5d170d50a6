"""Layout adapters: every row of the vLLM facts table round-trips, unknown layouts are refused."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

import maru
from maru.layouts import (
    BlocksFirst,
    KVFirst,
    LayoutAdapter,
    LayoutError,
    kv_tensor,
    recognise,
)
from maru.plugins import MaruPluginManager, get_plugin_manager
from maru.transfer import Blocks, ChunkCopy, DataPath

NB, BS, H, D, LAYERS = 12, 32, 2, 64, 3
BUILTINS = [KVFirst, BlocksFirst]


def filled(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """Random bytes in every element of a (possibly strided) view."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 127, tensor.shape, dtype=torch.int8, generator=generator)
    tensor.view(torch.int8).copy_(raw) if tensor.element_size() == 1 else tensor.copy_(
        raw.to(torch.float32).to(tensor.dtype)
    )
    return tensor


def permuted(physical: tuple[int, ...], order: tuple[int, ...], dtype=torch.bfloat16):
    """A tensor allocated in `physical` order and viewed in logical order (no copy)."""
    return torch.zeros(physical, dtype=dtype).permute(order)


ROWS = {
    # vLLM <= 0.22 FlashAttention / Flex / Triton <= 0.10.2: K/V first
    "flash<=0.22 (2,NB,BS,H,D)": lambda: torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16),
    # CPU backend 0.11.2-0.22
    "cpu<=0.22 (2,NB,H,BS,D)": lambda: torch.zeros(2, NB, H, BS, D, dtype=torch.bfloat16),
    # 0.23-0.25 FlashAttention, FlashInfer, Triton: blocks first, NHD and HND strides
    "flash 0.23 (NB,2,BS,H,D) NHD": lambda: torch.zeros(NB, 2, BS, H, D, dtype=torch.float16),
    "flash 0.23 (NB,2,BS,H,D) HND": lambda: permuted((NB, 2, H, BS, D), (0, 1, 3, 2, 4)),
    # 0.26-0.28 and the CPU backend 0.23+: (NB, H, BS, 2D)
    "0.26 (NB,H,BS,2D) HND": lambda: torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16),
    "0.26 (NB,H,BS,2D) NHD": lambda: permuted((NB, BS, H, 2 * D), (0, 2, 1, 3)),
    # MLA: no K/V split
    "mla (NB,BS,D)": lambda: torch.zeros(NB, BS, 576, dtype=torch.bfloat16),
    "mla>=0.29 (NB,1,BS,C)": lambda: torch.zeros(NB, 1, BS, 576, dtype=torch.bfloat16),
    # fp8 caches are stored as uint8
    "fp8 (NB,H,BS,2D)": lambda: torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8),
    # Mamba / linear-attention state >= 0.32: raw int8 pages padded to the attention page
    "mamba>=0.32 (NB,1,1,S) int8": lambda: torch.as_strided(
        torch.zeros(NB, 8192, dtype=torch.int8), (NB, 1, 1, 5000), (8192, 5000, 5000, 1)
    ),
}


def block_bytes(tensor: torch.Tensor, block: int, dim: int) -> bytes:
    """The bytes of one block, read independently of the adapters."""
    page = tensor.select(dim, block).contiguous()
    return (
        page.view(torch.uint8).numpy().tobytes()
        if page.element_size() == 1
        else page.view(torch.int16 if page.element_size() == 2 else torch.int32).numpy().tobytes()
    )


def block_dim_of(tensor: torch.Tensor) -> int:
    return 1 if tensor.dim() >= 3 and tuple(tensor.shape[:2]) == (2, NB) else 0


def save(adapter: LayoutAdapter, ids: list[int], payload: torch.Tensor) -> None:
    """Every layer's pages of blocks `ids` into `payload`."""
    engine = DataPath(adapter)
    for name in adapter.layers:
        engine.save_layer(name, [ChunkCopy(Blocks(ids), payload, len(ids))])


def round_trip(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> None:
    """Pages of blocks 1, 4, 7 of `source` land in blocks 9, 2, 5 of `target`, and nothing
    else in `target` changes."""
    reader = recognise(source, NB, BUILTINS)
    writer = recognise(target, NB, BUILTINS)
    assert reader.fingerprint == writer.fingerprint
    ids_from, ids_to = [1, 4, 7], [9, 2, 5]
    before = {
        name: {b: block_bytes(t, b, block_dim_of(t)) for b in range(NB)}
        for name, t in target.items()
    }
    stored = torch.empty(reader.block_bytes * 3, dtype=torch.int8)
    save(reader, ids_from, stored)
    DataPath(writer).load([ChunkCopy(Blocks(ids_to), stored, 3)])
    for name, tensor in target.items():
        dim = block_dim_of(tensor)
        for src, dst in zip(ids_from, ids_to, strict=True):
            assert block_bytes(tensor, dst, dim) == block_bytes(source[name], src, dim)
        for block in set(range(NB)) - set(ids_to):
            assert block_bytes(tensor, block, dim) == before[name][block], "untouched block"


@pytest.mark.parametrize("row", ROWS)
def test_every_row_round_trips(row: str) -> None:
    source = {f"layer{i}": filled(ROWS[row](), seed=i) for i in range(LAYERS)}
    target = {f"layer{i}": filled(ROWS[row](), seed=100 + i) for i in range(LAYERS)}
    round_trip(source, target)


@pytest.mark.parametrize("row", ROWS)
def test_rows_are_recognised_by_the_expected_adapter(row: str) -> None:
    tensor = ROWS[row]()
    adapter = recognise({"l": tensor}, NB, BUILTINS)
    assert adapter.name == ("kv-first" if row.startswith(("flash<=", "cpu<=")) else "blocks-first")
    parts = len(adapter.layers["l"])
    assert parts == (2 if adapter.name == "kv-first" else 1)


def shared_buffer_allocation(layout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """KV caches exactly as vLLM >= 0.29 allocates them: views into one int8 buffer."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    fixed_block = page * LAYERS if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NB, LAYERS, layout, fixed_strides=(None, fixed_block, None, None, None)
    )
    tensor = KVCacheTensor(
        size=page * LAYERS * NB, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    config = KVCacheConfig(
        num_blocks=NB, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    views = allocate_kv_cache(config, torch.device("cpu"), layout)
    assert len({v.untyped_storage().data_ptr() for v in views.values()}) == 1
    return views


def per_layer_allocation(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """KV caches as vLLM < 0.29 allocates them on the CPU: a tensor per layer, shaped by
    the CPU attention backend ((2, NB, H, BS, D) up to 0.22, blocks first from 0.23)."""
    from vllm.v1.attention.backends import cpu_attn

    backend = next(
        c
        for c in vars(cpu_attn).values()
        if isinstance(c, type)
        and c.__module__ == cpu_attn.__name__
        and "get_kv_cache_shape" in vars(c)
    )
    shape = backend.get_kv_cache_shape(NB, BS, H, D)
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=dtype) for i in range(LAYERS)
    }


def vllm_allocations() -> dict[str, Callable[[torch.dtype], dict[str, torch.Tensor]]]:
    """The KV caches the installed vLLM allocates, by name: every KVCacheLayout from 0.29
    (views into one shared buffer), else the CPU backend's tensor per layer."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return {"per-layer": per_layer_allocation}
    return {
        layout.name: functools.partial(shared_buffer_allocation, layout) for layout in KVCacheLayout
    }


VLLM_ALLOCATIONS = vllm_allocations()


def allocate(kind: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """The installed vLLM's allocation `kind`, every layer filled with random bytes."""
    return {
        name: filled(view, seed + i)
        for i, (name, view) in enumerate(VLLM_ALLOCATIONS[kind](dtype).items())
    }


def page_in_memory_order(tensor: torch.Tensor, block: int) -> list[float]:
    """A block's elements in the order of their addresses, where every element holds its
    logical index within the block: equal lists mean interchangeable pages."""
    dim = block_dim_of(tensor)
    page = tensor.select(dim, block)
    addresses = torch.zeros(page.shape, dtype=torch.int64)
    for axis, (size, stride) in enumerate(zip(page.shape, page.stride(), strict=True)):
        shape = [1] * page.dim()
        shape[axis] = size
        addresses = addresses + torch.arange(size).view(shape) * stride
    logical = torch.arange(page.numel(), dtype=torch.float32).view(page.shape)
    return logical.flatten()[addresses.flatten().argsort()].tolist()


@pytest.mark.parametrize("source_kind", VLLM_ALLOCATIONS)
def test_pages_move_between_every_pair_of_vllm_allocations_alike(source_kind: str) -> None:
    """Pages move between any two of the installed vLLM's allocations with one fingerprint
    (e.g. layer- and block-outermost views of one page order), layers at any offset."""
    source = allocate(source_kind)
    fingerprint = recognise(source, NB, BUILTINS).fingerprint
    alike = [
        kind
        for kind in VLLM_ALLOCATIONS
        if recognise(allocate(kind), NB, BUILTINS).fingerprint == fingerprint
    ]
    assert source_kind in alike
    for kind in alike:
        round_trip(source, allocate(kind, seed=50))


LAYER_AND_BLOCK_OUTERMOST = (("LBHNC", "BLHNC"), ("LBNHC", "BLNHC"), ("LHBNC", "BHLNC"))
"""vLLM >= 0.29 layouts that differ only in whether layers or blocks are outermost."""


def test_one_fingerprint_means_interchangeable_pages() -> None:
    """Two of the installed vLLM's allocations share a fingerprint only if their pages hold
    the same bytes in the same order; where pages sit (layer- or block-outermost) does not
    matter, nor how many blocks there are; the dtype does."""
    pages, prints = {}, {}
    for kind, allocation in VLLM_ALLOCATIONS.items():
        tensor = next(iter(allocation(torch.float32).values()))
        pages[kind] = page_in_memory_order(tensor, 3)
        prints[kind] = recognise(allocation(torch.float32), NB, BUILTINS).fingerprint
    for a in VLLM_ALLOCATIONS:
        for b in VLLM_ALLOCATIONS:
            assert prints[a] != prints[b] or pages[a] == pages[b], (a, b)
    for a, b in LAYER_AND_BLOCK_OUTERMOST:
        assert (a in prints) == (b in prints)
        assert prints.get(a) == prints.get(b), (a, b)
    assert (
        recognise({"l": torch.zeros(NB, H, BS, 2 * D)}, NB, BUILTINS).fingerprint
        != recognise(
            {"l": torch.zeros(NB, H, BS, 2 * D, dtype=torch.float16)}, NB, BUILTINS
        ).fingerprint
    )


def test_the_fingerprint_ignores_how_many_blocks_there_are() -> None:
    small = recognise({"l": torch.zeros(NB, H, BS, 2 * D)}, NB, BUILTINS)
    large = recognise({"l": torch.zeros(3 * NB, H, BS, 2 * D)}, 3 * NB, BUILTINS)
    assert small.fingerprint == large.fingerprint


def test_a_list_container_is_indexed_by_virtual_engine() -> None:
    first, second = torch.zeros(NB, H, BS, D), torch.ones(NB, H, BS, D)

    class OldForwardContext:
        virtual_engine = 1

    assert kv_tensor([first, second]) is first, "no virtual_engine attribute: engine 0"
    assert kv_tensor((first, second), OldForwardContext()) is second
    assert kv_tensor(first, OldForwardContext()) is first
    adapter = recognise({"l": [first, second]}, NB, BUILTINS)
    assert adapter.name == "blocks-first"


def test_an_unknown_layout_is_refused_with_the_shapes_and_strides_seen() -> None:
    weird = torch.zeros(BS, NB, H, D)
    with pytest.raises(LayoutError) as caught:
        recognise({"a": weird, "b": weird}, NB, BUILTINS)
    message = str(caught.value)
    assert f"shape {(BS, NB, H, D)} strides {weird.stride()}" in message
    assert "2 layers, 12 blocks" in message and "adapters tried: kv-first, blocks-first" in message
    assert isinstance(caught.value, maru.MaruError)


class BlocksLast(LayoutAdapter):
    """A third-party layout: the block index is the last dimension."""

    name = "blocks-last"

    @classmethod
    def block_dim(cls, tensor, num_blocks):
        return tensor.dim() - 1 if tensor.shape[-1] == num_blocks else None


class BlocksLastPlugin:
    @staticmethod
    @maru.hookimpl
    def maru_layout_adapters():
        return [BlocksLast]


def test_a_plugin_adapter_is_used_for_a_layout_the_builtins_do_not_know() -> None:
    manager = MaruPluginManager(load_entry_points=False, plugins=[BlocksLastPlugin])
    adapters = [p.cls for p in manager.layout_adapters.values()]
    assert [a.name for a in adapters] == ["kv-first", "blocks-first", "blocks-last"]
    exotic = {"l": filled(torch.zeros(H, BS, D, NB), 1)}
    chosen = recognise(exotic, NB, adapters)
    assert chosen.name == "blocks-last"
    stored = torch.empty(chosen.block_bytes, dtype=torch.int8)
    save(chosen, [3], stored)
    assert stored.numpy().tobytes() == block_bytes(exotic["l"], 3, 3)
    assert recognise({"l": torch.zeros(NB, H, BS, D)}, NB, adapters).name == "blocks-first"


def test_the_builtin_adapters_are_registered_through_the_hook() -> None:
    adapters = get_plugin_manager().layout_adapters
    assert adapters["kv-first"].cls is KVFirst
    assert adapters["blocks-first"].plugin.distribution == "maru"


def test_cpu_pages_packed_for_other_kernels_are_not_interchangeable(monkeypatch) -> None:
    cache = {"l": torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)}
    here = recognise(cache, NB, BUILTINS).fingerprint
    on_meta = recognise({"l": cache["l"].to("meta")}, NB, BUILTINS).fingerprint
    amx = not torch.cpu._is_amx_tile_supported()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert recognise(cache, NB, BUILTINS).fingerprint != here, "vLLM packs AMX pages otherwise"
    assert recognise({"l": cache["l"].to("meta")}, NB, BUILTINS).fingerprint == on_meta, (
        "a device cache's pages do not depend on the host's CPU"
    )
