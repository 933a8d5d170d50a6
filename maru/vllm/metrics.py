"""maru's Prometheus metrics on vLLM's `/metrics` (the connector's `build_prom_metrics`),
made from the statistics table (`maru.vllm.stats`).

vLLM hands each engine's connector stats (both halves' counters summed, per-chunk
latencies, the store's gauges) to `observe` once per report. Metrics are named
`vllm:maru_*` so that they sit beside vLLM's own, and are labelled the way vLLM labels
its engines (model name, engine index); errors are one counter labelled by kind.
Imported only by `build_prom_metrics`: releases without the hook lack its base class.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from maru.vllm.stats import Stat, of_kind

ERRORS_METRIC = "vllm:maru_errors"
ERRORS_HELP = (
    "Store errors by kind (lookup, load, save); each is a miss or a recompute, never a wrong token."
)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
COUNTERS = tuple(stat for stat in of_kind("counter") if stat.metric)
ERRORS = of_kind("error")
LATENCIES = of_kind("latency")
GAUGES = of_kind("gauge")


class MaruPromMetrics(KVConnectorPromMetrics):
    """Counters, latency histograms and store gauges, one labelled child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        metrics = {
            stat: self._metric(stat, labelnames) for stat in (*COUNTERS, *LATENCIES, *GAUGES)
        }
        errors = self._counter_cls(
            name=ERRORS_METRIC, documentation=ERRORS_HELP, labelnames=[*labelnames, "kind"]
        )
        self._children: dict[tuple[int, str], Any] = {}
        for engine, values in per_engine_labelvalues.items():
            for stat, metric in metrics.items():
                self._children[engine, stat.key] = metric.labels(*values)
            for stat in ERRORS:
                self._children[engine, stat.key] = errors.labels(*values, stat.metric)

    def _metric(self, stat: Stat, labelnames: list[str]) -> Any:
        if stat.kind == "latency":
            return self._histogram_cls(
                name=stat.metric,
                documentation=stat.help,
                labelnames=labelnames,
                buckets=LATENCY_BUCKETS,
            )
        if stat.kind == "gauge":
            return self._gauge_cls(
                name=stat.metric,
                documentation=stat.help,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
        return self._counter_cls(name=stat.metric, documentation=stat.help, labelnames=labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for stat in (*COUNTERS, *ERRORS):
            if transfer_stats_data.get(stat.key):
                self._children[engine_idx, stat.key].inc(transfer_stats_data[stat.key])
        for stat in LATENCIES:
            for seconds in transfer_stats_data.get(stat.key, ()):
                self._children[engine_idx, stat.key].observe(seconds)
        for stat in GAUGES:
            if stat.key in transfer_stats_data:
                self._children[engine_idx, stat.key].set(transfer_stats_data[stat.key])
