"""One logger tree for maru: `vllm.maru.*`.

Everything maru does inside a vLLM process (the connector, the data path, the store's
tiers) logs under vLLM's own logger, so vLLM's log configuration shows maru's lines
beside its own and silences them with its own.
"""

from __future__ import annotations

import logging

ROOT = "vllm.maru"


def get_logger(module: str) -> logging.Logger:
    """The logger of a maru module (`__name__`): `maru.backends.tiered` logs as
    `vllm.maru.backends.tiered`, `maru.vllm.worker` as `vllm.maru.worker`."""
    for package in ("maru.vllm", "maru"):
        if module == package or module.startswith(package + "."):
            module = module[len(package) :]
            break
    return logging.getLogger(ROOT + module)
