"""What a built `vllm.LLM` tells about its engine and maru's connector halves in it.

Run in the engine's process (`maru.cli._engine`), where the engine core and the worker
are reachable: counters, metrics, the KV cache groups, what the connector decided.
"""

from __future__ import annotations

from typing import Any

PREFIX_CACHE_METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
)
"""Prometheus counters (tokens) that split vLLM's local prefix-cache hits from a KV
connector's external hits; `RequestOutput.num_cached_tokens` only gives their sum."""


def connector_halves(llm: Any) -> list[Any]:
    """The scheduler's connector and this process's worker connector, if there is one.

    The engine core and the worker are in this process (no V1 multiprocessing), so
    both are reachable here."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    halves = [llm.llm_engine.engine_core.engine_core.scheduler.connector]
    if has_kv_transfer_group():
        halves.append(get_kv_transfer_group())
    return [child for connector in halves for child in children(connector)]


def children(connector: Any) -> list[Any]:
    """A connector, or the connectors a MultiConnector combines."""
    return list(getattr(connector, "_connectors", None) or [connector])


def connector_description(llm: Any) -> dict[str, Any]:
    """What maru's connector halves decided at start-up: the layout adapter and
    fingerprint a worker found, the identity the scheduler's namespace covers."""
    described: dict[str, Any] = {}
    for connector in connector_halves(llm):
        worker = getattr(connector, "worker_half", None)
        scheduler = getattr(connector, "scheduler_half", None)
        if worker is not None:
            names = sorted({path.adapter.name for path in worker.paths.values()})
            described["layout_adapter"] = ",".join(names) or None
            described["layout_fingerprint"] = worker.fingerprint
        if scheduler is not None:
            described["identity"] = scheduler.namespace.identity()
    return described


CONNECTOR_METRICS = ("vllm:maru_", "vllm:prompt_tokens_cached_by_source")
"""maru's metrics, and vLLM's count of cached prompt tokens by where they came from."""


def connector_metrics(llm: Any) -> dict[str, Any]:
    """The `CONNECTOR_METRICS` as vLLM's registry holds them: a counter's or gauge's value,
    a histogram's count and sum, summed over engines; a `kind` or `source` label goes
    into the name (`vllm:maru_errors{load}`)."""
    found: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(CONNECTOR_METRICS):
            continue
        label = metric.labels.get("kind", metric.labels.get("source"))
        name = metric.name + (f"{{{label}}}" if label else "")
        if hasattr(metric, "count"):
            seen = found.setdefault(name, {"count": 0, "sum": 0.0})
            seen["count"] += metric.count
            seen["sum"] += metric.sum
        else:
            found[name] = found.get(name, 0) + metric.value
    return found


def kv_cache_groups(llm: Any) -> list[str] | None:
    """The engine's KV cache groups as its scheduler allocates them: each group's spec
    and layers; None where the engine core runs in another process."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    if config is None:
        return None
    return [
        f"{type(group.kv_cache_spec).__name__}: {', '.join(group.layer_names)}"
        for group in config.kv_cache_groups
    ]


def kv_cache_container(llm: Any) -> str | None:
    """The type of an attention layer's `kv_cache`: a list indexed by virtual engine
    (vLLM <= 0.18) or the tensor itself; None if the layers live in worker processes."""
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return type(next(iter(layers.values())).kv_cache).__name__ if layers else None


def connector_totals(llm: Any) -> dict[str, float]:
    """Both maru connector halves' counters since start-up, summed."""
    totals: dict[str, float] = {}
    for connector in connector_halves(llm):
        for half in (
            getattr(connector, "worker_half", None),
            getattr(connector, "scheduler_half", None),
        ):
            for name, value in (half.stats.lifetime if half is not None else {}).items():
                totals[name] = totals.get(name, 0) + value
    return totals


def prefix_metrics(llm: Any) -> dict[str, float]:
    """Current values of the prefix-cache counters, summed over engines."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in PREFIX_CACHE_METRICS:
            totals[metric.name] = totals.get(metric.name, 0.0) + float(metric.value)
    return totals
