"""This instance's key namespace: what its digest covers, its key prefix, its record.

The digest covers everything that changes a chunk's bytes (`maru.vllm.identity`), the
workers' KV layout included, so the namespace is known only once a worker has said its
layout (its handshake, or the per-connector worker channel). Its record is kept in the
store beside its objects (`maru.vllm.records`).
"""

from __future__ import annotations

import time
from typing import Any

from maru.backends.base import Backend
from maru.config import MaruConfig
from maru.errors import MaruError
from maru.log import get_logger
from maru.vllm import keys
from maru.vllm.identity import kv_identity, model_identity, namespace_record
from maru.vllm.records import say_how_peers_differ, write_record

log = get_logger(__name__)

RECORD_REFRESH_S = 60.0
"""How often an active instance refreshes its namespace record's time of activity."""
UNKNOWN_LAYOUT = "unknown"
"""The layout before a worker has said its own: no namespace yet."""


class Namespace:
    """The namespace of one scheduler half, over its KV cache groups' signatures."""

    def __init__(self, vllm_config: Any, config: MaruConfig, group_signatures: list[str]):
        self._vllm_config = vllm_config
        self._config = config
        self._groups = group_signatures
        model = vllm_config.model_config
        self.model_identity = model_identity(model.model, model.revision)
        log.info("maru: model %s is %s in the key namespace", model.model, self.model_identity)
        self.layout = UNKNOWN_LAYOUT
        self._waited_for_layout = False
        self._prefix: bytes | None = None
        self._record_at = -RECORD_REFRESH_S

    @property
    def known(self) -> bool:
        """Has a worker said its layout (else no key can be made)? Says so, once, if not."""
        if self.layout != UNKNOWN_LAYOUT:
            return True
        if not self._waited_for_layout:
            self._waited_for_layout = True
            log.warning(
                "maru: no worker has said its KV layout yet (behind another connector on a "
                "vLLM without a per-connector worker channel it never will); no lookups or "
                "saves until one does"
            )
        return False

    def set_layout(self, layout: str) -> None:
        if layout != self.layout:
            self.layout = layout
            self._prefix = None

    def identity(self) -> dict[str, Any]:
        """What the digest covers (`maru.vllm.identity.kv_identity`)."""
        return kv_identity(
            self._vllm_config, self._config, self.layout, self.model_identity, self._groups
        )

    def prefix(self) -> bytes:
        """The key prefix of every object this instance loads and saves."""
        if self._prefix is None:
            digest = keys.identity_digest(self.identity())
            self._prefix = keys.namespace_prefix(self._config.namespace, digest)
            self._record_at = -RECORD_REFRESH_S
        return self._prefix

    def record(self) -> dict[str, Any]:
        """This namespace's record (`maru.vllm.records`)."""
        return namespace_record(self._vllm_config, self._config, self.identity())

    def keep_record(self, store: Backend) -> None:
        """Write the record once the layout is known, then refresh its time of activity
        at most every RECORD_REFRESH_S; the first time, say how namespaces of the same
        model in the store differ from this one."""
        if self.layout == UNKNOWN_LAYOUT or time.monotonic() - self._record_at < RECORD_REFRESH_S:
            return
        first = self._record_at < 0
        self._record_at = time.monotonic()
        prefix, record = self.prefix(), self.record()
        try:
            if first:
                this = keys.parse_key(keys.record_key(prefix)).namespace
                say_how_peers_differ(store, this, record)
        except MaruError as exc:  # e.g. a backend that cannot list its keys
            log.debug("maru: namespaces in the store not compared: %s", exc)
        try:
            write_record(store, prefix, record)
        except MaruError as exc:
            log.debug("maru: namespace record not kept: %s", exc)
