"""Reusable contract tests for storage backends.

A backend author runs the whole contract against their backend with a few lines::

    import pytest
    from maru.testing import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def make_store(self):
            stores = []
            def factory(capacity):
                store = maru.open_store(maru.load_config(backend="mine", capacity=capacity))
                stores.append(store)
                return store
            yield factory
            for store in stores:
                store.close()

`make_store(capacity)` returns a fresh, empty store of that many bytes. A
backend that enforces its capacity itself also mixes in `EvictionContract`
(`class TestMine(BackendContract, EvictionContract)`). Every built-in backend
runs these suites in maru's own tests.

What a backend declares decides what it must pass: one that keeps a removal log
(`removal_log`) must name every removal, one that does not must say None; one that
lists its keys (`lists_keys`) must list and delete exactly the keys under a prefix,
one that does not must raise UnsupportedOperationError and remove nothing; a
`zero_copy` one must read and write in `host_memory()`. No test passes because a
backend opted out of it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import numpy as np
import pytest

from maru.backends.base import MAX_KEY_BYTES, MEDIA, Backend, Hashing, ReadView, key_digest
from maru.errors import (
    BackendError,
    BufferTooSmallError,
    InvalidKeyError,
    ObjectTooLargeError,
    UnsupportedOperationError,
)

KIB = 1024


def viewed_with_hasher(store: Backend, key: bytes) -> tuple[bytes, ReadView, Hashing | None]:
    """Put a 40 KiB object under `key`: its bytes, a view of it and the view's hasher
    (None where the store does not verify what is read)."""
    data = payload(key, 40 * KIB)
    store.put(key, data)
    view = store.view(key)
    return data, view, view.hasher()


def payload(key: bytes | str, size: int) -> bytes:
    """Bytes that only `key` produces at this size, so a wrong or torn read shows."""
    seed = key.encode() if isinstance(key, str) else key
    digest = np.frombuffer(hashlib.blake2b(seed + size.to_bytes(8, "little")).digest(), np.uint8)
    return np.resize(digest, size).tobytes()


class BackendContract:
    """The behaviour every backend promises. Subclass it and provide `make_store`."""

    capacity: int = 256 * KIB
    """Capacity of the store most tests use."""

    @pytest.fixture
    def make_store(self) -> Callable[[int], Backend]:
        raise NotImplementedError("provide a make_store fixture: capacity -> fresh Backend")

    @pytest.fixture
    def store(self, make_store: Callable[[int], Backend]) -> Backend:
        return make_store(self.capacity)

    # --- reading and writing -------------------------------------------------

    def test_put_then_get_returns_the_same_bytes(self, store: Backend) -> None:
        data = payload("k", 10 * KIB)
        assert store.put(b"k", data) is True
        assert store.get(b"k") == data

    def test_a_missing_key_is_a_miss_everywhere(self, store: Backend) -> None:
        assert store.get(b"nope") is None
        assert store.get_into(b"nope", bytearray(16)) is None
        assert store.contains([b"nope"]) == [False]
        assert store.delete(b"nope") is False

    def test_a_str_key_is_its_utf8_bytes(self, store: Backend) -> None:
        assert store.put("clé", b"v")
        assert store.get("clé".encode()) == b"v"
        assert store.contains(["clé", "clé".encode()]) == [True, True]

    def test_first_writer_wins(self, store: Backend) -> None:
        assert store.put(b"k", b"first") is True
        assert store.put(b"k", b"second") is False
        assert store.get(b"k") == b"first"

    def test_an_empty_object_is_stored(self, store: Backend) -> None:
        assert store.put(b"empty", b"")
        assert store.get(b"empty") == b""
        assert store.contains([b"empty"]) == [True]

    def test_get_into_copies_into_bytearray_and_numpy(self, store: Backend) -> None:
        data = payload("k", 4 * KIB)
        store.put(b"k", data)
        out = bytearray(8 * KIB)
        assert store.get_into(b"k", out) == len(data)
        assert bytes(out[: len(data)]) == data
        array = np.zeros(KIB, dtype=np.float32)
        assert store.get_into(b"k", array) == len(data)
        assert array.tobytes() == data

    def test_get_into_a_small_buffer_fails_and_loses_nothing(self, store: Backend) -> None:
        data = payload("k", 4 * KIB)
        store.put(b"k", data)
        out = bytearray(KIB)
        with pytest.raises(BufferTooSmallError, match="bytes"):
            store.get_into(b"k", out)
        assert out == bytearray(KIB)
        assert store.get(b"k") == data

    def test_get_into_a_read_only_buffer_is_refused(self, store: Backend) -> None:
        store.put(b"k", b"data")
        with pytest.raises(TypeError, match="read-only"):
            store.get_into(b"k", b"\0" * 8)

    def test_contains_gives_one_answer_per_key(self, store: Backend) -> None:
        store.put(b"a", b"1")
        store.put(b"c", b"3")
        assert store.contains([b"a", b"b", b"c", b"a"]) == [True, False, True, True]
        assert store.contains([]) == []
        many = [f"key-{i}".encode() for i in range(128)]
        assert store.contains(many) == [False] * 128

    def test_get_many_into_fills_each_buffer_or_says_miss(self, store: Backend) -> None:
        store.put(b"a", payload("a", 3 * KIB))
        store.put(b"c", b"")
        outs = [bytearray(4 * KIB), bytearray(16), np.zeros(KIB, np.float32), bytearray(1)]
        assert store.get_many_into([b"a", b"b", "a", b"c"], outs) == [3 * KIB, None, 3 * KIB, 0]
        assert bytes(outs[0][: 3 * KIB]) == payload("a", 3 * KIB) == outs[2].tobytes()[: 3 * KIB]
        assert outs[1] == bytearray(16) and store.get_many_into([], []) == []

    def test_get_many_into_refuses_a_small_buffer_and_leaves_it_untouched(
        self, store: Backend
    ) -> None:
        store.put(b"a", payload("a", 2 * KIB))
        store.put(b"b", payload("b", 2 * KIB))
        small = bytearray(KIB)
        with pytest.raises(BufferTooSmallError, match="bytes"):
            store.get_many_into([b"a", b"b"], [bytearray(2 * KIB), small])
        assert small == bytearray(KIB)
        with pytest.raises(ValueError, match="outs"):
            store.get_many_into([b"a", b"b"], [bytearray(2 * KIB)])

    def test_fetch_many_views_each_object_or_says_miss(self, store: Backend) -> None:
        store.put(b"a", payload("a", 3 * KIB))
        store.put(b"c", b"")
        views = store.fetch_many([b"a", b"b", "a", b"c"], [4 * KIB, 16, 3 * KIB, 1])
        assert [None if v is None else bytes(v.data) for v in views] == [
            payload("a", 3 * KIB),
            None,
            payload("a", 3 * KIB),
            b"",
        ]
        assert all(v.valid() for v in views if v is not None)
        with pytest.raises(BufferTooSmallError, match="bytes"):
            store.fetch_many([b"a"], [KIB])
        with pytest.raises(ValueError, match="sizes"):
            store.fetch_many([b"a", b"c"], [4 * KIB])

    def test_put_many_stores_each_and_the_first_writer_wins(self, store: Backend) -> None:
        store.put(b"old", b"first")
        items = [(b"old", b"second"), (b"x", payload("x", KIB)), ("x", b"again"), (b"e", b"")]
        assert store.put_many(items) == [False, True, False, True]
        assert store.get(b"old") == b"first" and store.get(b"x") == payload("x", KIB)
        with store.reserve(b"pending", 4) as buffer:
            buffer[:] = b"abcd"
            assert store.put_many([(b"pending", b"wxyz")]) == [False]
        assert store.get(b"pending") == b"abcd" and store.put_many([]) == []

    def test_put_many_refuses_bad_keys_and_too_large_objects(self, store: Backend) -> None:
        with pytest.raises(InvalidKeyError, match="key"):
            store.put_many([(b"fine", b"v"), (b"", b"v")])
        with pytest.raises(ObjectTooLargeError, match="larger than"):
            store.put_many([(b"big", bytes(self.capacity + 1))])
        assert store.contains([b"big"]) == [False]

    def test_delete_removes_the_object(self, store: Backend) -> None:
        store.put(b"k", b"v")
        assert store.delete(b"k") is True
        assert store.get(b"k") is None
        assert store.delete(b"k") is False
        assert store.put(b"k", b"again")
        assert store.get(b"k") == b"again"

    def test_keys_and_delete_prefix_take_exactly_the_keys_under_it(self, store: Backend) -> None:
        """One namespace is listed, or goes, and its neighbours stay, where the store
        declares `lists_keys`; else both raise UnsupportedOperationError naming the
        operation, and nothing is removed."""
        keys = [b"maru/a/1", b"maru/a/2", b"maru/ab/1", b"maru/b/1", b"maru/a*/1"]
        for key in keys:
            store.put(key, key)
        if not store.lists_keys:
            with pytest.raises(UnsupportedOperationError, match="keys"):
                store.keys(b"maru/a")
            with pytest.raises(UnsupportedOperationError, match="prefix"):
                store.delete_prefix(b"maru/a/")
            assert store.contains(keys) == [True] * len(keys)
            return
        listed = sorted(store.keys(b"maru/a"))
        removed = store.delete_prefix(b"maru/a/")
        assert listed == [b"maru/a*/1", b"maru/a/1", b"maru/a/2", b"maru/ab/1"]
        assert removed == 2
        assert store.contains(keys) == [False, False, True, True, True]
        assert sorted(store.keys(b"maru/a/")) == []
        assert store.delete_prefix(b"maru/a/") == 0

    def test_the_removal_log_names_what_was_deleted(self, store: Backend) -> None:
        """`removed_since` lists the digests of deleted objects after the cursor, never
        one still stored, and none before the cursor, where the store declares
        `removal_log`; else its digests are always None."""
        store.put(b"before", b"v")
        store.delete(b"before")
        start = store.removed_since(None)
        for key in (b"gone", b"kept"):
            store.put(key, b"v")
        store.delete(b"gone")
        seen = store.removed_since(start.cursor)
        if not store.removal_log:
            assert (start.digests, seen.digests) == (None, None)
            return
        assert start.digests == []
        assert seen.digests == [key_digest(b"gone")]
        assert store.removed_since(seen.cursor).digests == []

    def test_capabilities_are_declared_with_allowed_values(self, store: Backend) -> None:
        assert store.medium in MEDIA, f"medium = {store.medium!r}; allowed: {MEDIA}"
        for capability in ("zero_copy", "removal_log", "lists_keys", "wraps"):
            assert isinstance(getattr(store, capability), bool), capability

    # --- keys ----------------------------------------------------------------

    @pytest.mark.parametrize("key", [b"", "", b"x" * (MAX_KEY_BYTES + 1), 42, None])
    def test_bad_keys_are_refused_with_a_clear_error(self, store: Backend, key: object) -> None:
        with pytest.raises(InvalidKeyError, match="key"):
            store.put(key, b"v")  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError, match="key"):
            store.contains([b"fine", key])  # type: ignore[list-item]

    def test_the_longest_allowed_key_works(self, store: Backend) -> None:
        key = b"k" * MAX_KEY_BYTES
        assert store.put(key, b"v")
        assert store.get(key) == b"v"

    # --- reservations --------------------------------------------------------

    def test_a_reservation_is_invisible_until_committed(self, store: Backend) -> None:
        data = payload("r", 8 * KIB)
        with store.reserve(b"r", len(data)) as buffer:
            assert buffer is not None and len(buffer) == len(data)
            buffer[:] = data
            assert store.contains([b"r"]) == [False]
            assert store.get(b"r") is None
        assert store.get(b"r") == data

    def test_an_exception_aborts_the_reservation(self, store: Backend) -> None:
        used_before = store.stats().used
        with pytest.raises(RuntimeError), store.reserve(b"r", 8 * KIB) as buffer:
            buffer[:4] = b"half"
            raise RuntimeError("writer failed")
        assert store.contains([b"r"]) == [False]
        assert store.stats().used == used_before
        assert store.put(b"r", b"retry")
        assert store.get(b"r") == b"retry"

    def test_reserving_a_taken_key_yields_none(self, store: Backend) -> None:
        store.put(b"stored", b"v")
        with store.reserve(b"stored", 4) as buffer:
            assert buffer is None
        with store.reserve(b"pending", 4) as first:
            first[:] = b"abcd"
            with store.reserve(b"pending", 4) as second:
                assert second is None
            assert store.put(b"pending", b"wxyz") is False
        assert store.get(b"pending") == b"abcd"

    def test_an_object_larger_than_the_store_is_refused(self, store: Backend) -> None:
        with pytest.raises(ObjectTooLargeError, match="larger than"):
            store.put(b"big", bytes(self.capacity + 1))
        assert store.contains([b"big"]) == [False]

    def test_stats_count_objects_bytes_hits_and_misses(self, store: Backend) -> None:
        before = store.stats()
        store.put(b"a", bytes(100))
        store.put(b"b", bytes(200))
        store.get(b"a")
        store.get_into(b"b", bytearray(200))
        store.get(b"missing")
        stats = store.stats()
        assert stats.capacity == self.capacity
        assert stats.objects == before.objects + 2
        assert stats.used >= before.used + 300
        assert stats.hits == before.hits + 2
        assert stats.misses == before.misses + 1

    # --- reading without a copy ----------------------------------------------

    def test_a_view_holds_the_committed_bytes(self, store: Backend) -> None:
        data = payload("v", 40 * KIB)
        store.put(b"v", data)
        view = store.view("v")
        assert bytes(view.data) == data and view.valid()
        assert view.data.readonly
        assert store.view(b"missing") is None

    def test_a_view_fed_to_its_hasher_is_valid(self, store: Backend) -> None:
        """A reader that hashes what it copies (`ReadView.hasher`) gets the same answer
        from `valid` as one that does not."""
        _, view, hasher = viewed_with_hasher(store, b"h")
        if hasher is not None:
            hasher.update(view.data[:1000])
            hasher.update(view.data[1000:])
        assert view.valid(hasher)

    def test_a_view_copied_through_its_hasher_lands_exactly_and_is_valid(
        self, store: Backend
    ) -> None:
        """`Hashing.copy_rows` copies the rows it is given and hashes them as `update`
        would: a CPU load into a KV cache copies and verifies through it."""
        data, view, hasher = viewed_with_hasher(store, b"c")
        if hasher is None:
            return
        source = np.frombuffer(view.data, dtype=np.uint8)
        rows, row_bytes, stride = 10, 4 * KIB, 5 * KIB
        target = np.zeros(rows * stride, dtype=np.uint8)
        hasher.copy_rows(target.ctypes.data, stride, source.ctypes.data, row_bytes, rows)
        copied = target.reshape(rows, stride)[:, :row_bytes].tobytes()
        assert copied == data and view.valid(hasher)

    def test_a_hasher_fed_other_bytes_makes_its_view_invalid(self, store: Backend) -> None:
        """`valid(hasher)` checks the bytes the reader hashed, not the object's own."""
        _, view, hasher = viewed_with_hasher(store, b"w")
        if hasher is None:
            return
        hasher.update(payload("other", 40 * KIB))
        assert not view.valid(hasher)

    def test_a_view_stays_valid_while_its_object_is_stored(self, store: Backend) -> None:
        size = self.capacity // 6
        store.put(b"old", payload("old", size))
        view = store.view(b"old")
        for i in range(2):  # writes that leave room for the object
            store.put(f"new{i}", payload(f"new{i}", KIB))
        assert bytes(view.data) == payload("old", size)
        assert view.valid(), "a view of an object still stored is valid"

    def test_a_valid_view_never_holds_another_objects_bytes(self, store: Backend) -> None:
        """In place (`zero_copy`), a view of a removed object may turn invalid but never
        shows other bytes as valid; a private copy stays valid and keeps its bytes."""
        size = self.capacity // 6
        store.put(b"old", payload("old", size))
        view = store.view(b"old")
        store.delete(b"old")
        for i in range(12):  # enough writes to reuse the freed memory
            store.put(f"new{i}", payload(f"new{i}", size))
        seen = bytes(view.data)
        if store.zero_copy:
            assert not view.valid() or seen == payload("old", size)
        else:
            assert view.valid() and seen == payload("old", size)

    def test_zero_copy_says_where_objects_are_read_and_written(self, store: Backend) -> None:
        memory = store.host_memory()
        if not store.zero_copy:
            assert memory is None
            return
        base = np.frombuffer(memory, np.uint8).ctypes.data
        within = lambda view: base <= np.frombuffer(view, np.uint8).ctypes.data < base + len(memory)  # noqa: E731
        store.put(b"k", payload("k", 10 * KIB))
        assert within(store.view(b"k").data), "a view reads the object in place"
        with store.reserve(b"r", 10 * KIB) as buffer:
            assert within(buffer), "a reservation is written in place"

    # --- lifecycle and concurrency -------------------------------------------

    def test_a_closed_store_raises_backend_error(self, make_store) -> None:
        with make_store(self.capacity) as store:
            store.put(b"k", b"v")
        for call in (
            lambda: store.get(b"k"),
            lambda: store.put(b"x", b"v"),
            lambda: store.contains([b"k"]),
            store.stats,
        ):
            with pytest.raises(BackendError, match="closed"):
                call()
        store.close()

    def test_threads_never_see_a_torn_or_wrong_object(self, store: Backend) -> None:
        assert churn_in_threads(store) == []


class EvictionContract:
    """For backends that enforce their own capacity (mock, shm, cxl), not for those
    where the server does (Redis with maxmemory): mix in beside BackendContract."""

    def test_a_full_store_evicts_the_least_recently_used(self, store: Backend) -> None:
        size = self.capacity // 5
        for i in range(4):
            assert store.put(f"k{i}", payload(f"k{i}", size))
        assert store.get(b"k0") == payload("k0", size)
        for i in range(4, 6):
            assert store.put(f"k{i}", payload(f"k{i}", size))
        present = store.contains([f"k{i}" for i in range(6)])
        assert present[0] and present[4] and present[5], present
        assert not present[1], present
        assert store.stats().evictions >= 1

    def test_writes_never_fail_for_lack_of_room(self, store: Backend) -> None:
        size = self.capacity // 7
        for i in range(30):
            assert store.put(f"k{i}", payload(f"k{i}", size)), f"put {i} failed"
            stats = store.stats()
            assert stats.used <= stats.capacity
        assert store.get(b"k29") == payload("k29", size)

    def test_the_removal_log_names_evictions(self, store: Backend) -> None:
        size = self.capacity // 5
        cursor = store.removed_since(None).cursor
        for i in range(6):
            assert store.put(f"k{i}", payload(f"k{i}", size))
        seen = store.removed_since(cursor)
        if not store.removal_log:
            assert seen.digests is None
            return
        gone = [
            f"k{i}".encode()
            for i, present in enumerate(store.contains([f"k{i}" for i in range(6)]))
            if not present
        ]
        assert gone and sorted(seen.digests) == sorted(map(key_digest, gone))

    def test_threads_under_eviction_pressure_see_whole_objects(self, store: Backend) -> None:
        assert churn_in_threads(store) == []
        stats = store.stats()
        assert stats.used <= stats.capacity
        assert stats.evictions > 0


def churn_in_threads(store: Backend, threads: int = 4, operations: int = 300) -> list[str]:
    """Random puts, gets and views from several threads; every read that was wrong."""
    errors: list[str] = []
    sizes = [KIB, 7 * KIB, 16 * KIB, 33 * KIB]

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(operations):
            i = int(rng.integers(40))
            key, size = f"obj{i}", sizes[i % len(sizes)]
            action = rng.random()
            if action < 0.5:
                store.put(key, payload(key, size))
            elif action < 0.75:
                got = store.get(key)
                if got is not None and got != payload(key, size):
                    errors.append(f"{key}: wrong bytes")
            elif (view := store.view(key)) is not None:
                seen = bytes(view.data)
                if view.valid() and seen != payload(key, size):
                    errors.append(f"{key}: wrong bytes in a valid view")

    running = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    return errors
