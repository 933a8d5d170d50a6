"""`maru demo --remote redis`: engines A and B as two nodes that share only a Redis server.

Each node has a shm pool of its own in front of the shared Redis (`backend: tiered`,
`tiers: [shm, redis]`); A's saves reach Redis through its tiered store's copier, and B,
whose pool is empty, loads the prefix from Redis (B's scheduler reads it into B's pool
before vLLM schedules the request: a remote tier, `maru.vllm.staging`). The
Redis server is the configured one (`redis.url` in maru's config) under a key prefix of
the demo's own, removed afterwards, or else a private redis-server on a loopback port,
stopped afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import maru
from maru.cli._redis_server import INSTALL_HINT, RedisServer
from maru.errors import ConfigError

REMOTES = ("redis",)
"""The remote tiers `--remote` offers."""
COPIED_S = 30.0
"""How long B waits for A's objects to reach Redis (A's copier writes them after its
saves) before it runs anyway."""


@contextmanager
def redis_url(config: maru.MaruConfig) -> Iterator[str]:
    """The configured Redis's url, or a private redis-server's for the demo's duration."""
    if config.redis is not None:
        yield config.redis.url
        return
    if shutil.which("redis-server") is None:
        raise ConfigError(f"remote = 'redis': {INSTALL_HINT}; or configure one (redis.url)")
    with tempfile.TemporaryDirectory(prefix="maru-demo-redis-") as folder:
        server = RedisServer(Path(folder)).start()
        try:
            yield server.url
        finally:
            server.stop()


def node(config: maru.MaruConfig, name: str, url: str, capacity: int) -> maru.MaruConfig:
    """A node's store: a private shm pool of `capacity` bytes in front of the shared Redis."""
    key_prefix = f"maru-demo-{os.getpid()}:"
    return maru.MaruConfig.model_validate(
        {
            **config.model_dump(exclude={"backend", "shm", "redis", "tiered"}),
            "backend": "tiered",
            "capacity": capacity,
            "tiered": {"tiers": ["shm", "redis"]},
            "shm": {"name": f"demo-{os.getpid()}-{name}"},
            "redis": {"url": url, "key_prefix": key_prefix},
        }
    )


def wait_until_copied(config: maru.MaruConfig, progress: Callable[[str], None]) -> None:
    """Wait (at most COPIED_S) until Redis holds every object of A's pool."""
    with maru.open_store(config) as store:
        first, remote = store.tiers
        wanted, deadline = set(first.keys()), time.monotonic() + COPIED_S
        while not wanted <= set(remote.keys()):
            if time.monotonic() > deadline:
                progress(f"Redis lacks some of A's {len(wanted)} objects after {COPIED_S:.0f} s")
                return
            time.sleep(0.05)
        progress(f"Redis holds A's {len(wanted)} objects")


def clean_up(configs: tuple[maru.MaruConfig, ...]) -> None:
    """Destroy each node's pool and remove the demo's objects from Redis."""
    for config in configs:
        with maru.open_store(config) as store:
            first, remote = store.tiers
            remote.delete_prefix(b"")
            first.destroy()
