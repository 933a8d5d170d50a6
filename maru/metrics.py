"""maru's Prometheus metrics on vLLM's `/metrics` (the connector's `build_prom_metrics`).

vLLM hands each engine's connector stats (`MaruConnectorStats.data`: both halves'
counters summed, per-chunk latencies, the store's gauges) to `observe` once per
report. Metrics are named `vllm:maru_*` so that they sit beside vLLM's own and are
labelled the way vLLM labels its engines (model name, engine index). Imports vLLM:
only the connector imports this module.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

COUNTERS = {
    "lookups": ("vllm:maru_lookups", "Store lookups (one batched lookup per request)."),
    "hit_tokens": ("vllm:maru_hit_tokens", "Prompt tokens loaded from the store."),
    "miss_tokens": ("vllm:maru_miss_tokens",
                    "Whole-chunk prompt tokens the store was asked for and lacked."),
    "loads": ("vllm:maru_chunks_loaded", "Chunks loaded (per tensor-parallel rank)."),
    "saves": ("vllm:maru_chunks_saved", "Chunks saved (per tensor-parallel rank)."),
    "loaded_bytes": ("vllm:maru_loaded_bytes", "Bytes copied from the store."),
    "saved_bytes": ("vllm:maru_saved_bytes", "Bytes copied into the store."),
    "skipped_seconds": ("vllm:maru_store_skipped_seconds",
                        "Seconds the store was skipped after errors (error_backoff)."),
}
"""Counter stats: stat name -> (metric name, help)."""

ERRORS = {"lookup_errors": "lookup", "load_errors": "load", "save_errors": "save"}
"""Error counters, as the `kind` label of vllm:maru_errors."""

LATENCIES = {
    "load_latencies": ("vllm:maru_load_seconds",
                       "Seconds from issuing a chunk's copies to its load being done."),
    "save_latencies": ("vllm:maru_save_seconds",
                       "Seconds from a chunk's first copy to its object committed."),
}
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0)

GAUGES = {
    "store_capacity": ("vllm:maru_store_capacity_bytes", "The store's capacity in bytes."),
    "store_used": ("vllm:maru_store_used_bytes", "Bytes the store's objects take."),
    "store_objects": ("vllm:maru_store_objects", "Objects in the store."),
    "store_evictions": ("vllm:maru_store_evictions",
                        "Objects the store has evicted since it was created."),
}


class MaruPromMetrics(KVConnectorPromMetrics):
    """Counters, latency histograms and store gauges, one labelled child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for stat, (name, documentation) in COUNTERS.items():
            self._metrics[stat] = self._counter_cls(name=name, documentation=documentation,
                                                    labelnames=labelnames)
        errors = self._counter_cls(name="vllm:maru_errors", documentation=(
            "Store errors by kind (lookup, load, save); each is a miss or a recompute, "
            "never a wrong token."), labelnames=[*labelnames, "kind"])
        for stat, (name, documentation) in LATENCIES.items():
            self._metrics[stat] = self._histogram_cls(
                name=name, documentation=documentation, labelnames=labelnames,
                buckets=LATENCY_BUCKETS)
        for stat, (name, documentation) in GAUGES.items():
            self._metrics[stat] = self._gauge_cls(name=name, documentation=documentation,
                                                  labelnames=labelnames,
                                                  multiprocess_mode="mostrecent")
        self._children: dict[tuple[int, str], Any] = {}
        for engine, values in per_engine_labelvalues.items():
            for stat, metric in self._metrics.items():
                self._children[engine, stat] = metric.labels(*values)
            for stat, kind in ERRORS.items():
                self._children[engine, stat] = errors.labels(*values, kind)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for stat in (*COUNTERS, *ERRORS):
            if transfer_stats_data.get(stat):
                self._children[engine_idx, stat].inc(transfer_stats_data[stat])
        for stat in LATENCIES:
            for seconds in transfer_stats_data.get(stat, ()):
                self._children[engine_idx, stat].observe(seconds)
        for stat in GAUGES:
            if stat in transfer_stats_data:
                self._children[engine_idx, stat].set(transfer_stats_data[stat])
