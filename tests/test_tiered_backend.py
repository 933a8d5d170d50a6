"""The tiered backend: shm in front of Redis and of a disk, copies written in the
background, promotion, restarts, and tiers that fail."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

import maru
from maru.backends._pool.index import key_hash
from maru.backends.base import ReadView
from maru.backends.shm import shm_path
from maru.testing import KIB, BackendContract, EvictionContract, payload
from tests.conftest import failing, stall_reservations, unique_name
from tests.redis_server import RedisServer, free_port


class TestTieredContract(BackendContract):
    @pytest.fixture
    def make_store(self, tiered):
        return tiered


def test_a_put_reaches_every_tier(tiered) -> None:
    store = tiered()
    assert store.put(b"k", b"both")
    assert store.flush(10)
    shm, redis = store.tiers
    assert shm.get(b"k") == b"both" and redis.get(b"k") == b"both"


def test_a_reservation_commits_to_every_tier(tiered) -> None:
    store = tiered()
    with store.reserve(b"k", 4) as buffer:
        buffer[:] = b"zero"
    assert store.flush(10)
    assert [tier.get(b"k") for tier in store.tiers] == [b"zero", b"zero"]


def test_a_lower_tier_hit_is_copied_into_the_tiers_above(tiered) -> None:
    store = tiered()
    shm, redis = store.tiers
    redis.put(b"k", payload("k", 5000))
    out = bytearray(8000)
    assert store.get_into(b"k", out) == 5000
    assert bytes(out[:5000]) == payload("k", 5000)
    assert shm.get(b"k") == payload("k", 5000)


def test_lookups_ask_a_lower_tier_only_about_what_is_missing_above(tiered, monkeypatch):
    store = tiered()
    shm, redis = store.tiers
    shm.put(b"a", b"1")
    redis.put(b"b", b"2")
    asked: list[list[bytes]] = []
    original = redis.contains
    monkeypatch.setattr(redis, "contains", lambda keys: asked.append(list(keys)) or original(keys))
    assert store.contains([b"a", b"b", b"c"]) == [True, True, False]
    assert asked == [[b"b", b"c"]]


def test_a_failing_lower_tier_never_breaks_the_tier_above(tiered) -> None:
    store = tiered(url=f"redis://127.0.0.1:{free_port()}/0")
    assert store.put(b"k", b"local")
    assert store.get(b"k") == b"local"
    assert store.contains([b"k", b"missing"]) == [True, False]
    with store.reserve(b"r", 3) as buffer:
        buffer[:] = b"abc"
    assert store.get(b"r") == b"abc"
    assert store.get(b"missing") is None


def test_a_lost_lower_tier_mid_run_only_costs_its_copies(tiered, tmp_path) -> None:
    server = RedisServer(tmp_path / "lower").start()
    store = tiered(url=server.url)
    store.put(b"before", b"1")
    server.stop()
    assert store.put(b"after", b"2")
    assert store.get(b"before") == b"1" and store.get(b"after") == b"2"


def test_every_tier_failing_is_a_backend_error(tiered, monkeypatch) -> None:
    store = tiered(url=f"redis://127.0.0.1:{free_port()}/0")

    def broken(*args, **kwargs):
        raise maru.BackendError("shm broken for the test")

    monkeypatch.setattr(store.tiers[0], "contains", broken)
    with pytest.raises(maru.BackendError, match="every tier failed a lookup"):
        store.contains([b"k"])


@pytest.mark.parametrize(
    ("tiers", "problem"),
    [
        (["shm"], "at least 2"),
        (["shm", "shm"], "each backend may appear once"),
        (["shm", "tiered"], "cannot itself be 'tiered'"),
    ],
)
def test_tier_lists_are_validated(tiers, problem) -> None:
    with pytest.raises(maru.ConfigError, match=problem):
        maru.load_config(backend="tiered", tiered={"tiers": tiers})


@pytest.fixture
def plugin_tiers(open_stores, tmp_path):
    """Open a tiered store of a mock and the example plugin's dirstore (which cannot list
    its keys), in the order given."""

    def make(*tiers: str) -> maru.Backend:
        return open_stores(
            backend="tiered",
            capacity=1 << 20,
            namespace=unique_name(),
            tiered={"tiers": list(tiers)},
            mock={"name": unique_name()},
            dirstore={"path": str(tmp_path / "objects")},
        )

    return make


def test_a_tier_that_cannot_list_its_keys_is_left_out_of_keys_and_delete_prefix(
    plugin_tiers,
) -> None:
    store = plugin_tiers("mock", "dirstore")
    mock, dirstore = store.tiers
    assert (store.lists_keys, mock.lists_keys, dirstore.lists_keys) == (True, True, False)
    store.put(b"maru/a/1", b"x")
    store.put(b"maru/b/1", b"y")
    assert store.keys(b"maru/") == [b"maru/a/1", b"maru/b/1"]
    assert store.delete_prefix(b"maru/a/") == 1
    assert mock.contains([b"maru/a/1", b"maru/b/1"]) == [False, True]


def test_keys_are_unsupported_only_when_no_tier_can_list_them(plugin_tiers, monkeypatch) -> None:
    store = plugin_tiers("dirstore", "mock")
    monkeypatch.setattr(store.tiers[1], "lists_keys", False)

    def cannot(prefix: bytes) -> None:
        raise maru.UnsupportedOperationError("the mock backend does not support keys()")

    monkeypatch.setattr(store.tiers[1], "keys", cannot)
    monkeypatch.setattr(store.tiers[1], "delete_prefix", cannot)
    with pytest.raises(maru.UnsupportedOperationError, match=r"keys\(\).*dirstore, mock"):
        store.keys(b"maru/")
    with pytest.raises(maru.UnsupportedOperationError, match=r"delete_prefix\(\)"):
        store.delete_prefix(b"maru/")


@pytest.mark.parametrize(
    ("tiers", "medium"), [(("mock", "dirstore"), "host"), (("dirstore", "mock"), "disk")]
)
def test_the_bytes_live_where_the_first_tiers_do(plugin_tiers, tiers, medium) -> None:
    assert plugin_tiers(*tiers).medium == medium


class TestShmOverDiskContract(BackendContract, EvictionContract):
    @pytest.fixture
    def make_store(self, shm_disk):
        return lambda capacity: shm_disk(capacity, disk_capacity=str(capacity))


def test_saves_never_wait_for_a_slow_tier_and_a_full_queue_drops_counted(
    shm_disk, monkeypatch
) -> None:
    store = shm_disk(write_queue=2)
    shm, disk = store.tiers
    writing, released = stall_reservations(monkeypatch, disk)
    saved = [store.put(b"k0", payload("k0", 64 * KIB))]
    assert writing.wait(10)
    saved += [store.put(f"k{i}", payload(f"k{i}", 64 * KIB)) for i in range(1, 6)]
    assert saved == [True] * 6
    assert all(shm.contains([f"k{i}" for i in range(6)]))
    released.set()
    assert store.flush(10)
    copies = store.info()["tiers"]["disk"]["copies"]
    assert (copies["queued"], copies["written"], copies["dropped"]) == (6, 3, 3)
    assert sum(disk.contains([f"k{i}" for i in range(6)])) == 3


def test_an_object_evicted_from_memory_stays_on_disk_and_comes_back(shm_disk) -> None:
    store = shm_disk(capacity=1 << 20)
    shm = store.tiers[0]
    size = 200 * KIB
    for i in range(20):
        assert store.put(f"k{i}", payload(f"k{i}", size))
        assert store.flush(10)
    assert shm.contains([b"k0"]) == [False]
    assert store.contains([f"k{i}" for i in range(20)]) == [True] * 20
    view = store.view(b"k0")
    assert bytes(view.data) == payload("k0", size) and view.valid()
    assert store.flush(10)
    assert shm.get(b"k0") == payload("k0", size)
    out = bytearray(size)
    assert store.get_into(b"k1", out) == size and out == payload("k1", size)
    assert shm.get(b"k1") == payload("k1", size)


def test_a_restarted_node_with_an_empty_pool_hits_from_disk_at_once(shm_disk) -> None:
    first = shm_disk(pool="restart-" + unique_name())
    for i in range(8):
        first.put(f"k{i}", payload(f"k{i}", 100 * KIB))
    pool = first.tiers[0].options.name
    first.close()
    shm_path(pool).unlink()
    again = shm_disk(pool=pool)
    assert again.tiers[0].stats().objects == 0
    assert again.contains([f"k{i}" for i in range(8)]) == [True] * 8
    assert [again.get(f"k{i}") for i in range(8)] == [payload(f"k{i}", 100 * KIB) for i in range(8)]
    assert again.flush(10)
    assert again.tiers[0].stats().objects == 8


def test_a_copy_of_an_object_that_changed_while_copied_is_never_stored(
    shm_disk, monkeypatch
) -> None:
    store = shm_disk()
    shm, disk = store.tiers
    real_peek = shm.peek
    monkeypatch.setattr(shm, "peek", lambda key: ReadView(real_peek(key).data, lambda: False))
    assert store.put(b"k", payload("k", 10 * KIB))
    assert store.flush(10)
    assert disk.contains([b"k"]) == [False]
    assert store.info()["tiers"]["disk"]["copies"]["lost"] == 1


def test_a_copy_of_an_object_gone_before_its_turn_is_counted_lost(shm_disk, monkeypatch) -> None:
    store = shm_disk()
    shm, disk = store.tiers
    monkeypatch.setattr(shm, "peek", lambda key: None)
    store.put(b"k", b"v")
    assert store.flush(10)
    assert disk.contains([b"k"]) == [False]
    assert store.info()["tiers"]["disk"]["copies"]["lost"] == 1


def test_write_queue_zero_writes_copies_in_the_caller(shm_disk) -> None:
    store = shm_disk(write_queue=0)
    store.put(b"k", b"v")
    assert store.tiers[1].get(b"k") == b"v"
    assert store.copiers[1]._thread is None


def test_closing_writes_the_queued_copies(shm_disk, tmp_path) -> None:
    store = shm_disk()
    for i in range(30):
        store.put(f"k{i}", payload(f"k{i}", 64 * KIB))
    disk = store.tiers[1]
    store.close()
    with reopened_disk(tmp_path) as reopened:
        assert reopened.contains([f"k{i}" for i in range(30)]) == [True] * 30
    assert disk._closed


def test_three_tiers_promote_a_redis_hit_into_memory_and_disk(shm_disk, redis_server) -> None:
    store = shm_disk(tiers=("shm", "disk", "redis"), redis=redis_server.url)
    shm, disk, redis = store.tiers
    redis.put(b"k", payload("k", 5000))
    assert store.get(b"k") == payload("k", 5000)
    assert store.flush(10)
    assert shm.get(b"k") == payload("k", 5000) and disk.get(b"k") == payload("k", 5000)


def test_with_the_first_tier_failing_the_next_decides_and_copies_keep_the_bytes(
    shm_disk, redis_server, monkeypatch
) -> None:
    store = shm_disk(tiers=("shm", "disk", "redis"), redis=redis_server.url)
    shm, disk, redis = store.tiers

    def broken(*args, **kwargs):
        raise maru.BackendError("shm broken for the test")

    monkeypatch.setattr(shm, "put", broken)
    data = bytearray(payload("k", 5000))
    assert store.put(b"k", data)
    data[:] = bytes(len(data))
    assert store.flush(10)
    assert disk.get(b"k") == payload("k", 5000) and redis.get(b"k") == payload("k", 5000)


def test_copies_into_lower_tiers_are_not_uses_of_the_object(shm_disk) -> None:
    """A copy read is no hit, and gives no second chance against eviction."""
    store = shm_disk()
    shm = store.tiers[0]
    for i in range(5):
        store.put(f"k{i}", payload(f"k{i}", KIB))
    assert store.flush(10)
    assert store.info()["tiers"]["disk"]["copies"]["written"] == 5
    assert shm.stats().hits == 0
    pool = shm.pool
    entries = [pool.index.find(f"k{i}".encode(), key_hash(f"k{i}".encode())) for i in range(5)]
    assert [pool.tables.hot[e] for e in entries] == [0] * 5


def wait_until(condition: Callable[[], bool], seconds: float = 30) -> bool:
    """Poll `condition` until it holds; False after `seconds` (a guard against hangs)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def slowed_writes(
    monkeypatch: pytest.MonkeyPatch, tier: maru.Backend, until: Callable[[], bool]
) -> threading.Event:
    """Make each write into `tier` wait until `until()` holds (a slow tier); the event
    is set once a write has started."""
    writing = threading.Event()
    begin = tier._begin

    def slow(key: bytes, nbytes: int) -> object:
        writing.set()
        wait_until(until)
        return begin(key, nbytes)

    monkeypatch.setattr(tier, "_begin", slow)
    return writing


def reopened_disk(tmp_path) -> maru.Backend:
    return maru.open_store(
        backend="disk", capacity="64MiB", namespace="tiers", disk={"path": str(tmp_path / "disk")}
    )


def new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The threads alive now that were not in `before`."""
    return [thread for thread in threading.enumerate() if thread not in before]


def test_closing_with_copies_queued_for_a_slow_tier_writes_them_and_ends_its_thread(
    shm_disk, monkeypatch, tmp_path
) -> None:
    """Writes into the disk wait until the store is closing: close finds every copy
    queued, writes them all, and returns once the copier's thread has ended."""
    store = shm_disk()
    writing = slowed_writes(monkeypatch, store.tiers[1], lambda: store._closed)
    before = set(threading.enumerate())
    for i in range(10):
        assert store.put(f"k{i}", payload(f"k{i}", 16 * KIB))
    assert writing.wait(10)
    store.close()
    assert new_threads(before) == []
    assert store.copiers[1].counts["written"] == 10
    with reopened_disk(tmp_path) as reopened:
        assert reopened.contains([f"k{i}" for i in range(10)]) == [True] * 10


def test_copies_still_queued_when_close_wait_runs_out_are_dropped_and_no_thread_outlives_close(
    shm_disk, monkeypatch, tmp_path
) -> None:
    """The copy being written when closing gives up waiting is finished; the queued
    ones, and any submitted later, are counted as dropped; the copier's thread has
    ended once close returns."""
    store = shm_disk(close_wait=0)
    copier = store.copiers[1]
    writing = slowed_writes(monkeypatch, store.tiers[1], lambda: copier.counts["dropped"] >= 5)
    before = set(threading.enumerate())
    assert store.put(b"k0", payload("k0", 16 * KIB))
    assert writing.wait(10)
    for i in range(1, 6):
        assert store.put(f"k{i}", payload(f"k{i}", 16 * KIB))
    store.close()
    assert new_threads(before) == []
    copier.submit(b"late")
    assert new_threads(before) == []
    counts = copier.counts
    assert (counts["queued"], counts["written"], counts["dropped"]) == (7, 1, 6)
    with reopened_disk(tmp_path) as reopened:
        assert reopened.contains([f"k{i}" for i in range(6)]) == [True] + [False] * 5


def test_a_batched_read_asks_each_tier_once_for_what_the_tiers_above_lack(
    tiered, monkeypatch
) -> None:
    store = tiered()
    shm, redis = store.tiers
    shm.put(b"top", payload("top", 300))
    redis.put(b"below", payload("below", 5000))
    asked: list[list[bytes]] = []
    batched = redis.get_many_into

    def recorded(keys, outs):
        asked.append(list(keys))
        return batched(keys, outs)

    monkeypatch.setattr(redis, "get_many_into", recorded)
    monkeypatch.setattr(redis, "get_into", lambda *a: pytest.fail("read key by key"))
    outs = [bytearray(8000) for _ in range(3)]
    assert store.get_many_into([b"top", b"below", b"nowhere"], outs) == [300, 5000, None]
    assert asked == [[b"below", b"nowhere"]], "one batch, without what the pool held"
    assert bytes(outs[1][:5000]) == payload("below", 5000)
    assert shm.get(b"below") == payload("below", 5000), "promoted into the pool"
    assert (store.stats().hits, store.stats().misses) == (2, 1)


def test_a_batched_read_with_a_failing_lower_tier_is_a_miss_there(tiered, monkeypatch) -> None:
    store = tiered()
    shm, redis = store.tiers
    shm.put(b"top", b"x")
    monkeypatch.setattr(redis, "get_many_into", failing("down"))
    assert store.get_many_into([b"top", b"below"], [bytearray(8), bytearray(8)]) == [1, None]
    monkeypatch.setattr(shm, "get_many_into", failing("down"))
    with pytest.raises(maru.BackendError, match="every tier failed to read"):
        store.get_many_into([b"top"], [bytearray(8)])


def test_a_batched_put_lands_in_the_first_tier_and_is_copied_below(tiered) -> None:
    store = tiered()
    assert store.put_many([(b"a", b"1"), (b"b", b"22"), (b"a", b"3")]) == [True, True, False]
    assert store.flush(10)
    shm, redis = store.tiers
    assert [shm.get(b"a"), shm.get(b"b")] == [b"1", b"22"]
    assert [redis.get(b"a"), redis.get(b"b")] == [b"1", b"22"]


def test_a_lower_tier_whose_credentials_are_refused_at_open_is_left_out(
    open_stores, tmp_path, caplog
) -> None:
    server = RedisServer(tmp_path / "auth", "--requirepass", "right").start()
    try:
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        pool = unique_name("tier")
        store = open_stores(
            backend="tiered",
            tiered={"tiers": ["shm", "redis"]},
            shm={"name": pool},
            redis={"url": url},
        )
        assert [tier.name for tier in store.tiers] == ["shm"]
        assert store.put(b"k", b"local") and store.get(b"k") == b"local"
        refused = [r for r in caplog.records if "turned off" in r.getMessage()]
        assert len(refused) == 1 and "redis" in refused[0].getMessage()
        shm_path(pool).unlink(missing_ok=True)
    finally:
        server.stop()


def test_a_lower_tier_that_refuses_maru_later_is_turned_off_and_the_pool_serves_on(
    tiered, monkeypatch, caplog
) -> None:
    store = tiered()
    redis = store.tiers[1]
    calls: list[str] = []

    def refusing(name: str):
        def refuse(*args, **kwargs):
            calls.append(name)
            raise maru.ConfigError("redis: WRONGPASS invalid username-password pair")

        return refuse

    for name in ("contains", "put", "reserve", "get_many_into"):
        monkeypatch.setattr(redis, name, refusing(name))
    assert store.put(b"a", b"1")
    assert store.flush(10)
    assert store.contains([b"a", b"b"]) == [True, False]
    assert store.get_many_into([b"a", b"b"], [bytearray(4), bytearray(4)]) == [1, None]
    assert store.put(b"c", b"3") and store.flush(10)
    assert len(calls) == 1, f"asked once, then left alone: {calls}"
    refused = [r for r in caplog.records if "turned off" in r.getMessage()]
    assert len(refused) == 1
    assert store.tiers[1].name == "redis" and store.copiers[1].counts["failed"] == 2


def test_a_lower_tier_that_is_down_is_logged_now_and_then_not_for_every_copy(
    shm_disk, monkeypatch, caplog
) -> None:
    store = shm_disk(write_queue=0)  # copies in the caller: counted at once
    monkeypatch.setattr(store.tiers[1], "reserve", failing("disk gone"))
    for index in range(150):
        assert store.put(f"k{index}".encode(), b"x")
    assert store.copiers[1].counts["failed"] == 150
    logged = [r for r in caplog.records if "failed to store a copy" in r.getMessage()]
    assert len(logged) == 2, "the first failure and the 100th"
