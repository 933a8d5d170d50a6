"""Online: two `vllm serve` processes on one shm pool, measured by vLLM's own client.

Server 1 (maru on a new pool) serves the prompts cold, then again: its own
prefix-cache hits. Server 2, a new process on the same pool that has never seen the
prompts, serves them from maru, then again (its own hits), for `--rounds` rounds,
its own prefix cache emptied before each (vLLM's /reset_prefix_cache; maru keeps
them): one server's maru hits and own hits, interleaved, so the machine's drift
touches both alike. The client is `vllm bench serve` with vLLM's prefix-repetition
dataset (distinct prefixes plus a suffix each, so prompts end mid-chunk), a fixed
seed, concurrency 4, on a tiny float32 model with a word-level tokenizer (text
round-trips to the same token ids). Each server first serves a pass of prompts of
its own (its first forwards; they share nothing with the measured ones).

Reported: the median time to first token and between output tokens (a decode step's
cost: what a connector adds to every step shows there) over every request of a kind,
maru hit over own hit, server 2's counters from /metrics in its maru passes, and
whether every pass's outputs equal the cold pass's request by request.

With `--lmcache VENV` (`.venv-lmcache`, which `make bench` builds), the same again
with LMCache's multiprocess server and vLLM's LMCacheMPConnector in place of maru, in
the same run. With `--busy`, another process keeps one core busy meanwhile.
`python benchmarks/online_serve.py --help`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from hit_cost import add_omp_wait_policy, competing_load, policy_shown, set_omp_wait_policy

import maru
from maru.cli._serve import counter, free_port, running, serve
from maru.cli._tiny_model import add_word_tokenizer, build_tiny_llama
from maru.cli.demo import model_cache

MODEL = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64, "vocab": 2048}
COUNTERS = {
    "maru": (
        "vllm:maru_hit_tokens_total",
        "vllm:maru_chunks_loaded_total",
        "vllm:maru_lookups_total",
        "vllm:maru_loaded_bytes_total",
        "vllm:maru_load_seconds_sum",
        "vllm:external_prefix_cache_hits_total",
    ),
    "lmcache": ("vllm:external_prefix_cache_hits_total",),
}
OPTIONS = [
    "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
    "--block-size", "32", "--kv-cache-memory-bytes", str(1 << 30),
]  # fmt: skip
LMCACHE_SERVER = [
    "--l1-size-gb", "1", "--eviction-policy", "LRU", "--max-workers", "1",
    "--supported-transfer-mode", "auto", "--disable-observability",
]  # fmt: skip
"""LMCache for this CPU: engine-driven transfers (its CPU path: the engine copies
through shared memory; the server's default, LMCache-driven, is for GPUs), one worker
thread per pool (two cores), an L1 of the size of maru's pool; `--lmcache-chunk-tokens`
picks its chunk size."""


def bench(url: str, model: Path, args: argparse.Namespace, out: Path, seed: int = 0) -> dict:
    """One `vllm bench serve` pass (its prompts drawn with `seed`); its detailed result."""
    command = [
        str(Path(sys.executable).parent / "vllm"), "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--model", str(model),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_tokens),
        "--prefix-repetition-suffix-len", str(args.suffix_tokens),
        "--prefix-repetition-num-prefixes", str(args.prompts),
        "--prefix-repetition-output-len", "8",
        "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
        "--seed", str(seed), "--ignore-eos", "--temperature", "0", "--num-warmups", "0",
        "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"vllm bench serve failed: {done.stderr[-4000:]}")
    return json.loads(out.read_text())


def pair(
    vllm: Path, transfer: dict, args: argparse.Namespace, out: Path, store: str
) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Server 1 serves the prompts cold, then again (its own hits). Server 2, new, serves
    them from the store, then again (its own hits), round after round, its own prefix
    cache emptied before each (the store keeps them): the same server's hits of both
    kinds, interleaved, so the machine's drift touches both alike. Every pass (named
    without the store), and server 2's counters during its store passes."""
    logs = model_cache().parent
    passes: dict[str, list[dict]] = {"cold": [], "own_hit": [], "store_hit": [], "own_hit_2": []}

    def run(url: str, server: int, name: str, seed: int = 0) -> dict:
        print(f"{store} server {server}: {name} ...", file=sys.stderr, flush=True)
        return bench(url, args.model, args, out / f"{store}-{server}-{name}.json", seed)

    with serve(args.model, logs / f"bench-online-{store}-1.log", transfer, OPTIONS, vllm) as url:
        run(url, 1, "warm-up (prompts of its own)", seed=1)
        passes["cold"].append(run(url, 1, "cold"))
        passes["own_hit"].append(run(url, 1, "own_hit"))
    counters = dict.fromkeys(COUNTERS[store], 0.0)
    with serve(args.model, logs / f"bench-online-{store}-2.log", transfer, OPTIONS, vllm) as url:
        run(url, 2, "warm-up (prompts of its own)", seed=2)
        for round_ in range(1, args.rounds + 1):
            reset_prefix_cache(url)
            before = {name: counter(url, name) for name in counters}
            passes["store_hit"].append(run(url, 2, f"{store}_hit, round {round_}"))
            for name in counters:
                counters[name] += counter(url, name) - before[name]
            passes["own_hit_2"].append(run(url, 2, f"own_hit, round {round_}"))
    return passes, counters


def reset_prefix_cache(url: str) -> None:
    """Empty the server's own prefix cache (vLLM's dev endpoint; it says no while
    blocks are still held, so ask again)."""
    for _ in range(100):
        request = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            if json.load(response)["success"]:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} would not reset its prefix cache")


def measure_maru(args: argparse.Namespace, out: Path) -> tuple[dict[str, list[dict]], dict]:
    pool = f"bench-online-{np.random.default_rng().integers(1 << 30)}"
    extra = {"backend": "shm", "capacity": "1GiB", "shm": {"name": pool}}
    transfer = {
        "kv_connector": "MaruKVConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    try:
        passes, counters = pair(Path(sys.executable).parent / "vllm", transfer, args, out, "maru")
    finally:
        with maru.open_store(maru.load_config(**extra)) as store:
            store.destroy()
    return {name.replace("store_", "maru_"): runs for name, runs in passes.items()}, counters


@contextmanager
def lmcache_server(
    venv: Path, chunk_tokens: int, name: str = "online", *extra: str
) -> Iterator[int]:
    """LMCache's multiprocess server (`extra`: more of its options) on a free loopback
    port, once it accepts; its log is bench-`name`-lmcache-server.log."""
    port = free_port()
    log = model_cache().parent / f"bench-{name}-lmcache-server.log"
    command = [
        str(venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
        "--http-port", str(free_port()), "--chunk-size", str(chunk_tokens), *LMCACHE_SERVER,
        *extra,
    ]  # fmt: skip
    with running(command, log, lambda: accepts(port), "lmcache server"):
        yield port


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def measure_lmcache(args: argparse.Namespace, out: Path) -> tuple[dict[str, list[dict]], dict]:
    with lmcache_server(args.lmcache, args.lmcache_chunk_tokens) as port:
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}
        transfer = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        passes, counters = pair(args.lmcache / "bin" / "vllm", transfer, args, out, "lmcache")
    return {f"lmcache_{name.replace('store_', '')}": r for name, r in passes.items()}, counters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="each a prefix of its own")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=33)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--busy", action="store_true", help="keep one core busy meanwhile")
    add_omp_wait_policy(parser)
    parser.add_argument("--rounds", type=int, default=3, help="server 2's pairs of passes")
    parser.add_argument("--lmcache", type=Path, help="an environment with LMCache: compare")
    parser.add_argument(
        "--lmcache-chunk-tokens",
        type=int,
        default=256,
        help="LMCache's chunk size: 256 (its default) measured faster here than 32 (one "
        "block, the hit length of maru's and vLLM's own)",
    )
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/online.json"))
    args = parser.parse_args()
    args.omp_wait_policy = set_omp_wait_policy(args.omp_wait_policy)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the servers' /reset_prefix_cache
    args.model = add_word_tokenizer(
        build_tiny_llama(model_cache() / "bench-online-llama", **MODEL), MODEL["vocab"]
    )
    with tempfile.TemporaryDirectory() as results, competing_load(args.busy):
        passes, counters = measure_maru(args, Path(results))
        counters = {"maru": counters}
        if args.lmcache:
            lmcache_passes, counters["lmcache"] = measure_lmcache(args, Path(results))
            passes.update(lmcache_passes)
    report = summary(passes, counters, args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(
        f"{args.prompts} prompts of {args.prefix_tokens} + {args.suffix_tokens} tokens, "
        f"concurrency {args.concurrency}{', one core kept busy' if args.busy else ''}"
        f"{policy_shown(args.omp_wait_policy)}; "
        f"median time to first token:"
    )
    for name, value in report["median_ttft_ms"].items():
        itl = report["median_itl_ms"][name]
        print(f"  {name:<17} {value:8.1f} ms   (then {itl:5.1f} ms between output tokens)")
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.2f}")
    print(f"second servers' /metrics during their store passes: {counters}")
    print(f"outputs identical to maru's server 1 cold pass: {report['outputs_identical']}")
    print(f"written to {args.output}")
    return 0 if all(report["outputs_identical"].values()) else 1


def summary(passes: dict[str, list[dict]], counters: dict, args: argparse.Namespace) -> dict:
    """The report: medians over every request of a kind's passes (time to first token,
    and between output tokens: a decode step's cost), the ratios, every TTFT, the
    counters, and whether every pass's outputs equal the cold pass's."""
    ttfts = {name: [t * 1e3 for r in runs for t in r["ttfts"]] for name, runs in passes.items()}
    itls = {
        name: [t * 1e3 for r in runs for itl in r["itls"] for t in itl]
        for name, runs in passes.items()
    }
    ttft = {name: statistics.median(values) for name, values in ttfts.items()}
    ratios = {
        "maru hit / own hit (server 2)": ttft["maru_hit"] / ttft["own_hit_2"],
        "maru hit / own hit (server 1)": ttft["maru_hit"] / ttft["own_hit"],
        "maru hit / cold": ttft["maru_hit"] / ttft["cold"],
    }
    if "lmcache_hit" in ttft:
        ratios["lmcache hit / own hit (its server 2)"] = (
            ttft["lmcache_hit"] / ttft["lmcache_own_hit_2"]
        )
        ratios["maru hit / lmcache hit"] = ttft["maru_hit"] / ttft["lmcache_hit"]
    reference = passes["cold"][0]["generated_texts"]
    return {
        "median_ttft_ms": ttft,
        "median_itl_ms": {name: statistics.median(values) for name, values in itls.items()},
        "ratios": ratios,
        "ttfts_ms": ttfts,
        "second_server_metrics": counters,
        "outputs_identical": {
            name: all(r["generated_texts"] == reference for r in runs)
            for name, runs in passes.items()
            if not name.endswith("cold")
        },
        "busy": args.busy,
        "omp_wait_policy": args.omp_wait_policy,
        "rounds": args.rounds,
        "lmcache_server": [*LMCACHE_SERVER, "--chunk-size", str(args.lmcache_chunk_tokens)]
        if args.lmcache
        else None,
        "workload": {
            "prompts": args.prompts,
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "concurrency": args.concurrency,
            "model": MODEL,
        },
    }


if __name__ == "__main__":
    sys.exit(main())
