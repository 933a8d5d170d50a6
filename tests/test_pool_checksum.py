"""Per-object checksums: an object corrupted after its commit is a miss, never wrong KV."""

from __future__ import annotations

from pathlib import Path

import pytest

import maru
from maru.backends._pool.index import key_hash
from maru.backends.shm import shm_path
from maru.testing import payload

MIB = 2**20
SIZES = [4096, 3 * MIB]
"""One object copied under the lock (put in one step), one copied outside it (reserved)."""


@pytest.fixture(params=["shm", "cxl"])
def open_pool(request, pool_names, tmp_path):
    """Opens stores on one pool (shm, or cxl emulated in a file): (opener, pool file)."""
    name, device = pool_names(), tmp_path / "dax"
    path = shm_path(name) if request.param == "shm" else device
    stores: list[maru.Backend] = []

    where = (
        {"name": name}
        if request.param == "shm"
        else {"mode": "emulated", "device": str(device), "align": 4096}
    )

    def opener(checksum: bool) -> maru.Backend:
        options = {request.param: where | {"checksum": checksum}}
        stores.append(maru.open_store(backend=request.param, capacity=8 * MIB, **options))
        return stores[-1]

    yield opener, path
    for store in stores:
        store.close()


def corrupt(store: maru.Backend, path: Path, key: bytes) -> None:
    """Flip one byte in the middle of the object, as a stray writer of the file would."""
    pool, tables = store.pool, store.pool.tables
    entry = pool.index.find(key, key_hash(key))
    start = int(tables.offset[entry] + tables.key_len[entry]) + int(tables.length[entry]) // 2
    with open(path, "r+b") as region:
        region.seek(pool.geometry.data_offset + start)
        byte = region.read(1)[0]
        region.seek(pool.geometry.data_offset + start)
        region.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("size", SIZES)
def test_a_corrupted_object_is_a_miss_and_is_removed(open_pool, size) -> None:
    opener, path = open_pool
    store = opener(checksum=True)
    data = payload("k", size)
    assert store.put(b"k", data)
    corrupt(store, path, b"k")
    assert store.get_into(b"k", bytearray(size)) is None
    assert store.get(b"k") is None
    assert store.pool.info()["corrupt"] == 1
    assert (store.stats().hits, store.stats().misses, store.stats().objects) == (0, 2, 0)
    assert store.put(b"k", data), "the corrupt object made room for a good one"
    assert store.get(b"k") == data
    assert store.pool.audit() == []


@pytest.mark.parametrize("size", SIZES)
def test_a_reservation_is_checksummed_as_committed(open_pool, size) -> None:
    opener, _ = open_pool
    store = opener(checksum=True)
    with store.reserve(b"r", size) as buffer:
        buffer[:] = payload("r", size)
    assert store.get(b"r") == payload("r", size)
    assert store.pool.info()["corrupt"] == 0


@pytest.mark.parametrize(("writes", "reads"), [(False, True), (True, False)])
def test_stores_with_and_without_checksums_share_a_pool(open_pool, writes, reads) -> None:
    opener, _ = open_pool
    writer, reader = opener(checksum=writes), opener(checksum=reads)
    for size in SIZES:
        assert writer.put(f"k{size}", payload("k", size))
        assert reader.get(f"k{size}") == payload("k", size)


def test_checksums_are_on_by_default() -> None:
    """A pool opened without saying so writes checksums and verifies loads."""
    assert maru.load_config().backend_options("shm").checksum is True
    cxl = maru.load_config(cxl={"mode": "emulated", "device": "/x"}).backend_options("cxl")
    assert cxl.checksum is True
