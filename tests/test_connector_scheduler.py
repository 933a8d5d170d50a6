"""The connector's scheduler half inside vLLM's real Scheduler."""

from __future__ import annotations

import logging

import pytest

from maru.vllm.keys import rank_key
from maru.vllm.tails import own_tail
from tests import vllm_harness
from tests.conftest import unique_name
from tests.vllm_harness import SchedulerHarness

CHUNK = 64
OBJECTS = 5
"""What a 300-token prompt is stored as: 4 whole 64-token chunks (blocks 0-7) and its
tail, block 8 (tokens 256-287: its last whole block)."""


def tokens(count: int, start: int = 1) -> list[int]:
    return list(range(start, start + count))


def test_a_miss_computes_everything_and_saves_every_whole_chunk_and_the_tail(harness) -> None:
    h = harness()
    h.add("a", tokens(300))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"a": 300}
    assert meta.loads == []
    blocks = h.block_ids("a")
    assert [save.block_ids for save in meta.saves] == [
        blocks[0:2],
        blocks[2:4],
        blocks[4:6],
        blocks[6:8],
        blocks[8:9],
    ]
    assert all(save.first_block == 0 for save in meta.saves)


def test_a_stored_prefix_is_loaded_and_the_rest_saved(harness) -> None:
    h = harness()
    h.add("first", tokens(300))
    h.step()
    second = h.add("second", tokens(256) + tokens(150, start=5000))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"second": 406 - 256}
    blocks = h.block_ids("second")
    assert [(load.block_ids, load.first_block) for load in meta.loads] == [
        (blocks[0:2], 0),
        (blocks[2:4], 0),
        (blocks[4:6], 0),
        (blocks[6:8], 0),
    ]
    keys = h.chunk_keys(second)
    assert [load.key for load in meta.loads] == keys[:4]
    assert [save.key for save in meta.saves] == keys[4:6], "chunks after the hit are saved"


def test_a_fully_stored_prompt_still_computes_its_last_token(harness) -> None:
    h = harness()
    h.add("first", tokens(256))
    h.step()
    h.add("again", tokens(256))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"again": 1}
    assert [load.block_ids for load in meta.loads] == [
        h.block_ids("again")[i : i + 2] for i in range(0, 8, 2)
    ]
    assert meta.saves == []


def test_the_same_prompt_hits_every_whole_block_as_vllms_own_cache_would(harness) -> None:
    h = harness()
    first = h.add("first", tokens(300))
    h.step()
    second = h.add("second", tokens(300))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"second": 300 - 9 * 32}, "computed: 12, not 44"
    blocks = h.block_ids("second")
    tail = own_tail(first, h.connector.scheduler.key_prefix(), 2, vllm_harness.BLOCK_SIZE)
    assert [(load.key, load.block_ids) for load in meta.loads] == [
        (key, blocks[2 * c : 2 * c + 2]) for c, key in enumerate(h.chunk_keys(second))
    ] + [(tail.key, blocks[8:9])]
    assert meta.saves == []
    assert h.stats["hit_tokens"] == 288


def test_a_longer_prompt_finds_the_tail_of_the_prompt_it_begins_with(harness) -> None:
    """A chat's next turn: the earlier prompt's tail ends inside a chunk of the new one,
    whose whole chunk the store lacks; the probe after the stored chunks finds it."""
    h = harness()
    first = h.add("first", tokens(300))
    h.step()
    turn = h.add("turn", tokens(600))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"turn": 600 - 9 * 32}
    tail = own_tail(first, h.connector.scheduler.key_prefix(), 2, vllm_harness.BLOCK_SIZE)
    blocks, keys = h.block_ids("turn"), h.chunk_keys(turn)
    assert meta.loads[-1].key == tail.key and meta.loads[-1].block_ids == blocks[8:9]
    assert [save.key for save in meta.saves] == keys[4:], "its own chunks from the tail's on"
    assert own_tail(turn, h.connector.scheduler.key_prefix(), 2, 32) is None, "18 whole blocks"


def test_a_prompt_that_diverges_inside_a_tail_hits_only_what_it_shares(harness) -> None:
    """Tails are found by their own last block: a prompt that diverges inside the tail's
    blocks finds only what it shares."""
    h = harness()
    h.add("first", tokens(96))  # chunk 0 and a 1-block tail: block 2
    h.step()
    other = h.add("other", tokens(64) + tokens(40, start=7000))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"other": 104 - 64}, "chunk 0 only"
    assert [load.key for load in meta.loads] == h.chunk_keys(other)[:1]


def test_only_the_leading_run_of_stored_chunks_is_a_hit(harness) -> None:
    h = harness()
    first = h.add("first", tokens(300))
    h.step()
    h.store.delete(rank_key(h.chunk_keys(first)[2], 0))
    h.add("second", tokens(300))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"second": 300 - 2 * CHUNK}
    assert len(meta.loads) == 2
    assert [save.key for save in meta.saves] == [h.chunk_keys(first)[2]], (
        "the missing chunk is saved, the stored one after it is not"
    )


@pytest.fixture
def prefix_caching(monkeypatch) -> None:
    """vLLM's own prefix cache on in the harness, as in a serving engine."""
    make_config = vllm_harness.make_vllm_config

    def with_prefix_caching(*args, **kwargs):
        config = make_config(*args, **kwargs)
        config.cache_config.enable_prefix_caching = True
        return config

    monkeypatch.setattr(vllm_harness, "make_vllm_config", with_prefix_caching)


def test_chunks_vllm_holds_are_saved_again_when_the_store_lost_them(
    harness, prefix_caching
) -> None:
    h = harness()
    first = h.add("first", tokens(300))
    h.step()
    keys = h.chunk_keys(first)
    for key in keys:
        h.store.delete(rank_key(key, 0))
    h.add("again", tokens(300))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"again": 300 - 9 * 32}, "vLLM's own cache hit"
    blocks = h.block_ids("again")
    assert meta.loads == []
    assert [(save.key, save.block_ids) for save in meta.saves] == [
        (keys[c], blocks[2 * c : 2 * c + 2]) for c in range(4)
    ]
    h.add("once more", tokens(300))
    _output, meta = h.step()
    assert meta.saves == [], "stored again, so not saved a third time"


def test_a_local_hit_loads_only_beyond_it_and_republishes_below(harness, prefix_caching) -> None:
    h = harness()
    h.add("first", tokens(300))
    h.step()
    longer = h.add("longer", tokens(600))
    keys = h.chunk_keys(longer)
    for key in keys[4:]:
        h.store.put(rank_key(key, 0), b"pages")
    for key in keys[:4]:
        h.store.delete(rank_key(key, 0))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"longer": 600 - 9 * CHUNK}
    blocks = h.block_ids("longer")
    assert [(load.key, load.block_ids, load.first_block) for load in meta.loads] == [
        (keys[4], blocks[9:10], 1)
    ] + [(keys[c], blocks[2 * c : 2 * c + 2], 0) for c in range(5, 9)], "blocks 0-8 are vLLM's own"
    assert [save.key for save in meta.saves] == keys[:4]


def test_one_batched_lookup_per_request(harness, monkeypatch) -> None:
    h = harness()
    h.add("first", tokens(300))
    h.step()
    calls = []
    store = h.connector.scheduler.store.available()
    original = store.contains
    monkeypatch.setattr(store, "contains", lambda keys: calls.append(len(keys)) or original(keys))
    h.add("second", tokens(600))
    h.step()
    assert calls == [9, 1], (
        "all 9 whole chunks of the prompt in one call; after the 4 stored, the tails that "
        "could follow them (one block: the first's tail) in another"
    )


def test_asking_again_for_a_request_it_could_not_schedule_has_no_side_effects(
    harness, monkeypatch
) -> None:
    """vLLM asks again every step while a request waits for blocks: one lookup answers,
    and its misses are counted once, when vLLM allocates the request."""
    h = harness(num_blocks=16)  # room for one 300-token request at a time
    h.add("first", tokens(300), max_tokens=6)
    h.step()
    calls = []
    store = h.connector.scheduler.store.available()
    original = store.contains
    monkeypatch.setattr(store, "contains", lambda keys: calls.append(len(keys)) or original(keys))
    h.add("second", tokens(300, start=1000))
    for _ in range(3):
        h.step()
        assert h.scheduler.requests["second"].num_computed_tokens == 0, "still waiting"
    assert calls == [5, 1], "one lookup: its 4 chunks and its tail, then the tails after none"
    assert h.stats["miss_tokens"] == 256, "the first's misses; the second's not yet"
    while "second" in h.scheduler.requests:
        h.step()
    assert h.stats["miss_tokens"] == 512


def test_chunked_prefill_saves_each_chunk_in_the_step_it_completes(harness) -> None:
    h = harness(max_batched_tokens=96)
    h.add("a", tokens(300))
    saved_per_step = []
    for _ in range(4):
        _output, meta = h.step()
        saved_per_step.append([save.block_ids for save in meta.saves])
    blocks = h.block_ids("a")
    assert (
        saved_per_step
        == [
            [blocks[0:2]],  # tokens 0-95: chunk 0 complete
            [blocks[2:4], blocks[4:6]],  # tokens 96-191: chunks 1 and 2
            [blocks[6:8], blocks[8:9]],  # tokens 192-287: chunk 3 and the tail
            [],  # tokens 288-299: no whole block
        ]
    )


def test_a_preempted_request_resumes_from_the_store(harness) -> None:
    h = harness(max_batched_tokens=128)
    h.add("a", tokens(300))
    _, meta = h.step()
    assert len(meta.saves) == 2
    h.preempt("a")
    output, meta = h.step()
    blocks = h.block_ids("a")
    assert output.num_scheduled_tokens == {"a": 128}
    assert [load.block_ids for load in meta.loads] == [blocks[0:2], blocks[2:4]]
    assert [save.block_ids for save in meta.saves] == [blocks[4:6], blocks[6:8]]


def test_different_cache_salts_never_share_chunks(harness) -> None:
    h = harness()
    h.add("tenant-a", tokens(300), cache_salt="a")
    h.step()
    h.add("tenant-b", tokens(300), cache_salt="b")
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"tenant-b": 300}
    assert meta.loads == []


def test_a_failing_store_is_a_miss_and_is_then_left_alone(harness, monkeypatch) -> None:
    h = harness(mock={"fail_rate": 1.0})
    h.add("a", tokens(300))
    output, _meta = h.step()
    assert output.num_scheduled_tokens == {"a": 300}
    h.add("b", tokens(300))
    h.step()
    assert (h.stats["lookups"], h.stats["lookup_errors"]) == (1, 1), "skipped during back-off"


def test_chunk_tokens_must_be_a_multiple_of_the_block_size(tiny_model) -> None:
    import maru

    with pytest.raises(
        maru.ConfigError, match="chunk_tokens = 48: not a multiple of vLLM's block size"
    ):
        SchedulerHarness(tiny_model, unique_name(), chunk_tokens=48)


def test_on_a_device_a_request_that_saved_keeps_its_blocks_until_its_saves_are_done(
    harness,
) -> None:
    h = harness()
    h.connector.scheduler.saves_hold_blocks = True  # as on a device: copies beside the forward
    free = h.free_blocks()
    h.add("a", tokens(300))
    h.step()
    assert "a" not in h.scheduler.requests or h.scheduler.requests["a"].is_finished()
    assert h.free_blocks() < free, "its saves may still be copying from its blocks"
    assert h.connector.has_pending_block_frees(), "vLLM waits for them rather than preempt"
    assert h.scheduler.has_requests(), "an idle engine still runs the next step"
    assert not h.scheduler.reset_prefix_cache()
    h.step()  # the worker reports the saves done (it waits for their copies)
    assert h.free_blocks() == free
    assert not h.connector.has_pending_block_frees()
    assert h.scheduler.reset_prefix_cache(), "as without maru, once the copies are done"
    assert not h.scheduler.has_requests()


def test_on_the_cpu_a_request_that_saved_frees_its_blocks_at_once(harness) -> None:
    """The CPU's saves are committed within the step: nothing to wait for (vLLM's own
    prefix cache can then be reset right after traffic)."""
    h = harness()
    assert not h.connector.scheduler.saves_hold_blocks
    free = h.free_blocks()
    h.add("a", tokens(300))
    _, meta = h.step()
    assert len(meta.saves) == OBJECTS
    assert "a" not in h.scheduler.requests
    assert h.free_blocks() == free


def test_a_request_that_saved_nothing_frees_its_blocks_at_once(harness) -> None:
    h = harness()
    h.add("a", tokens(300))
    h.step()
    h.step()
    free = h.free_blocks()
    h.add("b", tokens(300))  # every chunk stored: nothing to save
    _, meta = h.step()
    assert meta.saves == []
    assert h.free_blocks() == free


def test_no_lookups_once_a_worker_says_it_cannot_load(harness) -> None:
    from maru.vllm.metadata import NO_DATA_PATH, MaruHandshake

    h = harness()
    h.add("a", tokens(300))
    h.step()
    h.connector.set_xfer_handshake_metadata({0: MaruHandshake(NO_DATA_PATH)})
    h.add("b", tokens(300))
    _, meta = h.step()
    assert meta.loads == [] and meta.saves == []


def test_a_reset_with_the_connector_clears_only_this_instances_namespace(harness, caplog) -> None:
    h = harness()
    h.add("a", tokens(300))
    ours = h.chunk_keys(h.scheduler.requests["a"])
    others = [b"maru/default/other-model/" + bytes([i]) for i in range(3)]
    for key in [*ours, *others]:
        h.store.put(key, b"x")
    with caplog.at_level(logging.INFO, logger="vllm.maru"):
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
    assert f"reset_cache removed {len(ours)} objects" in caplog.text
    assert h.store.contains(ours) == [False] * len(ours)
    assert h.store.contains(others) == [True] * 3, "another model's namespace stays"


# --- KV events ---------------------------------------------------------------


def maru_events(h: SchedulerHarness, kind: str) -> list:
    """The maru events of one kind vLLM published (its own block events left out)."""
    return [
        e for e in h.published if type(e).__name__ == kind and (e.medium or "").startswith("maru:")
    ]


def as_published(blocks) -> list:
    """Block hashes as vLLM's own KV events carry them (ints by default, else bytes)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(block) for block in blocks]


def evict_from_shm(pool: str, keys: list[bytes]) -> None:
    """In another process: delete these objects from the shared-memory pool."""
    import maru

    with maru.open_store(backend="shm", shm={"name": pool}) as store:
        for key in keys:
            assert store.delete(key)


def test_saved_chunks_are_announced_with_their_blocks_once_the_store_has_them(harness) -> None:
    h = harness(kv_events=True)
    prompt = tokens(300)
    request = h.add("a", prompt)
    h.step()
    stored = maru_events(h, "BlockStored")
    assert len(stored) == OBJECTS, "one event per object saved: whole chunks, the tail"
    hashes = as_published(request.block_hashes)
    tail = stored.pop()
    assert tail.block_hashes == hashes[8:9] and tail.parent_block_hash == hashes[7]
    assert tail.token_ids == prompt[256:288]
    for chunk, event in enumerate(stored):
        assert event.medium == "maru:mock"
        assert event.block_size == vllm_harness.BLOCK_SIZE
        assert event.block_hashes == hashes[2 * chunk : 2 * chunk + 2]
        assert event.parent_block_hash == (hashes[2 * chunk - 1] if chunk else None)
        assert event.token_ids == prompt[CHUNK * chunk : CHUNK * (chunk + 1)]
    h.step()
    assert len(maru_events(h, "BlockStored")) == OBJECTS, "announced once"


def test_a_save_that_never_reached_the_store_is_never_announced(harness, monkeypatch) -> None:
    h = harness(kv_events=True)
    request = h.add("a", tokens(300))
    lost = rank_key(h.chunk_keys(request)[1], 0)
    put = h.store.put
    monkeypatch.setattr(h.store, "put", lambda key, data: key != lost and put(key, data))
    h.step()
    h.step()  # the worker reports the request's saves done
    announced = [e.block_hashes for e in maru_events(h, "BlockStored")]
    hashes = as_published(request.block_hashes)
    assert announced == [hashes[0:2], hashes[4:6], hashes[6:8], hashes[8:9]]
    put(lost, b"pages")  # stored later, by another instance
    h.add("b", tokens(20, start=9000))  # any step polls
    h.step()
    assert len(maru_events(h, "BlockStored")) == 4, "forgotten once the worker was done"


def test_chunks_another_process_evicts_are_removed_through_the_log(
    harness, pool_names, monkeypatch
) -> None:
    import multiprocessing

    import maru

    pool = pool_names()
    h = harness(kv_events=True, backend="shm", pool=pool)
    request = h.add("a", tokens(300))
    h.step()  # its first lookup compares the namespaces in the store (a scan, once)
    monkeypatch.setattr(maru.Backend, "keys", lambda *_: pytest.fail("the store was scanned"))
    keys = [rank_key(key, 0) for key in h.chunk_keys(request)]
    evictor = multiprocessing.get_context("spawn").Process(
        target=evict_from_shm, args=(pool, keys[2:])
    )
    evictor.start()
    evictor.join(60)
    assert evictor.exitcode == 0
    h.add("b", tokens(20, start=9000))  # any step polls
    h.step()
    [removed] = maru_events(h, "BlockRemoved")
    assert removed.medium == "maru:shm"
    assert removed.block_hashes == as_published(request.block_hashes[4:8])


def test_without_a_removal_log_the_announced_chunks_are_checked(harness, monkeypatch) -> None:
    from maru.backends.base import Removals
    from maru.backends.mock import MockBackend

    monkeypatch.setattr(MockBackend, "_removed_since", lambda self, cursor: Removals(0, None))
    monkeypatch.setattr("maru.vllm.events.VERIFY_INTERVAL_S", 0.0)
    h = harness(kv_events=True)
    request = h.add("a", tokens(300))
    h.step()
    h.store.delete(rank_key(h.chunk_keys(request)[0], 0))
    h.step()
    [removed] = maru_events(h, "BlockRemoved")
    assert removed.block_hashes == as_published(request.block_hashes[0:2])


def test_a_reset_removes_every_announced_chunk(harness) -> None:
    h = harness(kv_events=True)
    request = h.add("a", tokens(300))
    h.step()
    h.step()  # the request's blocks are free: vLLM resets only then
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    h.add("b", tokens(20, start=9000))
    h.step()
    [removed] = maru_events(h, "BlockRemoved")
    assert removed.block_hashes == as_published(request.block_hashes[:9])


def test_without_kv_events_nothing_is_tracked(harness) -> None:
    h = harness()
    h.add("a", tokens(300))
    h.step()
    assert h.connector.scheduler.events is None
    assert h.connector.take_events() == []


def test_a_release_without_the_optional_hooks_still_shares_and_says_so(
    harness, monkeypatch, caplog
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    for hook in ("build_prom_metrics", "take_events", "reset_cache"):
        monkeypatch.delattr(KVConnectorBase_V1, hook)
    monkeypatch.setattr("maru.vllm.compat.CacheHitSource", None)
    with caplog.at_level(logging.INFO, logger="vllm.maru"):
        h = harness(kv_events=True)
    assert (
        "lacks maru's Prometheus metrics (its counters still reach vLLM's stats); KV "
        "events for routers; clearing the store through /reset_prefix_cache; hit counts "
        "by source"
    ) in caplog.text
    assert "nothing is lost" in caplog.text
    assert h.connector.scheduler.events is None
    h.add("first", tokens(300))
    h.step()
    h.add("second", tokens(300))
    _, meta = h.step()
    assert len(meta.loads) == OBJECTS, "it still shares"


def test_a_producer_saves_and_does_not_load(harness) -> None:
    """kv_role kv_producer (a prefill instance): what it computes is for its consumers."""
    h = harness(kv_role="kv_producer")
    h.add("a", tokens(300))
    _, meta = h.step()
    assert len(meta.saves) == OBJECTS
    h.add("b", tokens(300))
    _, again = h.step()
    assert (again.loads, again.saves) == ([], []), "stored already: nothing to save"


def test_a_producer_loads_when_asked_to(harness) -> None:
    h = harness(kv_role="kv_producer", settings={"producer_loads": True})
    h.add("a", tokens(300))
    h.step()
    h.add("b", tokens(300))
    _, meta = h.step()
    assert len(meta.loads) == OBJECTS


def test_a_consumer_loads_and_never_saves(harness) -> None:
    """kv_role kv_consumer (a decode instance) loads its producers' chunks."""
    pool = unique_name()
    producer = harness(pool=pool, kv_role="kv_producer")
    consumer = harness(pool=pool, kv_role="kv_consumer")
    consumer.add("own", tokens(300, start=1000))
    _, computed = consumer.step()
    assert computed.saves == [], "what it computes alone is not saved"
    producer.add("a", tokens(300))
    producer.step()
    consumer.add("b", tokens(300))
    _, meta = consumer.step()
    assert len(meta.loads) == OBJECTS and meta.saves == []


def test_every_pipeline_stages_layout_goes_into_the_namespace(harness) -> None:
    """vLLM hands the handshakes keyed by (pipeline stage, tensor-parallel rank); its
    default refuses stages past the first."""
    from maru.vllm.metadata import MaruHandshake

    h = harness()
    scheduler = h.connector.scheduler
    h.connector.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): MaruHandshake("stage0"), (1, 0): MaruHandshake("stage1")}
    )
    assert scheduler.namespace.identity()["layout"] == "stage0,stage1"
    assert scheduler.namespace.record()["pp_size"] == 1 and scheduler.shares_per_chunk == 1


def test_without_its_workers_layout_it_neither_looks_up_nor_saves(harness, caplog) -> None:
    """Behind another connector in MultiConnector the handshake may be that connector's:
    maru's namespace is then unknown, and guessing it could load another layout's pages."""
    h = harness(layout=None)
    with caplog.at_level(logging.WARNING, logger="vllm.maru"):
        h.add("a", tokens(300))
        _, meta = h.step()
    assert meta.saves == [] and h.stats["lookups"] == 0
    assert "no worker has said its KV layout yet" in caplog.text


@pytest.mark.worker_channel
def test_the_layout_arrives_on_the_per_connector_worker_channel(harness) -> None:
    """What MultiConnector passes to each child, whatever the handshake was."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.outputs import KVConnectorOutput

    from maru.vllm.metadata import MaruWorkerMeta

    h = harness(layout=None)
    h.connector.set_xfer_handshake_metadata({0: KVConnectorHandshakeMetadata()})
    h.connector.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=MaruWorkerMeta(frozenset({"layout-1"})))
    )
    assert h.connector.scheduler.namespace.identity()["layout"] == "layout-1"
    h.add("a", tokens(300))
    _, meta = h.step()
    assert len(meta.saves) == OBJECTS


def test_a_consumer_waits_for_the_chunks_its_producer_named(harness) -> None:
    """P/D: the proxy hands the producer's kv_transfer_params to the consumer, which may
    arrive while the producer's saves still commit: "not yet" (vLLM asks again) until the
    store has them, instead of a miss."""
    pool = unique_name()
    producer = harness(pool=pool, kv_role="kv_producer")
    consumer = harness(pool=pool, kv_role="kv_consumer")
    prompt = tokens(300)
    namespace = producer.connector.scheduler.key_prefix().decode()
    named = {"maru": {"namespace": namespace, "chunks": 4, "tail": 1}}
    consumer.add("r", prompt, kv_transfer_params=named)
    for _ in range(2):
        _, meta = consumer.step()
        assert meta.loads == [] and consumer.scheduler.requests["r"].num_computed_tokens == 0
    producer.add("r", prompt)
    while "r" in producer.scheduler.requests:
        producer.step()
    assert producer.transfer_params["r"] == named, "4 chunks and a tail of 1 block"
    _, meta = consumer.step()
    assert len(meta.loads) == OBJECTS


def test_a_consumer_waits_for_its_producers_tail_too(harness) -> None:
    """The chunks may commit before the tail: a consumer that loaded them alone would
    compute the tail's blocks again."""
    pool = unique_name()
    producer = harness(pool=pool, kv_role="kv_producer")
    consumer = harness(pool=pool, kv_role="kv_consumer")
    prompt = tokens(300)
    producer.add("chunks only", prompt[: 4 * CHUNK])
    while "chunks only" in producer.scheduler.requests:
        producer.step()
    namespace = producer.connector.scheduler.key_prefix().decode()
    consumer.add(
        "r", prompt, kv_transfer_params={"maru": {"namespace": namespace, "chunks": 4, "tail": 1}}
    )
    _, meta = consumer.step()
    assert meta.loads == [] and consumer.scheduler.requests["r"].num_computed_tokens == 0
    producer.add("r", prompt)
    while "r" in producer.scheduler.requests:
        producer.step()
    _, meta = consumer.step()
    assert len(meta.loads) == OBJECTS and consumer.stats["hit_tokens"] == 288, "every whole block"


def test_a_producer_names_no_tail_where_its_prompt_has_none(harness) -> None:
    producer = harness(kv_role="kv_producer")
    producer.add("r", tokens(4 * CHUNK + 16))
    while "r" in producer.scheduler.requests:
        producer.step()
    assert producer.transfer_params["r"]["maru"]["tail"] == 0


def test_a_consumer_computes_what_is_not_there_by_its_deadline(harness) -> None:
    consumer = harness(kv_role="kv_consumer", settings={"consumer_wait": 0})
    scheduler = consumer.connector.scheduler
    named = {"maru": {"namespace": scheduler.key_prefix().decode(), "chunks": 4}}
    consumer.add("r", tokens(300), kv_transfer_params=named)
    consumer.step()
    assert "r" not in consumer.scheduler.requests, "computed, finished"


def test_with_async_scheduling_keys_saves_and_frees_stay_right(harness) -> None:
    """vLLM's AsyncScheduler schedules step N+1 before step N's output arrives, so its
    counts include tokens in flight: chunked prefill still saves each chunk once, with
    the blocks of a synchronous run, and every block is free at the end."""

    def run(h, step) -> tuple[object, list[tuple[bytes, list[int]]]]:
        request = h.add("a", tokens(300), max_tokens=4)
        saved = []
        for _ in range(12):
            _, meta = step()
            saved += [(save.key, save.block_ids) for save in meta.saves]
        return request, saved

    ahead, in_step = (
        harness(async_scheduling=True, max_batched_tokens=96),
        harness(max_batched_tokens=96),
    )
    free = ahead.free_blocks()
    request, saved = run(ahead, ahead.step_ahead)
    assert saved == run(in_step, in_step.step)[1]
    tail = own_tail(request, ahead.connector.scheduler.key_prefix(), 2, vllm_harness.BLOCK_SIZE)
    assert [key for key, _ in saved] == [*ahead.chunk_keys(request), tail.key]
    assert "a" not in ahead.scheduler.requests and ahead.free_blocks() == free
