"""The shm backend: the contract, and what only a shared pool has to show."""

from __future__ import annotations

import logging
import os
import stat
import threading

import numpy as np
import pytest

import maru
from maru.backends._pool import region as pool_format
from maru.backends._pool.attach import memory_of
from maru.backends.base import key_digest
from maru.backends.shm import shm_path
from maru.testing import BackendContract, EvictionContract, payload

MIB = 2**20


class TestShmContract(BackendContract, EvictionContract):
    @pytest.fixture
    def make_store(self, open_stores, pool_names):
        return lambda capacity: open_stores(
            backend="shm", capacity=capacity, shm={"name": pool_names()}
        )


def open_shm(name: str, capacity: str = "8MiB", **options) -> maru.Backend:
    return maru.open_store(backend="shm", capacity=capacity, shm={"name": name, **options})


@pytest.mark.parametrize("key_bytes", [1, 34, 63, 64, 65, 300])
def test_an_objects_bytes_start_on_a_64_byte_boundary_whatever_its_key(
    pool_names, key_bytes
) -> None:
    """Copies between objects and an aligned KV cache run at full speed only aligned
    (a load from an object 34 bytes off measured 10% slower, a save into one up to 40%)."""
    with maru.open_store(backend="shm", capacity="8MiB", shm={"name": pool_names()}) as store:
        put, reserved = b"p" * key_bytes, b"r" * key_bytes
        assert store.put(put, payload("p", 5000))
        with store.reserve(reserved, 3 * 2**20) as buffer:
            assert address(buffer) % 64 == 0
            buffer[:] = payload("r", 3 * 2**20)
        for key, data in ((put, payload("p", 5000)), (reserved, payload("r", 3 * 2**20))):
            view = store.view(key)
            assert address(view.data) % 64 == 0 and bytes(view.data) == data
        assert store.pool.audit() == []


def address(buffer: memoryview) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def test_a_pool_of_another_capacity_is_refused(pool_names) -> None:
    name = pool_names()
    with open_shm(name, "8MiB"), pytest.raises(maru.ConfigError) as caught:
        open_shm(name, "16MiB")
    assert "already exists with capacity 8388608" in str(caught.value)
    with open_shm(name, "8MiB") as again:
        assert again.stats().capacity == 8 * MIB


def test_a_region_that_is_not_a_pool_is_refused(pool_names) -> None:
    name = pool_names()
    shm_path(name).write_bytes(b"not a pool" * 10000)
    with pytest.raises(maru.BackendError, match="is not a maru pool"):
        open_shm(name)


def test_another_format_version_is_refused_not_reinterpreted(pool_names) -> None:
    name = pool_names()
    with open_shm(name) as store:
        store.put(b"k", b"v")
    with open(shm_path(name), "r+b") as region:
        region.seek(8 * pool_format.VERSION)
        region.write((pool_format.FORMAT_VERSION + 1).to_bytes(8, "little"))
    version = pool_format.FORMAT_VERSION
    with pytest.raises(
        maru.BackendError, match=f"format version {version + 1}, this maru reads version {version}"
    ):
        open_shm(name)


@pytest.mark.parametrize("bad", ["../x", "/", "", "a/b", ".hidden", "-x", "x" * 101, 7])
def test_pool_names_are_validated(bad) -> None:
    with pytest.raises(maru.ConfigError, match=r"shm\.name = .*not a pool name"):
        maru.load_config(backend="shm", shm={"name": bad})


@pytest.mark.parametrize(("mode", "expected"), [(None, 0o600), ("0660", 0o660), (0o640, 0o640)])
def test_permissions_default_to_owner_only(pool_names, mode, expected) -> None:
    name = pool_names()
    options = {} if mode is None else {"file_mode": mode}
    with open_shm(name, **options):
        assert stat.S_IMODE(os.stat(shm_path(name)).st_mode) == expected


def test_a_bad_file_mode_is_a_config_error() -> None:
    with pytest.raises(maru.ConfigError, match=r"shm\.file_mode = '0999'.*not a permission mode"):
        maru.load_config(backend="shm", shm={"file_mode": "0999"})


def deprecation_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def test_the_old_name_shm_mode_still_works_and_says_its_new_name(pool_names, caplog) -> None:
    name = pool_names()
    with caplog.at_level(logging.WARNING, logger="vllm.maru"):
        with open_shm(name, mode="0640") as store:
            assert stat.S_IMODE(os.stat(shm_path(name)).st_mode) == 0o640
            assert store.options.file_mode == 0o640
        assert deprecation_warnings(caplog) == [
            "shm.mode is deprecated: it is now shm.file_mode (as in the cxl section)"
        ]
        with pytest.raises(maru.ConfigError, match=r"'mode': '0999'.*not a permission mode"):
            maru.load_config(backend="shm", shm={"mode": "0999"})
        caplog.clear()
        maru.load_config(backend="shm", shm={"file_mode": "0640"})
        assert deprecation_warnings(caplog) == []


def resident_bytes(path) -> int:
    return os.stat(path).st_blocks * 512


def test_the_pool_maps_capacity_plus_a_small_index_all_reserved_at_creation(pool_names) -> None:
    name = pool_names()
    with open_shm(name, "1GiB") as store:
        geometry = store.pool.geometry
        assert os.stat(shm_path(name)).st_size == geometry.total == 2**30 + geometry.overhead
        assert geometry.overhead < 0.01 * 2**30
        assert resident_bytes(shm_path(name)) == geometry.total, "no page is left to a fault"


def test_prefault_populates_every_page_before_open_returns(pool_names) -> None:
    with open_shm(pool_names(), "64MiB", prefault=True) as store:
        populator = memory_of(store.pool).populator
        assert (populator.state, populator.done) == ("yes", len(store.pool.region))


def test_get_into_a_torch_tensor(pool_names) -> None:
    import torch

    with open_shm(pool_names()) as store:
        source = torch.arange(1024, dtype=torch.bfloat16)
        store.put(b"t", source)
        target = torch.zeros(1024, dtype=torch.bfloat16)
        assert store.get_into(b"t", target) == 2048
        assert torch.equal(source, target)


def test_the_pool_survives_every_store_closing(pool_names) -> None:
    name = pool_names()
    with open_shm(name) as first, open_shm(name) as second:
        first.put(b"k", b"v")
        assert second.get(b"k") == b"v"
    with open_shm(name) as third:
        assert third.get(b"k") == b"v"
        third.destroy()
    assert not shm_path(name).exists()


def reserve_at_once(store: maru.Backend, threads: int) -> list[bool]:
    """Threads make their process's first reservations at once; while they hold them,
    the pool is filled twice over. Whether each reservation could still be committed."""
    start, reserved = threading.Barrier(threads), threading.Barrier(threads + 1)
    filled = threading.Event()
    committed: list[bool] = []

    def write(i: int) -> None:
        start.wait()
        try:
            with store.reserve(f"t{i}", 100_000) as buffer:
                buffer[:] = payload(f"t{i}", 100_000)
                reserved.wait()
                filled.wait()
            committed.append(True)
        except maru.BackendError:
            committed.append(False)

    workers = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    reserved.wait()
    for i in range(16):
        store.put(f"filler{i}", bytes(MIB))
    filled.set()
    for worker in workers:
        worker.join()
    return committed


def test_threads_writing_first_at_once_all_keep_their_reservations(pool_names) -> None:
    for _ in range(5):
        with open_shm(pool_names()) as store:
            assert reserve_at_once(store, 8) == [True] * 8
            assert store.stats().reclaimed == 0


def test_a_reader_that_fell_further_behind_than_the_log_is_told_to_check(pool_names) -> None:
    name = pool_names()
    with open_shm(name) as store:
        cursor = store.removed_since(None).cursor
        for _ in range(pool_format.REMOVAL_LOG_SLOTS + 1):
            store.put(b"k", b"v")
            store.delete(b"k")
        assert store.removed_since(cursor).digests is None
        latest = store.removed_since(None).cursor
        assert latest == cursor + pool_format.REMOVAL_LOG_SLOTS + 1
        assert store.removed_since(latest - pool_format.REMOVAL_LOG_SLOTS).digests == (
            [key_digest(b"k")] * pool_format.REMOVAL_LOG_SLOTS
        )


def test_the_old_name_works_from_the_environment_too(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.maru"):
        config = maru.load_config(backend="shm", env={"MARU_SHM__MODE": "0660"})
    assert config.backend_options().file_mode == 0o660
    assert not any("ignoring environment variable" in r.getMessage() for r in caplog.records)
    assert deprecation_warnings(caplog) == [
        "shm.mode is deprecated: it is now shm.file_mode (as in the cxl section)"
    ]
