"""CXL memory: the shm pool's format and guarantees, on CXL-attached memory.

Three modes:

- ``devdax``: map a DAX character device (``/dev/daxX.Y``) found in sysfs, at the
  device's alignment.
- ``numa``: CXL Type-3 memory exposed as a CPU-less NUMA node; the pool is a
  shared memory object whose pages are bound to that node with ``mbind``.
- ``emulated``: the devdax code path over a regular file, for development and
  CI. It is not CXL memory, and says so in logs and ``maru info``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from maru.backends._pool import (
    Geometry,
    PoolBackend,
    PoolOptions,
    RegionSpec,
    address_of,
    reserve,
    survey_pool,
)
from maru.backends.holders import holders_of
from maru.backends.node import FoundStore
from maru.backends.shm import FileMode, PoolName, shm_path
from maru.config import Size
from maru.errors import BackendError, ConfigError
from maru.hookspecs import hookimpl
from maru.log import get_logger

log = get_logger(__name__)

MPOL_BIND = 2
MPOL_MF_STRICT, MPOL_MF_MOVE = 1, 2
MPOL_F_ADDR = 2
_SYSCALLS = {
    "x86_64": {"mbind": 237, "get_mempolicy": 239},
    "aarch64": {"mbind": 235, "get_mempolicy": 236},
}


class CxlOptions(PoolOptions):
    """The `cxl:` config section."""

    mode: Literal["devdax", "numa", "emulated"] = Field(
        "devdax", description="devdax device, CPU-less NUMA node, or file emulation"
    )
    device: Path | None = Field(None, description="devdax: /dev/daxX.Y; emulated: a file")
    numa_node: int | None = Field(None, ge=0, description="numa: the CXL memory's node")
    name: PoolName = Field("cxl", description="numa: shared memory pool name")
    file_mode: FileMode = Field(0o600, description="permissions of files maru creates")
    align: Size = Field(2 * 2**20, description="emulated: alignment a real device would have")
    sysfs_root: Path = Field(Path("/sys"), description="where sysfs is (tests use a fake)")

    @model_validator(mode="after")
    def _mode_needs(self) -> CxlOptions:
        if self.mode in ("devdax", "emulated") and self.device is None:
            raise ValueError(f"mode {self.mode!r} needs cxl.device (e.g. /dev/dax0.0 or a file)")
        if self.mode == "numa" and self.numa_node is None:
            raise ValueError("mode 'numa' needs cxl.numa_node")
        return self


@dataclass(frozen=True)
class DaxDevice:
    """A DAX device as sysfs describes it."""

    name: str
    path: Path
    size: int
    align: int
    target_node: int | None


def discover_dax_devices(sysfs_root: Path = Path("/sys")) -> list[DaxDevice]:
    """Every DAX device listed under `sysfs_root`/bus/dax/devices."""
    devices = []
    for entry in sorted((sysfs_root / "bus/dax/devices").glob("dax*")):
        devices.append(
            DaxDevice(
                name=entry.name,
                path=Path("/dev") / entry.name,
                size=int(_read(entry / "size")),
                align=int(_read(entry / "align") or 4096),
                target_node=_int_or_none(_read(entry / "target_node")),
            )
        )
    return devices


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


class CxlBackend(PoolBackend):
    """The crash-safe shared pool on CXL memory (devdax, NUMA node, or emulated)."""

    name: ClassVar[str] = "cxl"
    Options = CxlOptions
    description: ClassVar[str] = "CXL memory: devdax device, CPU-less NUMA node, or file emulation"

    def region_spec(self) -> RegionSpec:
        mode = self.options.mode
        if mode == "devdax":
            return self._devdax_spec()
        if mode == "numa":
            return self._numa_spec()
        return self._emulated_spec()

    def _devdax_spec(self) -> RegionSpec:
        path = self.options.device
        if not path.exists():
            raise ConfigError(
                f"cxl.device = '{path}': does not exist; allowed: a DAX device "
                f"such as /dev/dax0.0 (found: {self._found_devices()})"
            )
        devices = {d.name: d for d in discover_dax_devices(self.options.sysfs_root)}
        device = devices.get(path.name)
        if not stat.S_ISCHR(path.stat().st_mode) or device is None:
            raise ConfigError(
                f"cxl.device = '{path}': not a DAX device (no entry in "
                f"{self.options.sysfs_root}/bus/dax/devices); allowed: "
                f"{self._found_devices()}"
            )
        self._check_aligned(self.config.capacity, device.align)
        return RegionSpec(
            path=str(path),
            capacity=self.config.capacity,
            align=device.align,
            label=f"cxl devdax {path}",
            create=False,
            device_size=device.size,
            prefault=self.options.prefault,
        )

    def _emulated_spec(self) -> RegionSpec:
        path, align = self.options.device, self.options.align
        self._check_aligned(self.config.capacity, align)
        size = Geometry.for_capacity(self.config.capacity, align).total
        create_device_file(path, size, self.options.file_mode, self.config.capacity)
        size = path.stat().st_size
        if size % align:
            raise ConfigError(
                f"cxl.device = '{path}': its size {size} is not a multiple of "
                f"cxl.align ({align}); allowed: a file of a multiple of it"
            )
        log.warning("cxl backend in file-emulation mode over %s: this is not CXL memory", path)
        return RegionSpec(
            path=str(path),
            capacity=self.config.capacity,
            align=align,
            label=f"cxl emulated device {path}",
            create=False,
            device_size=size,
            prefault=self.options.prefault,
        )

    def _numa_spec(self) -> RegionSpec:
        node = self.options.numa_node
        nodes = self.options.sysfs_root / "devices/system/node"
        if not (nodes / f"node{node}").is_dir():
            found = sorted(p.name for p in nodes.glob("node[0-9]*"))
            raise ConfigError(
                f"cxl.numa_node = {node}: no such NUMA node; allowed: "
                f"{', '.join(found) or 'none found'}"
            )
        path = shm_path(self.options.name)
        return RegionSpec(
            path=str(path),
            capacity=self.config.capacity,
            label=f"cxl numa node {node} ({path})",
            mode=self.options.file_mode,
            prefault=self.options.prefault,
            before_init=lambda region: bind_to_node(region, node),
        )

    def _found_devices(self) -> str:
        found = discover_dax_devices(self.options.sysfs_root)
        return ", ".join(str(d.path) for d in found) or "no DAX devices found"

    def _check_aligned(self, capacity: int, align: int) -> None:
        if capacity % align:
            nearest = capacity // align * align or align
            raise ConfigError(
                f"capacity = {capacity}: not a multiple of the device alignment "
                f"({align} bytes); allowed: a multiple of it, e.g. {nearest}"
            )

    @classmethod
    def private_options(cls, tag: str, prefault: bool) -> dict[str, Any]:
        """An emulated device of its own in /dev/shm, named by `tag` (the devdax code
        path, over memory the benchmark may throw away)."""
        return {"mode": "emulated", "device": f"/dev/shm/maru-{tag}-cxl", "prefault": prefault}

    @classmethod
    def find_stores(cls, config: Any) -> list[FoundStore]:
        """The configured pool, if the configuration has a cxl section and it exists."""
        try:
            options = config.backend_options(cls.name)
        except ValueError:
            return []
        path = shm_path(options.name) if options.mode == "numa" else options.device
        if not path.exists():
            return []
        holders = holders_of([str(path)])[str(path)]
        window = cls._alignment(options, path)
        found = survey_pool(path, cls.name, path.name, holders, window)
        return [] if found is None else [found]

    @staticmethod
    def _alignment(options: CxlOptions, path: Path) -> int:
        """How the configured pool's memory is aligned (what a device maps in)."""
        if options.mode == "numa":
            return 4096
        if options.mode == "emulated":
            return options.align
        devices = {d.name: d.align for d in discover_dax_devices(options.sysfs_root)}
        return devices.get(path.name, options.align)

    def destroy(self) -> None:
        """Remove the pool: delete its file, or clear a device's header."""
        if self.options.mode == "devdax":
            with open(self.options.device, "r+b", buffering=0) as device:
                device.write(bytes(8))
            return
        path = shm_path(self.options.name) if self.options.mode == "numa" else self.options.device
        path.unlink(missing_ok=True)

    @classmethod
    def describe(cls, options: Any) -> str:
        """How a configured cxl backend will map its memory, for `maru info`."""
        if options.mode == "emulated":
            return f"file emulation over {options.device} (not CXL memory)"
        if options.mode == "numa":
            return f"shared memory bound to NUMA node {options.numa_node}"
        return f"DAX device {options.device}"


def create_device_file(path: Path, size: int, mode: int, capacity: int) -> None:
    """Make a zero file of `size` bytes at `path` atomically, unless one is there; its
    blocks reserved, so that a device that does not fit is refused here, not by SIGBUS."""
    if path.exists():
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
        reserve(fd, size, capacity, f"cxl emulated device {path}")
        with contextlib.suppress(FileExistsError):
            os.link(temporary, path)
    finally:
        os.close(fd)
        temporary.unlink()


def _syscall(name: str) -> tuple[Any, int]:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise BackendError(f"NUMA binding is not supported on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall, numbers[name]


def bind_to_node(region: Any, node: int) -> None:
    """Bind the pages of a mapping to one NUMA node (before they are touched)."""
    syscall, number = _syscall("mbind")
    address = address_of(region)
    mask = (ctypes.c_ulong * 16)()
    mask[node // 64] = 1 << (node % 64)
    result = syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(len(region)),
        ctypes.c_int(MPOL_BIND),
        mask,
        ctypes.c_ulong(16 * 64 + 1),
        ctypes.c_uint(MPOL_MF_STRICT | MPOL_MF_MOVE),
    )
    if result != 0:
        errno = ctypes.get_errno()
        raise BackendError(f"mbind to NUMA node {node} failed: {os.strerror(errno)}")


def memory_policy(region: Any) -> tuple[int, list[int]]:
    """(policy, nodes) the kernel applies to the start of a mapping."""
    syscall, number = _syscall("get_mempolicy")
    address = address_of(region)
    policy, mask = ctypes.c_int(), (ctypes.c_ulong * 16)()
    if (
        syscall(
            ctypes.c_long(number),
            ctypes.byref(policy),
            mask,
            ctypes.c_ulong(16 * 64 + 1),
            ctypes.c_void_p(address),
            ctypes.c_ulong(MPOL_F_ADDR),
        )
        != 0
    ):
        raise BackendError(f"get_mempolicy failed: {os.strerror(ctypes.get_errno())}")
    nodes = [n for n in range(16 * 64) if mask[n // 64] >> (n % 64) & 1]
    return policy.value, nodes


@hookimpl
def maru_backends() -> list[type[PoolBackend]]:
    return [CxlBackend]
