"""Every thread a store starts is its own: once `close()` returns, none of them is alive
and nothing of the store logs any more, for every built-in backend (and the tiered
one over a slow lower tier, whose queued copies closing gives up on)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import maru
from maru.backends.shm import shm_path
from maru.log import ROOT
from maru.testing import KIB, payload
from tests.conftest import unique_name

OBJECTS = 20
SIZE = 16 * KIB
THREAD_NAMES = "maru-"
"""How the names of the threads maru starts begin."""


def shm(pool: str, tmp_path: Path) -> dict[str, Any]:
    return {"backend": "shm", "shm": {"name": pool}}


def cxl(pool: str, tmp_path: Path) -> dict[str, Any]:
    return {"backend": "cxl", "cxl": {"mode": "emulated", "device": str(tmp_path / "dax")}}


def disk(pool: str, tmp_path: Path) -> dict[str, Any]:
    return {"backend": "disk", "disk": {"path": str(tmp_path / "disk")}}


def mock(pool: str, tmp_path: Path) -> dict[str, Any]:
    return {"backend": "mock", "mock": {"name": pool}}


def shm_over_disk(pool: str, tmp_path: Path) -> dict[str, Any]:
    return {
        **shm(pool, tmp_path),
        **disk(pool, tmp_path),
        "backend": "tiered",
        "tiered": {"tiers": ["shm", "disk"]},
    }


def shm_over_a_slow_tier(pool: str, tmp_path: Path) -> dict[str, Any]:
    """Copies into the mock take 0.2 s each, and closing waits for none of them."""
    return {
        "backend": "tiered",
        "tiered": {"tiers": ["shm", "mock"], "close_wait": 0},
        "shm": {"name": pool},
        "mock": {"name": pool, "latency": 0.2},
    }


CONFIGS: dict[str, Callable[[str, Path], dict[str, Any]]] = {
    "mock": mock,
    "shm": shm,
    "cxl": cxl,
    "disk": disk,
    "tiered-shm-disk": shm_over_disk,
    "tiered-slow-lower-tier": shm_over_a_slow_tier,
}


class Records(logging.Handler):
    """Keeps every record logged under maru's logger tree."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def maru_logs(caplog: pytest.LogCaptureFixture) -> Iterator[Records]:
    """Every record maru logs during the test, at any level."""
    caplog.set_level(logging.DEBUG, logger=ROOT)
    records = Records()
    logger = logging.getLogger(ROOT)
    logger.addHandler(records)
    yield records
    logger.removeHandler(records)


def use(store: maru.Backend) -> None:
    """Puts, reads and a delete, as serving does."""
    keys = [f"k{i}" for i in range(OBJECTS)]
    for key in keys:
        assert store.put(key, payload(key, SIZE))
    assert store.get(keys[-1]) == payload(keys[-1], SIZE)
    out = bytearray(SIZE)
    assert store.get_into(keys[-2], out) == SIZE
    assert store.contains([keys[-1], "missing"]) == [True, False]
    assert store.delete(keys[-1])


def outlived(before: set[threading.Thread]) -> list[str]:
    """The names of the threads alive now that were not before; waits for each (a
    guard against hangs) so that whatever they log is logged by the time it returns."""
    late = [thread for thread in threading.enumerate() if thread not in before]
    for thread in late:
        thread.join(30)
    return [thread.name for thread in late]


def open_store(config: dict[str, Any]) -> maru.Backend:
    return maru.open_store(capacity="64MiB", namespace=unique_name(), **config)


def check_closing(config: dict[str, Any], logs: Records) -> None:
    """Open a store, use it, and close it: the threads it started are named as maru's,
    none is alive once `close()` returns, and nothing is logged after it."""
    before = set(threading.enumerate())
    store = open_store(config)
    use(store)
    started = [thread.name for thread in threading.enumerate() if thread not in before]
    assert all(name.startswith(THREAD_NAMES) for name in started), started
    store.close()
    closed_at = len(logs.records)
    assert (outlived(before), logs.records[closed_at:]) == ([], [])


@pytest.mark.parametrize("backend", CONFIGS)
def test_no_thread_of_a_store_outlives_its_close_and_nothing_logs_after_it(
    backend: str, tmp_path: Path, maru_logs: Records
) -> None:
    pool = unique_name("threads")
    try:
        check_closing(CONFIGS[backend](pool, tmp_path), maru_logs)
    finally:
        shm_path(pool).unlink(missing_ok=True)


def test_no_thread_of_a_redis_store_outlives_its_close(redis_server, maru_logs: Records) -> None:
    check_closing({"backend": "redis", "redis": {"url": redis_server.url}}, maru_logs)
