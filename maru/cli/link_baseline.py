"""The link's own throughput, for `maru bench` on a network store: plain transfers of the
same bytes over the same kind of socket as the store's (TCP to the same host, or the same
kind of Unix socket), to a peer process on this machine, in the same run.

A put is measured against sending the bytes and waiting for a one-byte answer, a read
against asking and receiving them into a buffer, as one request and reply each, which is
what a store at wire speed does. The peer must run where the server runs, so the
baseline exists only for a server on this machine (loopback or a Unix socket).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from maru.sizes import format_size

HEADER = struct.Struct("<cQ")
"""A request: b"P" (the bytes follow; answer one byte) or b"G" (answer the bytes), and a size."""
LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")
PEER = "import sys; from maru.cli.link_baseline import serve; serve(*sys.argv[1:])"
"""The peer process's program: arguments family, address ("" for TCP) and largest size."""


class LinkBaseline:
    """A peer process at the other end of one socket: `send` and `receive` move bytes
    as a store's put and read do."""

    def __init__(self, family: str, largest: int) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="maru-link-")
        address = str(Path(self._directory.name) / "peer.sock") if family == "unix" else ""
        self._peer = subprocess.Popen(
            [sys.executable, "-c", PEER, family, address, str(largest)],
            stdout=subprocess.PIPE,
            text=True,
        )
        where = self._peer.stdout.readline().strip()  # type: ignore[union-attr]
        if family == "unix":
            self._sock = socket.socket(socket.AF_UNIX)
            self._sock.connect(where)
        else:
            self._sock = socket.create_connection(("127.0.0.1", int(where)))
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._answer = bytearray(1)

    def send(self, data: Any) -> None:
        """Send `data` to the peer and wait for its one-byte answer."""
        view = memoryview(data).cast("B")
        self._sock.sendall(HEADER.pack(b"P", view.nbytes))
        self._sock.sendall(view)
        _receive_into(self._sock, memoryview(self._answer))

    def receive(self, out: Any) -> None:
        """Ask the peer for as many bytes as `out` holds, received straight into it."""
        view = memoryview(out).cast("B")
        self._sock.sendall(HEADER.pack(b"G", view.nbytes))
        _receive_into(self._sock, view)

    def close(self) -> None:
        self._sock.close()
        self._peer.wait(timeout=30)
        self._directory.cleanup()


def link_for(store: Any, largest: int) -> LinkBaseline | None:
    """The baseline for a store reached over a socket to this machine (its `url`), or
    None where there is none to measure (memory stores, a server on another host)."""
    if store.medium != "remote" or not isinstance(url := getattr(store.options, "url", None), str):
        return None
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return LinkBaseline("unix", largest)
    if parts.hostname in LOCAL_HOSTS and parts.scheme == "redis":
        return LinkBaseline("tcp", largest)
    return None


def link_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The store beside plain socket transfers of the same bytes (same run)."""
    return baseline_lines(
        rows,
        "plain socket transfers of the same bytes to a peer process",
        ("send", "link_send_gbps"),
        ("receive", "link_receive_gbps"),
    )


def baseline_lines(
    rows: list[dict[str, Any]], baseline: str, write: tuple[str, str], read: tuple[str, str]
) -> list[str]:
    """The store's put and get_into beside a baseline's write and read of the same bytes
    in the same run: `write` and `read` are each a column title and a row's field."""
    (write_title, write_gbps), (read_title, read_gbps) = write, read
    lines = [
        f"beside {baseline} (same run), GB/s:",
        f"{'size':>8} {write_title:>8} {'put':>8} {'ratio':>6} {read_title:>9} "
        f"{'get_into':>9} {'ratio':>6}",
    ]
    for r in rows:
        written, readback = r[write_gbps], r[read_gbps]
        lines.append(
            f"{format_size(r['size']):>8} {written:8.2f} {r['put_gbps']:8.2f} "
            f"{r['put_gbps'] / written:6.2f} {readback:9.2f} {r['get_into_gbps']:9.2f} "
            f"{r['get_into_gbps'] / readback:6.2f}"
        )
    return lines


def _receive_into(sock: socket.socket, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:
        received = sock.recv_into(view[done:])
        if not received:
            raise ConnectionError("the link baseline's peer closed the socket")
        done += received


def serve(family: str, address: str, largest: str) -> None:
    """The peer: prints where it listens, then answers one client until it closes, from
    and into one buffer of `largest` bytes."""
    if family == "unix":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
    else:
        listener = socket.create_server(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(60)  # a client that never comes: exit instead of waiting for good
    print(address or listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    if family == "tcp":
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = memoryview(bytearray(os.urandom(64)) * (int(largest) // 64 + 1))
    header = memoryview(bytearray(HEADER.size))
    try:
        while True:
            _receive_into(conn, header)
            kind, size = HEADER.unpack(header)
            if kind == b"P":
                _receive_into(conn, buffer[:size])
                conn.sendall(b"+")
            else:
                conn.sendall(buffer[:size])
    except ConnectionError:
        pass
