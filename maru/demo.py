"""`maru demo`: two real vLLM engines, in two processes, share a long prompt's KV.

Engine A prefills a long prompt and stores its KV in maru (the embedded shm
pool by default). Engine B, a separate process, gets the same prompt: it loads
the prefix from maru instead of computing it. The demo prints both times to
first token, how many tokens B loaded, whether the outputs are identical, and
the pool's statistics.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import maru

DEMO_MODEL = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64,
              "intermediate": 1408, "vocab": 4096}
"""Big enough that prefill, not start-up noise, dominates the time to first token."""


def model_cache() -> Path:
    """Where demo and benchmark models are kept between runs."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "maru" / "models"


def connector_config(config: maru.MaruConfig) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for MaruKVConnector with this maru config."""
    extra = config.model_dump(mode="json", exclude_none=True, exclude={"config_file"})
    return {"kv_connector": "MaruKVConnector", "kv_connector_module_path": "maru.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}




def run_demo(config: maru.MaruConfig, *, model: Path | None = None, prompt_tokens: int = 2000,
             vocab: int = DEMO_MODEL["vocab"],
             progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Engine A then engine B on one long (random, so never seen before) prompt."""
    from maru.engine import build_tiny_llama, run_engine

    if model is None:
        model = model_cache() / "demo-llama"
        progress(f"demo model: {model} (random weights, built on first use) ...")
        build_tiny_llama(model, **DEMO_MODEL)
    prompt = np.random.default_rng().integers(1, vocab, prompt_tokens).tolist()
    transfer = connector_config(config)
    log = model_cache().parent / "demo-engines.log"
    progress(f"engine A (its own process): prefilling the prompt, storing its KV in maru "
             f"(engine logs: {log}) ...")
    engine_a = run_engine(model, [prompt], kv_transfer_config=transfer, max_tokens=16,
                          log_path=log)
    progress("engine B (another process): same prompt, loading its KV from maru ...")
    engine_b = run_engine(model, [prompt], kv_transfer_config=transfer, max_tokens=16,
                          log_path=log)
    with maru.open_store(config) as store:
        stats = store.stats().as_dict()
    return {
        "backend": config.backend,
        "prompt_tokens": prompt_tokens,
        "ttft_cold_s": engine_a.ttft_s[0],
        "ttft_hit_s": engine_b.ttft_s[0],
        "tokens_loaded": engine_b.external_cached_tokens[0],
        "identical": engine_a.token_ids == engine_b.token_ids,
        "stats": stats,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as lines for people."""
    cold, hit = report["ttft_cold_s"], report["ttft_hit_s"]
    return "\n".join([
        f"prompt: {report['prompt_tokens']} tokens, backend {report['backend']}",
        f"engine A (cold prefill)   time to first token {cold * 1e3:8.1f} ms",
        f"engine B (maru hit)       time to first token {hit * 1e3:8.1f} ms "
        f"({cold / hit:.1f}x faster)",
        f"tokens engine B loaded from maru: {report['tokens_loaded']}",
        f"outputs identical: {report['identical']}",
        "pool: " + ", ".join(f"{k}={v}" for k, v in report["stats"].items()),
    ])
