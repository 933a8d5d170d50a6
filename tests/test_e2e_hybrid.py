"""Hybrid models (several KV cache groups) with maru configured, on real vLLM engines.

maru declares vLLM's SupportsHMA, so vLLM keeps its hybrid allocator on: a Mamba hybrid
starts (without it vLLM refuses: "Failed to promote local KV cache specs to one unified
type"), and a sliding-window hybrid keeps its memory savings. maru serves one
full-attention group, so for these it steps aside with one error and vLLM computes
everything, token for token as without a connector."""

from __future__ import annotations

import pytest

import maru
from maru.cli._engine import run_engine
from maru.cli.demo import connector_config
from tests.hybrid_models import build_hybrid

pytestmark = pytest.mark.slow

PROMPT = list(range(3, 203))
ENGINE = {
    "sliding_window": {},
    "mamba": {"max_num_batched_tokens": 32},  # vLLM's CPU Mamba scan, in align mode
}


def maru_transfer_config(pool: str) -> dict:
    """vLLM's kv_transfer_config for maru over a small shm pool of this test's own."""
    config = maru.load_config(backend="shm", capacity="64MiB", chunk_tokens=64, shm={"name": pool})
    return connector_config(config)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid-models")
    return lambda kind: build_hybrid(folder / kind, kind)


@pytest.mark.parametrize("kind", ["sliding_window", "mamba"])
def test_a_hybrid_model_runs_with_maru_as_without_it(hybrid, kind, pool_names, tmp_path):
    model, log = hybrid(kind), tmp_path / "engine.log"
    config = maru_transfer_config(pool_names())
    with_maru = run_engine(model, [PROMPT], kv_transfer_config=config, log_path=log, **ENGINE[kind])
    without = run_engine(model, [PROMPT], **ENGINE[kind])
    assert with_maru.token_ids == without.token_ids
    assert with_maru.extra["num_gpu_blocks"] == without.extra["num_gpu_blocks"], "HMA stays on"
    errors = [line for line in log.read_text().splitlines() if "ERROR" in line and "maru" in line]
    assert len(errors) == 1 and "KV cache has 2 groups" in errors[0], errors
    assert with_maru.extra["connector_totals"]["lookups"] == 0


def test_a_sliding_window_hybrid_shares_with_the_hybrid_allocator_off(hybrid, pool_names):
    """What the error advises: vLLM then keeps every token of the sliding-window layers as
    full attention, one group, which maru serves."""
    model = hybrid("sliding_window")
    config = maru_transfer_config(pool_names())
    off = {"llm_kwargs": {"disable_hybrid_kv_cache_manager": True}}
    writer = run_engine(model, [PROMPT], kv_transfer_config=config, **off)
    reader = run_engine(model, [PROMPT], kv_transfer_config=config, **off)
    own_hit = run_engine(model, [PROMPT, PROMPT], **off)
    assert writer.extra["connector_totals"]["saves"] > 0
    assert reader.external_cached_tokens == [192]
    assert reader.token_ids == own_hit.token_ids[1:]
