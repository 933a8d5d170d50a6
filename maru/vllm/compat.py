"""What differs between the vLLM releases maru supports (0.17 to 0.33), in one place.

Hooks a release lacks are said once at start-up and otherwise left alone: loads and
saves need none of them. Types a release lacks have stand-ins here, so the rest of the
package imports them from this module and never asks which release it runs on.
"""

from __future__ import annotations

from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from maru.log import get_logger

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # vLLM < 0.11 has no connector stats
    KVConnectorStats = object  # type: ignore[assignment,misc]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # releases before the hybrid memory allocator
    SupportsHMA = object  # type: ignore[assignment,misc]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # vLLM < 0.28 has no per-connector channel from workers to the scheduler
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM < 0.32 takes no per-request load failures
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM < 0.32 does not count hits by source
    CacheHitSource = None  # type: ignore[assignment,misc]

log = get_logger(__name__)

OPTIONAL_HOOKS = {
    "build_prom_metrics": "maru's Prometheus metrics (its counters still reach vLLM's stats)",
    "take_events": "KV events for routers",
    "reset_cache": "clearing the store through /reset_prefix_cache",
}
"""Connector hooks of recent vLLM releases, and what is missing where a release lacks one."""


def vllm_version() -> str:
    """The installed vLLM release, e.g. "0.32.0"."""
    return vllm.__version__


def release() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM; None if its version does not say."""
    parts = [int(p) for p in vllm_version().split(".")[:2] if p.isdigit()]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def has_hook(name: str) -> bool:
    """Does this release call the connector hook `name`?"""
    return hasattr(KVConnectorBase_V1, name)


def missing_hooks() -> list[str]:
    """What this vLLM release cannot ask of a connector, in words."""
    missing = [what for hook, what in OPTIONAL_HOOKS.items() if not has_hook(hook)]
    if CacheHitSource is None:
        missing.append(
            "hit counts by source (loaded tokens count as external prefix-cache hits only)"
        )
    return missing


def say_what_this_release_lacks() -> None:
    """Say once, at start-up, which optional hooks this vLLM lacks: the connector runs
    without them, and no KV is lost."""
    if missing := missing_hooks():
        log.info(
            "maru: vLLM %s lacks %s; loads and saves work as ever, nothing is lost",
            vllm_version(),
            "; ".join(missing),
        )


HIT_SOURCES = {"host": "HOST", "disk": "DISK"}
"""A store's medium -> the CacheHitSource its hits count as (else EXTERNAL_UNSPECIFIED)."""


def hit_source(medium: str) -> Any:
    """Where vLLM should count tokens loaded from a store whose bytes live in `medium`;
    None where this release does not count hits by source."""
    if CacheHitSource is None:
        return None
    return CacheHitSource[HIT_SOURCES.get(medium, "EXTERNAL_UNSPECIFIED")]


def recompute_failed_loads(vllm_config: Any) -> None:
    """A best-effort cache must never fail a request: have vLLM recompute failed loads."""
    transfer = vllm_config.kv_transfer_config
    if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
        log.info(
            "maru: setting kv_load_failure_policy to 'recompute' (a failed load from a "
            "cache is recomputed, never an error)"
        )
        transfer.kv_load_failure_policy = "recompute"


def pipeline_parallel_rank() -> int | None:
    """This worker's pipeline stage; None when vLLM cannot tell (no distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().rank_in_group
    except Exception:
        return None


def tensor_parallel_rank() -> int | None:
    """This worker's tensor-parallel rank; None when vLLM cannot tell (no distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:
        return None


def transfer_results(saved: set[str], loaded: set[str], failed: set[str]) -> Any:
    """What a worker reports of its transfers, as vLLM takes it (`get_transfer_results`;
    a failed load is also a finished one)."""
    return KVConnectorTransferResults(
        finished_sending=saved, finished_recving=loaded | failed, failed_recving=failed
    )
