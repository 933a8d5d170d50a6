"""Maru's configuration: one pydantic model (`model`), loaded from arguments, vLLM's
extra config, the environment and a file (`sources`).

Precedence, highest first: explicit arguments > vLLM ``kv_connector_extra_config``
> ``MARU_*`` environment variables > a YAML/TOML/JSON file (``config_file`` or
``MARU_CONFIG``) > defaults. Each backend's options live in a section named after
the backend and are validated by that backend's own ``Options`` model.
"""

from __future__ import annotations

from maru.config.model import (
    BACKENDS_CONTEXT,
    MaruConfig,
    Options,
    config_error,
    leaves,
    shown_value,
    source_of,
)
from maru.config.sources import ResolvedConfig, load_config, read_config_file, resolve_config
from maru.sizes import Size

__all__ = [
    "BACKENDS_CONTEXT",
    "MaruConfig",
    "Options",
    "ResolvedConfig",
    "Size",
    "config_error",
    "leaves",
    "load_config",
    "read_config_file",
    "resolve_config",
    "shown_value",
    "source_of",
]
