"""POSIX shared memory: one pool per node that every process on it attaches to.

The embedded default. The pool is a shared memory object (`/dev/shm/maru-NAME`)
that outlives the processes using it until `maru pool destroy`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from maru.backends._pool import PoolBackend, PoolOptions, RegionSpec, survey_pool
from maru.backends.holders import holders_of
from maru.backends.node import FoundStore
from maru.errors import BackendError
from maru.hookspecs import hookimpl
from maru.log import get_logger

log = get_logger(__name__)

SHM_DIR = Path("/dev/shm")
POOL_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")


def _pool_name(value: Any) -> str:
    if not isinstance(value, str) or not POOL_NAME_RE.match(value):
        raise PydanticCustomError(
            "pool_name",
            "not a pool name; allowed: 1 to 100 letters, digits and '._-', "
            "not starting with '.' or '-'",
        )
    return value


def _file_mode(value: Any) -> int:
    if isinstance(value, str) and re.fullmatch(r"0?o?[0-7]{3,4}", value):
        value = int(value.replace("o", ""), 8)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
        raise PydanticCustomError(
            "file_mode",
            "not a permission mode; allowed: an octal string such as '0600' or "
            "'0660', or an integer up to 0o777",
        )
    return value


PoolName = Annotated[str, BeforeValidator(_pool_name)]
FileMode = Annotated[int, BeforeValidator(_file_mode)]


class ShmOptions(PoolOptions):
    """The `shm:` config section."""

    name: PoolName = Field("default", description="pool name; processes with one name share it")
    file_mode: FileMode = Field(
        0o600,
        description="permissions of the shared memory object, e.g. '0660' for a serving group",
    )

    renamed: ClassVar[dict[str, str]] = {"mode": "file_mode"}

    @model_validator(mode="before")
    @classmethod
    def _renamed_mode(cls, values: Any) -> Any:
        """`shm.mode`, the old name of `shm.file_mode` (as cxl names it), still works."""
        if not isinstance(values, dict) or "mode" not in values:
            return values
        log.warning("shm.mode is deprecated: it is now shm.file_mode (as in the cxl section)")
        values = dict(values)
        values.setdefault("file_mode", _file_mode(values.pop("mode")))
        return values


def shm_path(name: str) -> Path:
    """The shared memory object of pool `name`."""
    return SHM_DIR / f"maru-{name}"


class ShmBackend(PoolBackend):
    """A crash-safe pool in POSIX shared memory, shared by every process on the node."""

    name: ClassVar[str] = "shm"
    Options = ShmOptions
    description: ClassVar[str] = "POSIX shared memory, shared by the processes of one node"

    def region_spec(self) -> RegionSpec:
        if not SHM_DIR.is_dir():
            raise BackendError(f"{SHM_DIR} is missing: the shm backend needs Linux shared memory")
        path = shm_path(self.options.name)
        return RegionSpec(
            path=str(path),
            capacity=self.config.capacity,
            label=f"shm pool {self.options.name!r} ({path})",
            mode=self.options.file_mode,
            prefault=self.options.prefault,
        )

    @classmethod
    def describe(cls, options: Any) -> str:
        """Where a configured shm pool lives, for `maru info`."""
        return f"POSIX shared memory {shm_path(options.name)}"

    @classmethod
    def private_options(cls, tag: str, prefault: bool) -> dict[str, Any]:
        """A pool of its own, named `tag`."""
        return {"name": tag, "prefault": prefault}

    @classmethod
    def find_stores(cls, config: Any) -> list[FoundStore]:
        """Every maru pool in /dev/shm, whatever its name and whoever made it."""
        paths = sorted(SHM_DIR.glob("maru-*"))
        holders = holders_of(str(path) for path in paths)
        found = (
            survey_pool(path, cls.name, path.name.removeprefix("maru-"), holders[str(path)])
            for path in paths
        )
        return [store for store in found if store is not None]

    def destroy(self) -> None:
        """Remove the pool's shared memory object; open mappings keep working."""
        shm_path(self.options.name).unlink(missing_ok=True)


@hookimpl
def maru_backends() -> list[type[PoolBackend]]:
    return [ShmBackend]
