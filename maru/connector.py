"""MaruKVConnector: vLLM's KV connector over a maru store; the facade vLLM loads.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "shm", "capacity": "8GiB"}}'

vLLM builds one connector per role: in the scheduler it hands every call to the
scheduler half (`maru.vllm.scheduler`: lookups, load and save plans), in each worker to
the worker half (`maru.vllm.worker`: copies between the store and the KV cache). Only
chunk keys and block ids travel from scheduler to workers (`maru.vllm.metadata`).

A hit in memory is copied within the step; one in a slow tier (Redis, a disk) is loaded
asynchronously, read off the engine's thread while other requests run
(`maru.vllm.asyncloads`). The store is best-effort: a lookup error is a miss, a chunk
that cannot be loaded is reported through `get_block_ids_with_load_errors` so vLLM
recomputes it, and after an error the store is skipped for `error_backoff` seconds.
What retrying cannot fix (bad configuration, an unknown tensor-parallel rank) turns the
half off with one error.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from maru.config import load_config
from maru.transfer import DataPath
from maru.vllm import compat
from maru.vllm.metadata import MaruConnectorMetadata, MaruHandshake, MaruWorkerMeta
from maru.vllm.scheduler import MaruScheduler
from maru.vllm.stats import MaruConnectorStats
from maru.vllm.worker import DataPathFactory, MaruWorker

__all__ = ["MaruConnectorMetadata", "MaruKVConnector"]


class MaruKVConnector(KVConnectorBase_V1, compat.SupportsHMA):
    """vLLM KV connector that shares prompt KV through a maru store.

    It supports vLLM's hybrid memory allocator: vLLM keeps it on, so hybrid models start
    and keep their memory savings; a KV cache of more than one group, or of one that frees
    blocks, turns maru off with one error (`maru.vllm.groups`), and vLLM computes it."""

    def __init__(
        self,
        vllm_config: Any,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
        *,
        transfers: DataPathFactory = DataPath,
    ) -> None:
        """`transfers` makes the worker's data path (vLLM never passes it; tests do)."""
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.config = load_config(extra_config=extra)
        compat.recompute_failed_loads(vllm_config)
        self.scheduler_half: MaruScheduler | None = None
        self.worker_half: MaruWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_half = MaruScheduler(vllm_config, self.config, kv_cache_config)
            source = compat.hit_source(self.scheduler_half.medium)
            if source is not None:
                self._cache_hit_source = source
        else:
            self.worker_half = MaruWorker(vllm_config, self.config, kv_cache_config, transfers)

    @property
    def worker(self) -> MaruWorker:
        """The worker half; a clear error where vLLM asks the scheduler's connector."""
        if self.worker_half is None:
            raise RuntimeError("maru: a worker-side connector call on the scheduler's connector")
        return self.worker_half

    @property
    def scheduler(self) -> MaruScheduler:
        """The scheduler half; a clear error where vLLM asks a worker's connector."""
        if self.scheduler_half is None:
            raise RuntimeError("maru: a scheduler-side connector call on a worker's connector")
        return self.scheduler_half

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """maru's metrics on vLLM's /metrics (`maru.vllm.metrics`)."""
        from maru.vllm.metrics import MaruPromMetrics

        return MaruPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads and saves are issued per layer, between graph pieces (a whole-model CUDA
        graph would replay the forward without them)."""
        return True

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> MaruConnectorStats | None:
        return MaruConnectorStats(dict(data or {}))

    def get_kv_connector_stats(self) -> MaruConnectorStats | None:
        if self.worker_half is not None:
            return self.worker_half.report()
        return self.scheduler_half.report()

    def shutdown(self) -> None:
        (self.worker_half or self.scheduler_half).close()

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> MaruHandshake | None:
        return self.worker_half.handshake() if self.worker_half else None

    def build_connector_worker_meta(self) -> MaruWorkerMeta | None:
        if self.worker_half is None:
            return None
        handshake = self.worker_half.handshake()
        return MaruWorkerMeta(frozenset({handshake.layout_fingerprint}), handshake.block_bytes)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_half is not None and connector_metadata.saves:
            self.worker_half.expect_saves(connector_metadata.saves)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if kv_connector_metadata.preempted:  # their blocks are reused from this step on
            self.worker.commit_copied(wait=True)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if metadata.loads:
            self.worker.load(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        metadata = self._get_connector_metadata()
        if metadata.saves:
            try:
                self.worker.save_layer(layer_name, metadata.saves)
            except Exception as exc:  # a failed save is a future miss, never a failed step
                self.worker.abort_saves(exc)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        try:
            self.worker.finish_saves(self._get_connector_metadata().saves)
        except Exception as exc:
            self.worker.abort_saves(exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_half is None:
            return None, None
        saved = self.worker_half.finished_saving(finished_req_ids)
        loaded, _ = self.worker_half.take_finished_loads()
        return saved or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """`get_finished` with the requests whose loads failed (vLLM recomputes them);
        what vLLM asks for since it takes per-request load failures."""
        if self.worker_half is None:
            return compat.transfer_results(set(), set(), set())
        saved = self.worker_half.finished_saving(finished_req_ids)
        loaded, failed = self.worker_half.take_finished_loads()
        return compat.transfer_results(saved, loaded, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_half.take_failed_blocks() if self.worker_half else set()

    # scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens) and self.scheduler.load_async(request.request_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(
            request, blocks.get_block_ids(), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> MaruConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self.scheduler_half is not None:
            self.scheduler_half.saves_settled(set(connector_output.finished_sending or ()))
            self.scheduler_half.loads_failed(
                set(getattr(connector_output, "failed_recving", ())),
                frozenset(getattr(connector_output, "invalid_block_ids", None) or ()),
            )
            self.scheduler_half.loads_finished(set(connector_output.finished_recving or ()))
            worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(worker_meta, MaruWorkerMeta):
                self.scheduler_half.set_layout(set(worker_meta.layout_fingerprints))
                self.scheduler_half.staging.learn(worker_meta.block_bytes)

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come free once their saves' copies are done: vLLM
        waits for them rather than preempt a request."""
        return bool(self.scheduler_half and self.scheduler_half.held)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls instead of `request_finished` with its hybrid allocator on."""
        return self.scheduler.request_finished(request)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        handshakes = [m for m in metadata.values() if isinstance(m, MaruHandshake)]
        if handshakes:
            self.scheduler.set_layout({m.layout_fingerprint for m in handshakes})
            self.scheduler.staging.learn(b for m in handshakes for b in m.block_bytes)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """The handshakes of every (pipeline stage, tensor-parallel rank)."""
        self.set_xfer_handshake_metadata(dict(enumerate(metadata.values())))

    def take_events(self) -> list[Any]:
        return self.scheduler_half.take_events() if self.scheduler_half else []

    def reset_cache(self) -> bool | None:
        """`/reset_prefix_cache` with the connector: clear this instance's namespace."""
        return self.scheduler_half.reset() if self.scheduler_half else None
