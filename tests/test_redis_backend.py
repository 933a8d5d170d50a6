"""The redis backend: the contract on fakeredis, on a real server and on a real cluster;
failures become BackendError, and work resumes when the server is back."""

from __future__ import annotations

import fakeredis
import pytest

import maru
from maru.backends.redis import RedisBackend
from maru.testing import BackendContract, payload
from tests.conftest import call_with_deadline, unique_name
from tests.redis_server import RedisCluster, RedisServer


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


def redis_opener(open_stores, **redis):
    """make_store for the contract: every store gets a namespace of its own."""
    return lambda capacity: open_stores(
        backend="redis", capacity=capacity, namespace=unique_name(), redis=redis
    )


class TestFakeRedisContract(BackendContract):
    @pytest.fixture
    def make_store(self, open_stores, monkeypatch):
        server = fakeredis.FakeServer()
        monkeypatch.setattr(
            RedisBackend, "_connect", lambda self: fakeredis.FakeRedis(server=server)
        )
        return redis_opener(open_stores)


class TestRealRedisContract(BackendContract):
    @pytest.fixture
    def make_store(self, open_stores, redis_server):
        return redis_opener(open_stores, url=redis_server.url)


class TestRedisClusterContract(BackendContract):
    @pytest.fixture
    def make_store(self, open_stores, redis_cluster):
        return redis_opener(open_stores, url=redis_cluster.url, cluster=True)


def test_the_server_evicts_under_maxmemory(open_stores, redis_server) -> None:
    store = open_stores(backend="redis", namespace=unique_name(), redis={"url": redis_server.url})
    for i in range(120):
        assert store.put(f"k{i}", payload(f"k{i}", 1 << 20)), i
    present = store.contains([f"k{i}" for i in range(120)])
    assert present[-1] and not all(present), "allkeys-lru made room"
    assert store.get(b"k119") == payload("k119", 1 << 20)


def test_a_stopped_server_fails_fast_and_work_resumes(open_stores, tmp_path) -> None:
    server = RedisServer(tmp_path / "flaky").start()
    try:
        store = open_stores(
            backend="redis",
            namespace=unique_name(),
            redis={"url": server.url, "timeout": 0.3, "connect_timeout": 0.3},
        )
        assert store.put(b"before", b"1")
        server.stop()
        for operation in (
            lambda: store.get(b"before"),
            lambda: store.put(b"x", b"1"),
            lambda: store.contains([b"before", b"x"]),
        ):
            status, result = call_with_deadline(operation)
            assert status == "error" and isinstance(result, maru.BackendError), result
        server.start()
        assert store.put(b"after", b"2")
        assert store.get(b"after") == b"2"
    finally:
        server.stop()


def test_an_unreachable_server_is_a_backend_error(open_stores) -> None:
    from tests.redis_server import free_port

    store = open_stores(backend="redis", redis={"url": f"redis://127.0.0.1:{free_port()}/0"})
    with pytest.raises(maru.BackendError, match="Connection"):
        store.get(b"k")


def test_server_errors_such_as_oom_are_backend_errors(open_stores, tmp_path) -> None:
    server = RedisServer(
        tmp_path / "tiny", "--maxmemory", "1mb", "--maxmemory-policy", "noeviction"
    ).start()
    try:
        store = open_stores(backend="redis", redis={"url": server.url})
        with pytest.raises(maru.BackendError, match=r"OutOfMemoryError|OOM"):
            for i in range(10):
                store.put(f"k{i}", bytes(1 << 20))
    finally:
        server.stop()


def test_namespaces_share_one_server_without_seeing_each_other(open_stores, redis_server):
    first = open_stores(
        backend="redis", namespace="a", redis={"url": redis_server.url, "key_prefix": unique_name()}
    )
    second = open_stores(
        backend="redis",
        namespace="b",
        redis={"url": redis_server.url, "key_prefix": first.options.key_prefix},
    )
    first.put(b"k", b"from a")
    assert second.get(b"k") is None
    assert second.put(b"k", b"from b")
    assert first.get(b"k") == b"from a"


def test_ttl_expires_objects(open_stores, redis_server) -> None:
    store = open_stores(
        backend="redis", namespace=unique_name(), redis={"url": redis_server.url, "ttl": 30}
    )
    store.put(b"k", b"v")
    assert 0 < store._client.pttl(store._key(b"k")) <= 30_000


def test_the_password_is_never_shown(monkeypatch, capsys) -> None:
    from maru.cli import main

    monkeypatch.setenv("MARU_BACKEND", "redis")
    monkeypatch.setenv("MARU_REDIS__PASSWORD", "hunter2")
    monkeypatch.setenv("MARU_REDIS__URL", "redis://cache.example:6380/1")
    assert main(["config", "show"]) == 0
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert "redis.password" in out and "Redis at redis://cache.example:6380" in out
    config = maru.load_config()
    assert "hunter2" not in repr(config)
    assert config.redis.password.get_secret_value() == "hunter2"


@pytest.mark.parametrize("url", ["http://x", "localhost:6379", ""])
def test_urls_of_other_schemes_are_config_errors(url: str) -> None:
    with pytest.raises(maru.ConfigError, match=r"redis\.url = .*scheme"):
        maru.load_config(backend="redis", redis={"url": url})


def test_a_unix_socket_url_works(open_stores, tmp_path) -> None:
    socket_path = tmp_path / "redis.sock"
    server = RedisServer(
        tmp_path / "unix", "--unixsocket", str(socket_path), "--unixsocketperm", "700"
    ).start()
    try:
        store = open_stores(
            backend="redis", namespace=unique_name(), redis={"url": f"unix://{socket_path}"}
        )
        assert store.put(b"k", b"over a socket")
        assert store.get(b"k") == b"over a socket"
    finally:
        server.stop()


def cluster_and_server_errors():
    from redis import exceptions

    return [
        exceptions.ConnectionError("refused"),
        exceptions.TimeoutError("read timed out"),
        exceptions.ResponseError("OOM command not allowed"),
        exceptions.MovedError("3999 127.0.0.1:6381"),
        exceptions.AskError("3999 127.0.0.1:6381"),
        exceptions.ClusterDownError("CLUSTERDOWN"),
        exceptions.TryAgainError("TRYAGAIN"),
    ]


@pytest.mark.parametrize("error", cluster_and_server_errors(), ids=lambda e: type(e).__name__)
def test_every_redis_failure_is_a_backend_error_the_connector_can_treat_as_a_miss(
    open_stores, monkeypatch, error
) -> None:
    server = fakeredis.FakeServer()
    monkeypatch.setattr(RedisBackend, "_connect", lambda self: fakeredis.FakeRedis(server=server))
    store = open_stores(backend="redis", namespace=unique_name())

    def fail(*args, **kwargs):
        raise error

    for command in ("get", "set", "exists", "delete"):
        monkeypatch.setattr(store._client, command, fail)
    for operation in (
        lambda: store.get(b"k"),
        lambda: store.put(b"k", b"v"),
        lambda: store.delete(b"k"),
    ):
        with pytest.raises(maru.BackendError, match=type(error).__name__):
            operation()
