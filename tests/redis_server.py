"""Local redis-server processes on free loopback ports, for the tests.

They bind 127.0.0.1 only, persist nothing, and are stopped by whoever started them.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from redis.crc import key_slot

from maru.cli._redis_server import RedisServer as _RedisServer
from maru.cli._redis_server import free_port, redis_binary


class RedisServer(_RedisServer):
    """One redis-server on 127.0.0.1 (`maru.cli._redis_server`) that can also hang."""

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections open, nothing answered, as a hung node."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)


class RedisCluster:
    """Redis Cluster on loopback: three primaries, each with `replicas` replicas. Keys of a
    node that fails are refused, not the whole cluster's (`cluster-require-full-coverage
    no`), and it evicts as the README recommends."""

    def __init__(self, directory: Path, replicas: int = 0) -> None:
        self.replicas = replicas
        self.nodes = [
            RedisServer(
                directory / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
                "--cluster-require-full-coverage",
                "no",
                "--repl-diskless-sync-delay",
                "0",
                "--maxmemory",
                "64mb",
                "--maxmemory-policy",
                "allkeys-lru",
                cluster_bus=True,
            )
            for i in range(3 * (1 + replicas))
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
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        if not self.wait(lambda: all(self._ready(node) for node in self.nodes)):
            raise RuntimeError("the Redis Cluster did not become ready")
        return self

    @staticmethod
    def wait(condition: Callable[[], bool], seconds: float = 30) -> bool:
        """Whether `condition()` came true within `seconds` (asked every 0.2 s)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.2)
        return False

    def _ready(self, node: RedisServer) -> bool:
        """Whether `node` serves: each node learns the cluster's state by gossip, on its own."""
        info = cli(node.port, "cluster", "info")
        if "cluster_state:ok" not in info or f"cluster_known_nodes:{len(self.nodes)}" not in info:
            return False
        replicas = sum(
            "slave" in line.split()[2] for line in cli(node.port, "cluster", "nodes").splitlines()
        )
        replication = cli(node.port, "info", "replication")
        synced = "role:master" in replication or "master_link_status:up" in replication
        return replicas == 3 * self.replicas and synced

    def primary_of(self, name: bytes) -> RedisServer:
        """The node that serves the key `name` now (as the running nodes say)."""
        slot = key_slot(name)
        for node in self.nodes:
            if node.process is None:
                continue
            for line in cli(node.port, "cluster", "nodes").splitlines():
                fields = line.split()
                if "master" in fields[2] and "fail" not in fields[2] and _serves(fields[8:], slot):
                    return self.node_at(int(fields[1].split(":")[1].split("@")[0]))
        raise RuntimeError(f"no node serves slot {slot}")

    def node_at(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def stop(self) -> None:
        for node in self.nodes:
            node.resume()
            node.stop()


def _serves(ranges: list[str], slot: int) -> bool:
    """Whether CLUSTER NODES slot ranges ("0-5460", "7") include `slot`."""
    for text in ranges:
        if text.startswith("["):
            continue
        first, _, last = text.partition("-")
        if int(first) <= slot <= int(last or first):
            return True
    return False


def cli(port: int, *command: str) -> str:
    """redis-cli's answer to `command` from the server on `port` ("" if it does not answer)."""
    try:
        return subprocess.run(
            [redis_binary("redis-cli"), "-p", str(port), *command],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except subprocess.TimeoutExpired:
        return ""


class SlowLink:
    """A TCP proxy on loopback to the server on `port` that forwards at most `rate` bytes
    per second each way, as a slow network would."""

    def __init__(self, port: int, rate: float) -> None:
        self.target = port
        self.rate = rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(1 << 16):
                time.sleep(len(chunk) / self.rate)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


class Sentinel(RedisServer):
    """A redis-server in Sentinel mode watching the primary on `primary_port` as `name`."""

    def __init__(self, directory: Path, primary_port: int, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "sentinel.conf"
        config.write_text(
            f"sentinel monitor {name} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {name} 1000\n"
        )
        super().__init__(directory, "--sentinel")
        self.config = config

    def arguments(self) -> list[str]:
        return [redis_binary(), str(self.config), "--sentinel", "--port", str(self.port)]


def tls_files(directory: Path) -> dict[str, Path]:
    """A CA, and a server and a client certificate it signed (for localhost), as PEM files."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        name: directory / f"{name}.pem"
        for name in ("ca", "ca-key", "server", "server-key", "client", "client-key")
    }
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=maru test CA",
        "-keyout",
        files["ca-key"],
        "-out",
        files["ca"],
    )
    for name in ("server", "client"):
        request = directory / f"{name}.csr"
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            files[f"{name}-key"],
            "-out",
            request,
        )
        extensions = directory / f"{name}.ext"
        extensions.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            request,
            "-CA",
            files["ca"],
            "-CAkey",
            files["ca-key"],
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            extensions,
            "-out",
            files[name],
        )
    return files


def _openssl(*arguments: object) -> None:
    subprocess.run(
        [shutil.which("openssl") or "openssl", *map(str, arguments)],
        check=True,
        capture_output=True,
        timeout=60,
    )


def tls_server(directory: Path, files: dict[str, Path]) -> tuple[RedisServer, int]:
    """A redis-server that also listens with TLS (clients must show a certificate the CA
    signed): the server, and its TLS port."""
    tls_port = free_port()
    server = RedisServer(
        directory,
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(files["server"]),
        "--tls-key-file",
        str(files["server-key"]),
        "--tls-ca-cert-file",
        str(files["ca"]),
        "--tls-auth-clients",
        "yes",
    )
    return server.start(), tls_port
