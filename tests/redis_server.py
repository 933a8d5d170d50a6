"""Local redis-server processes on free loopback ports, for the tests.

They bind 127.0.0.1 only, persist nothing, and are stopped by whoever started them.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

INSTALL_HINT = (
    "redis-server is missing: `make test` installs it (apt-get install -y "
    "redis-server); run that, or `apt-get install -y redis-server`"
)


CLUSTER_BUS_OFFSET = 10000
"""A cluster node also listens on its port + 10000, which must exist and be free."""


def free_port(*, cluster_bus: bool = False) -> int:
    """A loopback port nobody listens on (and, for a cluster node, its bus port too)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if not cluster_bus:
            return port
        if port + CLUSTER_BUS_OFFSET <= 65535 and _is_free(port + CLUSTER_BUS_OFFSET):
            return port


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def redis_binary(name: str = "redis-server") -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(INSTALL_HINT)
    return path


class RedisServer:
    """One redis-server on 127.0.0.1; `stop` and `start` again keep its port."""

    def __init__(self, directory: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.directory = directory
        self.extra = extra
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.wait_ready()
        return self

    def wait_ready(self, seconds: float = 20) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=20)
            self.process = None


class RedisCluster:
    """Three redis-server nodes joined into a Redis Cluster (no replicas)."""

    def __init__(self, directory: Path) -> None:
        self.nodes = [
            RedisServer(
                directory / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
                port=free_port(cluster_bus=True),
            )
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                redis_binary("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(self._ready(node) for node in self.nodes):
                return self
            time.sleep(0.2)
        raise RuntimeError("the Redis Cluster did not become ready")

    def _ready(self, node: RedisServer) -> bool:
        """Whether `node` serves: each node learns the cluster's state by gossip, on its own."""
        info = subprocess.run(
            [redis_binary("redis-cli"), "-p", str(node.port), "cluster", "info"],
            capture_output=True,
            text=True,
        ).stdout
        return "cluster_state:ok" in info and f"cluster_known_nodes:{len(self.nodes)}" in info

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
