"""maru's connector under its own name in vLLM's connector factory.

vLLM loads the `vllm.general_plugins` entry points in every process it starts (engine
core, API server, workers), so `"kv_connector": "MaruKVConnector"` works without
`kv_connector_module_path`, and vLLM can rebuild maru's stats by class name wherever it
needs to (MultiConnector does, in the frontend process, which never imports
`maru.connector`).
"""

from __future__ import annotations

import contextlib

CONNECTOR = "MaruKVConnector"
MODULE = "maru.connector"


def register() -> None:
    """Register the connector, once per process (vLLM may call this more than once)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # registered already, by an earlier call
        KVConnectorFactory.register_connector(CONNECTOR, MODULE, CONNECTOR)
