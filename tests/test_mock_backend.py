"""The mock backend: the whole contract, sharing by name, and fault injection."""

from __future__ import annotations

import pytest

import maru
from maru.testing import BackendContract, EvictionContract, payload
from tests.conftest import unique_name


class TestMockContract(BackendContract, EvictionContract):
    @pytest.fixture
    def make_store(self, open_stores):
        return lambda capacity: open_stores(
            backend="mock", capacity=capacity, mock={"name": unique_name()}
        )


def test_stores_with_one_name_share_objects(open_stores) -> None:
    name = unique_name()
    writer = open_stores(backend="mock", capacity="1MiB", mock={"name": name})
    reader = open_stores(backend="mock", capacity="1MiB", mock={"name": name})
    other = open_stores(backend="mock", capacity="1MiB", mock={"name": unique_name()})
    writer.put(b"k", b"shared")
    assert reader.get(b"k") == b"shared"
    assert other.get(b"k") is None


def test_one_name_with_two_capacities_is_a_config_error(open_stores) -> None:
    name = unique_name()
    open_stores(backend="mock", capacity="1MiB", mock={"name": name})
    with pytest.raises(maru.ConfigError, match="capacity"):
        open_stores(backend="mock", capacity="2MiB", mock={"name": name})


def test_injected_failures_raise_backend_error_at_the_configured_rate(open_stores) -> None:
    store = open_stores(backend="mock", mock={"name": unique_name(), "fail_rate": 0.3, "seed": 1})
    failures = 0
    for i in range(1000):
        try:
            store.contains([f"k{i}"])
        except maru.BackendError as exc:
            assert "injected failure in contains" in str(exc)
            failures += 1
    assert 200 < failures < 400


def test_dropped_objects_are_misses_after_a_positive_lookup(open_stores) -> None:
    store = open_stores(backend="mock", mock={"name": unique_name(), "drop_rate": 0.5, "seed": 7})
    keys = [f"k{i}" for i in range(200)]
    for key in keys:
        store.put(key, payload(key, 64))
    assert all(store.contains(keys))
    loaded = [store.get(key) for key in keys]
    assert 50 < loaded.count(None) < 150
    for key, data in zip(keys, loaded, strict=True):
        assert data is None or data == payload(key, 64)
    assert store.contains(keys) == [data is not None for data in loaded]


def test_latency_is_added_to_every_operation(open_stores, monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("maru.backends.mock.time.sleep", slept.append)
    store = open_stores(backend="mock", mock={"name": unique_name(), "latency": 0.002})
    store.put(b"k", b"v")
    store.get(b"k")
    store.contains([b"k"])
    assert slept == [0.002, 0.002, 0.002]


def test_the_pool_is_dropped_when_its_last_store_closes(open_stores) -> None:
    name = unique_name()
    with maru.open_store(backend="mock", mock={"name": name}) as store:
        store.put(b"k", b"v")
    fresh = open_stores(backend="mock", mock={"name": name})
    assert fresh.get(b"k") is None


@pytest.mark.parametrize(
    ("name", "declared"),
    [
        (
            "mock",
            {
                "medium": "host",
                "zero_copy": False,
                "removal_log": True,
                "lists_keys": True,
                "wraps": False,
            },
        ),
        (
            "shm",
            {
                "medium": "host",
                "zero_copy": True,
                "removal_log": True,
                "lists_keys": True,
                "wraps": True,
            },
        ),
        (
            "cxl",
            {
                "medium": "host",
                "zero_copy": True,
                "removal_log": True,
                "lists_keys": True,
                "wraps": True,
            },
        ),
        (
            "redis",
            {
                "medium": "remote",
                "zero_copy": False,
                "removal_log": False,
                "lists_keys": True,
                "wraps": False,
            },
        ),
        (
            "dirstore",
            {
                "medium": "disk",
                "zero_copy": False,
                "removal_log": False,
                "lists_keys": False,
                "wraps": False,
            },
        ),
    ],
)
def test_each_backend_declares_what_it_can_do(name, declared) -> None:
    from maru.backends.registry import backend_class

    backend = backend_class(name)
    assert {capability: getattr(backend, capability) for capability in declared} == declared


def test_a_backend_that_declares_nothing_claims_no_host_memory_and_no_private_store() -> None:
    from maru.backends.base import Backend

    assert (
        Backend.medium,
        Backend.zero_copy,
        Backend.removal_log,
        Backend.lists_keys,
        Backend.wraps,
    ) == ("remote", False, False, False, False)
    assert Backend.private_options("tag", True) is None


@pytest.mark.parametrize("operation", ["destroy", "clear", "info", "populate"])
def test_optional_operations_it_lacks_name_the_backend_and_the_operation(
    open_stores, operation
) -> None:
    store = open_stores(backend="mock", mock={"name": unique_name()})
    with pytest.raises(
        maru.UnsupportedOperationError, match=rf"the mock backend does not support {operation}\(\)"
    ):
        getattr(store, operation)()
    assert store.label == "mock store"
    with type(store).open_existing(store.config) as again:
        assert again.stats().capacity == store.config.capacity
