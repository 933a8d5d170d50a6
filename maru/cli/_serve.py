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
from collections.abc import Callable, Iterator, Sequence
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
def running(
    command: Sequence[str], log: Path, ready: Callable[[], bool], what: str
) -> Iterator[None]:
    """`command` in a process of its own (its output in `log`) for the block, entered
    once `ready()` answers true; stopped at the end."""
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=os.environ)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not ready():
            if process.poll() is not None:
                raise ServerError(f"{what} exited: {log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise ServerError(f"{what} not up in {STARTUP_S} s: {log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield
    finally:
        process.terminate()
        process.wait(60)


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
    command = [str(vllm), "serve", str(model), "--port", str(port), "--host", "127.0.0.1", *options]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    url = f"http://127.0.0.1:{port}"
    with running(command, log, lambda: healthy(url), "vllm serve"):
        yield url


def counter(url: str, name: str) -> float:
    """A counter of the server's /metrics, summed over its label sets."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{name}{{") or line.startswith(f"{name} ")
    )
