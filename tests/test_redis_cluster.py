"""The redis backend on a real Redis Cluster whose nodes fail: a hung or dead node costs
only its own keys (misses) while the other nodes answer, the layout is learnt from any
seed node, and the store keeps serving after a replica takes over from a dead primary."""

from __future__ import annotations

import pytest

from maru.testing import payload
from tests.conftest import call_with_deadline, unique_name
from tests.redis_server import RedisCluster, free_port

SIZE = 1000
KEYS = [f"k{i}".encode() for i in range(30)]


@pytest.fixture
def cluster(tmp_path):
    started = RedisCluster(tmp_path / "cluster").start()
    yield started
    started.stop()


def cluster_store(open_stores, url: str, **redis):
    return open_stores(
        backend="redis",
        namespace=unique_name(),
        redis={"url": url, "cluster": True, "timeout": 0.3, "connect_timeout": 0.3, **redis},
    )


def on_node(cluster, store, node, keys) -> list[bool]:
    """Which of `keys` `node` serves."""
    return [cluster.primary_of(store._key(key)) is node for key in keys]


@pytest.mark.parametrize("failure", ["pause", "kill"])
def test_a_hung_or_dead_node_costs_only_its_own_keys(open_stores, cluster, failure) -> None:
    store = cluster_store(open_stores, cluster.url)
    assert store.put_many([(key, payload(key, SIZE)) for key in KEYS]) == [True] * len(KEYS)
    failing = cluster.primary_of(store._key(KEYS[0]))
    lost = on_node(cluster, store, failing, KEYS)
    assert 0 < sum(lost) < len(KEYS)
    new = [(key + b"-new", b"v") for key in KEYS]
    refused = on_node(cluster, store, failing, [key for key, _ in new])
    getattr(failing, failure)()

    status, present = call_with_deadline(lambda: store.contains(KEYS))
    assert status == "ok" and present == [not gone for gone in lost], present
    outs = [bytearray(SIZE) for _ in KEYS]
    status, sizes = call_with_deadline(lambda: store.get_many_into(KEYS, outs))
    assert status == "ok" and sizes == [None if gone else SIZE for gone in lost], sizes
    for key, out, gone in zip(KEYS, outs, lost, strict=True):
        assert gone or bytes(out) == payload(key, SIZE)
    status, stored = call_with_deadline(lambda: store.put_many(new))
    assert status == "ok" and stored == [not gone for gone in refused], stored


def test_the_hung_nodes_keys_come_back_when_it_answers_again(open_stores, cluster) -> None:
    store = cluster_store(open_stores, cluster.url, node_backoff=0.2)
    store.put_many([(key, b"v") for key in KEYS])
    hung = cluster.primary_of(store._key(KEYS[0]))
    hung.pause()
    assert not all(store.contains(KEYS))
    hung.resume()
    assert cluster.wait(lambda: store.contains(KEYS) == [True] * len(KEYS))


def test_a_node_that_failed_is_not_asked_again_for_node_backoff(
    open_stores, cluster, monkeypatch
) -> None:
    """Its keys are misses at once, instead of costing every call its deadline."""
    from maru.backends import redis as redis_backend

    store = cluster_store(open_stores, cluster.url, node_backoff=600)
    hung = cluster.primary_of(store._key(KEYS[0]))
    hung.pause()
    store.contains(KEYS)
    asked = []
    exchange = redis_backend.exchange
    monkeypatch.setattr(
        redis_backend, "exchange", lambda pool, *rest: asked.append(pool) or exchange(pool, *rest)
    )
    present = store.contains(KEYS)
    hung_pools = [
        node.pool for node in store._topology.primaries() if node.where.endswith(f":{hung.port}")
    ]
    assert len(hung_pools) == 1 and hung_pools[0] not in asked
    assert len(asked) == 2 and not any(present)


def test_a_dead_nodes_key_alone_is_a_miss_while_other_primaries_answer(
    open_stores, cluster
) -> None:
    """A single key's get or put on a dead node is a miss, not an error that would make
    the connector skip the whole store; only when every primary fails is it an error,
    so the connector backs off."""
    import maru

    store = cluster_store(open_stores, cluster.url, node_backoff=600)
    dead = cluster.primary_of(store._key(KEYS[0]))
    others = [key for key in KEYS if cluster.primary_of(store._key(key)) is not dead]
    dead.kill()
    assert store.get(KEYS[0]) is None
    assert store.put(KEYS[0], b"v") is False
    assert store.put(others[0], b"v") and store.get(others[0]) == b"v"
    for node in cluster.nodes:
        node.kill()
    with pytest.raises(maru.BackendError, match=r"Connection|refused|not asked"):
        for key in KEYS:  # each primary fails once; then no other is presumed up
            store.get(key)


def test_the_layout_is_learnt_from_any_seed_node(open_stores, cluster) -> None:
    dead_seed = f"redis://127.0.0.1:{free_port()}"
    store = cluster_store(open_stores, dead_seed, urls=[cluster.url])
    assert store.put(b"k", b"through a second seed")
    assert store.get(b"k") == b"through a second seed"
    assert store.contains([*KEYS, b"k"]) == [False] * len(KEYS) + [True]


def test_the_store_serves_every_key_after_a_replica_replaces_a_dead_primary(
    open_stores, tmp_path
) -> None:
    cluster = RedisCluster(tmp_path / "replicated", replicas=1).start()
    try:
        store = cluster_store(open_stores, cluster.url)
        dead = cluster.primary_of(store._key(KEYS[0]))
        dead.kill()
        fresh = [key + b"-after" for key in KEYS]

        def serves_all() -> bool:
            store.put_many([(key, b"v") for key in fresh])
            return store.contains(fresh) == [True] * len(fresh)

        assert cluster.wait(serves_all, seconds=60), "a replica took over the dead primary's slots"
        assert cluster.primary_of(store._key(KEYS[0])) is not dead
    finally:
        cluster.stop()


def test_no_thread_of_a_cluster_store_outlives_its_close(cluster) -> None:
    import threading

    import maru

    config = maru.load_config(
        backend="redis", namespace=unique_name(), redis={"url": cluster.url, "cluster": True}
    )
    with maru.open_store(config) as store:
        assert store.contains(KEYS) == [False] * len(KEYS)
        assert any(thread.name.startswith("maru-redis") for thread in threading.enumerate())
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("maru-redis")]


def test_cluster_mode_on_a_plain_server_says_why_no_node_serves(open_stores, redis_server) -> None:
    import maru

    url = redis_server.url.rsplit("/", 1)[0]
    store = open_stores(backend="redis", redis={"url": url, "cluster": True})
    with pytest.raises(maru.BackendError, match="cluster support disabled"):
        store.get(b"k")
