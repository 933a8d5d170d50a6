"""Hybrid models (several KV cache groups, or one that drops blocks) sharing KV through
maru, on real vLLM engines.

Each kind of model (`tests.hybrid_models`) is written by one engine and read by a second:
the reader loads the writer's chunks, group by group by each group's own rule (full
attention every block, a sliding window its last window, a Mamba or linear-attention
layer one state), and its tokens equal those of vLLM's own prefix-cache hit at the same
point of the same prompt. The models are float32 where vLLM's CPU kernels allow (the
gated delta net runs in bf16 only, and there the reference is a hit from the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

import maru
from maru.backends.shm import shm_path
from maru.cli._engine import run_engine
from maru.cli._hybrid_models import build_hybrid
from maru.cli.demo import connector_config
from maru.vllm.keys import HEADER_BYTES, ROOT, parse_key
from tests.conftest import unique_name

pytestmark = pytest.mark.slow

PROMPT = list(range(3, 203))
HIT = 192
"""Three 64-token chunks (two of 96): a hit ends on a chunk boundary before the last token."""


@dataclass(frozen=True)
class Kind:
    """How a kind of model runs here, and the KV cache groups vLLM gives it."""

    groups: int
    chunk_tokens: int = 64
    options: dict = field(default_factory=dict)


FLOAT32 = {"dtype": "float32"}
KINDS = {
    "sliding_window": Kind(2, options={"llm_kwargs": FLOAT32}),
    "all_sliding_window": Kind(1, options={"llm_kwargs": FLOAT32}),
    # vLLM's CPU Mamba scan in align mode: a block per step
    "mamba": Kind(2, options={"llm_kwargs": FLOAT32, "max_num_batched_tokens": 32}),
    # vLLM raises the block size to fit the delta net's state, by how much depends on the
    # CPU (64 on an AVX2 EPYC, 96 where this was written): 96 everywhere. CPU GDN is bf16
    "linear_attention": Kind(2, 96, {"max_num_batched_tokens": 96, "block_size": 96}),
}


def maru_transfer_config(pool: str, chunk_tokens: int = 64, backend: str = "shm") -> dict:
    """vLLM's kv_transfer_config for maru over a small store of this test's own."""
    options = {"shm": {"name": pool}} if backend == "shm" else {"mock": {"name": pool}}
    config = maru.load_config(
        backend=backend, capacity="64MiB", chunk_tokens=chunk_tokens, **options
    )
    return connector_config(config)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid-models")
    return lambda kind: build_hybrid(folder / kind, kind)


@pytest.fixture(scope="module")
def shared(hybrid):
    """Per kind, once: a writer engine, a reader engine over the writer's pool, and the
    reference (vLLM's own prefix-cache hit on the prompt, without maru)."""
    runs: dict[str, dict] = {}
    pools: list[str] = []

    def run(kind: str) -> dict:
        if kind not in runs:
            spec, model = KINDS[kind], hybrid(kind)
            pools.append(unique_name("test"))
            config = maru_transfer_config(pools[-1], spec.chunk_tokens)
            runs[kind] = {
                "pool": pools[-1],
                "config": config,
                "writer": run_engine(model, [PROMPT], kv_transfer_config=config, **spec.options),
                "reader": run_engine(model, [PROMPT], kv_transfer_config=config, **spec.options),
                "own_hit": run_engine(model, [PROMPT, PROMPT], **spec.options),
            }
        return runs[kind]

    yield run
    for pool in pools:
        shm_path(pool).unlink(missing_ok=True)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_second_engine_loads_the_first_ones_chunks(shared, kind):
    runs = shared(kind)
    reader, own_hit = runs["reader"], runs["own_hit"]
    assert runs["writer"].extra["connector_totals"]["saves"] > 0
    assert reader.external_cached_tokens == [HIT]
    assert reader.extra["connector_totals"]["loads"] > 0
    assert reader.extra["connector_totals"]["load_errors"] == 0
    assert own_hit.num_cached_tokens[1] == HIT, "the reference hits at the same point"
    assert reader.token_ids == own_hit.token_ids[1:]


@pytest.mark.parametrize("kind", list(KINDS))
def test_with_maru_vllm_keeps_its_hybrid_allocator(shared, kind):
    """The same KV cache groups and block count as without a connector (HMA stays on)."""
    with_maru, without = shared(kind)["writer"], shared(kind)["own_hit"]
    assert len(with_maru.extra["kv_cache_groups"]) == KINDS[kind].groups
    assert with_maru.extra["kv_cache_groups"] == without.extra["kv_cache_groups"]
    assert with_maru.extra["num_gpu_blocks"] == without.extra["num_gpu_blocks"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_zeroed_window_or_state_changes_the_tokens(shared, hybrid, kind):
    """The negative control: the reader's equality can fail. The pages of the group that
    is not full attention (the one object of it a reader loads) zeroed, as if a load had
    left its fresh blocks as vLLM allocates them."""
    runs = shared(kind)
    groups = runs["writer"].extra["kv_cache_groups"]
    other = next(i for i, group in enumerate(groups) if not group.startswith("FullAttention"))
    assert zero_group(runs["pool"], other) > 0
    reader = run_engine(
        hybrid(kind), [PROMPT], kv_transfer_config=runs["config"], **KINDS[kind].options
    )
    assert reader.external_cached_tokens == [HIT]
    assert reader.token_ids != runs["own_hit"].token_ids[1:]


def zero_group(pool: str, group: int) -> int:
    """Zero the pages (not the header) of every object of `group` in shm pool `pool`; how
    many objects."""
    config = maru.load_config(backend="shm", capacity="64MiB", shm={"name": pool})
    count = 0
    with maru.open_store(config) as store:
        for key in store.keys(ROOT):
            parsed = parse_key(key)
            if parsed is None or parsed.is_record or parsed.group != group:
                continue
            header = store.get(key)[:HEADER_BYTES]
            size = len(store.get(key))
            store.delete(key)
            assert store.put(key, header + bytes(size - HEADER_BYTES))
            count += 1
    return count


def test_a_store_that_fails_every_load_gives_the_cold_tokens(hybrid):
    """A Mamba hybrid (several groups: vLLM takes failures only per request, of
    asynchronous loads): the lookups find the chunks, every read finds them gone."""
    shared_prefix = list(range(3, 259))
    prompts = [shared_prefix + list(range(300, 340)), shared_prefix[:200] + list(range(400, 440))]
    model, options = hybrid("mamba"), KINDS["mamba"].options
    config = maru_transfer_config(unique_name(), backend="mock")
    config["kv_connector_extra_config"]["mock"]["drop_rate"] = 1.0
    failing = run_engine(model, prompts, kv_transfer_config=config, **options)
    cold = run_engine(model, prompts, **options)
    totals = failing.extra["connector_totals"]
    assert totals["hit_tokens"] == HIT and totals["load_errors"] > 0, totals
    assert totals["loads"] == 0
    assert failing.token_ids == cold.token_ids


def test_beyond_vllms_own_cache_a_window_hybrid_hits_mid_prompt(hybrid):
    """vLLM keeps only "semantic checkpoints" of sliding-window and Mamba groups, so its
    own cache rarely hits inside a prompt another request shared; maru's chunks do."""
    shared_prefix = list(range(3, 259))
    prompts = [
        shared_prefix + list(range(300, 340)),
        shared_prefix + list(range(350, 390)),
        shared_prefix[:200] + list(range(400, 440)),
    ]
    model, options = hybrid("sliding_window"), KINDS["sliding_window"].options
    with_maru = run_engine(
        model,
        prompts,
        kv_transfer_config=maru_transfer_config(unique_name(), backend="mock"),
        **options,
    )
    own = run_engine(model, prompts, **options)
    assert own.num_cached_tokens == [0, 0, 0]
    assert with_maru.num_cached_tokens == [0, 256, HIT]
    assert with_maru.token_ids == own.token_ids


def test_a_sliding_window_hybrid_shares_with_the_hybrid_allocator_off(hybrid, pool_names):
    """Still possible: vLLM then keeps every token of the sliding-window layers as full
    attention, one group."""
    model = hybrid("sliding_window")
    config = maru_transfer_config(pool_names())
    off = {"llm_kwargs": {"disable_hybrid_kv_cache_manager": True}}
    writer = run_engine(model, [PROMPT], kv_transfer_config=config, **off)
    reader = run_engine(model, [PROMPT], kv_transfer_config=config, **off)
    own_hit = run_engine(model, [PROMPT, PROMPT], **off)
    assert len(writer.extra["kv_cache_groups"]) == 1
    assert writer.extra["connector_totals"]["saves"] > 0
    assert reader.external_cached_tokens == [HIT]
    assert reader.token_ids == own_hit.token_ids[1:]
