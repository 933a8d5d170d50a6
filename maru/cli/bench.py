"""`maru bench`: backend throughput and latency, as ratios to memcpy in the same run.

These machines are noisy, so every throughput is reported next to a plain
memcpy of the same bytes, measured in the same run, and latencies are medians.
Every copy, the baseline's and the store's, reads from and writes to buffers that
rotate through pre-touched memory larger than the CPU caches, as KV chunks do:
never the same cache-hot bytes twice. A backend that declares a private store
(`Backend.private_options`) is measured on one of its own; any other on the
configured store, under a namespace of its own, deleting what it wrote. A private
store that `wraps` is measured in steady state (after it has wrapped, so every put
evicts) and, for 4 MiB puts, on a fresh store's first pass, as a new serving node
sees it. The objects read back while measuring (the working set) are sized from what
the store holds at once: its capacity, and its entries where it has a fixed table of
them (`info()["entries"]`, a pool's); the report says what bounds them. A store on
local disk (`medium` "disk") is also measured against the device: a plain write of a
new file and a read of an earlier one, of the same size, in the store's own directory
(so on the same filesystem), in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

import maru
from maru.backends.base import MAX_KEY_BYTES
from maru.backends.registry import backend_class
from maru.cli._cpu_caches import last_level_cache_bytes
from maru.cli.command import Result, add_config_option
from maru.cli.link_baseline import baseline_lines, link_for, link_lines
from maru.cli.plots import bench_plot, png_destination, require_matplotlib
from maru.cli.working_set import WorkingSet, working_set
from maru.config import resolve_config
from maru.errors import ConfigError, UnsupportedOperationError
from maru.sizes import Size, format_size

KIB, MIB = 2**10, 2**20
DEFAULT_SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 32 * MIB)
BENCH_BYTES = 256 * MIB
"""Bytes moved per object size (more repetitions for small objects)."""
ARENA_BYTES = 256 * MIB
"""Least size of each rotating buffer (sources, targets); at least 4 times the L3."""
FIRST_PASS_SIZE = 4 * MIB
SAMPLES = ("memcpy", "put", "get", "fw", "fr", "ls", "lr")  # SizeResult's gbps, in order


@dataclass
class SizeResult:
    """Throughput for one object size, in GB/s, and the ratios to memcpy; for a store on
    local disk, also plain file writes and reads of the same bytes."""

    size: int
    working_set: WorkingSet
    memcpy_gbps: float
    put_gbps: float
    get_into_gbps: float
    file_write_gbps: float | None = None
    file_read_gbps: float | None = None
    link_send_gbps: float | None = None
    link_receive_gbps: float | None = None

    @property
    def put_ratio(self) -> float:
        return self.put_gbps / self.memcpy_gbps

    @property
    def get_ratio(self) -> float:
        return self.get_into_gbps / self.memcpy_gbps


def bench_config(
    backend: str, capacity: int, config_file: str | None = None, *, fresh: bool = False
) -> maru.MaruConfig:
    """The benchmark's configuration, so that it never touches a serving store.

    A backend with a private store (`private_options`) gets one of its own, populated
    before it is measured, or with `fresh`, opened as serving opens it. Any other is
    the store the user's configuration names (e.g. the server's URL), under a
    namespace of the benchmark's own.
    """
    tag = f"bench-{os.getpid()}" + ("-fresh" if fresh else "")
    options = backend_class(backend).private_options(tag, not fresh)
    sections = {} if options is None else {backend: options}
    return maru.load_config(
        config_file, backend=backend, capacity=capacity, namespace=tag, **sections
    )


def has_private_store(backend: str) -> bool:
    """Does the backend give the benchmark a throwaway store of its own?"""
    return backend_class(backend).private_options("bench", True) is not None


def arena_bytes() -> int:
    """Bytes of each rotating buffer: ARENA_BYTES, or 4 times the L3 cache if larger."""
    return max(ARENA_BYTES, 4 * last_level_cache_bytes())


class Rotation:
    """Slots of `size` bytes in a pre-touched buffer, handed out in turn."""

    def __init__(self, buffer: np.ndarray, size: int) -> None:
        count = max(2, len(buffer) // size)
        self._slots = buffer[: count * size].reshape(count, size)
        self._next = itertools.cycle(range(count))

    def __call__(self) -> np.ndarray:
        return self._slots[next(self._next)]


def pretouched(nbytes: int, fill: int) -> np.ndarray:
    """A buffer whose pages are all mapped (written with `fill`)."""
    return np.full(nbytes, fill, dtype=np.uint8)


def _median_seconds(action: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _timed(action: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """(seconds, result) of one call; its arguments are evaluated outside the timing."""
    started = time.perf_counter()
    result = action(*args)
    return time.perf_counter() - started, result


def memcpy_seconds(sources: Rotation, targets: Rotation, repeats: int) -> float:
    """Median seconds of one copy between rotating buffers: the baseline."""
    return _median_seconds(lambda: np.copyto(targets(), sources()), repeats)


class FileBaseline:
    """Plain files of one size in a directory: the device's own write and read speed
    through the same filesystem (and page cache) as a disk store's objects."""

    def __init__(self, directory: Path, size: int, kept: int) -> None:
        self._directory = directory / f".bench-baseline-{os.getpid()}"
        self._directory.mkdir(exist_ok=True)
        self._kept, self._files = kept, list[Path]()

    def write(self, data: np.ndarray) -> None:
        """Write `data` as a new file, and drop the oldest beyond the kept ones."""
        path = self._directory / str(len(self._files))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self._files.append(path)
        if len(self._files) > self._kept:
            self._files[-self._kept - 1].unlink()

    def read(self, out: np.ndarray) -> None:
        """Read the oldest file kept into `out`."""
        fd = os.open(self._files[-min(self._kept, len(self._files))], os.O_RDONLY)
        try:
            os.preadv(fd, [out], 0)
        finally:
            os.close(fd)

    def remove(self) -> None:
        shutil.rmtree(self._directory, ignore_errors=True)


def store_directory(store: maru.Backend) -> Path | None:
    """The directory of a store on local disk, where it says (`info()["path"]`)."""
    if store.medium != "disk":
        return None
    try:
        path = store.info().get("path")
    except UnsupportedOperationError:
        return None
    return None if path is None else Path(path)


def bench_size(
    store: maru.Backend,
    size: int,
    run: int,
    written: list[bytes],
    arenas: tuple[np.ndarray, np.ndarray],
    wrap: bool,
) -> SizeResult:
    """put and get_into of `size`-byte objects, and memcpy of the same bytes (and, for a
    store on local disk, plain file writes and reads).

    Each repetition copies once (the baseline), writes a new object and reads an
    older one of the working set (`working_set`), as serving does, from and into
    rotating buffers; interleaving them keeps the machine's drift out of the ratios.
    With `wrap` the store is first filled once (by bytes or by entries, whichever runs
    out first), so that every measured put evicts; the objects read, the last of the
    fill, are read often enough to be kept. The keys written are added to `written`.
    """
    repeats = max(5, min(200, BENCH_BYTES // size))
    sources, targets = Rotation(arenas[0], size), Rotation(arenas[1], size)
    chosen = working_set(store, size, len(arenas[0]))
    for i in range(chosen.holds + 1 if wrap else chosen.objects):
        written.append(f"fill-{run}-{i}".encode())
        store.put(written[-1], sources())
    directory = store_directory(store)
    files = None if directory is None else FileBaseline(directory, size, max(1, chosen.objects))
    link = link_for(store, size)
    older = itertools.cycle(written[-chosen.objects :]) if chosen.objects else None
    samples: dict[str, list[float]] = {name: [] for name in SAMPLES}
    try:
        for i in range(repeats):
            written.append(f"bench-{run}-{i}".encode())
            samples["memcpy"].append(_timed(np.copyto, targets(), sources())[0])
            if files is not None:
                samples["fw"].append(_timed(files.write, sources())[0])
                samples["fr"].append(_timed(files.read, targets())[0])
            if link is not None:
                samples["ls"].append(_timed(link.send, sources())[0])
                samples["lr"].append(_timed(link.receive, targets())[0])
            samples["put"].append(_timed(store.put, written[-1], sources())[0])
            read = written[-1] if older is None else next(older)
            seconds, found = _timed(store.get_into, read, targets())
            if found is None:
                raise maru.BackendError(
                    f"benchmark missed a {size}-byte object it wrote ({chosen.describe(size)})"
                )
            samples["get"].append(seconds)
    finally:
        if files is not None:
            files.remove()
        if link is not None:
            link.close()
    _check_read_back(store, written[-1], size)
    gbps = {name: size / statistics.median(times) / 1e9 for name, times in samples.items() if times}
    return SizeResult(size, chosen, *(gbps.get(name) for name in SAMPLES))


def _check_read_back(store: maru.Backend, key: bytes, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    store.delete(key)
    out = np.empty_like(data)
    if (
        not store.put(key, data)
        or store.get_into(key, out) is None
        or not np.array_equal(out, data)
    ):
        raise maru.BackendError(f"benchmark read back wrong bytes for {size}-byte objects")


def bench_first_pass(
    backend: str, capacity: int, config_file: str | None, arenas: tuple[np.ndarray, np.ndarray]
) -> dict[str, Any]:
    """4 MiB puts (a quarter of a smaller pool) into a pool that was never touched, until
    it is full: what a new node gets (a new pool is populated as it is opened, so its
    first pass runs at memory speed). Throughputs are over the whole pass, open
    excluded."""
    size = max(1, min(FIRST_PASS_SIZE, capacity // 4))
    sources, targets = Rotation(arenas[0], size), Rotation(arenas[1], size)
    count = capacity // size - 1
    memcpy_gbps = size / memcpy_seconds(sources, targets, max(5, count)) / 1e9
    started = time.perf_counter()
    with maru.open_store(bench_config(backend, capacity, config_file, fresh=True)) as store:
        try:
            opened = time.perf_counter()
            for i in range(count):
                store.put(f"first-{i}".encode(), sources())
            put_gbps = count * size / (time.perf_counter() - opened) / 1e9
        finally:
            store.destroy()
    return {
        "size": size,
        "pool_bytes": capacity,
        "memcpy_gbps": memcpy_gbps,
        "open_s": opened - started,
        "put_gbps": put_gbps,
        "put_ratio": put_gbps / memcpy_gbps,
    }


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


def _leave_nothing(store: maru.Backend, written: list[bytes], private: bool) -> None:
    """Destroy a private store (one that goes when closed has nothing to destroy);
    delete what was written to any other: a serving store is never destroyed."""
    if private:
        try:
            store.destroy()
            return
        except UnsupportedOperationError:
            pass
    _delete_written(store, written)


def check_sizes(sizes: tuple[int, ...], capacity: int) -> None:
    """Refuse, before measuring anything, an object size that leaves no room in a store
    of `capacity` bytes for the object's key (up to MAX_KEY_BYTES)."""
    for size in sizes:
        if size > capacity - MAX_KEY_BYTES:
            raise ConfigError(
                f"maru bench --size {format_size(size)} does not fit in a store of "
                f"--capacity {format_size(capacity)} with its key (up to {MAX_KEY_BYTES} "
                "bytes): use a smaller size or a larger capacity"
            )


def run_bench(
    backend: str,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    capacity: int = 1 << 30,
    progress: Callable[[str], None] | None = None,
    config_file: str | None = None,
) -> dict[str, Any]:
    """Benchmark one installed backend; the report as plain data. Leaves nothing behind.
    An unknown name, or a size that does not fit in `capacity`, is a ConfigError."""
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    check_sizes(sizes, capacity)
    private = has_private_store(backend)
    wrap = private and backend_class(backend).wraps
    written: list[bytes] = []
    buffer_bytes = max(arena_bytes(), 2 * max(sizes))
    arenas = (pretouched(buffer_bytes, 1), pretouched(buffer_bytes, 2))
    first_pass = None
    if wrap:
        progress(f"{backend}: first pass of a fresh pool ...")
        first_pass = bench_first_pass(backend, capacity, config_file, arenas)
    with maru.open_store(bench_config(backend, capacity, config_file)) as store:
        try:
            results = []
            for run, size in enumerate(sizes):
                progress(f"{backend}: {format_size(size)} objects ...")
                results.append(bench_size(store, size, run, written, arenas, wrap))
                _delete_written(store, written)
            progress(f"{backend}: latency ...")
            latency = bench_latency(store, written)
        finally:
            _leave_nothing(store, written, private)
    return {
        "backend": backend,
        "sizes": [
            asdict(r) | {"put_ratio": r.put_ratio, "get_ratio": r.get_ratio} for r in results
        ],
        "latency": latency,
        "first_pass": first_pass,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    lines = [
        f"backend {report['backend']}: throughput in GB/s, ratio to memcpy of the same bytes",
        f"{'size':>8} {'memcpy':>8} {'put':>8} {'ratio':>6} {'get_into':>9} {'ratio':>6}",
    ]
    for r in report["sizes"]:
        lines.append(
            f"{format_size(r['size']):>8} {r['memcpy_gbps']:8.2f} {r['put_gbps']:8.2f} "
            f"{r['put_ratio']:6.2f} {r['get_into_gbps']:9.2f} {r['get_ratio']:6.2f}"
        )
    lines += ["  " + WorkingSet(**r["working_set"]).describe(r["size"]) for r in report["sizes"]]
    if report["sizes"] and report["sizes"][0]["file_write_gbps"] is not None:
        lines += baseline_lines(
            report["sizes"],
            "plain files of the same size in the store's directory",
            ("write", "file_write_gbps"),
            ("read", "file_read_gbps"),
        )
    if report["sizes"] and report["sizes"][0].get("link_send_gbps") is not None:
        lines += link_lines(report["sizes"])
    first = report["first_pass"]
    if first:
        lines += [
            f"first pass of a fresh {format_size(first['pool_bytes'])} pool, "
            f"{format_size(first['size'])} puts (opened in {first['open_s']:.2f} s; "
            f"memcpy {first['memcpy_gbps']:.2f} GB/s):",
            f"  put {first['put_gbps']:8.2f} ratio {first['put_ratio']:.2f}",
        ]
    latency = report["latency"]
    lines.append(
        f"contains(128 keys) median {latency['contains_128_us']:.1f} us; "
        f"4 KiB put {latency['put_4k_us']:.1f} us, get_into {latency['get_4k_us']:.1f} us"
    )
    return "\n".join(lines)


# --- the command -----------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> Result:
    """Throughput and latency of installed backends (the configured one by default), as
    ratios to memcpy; with --plot, also a PNG."""
    plot = None if args.plot is None else png_destination(args.plot)
    if plot is not None:  # checked before minutes of measuring, not after
        require_matplotlib()
    backends = args.backend or [resolve_config(args.config).config.backend]
    for name in backends:  # an unknown name fails before minutes of measuring
        backend_class(name)
    measure: dict[str, Any] = {"config_file": args.config}
    if args.size:
        measure["sizes"] = tuple(args.size)
    if args.capacity:
        measure["capacity"] = args.capacity
    reports = [run_bench(backend, **measure) for backend in backends]
    text = "\n\n".join(format_report(report) for report in reports)
    if plot is not None:
        bench_plot(reports, plot)
        text += f"\n\nplot written to {plot}"
    return Result(reports, text)


def parse_bench_size(text: str) -> int:
    """A `maru bench --size/--capacity` value: a size greater than zero, e.g. 64KiB."""
    try:
        return TypeAdapter(Size).validate_python(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.errors()[0]['msg']}") from None


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """`maru bench`."""
    bench = commands.add_parser("bench", parents=[common], help="benchmark backends")
    bench.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="installed backend to measure (repeatable; default: the "
        "configured one); `maru info` lists them",
    )
    bench.add_argument(
        "--size",
        action="append",
        type=parse_bench_size,
        metavar="SIZE",
        help="object size to measure, e.g. 64KiB (repeatable; default 64 KiB to 32 MiB)",
    )
    bench.add_argument(
        "--capacity",
        type=parse_bench_size,
        metavar="SIZE",
        help="bytes of each store measured (default 1 GiB)",
    )
    add_config_option(
        bench,
        "config file (else MARU_CONFIG); a backend without a private "
        "store (e.g. a server) is measured where it names",
    )
    bench.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw throughput by object size against memcpy as a PNG "
        "(needs matplotlib: pip install 'maru[plot]')",
    )
    bench.set_defaults(run=cmd_bench)
