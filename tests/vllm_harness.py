"""vLLM's real Scheduler driven step by step with MaruKVConnector's scheduler half.

The worker's part (copying KV) is played by putting a placeholder object for
every chunk the metadata says to save, and by reporting a finished request's
saves done in the next step, so these tests see exactly what the scheduler
half plans: lookups, loads, saves, their block ids, and when blocks are freed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import maru
from maru.vllm.keys import rank_key
from maru.vllm.metadata import MaruConnectorMetadata, MaruHandshake
from maru.vllm.stats import COUNTED

BLOCK_SIZE = 32


def make_vllm_config(
    model_dir: Any,
    extra: dict[str, Any],
    *,
    num_blocks: int = 200,
    max_batched_tokens: int = 2048,
    kv_events: bool = False,
    kv_role: str = "kv_both",
) -> Any:
    """A VllmConfig for the tiny model with MaruKVConnector configured by `extra` (and,
    with `kv_events`, KV events published to a publisher that drops them)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cache.num_gpu_blocks = num_blocks
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, max_model_len=4096, dtype="bfloat16"
        ),
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_batched_tokens,
            max_num_seqs=16,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MaruKVConnector",
            kv_connector_module_path="maru.connector",
            kv_role=kv_role,
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null"),
    )


GROUP_LAYERS = {"full": "f", "window": "s", "state": "m", "chunked": "c"}


def group_spec(kind: str, window: int = 64) -> Any:
    """A KV cache spec of one kind of group, as vLLM builds them: "full" attention, a
    sliding "window", a Mamba "state" (its prefix-caching "align" mode), or "chunked"
    local attention (which maru does not serve)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    shape = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    if kind == "full":
        return FullAttentionSpec(**shape)
    if kind == "window":
        return SlidingWindowSpec(**shape, sliding_window=window)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**shape, attention_chunk_size=window)
    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((96, 3), (4, 32, 16)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )


def make_kv_cache_config(num_blocks: int, groups: tuple[str, ...] = ("full",)) -> Any:
    """The KV cache as the scheduler sees it: one group per kind in `groups` ("full",
    "window", "state"; one layer each, named by kind), sharing one pool of blocks."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    specs = [
        KVCacheGroupSpec([f"{GROUP_LAYERS[kind]}{index}"], group_spec(kind))
        for index, kind in enumerate(groups)
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)


def request_parameters() -> set[str]:
    """The parameters of this vLLM's Request (0.16 requires `eos_token_id`; 0.32 has none)."""
    import inspect

    from vllm.v1.request import Request

    return set(inspect.signature(Request).parameters)


def vllm_features() -> dict[str, bool]:
    """Whether this vLLM release has each feature older ones lack, by the marker of the
    tests that need it (`tests.conftest.VLLM_FEATURES`)."""
    from maru.vllm import compat

    return {
        "hybrid_loads": compat.has_hook("get_transfer_results"),
        "worker_channel": compat.KVConnectorWorkerMetadata is not object,
    }


def failures(req_ids: set[str]) -> dict[str, set[str]]:
    """KVConnectorOutput's per-request load failures, where this vLLM takes them."""
    return {"failed_recving": req_ids} if req_ids else {}


class SchedulerHarness:
    """One vLLM scheduler with the maru connector over a store (an in-process mock one
    unless `backend` says otherwise), told the workers' `layout` as their handshake
    would (None: told nothing). With `kv_events`, vLLM's KV events are collected in
    `published`."""

    def __init__(
        self,
        model_dir: Any,
        pool: str,
        *,
        chunk_tokens: int = 64,
        max_batched_tokens: int = 2048,
        num_blocks: int = 200,
        mock: dict[str, Any] | None = None,
        backend: str = "mock",
        kv_events: bool = False,
        groups: tuple[str, ...] = ("full",),
        kv_role: str = "kv_both",
        settings: dict[str, Any] | None = None,
        layout: str | None = "harness-layout",
        async_scheduling: bool = False,
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        options = {"name": pool, **(mock or {})} if backend == "mock" else {"name": pool}
        extra = {"backend": backend, "chunk_tokens": chunk_tokens, backend: options}
        extra.update(settings or {})
        vllm_config = make_vllm_config(
            model_dir,
            extra,
            num_blocks=num_blocks,
            max_batched_tokens=max_batched_tokens,
            kv_events=kv_events,
            kv_role=kv_role,
        )
        kv_cache_config = make_kv_cache_config(num_blocks, groups)
        if "state" in groups:  # what vLLM sets for a Mamba hybrid with prefix caching
            vllm_config.cache_config.mamba_cache_mode = "align"
        self.scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
            vllm_config,
            kv_cache_config,
            StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.connector = self.scheduler.connector
        if layout is not None:  # what the workers' handshake says at start-up
            self.connector.set_xfer_handshake_metadata({0: MaruHandshake(layout)})
        self.forwarded: dict[str, float] = {}
        """Connector stats vLLM handed on in its scheduler stats."""
        self.blocks: dict[str, tuple[list[int], ...]] = {}
        self.saving: set[str] = set()
        self._in_flight: tuple[Any, Any] | None = None
        """With `step_ahead`: the step scheduled, its output not reported yet."""
        self.transfer_params: dict[str, Any] = {}
        """The kv_transfer_params vLLM returned with each finished request."""
        self.failing_loads: set[str] = set()
        """Requests whose asynchronous loads the played worker reports failed."""
        self.store = maru.open_store(backend=backend, **{backend: {"name": pool}})
        self.published: list[Any] = []
        if kv_events:
            self.scheduler.kv_event_publisher.publish = lambda batch: self.published.extend(
                batch.events
            )

    def add(
        self,
        req_id: str,
        tokens: list[int],
        *,
        cache_salt: str | None = None,
        max_tokens: int = 1,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"eos_token_id": 2} if "eos_token_id" in request_parameters() else {}
        request = Request(
            req_id,
            tokens,
            SamplingParams(
                max_tokens=max_tokens,
                extra_args={"kv_transfer_params": kv_transfer_params}
                if kv_transfer_params
                else None,
            ),
            None,
            cache_salt=cache_salt,
            block_hasher=self._hasher,
            **extra,
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> tuple[Any, MaruConnectorMetadata]:
        """Schedule, play the worker (store what is saved), report the model's output."""
        scheduled = self._schedule()
        self._report(*scheduled)
        return scheduled[0], scheduled[0].kv_connector_metadata

    def step_ahead(self) -> tuple[Any, MaruConnectorMetadata]:
        """As vLLM's async scheduling runs: schedule step N+1, then report step N's
        output (the scheduler's counts then include the tokens in flight)."""
        scheduled = self._schedule()
        if self._in_flight is not None:
            self._report(*self._in_flight)
        self._in_flight = scheduled
        return scheduled[0], scheduled[0].kv_connector_metadata

    def _schedule(self) -> tuple[Any, Any]:
        """Schedule one step and play the worker: the scheduler output and what the
        model runner will report of it."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        for save in meta.saves:
            self.store.put(rank_key(save.key, 0, save.group), b"pages")
            if self.connector.scheduler.saves_hold_blocks:  # the worker reports them done
                self.saving.add(save.req_id)
        saved = output.finished_req_ids & self.saving
        self.saving -= saved
        loaded = (
            {load.req_id for load in meta.loads} if self.connector.scheduler.loads_async else set()
        )
        failed = loaded & self.failing_loads
        computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        req_ids = list(output.num_scheduled_tokens)
        for req_id in req_ids:
            self.blocks[req_id] = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        sampled = []
        for req_id in req_ids:
            done = computed[req_id] + output.num_scheduled_tokens[req_id]
            prompt = self.scheduler.requests[req_id].num_prompt_tokens
            sampled.append([7] if done >= prompt else [])
        return output, ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=saved, finished_recving=loaded, **failures(failed)
            ),
        )

    def _report(self, output: Any, model_output: Any) -> None:
        engine_outputs = self.scheduler.update_from_output(output, model_output)
        for outputs in engine_outputs.values():
            for finished in outputs.outputs:
                if finished.kv_transfer_params:
                    self.transfer_params[finished.request_id] = finished.kv_transfer_params
            reported = outputs.scheduler_stats and outputs.scheduler_stats.kv_connector_stats
            for name in COUNTED:
                self.forwarded[name] = self.forwarded.get(name, 0) + (reported or {}).get(name, 0)

    @property
    def stats(self) -> dict[str, float]:
        """What vLLM handed on, plus what the scheduler half holds for its next report
        (vLLM <= 0.23 forwards it only together with a worker's stats)."""
        pending = self.connector.scheduler.stats.data
        return {name: self.forwarded.get(name, 0) + pending[name] for name in COUNTED}

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def preempt(self, req_id: str) -> None:
        """Preempt a running request, as vLLM does when it runs out of blocks."""
        request = self.scheduler.requests[req_id]
        self.scheduler.running.remove(request)
        # vLLM <= 0.23 asserts that a request it preempts was not scheduled the step before
        getattr(self.scheduler, "prev_step_scheduled_req_ids", set()).discard(req_id)
        self.scheduler._preempt_request(request, time.monotonic())

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """The request's blocks (of one KV cache group) when it was last scheduled."""
        return list(self.blocks[req_id][group])

    def chunk_keys(self, request: Any) -> list[bytes]:
        return self.connector.scheduler.chunk_keys(request)

    def close(self) -> None:
        self.connector.shutdown()  # joins the scheduler half's threads
        self.store.close()
