"""What verifying a step's loads costs on the CPU: objects hashed while copied, or after.

One step's worth of objects (by default the online benchmark's: four hits of 1056
tokens at 8 KiB a token, 20 objects of 1.7 MB, 34.6 MB) is loaded from a checksummed
shm pool into a CPU KV cache through maru's data path, as the worker does, three ways:

- unverified: the copies alone (read through a store opened with `checksum: false`);
- verified after: the copies, then `valid()` hashes each object again (by then the
  step's later copies have pushed it out of the CPU's caches);
- verified while copying: the copies compute the checksum as they go, through the
  view's hasher (what the worker does), then `valid(hasher)`.

Each step is set against a single-threaded memcpy of the same bytes in the same loop,
the four taking turns so the machine's drift touches all alike. Each load or copy
reads objects and writes cache blocks (or memory) the one before it did not touch,
out of twice the last-level cache's size, so none finds its bytes in the CPU's caches.
`python benchmarks/load_checksum.py --help`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

import maru
from maru.cli._cpu_caches import last_level_cache_bytes
from maru.layouts import BlocksFirst, KVFirst, recognise
from maru.transfer import Blocks, ChunkCopy, DataPath, host_tensor

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 4, 4, 64, 32
"""The online benchmark's model: float32, 8 KiB of KV a token."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=20, help="objects a step loads")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per object")
    parser.add_argument("--steps", type=int, default=40, help="measured steps per way")
    args = parser.parse_args()
    probe = DataPath(recognise(kv_caches(args.blocks), args.blocks, [KVFirst, BlocksFirst]))
    step_bytes = args.objects * probe.payload_bytes(args.blocks)
    slots = max(6, math.ceil(2 * last_level_cache_bytes() / step_bytes))
    cache_blocks = slots * args.objects * args.blocks
    path = DataPath(recognise(kv_caches(cache_blocks), cache_blocks, [KVFirst, BlocksFirst]))
    size = path.payload_bytes(args.blocks)
    objects = slots * args.objects
    pool = {"backend": "shm", "capacity": 2 * objects * size}
    pool_name = f"bench-{uuid.uuid4().hex[:8]}"
    store = maru.open_store(**pool, shm={"name": pool_name})
    unverified = maru.open_store(**pool, shm={"name": pool_name, "checksum": False})
    try:
        rng = np.random.default_rng(0)
        keys = [uuid.uuid4().bytes for _ in range(objects)]
        for key in keys:
            assert store.put(key, rng.bytes(size))
        source = np.frombuffer(rng.bytes(slots * step_bytes), np.int8)
        target = np.ones(slots * step_bytes, np.int8)  # written, so its pages are mapped
        ways: dict[str, Callable[[int], None]] = {
            "memcpy": lambda slot: memcpy(source, target, step_bytes, slot),
            "unverified": lambda slot: load_step(path, unverified, keys, args, slot),
            "verified after copying": lambda slot: load_step(path, store, keys, args, slot),
            "verified while copying": lambda slot: load_step(path, store, keys, args, slot, True),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for step in range(args.steps + 1):
            for index, (name, way) in enumerate(ways.items()):
                started = time.perf_counter()
                way((step * len(ways) + index) % slots)
                if step:  # the first is a warm-up
                    times[name].append(time.perf_counter() - started)
            print(f"\rstep {step}/{args.steps}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        unverified.close()
        store.destroy()
    memcpy_s = statistics.median(times["memcpy"])
    print(f"one step: {args.objects} objects of {size / 1e6:.2f} MB ({step_bytes / 1e6:.1f} MB)")
    for name, measured in times.items():
        median = statistics.median(measured)
        print(
            f"  {name:24} {median * 1e3:6.2f} ms  {step_bytes / median / 1e9:5.1f} GB/s  "
            f"{median / memcpy_s:4.2f}x memcpy's time"
        )
    return 0


def kv_caches(blocks: int) -> dict[str, torch.Tensor]:
    """A CPU KV cache of `blocks` blocks per layer in vLLM's (2, NB, H, BS, D) layout."""
    return {f"layer{i}": torch.zeros(2, blocks, HEADS, BLOCK_SIZE, HEAD_DIM) for i in range(LAYERS)}


def memcpy(source: np.ndarray, target: np.ndarray, nbytes: int, slot: int) -> None:
    """A plain copy of one step's bytes, from and to the memory of `slot`."""
    at = slot * nbytes
    np.copyto(target[at : at + nbytes], source[at : at + nbytes])


def load_step(
    path: DataPath,
    store: maru.Backend,
    keys: list[bytes],
    args: argparse.Namespace,
    slot: int,
    hashed_while_copying: bool = False,
) -> None:
    """Load one step's objects (those of `slot`) into the cache's blocks of `slot` as the
    worker does; every one must be valid (and match its checksum, where `store`
    verifies)."""
    first, offset = slot * args.objects, slot * args.objects * args.blocks
    views, chunks = [], []
    for index in range(args.objects):
        view = store.view(keys[(first + index) % len(keys)])
        blocks = Blocks(
            list(range(offset + index * args.blocks, offset + (index + 1) * args.blocks))
        )
        hasher = view.hasher() if hashed_while_copying else None
        chunks.append(ChunkCopy(blocks, host_tensor(view.data), args.blocks, 0, hasher))
        views.append(view)
    assert path.load(chunks) == set()
    for view, chunk in zip(views, chunks, strict=True):
        assert view.valid(chunk.hasher), "an object failed its checks"


if __name__ == "__main__":
    sys.exit(main())
