"""Redis or Valkey: one store shared by instances on many machines.

Maru uses the server as it is: a single server, a replicated one, or a Redis
Cluster. Each object is one string value, written with `SET NX` (first writer
wins, and a reader sees the whole value or nothing). Eviction is the server's:
run it with `maxmemory` and `maxmemory-policy allkeys-lru`. Timeouts are short
and there are no retries, because the store sits on the inference path: every
failure is a `BackendError`, which the connector treats as a miss.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator

from maru.backends.base import Backend, StoreStats
from maru.config import Options
from maru.errors import BackendError, ObjectTooLargeError
from maru.hookspecs import hookimpl

SCHEMES = ("redis", "rediss", "unix")


class RedisOptions(Options):
    """The `redis:` config section."""

    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="redis://, rediss:// (TLS) or "
        "unix:// address of a server (or of any node of a cluster)",
    )
    username: str | None = Field(None, description="ACL user (or in the URL)")
    password: SecretStr | None = Field(
        None, description="password; set it with MARU_REDIS__PASSWORD rather than in a file"
    )
    db: int | None = Field(None, ge=0, description="database number (not in cluster mode)")
    key_prefix: str = Field("maru:", description="prefix of every key maru writes")
    ttl: float | None = Field(None, gt=0, description="seconds an object lives, if set")
    connect_timeout: float = Field(0.5, gt=0, le=60, description="seconds to connect")
    timeout: float = Field(0.5, gt=0, le=60, description="seconds to wait for a reply")
    pool_size: int = Field(16, ge=1, le=1024, description="connections per process")
    cluster: bool = Field(False, description="the URL names a node of a Redis Cluster")

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        scheme = urlsplit(url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"scheme {scheme or '(none)'!r} is not one of {', '.join(SCHEMES)}")
        return url


class RedisBackend(Backend):
    """Objects as string values on a Redis/Valkey server or cluster."""

    name: ClassVar[str] = "redis"
    Options = RedisOptions
    description: ClassVar[str] = "Redis or Valkey (server, replicated, or cluster)"
    lists_keys = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._prefix = f"{self.options.key_prefix}{config.namespace}:".encode()
        self._client = self._connect()
        self._pending: set[bytes] = set()
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    @classmethod
    def describe(cls, options: Any) -> str:
        """Where the server is (never the password), for `maru info`."""
        parts = urlsplit(options.url)
        where = parts.hostname or parts.path
        port = f":{parts.port}" if parts.port else ""
        return (
            f"{'Redis Cluster' if options.cluster else 'Redis'} at {parts.scheme}://{where}{port}"
        )

    def _connect(self) -> Any:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise BackendError("the redis backend needs redis-py: pip install redis") from None
        options = self.options
        settings: dict[str, Any] = {
            "socket_connect_timeout": options.connect_timeout,
            "socket_timeout": options.timeout,
            "retry": Retry(NoBackoff(), 0),
            "max_connections": options.pool_size,
        }
        if options.username:
            settings["username"] = options.username
        if options.password:
            settings["password"] = options.password.get_secret_value()
        with self._failures("connect"):
            if options.cluster:
                from redis.cluster import RedisCluster

                return RedisCluster.from_url(options.url, **settings)
            if options.db is not None:
                settings["db"] = options.db
            return redis.Redis.from_url(options.url, **settings)

    @contextmanager
    def _failures(self, operation: str) -> Iterator[None]:
        """Every client or server error inside becomes a BackendError naming the operation
        and the server (never the password), which the connector treats as a miss."""
        import redis

        try:
            yield
        except redis.RedisError as exc:
            raise BackendError(
                f"{operation} on {self.describe(self.options)} failed: {type(exc).__name__}: {exc}"
            ) from None

    def _call(self, operation: str, *args: Any, **kwargs: Any) -> Any:
        """One command of the client."""
        with self._failures(operation):
            return getattr(self._client, operation)(*args, **kwargs)

    def _key(self, key: bytes) -> bytes:
        return self._prefix + key

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self.config.capacity:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes is larger than the store ({self.config.capacity} "
                "bytes, the configured capacity)"
            )

    def _store(self, key: bytes, data: Any) -> bool:
        ttl_ms = int(self.options.ttl * 1000) if self.options.ttl else None
        return bool(self._call("set", self._key(key), data, nx=True, px=ttl_ms))

    def _put(self, key: bytes, data: memoryview) -> bool:
        self._check_size(data.nbytes)
        with self._lock:
            if key in self._pending:
                return False
        return self._store(key, data)

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        self._check_size(nbytes)
        with self._lock:
            if key in self._pending:
                return None
            self._pending.add(key)
        try:
            if self._call("exists", self._key(key)):
                self._release(key)
                return None
        except BaseException:
            self._release(key)
            raise
        buffer = bytearray(nbytes)
        return (key, buffer), memoryview(buffer)

    def _release(self, key: bytes) -> None:
        with self._lock:
            self._pending.discard(key)

    def _commit(self, handle: tuple[bytes, bytearray]) -> None:
        key, buffer = handle
        try:
            self._store(key, buffer)
        finally:
            self._release(key)

    def _abort(self, handle: tuple[bytes, bytearray]) -> None:
        self._release(handle[0])

    def _count(self, found: bool) -> None:
        with self._lock:
            if found:
                self._hits += 1
            else:
                self._misses += 1

    def _get(self, key: bytes) -> bytes | None:
        data = self._call("get", self._key(key))
        self._count(data is not None)
        return data

    def _contains(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        pipeline = self._client.pipeline(transaction=False)
        for key in keys:
            pipeline.exists(self._key(key))
        return [bool(found) for found in self._call_pipeline(pipeline)]

    def _call_pipeline(self, pipeline: Any) -> list[Any]:
        with self._failures("pipeline"):
            return pipeline.execute()

    def _delete(self, key: bytes) -> bool:
        return bool(self._call("delete", self._key(key)))

    def _scan(self, prefix: bytes) -> list[bytes]:
        """The server's names of the keys under this store's prefix and `prefix`."""
        with self._failures("scan"):
            return list(
                self._client.scan_iter(match=_glob_escape(self._prefix + prefix) + b"*", count=1000)
            )

    def _keys(self, prefix: bytes) -> list[bytes]:
        return [name[len(self._prefix) :] for name in self._scan(prefix)]

    def _delete_prefix(self, prefix: bytes) -> int:
        names = self._scan(prefix)
        return sum(self._call("delete", *names[i : i + 1000]) for i in range(0, len(names), 1000))

    def _stats(self) -> StoreStats:
        """Objects and bytes under this store's prefix (a SCAN: for tools, not hot paths);
        hits and misses of this process; evictions as the server counts them."""
        keys = self._scan(b"")
        sizes = self._sizes(keys)
        evicted = sum(node.get("evicted_keys", 0) for node in _per_node(self._server_stats()))
        with self._lock:
            return StoreStats(
                self.config.capacity, sum(sizes), len(keys), self._hits, self._misses, evicted
            )

    def _server_stats(self) -> dict[str, Any]:
        """INFO stats, or nothing from a server or proxy without INFO (no eviction count)."""
        import redis

        with self._failures("info"):
            try:
                return self._client.info("stats")
            except redis.ResponseError:
                return {}

    def _sizes(self, keys: list[bytes]) -> list[int]:
        pipeline = self._client.pipeline(transaction=False)
        for key in keys:
            pipeline.strlen(key)
        return [int(size) for size in self._call_pipeline(pipeline)] if keys else []

    def _close(self) -> None:
        self._client.close()


def _per_node(info: dict[str, Any]) -> list[dict[str, Any]]:
    """INFO of a server, or of each node of a cluster (keyed by node)."""
    if info and all(isinstance(value, dict) for value in info.values()):
        return list(info.values())
    return [info]


@hookimpl
def maru_backends() -> list[type[Backend]]:
    return [RedisBackend]


def _glob_escape(text: bytes) -> bytes:
    """`text` as a literal in a Redis MATCH pattern."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", text)
