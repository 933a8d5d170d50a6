"""`maru demo`: two serving instances share the KV cache of a common prompt prefix.

Instance A, a process of its own, "prefills" a prompt and stores one object per
chunk, then exits; instance B gets a prompt with the same prefix, finds the
longest stored prefix in one batched lookup, loads those chunks and only
computes the rest.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import time
from typing import Any

import numpy as np

import maru

CHUNK_TOKENS = 256
PAGE_BYTES_PER_TOKEN = 2 * 8 * 128 * 2 * 4  # K+V, 8 heads, head size 128, bf16, 4 layers


def chunk_keys(tokens: list[int], namespace: str) -> list[bytes]:
    """Chained keys: each chunk's key covers every token before it."""
    keys, parent = [], hashlib.sha256(namespace.encode()).digest()
    for start in range(0, len(tokens) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
        chunk = np.asarray(tokens[start : start + CHUNK_TOKENS], dtype=np.int64).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


def fake_kv(key: bytes) -> np.ndarray:
    """Deterministic KV pages for a chunk, standing in for a model's prefill."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 255, CHUNK_TOKENS * PAGE_BYTES_PER_TOKEN, dtype=np.uint8)


def prefill_and_store(store: maru.Backend, tokens: list[int], namespace: str) -> int:
    """Instance A: compute every chunk and store it; the number stored."""
    stored = 0
    for key in chunk_keys(tokens, namespace):
        kv = fake_kv(key)
        with store.reserve(key, kv.nbytes) as buffer:
            if buffer is not None:
                buffer[:] = kv.data
                stored += 1
    return stored


def load_prefix(store: maru.Backend, tokens: list[int], namespace: str) -> dict[str, Any]:
    """Instance B: load the longest stored prefix, then check every byte."""
    keys = chunk_keys(tokens, namespace)
    started = time.perf_counter()
    found = store.contains(keys)
    hit = found.index(False) if False in found else len(found)
    pages = [np.empty(CHUNK_TOKENS * PAGE_BYTES_PER_TOKEN, dtype=np.uint8) for _ in range(hit)]
    loaded = [store.get_into(key, page) is not None for key, page in zip(keys, pages, strict=False)]
    hit = loaded.index(False) if False in loaded else hit
    seconds = time.perf_counter() - started
    identical = all(
        np.array_equal(page, fake_kv(key)) for key, page in zip(keys, pages[:hit], strict=False)
    )
    return {
        "prompt_tokens": len(tokens),
        "hit_tokens": hit * CHUNK_TOKENS,
        "load_seconds": seconds,
        "identical": identical,
    }


def _prompts() -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(0)
    system_prompt = rng.integers(0, 32000, 8 * CHUNK_TOKENS).tolist()
    return (
        system_prompt + rng.integers(0, 32000, 300).tolist(),
        system_prompt + rng.integers(0, 32000, 500).tolist(),
    )


def _instance_a(config: maru.MaruConfig) -> int:
    with maru.open_store(config) as store:
        return prefill_and_store(store, _prompts()[0], config.namespace)


def run_demo(config: maru.MaruConfig) -> dict[str, Any]:
    """Instance A runs in a process of its own, instance B in this one; B's report."""
    with multiprocessing.get_context("spawn").Pool(1) as instance_a:
        stored = instance_a.apply(_instance_a, (config,))
    with maru.open_store(config) as instance_b:
        report = load_prefix(instance_b, _prompts()[1], config.namespace)
        report.update(
            backend=config.backend, chunks_stored=stored, stats=instance_b.stats().as_dict()
        )
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as lines for people."""
    return "\n".join(
        [
            f"backend: {report['backend']}",
            f"instance A stored {report['chunks_stored']} chunks of {CHUNK_TOKENS} tokens",
            f"instance B: {report['hit_tokens']} of {report['prompt_tokens']} prompt tokens loaded "
            f"from maru in {report['load_seconds'] * 1e3:.1f} ms",
            f"loaded KV identical to a fresh prefill: {report['identical']}",
            "store: " + ", ".join(f"{k}={v}" for k, v in report["stats"].items()),
        ]
    )
