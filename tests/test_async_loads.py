"""Loads from a slow tier never stall the step: vLLM waits for them (WAITING_FOR_REMOTE_KVS)
while the worker reads them on its own threads; memory stores load inside the step."""

from __future__ import annotations

import threading
import time

import pytest

import maru
from maru.backends.mock import MockBackend
from maru.errors import BackendError, ConfigError
from maru.vllm.fetcher import Fetcher
from maru.vllm.metadata import ChunkTransfer, MaruConnectorMetadata
from tests.conftest import call_with_deadline, unique_name
from tests.test_connector_worker import LAYER_NAMES, kv_caches, run_step, same_blocks, worker

LOAD_EVERY_HIT = {"slow_hits": "always"}
"""These tests are about how a slow hit loads, not whether (`tests/test_load_policy.py`)."""
GUARD_S = 30
"""How long a test waits for what must happen before calling it hung (never a speed
requirement)."""


def tokens(count: int, start: int = 1) -> list[int]:
    return list(range(start, start + count))


@pytest.fixture
def remote(monkeypatch):
    """Make every mock store declare its bytes remote, as a network store does."""
    monkeypatch.setattr(MockBackend, "medium", "remote")


def blocked_reads(monkeypatch, store, error: Exception | None = None):
    """Make `store`'s reads wait: (reading, released): set once a read started, and to be
    set by the test to let reads go on (and raise `error`, if given)."""
    reading, released = threading.Event(), threading.Event()
    get_into = store._get_into

    def blocked(key: bytes, out: memoryview):
        reading.set()
        released.wait(GUARD_S)
        if error is not None:
            raise error
        return get_into(key, out)

    monkeypatch.setattr(store, "_get_into", blocked)
    return reading, released


def finished_loads(connector, count: int = 1) -> set[str]:
    """Wait until the worker has reported `count` requests' loads finished (a guard
    against a hang only); those requests."""
    until, finished = time.monotonic() + GUARD_S, set()
    while time.monotonic() < until:
        finished |= connector.get_finished(set())[1] or set()
        if len(finished) >= count:
            return finished
        time.sleep(0.01)
    raise AssertionError(f"{count} loads not reported finished in {GUARD_S} s: {finished}")


def load_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("maru-load")]


def background_load(block_ids: list[int]) -> MaruConnectorMetadata:
    return MaruConnectorMetadata(
        loads=[ChunkTransfer(b"k0", block_ids, req_id="r", background=True)]
    )


@pytest.fixture
def saved(tiny_model):
    """A mock store named by the returned pool holding chunk k0 from blocks 3 and 7 of
    the returned caches."""
    pool, source = unique_name("async"), kv_caches(1)
    writer = worker(tiny_model, pool, source)
    run_step(writer, MaruConnectorMetadata(saves=[ChunkTransfer(b"k0", [3, 7])]))
    yield pool, source
    writer.shutdown()


# the worker


def test_a_background_load_returns_at_once_and_is_reported_once_its_read_is_done(
    tiny_model, saved, monkeypatch
) -> None:
    pool, source = saved
    target = kv_caches(None)
    reader = worker(tiny_model, pool, target)
    reading, released = blocked_reads(monkeypatch, reader.worker.store.available())
    failed = call_with_deadline(lambda: run_step(reader, background_load([11, 12])))
    assert failed == ("ok", set()), "start_load_kv waited for the read"
    assert reading.wait(GUARD_S)
    assert [t.name for t in load_threads()], "the read runs on a maru-load thread"
    assert reader.get_finished(set()) == (None, None)
    assert all(not target[name].any() for name in LAYER_NAMES)
    released.set()
    assert finished_loads(reader) == {"r"}
    assert reader.get_block_ids_with_load_errors() == set()
    assert same_blocks(source, [3, 7], target, [11, 12])
    stats = reader.get_kv_connector_stats().data
    assert (stats["loads"], stats["background_loads"]) == (1, 1)
    reader.shutdown()
    assert load_threads() == [], "shutting down joins the load threads"


@pytest.mark.parametrize("how", ["failed", "missing", "timed out"])
def test_a_background_load_that_fails_reports_its_request_and_blocks(
    tiny_model, saved, monkeypatch, how
) -> None:
    pool, _ = saved
    settings = {"async_load_timeout": 0.01} if how == "timed out" else {}
    reader = worker(tiny_model, pool, kv_caches(None), settings=settings)
    error = BackendError("connection reset") if how == "failed" else None
    _, released = blocked_reads(monkeypatch, reader.worker.store.available(), error)
    meta = background_load([11, 12])
    if how == "missing":
        meta.loads[0].key = b"absent"
    run_step(reader, meta)
    if how != "timed out":
        released.set()
    assert finished_loads(reader) == {"r"}
    assert reader.get_block_ids_with_load_errors() == {11, 12}
    assert reader.get_kv_connector_stats().data["load_errors"] == 1
    released.set()
    reader.shutdown()
    assert load_threads() == []


def test_a_load_the_full_queue_cannot_take_fails_at_once(tiny_model, saved, monkeypatch) -> None:
    pool, _ = saved
    reader = worker(tiny_model, pool, kv_caches(None))
    reader.worker.background.fetcher = Fetcher(threads=1, queued=1)
    reading, released = blocked_reads(monkeypatch, reader.worker.store.available())
    loads = [
        ChunkTransfer(b"k0", [2 * i + 1, 2 * i + 2], 0, f"r{i}", background=True) for i in range(3)
    ]
    run_step(reader, MaruConnectorMetadata(loads=loads[:1]))
    assert reading.wait(GUARD_S), "r0 is being read"
    assert run_step(reader, MaruConnectorMetadata(loads=loads[1:])) == {5, 6}, "r2 found no room"
    assert reader.get_finished(set()) == (None, {"r2"}), "r1 waits its turn"
    released.set()
    assert finished_loads(reader, 2) == {"r0", "r1"}
    assert reader.get_block_ids_with_load_errors() == set()
    reader.shutdown()


def test_the_fetcher_never_waits_and_joins_its_threads() -> None:
    fetcher, released = Fetcher(threads=1, queued=1), threading.Event()
    assert fetcher.submit("slow", lambda: released.wait(GUARD_S) and "read", GUARD_S)
    assert fetcher.submit("queued", lambda: "also read", GUARD_S)
    assert not fetcher.submit("refused", lambda: "never read", GUARD_S), "the queue is full"
    assert fetcher.take() == []
    released.set()
    taken = []
    while len(taken) < 2:
        taken += fetcher.take()
    assert sorted((f.tag, f.result, f.error) for f in taken) == [
        ("queued", "also read", None),
        ("slow", "read", None),
    ]
    fetcher.close(GUARD_S)
    assert load_threads() == []


def test_loads_not_marked_background_are_done_within_the_step(tiny_model, saved) -> None:
    pool, source = saved
    target = kv_caches(None)
    reader = worker(tiny_model, pool, target)
    run_step(reader, MaruConnectorMetadata(loads=[ChunkTransfer(b"k0", [11, 12], req_id="r")]))
    assert same_blocks(source, [3, 7], target, [11, 12])
    assert reader.get_finished(set()) == (None, None), "vLLM does not wait for them"
    assert load_threads() == []
    reader.shutdown()


def test_a_bad_setting_is_refused_naming_it(tiny_model) -> None:
    with pytest.raises(ConfigError, match="async_loads = 'sometimes'"):
        worker(tiny_model, unique_name(), kv_caches(None), settings={"async_loads": "sometimes"})


# the scheduler


def hit(h, req_id: str, prompt: list[int]) -> tuple[int | None, bool]:
    """What the connector tells vLLM of a new request: tokens to load, and whether
    asynchronously."""
    return h.connector.get_num_new_matched_tokens(h.add(req_id, prompt), 0)


@pytest.mark.parametrize(
    ("medium", "mode", "background"),
    [
        ("host", "auto", False),
        ("remote", "auto", True),
        ("disk", "auto", True),
        ("remote", "never", False),
        ("host", "always", True),
    ],
)
def test_a_hit_loads_asynchronously_where_its_store_is_slow(
    harness, monkeypatch, medium, mode, background
) -> None:
    monkeypatch.setattr(MockBackend, "medium", medium)
    h = harness(settings={"async_loads": mode} | LOAD_EVERY_HIT)
    h.add("first", tokens(300))
    h.step()
    assert hit(h, "second", tokens(300)) == (288, background)
    assert hit(h, "miss", tokens(300, start=7000)) == (0, False)


def test_a_tiered_hit_loads_asynchronously_only_where_its_first_tier_lacks_it(
    harness, tmp_path
) -> None:
    disk = {"path": str(tmp_path / "disk")}
    tiers = {"backend": "tiered", "tiered": {"tiers": ["mock", "disk"]}, "disk": disk}
    h = harness(settings=tiers | LOAD_EVERY_HIT)
    h.add("first", tokens(300))
    h.step()
    assert hit(h, "in memory", tokens(300)) == (288, False)
    with maru.open_store(backend="disk", disk=disk) as below:
        for key in h.store.keys(b""):
            below.put(key, h.store.get(key))
            h.store.delete(key)
    assert hit(h, "on disk", tokens(300)) == (288, True)


def report(h, loaded: set[str], invalid_block_ids: set[int] = frozenset()) -> None:
    """A step in which the workers report these requests' loads done (and these blocks
    failed), with nothing else to run."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    output = h.scheduler.schedule()
    assert output.num_scheduled_tokens == {}
    kv_output = KVConnectorOutput(finished_recving=loaded, invalid_block_ids=invalid_block_ids)
    h.scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=[], req_id_to_index={}, sampled_token_ids=[], kv_connector_output=kv_output
        ),
    )


def test_a_remote_hit_waits_for_its_load_while_other_requests_run(harness, remote) -> None:
    from vllm.v1.request import RequestStatus

    h = harness(settings=LOAD_EVERY_HIT)
    h.add("first", tokens(300))
    h.step()
    h.add("other", tokens(100, start=9000))
    h.add("second", tokens(256) + tokens(150, start=5000))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"other": 100}
    assert h.scheduler.requests["second"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(meta.loads) == 4
    assert all(load.background and load.req_id == "second" for load in meta.loads)
    report(h, {"second"})
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"second": 150}, "it resumes after its hit"
    assert meta.loads == []


def test_a_failed_remote_load_is_recomputed_and_not_loaded_again(harness, remote) -> None:
    h = harness(settings=LOAD_EVERY_HIT)
    h.add("first", tokens(300))
    h.step()
    h.add("second", tokens(300))
    _, meta = h.step()
    assert meta.loads and all(load.background for load in meta.loads)
    report(h, {"second"}, invalid_block_ids=set(meta.loads[0].block_ids))
    output, meta = h.step()
    assert output.num_scheduled_tokens == {"second": 300}, "computed, not waited for again"
    assert meta.loads == []


def test_the_tiered_store_says_where_each_key_would_be_read(open_stores, tmp_path) -> None:
    store = open_stores(
        backend="tiered",
        tiered={"tiers": ["mock", "disk"]},
        mock={"name": unique_name()},
        disk={"path": str(tmp_path / "disk")},
    )
    assert store.put(b"both", b"x")
    assert store.flush(GUARD_S)
    assert store.tiers[1].put(b"below", b"y")
    assert store.media([b"both", b"below", b"nowhere"]) == ["host", "disk", "disk"]
