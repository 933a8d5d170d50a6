"""The worker half on a KV cache of two groups: a full-attention layer and a Mamba layer
whose state pages are raw int8 views with a padded block stride, as vLLM 0.32 hands
them over. A group's block ids are copied only through its own layers; with several
groups a failed load fails its request (vLLM's only failure path there)."""

from __future__ import annotations

import pytest
import torch

from maru.connector import MaruKVConnector
from maru.vllm.metadata import ChunkTransfer, MaruConnectorMetadata
from tests.conftest import unique_name
from tests.vllm_harness import make_kv_cache_config, make_vllm_config

NB, PAGE, STATE = 24, 16384, 96 * 3 * 4 + 4 * 32 * 16 * 4
"""Blocks, the padded page (an attention page of (2, 32, 128) bf16), the state's bytes
(`tests.vllm_harness.group_spec("state")`)."""

pytestmark = pytest.mark.hybrid_loads
"""Older releases serve no hybrid (tests/test_scheduler_groups.py checks they say so)."""


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    """f0: attention (NB, 2, 32, 128) bf16; m1: a state page view (NB, 1, 1, STATE) int8
    over PAGE-byte blocks. Random, or zero."""
    attention = torch.zeros(NB, 2, 32, 128, dtype=torch.bfloat16)
    pages = torch.zeros(NB, PAGE, dtype=torch.int8)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        attention.copy_(torch.randn(attention.shape, generator=generator))
        pages.copy_(torch.randint(-128, 127, pages.shape, generator=generator, dtype=torch.int8))
    state = torch.as_strided(pages, (NB, 1, 1, STATE), (PAGE, STATE, STATE, 1))
    return {"f0": attention, "m1": state, "pages": pages}


def worker(tiny_model, pool: str, layers: dict[str, torch.Tensor]) -> MaruKVConnector:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    extra = {"backend": "mock", "chunk_tokens": 64, "mock": {"name": pool}}
    connector = MaruKVConnector(
        make_vllm_config(tiny_model, extra),
        KVConnectorRole.WORKER,
        make_kv_cache_config(NB, ("full", "state")),
    )
    connector.register_kv_caches({name: layers[name] for name in ("f0", "m1")})
    return connector


def step(connector: MaruKVConnector, meta: MaruConnectorMetadata) -> object:
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    for name in ("f0", "m1"):
        connector.wait_for_layer_load(name)
        connector.save_kv_layer(name, None, None)
    connector.wait_for_save()
    connector.clear_connector_metadata()
    return connector.get_transfer_results(set())


def test_each_groups_blocks_move_only_through_its_own_layers(tiny_model) -> None:
    pool, written, read = unique_name(), caches(1), caches(None)
    writer = worker(tiny_model, pool, written)
    assert len(writer.worker.paths) == 2
    step(
        writer,
        MaruConnectorMetadata(
            saves=[
                ChunkTransfer(b"chunk", [1, 2], req_id="w", group=0),
                ChunkTransfer(b"chunk", [3], req_id="w", group=1),
            ]
        ),
    )
    reader = worker(tiny_model, pool, read)
    results = step(
        reader,
        MaruConnectorMetadata(
            loads=[
                ChunkTransfer(b"chunk", [5, 6], req_id="r", group=0),
                ChunkTransfer(b"chunk", [7], req_id="r", group=1),
            ]
        ),
    )
    assert (results.finished_recving, results.failed_recving) == ({"r"}, set())
    assert torch.equal(read["f0"][5:7], written["f0"][1:3])
    assert torch.equal(read["m1"][7], written["m1"][3])
    untouched = [b for b in range(NB) if b not in (5, 6)]
    assert not read["f0"][untouched].any(), "group 1's block 7 went through group 0's layer"
    assert not read["pages"][7, STATE:].any(), "only the state's bytes, not the padding"
    assert not read["pages"][[b for b in range(NB) if b != 7]].any()


def test_a_failed_load_with_several_groups_fails_its_request_not_blocks(tiny_model) -> None:
    reader = worker(tiny_model, unique_name(), caches(None))
    results = step(
        reader,
        MaruConnectorMetadata(
            loads=[
                ChunkTransfer(b"absent", [5, 6], req_id="r", group=0),
                ChunkTransfer(b"absent", [7], req_id="r", group=1),
            ]
        ),
    )
    assert (results.finished_recving, results.failed_recving) == ({"r"}, {"r"})
    assert reader.get_block_ids_with_load_errors() == set()
    assert reader.worker.stats.data["load_errors"] == 2


def test_a_load_beyond_what_an_object_holds_fails(tiny_model) -> None:
    """A state object holds one block: asking for a second is a failure, never a copy of
    whatever follows it."""
    pool, written, read = unique_name(), caches(1), caches(None)
    step(
        worker(tiny_model, pool, written),
        MaruConnectorMetadata(saves=[ChunkTransfer(b"chunk", [3], req_id="w", group=1)]),
    )
    reader = worker(tiny_model, pool, read)
    results = step(
        reader,
        MaruConnectorMetadata(
            loads=[ChunkTransfer(b"chunk", [7, 8], first_block=0, req_id="r", group=1)]
        ),
    )
    assert results.failed_recving == {"r"}
    assert not read["pages"].any()
