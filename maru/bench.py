"""`maru bench`: backend throughput and latency, as ratios to memcpy in the same run.

These machines are noisy, so every throughput is reported next to a plain
memcpy of the same bytes, measured in the same run, and latencies are medians.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import maru

KIB, MIB = 2**10, 2**20
DEFAULT_SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 32 * MIB)
BENCH_BYTES = 256 * MIB
"""Bytes moved per object size (more repetitions for small objects)."""


@dataclass
class SizeResult:
    """Throughput for one object size, in GB/s, and the ratios to memcpy."""

    size: int
    memcpy_gbps: float
    put_gbps: float
    get_into_gbps: float

    @property
    def put_ratio(self) -> float:
        return self.put_gbps / self.memcpy_gbps

    @property
    def get_ratio(self) -> float:
        return self.get_into_gbps / self.memcpy_gbps


def bench_config(backend: str, capacity: int, config_file: str | None = None) -> maru.MaruConfig:
    """The benchmark's configuration, so that it never touches a serving store.

    shm, cxl and mock get a private pool. redis has no private server: the benchmark
    measures the server the user's configuration names (`redis.url`), under a namespace
    of its own, and deletes what it writes.
    """
    tag = f"bench-{os.getpid()}"
    sections: dict[str, Any] = {
        "mock": {"mock": {"name": tag}},
        "shm": {"shm": {"name": tag, "prefault": True}},
        "cxl": {
            "cxl": {"mode": "emulated", "device": f"/dev/shm/maru-{tag}-cxl", "prefault": True}
        },
    }
    return maru.load_config(config_file, backend=backend, capacity=capacity, namespace=tag,
                            **sections.get(backend, {}))


def _median_seconds(action: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def bench_size(store: maru.Backend, size: int, run: int, written: list[bytes]) -> SizeResult:
    """put and get_into of `size`-byte objects, and memcpy of the same bytes.

    Each repetition writes a new object and reads a different one, as serving
    does; the memcpy baseline copies to and from as many distinct buffers. The keys
    written are added to `written`.
    """
    repeats = max(5, min(200, BENCH_BYTES // size))
    source = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    target = np.empty_like(source)
    arena = np.ones((repeats, size), dtype=np.uint8)
    slots = itertools.cycle(range(repeats))
    memcpy_to = _median_seconds(lambda: np.copyto(arena[next(slots)], source), repeats)
    memcpy_from = _median_seconds(lambda: np.copyto(target, arena[next(slots)]), repeats)
    keys = [f"bench-{run}-{size}-{i}".encode() for i in range(repeats)]
    written.extend(keys)
    puts, gets = iter(keys), itertools.cycle(keys)
    put = _median_seconds(lambda: store.put(next(puts), source), repeats)
    get = _median_seconds(lambda: store.get_into(next(gets), target), repeats)
    if store.get_into(keys[-1], target) is None or not np.array_equal(target, source):
        raise maru.BackendError(f"benchmark read back wrong bytes for {size}-byte objects")
    memcpy = (memcpy_to + memcpy_from) / 2
    return SizeResult(size, size / memcpy / 1e9, size / put / 1e9, size / get / 1e9)


def bench_latency(store: maru.Backend, written: list[bytes]) -> dict[str, float]:
    """Median microseconds of contains(128 keys) and of a 4 KiB put and get; the keys
    written are added to `written`."""
    keys = [f"lat-{i}".encode() for i in range(128)]
    smalls = [f"small-{i}".encode() for i in range(2000)]
    written.extend(keys[::2] + smalls)
    for key in keys[::2]:
        store.put(key, bytes(64))
    small = np.ones(4 * KIB, dtype=np.uint8)
    out = np.empty_like(small)
    puts = iter(smalls)
    return {
        "contains_128_us": _median_seconds(lambda: store.contains(keys), 500) * 1e6,
        "put_4k_us": _median_seconds(lambda: store.put(next(puts), small), 2000) * 1e6,
        "get_4k_us": _median_seconds(lambda: store.get_into(b"small-0", out), 2000) * 1e6,
    }


def _delete_written(store: maru.Backend, written: list[bytes]) -> None:
    """Delete the benchmark's objects, so a shared server holds at most one size's worth."""
    for key in written:
        store.delete(key)
    written.clear()


def run_bench(
    backend: str,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    capacity: int = 1 << 30,
    progress: Callable[[str], None] | None = None,
    config_file: str | None = None,
) -> dict[str, Any]:
    """Benchmark one backend; the report as plain data. Leaves nothing behind."""
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    written: list[bytes] = []
    with maru.open_store(bench_config(backend, capacity, config_file)) as store:
        try:
            results = []
            for run, size in enumerate(sizes):
                progress(f"{backend}: {size // KIB} KiB objects ...")
                results.append(bench_size(store, size, run, written))
                _delete_written(store, written)
            progress(f"{backend}: latency ...")
            latency = bench_latency(store, written)
        finally:
            if hasattr(store, "destroy"):
                store.destroy()
            else:
                _delete_written(store, written)
    return {
        "backend": backend,
        "sizes": [
            asdict(r) | {"put_ratio": r.put_ratio, "get_ratio": r.get_ratio} for r in results
        ],
        "latency": latency,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    lines = [
        f"backend {report['backend']}: throughput in GB/s, ratio to memcpy of the same bytes",
        f"{'size':>8} {'memcpy':>8} {'put':>8} {'ratio':>6} {'get_into':>9} {'ratio':>6}",
    ]
    for r in report["sizes"]:
        lines.append(
            f"{_size_label(r['size']):>8} {r['memcpy_gbps']:8.2f} {r['put_gbps']:8.2f} "
            f"{r['put_ratio']:6.2f} {r['get_into_gbps']:9.2f} {r['get_ratio']:6.2f}"
        )
    latency = report["latency"]
    lines.append(
        f"contains(128 keys) median {latency['contains_128_us']:.1f} us; "
        f"4 KiB put {latency['put_4k_us']:.1f} us, get_into {latency['get_4k_us']:.1f} us"
    )
    return "\n".join(lines)


def _size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
