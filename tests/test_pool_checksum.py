"""Per-object checksums: an object corrupted after its commit is a miss, never wrong KV."""

from __future__ import annotations

from pathlib import Path

import pytest

import maru
from maru.backends._pool import checksum as checksums
from maru.backends._pool.index import key_hash
from maru.backends._pool.region import data_start
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
    start = data_start(int(tables.offset[entry]), int(tables.key_len[entry]))
    start += int(tables.length[entry]) // 2
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
def test_a_view_checks_what_its_reader_hashed_without_hashing_again(
    open_pool, size, monkeypatch
) -> None:
    """A reader that fed the view's hasher all the bytes it copied is answered from that
    digest; bytes corrupted before the reader read them fail it, and the object goes."""
    opener, path = open_pool
    store = opener(checksum=True)
    for key in ("good", "bad"):
        assert store.put(key, payload(key, size))
    corrupt(store, path, b"bad")
    views = {key: store.view(key) for key in ("good", "bad")}
    hashers = {key: view.hasher() for key, view in views.items()}
    for key, view in views.items():
        hashers[key].update(view.data)
    hashed_again = []
    monkeypatch.setattr(checksums, "checksum", lambda data: hashed_again.append(data))
    assert views["good"].valid(hashers["good"])
    assert not views["bad"].valid(hashers["bad"])
    assert hashed_again == []
    monkeypatch.undo()
    assert store.get(b"bad") is None and store.pool.info()["corrupt"] == 1
    assert store.get(b"good") == payload("good", size)


def test_a_view_hashes_again_what_its_reader_did_not_hash_whole(open_pool) -> None:
    opener, path = open_pool
    store = opener(checksum=True)
    assert store.put(b"k", payload("k", SIZES[1]))
    corrupt(store, path, b"k")
    view = store.view(b"k")
    hasher = view.hasher()
    hasher.update(view.data[: len(view.data) // 4])  # the corrupt byte is past these
    assert not view.valid(hasher)
    assert store.pool.info()["corrupt"] == 1


def test_a_view_without_checksums_has_no_hasher(open_pool) -> None:
    opener, _ = open_pool
    writer, reader = opener(checksum=False), opener(checksum=True)
    assert writer.put(b"k", payload("k", SIZES[0]))
    assert writer.view(b"k").hasher() is None, "the store verifies nothing"
    assert reader.view(b"k").hasher() is None, "the object was stored without a checksum"


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
