"""Two nodes that share nothing but a Redis server, online: maru's remote hits, and
LMCache's on the same Redis in the same run.

Each node is a `vllm serve` process with a local tier of its own in front of one
private redis-server on loopback: for maru a shm pool of its own (`tiered: [shm,
redis]`, maru's defaults), for LMCache a multiprocess server of its own whose L1 sits
in front of the same Redis through its RESP L2 adapter (LMCache's native Redis client;
the settings `online_serve.py` measured best on this CPU, `--lmcache-workers` I/O
threads). Node A serves `--rounds` sets of prompts cold, storing them; node B, which
has never seen them, serves each set once from the remote tier (its own tier does not
hold that set yet), then again (its own prefix-cache hits). The client is `vllm bench
serve` as in `online_serve.py` (vLLM's prefix-repetition prompts, a tiny float32 model).

Reported: median time to first token of A's cold passes, B's remote hits and B's own
hits; the remote hit over the cold prompt, and over B's own hit plus one transfer of
the hit's bytes over the link (a plain socket transfer between two processes on
loopback, measured in the same run: the issue's bound is 1.25); maru's remote hit over
LMCache's; node B's counters; whether every output equals node A's cold output for the
same prompts. The record (`--json`) is stamped with commit, machine and versions.
`python benchmarks/two_nodes.py --help`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import redis
from online_serve import MODEL, OPTIONS, bench, lmcache_server
from remote_loads import write_record

import maru
from maru.cli._redis_server import RedisServer
from maru.cli._serve import counter, serve
from maru.cli._tiny_model import add_word_tokenizer, build_tiny_llama
from maru.cli.demo import model_cache
from maru.cli.link_baseline import LinkBaseline

COUNTERS = {
    "maru": (
        "vllm:maru_hit_tokens_total",
        "vllm:maru_chunks_loaded_in_background_total",
        "vllm:maru_staged_hit_tokens_total",
        "vllm:maru_slow_hit_tokens_recomputed_total",
        "vllm:external_prefix_cache_hits_total",
    ),
    "lmcache": ("vllm:external_prefix_cache_hits_total",),
}
FIRST_SEED = 100
"""Round r's prompts are drawn with seed FIRST_SEED + r; the warm-ups with 1 and 2."""
SETTLED_S = 2.0
"""Redis holds all of node A's copies once its key count has not changed for this long."""
SETTLE_LIMIT_S = 120.0


def maru_nodes(redis_url: str, run: str) -> list[dict[str, Any]]:
    """The two nodes' connector configs: a shm pool each, one Redis."""
    return [
        {
            "kv_connector": "MaruKVConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "backend": "tiered",
                "capacity": "1GiB",
                "tiered": {"tiers": ["shm", "redis"]},
                "shm": {"name": f"{run}-{node}"},
                "redis": {"url": redis_url, "key_prefix": f"{run}:"},
            },
        }
        for node in ("a", "b")
    ]


@contextmanager
def lmcache_nodes(venv: Path, chunk_tokens: int, workers: int, port: int) -> Iterator[list[dict]]:
    """Two LMCache multiprocess servers, each with Redis as its L2; their connector
    configs."""
    resp = {"type": "resp", "host": "127.0.0.1", "port": port, "num_workers": workers}
    adapter = json.dumps(resp)
    with ExitStack() as stack:
        ports = [
            stack.enter_context(
                lmcache_server(venv, chunk_tokens, f"two-nodes-{node}", "--l2-adapter", adapter)
            )
            for node in ("a", "b")
        ]
        yield [
            {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1",
                    "lmcache.mp.port": port,
                },
            }
            for port in ports
        ]


def two_nodes(
    vllm: Path,
    nodes: list[dict],
    args: argparse.Namespace,
    out: Path,
    store: str,
    settled: Callable[[], None],
) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Node A serves every round's prompts cold; once Redis holds them, node B serves
    each round's from the remote tier, then again (its own hits). The passes by kind
    (lists indexed by round) and node B's counters over its remote passes."""
    logs = model_cache().parent
    passes: dict[str, list[dict]] = {"cold": [], "remote_hit": [], "own_hit": []}

    def run(url: str, node: str, name: str, seed: int) -> dict:
        print(f"{store} node {node}: {name} ...", file=sys.stderr, flush=True)
        return bench(url, args.model, args, out / f"{store}-{node}-{name}.json", seed)

    with serve(args.model, logs / f"bench-two-nodes-{store}-a.log", nodes[0], OPTIONS, vllm) as url:
        run(url, "a", "warm-up", seed=1)
        for round_ in range(args.rounds):
            passes["cold"].append(run(url, "a", f"cold {round_}", FIRST_SEED + round_))
    settled()
    counters = dict.fromkeys(COUNTERS[store], 0.0)
    with serve(args.model, logs / f"bench-two-nodes-{store}-b.log", nodes[1], OPTIONS, vllm) as url:
        run(url, "b", "warm-up", seed=2)
        for round_ in range(args.rounds):
            before = {name: counter(url, name) for name in counters}
            passes["remote_hit"].append(run(url, "b", f"remote {round_}", FIRST_SEED + round_))
            for name in counters:
                counters[name] += counter(url, name) - before[name]
            passes["own_hit"].append(run(url, "b", f"own {round_}", FIRST_SEED + round_))
    return passes, counters


def settle(client: redis.Redis) -> Callable[[], None]:
    """A wait until the server's key count has stopped changing (the nodes write their
    copies in the background)."""

    def wait() -> None:
        last, since, deadline = -1, time.monotonic(), time.monotonic() + SETTLE_LIMIT_S
        while time.monotonic() < deadline:
            keys = client.dbsize()
            if keys != last:
                last, since = keys, time.monotonic()
            elif keys and time.monotonic() - since >= SETTLED_S:
                return
            time.sleep(0.2)
        raise RuntimeError(f"Redis's key count did not settle in {SETTLE_LIMIT_S:g} s")

    return wait


def link_seconds(nbytes: int, repeats: int = 20) -> float:
    """The median time to receive `nbytes` over a plain loopback socket from another
    process (the link's own cost of moving one hit's bytes)."""
    link = LinkBaseline("tcp", nbytes)
    buffer = bytearray(nbytes)
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            link.receive(buffer)
            times.append(time.perf_counter() - start)
    finally:
        link.close()
    return statistics.median(times)


def hit_bytes(args: argparse.Namespace) -> int:
    """Bytes of one prompt's stored prefix (float32 keys and values of every layer)."""
    per_token = MODEL["layers"] * 2 * MODEL["kv_heads"] * MODEL["head_dim"] * 4
    return args.prefix_tokens * per_token


def summary(
    passes: dict[str, dict[str, list[dict]]],
    counters: dict,
    link_s: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Medians of each kind's TTFTs, the ratios, and whether outputs match node A's cold
    pass of the same prompts."""
    ttfts = {
        f"{store}_{kind}": [t * 1e3 for r in runs for t in r["ttfts"]]
        for store, kinds in passes.items()
        for kind, runs in kinds.items()
    }
    ttft = {name: statistics.median(values) for name, values in ttfts.items()}
    ratios = {}
    for store in passes:
        ratios[f"{store} remote hit / cold"] = ttft[f"{store}_remote_hit"] / ttft[f"{store}_cold"]
        ratios[f"{store} remote hit / (own hit + link transfer)"] = ttft[f"{store}_remote_hit"] / (
            ttft[f"{store}_own_hit"] + link_s * 1e3
        )
    if "lmcache" in passes:
        ratios["maru remote hit / lmcache remote hit"] = (
            ttft["maru_remote_hit"] / ttft["lmcache_remote_hit"]
        )
    identical = {
        f"{store}_{kind}": all(
            run["generated_texts"] == cold["generated_texts"]
            for run, cold in zip(runs, kinds["cold"], strict=True)
        )
        for store, kinds in passes.items()
        for kind, runs in kinds.items()
        if kind != "cold"
    }
    return {
        "median_ttft_ms": ttft,
        "ttfts_ms": ttfts,
        "link_transfer_ms": link_s * 1e3,
        "hit_bytes": hit_bytes(args),
        "ratios": ratios,
        "node_b_metrics": counters,
        "outputs_identical": identical,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="per round, a prefix each")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=33)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="sets of prompts")
    parser.add_argument("--lmcache", type=Path, help="an environment with LMCache: compare")
    parser.add_argument("--lmcache-chunk-tokens", type=int, default=256)
    parser.add_argument("--lmcache-workers", type=int, default=8, help="its RESP I/O threads")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/two_nodes.json"))
    args = parser.parse_args(argv)
    args.model = add_word_tokenizer(
        build_tiny_llama(model_cache() / "bench-online-llama", **MODEL), MODEL["vocab"]
    )
    run = f"bench-two-nodes-{np.random.default_rng().integers(1 << 30)}"
    passes: dict[str, dict[str, list[dict]]] = {}
    counters: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="maru-two-nodes-") as folder:
        server = RedisServer(Path(folder) / "redis", "--maxmemory-policy", "allkeys-lru").start()
        client = redis.Redis(port=server.port, socket_timeout=10)
        try:
            vllm = Path(sys.executable).parent / "vllm"
            nodes = maru_nodes(server.url, run)
            try:
                passes["maru"], counters["maru"] = two_nodes(
                    vllm, nodes, args, Path(folder), "maru", settle(client)
                )
            finally:
                for node in nodes:
                    extra = node["kv_connector_extra_config"]
                    config = maru.load_config(backend="shm", capacity="1GiB", shm=extra["shm"])
                    with maru.open_store(config) as pool:
                        pool.destroy()
            if args.lmcache:
                client.flushall()
                with lmcache_nodes(
                    args.lmcache, args.lmcache_chunk_tokens, args.lmcache_workers, server.port
                ) as lmcache:
                    passes["lmcache"], counters["lmcache"] = two_nodes(
                        args.lmcache / "bin" / "vllm",
                        lmcache,
                        args,
                        Path(folder),
                        "lmcache",
                        settle(client),
                    )
        finally:
            client.close()
            server.stop()
    report = summary(passes, counters, link_seconds(hit_bytes(args)), args)
    print(
        f"{args.rounds} rounds of {args.prompts} prompts of {args.prefix_tokens} + "
        f"{args.suffix_tokens} tokens, concurrency {args.concurrency}; median TTFT:"
    )
    for name, value in report["median_ttft_ms"].items():
        print(f"  {name:<20} {value:8.1f} ms")
    print(
        f"one hit's bytes ({report['hit_bytes'] / 2**20:.1f} MiB) over the link: "
        f"{report['link_transfer_ms']:.2f} ms"
    )
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.2f}")
    print(f"node B's /metrics during its remote passes: {counters}")
    print(f"outputs identical to node A's cold pass: {report['outputs_identical']}")
    write_record("two_nodes", args, report)
    return 0 if all(report["outputs_identical"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
