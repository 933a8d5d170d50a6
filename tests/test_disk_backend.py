"""The disk backend: the whole contract, objects kept across reopening, corrupt and
half-written files never served, several processes writing one directory, and
directories it must refuse."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import maru
from maru.backends._disk.directory import MARKER, STALE_TEMP_SECONDS, TEMP_PREFIX
from maru.backends._disk.objects import digest
from maru.backends.disk import DiskBackend
from maru.testing import KIB, BackendContract, EvictionContract, payload
from tests.conftest import unique_name
from tests.small_filesystem import run_on_small_filesystem

REPOSITORY = Path(__file__).resolve().parents[1]
_text = {"capture_output": True, "text": True, "check": True}


@pytest.fixture
def open_disk(open_stores, tmp_path):
    """Open a disk store at `tmp_path / "store"` (or `path`), closed at teardown."""

    def opener(path: Path | None = None, capacity: int | str = "1MiB", **options) -> DiskBackend:
        where = str(path or tmp_path / "store")
        return open_stores(backend="disk", capacity=capacity, disk={"path": where, **options})

    return opener


class TestDiskContract(BackendContract, EvictionContract):
    @pytest.fixture
    def make_store(self, open_disk, tmp_path):
        return lambda capacity: open_disk(tmp_path / unique_name(), capacity)


def object_file(store: DiskBackend, key: bytes) -> Path:
    """The file that holds `key`'s object."""
    (path,) = [path for path in store._dir.glob("*/*") if not path.name.startswith(TEMP_PREFIX)]
    assert store.keys(key) == [key]
    return path


def test_a_reopened_store_serves_every_committed_object(open_disk) -> None:
    first = open_disk()
    keys = [f"k{i}".encode() for i in range(20)]
    for key in keys:
        assert first.put(key, payload(key, 3 * KIB))
    with first.reserve(b"reserved", KIB) as buffer:
        buffer[:] = payload("reserved", KIB)
    first.close()
    again = open_disk()
    assert [again.get(key) for key in keys] == [payload(key, 3 * KIB) for key in keys]
    assert again.get(b"reserved") == payload("reserved", KIB)
    assert sorted(again.keys(b"k")) == sorted(keys)
    assert again.stats().objects == 21


def test_a_reopened_store_evicts_the_least_recently_used_of_before(open_disk) -> None:
    size = 250 * KIB
    first = open_disk()
    for i in range(4):
        first.put(f"k{i}", payload(f"k{i}", size))
    assert first.get(b"k0") is not None
    first.close()
    again = open_disk()
    again.put(b"new", payload("new", size))
    assert again.contains([b"k0", b"k1", b"k2", b"k3", b"new"]) == [True, False, True, True, True]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[:-1], id="truncated"),
        pytest.param(lambda data: data[:-100] + bytes([data[-100] ^ 1]) + data[-99:], id="bitflip"),
        pytest.param(lambda data: data[:10], id="header-only"),
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: data + b"x", id="longer"),
    ],
)
def test_a_damaged_object_file_is_a_miss_and_is_removed(open_disk, damage) -> None:
    store = open_disk()
    data = payload("k", 8 * KIB)
    store.put(b"k", data)
    path = object_file(store, b"k")
    path.write_bytes(damage(path.read_bytes()))
    assert store.get_into(b"k", bytearray(16 * KIB)) is None
    assert not path.exists()
    assert store.contains([b"k"]) == [False]
    assert store.put(b"k", data)
    assert store.get(b"k") == data


@pytest.mark.parametrize("read", ["get", "view"])
def test_every_read_checks_the_checksum(open_disk, read) -> None:
    store = open_disk()
    store.put(b"k", payload("k", 4 * KIB))
    path = object_file(store, b"k")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(data)
    assert getattr(store, read)(b"k") is None
    assert not path.exists()


def test_a_file_of_another_key_under_the_same_name_is_never_served(open_disk) -> None:
    """A digest collision, made by renaming one key's file to the other's name: a miss,
    and the other key's object is left alone."""
    store = open_disk()
    store.put(b"mine", b"my bytes")
    store.put(b"theirs", b"their bytes")
    mine, theirs = store._path(digest(b"mine")), store._path(digest(b"theirs"))
    os.replace(theirs, mine)
    assert store.get(b"mine") is None
    assert store.delete(b"mine") is False
    assert mine.exists()
    assert store.keys(b"") == [b"theirs"]


def test_a_crashed_writers_temporary_file_is_invisible_and_cleaned_at_open(open_disk) -> None:
    store = open_disk()
    store.put(b"kept", b"v")
    directory = store._path(digest(b"lost")).parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_text)
    left_by_dead = directory / f"{TEMP_PREFIX}{dead.stdout.strip()}.abc.{store._host}"
    left_long_ago = directory / f"{TEMP_PREFIX}1.def.elsewhere"
    being_written = directory / f"{TEMP_PREFIX}{os.getpid()}.123.{store._host}"
    for path in (left_by_dead, left_long_ago, being_written):
        path.write_bytes(b"half an object")
    old = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(left_long_ago, (old, old))
    assert store.contains([b"lost"]) == [False]
    assert store.keys(b"") == [b"kept"]
    store.close()
    again = open_disk()
    assert (left_by_dead.exists(), left_long_ago.exists(), being_written.exists()) == (
        False,
        False,
        True,
    )
    assert again.keys(b"") == [b"kept"]
    assert again.stats().objects == 1


WRITER = """
import sys, time
import maru
from maru.testing import payload
path, key, writer, start = sys.argv[1], sys.argv[2].encode(), sys.argv[3], float(sys.argv[4])
store = maru.open_store(backend="disk", capacity="64MiB", disk={"path": path})
while time.time() < start:
    time.sleep(0.001)
if writer == "reader":
    seen, hits = set(), 0
    deadline = time.time() + 10
    while hits < 20 and time.time() < deadline:
        data = store.get(key)
        if data is not None:
            seen.add(data)
            hits += 1
    wrong = [d for d in seen if d not in {payload(f"w{i}", 4 << 20) for i in range(4)}]
    print("reader", len(seen), len(wrong))
else:
    print(writer, store.put(key, payload(writer, 4 << 20)))
"""


def test_processes_writing_one_key_one_wins_and_readers_see_whole_objects(tmp_path) -> None:
    path = tmp_path / "shared"
    maru.open_store(backend="disk", capacity="64MiB", disk={"path": str(path)}).close()
    start = str(time.time() + 2)
    roles = ["w0", "w1", "w2", "w3", "reader"]
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    running = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), "shared-key", role, start],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for role in roles
    ]
    outputs = [process.communicate(timeout=60)[0].split() for process in running]
    assert [process.returncode for process in running] == [0] * len(roles)
    wins = [role for role, won in outputs[:4] if won == "True"]
    assert len(wins) == 1, outputs
    assert outputs[4] == ["reader", "1", "0"], outputs
    with maru.open_store(backend="disk", capacity="64MiB", disk={"path": str(path)}) as store:
        assert store.get(b"shared-key") == payload(wins[0], 4 << 20)
        assert store.keys(b"") == [b"shared-key"]
        assert [p.name for p in store._dir.glob(f"*/{TEMP_PREFIX}*")] == []


def test_two_stores_on_one_directory_share_objects_and_first_writer_wins(open_disk) -> None:
    writer, reader = open_disk(), open_disk()
    assert writer.put(b"k", b"first")
    assert reader.contains([b"k"]) == [True]
    assert reader.put(b"k", b"second") is False
    assert reader.get(b"k") == b"first"
    assert reader.delete(b"k")
    assert writer.get(b"k") is None


def test_a_path_under_a_regular_file_is_a_config_error_naming_it(open_disk, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for path in (blocker, blocker / "store"):
        with pytest.raises(maru.ConfigError, match=rf"disk\.path = '{path}'.*cannot use it"):
            open_disk(path)


def test_a_directory_of_another_format_is_refused_saying_how_to_fix_it(open_disk, tmp_path) -> None:
    root = tmp_path / "old"
    root.mkdir()
    (root / MARKER).write_text("0\n")
    with pytest.raises(maru.ConfigError, match=r"format '0'.*format 1.*another directory.*rm -r"):
        open_disk(root)


def test_a_directory_holding_other_files_is_refused(open_disk, tmp_path) -> None:
    root = tmp_path / "home"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    with pytest.raises(maru.ConfigError, match=r"holds other files \(notes\.txt"):
        open_disk(root)
    assert sorted(os.listdir(root)) == ["notes.txt"]


def test_an_io_error_while_reading_is_a_backend_error(open_disk, monkeypatch) -> None:
    store = open_disk()
    store.put(b"k", b"v")

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("maru.backends.disk.os.preadv", broken)
    with pytest.raises(maru.BackendError, match=r"read of .* failed: Input/output error"):
        store.get(b"k")


def test_get_into_reads_straight_into_the_buffer(open_disk, monkeypatch) -> None:
    """One preadv into the caller's buffer, whatever its size: no staging copy, no
    per-chunk syscalls."""
    store = open_disk(capacity="64MiB")
    data = payload("big", 16 << 20)
    store.put(b"big", data)
    out = bytearray(len(data))
    targets: list[int] = []
    real = os.preadv

    def recording(fd, buffers, offset):
        targets.extend(memoryview(buffer).nbytes for buffer in buffers)
        return real(fd, buffers, offset)

    monkeypatch.setattr("maru.backends.disk.os.preadv", recording)
    assert store.get_into(b"big", out) == len(data)
    assert out == data
    assert targets == [len(data)]


def test_capacity_counts_file_bytes_and_clear_and_destroy_remove_them(open_disk, tmp_path) -> None:
    store = open_disk(tmp_path / "gone")
    store.put(b"k", bytes(1000))
    assert store.stats().used == sum(p.stat().st_size for p in store._dir.glob("*/*"))
    assert store.clear() == 1
    assert store.stats().objects == 0
    store.destroy()
    assert not (tmp_path / "gone").exists()


FILL = """
import sys
import maru
from maru.testing import payload
store = maru.open_store(backend="disk", capacity="64MiB", disk={"path": sys.argv[1] + "/s"})
stored = [store.put(f"k{i}", payload(f"k{i}", 512 << 10)) for i in range(40)]
too_big = store.put("huge", payload("huge", 6 << 20))
kept = [i for i in range(40) if store.get(f"k{i}") == payload(f"k{i}", 512 << 10)]
info = store.info()
print(all(stored), too_big, kept[-1], len(kept) < 8, store.stats().evictions > 0,
      info["not_stored_disk_full"])
"""


def test_a_full_filesystem_evicts_and_never_fails_a_write(tmp_path) -> None:
    """On a 4 MiB filesystem under a 64 MiB capacity: every write lands (the oldest
    objects go), and one larger than the filesystem is not stored, without an error."""
    printed = run_on_small_filesystem(FILL, "4m", tmp_path / "small").split()
    assert printed == ["True", "False", "39", "True", "True", "1"]


def test_an_io_error_while_writing_is_a_backend_error(open_disk, monkeypatch) -> None:
    store = open_disk()

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("maru.backends._disk.objects.os.writev", broken)
    with pytest.raises(maru.BackendError, match=r"write of .* failed: Input/output error"):
        store.put(b"k", b"v")
    monkeypatch.undo()
    assert store.put(b"k", b"v") and store.get(b"k") == b"v"
    assert [p.name for p in store._dir.glob(f"*/{TEMP_PREFIX}*")] == []


KEEP_WRITING = """
import sys
import maru
from maru.testing import payload
store = maru.open_store(backend="disk", capacity="256MiB", disk={"path": sys.argv[1]})
print("ready", flush=True)
i = int(sys.argv[2])
while True:
    store.put(f"k{i}", payload(f"k{i}", (1 + i % 7) << 19))
    i += 1
"""


def test_writers_killed_mid_write_leave_only_whole_objects(tmp_path) -> None:
    """SIGKILL, again and again, of two processes writing objects of 0.5 to 3.5 MiB:
    a reopened store serves every object it lists whole, and nothing torn."""
    path = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    for round_ in range(4):
        writers = [
            subprocess.Popen(
                [sys.executable, "-c", KEEP_WRITING, str(path), str(1000 * (2 * round_ + w))],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for w in range(2)
        ]
        for writer in writers:
            assert writer.stdout.readline().strip() == "ready"
        time.sleep(0.2 + 0.1 * round_)
        for writer in writers:
            writer.kill()
            writer.wait()
    with maru.open_store(backend="disk", capacity="256MiB", disk={"path": str(path)}) as store:
        keys = store.keys(b"")
        assert len(keys) > 8
        for key in keys:
            index = int(key[1:])
            assert store.get(key) == payload(key.decode(), (1 + index % 7) << 19)
        assert store.stats().objects == len(keys)
        assert [p.name for p in store._dir.glob(f"*/{TEMP_PREFIX}*")] == []
