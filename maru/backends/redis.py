"""Redis or Valkey: one store shared by instances on many machines.

Maru uses the server as it is: a single server, a primary watched by Sentinels, or a
Redis Cluster. Each object is one string value, written with `SET NX` (first writer
wins, and a reader sees the whole value or nothing). Eviction is the server's: run it
with `maxmemory` and `maxmemory-policy allkeys-lru` (checked, with a warning, at open).

Every call has a deadline, `timeout` plus its bytes at `min_throughput`, and there are
no retries, because the store sits on the inference path: a failure is a
`BackendError`, which the connector treats as a miss. Credentials or permissions the
server refuses are a `ConfigError` instead, since retrying cannot fix them. Batches
(`contains`, `get_many_into`, `put_many`) take one round trip per node; in a cluster
the nodes are asked in parallel, and a node that fails or is slow costs only its own
keys (misses), unless every node asked failed. Reads land straight in the caller's
buffer (`get_into`, `get_many_into`); a large one is read in ranges of one version of the
object (`chunked_reads`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

from maru.backends._redis.options import RedisOptions
from maru.backends.base import Backend, StoreStats
from maru.errors import BackendError, ObjectTooLargeError
from maru.hookspecs import hookimpl

try:  # redis-py is optional (maru[redis]): without it the backend is listed, not opened
    import redis

    from maru.backends._redis import connect
    from maru.backends._redis.batches import Batches
    from maru.backends._redis.policy import check_eviction_policy
    from maru.backends._redis.topology import Node, open_topology
    from maru.backends._redis.wire import Deadline, Reader, TooSmall, exchange, read_many_into
except ModuleNotFoundError as exc:
    if exc.name != "redis" and not (exc.name or "").startswith("redis."):
        raise
    redis = None  # type: ignore[assignment]

__all__ = ["RedisBackend", "RedisOptions"]

T = TypeVar("T")


class RedisBackend(Backend):
    """Objects as string values on a Redis/Valkey server, Sentinel primary or cluster."""

    name: ClassVar[str] = "redis"
    Options = RedisOptions
    description: ClassVar[str] = "Redis or Valkey (server, Sentinel, or cluster)"
    lists_keys = True

    def __init__(self, config: Any) -> None:
        if redis is None:
            raise BackendError("the redis backend needs redis-py: pip install 'maru[redis]'")
        super().__init__(config)
        self._prefix = f"{self.options.key_prefix}{config.namespace}:".encode()
        self._per_byte = 1 / self.options.min_throughput
        self._pending: set[bytes] = set()
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self._topology = open_topology(self.options)
        self._batches = Batches(self._topology, self.options, self.describe(self.options))
        check_eviction_policy(self._topology.primaries(), self.options)

    @classmethod
    def describe(cls, options: Any) -> str:
        """Where the server is (never the password), for `maru info`."""
        sentinel = options.sentinel
        if sentinel is not None:
            addresses = ",".join(f"{host}:{port}" for host, port in sentinel[0])
            return f"Redis primary {sentinel[1]!r} via Sentinels {addresses}"
        parts = urlsplit(options.url)
        where = parts.hostname or parts.path
        port = f":{parts.port}" if parts.port else ""
        more = f" (+{len(options.urls)} seed nodes)" if options.urls else ""
        kind = "Redis Cluster" if options.cluster else "Redis"
        return f"{kind} at {parts.scheme}://{where}{port}{more}"

    # --- batches, one per node -----------------------------------------------

    def _exchange(
        self,
        node: Node,
        commands: list[tuple[Any, ...]],
        read: Callable[[Reader], T],
        nbytes: int = 0,
    ) -> T:
        """`commands` to `node` in one round trip, by a deadline of `timeout` plus
        `nbytes` (and the bytes of the replies) at `min_throughput`."""
        timeout, per_byte = self.options.timeout, self._per_byte
        return exchange(node.pool, commands, read, lambda: Deadline(timeout, per_byte, nbytes))

    def _simple(self, operation: str, command: str, names: list[bytes], miss: Any) -> list[Any]:
        """One `command name` per name, pipelined per node: the replies."""

        def run(node: Node, indices: list[int]) -> list[Any]:
            commands = [(command, names[i]) for i in indices]
            return self._exchange(node, commands, lambda reader: _values(reader, len(commands)))

        return self._batches.run(operation, names, run, miss)

    # --- the contract --------------------------------------------------------

    def _key(self, key: bytes) -> bytes:
        return self._prefix + key

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self.config.capacity:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes is larger than the store ({self.config.capacity} "
                "bytes, the configured capacity)"
            )

    def _store(self, items: list[tuple[bytes, memoryview]]) -> list[bool]:
        """SET NX each (key, data), pipelined per node: which were stored."""
        expiry = ("PX", int(self.options.ttl * 1000)) if self.options.ttl else ()
        names = [self._key(key) for key, _ in items]

        def run(node: Node, indices: list[int]) -> list[bool]:
            commands = [("SET", names[i], items[i][1], "NX", *expiry) for i in indices]
            nbytes = sum(items[i][1].nbytes for i in indices)
            replies = self._exchange(node, commands, lambda r: _values(r, len(commands)), nbytes)
            return [reply is not None for reply in replies]

        return self._batches.run("set", names, run, False)

    def _put(self, key: bytes, data: memoryview) -> bool:
        return self._put_many([(key, data)])[0]

    def _put_many(self, items: list[tuple[bytes, memoryview]]) -> list[bool]:
        for _, data in items:
            self._check_size(data.nbytes)
        with self._lock:
            free = [i for i, (key, _) in enumerate(items) if key not in self._pending]
        stored = [False] * len(items)
        for i, done in zip(free, self._store([items[i] for i in free]), strict=True):
            stored[i] = done
        return stored

    def _begin(self, key: bytes, nbytes: int) -> tuple[Any, memoryview] | None:
        self._check_size(nbytes)
        with self._lock:
            if key in self._pending:
                return None
            self._pending.add(key)
        try:
            if self._contains([key])[0]:
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
            self._store([(key, memoryview(buffer))])
        finally:
            self._release(key)

    def _abort(self, handle: tuple[bytes, bytearray]) -> None:
        self._release(handle[0])

    def _count(self, answers: list[Any]) -> None:
        found = sum(answer is not None for answer in answers)
        with self._lock:
            self._hits += found
            self._misses += len(answers) - found

    def _get(self, key: bytes) -> bytes | None:
        data = self._simple("get", "GET", [self._key(key)], None)
        self._count(data)
        return data[0]

    def _get_into(self, key: bytes, out: memoryview) -> int | None:
        return self._get_many_into([key], [out])[0]

    def _get_many_into(self, keys: list[bytes], outs: list[memoryview]) -> list[int | None]:
        names = [self._key(key) for key in keys]

        chunked = self.options.chunked_reads

        def run(node: Node, indices: list[int]) -> list[Any]:
            commands, read = read_many_into(
                [names[i] for i in indices], [outs[i] for i in indices], chunked
            )
            return self._exchange(node, commands, lambda reader: list(map(_raised, read(reader))))

        sizes = self._batches.run("get", names, run, None)
        for key, out, size in zip(keys, outs, sizes, strict=True):
            if isinstance(size, TooSmall):
                raise self.too_small(key, size.size, out.nbytes)
        self._count(sizes)
        return sizes

    def _contains(self, keys: list[bytes]) -> list[bool]:
        found = self._simple("exists", "EXISTS", [self._key(key) for key in keys], 0)
        return [bool(count) for count in found]

    def _delete(self, key: bytes) -> bool:
        return bool(self._simple("delete", "DEL", [self._key(key)], 0)[0])

    # --- tools ---------------------------------------------------------------

    @contextmanager
    def _failures(self, operation: str, node: Node) -> Iterator[None]:
        with connect.failures(operation, node.where, self.options):
            yield

    def _scan(self, prefix: bytes) -> list[bytes]:
        """The server's names of the keys under this store's prefix and `prefix`, on
        every primary."""
        pattern = _glob_escape(self._prefix + prefix) + b"*"
        names: list[bytes] = []
        for node in self._topology.primaries():
            with self._failures("scan", node):
                names.extend(node.client.scan_iter(match=pattern, count=1000))
        return names

    def _keys(self, prefix: bytes) -> list[bytes]:
        return [name[len(self._prefix) :] for name in self._scan(prefix)]

    def _delete_prefix(self, prefix: bytes) -> int:
        return sum(self._simple("delete", "DEL", self._scan(prefix), 0))

    def _stats(self) -> StoreStats:
        """Objects and bytes under this store's prefix (a SCAN: for tools, not hot paths);
        hits and misses of this process; evictions as the servers count them."""
        names = self._scan(b"")
        sizes = self._simple("strlen", "STRLEN", names, 0)
        evicted = sum(
            self._server_stats(node).get("evicted_keys", 0) for node in self._topology.primaries()
        )
        with self._lock:
            return StoreStats(
                self.config.capacity, sum(sizes), len(names), self._hits, self._misses, evicted
            )

    def _server_stats(self, node: Node) -> dict[str, Any]:
        """INFO stats, or nothing from a server or proxy without INFO (no eviction count)."""
        with self._failures("info", node):
            try:
                return node.client.info("stats")
            except redis.ResponseError:
                return {}

    def _close(self) -> None:
        self._batches.close()


def _values(reader: Reader, count: int) -> list[Any]:
    """`count` replies; the first error among them raised once all were read."""
    return [_raised(value) for value in [reader.value() for _ in range(count)]]


def _raised(value: T) -> T:
    if isinstance(value, Exception):
        raise value
    return value


@hookimpl
def maru_backends() -> list[type[Backend]]:
    return [RedisBackend]


def _glob_escape(text: bytes) -> bytes:
    """`text` as a literal in a Redis MATCH pattern."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", text)
