"""A private redis-server on a free loopback port: for `maru demo --remote redis`, and the
base of the tests' and benchmarks' servers. It binds 127.0.0.1 only, persists nothing,
and is stopped by whoever started it."""

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
PORT_TRIES = 5
"""How many ports a server tries before its start counts as failed."""
CLUSTER_BUS_OFFSET = 10000
"""A cluster node also listens on its port + 10000, which must exist and be free."""
READY_S = 20.0
"""How long a start waits for the server to answer."""


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
    """The path of `name` (redis-server, redis-cli); RuntimeError naming the install."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(INSTALL_HINT)
    return path


class RedisServer:
    """One redis-server on 127.0.0.1; `stop` and `start` again keep its port."""

    def __init__(
        self, directory: Path, *extra: str, port: int | None = None, cluster_bus: bool = False
    ) -> None:
        self.cluster_bus = cluster_bus
        self.port_chosen_here = port is None
        self.port = port or free_port(cluster_bus=cluster_bus)
        self.directory = directory
        self.extra = extra
        self.process: subprocess.Popen | None = None
        self.started_once = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server; a port another process took since it was chosen (a client's
        ephemeral port, say) is chosen again, on the first start only."""
        for _ in range(PORT_TRIES):
            if self._launch(self.arguments()):
                self.started_once = True
                return self
            if self.started_once or not self.port_chosen_here:
                break
            self.port = free_port(cluster_bus=self.cluster_bus)
        raise RuntimeError(f"redis-server on port {self.port} did not start: {self.log_tail()}")

    def arguments(self) -> list[str]:
        return [
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
        ]

    @property
    def log(self) -> Path:
        return self.directory / "server.log"

    def log_tail(self) -> str:
        try:
            return " / ".join(self.log.read_text(errors="replace").splitlines()[-3:])
        except OSError:
            return "(no log)"

    def _launch(self, arguments: list[str]) -> bool:
        """Whether the server started and answers; False if it exited (its port in use)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(arguments, stdout=log, stderr=subprocess.STDOUT)
        if self.wait_ready():
            return True
        self.kill()
        return False

    def wait_ready(self, seconds: float = READY_S) -> bool:
        """Whether the server answers PING within `seconds` (False at once if it exited)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return True
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=20)
            self.process = None

    def kill(self) -> None:
        """Stop at once, as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=20)
            self.process = None
