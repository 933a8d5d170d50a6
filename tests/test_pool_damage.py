"""A damaged pool is a miss, never a crash and never another object's bytes.

Bytes no maru wrote (a stray or killed writer, a memory error) are written into the
header, the entry table, the hash index or the data of a pool of known objects; a
fresh process then reads every object and writes new ones. Seeded and bounded, for
the quick lane; the same for shm and for cxl in emulated mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import maru
from maru.backends._pool.index import key_hash
from maru.backends._pool.region import FREE_HEAD, Geometry
from maru.backends.shm import shm_path
from maru.testing import KIB, payload
from tests.conftest import unique_name

REPOSITORY = Path(__file__).resolve().parents[1]
CAPACITY = 16 << 20
OBJECTS = 120
SIZES = (KIB, 5 * KIB, 48 * KIB, 200 * KIB)


def backend_settings(backend: str, where: str, checksum: bool) -> dict:
    """Config overrides of a pool at `where`: a shm pool name, or an emulated device file."""
    if backend == "shm":
        return {"backend": "shm", "shm": {"name": where, "checksum": checksum}}
    cxl = {"mode": "emulated", "device": where, "align": 4096, "checksum": checksum}
    return {"backend": "cxl", "cxl": cxl}


def pool_file(backend: str, where: str) -> Path:
    return shm_path(where) if backend == "shm" else Path(where)


def object_size(i: int) -> int:
    return SIZES[i % len(SIZES)]


def fill(backend: str, where: str) -> None:
    """A pool holding OBJECTS known objects (half committed through reservations)."""
    settings = backend_settings(backend, where, checksum=True)
    with maru.open_store(capacity=CAPACITY, **settings) as store:
        for i in range(OBJECTS):
            data = payload(f"k{i}", object_size(i))
            if i % 2:
                with store.reserve(f"k{i}", len(data)) as buffer:
                    buffer[:] = data
            else:
                assert store.put(f"k{i}", data)


READER = """
import json, sys
import maru
from maru.testing import payload
from tests.test_pool_damage import CAPACITY, OBJECTS, backend_settings, object_size
backend, checksum, pools = sys.argv[1], sys.argv[2] == "on", json.loads(sys.argv[3])
results = []
for where in pools:
    row = {"right": 0, "missing": 0, "wrong": 0, "died": None, "refused": None, "writes": 0}
    results.append(row)
    try:
        store = maru.open_store(capacity=CAPACITY, **backend_settings(backend, where, checksum))
    except maru.MaruError as exc:
        row["refused"] = type(exc).__name__
        continue
    try:
        for i in range(OBJECTS):
            try:
                got = store.get(f"k{i}")
            except maru.MaruError:
                got = None
            if got is None:
                row["missing"] += 1
            elif got == payload(f"k{i}", object_size(i)):
                row["right"] += 1
            else:
                row["wrong"] += 1
            view = store.view(f"k{i}")
            if view is not None and bytes(view.data) != payload(f"k{i}", object_size(i)):
                if view.valid():
                    row["wrong"] += 1
        store.contains([f"k{i}" for i in range(OBJECTS)])
        store.keys(b"")
        for i in range(20):
            new = payload(f"new{i}", 3000 + i)
            if store.put(f"new{i}", new) and store.get(f"new{i}") == new:
                row["writes"] += 1
        row["damaged"] = store.info().get("damaged")
    except Exception as exc:
        row["died"] = f"{type(exc).__name__}: {exc}"
    finally:
        store.close()
print(json.dumps(results))
"""


def regions(geometry: Geometry) -> dict[str, tuple[int, int]]:
    """[start, end) of each part of a pool's file."""
    return {
        "header": (0, geometry.index_offset),
        "entries": (geometry.index_offset, geometry.bucket_offset),
        "index": (geometry.bucket_offset, geometry.data_offset),
        "data": (geometry.data_offset, geometry.data_offset + CAPACITY),
    }


def damaged_copies(
    backend: str, pristine: Path, part: tuple[int, int], seed: int, count: int
) -> list[str]:
    """`count` copies of the pool file with random bytes written into `part`: runs of 1
    to 64 random bytes at 1 to 40 random places, or whole 8-byte words set to values
    that are in range for some field (0, 1, 2, -1, a small entry number, an offset)."""
    rng = np.random.default_rng(seed)
    original = pristine.read_bytes()
    made = []
    for _ in range(count):
        where = unique_name("fuzz")
        target = pool_file(backend, str(pristine.parent / where) if backend == "cxl" else where)
        data = bytearray(original)
        for _ in range(int(rng.integers(1, 41))):
            at = int(rng.integers(part[0], part[1] - 64))
            if rng.random() < 0.5:
                run = int(rng.integers(1, 65))
                data[at : at + run] = rng.integers(0, 256, run, dtype=np.uint8).tobytes()
            else:
                at -= at % 8
                value = int(rng.choice([0, 1, 2, -1, int(rng.integers(0, 4096)), 64 * 1024]))
                data[at : at + 8] = value.to_bytes(8, "little", signed=True)
        target.write_bytes(bytes(data))
        made.append(str(target) if backend == "cxl" else where)
    return made


def read_in_a_fresh_process(backend: str, checksum: bool, pools: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    done = subprocess.run(
        [sys.executable, "-c", READER, backend, "on" if checksum else "off", json.dumps(pools)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPOSITORY,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(params=["shm", "cxl"])
def pristine(request, tmp_path):
    """(backend, the pool file of a filled pool) for shm and emulated cxl."""
    backend = request.param
    name = unique_name("pristine")
    where = name if backend == "shm" else str(tmp_path / name)
    fill(backend, where)
    path = pool_file(backend, where)
    yield backend, path
    path.unlink(missing_ok=True)
    for leftover in path.parent.glob("maru-fuzz-*") if backend == "shm" else ():
        leftover.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("part", "checksum", "seed"),
    [
        ("header", True, 1),
        ("entries", True, 2),
        ("entries", False, 3),
        ("index", True, 4),
        ("index", False, 5),
        ("data", True, 6),
    ],
)
def test_random_damage_is_a_miss_never_a_crash_or_another_objects_bytes(
    pristine, part, checksum, seed
) -> None:
    """Without checksums too, damaged metadata is caught by its own checks (damaged data
    needs the checksum: nothing else reads every byte)."""
    backend, path = pristine
    span = regions(Geometry.for_capacity(CAPACITY))[part]
    pools = damaged_copies(backend, path, span, seed, count=12)
    try:
        rows = read_in_a_fresh_process(backend, checksum=checksum, pools=pools)
    finally:
        for where in pools:
            pool_file(backend, where).unlink(missing_ok=True)
    assert [row["died"] for row in rows] == [None] * len(rows), rows
    assert sum(row["wrong"] for row in rows) == 0, rows
    opened = [row for row in rows if row["refused"] is None]
    assert all(row["writes"] == 20 for row in opened), rows
    assert all(row["right"] + row["missing"] == OBJECTS for row in opened), rows
    if part != "header":
        assert opened, "damage outside the header never stops a pool from opening"
        assert sum(row["right"] for row in opened) > OBJECTS * len(opened) // 2, rows


@pytest.fixture(params=["shm", "cxl"])
def open_pool(request, tmp_path, open_stores):
    """Open a pool store of 16 MiB (checksums off unless asked), shm or emulated cxl."""
    made: list[Path] = []

    def opener(checksum: bool = False) -> maru.Backend:
        name = unique_name("damage")
        where = name if request.param == "shm" else str(tmp_path / name)
        made.append(pool_file(request.param, where))
        return open_stores(capacity=CAPACITY, **backend_settings(request.param, where, checksum))

    yield opener
    for path in made:
        path.unlink(missing_ok=True)


def test_an_entry_pointed_at_another_objects_bytes_is_a_miss_not_those_bytes(open_pool) -> None:
    store = open_pool()
    store.put(b"a", payload("a", 4 * KIB))
    store.put(b"b", payload("b", 4 * KIB))
    t = store.pool.tables
    a, b = (store.pool.index.find(k, key_hash(k)) for k in (b"a", b"b"))
    t.offset[a] = t.offset[b]
    assert store.get(b"a") is None
    assert store.get(b"b") == payload("b", 4 * KIB)
    assert store.info()["damaged"] == 1 and store.info()["repairs"] == 1
    assert store.pool.audit() == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("length", 2**62), ("key_len", 0), ("state", 7), ("writer", 4096 << 48), ("gen", 5)],
)
def test_a_field_out_of_range_or_unsealed_is_dropped_under_the_lock(open_pool, field, value):
    store = open_pool()
    store.put(b"k", payload("k", 64 * KIB))
    store.put(b"other", b"kept")
    getattr(store.pool.tables, field)[store.pool.index.find(b"k", key_hash(b"k"))] = value
    assert store.get(b"k") is None
    assert store.contains([b"k", b"other"]) == [False, True]
    assert store.get(b"other") == b"kept"
    assert store.put(b"k", b"again") and store.get(b"k") == b"again"
    assert store.pool.audit() == []


@pytest.mark.parametrize("link", ["bucket beyond the table", "chain loop", "free list in use"])
def test_damaged_links_are_rebuilt_and_every_operation_goes_on(open_pool, link) -> None:
    store = open_pool()
    for i in range(50):
        store.put(f"k{i}", payload(f"k{i}", KIB))
    t, pool = store.pool.tables, store.pool
    entry = pool.index.find(b"k3", key_hash(b"k3"))
    if link == "bucket beyond the table":
        t.buckets[pool.index.bucket(key_hash(b"k3"))] = 1 << 30
    elif link == "chain loop":
        t.buckets[pool.index.bucket(key_hash(b"k3"))] = entry
        t.chain[entry] = entry
        t.hash[entry] ^= 1
    else:
        t.set_link(FREE_HEAD, entry)
    assert store.contains([b"k3"]) in ([True], [False])
    assert store.get(b"k3") in (None, payload("k3", KIB))
    assert store.put(b"new", b"x") and store.get(b"new") == b"x"
    assert sum(store.get(f"k{i}") == payload(f"k{i}", KIB) for i in range(50)) >= 49
    assert store.info()["repairs"] >= 1
    assert store.pool.audit() == []
