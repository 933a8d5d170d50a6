"""Maru: a pluggable KV-cache store for vLLM.

import maru
cfg = maru.load_config("maru.yaml")      # or maru.load_config(backend="shm", ...)
with maru.open_store(cfg) as store:
    store.put(b"key", b"value")
"""

from __future__ import annotations

from typing import Any

from maru.backends.base import Backend, StoreStats
from maru.backends.registry import backend_class
from maru.config import MaruConfig, load_config
from maru.errors import (
    BackendError,
    BufferTooSmallError,
    ConfigError,
    InvalidKeyError,
    MaruError,
    ObjectTooLargeError,
    PluginError,
    UnsupportedOperationError,
)
from maru.hookspecs import hookimpl

__all__ = [
    "Backend",
    "BackendError",
    "BufferTooSmallError",
    "ConfigError",
    "InvalidKeyError",
    "MaruConfig",
    "MaruError",
    "ObjectTooLargeError",
    "PluginError",
    "StoreStats",
    "UnsupportedOperationError",
    "hookimpl",
    "load_config",
    "open_store",
]


def open_store(config: MaruConfig | None = None, **overrides: Any) -> Backend:
    """Open the backend named by `config.backend` (or by `load_config(**overrides)`)."""
    if config is None:
        config = load_config(**overrides)
    elif overrides:
        raise TypeError("pass either a config or keyword overrides, not both")
    return backend_class(config.backend)(config)
