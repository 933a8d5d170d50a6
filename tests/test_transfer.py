"""The data path without vLLM: pages round-trip bit-exactly for every layout row and
device, loads complete layer by layer, and devices it cannot handle are refused."""

from __future__ import annotations

import itertools
import math
import mmap
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from maru.backends._pool.checksum import Hasher, checksum
from maru.layouts import BlocksFirst, KVFirst, recognise
from maru.transfer import (
    Blocks,
    ChunkCopy,
    DataPath,
    UnsupportedDeviceError,
    put_caches_on_huge_pages,
    queue_for,
    widest,
)
from tests.copy_queues import DeferredQueue
from tests.test_layouts import BUILTINS, NB, ROWS, block_dim_of, filled

LAYERS = 3
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.cuda),
]
BLOCK_IDS = {
    "consecutive": ([4, 5, 6], [8, 9, 10]),
    "scattered": ([1, 7, 4], [9, 2, 5]),
    "mixed": ([0, 1, 5], [10, 11, 3]),
}


def caches(row: str, seed: int, device: str) -> dict[str, torch.Tensor]:
    return {f"layer{i}": filled(ROWS[row](), seed + i).to(device) for i in range(LAYERS)}


def page(tensor: torch.Tensor, block: int) -> torch.Tensor:
    """The bytes of one block, read independently of maru."""
    return tensor.select(block_dim_of(tensor), block).contiguous().cpu().flatten().view(torch.uint8)


def save_chunk(path: DataPath, ids: list[int]) -> torch.Tensor:
    payload = path.staging(path.payload_bytes(len(ids)))
    chunk = ChunkCopy(Blocks(ids), payload, len(ids))
    for name in path.adapter.layers:
        path.save_layer(name, [chunk])
    path.saves_done().wait()
    return payload


@pytest.mark.parametrize("ids", BLOCK_IDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row", ROWS)
def test_pages_round_trip_bit_exactly(row: str, device: str, ids: str) -> None:
    source, target = caches(row, 1, device), caches(row, 100, device)
    before = {name: [page(t, b) for b in range(NB)] for name, t in target.items()}
    ids_from, ids_to = BLOCK_IDS[ids]
    payload = save_chunk(DataPath(recognise(source, NB, BUILTINS)), ids_from)
    loader = DataPath(recognise(target, NB, BUILTINS))
    assert loader.load([ChunkCopy(Blocks(ids_to), payload, 3)]) == set()
    loader.loads_done().wait()
    for name, tensor in target.items():
        for src, dst in zip(ids_from, ids_to, strict=True):
            assert torch.equal(page(tensor, dst), page(source[name], src)), (name, dst)
        for block in set(range(NB)) - set(ids_to):
            assert torch.equal(page(tensor, block), before[name][block]), "untouched block"


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_can_skip_the_first_blocks_of_a_chunk(device: str) -> None:
    row = "0.26 (NB,H,BS,2D) HND"
    source, target = caches(row, 1, device), caches(row, 100, device)
    payload = save_chunk(DataPath(recognise(source, NB, BUILTINS)), [2, 3, 4])
    loader = DataPath(recognise(target, NB, BUILTINS))
    loader.load([ChunkCopy(Blocks([7, 11]), payload, 3, first=1)])
    loader.loads_done().wait()
    for name, tensor in target.items():
        assert torch.equal(page(tensor, 7), page(source[name], 3))
        assert torch.equal(page(tensor, 11), page(source[name], 4))


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize(("ids", "first"), [([7, 8, 9], 0), ([11], 1)])
def test_a_cpu_load_feeds_its_hasher_the_whole_payload_in_order(
    row: str, ids: list[int], first: int
) -> None:
    """What the load hashed is the payload's checksum, also where it loads only some of
    the chunk's blocks: the store's check needs no second pass over the bytes."""
    source, target = caches(row, 1, "cpu"), caches(row, 100, "cpu")
    payload = save_chunk(DataPath(recognise(source, NB, BUILTINS)), [2, 3, 4])
    hasher = Hasher()
    loader = DataPath(recognise(target, NB, BUILTINS))
    assert loader.load([ChunkCopy(Blocks(ids), payload, 3, first, hasher)]) == set()
    assert hasher.fed == payload.numel()
    assert hasher.checksum() == checksum(memoryview(payload.numpy()))


class CountingHasher(Hasher):
    """A Hasher that counts the bytes it was given to hash apart from a copy."""

    __slots__ = ("updated",)

    def __init__(self) -> None:
        super().__init__()
        self.updated = 0

    def update(self, data) -> None:
        super().update(data)
        self.updated += memoryview(data).nbytes


@pytest.mark.parametrize("row", ROWS)
def test_a_cpu_load_of_every_stored_row_hashes_them_as_it_copies(row: str) -> None:
    """No byte of the payload is read a second time to hash it: the copies sum them."""
    source, target = caches(row, 1, "cpu"), caches(row, 100, "cpu")
    payload = save_chunk(DataPath(recognise(source, NB, BUILTINS)), [2, 3, 4])
    hasher = CountingHasher()
    loader = DataPath(recognise(target, NB, BUILTINS))
    assert loader.load([ChunkCopy(Blocks([7, 8, 11]), payload, 3, 0, hasher)]) == set()
    assert (hasher.fed, hasher.updated) == (payload.numel(), 0)
    assert hasher.checksum() == checksum(memoryview(payload.numpy()))
    assert all(torch.equal(page(target[n], 11), page(source[n], 4)) for n in target)


def test_chunks_loaded_together_each_feed_their_own_hasher_in_order() -> None:
    """Each chunk is copied whole, layer after layer, so each hasher sees its payload
    in order."""
    row = "0.26 (NB,H,BS,2D) HND"
    source, target = caches(row, 1, "cpu"), caches(row, 100, "cpu")
    saver = DataPath(recognise(source, NB, BUILTINS))
    payloads = [save_chunk(saver, [block]) for block in range(8)]
    hashers = [Hasher() for _ in payloads]
    chunks = [
        ChunkCopy(Blocks([NB - 1 - i]), payload, 1, hasher=hasher)
        for i, (payload, hasher) in enumerate(zip(payloads, hashers, strict=True))
    ]
    assert DataPath(recognise(target, NB, BUILTINS)).load(chunks) == set()
    for i, (payload, hasher) in enumerate(zip(payloads, hashers, strict=True)):
        assert hasher.checksum() == checksum(memoryview(payload.numpy()))
        assert all(torch.equal(page(target[n], NB - 1 - i), page(source[n], i)) for n in target)


def test_a_cpu_load_copies_every_chunk_in_the_calling_thread(monkeypatch) -> None:
    """No second thread: in an engine one made loads no faster, and 1.6-2.8x slower with
    a core kept busy (a thread that starts a chunk and loses its core holds the load up).
    The first copy waits a moment, time enough for any other thread to take a chunk."""
    row = "0.26 (NB,H,BS,2D) HND"
    source, target = caches(row, 1, "cpu"), caches(row, 100, "cpu")
    saver = DataPath(recognise(source, NB, BUILTINS))
    chunks = [ChunkCopy(Blocks([b + 6]), save_chunk(saver, [b]), 1) for b in range(4)]
    threads: list[str] = []
    copy_layer = DataPath._load_layer

    def copy_noting_the_thread(path: DataPath, name: str, chunk: ChunkCopy) -> None:
        if not threads:
            time.sleep(0.2)
        threads.append(threading.current_thread().name)
        copy_layer(path, name, chunk)

    monkeypatch.setattr(DataPath, "_load_layer", copy_noting_the_thread)
    assert DataPath(recognise(target, NB, BUILTINS)).load(chunks) == set()
    assert set(threads) == {threading.current_thread().name}
    for name, block in itertools.product(target, range(4)):
        assert torch.equal(page(target[name], block + 6), page(source[name], block))


def test_loads_complete_layer_by_layer() -> None:
    row = "0.26 (NB,H,BS,2D) HND"
    source, target = caches(row, 1, "cpu"), caches(row, 100, "cpu")
    payload = save_chunk(DataPath(recognise(source, NB, BUILTINS)), [2, 3])
    queue = DeferredQueue()
    loader = DataPath(recognise(target, NB, BUILTINS), queue)
    loader.load([ChunkCopy(Blocks([5, 6]), payload, 2)])
    assert not torch.equal(page(target["layer0"], 5), page(source["layer0"], 2)), "queued only"
    loader.wait_layer("layer0")
    assert torch.equal(page(target["layer0"], 5), page(source["layer0"], 2))
    assert not torch.equal(page(target["layer1"], 5), page(source["layer1"], 2)), (
        "waiting for layer 0 does not wait for layer 1"
    )
    loader.wait_layer("layer1")
    loader.wait_layer("layer2")
    assert all(torch.equal(page(target[n], 6), page(source[n], 3)) for n in target)


def test_a_chunk_whose_copy_cannot_be_issued_is_reported_alone(monkeypatch) -> None:
    row = "0.26 (NB,H,BS,2D) HND"
    source, target = caches(row, 1, "cpu"), caches(row, 100, "cpu")
    payload = save_chunk(DataPath(recognise(source, NB, BUILTINS)), [2, 3])
    loader = DataPath(recognise(target, NB, BUILTINS))
    short = payload[:-1]  # one byte short: its last layer cannot be copied
    failed = loader.load(
        [ChunkCopy(Blocks([5, 6]), payload, 2), ChunkCopy(Blocks([8, 9]), short, 2)]
    )
    assert failed == {1}
    assert all(torch.equal(page(target[n], 6), page(source[n], 3)) for n in target)


@pytest.mark.parametrize(("ids", "first"), [([NB - 1, NB], 0), ([5, 6], 1)])
def test_a_cpu_copy_outside_the_cache_or_the_object_fails_and_writes_nothing(
    ids: list[int], first: int
) -> None:
    """The CPU copies take addresses, so the data path checks every run's bounds: a
    block past the cache, or rows past the object's stored blocks, fail that chunk."""
    row = "0.26 (NB,H,BS,2D) HND"
    source, target = caches(row, 1, "cpu"), caches(row, 100, "cpu")
    payload = save_chunk(DataPath(recognise(source, NB, BUILTINS)), [2, 3])
    before = {name: tensor.clone() for name, tensor in target.items()}
    loader = DataPath(recognise(target, NB, BUILTINS))
    assert loader.load([ChunkCopy(Blocks(ids), payload, 2, first=first)]) == {0}
    assert all(torch.equal(target[name], before[name]) for name in target)


def test_a_device_without_a_data_path_is_refused_by_name() -> None:
    with pytest.raises(
        UnsupportedDeviceError, match="device meta; maru's data path supports cpu, cuda"
    ):
        queue_for(torch.device("meta"))


def test_pages_are_indexed_as_wide_integers_when_aligned() -> None:
    rows = torch.zeros(4, 64, dtype=torch.int8)
    assert widest(rows)[0].dtype == torch.int64
    assert widest(rows[:, 2:])[0].dtype == torch.int16, "offset by 2 bytes"
    assert widest(rows[:, 1:])[0].dtype == torch.int8


def test_the_gpu_check_runs_its_round_trips_on_the_cpu(tmp_path, monkeypatch) -> None:
    """benchmarks/gpu_transfer.py is run on GPU machines by hand; here it must not rot."""
    import json
    import runpy
    import sys

    output = tmp_path / "gpu_transfer.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "gpu_transfer.py",
            "--device",
            "cpu",
            "--layers",
            "2",
            "--blocks",
            "64",
            "--repeats",
            "1",
            "--output",
            str(output),
        ],
    )
    with pytest.raises(SystemExit) as exited:
        runpy.run_path("benchmarks/gpu_transfer.py", run_name="__main__")
    assert exited.value.code == 0
    layouts = json.loads(output.read_text())["layouts"]
    assert len(layouts) == 6 and all(r["bit_exact"] for r in layouts.values())


def anon_huge_bytes_at(address: int) -> int:
    """Bytes of the mapping holding `address` that are transparent huge pages (smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def thp_collapse_available() -> bool:
    """MADV_COLLAPSE: Linux 6.1, transparent huge pages not turned off."""
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    return enabled.exists() and "[never]" not in enabled.read_text() and release >= (6, 1)


def random_in_fresh_memory(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values in an anonymous mapping of their own, on small pages unless THP is
    `always` (malloc could hand back memory an earlier test put on huge pages)."""
    nbytes = math.prod(shape) * dtype.itemsize
    tensor = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype)
    return tensor.copy_(torch.randn(tensor.shape, dtype=dtype)).view(shape)


def middle_of(tensor: torch.Tensor) -> int:
    """An address inside a tensor's memory (madvise splits a mapping around its range)."""
    return tensor.data_ptr() + tensor.nbytes // 2


def test_a_cpu_cache_is_put_on_huge_pages_with_its_contents_kept() -> None:
    """torch gives a CPU KV cache 4 KiB pages (unless THP is `always`), and each costs
    maru's copies into the cache a TLB miss; maru moves the cache onto 2 MiB pages."""
    blocks = 256
    cache = random_in_fresh_memory((2, blocks, 4, 32, 64), torch.float32)  # 16 MiB
    before, huge_before = cache.clone(), anon_huge_bytes_at(middle_of(cache))
    path = DataPath(recognise({"layer0": cache}, blocks, [KVFirst, BlocksFirst]))
    moved = put_caches_on_huge_pages([path])
    assert torch.equal(cache, before)
    if thp_collapse_available():
        assert moved >= 12 * 2**20 and anon_huge_bytes_at(middle_of(cache)) >= moved
    else:
        assert (moved, anon_huge_bytes_at(middle_of(cache))) == (0, huge_before)
