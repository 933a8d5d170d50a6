"""Slow hits staged by the scheduler (`maru.vllm.staging`): with a tiered store over a shm
pool, vLLM's real scheduler waits while the hit is read into the pool, then schedules the
request with a load inside the step; where the hit cannot be promoted, its load runs in
the worker's background as before."""

from __future__ import annotations

import time

import pytest

import maru
from maru.vllm.keys import HEADER_BYTES, rank_key
from maru.vllm.metadata import MaruHandshake
from tests.test_async_loads import GUARD_S, LOAD_EVERY_HIT, tokens

BLOCK_BYTES = 4096
"""What the played worker says one block of its objects weighs."""
HIT = 288
"""Tokens a 300-token prompt hits: 4 chunks of 64 and a tail of one 32-token block."""


@pytest.fixture
def node(harness, tmp_path, pool_names):
    """A scheduler over a shm pool in front of a disk store (a slow tier), and a function
    that puts a prompt's objects on the disk only, each `extra` bytes off its size."""
    disk = {"path": str(tmp_path / "disk")}
    tiered = {"tiers": ["shm", "disk"]}
    shm = {"name": pool_names()}
    settings = {"backend": "tiered", "tiered": tiered, "shm": shm, "disk": disk}
    h = harness(settings=settings | {"capacity": "64MiB"} | LOAD_EVERY_HIT)

    def stored_below(prompt: list[int], extra: int = 0) -> None:
        first = h.add("first", prompt)
        h.step()  # the played worker saves into the harness's own store
        chunks = {rank_key(k, 0) for k in h.chunk_keys(first)}
        with maru.open_store(backend="disk", capacity="64MiB", disk=disk) as below:
            for key in h.store.keys(b""):
                blocks = 2 if key in chunks else 1
                below.put(key, bytes(HEADER_BYTES + blocks * BLOCK_BYTES + extra))

    return h, stored_below, shm


def sizes_told(h) -> None:
    """The workers' handshake: one block of worker 0's group 0 objects is BLOCK_BYTES."""
    handshake = MaruHandshake("harness-layout", frozenset({(0, 0, BLOCK_BYTES)}))
    h.connector.set_xfer_handshake_metadata({0: handshake})


def steps_until_scheduled(h, req_id: str):
    """Step until vLLM schedules `req_id` (a guard against a hang, not a speed check):
    the steps that did not, and the output and metadata of the one that did."""
    waited, until = 0, time.monotonic() + GUARD_S
    while time.monotonic() < until:
        output, meta = h.step()
        if req_id in output.num_scheduled_tokens:
            return waited, output, meta
        waited += 1
        time.sleep(0.005)
    raise AssertionError(f"{req_id} not scheduled in {GUARD_S} s")


def test_a_slow_hit_is_read_into_the_pool_then_loaded_within_the_step(node) -> None:
    h, stored_below, shm = node
    stored_below(tokens(300))
    sizes_told(h)
    request = h.add("second", tokens(300))
    waited, output, meta = steps_until_scheduled(h, "second")
    assert waited >= 1, "vLLM waited while the scheduler read the hit"
    assert output.num_scheduled_tokens["second"] == 300 - HIT
    assert meta.loads and not any(load.background for load in meta.loads)
    with maru.open_store(backend="shm", capacity="64MiB", shm=shm) as pool:
        keys = [rank_key(k, 0) for k in h.chunk_keys(request)]
        assert all(pool.contains(keys)), "promoted into the node's pool"
    assert h.stats["staged_tokens"] == HIT


def test_a_hit_that_cannot_be_promoted_loads_in_the_background(node) -> None:
    """Objects of another size than the workers' are read privately, not into the pool:
    the hit is still on the slow tier, and the worker loads it as before."""
    from vllm.v1.request import RequestStatus

    h, stored_below, _ = node
    stored_below(tokens(300), extra=1)
    sizes_told(h)
    h.add("second", tokens(300))
    until = time.monotonic() + GUARD_S
    while h.scheduler.requests["second"].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < until, "the hit was never handed to the worker"
        _, meta = h.step()
        time.sleep(0.005)
    assert meta.loads and all(load.background for load in meta.loads)
    assert h.stats.get("staged_tokens", 0) == 0


def test_without_the_workers_sizes_a_slow_hit_loads_in_the_background(node) -> None:
    h, stored_below, _ = node
    stored_below(tokens(300))
    h.add("second", tokens(300))
    _, meta = h.step()
    assert meta.loads and all(load.background for load in meta.loads), "no step waited"
