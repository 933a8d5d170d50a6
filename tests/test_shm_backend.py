"""The shm backend: the contract, and what only a shared pool has to show."""

from __future__ import annotations

import pytest

from maru.backends.shm import shm_path
from maru.testing import BackendContract
from tests.conftest import unique_name


@pytest.fixture
def pool_names():
    """Fresh pool names; their shared memory objects are removed at teardown."""
    names: list[str] = []

    def make() -> str:
        names.append(unique_name("test"))
        return names[-1]

    yield make
    for name in names:
        shm_path(name).unlink(missing_ok=True)


class TestShmContract(BackendContract):
    @pytest.fixture
    def make_store(self, open_stores, pool_names):
        return lambda capacity: open_stores(backend="shm", capacity=capacity,
                                            shm={"name": pool_names()})
