"""The redis backend: the contract on a real server and on a real cluster; failures
become BackendError (refused credentials a ConfigError), work resumes when the server is
back, and the production settings (deadlines, pool, TLS, Sentinel) do what they say."""

from __future__ import annotations

import uuid

import pytest
import redis

import maru
from maru.backends import redis as redis_backend
from maru.testing import BackendContract, payload
from tests.conftest import call_with_deadline, unique_name
from tests.redis_server import RedisCluster, RedisServer, Sentinel, SlowLink, tls_files, tls_server


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
    assert 0 < redis.Redis.from_url(redis_server.url).pttl(store._key(b"k")) <= 30_000


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
    open_stores, redis_server, monkeypatch, error
) -> None:
    store = open_stores(backend="redis", namespace=unique_name(), redis={"url": redis_server.url})

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(redis_backend, "exchange", fail)
    for operation in (
        lambda: store.get(b"k"),
        lambda: store.put(b"k", b"v"),
        lambda: store.delete(b"k"),
        lambda: store.contains([b"k"]),
        lambda: store.get_many_into([b"k"], [bytearray(1)]),
    ):
        with pytest.raises(maru.BackendError, match=type(error).__name__):
            operation()


# --- production settings ------------------------------------------------------

MIB = 1 << 20


@pytest.fixture
def slow_link(redis_server):
    """The shared server behind a link of 4 MB/s."""
    link = SlowLink(redis_server.port, 4e6)
    yield link
    link.close()


def test_a_call_gets_time_for_its_bytes_at_min_throughput(open_stores, slow_link) -> None:
    """2 MiB at 4 MB/s take longer than `timeout`; `min_throughput` 1 MB/s allows for them."""
    settings = {"url": slow_link.url, "timeout": 0.3, "min_throughput": "1MB"}
    store = open_stores(backend="redis", namespace=unique_name(), redis=settings)
    data = payload("big", 2 * MIB)
    assert store.put(b"big", data)
    out = bytearray(2 * MIB)
    assert store.get_into(b"big", out) == 2 * MIB and out == data


def test_a_call_past_its_deadline_is_a_timeout(open_stores, slow_link) -> None:
    settings = {"url": slow_link.url, "timeout": 0.3, "min_throughput": "100GB"}
    store = open_stores(backend="redis", namespace=unique_name(), redis=settings)
    with pytest.raises(maru.BackendError, match="Timeout"):
        store.put(b"big", payload("big", 2 * MIB))


def test_callers_beyond_the_pool_wait_for_a_connection(open_stores, redis_server) -> None:
    """8 threads on 2 connections, through a slow link so that their calls overlap."""
    import threading

    link = SlowLink(redis_server.port, 40e6)
    try:
        settings = {"url": link.url, "pool_size": 2, "pool_timeout": 30, "min_throughput": "1MB"}
        store = open_stores(backend="redis", namespace=unique_name(), redis=settings)
        store.put(b"k", payload("k", MIB))
        failures: list[Exception] = []

        def reader() -> None:
            for _ in range(5):
                try:
                    assert store.get_into(b"k", bytearray(MIB)) == MIB
                except Exception as exc:
                    failures.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
    finally:
        link.close()


@pytest.mark.parametrize(
    ("policy", "ttl", "warned"),
    [
        ("noeviction", None, True),
        ("volatile-lru", None, True),
        ("volatile-lru", 60, False),
        ("allkeys-lru", None, False),
    ],
)
def test_a_server_that_would_not_evict_maru_objects_is_named_at_open(
    open_stores, tmp_path, caplog, policy, ttl, warned
) -> None:
    server = RedisServer(tmp_path / "policy", "--maxmemory-policy", policy).start()
    try:
        with caplog.at_level("WARNING", logger="vllm.maru"):
            open_stores(backend="redis", redis={"url": server.url, "ttl": ttl})
        named = [m for m in caplog.messages if "maxmemory-policy allkeys-lru" in m and policy in m]
        assert bool(named) == warned, caplog.messages
    finally:
        server.stop()


def test_a_server_that_refuses_config_is_used_without_the_check(open_stores, tmp_path) -> None:
    server = RedisServer(tmp_path / "noconfig", "--rename-command", "CONFIG", '""').start()
    try:
        store = open_stores(backend="redis", namespace=unique_name(), redis={"url": server.url})
        assert store.put(b"k", b"v") and store.get(b"k") == b"v"
    finally:
        server.stop()


def test_a_refused_password_is_a_config_error_naming_it(open_stores, tmp_path) -> None:
    server = RedisServer(tmp_path / "auth", "--requirepass", "right").start()
    try:
        with pytest.raises(maru.ConfigError, match=r"redis\.password.*allowed"):
            open_stores(backend="redis", redis={"url": server.url, "password": "wrong"})
        store = open_stores(backend="redis", redis={"url": server.url, "password": "right"})
        assert store.put(b"k", b"v")
    finally:
        server.stop()


def test_a_command_the_acl_refuses_is_a_config_error_naming_the_user(open_stores, tmp_path) -> None:
    server = RedisServer(
        tmp_path / "acl", "--user", *["maru", "on", ">pw", "~*", "&*", "+@all", "-set"]
    ).start()
    try:
        settings = {"url": server.url, "username": "maru", "password": "pw"}
        store = open_stores(backend="redis", namespace=unique_name(), redis=settings)
        assert store.get(b"k") is None
        for write in (lambda: store.put(b"k", b"v"), lambda: store.put_many([(b"k", b"v")])):
            with pytest.raises(maru.ConfigError, match=r"redis\.username = 'maru' may not set"):
                write()
    finally:
        server.stop()


def test_tls_with_a_private_ca_and_a_client_certificate(open_stores, tmp_path) -> None:
    files = tls_files(tmp_path / "pki")
    server, port = tls_server(tmp_path / "tls", files)
    client = {"tls_cert_file": files["client"], "tls_key_file": files["client-key"]}
    url = f"rediss://localhost:{port}"
    try:
        store = open_stores(
            backend="redis",
            namespace=unique_name(),
            redis={"url": url, "tls_ca_file": files["ca"], **client},
        )
        assert store.put(b"k", b"over TLS") and store.get(b"k") == b"over TLS"
        unverified = open_stores(backend="redis", redis={"url": url, "tls_verify": False, **client})
        assert unverified.contains([b"k"]) == [False]
        untrusted = open_stores(backend="redis", redis={"url": url, **client})
        with pytest.raises(maru.BackendError, match="certificate verify failed"):
            untrusted.get(b"k")
    finally:
        server.stop()


def test_the_primary_is_found_through_sentinels(open_stores, redis_server, tmp_path) -> None:
    sentinel = Sentinel(tmp_path / "sentinel", redis_server.port, "cache").start()
    try:
        by_url = open_stores(
            backend="redis",
            namespace=unique_name(),
            redis={"url": f"redis+sentinel://127.0.0.1:{sentinel.port}/cache"},
        )
        by_fields = open_stores(
            backend="redis",
            namespace=by_url.config.namespace,
            redis={"sentinels": [f"127.0.0.1:{sentinel.port}"], "service_name": "cache"},
        )
        assert by_url.put(b"k", b"via sentinel")
        assert by_fields.get(b"k") == b"via sentinel"
        assert "Sentinels" in maru.open_store.__module__ or "cache" in by_url.describe(
            by_url.options
        )
    finally:
        sentinel.stop()


@pytest.mark.parametrize(
    ("redis_section", "names"),
    [
        ({"url": "redis://h:1/0?socket_timeout=9"}, r"redis\.url .*socket_timeout.*redis\.timeout"),
        ({"url": "redis://h:1/0?ssl_ca_certs=/x"}, r"ssl_ca_certs.*redis\.tls_ca_file"),
        ({"urls": ["redis://h:2"]}, r"urls .*cluster: true"),
        ({"url": "redis://h:1", "cluster": True, "urls": ["http://h"]}, r"redis\.urls.*scheme"),
        ({"tls_ca_file": "/no/such.pem"}, r"redis\.tls_ca_file = '/no/such.pem'.*no such file"),
        ({"tls_verify": False, "sentinels": ["h:1"]}, r"sentinels and service_name"),
        ({"sentinels": ["no-port"], "service_name": "s"}, r"redis\.sentinels.*host:port"),
        ({"url": "redis+sentinel://h:1"}, r"/service_name"),
        ({"url": "redis://h:1", "min_throughput": "fast"}, r"redis\.min_throughput.*size"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(redis_section, names) -> None:
    with pytest.raises(maru.ConfigError, match=names):
        maru.load_config(backend="redis", redis=redis_section)


def test_tls_files_need_a_rediss_url(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here")
    with pytest.raises(maru.ConfigError, match=r"tls_ca_file need a rediss:// url"):
        maru.load_config(backend="redis", redis={"url": "redis://h:1", "tls_ca_file": str(ca)})


def test_bench_shows_the_store_beside_the_link_it_runs_over(redis_server, monkeypatch) -> None:
    """`maru bench` on a local server also moves the same bytes over a plain socket to a
    peer process, and prints the store's throughput beside it."""
    from maru.cli.bench import format_report, run_bench

    monkeypatch.setenv("MARU_REDIS__URL", redis_server.url)
    report = run_bench("redis", sizes=(64 * 1024,), capacity=2**20, progress=lambda line: None)
    row = report["sizes"][0]
    assert row["link_send_gbps"] > 0 and row["link_receive_gbps"] > 0
    assert "plain socket transfers of the same bytes" in format_report(report)


def test_without_redis_py_the_backend_is_listed_and_opening_says_what_to_install() -> None:
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['redis'] = None\n"
        "import maru\n"
        "try:\n"
        "    maru.open_store(maru.load_config(backend='redis'))\n"
        "except maru.BackendError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert "needs redis-py: pip install 'maru[redis]'" in done.stdout, done.stderr


def test_after_a_sentinel_failover_the_store_writes_to_the_new_primary(
    open_stores, tmp_path
) -> None:
    primary = RedisServer(tmp_path / "primary", "--repl-diskless-sync-delay", "0").start()
    replica = RedisServer(tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port))
    replica.start()
    sentinel = Sentinel(tmp_path / "sentinel", primary.port, "cache").start()
    try:
        url = f"redis+sentinel://127.0.0.1:{sentinel.port}/cache"
        store = open_stores(backend="redis", namespace=unique_name(), redis={"url": url})
        assert store.put(b"before", b"1")
        copy = redis.Redis(port=replica.port)
        assert RedisCluster.wait(lambda: copy.exists(store._key(b"before")) == 1)
        primary.kill()

        def writes() -> bool:
            try:
                return store.put(f"after-{uuid.uuid4()}", b"2")
            except maru.BackendError:
                return False

        assert RedisCluster.wait(writes, seconds=60), "the Sentinel's new primary takes writes"
        assert store.get(b"before") == b"1"
    finally:
        for server in (sentinel, replica, primary):
            server.stop()


def getranges(server) -> int:
    """GETRANGE commands the server ran so far."""
    stats = redis.Redis.from_url(server.url).info("commandstats")
    return stats.get("cmdstat_getrange", {}).get("calls", 0)


@pytest.fixture
def roomy_redis(tmp_path):
    """A private redis-server that never evicts: the shared one evicts under 64 MB, and the
    reply buffers of a large read count towards that (CI once saw an object written a
    moment before evicted)."""
    server = RedisServer(tmp_path / "roomy").start()
    yield server
    server.stop()


def test_large_buffers_are_read_in_ranges_of_one_version(open_stores, roomy_redis) -> None:
    """A buffer of 16 MiB or more is filled by 1 MiB ranges in MULTI/EXEC: the whole object,
    a miss, an empty object, or BufferTooSmallError, as with one GET."""
    store = open_stores(backend="redis", namespace=unique_name(), redis={"url": roomy_redis.url})
    big, small = payload("big", 17 * MIB + 5), payload("small", 3 * MIB)
    assert store.put_many([(b"big", big), (b"small", small), (b"empty", b"")]) == [True] * 3
    before = getranges(roomy_redis)
    outs = [bytearray(18 * MIB) for _ in range(4)]
    keys = [b"big", b"small", b"missing", b"empty"]
    assert store.get_many_into(keys, outs) == [len(big), len(small), None, 0]
    assert outs[0][: len(big)] == big and outs[1][: len(small)] == small
    assert getranges(roomy_redis) - before == 4 * 18
    too_small = bytearray(16 * MIB)
    with pytest.raises(maru.BufferTooSmallError):
        store.get_into(b"big", too_small)
    assert too_small == bytearray(16 * MIB)
    plain = open_stores(
        backend="redis",
        namespace=store.config.namespace,
        redis={"url": roomy_redis.url, "chunked_reads": False},
    )
    before = getranges(roomy_redis)
    assert plain.get_into(b"big", outs[0]) == len(big) and getranges(roomy_redis) == before
