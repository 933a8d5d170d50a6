"""`vllm serve` in a process of its own, for tests and benchmarks of the online path.

vLLM is never imported here: the server is the `vllm` command of this environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

STARTUP_S = 300


class ServerError(RuntimeError):
    """The server exited, or was not up in time; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def serve(
    model: Path,
    log: Path,
    transfer: dict | None,
    options: Sequence[str] = (),
    vllm: Path = Path(sys.executable).parent / "vllm",
) -> Iterator[str]:
    """`vllm serve MODEL OPTIONS` (`vllm`: the command, this environment's unless
    told) on a free loopback port, with `transfer` as its --kv-transfer-config; its
    base URL once /health answers."""
    port = free_port()
    command = [
        str(vllm),
        "serve",
        str(model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *options,
    ]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    with log.open("w") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while not healthy(url):
            if server.poll() is not None:
                raise ServerError(f"vllm serve exited: {log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise ServerError(f"not up in {STARTUP_S} s: {log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        server.wait(60)


def counter(url: str, name: str) -> float:
    """A counter of the server's /metrics, summed over its label sets."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{name}{{") or line.startswith(f"{name} ")
    )
