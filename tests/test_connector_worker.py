"""The connector's worker half: chunks between a store and KV caches, and failures."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import maru
from maru.backends._pool import checksum as checksums
from maru.backends.shm import shm_path
from maru.connector import MaruKVConnector
from maru.transfer import DataPath
from maru.vllm.keys import HEADER_BYTES, rank_key
from maru.vllm.metadata import NO_DATA_PATH, ChunkTransfer, MaruConnectorMetadata
from tests.conftest import stall_reservations, unique_name
from tests.copy_queues import DeferredQueue, FailingQueue
from tests.test_pool_checksum import corrupt
from tests.test_transfer import (
    anon_huge_bytes_at,
    middle_of,
    random_in_fresh_memory,
    thp_collapse_available,
)
from tests.vllm_harness import make_kv_cache_config, make_vllm_config

NB, LAYERS = 40, 3
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """CPU-backend shaped caches (NB, H, BS, 2D), random or zero."""
    caches = {}
    for i, name in enumerate(LAYER_NAMES):
        cache = torch.zeros(NB, 2, 32, 128, dtype=torch.bfloat16)
        if seed is not None:
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed + i)))
        caches[name] = cache
    return caches


def worker(
    tiny_model,
    pool: str,
    caches: dict[str, torch.Tensor],
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    settings: dict | None = None,
    queue=None,
    **mock,
) -> MaruKVConnector:
    """A worker-role connector over mock store `pool` (no distributed setup); its copies
    go through `queue` if given (else the device's own)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    extra = {
        "backend": "mock",
        "chunk_tokens": 64,
        "mock": {"name": pool, **mock},
        **(settings or {}),
    }
    config = make_vllm_config(tiny_model, extra)
    config.parallel_config.tensor_parallel_size = tp_size
    config.parallel_config.pipeline_parallel_size = pp_size
    connector = MaruKVConnector(
        config,
        KVConnectorRole.WORKER,
        make_kv_cache_config(NB),
        transfers=lambda adapter: DataPath(adapter, queue),
    )
    connector.register_kv_caches(caches)
    return connector


def run_step(
    connector: MaruKVConnector, meta: MaruConnectorMetadata, *, layer_by_layer: bool = True
) -> set[int]:
    """One forward step as vLLM drives it; the block ids that failed to load."""
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    if layer_by_layer:
        for name in LAYER_NAMES:
            connector.wait_for_layer_load(name)
            connector.save_kv_layer(name, None, None)
    connector.wait_for_save()
    connector.clear_connector_metadata()
    return connector.get_block_ids_with_load_errors()


def same_blocks(a: dict, a_ids: list[int], b: dict, b_ids: list[int]) -> bool:
    return all(torch.equal(a[n][a_ids], b[n][b_ids]) for n in LAYER_NAMES)


@pytest.fixture
def pool():
    return unique_name("worker")


@pytest.mark.parametrize("layer_by_layer", [True, False])
def test_a_saved_chunk_loads_into_other_blocks_of_another_cache(
    tiny_model, pool, layer_by_layer
) -> None:
    source, target = kv_caches(1), kv_caches(None)
    writer = worker(tiny_model, pool, source)
    assert (
        run_step(
            writer,
            MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])]),
            layer_by_layer=layer_by_layer,
        )
        == set()
    )
    reader = worker(tiny_model, pool, target)
    assert run_step(reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"k0", [11, 12])])) == set()
    assert same_blocks(source, [3, 7], target, [11, 12])
    untouched = [b for b in range(NB) if b not in (11, 12)]
    assert all(not target[n][untouched].any() for n in LAYER_NAMES)
    stats = reader.get_kv_connector_stats().data
    assert stats["loads"] == 1 and stats["loaded_bytes"] > 0
    assert writer.get_kv_connector_stats().data["saves"] == 1


def test_a_load_can_skip_blocks_computed_locally(tiny_model, pool) -> None:
    source, target = kv_caches(1), kv_caches(None)
    run_step(
        worker(tiny_model, pool, source),
        MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])]),
    )
    run_step(
        worker(tiny_model, pool, target),
        MaruConnectorMetadata(loads=[ChunkTransfer(b"k0", [20], first_block=1)]),
    )
    assert same_blocks(source, [7], target, [20])


def test_the_object_is_one_chunk_of_every_layer_with_a_header(tiny_model, pool) -> None:
    run_step(
        worker(tiny_model, pool, kv_caches(1)),
        MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])]),
    )
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        data = store.get(rank_key(b"k0", 0))
    page = 2 * 32 * 128 * 2
    assert len(data) == HEADER_BYTES + 2 * LAYERS * page


def test_an_incomplete_save_is_never_visible(tiny_model, pool) -> None:
    writer = worker(tiny_model, pool, kv_caches(1), queue=FailingQueue(after=1))
    meta = MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])])
    writer.bind_connector_metadata(meta)
    writer.save_kv_layer(LAYER_NAMES[0], None, None)  # the first layer's copy runs
    writer.wait_for_save()  # the second one fails
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        assert store.contains([rank_key(b"k0", 0)]) == [False]
        assert store.stats().used == 0, "the reservation was released"


@pytest.mark.parametrize("damage", ["missing", "other layout", "truncated", "garbage"])
def test_chunks_that_cannot_be_trusted_are_reported_for_recompute(tiny_model, pool, damage) -> None:
    target = kv_caches(None)
    key = rank_key(b"k0", 0)
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        run_step(
            worker(tiny_model, pool, kv_caches(1)),
            MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])]),
        )
        good = store.get(key)
        store.delete(key)
        if damage == "other layout":
            store.put(key, good[:8] + bytes(24) + good[32:])
        elif damage == "truncated":
            store.put(key, good[:-1])
        elif damage == "garbage":
            store.put(key, bytes(len(good)))
        reader = worker(tiny_model, pool, target)
        failed = run_step(
            reader,
            MaruConnectorMetadata(
                loads=[ChunkTransfer(b"k0", [11, 12]), ChunkTransfer(b"k1", [13, 14])]
            ),
        )
    assert failed == {11, 12, 13, 14}
    assert not any(target[n].any() for n in LAYER_NAMES), "nothing half-written"
    assert reader.get_block_ids_with_load_errors() == set(), "reported once"


def test_injected_faults_only_ever_cause_recomputes(tiny_model, pool) -> None:
    source = kv_caches(1)
    saves = [ChunkTransfer(b"k%d" % i, [2 * i, 2 * i + 1]) for i in range(10)]
    run_step(worker(tiny_model, pool, source), MaruConnectorMetadata(saves=saves))
    target = kv_caches(None)
    reader = worker(tiny_model, pool, target, drop_rate=0.5, seed=3)
    loads = [ChunkTransfer(b"k%d" % i, [20 + 2 * i, 21 + 2 * i]) for i in range(10)]
    failed = run_step(reader, MaruConnectorMetadata(loads=loads))
    assert 0 < len(failed) < 20
    for load, save in zip(loads, saves, strict=True):
        if not set(load.block_ids) & failed:
            assert same_blocks(source, save.block_ids, target, load.block_ids)


def test_after_an_error_the_store_is_skipped_for_the_back_off(tiny_model, pool) -> None:
    reader = worker(tiny_model, pool, kv_caches(None), fail_rate=1.0)
    failed = run_step(reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"k0", [1, 2])]))
    assert failed == {1, 2}
    store = reader.worker.store.available()
    assert store is None, "backing off"


def test_an_unknown_layout_disables_the_connector_with_one_clear_error(
    tiny_model, pool, caplog
) -> None:
    weird = {name: torch.zeros(32, NB, 2, 128) for name in LAYER_NAMES}
    with caplog.at_level(logging.ERROR):
        connector = worker(tiny_model, pool, weird)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no layout adapter recognises this KV cache" in errors[0]
    assert "shape (32, 40, 2, 128)" in errors[0]
    assert connector.get_handshake_metadata().layout_fingerprint == NO_DATA_PATH
    failed = run_step(
        connector,
        MaruConnectorMetadata(
            loads=[ChunkTransfer(b"k0", [1, 2])], saves=[ChunkTransfer(b"k1", [3, 4])]
        ),
    )
    assert failed == {1, 2}


def test_stats_aggregate_across_workers_and_reduce_for_vllm_logs() -> None:
    from maru.vllm.stats import LOAD_ERRORS, LOAD_SECONDS, LOADS, MaruConnectorStats

    first = MaruKVConnector.build_kv_connector_stats({"loads": 2, "loaded_bytes": 100})
    second = MaruConnectorStats()
    second.add(LOADS)
    second.add(LOAD_SECONDS, 0.123456)
    second.add(LOAD_ERRORS)
    merged = first.aggregate(second).reduce()
    assert (merged["loads"], merged["loaded_bytes"], merged["load_errors"]) == (3, 100, 1)
    assert merged["load_seconds"] == 0.1235
    assert MaruConnectorStats().is_empty() and not first.is_empty()
    assert second.take().data["loads"] == 1 and second.take() is None, "reset after a report"
    assert second.lifetime["loads"] == 1


def test_a_load_counts_finding_its_objects_apart_from_copying_them(tiny_model, pool) -> None:
    """`load_open_seconds` is the part of `load_seconds` spent getting each chunk's object
    from the store (held up 20 ms a lookup here), never the copies (held up 50 ms)."""
    source, target = kv_caches(1), kv_caches(None)
    run_step(worker(tiny_model, pool, source), save_k0_k1())
    slow_copies = DeferredQueue(meanwhile=lambda: time.sleep(0.05))
    reader = worker(tiny_model, pool, target, queue=slow_copies, latency=0.02)
    assert run_step(reader, load_k0_k1()) == set()
    stats = reader.get_kv_connector_stats().data
    assert stats["load_open_seconds"] >= 2 * 0.02
    assert stats["load_seconds"] - stats["load_open_seconds"] >= 0.05


def test_latencies_join_and_the_latest_store_gauges_win_across_reports() -> None:
    from maru.vllm.stats import (
        LOAD_LATENCIES,
        STORE_OBJECTS,
        STORE_USED,
        MaruConnectorStats,
    )

    worker, scheduler = MaruConnectorStats(), MaruConnectorStats()
    worker.observe(LOAD_LATENCIES, 0.002)
    scheduler.observe(LOAD_LATENCIES, 0.004)
    scheduler.set_gauges({STORE_OBJECTS: 5, STORE_USED: 100})
    merged = worker.aggregate(scheduler)
    assert merged.data["load_latencies"] == [0.002, 0.004]
    later = MaruConnectorStats({"store_objects": 7})
    assert merged.aggregate(later).data["store_objects"] == 7
    assert "load_latencies" not in merged.reduce() and "store_objects" not in merged.reduce()
    assert not MaruConnectorStats({"load_latencies": [0.1]}).is_empty()


@pytest.mark.parametrize(
    ("version", "algorithm", "seed", "advice"),
    [
        ("0.32.0", "xxhash", None, "set PYTHONHASHSEED to one value everywhere, or use a sha256"),
        ("0.32.0", "xxhash_cbor", None, "or use a sha256 algorithm"),
        ("0.32.0", "sha256", None, None),
        ("0.32.0", "xxhash", "0", None),
        ("0.28.0", "sha256", None, "set PYTHONHASHSEED to one value everywhere (before vLLM 0.29"),
        ("0.28.0", "xxhash", None, "set PYTHONHASHSEED to one value everywhere (before vLLM 0.29"),
        ("0.28.0", "sha256", "0", None),
    ],
)
def test_a_per_process_hash_seed_is_reported_once_with_advice_for_the_release(
    tiny_model, caplog, monkeypatch, version, algorithm, seed, advice
) -> None:
    import vllm

    from maru.vllm.identity import warn_if_hash_seed_is_per_process

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    config = make_vllm_config(tiny_model, {"backend": "mock"})
    config.cache_config.prefix_caching_hash_algo = algorithm
    monkeypatch.setattr(vllm, "__version__", version)
    with caplog.at_level(logging.WARNING):
        warn_if_hash_seed_is_per_process(config)
    messages = [r.getMessage() for r in caplog.records if "hash seed" in r.getMessage()]
    assert len(messages) == (0 if advice is None else 1)
    if advice is not None:
        assert advice in messages[0]
    if version == "0.28.0":
        assert not any("or use" in message for message in messages), "sha256 is no cure there"


def test_a_copy_that_fails_mid_step_never_reaches_vllm(tiny_model, pool) -> None:
    source = kv_caches(1)
    run_step(
        worker(tiny_model, pool, source),
        MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])]),
    )
    reader = worker(tiny_model, pool, kv_caches(None), queue=FailingQueue(after=0))
    failed = run_step(
        reader,
        MaruConnectorMetadata(
            loads=[ChunkTransfer(b"k0", [11, 12])], saves=[ChunkTransfer(b"k1", [1, 2])]
        ),
    )
    assert failed == {11, 12}
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        assert store.contains([rank_key(b"k1", 0)]) == [False]


def logged_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_object_too_big_for_a_chunk_is_a_miss_not_a_store_error(tiny_model, pool) -> None:
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        store.put(rank_key(b"k0", 0), bytes(HEADER_BYTES + 2 * LAYERS * 2 * 32 * 128 * 2 + 1))
        reader = worker(tiny_model, pool, kv_caches(None))
        failed = run_step(reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"k0", [1, 2])]))
    assert failed == {1, 2}
    assert reader.worker.store.available() is not None, "no back-off for a miss"


def test_an_invalid_key_is_not_taken_for_a_miss(tiny_model, pool, caplog) -> None:
    reader = worker(tiny_model, pool, kv_caches(None), settings={"error_backoff": 0})
    with caplog.at_level(logging.ERROR):
        for _ in range(2):
            failed = run_step(
                reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"k" * 600, [1, 2])])
            )
            assert failed == {1, 2}
    errors = logged_errors(caplog)
    assert len(errors) == 1 and "InvalidKeyError" in errors[0], errors
    assert reader.worker.store.available() is None, "off for good, even with no back-off"


def test_a_store_that_cannot_open_as_configured_turns_the_worker_off_once(
    tiny_model, pool, caplog, monkeypatch
) -> None:
    opened = []
    real_open = maru.open_store
    monkeypatch.setattr(
        maru, "open_store", lambda *args, **kw: opened.append(1) or real_open(*args, **kw)
    )
    with real_open(backend="mock", capacity="1MiB", mock={"name": pool}):
        connector = worker(tiny_model, pool, kv_caches(1), settings={"error_backoff": 0})
        with caplog.at_level(logging.WARNING):
            for step in range(3):
                failed = run_step(
                    connector,
                    MaruConnectorMetadata(
                        loads=[ChunkTransfer(b"k0", [1, 2])],
                        saves=[ChunkTransfer(b"k%d" % step, [3, 4])],
                    ),
                )
                assert failed == {1, 2}
    assert len(opened) == 1, "a ConfigError is not retried"
    messages = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("vllm.maru") and r.levelno >= logging.WARNING
    ]
    assert len(messages) == 1 and "ConfigError" in messages[0], messages
    assert "worker half is off" in messages[0] and "capacity" in messages[0]


def test_each_pipeline_stage_stores_and_loads_its_own_share(tiny_model, pool, monkeypatch):
    """Two stages of one tensor-parallel rank each hold other layers: one chunk is two
    objects (`@0`, `@1`), and each stage loads its own."""
    monkeypatch.setattr("maru.vllm.worker.tensor_parallel_rank", lambda: 0)
    written = {}
    for stage in (0, 1):
        monkeypatch.setattr("maru.vllm.worker.pipeline_parallel_rank", lambda s=stage: s)
        written[stage] = kv_caches(10 * stage + 1)
        writer = worker(tiny_model, pool, written[stage], pp_size=2)
        run_step(writer, MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])]))
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        assert store.contains([rank_key(b"k0", 0), rank_key(b"k0", 1)]) == [True, True]
    for stage in (1, 0):
        monkeypatch.setattr("maru.vllm.worker.pipeline_parallel_rank", lambda s=stage: s)
        target = kv_caches(None)
        reader = worker(tiny_model, pool, target, pp_size=2)
        assert (
            run_step(reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"k0", [11, 12])])) == set()
        )
        assert same_blocks(written[stage], [3, 7], target, [11, 12])


def test_an_unknown_rank_with_tensor_parallelism_turns_the_worker_off(
    tiny_model, pool, caplog
) -> None:
    source, target = kv_caches(1), kv_caches(None)
    run_step(
        worker(tiny_model, pool, source),
        MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])]),
    )
    with caplog.at_level(logging.ERROR):
        reader = worker(tiny_model, pool, target, tp_size=2)
    errors = logged_errors(caplog)
    assert len(errors) == 1 and "tensor-parallel rank is unknown" in errors[0], errors
    failed = run_step(
        reader,
        MaruConnectorMetadata(
            loads=[ChunkTransfer(b"k0", [11, 12])], saves=[ChunkTransfer(b"k1", [1, 2])]
        ),
    )
    assert failed == {11, 12}, "rank 0's share is not loaded into an unknown rank"
    assert not any(target[n].any() for n in LAYER_NAMES)
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        assert store.contains([rank_key(b"k1", 0), rank_key(b"k1", 1)]) == [False, False]


def test_a_tail_object_holds_fewer_blocks_and_loads_only_those(tiny_model, pool) -> None:
    """A prompt's last whole blocks after its whole chunks are one shorter object."""
    source = kv_caches(1)
    run_step(
        worker(tiny_model, pool, source),
        MaruConnectorMetadata(saves=[ChunkTransfer(b"tail", [5], req_id="r")]),
    )
    target = kv_caches(None)
    reader = worker(tiny_model, pool, target)
    failed = run_step(reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"tail", [11])]))
    assert failed == set() and same_blocks(source, [5], target, [11])
    failed = run_step(reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"tail", [12, 13])]))
    assert failed == {12, 13}, "more blocks than the object holds"
    assert not any(target[n][12:14].any() for n in LAYER_NAMES)


def test_a_save_is_committed_only_once_copied(tiny_model, pool) -> None:
    source = kv_caches(1)
    queue = DeferredQueue()  # a stream that has not run the copies yet
    writer = worker(tiny_model, pool, source, queue=queue)
    run_step(writer, MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7], req_id="r")]))
    key = rank_key(b"k0", 0)
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        assert store.contains([key]) == [False], "not visible before its copies are done"
        assert writer.get_finished(set()) == (None, None), "r is still running"
        assert store.contains([key]) == [False]
        queue.drain()
        assert writer.get_finished(set()) == (None, None)
        assert store.contains([key]) == [True], "committed at the first call after its copies"
    target = kv_caches(None)
    run_step(
        worker(tiny_model, pool, target),
        MaruConnectorMetadata(loads=[ChunkTransfer(b"k0", [11, 12])]),
    )
    assert same_blocks(source, [3, 7], target, [11, 12])


def test_a_finished_request_is_reported_in_the_next_step_once_its_copies_are_done(
    tiny_model, pool
) -> None:
    """vLLM runs one step after a request finishes (even in an idle engine, in every
    release) and frees its blocks when the worker reports it: the worker waits there
    for its copies, so no finished request's blocks stay held."""
    queue = DeferredQueue()
    writer = worker(tiny_model, pool, kv_caches(1), queue=queue)
    run_step(writer, MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7], req_id="r")]))
    run_step(writer, MaruConnectorMetadata(saves=[ChunkTransfer(b"k1", [4, 8], req_id="s")]))
    assert writer.get_finished({"r"}) == ({"r"}, None)
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        assert store.contains([rank_key(b"k0", 0)]) == [True]
    assert queue.ran < len(queue.queued), "s, still running, is not waited for"


def test_requests_without_saves_are_not_reported(tiny_model, pool) -> None:
    queue = DeferredQueue()
    writer = worker(tiny_model, pool, kv_caches(1), queue=queue)
    run_step(writer, MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7], req_id="r")]))
    queue.drain()
    assert writer.get_finished({"r", "other"}) == ({"r"}, None)
    assert writer.get_finished({"r"}) == (None, None), "reported once"


def test_on_the_cpu_saves_are_done_within_the_step_and_never_reported(tiny_model, pool) -> None:
    """The scheduler frees a finished request's blocks at once (nothing to wait for)."""
    writer = worker(tiny_model, pool, kv_caches(1))
    run_step(writer, MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7], req_id="r")]))
    with maru.open_store(backend="mock", mock={"name": pool}) as store:
        assert store.contains([rank_key(b"k0", 0)]) == [True]
    assert writer.get_finished({"r"}) == (None, None)


def save_k0_k1() -> MaruConnectorMetadata:
    """Two chunks saved from blocks 3, 7 and 1, 2 (`load_k0_k1` loads them)."""
    return MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7]), ChunkTransfer(b"k1", [1, 2])])


def load_k0_k1() -> MaruConnectorMetadata:
    """The chunks of `save_k0_k1` loaded into blocks 11, 12 and 20, 21."""
    return MaruConnectorMetadata(
        loads=[ChunkTransfer(b"k0", [11, 12]), ChunkTransfer(b"k1", [20, 21])]
    )


def test_a_load_whose_object_is_recycled_while_copying_fails_alone(tiny_model, pool_names) -> None:
    shm = {"backend": "shm", "capacity": "8MiB", "shm": {"name": pool_names()}}
    source, target = kv_caches(1), kv_caches(None)
    run_step(worker(tiny_model, "unused", source, settings=shm), save_k0_k1())
    store = maru.open_store(**shm)

    def recycle() -> None:  # while the copies run, k1 is evicted and its memory reused
        size = len(store.get(rank_key(b"k1", 0)))
        assert store.delete(rank_key(b"k1", 0))
        assert store.put(b"other", bytes(size))

    reader = worker(
        tiny_model, "unused", target, settings=shm, queue=DeferredQueue(meanwhile=recycle)
    )
    failed = run_step(reader, load_k0_k1())
    assert failed == {20, 21}, "exactly the recycled chunk's blocks are recomputed"
    assert same_blocks(source, [3, 7], target, [11, 12])
    assert reader.get_kv_connector_stats().data["loads"] == 1


def test_a_cpu_load_checks_the_checksum_of_the_bytes_it_copied(
    tiny_model, pool_names, monkeypatch
) -> None:
    """From a checksummed pool, each object is hashed as it is copied, never read again
    for its check, and an object corrupted in the pool fails its load alone."""
    name = pool_names()
    shm = {"backend": "shm", "capacity": "8MiB", "shm": {"name": name}}
    source, target = kv_caches(1), kv_caches(None)
    run_step(worker(tiny_model, "unused", source, settings=shm), save_k0_k1())
    store = maru.open_store(**shm)
    corrupt(store, shm_path(name), rank_key(b"k1", 0))
    reader = worker(tiny_model, "unused", target, settings=shm)
    hashed_whole = []
    monkeypatch.setattr(checksums, "checksum", lambda data: hashed_whole.append(data))
    failed = run_step(reader, load_k0_k1())
    assert failed == {20, 21}, "exactly the corrupt chunk's blocks are recomputed"
    assert same_blocks(source, [3, 7], target, [11, 12])
    assert hashed_whole == [], "no object was hashed again after its copy"
    assert store.pool.info()["corrupt"] == 1


def test_a_cache_on_an_unsupported_device_disables_the_worker_once(
    tiny_model, pool, caplog
) -> None:
    on_meta = {name: cache.to("meta") for name, cache in kv_caches(None).items()}
    with caplog.at_level(logging.ERROR):
        reader = worker(tiny_model, pool, on_meta)
        failed = run_step(reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"k0", [1, 2])]))
    errors = logged_errors(caplog)
    assert len(errors) == 1 and "device meta" in errors[0] and "supports cpu, cuda" in errors[0]
    assert failed == {1, 2}
    assert reader.get_handshake_metadata().layout_fingerprint == NO_DATA_PATH


def test_copies_a_lower_tier_could_not_take_are_counted_as_dropped(
    tiny_model, pool, tmp_path, monkeypatch
) -> None:
    """mock in front of a disk whose writes are stuck, with room for one queued copy: of
    four saved chunks one is being copied, one waits, two are dropped (kept in memory)."""
    tiers = {
        "backend": "tiered",
        "tiered": {"tiers": ["mock", "disk"], "write_queue": 1},
        "disk": {"path": str(tmp_path / "disk")},
    }
    writer = worker(tiny_model, pool, kv_caches(1), settings=tiers)
    store = writer.worker_half.store.available()
    disk = store.tiers[1]
    writing, released = stall_reservations(monkeypatch, disk)
    run_step(writer, MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [1, 2])]))
    assert writing.wait(10)
    saves = [ChunkTransfer(f"k{i}".encode(), [2 * i + 1, 2 * i + 2]) for i in range(1, 4)]
    run_step(writer, MaruConnectorMetadata(saves=saves))
    stats = writer.get_kv_connector_stats().data
    assert (stats["saves"], stats["copies_dropped"]) == (4, 2)
    released.set()
    assert store.flush(10)
    assert sum(disk.contains([rank_key(f"k{i}".encode(), 0) for i in range(4)])) == 2


@pytest.mark.parametrize("moved", [True, False])
def test_a_cpu_kv_cache_is_moved_onto_huge_pages_unless_configured_not_to(
    tiny_model, pool, moved
) -> None:
    """As vLLM allocates a CPU cache: each layer's cache a view of one buffer, which
    maru moves onto huge pages at registration, keeping every byte."""
    per_layer = kv_caches(None)[LAYER_NAMES[0]].numel()
    buffer = random_in_fresh_memory((4 * 2**20,), torch.bfloat16)  # 8 MiB, more than used
    before, huge_before = buffer.clone(), anon_huge_bytes_at(middle_of(buffer))
    caches = {
        name: buffer[i * per_layer : (i + 1) * per_layer].view(NB, 2, 32, 128)
        for i, name in enumerate(LAYER_NAMES)
    }
    worker(tiny_model, pool, caches, settings={"kv_cache_huge_pages": moved})
    assert torch.equal(buffer, before)
    huge = anon_huge_bytes_at(middle_of(buffer))
    assert huge >= 4 * 2**20 if moved and thp_collapse_available() else huge == huge_before
