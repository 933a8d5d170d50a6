"""When a half uses the store: opened lazily, skipped for a while after an error, and
turned off for good by what retrying cannot fix."""

from __future__ import annotations

import time

import maru
from maru.backends.base import Backend
from maru.config import MaruConfig
from maru.errors import ConfigError, InvalidKeyError, ObjectTooLargeError, PluginError
from maru.log import get_logger
from maru.vllm.stats import SKIPPED_SECONDS, MaruConnectorStats

log = get_logger(__name__)

PERMANENT_ERRORS = (ConfigError, PluginError, InvalidKeyError, ObjectTooLargeError)
"""Store errors that retrying cannot fix: they turn the half off instead of backing off."""


class StoreGuard:
    """Opens the store lazily and keeps it out of the way for a while after errors."""

    def __init__(self, config: MaruConfig, half: str, stats: MaruConnectorStats) -> None:
        self.config = config
        self.half = half
        """Which half ("scheduler" or "worker"), for the logs."""
        self.stats = stats
        self._store: Backend | None = None
        self._retry_at = 0.0
        self.disabled = False

    def available(self) -> Backend | None:
        """The store, or None while backing off after an error or once disabled."""
        if self.disabled or time.monotonic() < self._retry_at:
            return None
        if self._store is None:
            try:
                self._store = maru.open_store(self.config)
            except Exception as exc:
                self.failed(exc)
                return None
        return self._store

    def failed(self, exc: BaseException) -> None:
        """Note an error: skip the store for `error_backoff` seconds, or for good if permanent."""
        if isinstance(exc, PERMANENT_ERRORS):
            self.disable(
                f"the {self.config.backend} store cannot work as configured: "
                f"{type(exc).__name__}: {exc}"
            )
            return
        log.warning(
            "maru store error, skipping it for %.0f s: %s: %s",
            self.config.error_backoff,
            type(exc).__name__,
            exc,
        )
        self._retry_at = time.monotonic() + self.config.error_backoff
        self.stats.add(SKIPPED_SECONDS, self.config.error_backoff)

    def disable(self, reason: str) -> None:
        """Stop using the store until restart, saying why once."""
        if not self.disabled:
            self.disabled = True
            log.error(
                "maru: %s; the connector's %s half is off (vLLM computes everything "
                "itself) until restart",
                reason,
                self.half,
            )

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
