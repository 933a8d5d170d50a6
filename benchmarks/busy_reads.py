"""Batched Redis reads beside a busy Python thread: what a background load meets when it
reads beside the engine's thread.

A private redis-server on loopback holds `--objects` objects of `--size` bytes; the
store reads them with one `get_many_into` (its replies read in one call that holds no
interpreter lock, `maru._respread`), `--repeats` times, alone and while another thread
of the same process runs Python without pause. The baseline, in the same run: the same
bytes over a plain loopback socket from another process, read in Python (`recv_into`),
alone and beside the busy thread. Reported: each median, and busy over quiet. The
record (`--json`) is stamped with commit, machine and versions.
"""

from __future__ import annotations

import argparse
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


def median_ms(read: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(store: maru.Backend, size: int, objects: int, repeats: int) -> dict[str, dict]:
    """Medians of the store's batched read and of the link's (the same bytes over a plain
    socket, read in Python), each alone and beside a busy thread."""
    keys = [b"busy-%d" % i for i in range(objects)]
    store.put_many([(key, bytes([i]) * size) for i, key in enumerate(keys)])
    outs = [bytearray(size) for _ in keys]
    link = LinkBaseline("tcp", size)
    reads = {
        "the store": lambda: store.get_many_into(keys, outs),
        "a plain socket": lambda: [link.receive(out) for out in outs],
    }
    results = {}
    try:
        for name, read in reads.items():
            quiet = median_ms(read, repeats)
            with busy_thread():
                busy = median_ms(read, repeats)
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
    with tempfile.TemporaryDirectory(prefix="maru-busy-reads-") as folder:
        server = RedisServer(Path(folder), "--maxmemory-policy", "allkeys-lru").start()
        config = maru.load_config(backend="redis", capacity="1GiB", redis={"url": server.url})
        try:
            with maru.open_store(config) as store:
                results = measure(store, parse_size(args.size), args.objects, args.repeats)
        finally:
            server.stop()
    print(f"{args.objects} objects of {args.size}, one get_many_into, median of {args.repeats}:")
    for reader, r in results.items():
        print(
            f"  {reader:<15} quiet {r['quiet_ms']:6.1f} ms   beside a busy "
            f"thread {r['busy_ms']:6.1f} ms   ({r['busy/quiet']:.1f}x)"
        )
    write_record("busy_reads", args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
