"""A new process on an existing pool: its first reads against its later ones.

One process creates an shm pool of several GiB and fills it with 4 MiB objects; a
new process (as a new engine would) attaches to it and reads objects into a buffer
of its own: every object once (first reads: its pages not yet mapped in this
process), then the same objects again (later reads). Printed as GB/s and as ratios
to a single-threaded memcpy of the same bytes measured in the same process, with the
attach time and how much of the pool the new process mapped. Nothing is timed in a
test; `python benchmarks/pool_attach.py --help`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

import maru

OBJECT = 4 << 20


def config(name: str, capacity: int) -> maru.MaruConfig:
    return maru.load_config(backend="shm", capacity=capacity, shm={"name": name})


def fill(name: str, capacity: int, count: int) -> None:
    """Create the pool (populated as a new pool is) and write `count` objects."""
    data = np.random.default_rng(0).integers(0, 255, OBJECT, dtype=np.uint8)
    with maru.open_store(config(name, capacity)) as store:
        for i in range(count):
            data[:8] = i % 256
            if not store.put(f"object-{i}".encode(), data):
                raise maru.MaruError(f"object {i} did not fit")


def read_pass(store: maru.Backend, count: int, out: np.ndarray) -> float:
    """Seconds to copy every object into `out`, one after another."""
    started = time.perf_counter()
    for i in range(count):
        view = store.view(f"object-{i}".encode())
        np.copyto(out, np.frombuffer(view.data, dtype=np.uint8))
        if out[0] != i % 256 or not view.valid():
            raise maru.MaruError(f"object {i} read back wrong")
    return time.perf_counter() - started


def memcpy_seconds(count: int, out: np.ndarray) -> float:
    """Seconds to copy `count` 4 MiB buffers from a rotation larger than the CPU caches."""
    sources = np.ones((16, OBJECT), dtype=np.uint8)
    started = time.perf_counter()
    for i in range(count):
        np.copyto(out, sources[i % 16])
    return time.perf_counter() - started


def shared_memory_mapped() -> int:
    """Bytes of shared memory this process maps (RssShmem)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def attach_and_read(name: str, capacity: int, count: int, results: mp.Queue) -> None:
    """In a new process: attach, read everything twice, report."""
    out = np.empty(OBJECT, dtype=np.uint8)
    memcpy_seconds(16, out)  # this process's own buffer, touched before timing
    started = time.perf_counter()
    store = maru.open_store(config(name, capacity))
    attach_s = time.perf_counter() - started
    attached = shared_memory_mapped()
    first_s = read_pass(store, count, out)
    mapped = shared_memory_mapped()
    later_s = read_pass(store, count, out)
    copy_s = memcpy_seconds(count, out)
    store.close()
    results.put(
        {
            "attach_s": attach_s,
            "first_s": first_s,
            "later_s": later_s,
            "memcpy_s": copy_s,
            "mapped_at_attach": attached,
            "mapped_after_reads": mapped,
        }
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-gib", type=int, default=4)
    parser.add_argument("--read-gib", type=float, default=1.0, help="of the pool, read twice")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/pool_attach.json"))
    args = parser.parse_args()
    capacity = args.capacity_gib << 30
    filled = int(capacity * 0.9) // OBJECT
    count = min(filled, int(args.read_gib * (1 << 30)) // OBJECT)
    name = f"bench-attach-{np.random.default_rng().integers(1 << 30)}"
    context = mp.get_context("spawn")
    print(f"creating a {args.capacity_gib} GiB pool, {filled} objects of 4 MiB ...", flush=True)
    creator = context.Process(target=fill, args=(name, capacity, filled))
    creator.start()
    creator.join()
    try:
        if creator.exitcode != 0:
            raise maru.MaruError("filling the pool failed")
        results = context.Queue()
        reader = context.Process(target=attach_and_read, args=(name, capacity, count, results))
        reader.start()
        report = results.get(timeout=600)
        reader.join()
    finally:
        with maru.open_store(config(name, capacity)) as store:
            store.destroy()
    moved = count * OBJECT
    report |= {
        "objects_read": count,
        "first_gbps": moved / report["first_s"] / 1e9,
        "later_gbps": moved / report["later_s"] / 1e9,
        "memcpy_gbps": moved / report["memcpy_s"] / 1e9,
    }
    report["first_over_later"] = report["first_gbps"] / report["later_gbps"]
    report["first_over_memcpy"] = report["first_gbps"] / report["memcpy_gbps"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(
        f"a new process attached to a {args.capacity_gib} GiB pool in "
        f"{report['attach_s'] * 1e3:.1f} ms, mapping {report['mapped_at_attach'] / 2**20:.1f} "
        f"MiB; after reading {moved / 2**30:.2f} GiB it maps "
        f"{report['mapped_after_reads'] / 2**30:.2f} GiB\n"
        f"first reads  {report['first_gbps']:6.2f} GB/s = {report['first_over_memcpy']:.2f}x memcpy"
        f"\nlater reads  {report['later_gbps']:6.2f} GB/s\n"
        f"memcpy       {report['memcpy_gbps']:6.2f} GB/s (one thread, same process)\n"
        f"first / later: {report['first_over_later']:.2f}\n"
        f"written to {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
