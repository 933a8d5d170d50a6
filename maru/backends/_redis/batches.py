"""One batch, split by node: each node's part runs on its own (in parallel in a cluster)
by its own deadline, so that a node that fails or hangs costs only its own keys. That
holds for a batch of one node's keys too (a single key's get or put): while another
primary of the cluster is presumed up, the failed node's keys are misses, not an error
that would make the connector skip the whole store."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from maru.backends._redis import connect
from maru.backends._redis.options import RedisOptions
from maru.backends._redis.topology import Cluster, Node, Single
from maru.errors import BackendError
from maru.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")
NODE_THREADS = 8
"""Nodes of a cluster asked at once by one batch."""


class Skipped(BackendError):
    """A node not asked, because it failed a moment ago (`node_backoff`)."""


Run = Callable[[Node, list[int]], list[Any]]
"""Runs one node's part of a batch (the indices of its names): one answer per index."""


class Batches:
    """Runs batches over the nodes of a topology; owns the threads that ask them."""

    def __init__(self, topology: Single | Cluster, options: RedisOptions, where: str) -> None:
        self.topology = topology
        self._options = options
        self._where = where
        self._threads = ThreadPoolExecutor(NODE_THREADS, "maru-redis") if options.cluster else None

    def run(self, operation: str, names: list[bytes], run: Run, miss: T) -> list[Any]:
        """`run(node, indices)` for each node's names: one answer per name, `miss` for
        those of a node that failed or that no node serves, or the first BackendError
        if every node asked failed and no other primary is presumed up (refused
        credentials raise a ConfigError)."""
        groups = self.topology.groups(names)
        outcomes = (
            list(self._threads.map(lambda group: self._attempt(operation, run, *group), groups))
            if self._threads is not None and len(groups) > 1
            else [self._attempt(operation, run, *group) for group in groups]
        )
        answers: list[Any] = [miss] * len(names)
        failed: list[tuple[Node | None, BackendError]] = []
        for (node, indices), outcome in zip(groups, outcomes, strict=True):
            if isinstance(outcome, BackendError):
                failed.append((node, outcome))
                continue
            for index, answer in zip(indices, outcome, strict=True):
                answers[index] = answer
        if failed:
            self.topology.failed(node for node, _ in failed if node is not None)
            if len(failed) == len(groups) and not self._others_up({n for n, _ in failed}):
                raise failed[0][1]
            for _, error in failed:
                if not isinstance(error, Skipped):
                    log.warning("maru redis: %s; its keys are misses", error)
        return answers

    def _others_up(self, failed: set[Node | None]) -> bool:
        """In a cluster, is a primary other than `failed` presumed up (it has not failed
        within `node_backoff`)?"""
        if self._threads is None:
            return False
        now = time.monotonic()
        return any(
            node not in failed and node.skip_until <= now for node in self.topology.primaries()
        )

    def _attempt(
        self, operation: str, run: Run, node: Node | None, indices: list[int]
    ) -> list[Any] | BackendError:
        """`run(node, indices)`, or the BackendError it failed with (other errors raise);
        in a cluster, a node that failed is skipped for `node_backoff` seconds."""
        if node is None:
            trouble = self.topology.trouble or "their slots have no primary"
            return BackendError(
                f"{operation}: no node of {self._where} serves these keys: {trouble}"
            )
        if self._threads is not None and (left := node.skip_until - time.monotonic()) > 0:
            return Skipped(f"{operation}: {node.where} failed; not asked for {left:.1f} s more")
        try:
            with connect.failures(operation, node.where, self._options):
                return run(node, indices)
        except BackendError as exc:
            if self._threads is not None:
                node.skip_until = time.monotonic() + self._options.node_backoff
            return exc

    def close(self) -> None:
        """Wait for the threads (each bounded by its deadline), then close every client."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        self.topology.close()
