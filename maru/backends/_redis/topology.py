"""Where each key lives: one server (or the primary the Sentinels name), or the primary
of the key's slot in a cluster, so that a batch is split into one sub-batch per node and
a node that fails costs only its own keys."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from maru.backends._redis import connect
from maru.backends._redis.options import RedisOptions
from maru.backends._redis.wire import Deadline, exchange
from maru.errors import BackendError
from maru.log import get_logger

log = get_logger(__name__)

REFRESH_SECONDS = 1.0
"""A cluster's layout is asked for again at most this often (after a node failed)."""


@dataclass(eq=False)
class Node:
    """One server maru talks to, by its address (for messages) and its client."""

    where: str
    client: redis.Redis
    pool: Any = field(init=False)
    skip_until: float = field(init=False, default=0.0)
    """In a cluster, the node is not asked before this `time.monotonic()` (it failed)."""

    def __post_init__(self) -> None:
        self.pool = self.client.connection_pool


class Single:
    """Every key on one server (or on the primary the Sentinels name)."""

    trouble = ""

    def __init__(self, node: Node) -> None:
        self.node = node

    def groups(self, names: list[bytes]) -> list[tuple[Node | None, list[int]]]:
        """The names' indices, by the node that holds them (None: no node serves them)."""
        return [(self.node, list(range(len(names))))] if names else []

    def primaries(self) -> list[Node]:
        return [self.node]

    def failed(self, nodes: Iterable[Node]) -> None:
        """Nodes failed a call: a cluster looks at its layout again."""

    def close(self) -> None:
        self.node.client.close()


class Cluster:
    """Keys by slot, on the primary that serves the slot; the layout is learnt from any
    node that answers (`url`, then `urls`, then the nodes known already)."""

    def __init__(self, options: RedisOptions) -> None:
        self._options = options
        self._seeds = [options.url, *options.urls]
        self._nodes: dict[str, Node] = {}
        self._slots: list[Node | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._lock = threading.Lock()
        self._asked_at = -REFRESH_SECONDS
        self.trouble = ""
        """Why keys may have no node: the layout could not be learnt ("" when it was)."""
        self.refresh()

    def groups(self, names: list[bytes]) -> list[tuple[Node | None, list[int]]]:
        by_node: dict[Node | None, list[int]] = {}
        slots = self._slots
        for index, name in enumerate(names):
            by_node.setdefault(slots[key_slot(name)], []).append(index)
        return list(by_node.items())

    def primaries(self) -> list[Node]:
        return list(dict.fromkeys(node for node in self._slots if node is not None))

    def failed(self, nodes: Iterable[Node]) -> None:
        self.refresh(avoid=set(nodes))

    def refresh(self, avoid: Iterable[Node] = ()) -> None:
        """Learn which primary serves each slot, at most every REFRESH_SECONDS, asking the
        nodes that did not just fail first; the old layout stays if none answers."""
        if time.monotonic() - self._asked_at < REFRESH_SECONDS or not self._lock.acquire(False):
            return
        try:
            self._asked_at = time.monotonic()
            last = set(avoid)
            known = [node for node in self._nodes.values() if node not in last]
            for node in dict.fromkeys([*known, *map(self._node_at, self._seeds), *last]):
                slots = self._ask(node)
                if isinstance(slots, list):
                    self._slots = self._layout(slots, node)
                    self.trouble = ""
                    return
                self.trouble = f"no node told the cluster's layout (last: {slots})"
        finally:
            self._lock.release()
        log.warning("maru redis: %s; keeping the layout known before", self.trouble)

    def _ask(self, node: Node) -> list[Any] | str:
        """CLUSTER SLOTS from `node`, or why not (refused credentials raise)."""
        try:
            with connect.failures("ask the cluster's layout", node.where, self._options):
                deadline = partial(Deadline, self._options.timeout, 0.0)
                slots = exchange(node.pool, [("CLUSTER", "SLOTS")], _reply, deadline)
        except BackendError as exc:
            return str(exc)
        return (
            f"{node.where}: {type(slots).__name__}: {slots}"
            if isinstance(slots, Exception)
            else slots
        )

    def _layout(self, slots: list[Any], asked: Node) -> list[Node | None]:
        table: list[Node | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        asked_host = urlsplit(asked.where).hostname or ""
        for start, end, primary, *_replicas in slots:
            host = primary[0].decode() or asked_host
            node = self._node_at(f"{self._scheme}://{host}:{primary[1]}")
            table[start : end + 1] = [node] * (end + 1 - start)
        return table

    @property
    def _scheme(self) -> str:
        return urlsplit(self._options.url).scheme

    def _node_at(self, url: str) -> Node:
        """The node at `url` (its host and port; user and password from the fields or
        from the first URL), made once."""
        parts = urlsplit(url)
        where = f"{parts.scheme}://{parts.hostname}:{parts.port}"
        if where not in self._nodes:
            first = urlsplit(self._options.url)
            netloc = f"{first.netloc.rpartition('@')[0]}@" if "@" in first.netloc else ""
            address = urlunsplit(
                (parts.scheme, f"{netloc}{parts.hostname}:{parts.port}", "", "", "")
            )
            self._nodes[where] = Node(where, connect.client(self._options, address))
        return self._nodes[where]

    def close(self) -> None:
        for node in self._nodes.values():
            node.client.close()


def _reply(reader: Any) -> Any:
    return reader.value()


def open_topology(options: RedisOptions) -> Single | Cluster:
    """Where the configured keys live."""
    if options.cluster:
        return Cluster(options)
    sentinel = options.sentinel
    if sentinel is not None:
        return Single(Node(f"Sentinel service {sentinel[1]}", connect.sentinel_client(options)))
    parts = urlsplit(options.url)
    where = (
        f"{parts.scheme}://{parts.hostname or parts.path}{f':{parts.port}' if parts.port else ''}"
    )
    return Single(Node(where, connect.client(options, options.url)))
