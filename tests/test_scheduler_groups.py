"""The scheduler half on KV caches of several groups, inside vLLM's real Scheduler: each
group's hit rule, its own block ids, and never vLLM's null block (docs/vllm-hybrid-groups.md).

Blocks are 32 tokens, chunks 64 (two blocks), windows 64 tokens: a chunk stores both its
blocks of a full-attention group, its last cdiv(63, 32) = 2 of a sliding window, and its
last one (the state after its last token) of a Mamba group."""

from __future__ import annotations

import logging

import pytest

from maru.vllm.metadata import NULL_BLOCK
from tests.vllm_harness import SchedulerHarness, vllm_features


def tokens(count: int, start: int = 1) -> list[int]:
    return list(range(start, start + count))


def run(h: SchedulerHarness, req_id: str, count: int) -> tuple[object, list]:
    """Run a request to its end: the request, and every step's metadata."""
    request = h.add(req_id, tokens(count))
    metas = []
    while req_id in h.scheduler.requests:
        metas.append(h.step()[1])
    return request, metas


def transfers(metas: list, kind: str) -> list:
    return [t for meta in metas for t in getattr(meta, kind)]


def by_group(found: list) -> dict[int, list]:
    grouped: dict[int, list] = {}
    for transfer in found:
        grouped.setdefault(transfer.group, []).append(transfer)
    return grouped


def assert_never_the_null_block(metas: list) -> None:
    for transfer in transfers(metas, "saves") + transfers(metas, "loads"):
        assert NULL_BLOCK not in transfer.block_ids, transfer


@pytest.mark.hybrid_loads
def test_a_sliding_window_hybrid_loads_only_the_window_before_the_hit(harness) -> None:
    h = harness(groups=("full", "window"))
    writer, written = run(h, "writer", 300)
    saved = by_group(transfers(written, "saves"))
    assert [len(t.block_ids) for t in saved[0]] == [2, 2, 2, 2]
    assert [len(t.block_ids) for t in saved[1]] == [2, 2, 2, 2]
    _, metas = run(h, "reader", 300)
    loads = by_group(transfers(metas, "loads"))
    assert [t.key for t in loads[0]] == h.chunk_keys(writer)
    window = h.block_ids("reader", 1)
    assert window[:6] == [NULL_BLOCK] * 6, "vLLM keeps only the window before the hit"
    assert [(t.block_ids, t.first_block) for t in loads[1]] == [(window[6:8], 0)]
    assert loads[1][0].key == loads[0][3].key
    assert h.stats["hit_tokens"] == 256
    assert_never_the_null_block(metas)


def test_a_window_hit_needs_no_chunk_before_the_window(harness) -> None:
    """The store lost the first chunks' objects: full attention cannot hit, an all-window
    model can (it needs only the last window)."""
    h = harness(groups=("window",))
    writer, _ = run(h, "writer", 300)
    keys = h.chunk_keys(writer)
    for key in keys[:2]:
        h.store.delete_prefix(key)
    _, metas = run(h, "reader", 300)
    assert [t.key for t in transfers(metas, "loads")] == [keys[3]]
    assert h.stats["hit_tokens"] == 256
    assert_never_the_null_block(metas)


def test_an_all_window_model_never_loads_into_the_null_block(harness) -> None:
    """One sliding-window group (Mistral-7B-v0.1 style): one group, so no HMA needed."""
    h = harness(groups=("window",))
    _, written = run(h, "writer", 300)
    assert_never_the_null_block(written)
    _, metas = run(h, "reader", 300)
    (load,) = transfers(metas, "loads")
    table = h.block_ids("reader")
    assert table[:6] == [NULL_BLOCK] * 6
    assert (load.block_ids, load.first_block) == (table[6:8], 0)


def test_a_window_chunk_is_saved_before_vllm_drops_its_blocks(harness) -> None:
    """Prefill in 64-token steps: vLLM frees a window's blocks behind it as it goes, so
    each chunk's blocks are saved in the step that completes it, never later."""
    h = harness(groups=("window",), max_batched_tokens=64)
    _, metas = run(h, "writer", 300)
    saves = transfers(metas, "saves")
    assert len(saves) == 4
    assert_never_the_null_block(metas)
    assert [len(m.saves) for m in metas[:4]] == [1, 1, 1, 1]


@pytest.mark.hybrid_loads
def test_a_mamba_hybrid_loads_one_state_at_the_hit(harness) -> None:
    """A Mamba group in vLLM's align mode, prefilled a block per step: each chunk's state
    is saved in the step that ends it; a hit loads the state at the hit only."""
    h = harness(groups=("full", "state"), max_batched_tokens=32)
    _, written = run(h, "writer", 300)
    saved = by_group(transfers(written, "saves"))
    assert [len(t.block_ids) for t in saved[1]] == [1, 1, 1, 1]
    h.add("reader", tokens(300))
    _, meta = h.step()  # the loads are planned; the request waits for them
    loads = by_group(meta.loads)
    assert len(loads[0]) == 4
    state = h.scheduler.kv_cache_manager.get_block_ids("reader")[1]
    assert state[:7] == [NULL_BLOCK] * 7, "vLLM keeps one state, at the hit"
    assert [(t.key, t.block_ids) for t in loads[1]] == [(loads[0][3].key, [state[7]])]
    assert_never_the_null_block([meta])


@pytest.mark.hybrid_loads
def test_a_hybrid_hit_is_where_every_group_can_be_served(harness) -> None:
    """The state after chunk 3 is lost: the hit falls back to chunk 2, where the full
    group's blocks and the state both are."""
    h = harness(groups=("full", "state"), max_batched_tokens=32)
    writer, _ = run(h, "writer", 300)
    keys = h.chunk_keys(writer)
    for share in h.connector.scheduler.shares(keys[3], 1):
        h.store.delete(share)
    _, metas = run(h, "reader", 300)
    loads = by_group(transfers(metas, "loads"))
    assert [t.key for t in loads[0]] == keys[:3]
    assert [t.key for t in loads[1]] == [keys[2]]
    assert h.stats["hit_tokens"] == 192


@pytest.mark.hybrid_loads
def test_a_failed_hybrid_load_is_a_recompute_and_is_not_tried_again(harness) -> None:
    """With several groups vLLM takes only per-request failures of asynchronous loads."""
    h = harness(groups=("full", "window"))
    run(h, "writer", 300)
    h.failing_loads.add("reader")
    _, metas = run(h, "reader", 300)
    assert len(transfers(metas, "loads")) == 5, "one attempt: 4 full chunks and a window"
    assert h.scheduler.requests.get("reader") is None, "it ran to its end"
    assert h.connector.scheduler.failed_loads == set()


def test_a_hybrid_is_served_only_where_vllm_takes_per_request_failures(harness, caplog):
    """Elsewhere the connector turns itself off, saying why (on every release)."""
    with caplog.at_level(logging.ERROR, logger="vllm.maru"):
        h = harness(groups=("full", "window"))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    if vllm_features()["hybrid_loads"]:
        assert errors == [] and not h.connector.scheduler.store.disabled
    else:
        assert len(errors) == 1 and "cannot take a failed load of one request" in errors[0]
        assert h.connector.scheduler.store.disabled


@pytest.mark.hybrid_loads
def test_the_namespace_and_its_record_carry_the_group_structure(harness) -> None:
    """A model with other groups never reads these chunks: another namespace."""
    one, two = harness(groups=("full",)), harness(groups=("full", "window"))
    assert one.connector.scheduler.key_prefix() != two.connector.scheduler.key_prefix()
    assert two.connector.scheduler.namespace.record()["kv_groups"] == [
        "full attention/32",
        "sliding window/32/sliding_window=64/extra_retained_tokens=0",
    ]


def test_an_unknown_group_spec_turns_the_connector_off_naming_it(harness, caplog) -> None:
    """Chunked local attention drops blocks by its own rule: never guessed at."""
    with caplog.at_level(logging.ERROR, logger="vllm.maru"):
        h = harness(groups=("chunked",))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "KV cache group 0 (ChunkedLocalAttentionSpec of 1 layers)" in errors[0]
    _, metas = run(h, "a", 300)
    _, again = run(h, "b", 300)
    assert transfers(metas, "saves") == transfers(again, "loads") == []
    assert h.stats["lookups"] == 0 and h.store.stats().objects == 0


def test_chunk_tokens_must_end_on_every_groups_block_boundary() -> None:
    from maru.errors import ConfigError
    from maru.vllm.groups import FULL, STATE, KVGroup, check_chunk_tokens

    groups = [KVGroup(0, FULL, 32, ("f0",)), KVGroup(1, STATE, 48, ("m1",))]
    with pytest.raises(ConfigError) as raised:
        check_chunk_tokens(groups, 64)
    assert str(raised.value) == (
        "chunk_tokens = 64: not a multiple of the block size of group 1 (state, 1 layers) "
        "(48); allowed: a multiple of 96"
    )
    check_chunk_tokens(groups, 96)
