"""`maru demo`: two real vLLM engines, in two processes, share a long prompt's KV.

Engine A prefills a long prompt and stores its KV in maru (the embedded shm
pool by default), then runs the prompt again, which vLLM serves from its own
prefix cache. Engine B, a separate process, gets the same prompt: it loads the
prefix from maru instead of computing it. The demo prints the times to first
token, how many tokens B loaded, and whether B's output is identical to A's
own prefix-cache hit: the same KV bytes and the same hit length, so the only
difference is where the KV came from. Each engine runs a short prompt of its own
first, so no timed request is an engine's first. (Compared with A's cold prefill
instead, a bf16 model may differ in low bits from other batch shapes: not a maru
fault.)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import maru
from maru.backends.registry import backend_class
from maru.cli import demo_remote
from maru.cli.command import EXIT_FAILURE, EXIT_OK, Result, add_config_option
from maru.config import resolve_config
from maru.errors import ConfigError

DEMO_MODEL = {
    "layers": 4,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 4,
    "head_dim": 64,
    "intermediate": 1408,
    "vocab": 4096,
}
"""Big enough that prefill, not start-up noise, dominates the time to first token."""


def model_cache() -> Path:
    """Where demo and benchmark models are kept between runs."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "maru" / "models"


WARM_UP_TOKENS = 24
"""An engine's first prompt, random and shorter than a block (32 tokens), so it stores
and loads nothing: it takes vLLM's one-time costs of a first request (11-18 ms more
than a later one's on the 2-core EPYC, in an engine without maru), which vLLM's own
prefix-cache hit, never an engine's first request, does not pay."""


def warm_up_prompt(rng: np.random.Generator, vocab: int) -> list[int]:
    """A prompt of `WARM_UP_TOKENS` random tokens."""
    return rng.integers(1, vocab, WARM_UP_TOKENS).tolist()


DEMO_POOL_CAPACITY = 256 * 2**20
"""The demo's own pool when nothing is configured: its KV is a few MiB."""


def private_pool(config: maru.MaruConfig) -> maru.MaruConfig:
    """The default configuration with a small store of the demo's own (`private_options`
    of the default backend): the demo then leaves no pool behind (a default pool keeps
    4 GiB of memory until destroyed)."""
    options = backend_class(config.backend).private_options(f"demo-{os.getpid()}", False)
    return maru.MaruConfig.model_validate(
        {**config.model_dump(), "capacity": DEMO_POOL_CAPACITY, config.backend: options}
    )


def connector_config(config: maru.MaruConfig) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for MaruKVConnector with this maru config."""
    return {
        "kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": config.portable(),
    }


def demo_prompt_tokens(requested: int, chunk_tokens: int) -> int:
    """The longest prompt of at most `requested` tokens that is whole chunks plus one
    token, so that maru's hit and vLLM's own hit both leave exactly the last token to
    compute."""
    chunks = (requested - 1) // chunk_tokens
    if chunks < 1:
        raise ConfigError(
            f"prompt_tokens = {requested}: too short to share a chunk; allowed: "
            f"at least chunk_tokens + 1 = {chunk_tokens + 1}"
        )
    return chunks * chunk_tokens + 1


def run_demo(
    config: maru.MaruConfig,
    *,
    model: Path | None = None,
    prompt_tokens: int = 2049,
    vocab: int = DEMO_MODEL["vocab"],
    progress: Callable[[str], None] = lambda line: None,
    after_engine_a: Callable[[], None] = lambda: None,
    node_b: maru.MaruConfig | None = None,
) -> dict[str, Any]:
    """Engine A (cold, then its own cache) and engine B (maru) on one random prompt: A's
    store is `config`, B's is `node_b` (another node's) or the same.

    `after_engine_a` runs between the two engines (tests corrupt the store there)."""
    from maru.cli._engine import start_engine
    from maru.cli._tiny_model import build_tiny_llama

    length = demo_prompt_tokens(prompt_tokens, config.chunk_tokens)
    if model is None:
        model = model_cache() / "demo-llama"
        progress(f"demo model: {model} (random weights, built on first use) ...")
        build_tiny_llama(model, **DEMO_MODEL)
    rng = np.random.default_rng()
    prompt = rng.integers(1, vocab, length).tolist()
    options = {
        "max_tokens": 16,
        "held": True,
        "log_path": model_cache().parent / "demo-engines.log",
    }
    progress(
        f"starting engines A and B, two processes, side by side (engine logs: "
        f"{options['log_path']}) ..."
    )
    engines = (
        start_engine(
            model,
            [warm_up_prompt(rng, vocab), prompt, prompt],
            kv_transfer_config=connector_config(config),
            **options,
        ),
        start_engine(
            model,
            [warm_up_prompt(rng, vocab), prompt],
            kv_transfer_config=connector_config(node_b or config),
            **options,
        ),
    )
    try:
        for engine in engines:
            engine.wait_built()
        progress(
            "engine A: prefilling the prompt, storing its KV in maru, then the prompt "
            "again from vLLM's own cache ..."
        )
        engine_a = engines[0].result()
        after_engine_a()
        progress("engine B: same prompt, loading its KV from maru ...")
        engine_b = engines[1].result()
    finally:
        for engine in engines:
            engine.stop()
    with maru.open_store(config) as store:
        stats = store.stats().as_dict()
    loaded, own_hit = engine_b.external_cached_tokens[1], engine_a.num_cached_tokens[2]
    return {
        "backend": config.backend,
        "prompt_tokens": length,
        "ttft_cold_s": engine_a.ttft_s[1],
        "ttft_own_hit_s": engine_a.ttft_s[2],
        "ttft_hit_s": engine_b.ttft_s[1],
        "ttft_warm_up_s": [engine_a.ttft_s[0], engine_b.ttft_s[0]],
        "tokens_loaded": loaded,
        "loaded_from_slow_tier": slow_tier_load(engine_b.extra["connector_totals"]),
        "own_hit_tokens": own_hit,
        "identical": loaded == own_hit and engine_b.token_ids[1] == engine_a.token_ids[2],
        "stats": stats,
    }


def slow_tier_load(totals: dict[str, float]) -> str | None:
    """How engine B's hit came from a slow tier, if it did: staged by its scheduler into
    its pool (`maru.vllm.staging`), or read in its worker's background."""
    if totals.get("staged_tokens", 0) > 0:
        return "read into B's pool before vLLM scheduled it"
    return "in the background" if totals.get("background_loads", 0) > 0 else None


def format_report(report: dict[str, Any]) -> str:
    """The report as lines for people."""
    cold, own, hit = report["ttft_cold_s"], report["ttft_own_hit_s"], report["ttft_hit_s"]
    warm_a, warm_b = report["ttft_warm_up_s"]
    return "\n".join(
        [
            f"prompt: {report['prompt_tokens']} tokens, backend {report['backend']}",
            f"engine A (cold prefill)       time to first token {cold * 1e3:8.1f} ms",
            f"engine A again (vLLM's cache) time to first token {own * 1e3:8.1f} ms "
            f"({report['own_hit_tokens']} tokens cached)",
            f"engine B (maru hit)           time to first token {hit * 1e3:8.1f} ms "
            f"({cold / hit:.1f}x faster than cold)",
            f"tokens engine B loaded from maru: {report['tokens_loaded']}"
            + (
                f" (from a slow tier, {report['loaded_from_slow_tier']})"
                if report["loaded_from_slow_tier"]
                else ""
            ),
            f"each engine's first request (before these, {WARM_UP_TOKENS} tokens of its own: "
            f"one-time costs): A {warm_a * 1e3:.1f} ms, B {warm_b * 1e3:.1f} ms",
            f"outputs identical (engine B's maru hit vs engine A's own cache hit): "
            f"{report['identical']}",
            "pool: " + ", ".join(f"{k}={v}" for k, v in report["stats"].items()),
        ]
    )


def cmd_demo(args: argparse.Namespace) -> Result:
    """Two vLLM engines in two processes share a long prompt's KV through maru."""
    resolved = resolve_config(args.config)
    if args.remote:
        return remote_demo(resolved.config, args.prompt_tokens)
    configured = bool(resolved.sources)
    config = resolved.config if configured else private_pool(resolved.config)
    try:
        report = run_demo(config, prompt_tokens=args.prompt_tokens, progress=say)
    finally:
        if not configured:
            with maru.open_store(config) as store:
                store.destroy()
    return result_of(report)


def remote_demo(config: maru.MaruConfig, prompt_tokens: int) -> Result:
    """Engines A and B as two nodes, each with its own pool, sharing a Redis server."""
    with demo_remote.redis_url(config) as url:
        say(f"engines A and B are two nodes: a shm pool each, sharing Redis at {url}")
        nodes = tuple(
            demo_remote.node(config, name, url, DEMO_POOL_CAPACITY) for name in ("a", "b")
        )
        try:
            report = run_demo(
                nodes[0],
                prompt_tokens=prompt_tokens,
                progress=say,
                after_engine_a=lambda: demo_remote.wait_until_copied(nodes[0], say),
                node_b=nodes[1],
            )
        finally:
            demo_remote.clean_up(nodes)
    return result_of(report)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def result_of(report: dict[str, Any]) -> Result:
    return Result(report, format_report(report), EXIT_OK if report["identical"] else EXIT_FAILURE)


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """`maru demo`."""
    demo = commands.add_parser("demo", parents=[common], help="share a prompt prefix's KV")
    add_config_option(demo)
    demo.add_argument(
        "--prompt-tokens",
        type=int,
        default=2049,
        metavar="N",
        help="length of the shared prompt, rounded down to whole chunks plus "
        "one token (default 2049)",
    )
    demo.add_argument(
        "--remote",
        choices=demo_remote.REMOTES,
        help="run A and B as two nodes, each with a shm pool of its own, sharing only this "
        "remote store (the configured one, else a private server on loopback)",
    )
    demo.set_defaults(run=cmd_demo)
