"""The cxl backend: emulation runs the contract; devdax discovery and NUMA binding."""

from __future__ import annotations

import os
import stat

import pytest

import maru
from maru.backends.cxl import MPOL_BIND, discover_dax_devices, memory_policy
from maru.testing import BackendContract, EvictionContract
from tests.conftest import unique_name

MIB = 2**20


class TestCxlEmulatedContract(BackendContract, EvictionContract):
    @pytest.fixture
    def make_store(self, open_stores, tmp_path):
        return lambda capacity: open_stores(
            backend="cxl",
            capacity=capacity,
            cxl={"mode": "emulated", "device": str(tmp_path / unique_name("dax")), "align": 4096},
        )


def fake_sysfs(root, name="dax0.0", size=64 * MIB, align=2 * MIB, node=1):
    device = root / "bus/dax/devices" / name
    device.mkdir(parents=True)
    (device / "size").write_text(f"{size}\n")
    (device / "align").write_text(f"{align}\n")
    (device / "target_node").write_text(f"{node}\n")
    (root / "devices/system/node/node0").mkdir(parents=True)
    return root


def test_dax_devices_are_discovered_from_sysfs(tmp_path) -> None:
    root = fake_sysfs(tmp_path / "sys")
    assert [
        (d.name, str(d.path), d.size, d.align, d.target_node) for d in discover_dax_devices(root)
    ] == [("dax0.0", "/dev/dax0.0", 64 * MIB, 2 * MIB, 1)]


def cxl_error(**cxl) -> str:
    with pytest.raises(maru.ConfigError) as caught:
        maru.open_store(backend="cxl", capacity=cxl.pop("capacity", "4MiB"), cxl=cxl)
    return str(caught.value)


def test_a_missing_device_is_a_clear_error(tmp_path) -> None:
    root = fake_sysfs(tmp_path / "sys")
    message = cxl_error(device=str(tmp_path / "dax9.9"), sysfs_root=str(root))
    assert "does not exist" in message and "/dev/dax0.0" in message


def test_a_file_that_is_not_a_dax_device_is_refused(tmp_path) -> None:
    root = fake_sysfs(tmp_path / "sys")
    plain = tmp_path / "dax0.0"
    plain.write_bytes(bytes(4096))
    assert "not a DAX device" in cxl_error(device=str(plain), sysfs_root=str(root))
    character = tmp_path / "dax5.0"
    os.mknod(character, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    assert "not a DAX device" in cxl_error(device=str(character), sysfs_root=str(root))


def test_a_capacity_off_the_device_alignment_is_refused(tmp_path) -> None:
    root = fake_sysfs(tmp_path / "sys")
    character = tmp_path / "dax0.0"
    os.mknod(character, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    message = cxl_error(device=str(character), sysfs_root=str(root), capacity="3MiB")
    assert "not a multiple of the device alignment (2097152 bytes)" in message


def test_an_emulated_file_of_a_bad_size_is_refused(tmp_path) -> None:
    odd = tmp_path / "odd"
    odd.write_bytes(bytes(3 * MIB + 5))
    assert "not a multiple of cxl.align" in cxl_error(mode="emulated", device=str(odd))


def test_modes_need_their_settings() -> None:
    assert "mode 'devdax' needs cxl.device" in cxl_error()
    assert "mode 'numa' needs cxl.numa_node" in cxl_error(mode="numa")


def test_numa_mode_binds_the_pool_to_the_node(open_stores) -> None:
    name = unique_name("numa")
    store = open_stores(
        backend="cxl", capacity="8MiB", cxl={"mode": "numa", "numa_node": 0, "name": name}
    )
    try:
        assert memory_policy(store.pool.region.view) == (MPOL_BIND, [0])
        store.put(b"k", b"on node 0")
        assert store.get(b"k") == b"on node 0"
    finally:
        store.destroy()


def test_a_missing_numa_node_is_a_clear_error() -> None:
    message = cxl_error(mode="numa", numa_node=63)
    assert "cxl.numa_node = 63: no such NUMA node; allowed: node0" in message


def test_an_emulated_pool_persists_in_its_file(tmp_path) -> None:
    device = str(tmp_path / "fake-dax")
    settings = {"backend": "cxl", "capacity": "4MiB", "cxl": {"mode": "emulated", "device": device}}
    with maru.open_store(**settings) as store:
        store.put(b"k", b"kept in the file")
    with maru.open_store(**settings) as store:
        assert store.get(b"k") == b"kept in the file"
