"""Batched Redis reads beside a busy Python thread: what a background load meets when it
reads beside the engine's thread.

A private redis-server on loopback holds `--objects` objects of `--size` bytes. Read,
`--repeats` times, alone and while another thread of the same process runs Python
without pause: by a Redis store's `get_many_into` (its replies read in one call that
holds no interpreter lock, `maru._respread`), and by a tiered store's `fetch_many`, shm
in front of that Redis, what a background load calls (the objects read straight into
the pool, which is emptied before each read). The baseline, in the same run: the same
bytes over a plain loopback socket from another process, read in Python (`recv_into`).
Reported: each median, and busy over quiet. The record (`--json`) is stamped with
commit, machine and versions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from remote_loads import write_record

import maru
from maru.cli._redis_server import RedisServer
from maru.cli.link_baseline import LinkBaseline
from maru.sizes import parse_size


@contextmanager
def busy_thread() -> Iterator[None]:
    """Another thread running Python without pause, for the block."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def median_ms(read: Callable[[], object], repeats: int, reset: Callable[[], object]) -> float:
    """The median time of `read`, `reset` (untimed) before each."""
    times = []
    for _ in range(repeats):
        reset()
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(redis: maru.Backend, tiered: maru.Backend, args: argparse.Namespace) -> dict:
    """Medians of a Redis store's batched read, of a tiered store's fetch of the same
    objects from the Redis below its shm pool (into the pool; emptied before each), and
    of the link's (the same bytes over a plain socket, read in Python), each alone and
    beside a busy thread."""
    size = parse_size(args.size)
    keys = [b"busy-%d" % i for i in range(args.objects)]
    redis.put_many([(key, bytes([i]) * size) for i, key in enumerate(keys)])
    outs = [bytearray(size) for _ in keys]
    pool = tiered.tiers[0]
    link = LinkBaseline("tcp", size)
    reads = {
        "redis get_many_into": (lambda: redis.get_many_into(keys, outs), lambda: None),
        "tiered fetch_many": (
            lambda: tiered.fetch_many(keys, [size] * len(keys)),
            lambda: [pool.delete(key) for key in keys],
        ),
        "a plain socket": (lambda: [link.receive(out) for out in outs], lambda: None),
    }
    results = {}
    try:
        for name, (read, reset) in reads.items():
            quiet = median_ms(read, args.repeats, reset)
            with busy_thread():
                busy = median_ms(read, args.repeats, reset)
            results[name] = {"quiet_ms": quiet, "busy_ms": busy, "busy/quiet": busy / quiet}
    finally:
        link.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=4)
    parser.add_argument("--size", default="2MiB")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/busy_reads.json"))
    args = parser.parse_args(argv)
    pool = f"busy-reads-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="maru-busy-reads-") as folder:
        server = RedisServer(Path(folder), "--maxmemory-policy", "allkeys-lru").start()
        redis = {"url": server.url, "key_prefix": "busy:"}
        try:
            with (
                maru.open_store(maru.load_config(backend="redis", redis=redis)) as store,
                maru.open_store(
                    maru.load_config(
                        backend="tiered",
                        capacity="256MiB",
                        shm={"name": pool},
                        tiered={"tiers": ["shm", "redis"]},
                        redis=redis,
                    )
                ) as tiered,
            ):
                results = measure(store, tiered, args)
                tiered.tiers[0].destroy()
        finally:
            server.stop()
    print(f"{args.objects} objects of {args.size} in one call, median of {args.repeats}:")
    for reader, r in results.items():
        print(
            f"  {reader:<20} quiet {r['quiet_ms']:6.1f} ms   beside a busy "
            f"thread {r['busy_ms']:6.1f} ms   ({r['busy/quiet']:.1f}x)"
        )
    write_record("busy_reads", args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
