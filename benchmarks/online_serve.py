"""Online: two `vllm serve` processes on one shm pool, measured by vLLM's own client.

Server A (maru on a new pool) serves the prompts cold, then again: its own
prefix-cache hits. Server B, a new process on the same pool that has never seen the
prompts, serves them: maru hits. The client is `vllm bench serve` with vLLM's
prefix-repetition dataset (distinct prefixes plus a suffix each, so prompts end
mid-chunk), a fixed seed, concurrency 4, on a tiny float32 model with a word-level
tokenizer (text round-trips to the same token ids). Reported: median time to first
token of each pass, maru hit over own hit (the same server software, the same
prompts), B's maru counters from /metrics in that pass, and whether B's outputs
equal A's cold ones request by request. Each server first serves a pass of prompts of
its own (its first forwards; they share nothing with the measured prompts). With
`--busy`, another process keeps one core busy meanwhile.
`python benchmarks/online_serve.py --help`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from hit_cost import competing_load

import maru
from maru.cli._serve import counter, serve
from maru.cli._tiny_model import add_word_tokenizer, build_tiny_llama
from maru.cli.demo import model_cache

MODEL = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64, "vocab": 2048}
COUNTERS = (
    "vllm:maru_hit_tokens_total",
    "vllm:maru_chunks_loaded_total",
    "vllm:maru_lookups_total",
)


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
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="each a prefix of its own")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=33)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--busy", action="store_true", help="keep one core busy meanwhile")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/online.json"))
    args = parser.parse_args()
    model = add_word_tokenizer(
        build_tiny_llama(model_cache() / "bench-online-llama", **MODEL), MODEL["vocab"]
    )
    pool = f"bench-online-{np.random.default_rng().integers(1 << 30)}"
    transfer = {
        "kv_connector": "MaruKVConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "shm", "capacity": "1GiB", "shm": {"name": pool}},
    }
    options = [
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
        "--block-size", "32", "--kv-cache-memory-bytes", str(1 << 30),
    ]  # fmt: skip
    passes: dict[str, dict] = {}
    counters: dict[str, float] = {}
    logs = model_cache().parent
    try:
        with tempfile.TemporaryDirectory() as results, competing_load(args.busy):
            out = Path(results)
            with serve(model, logs / "bench-online-a.log", transfer, options) as url:
                print("server A: warm-up (prompts of its own) ...", file=sys.stderr, flush=True)
                bench(url, model, args, out / "warm-up-a.json", seed=1)
                for name in ("cold", "own_hit"):
                    print(f"server A: {name} ...", file=sys.stderr, flush=True)
                    passes[name] = bench(url, model, args, out / f"{name}.json")
            with serve(model, logs / "bench-online-b.log", transfer, options) as url:
                print("server B: warm-up (prompts of its own) ...", file=sys.stderr, flush=True)
                bench(url, model, args, out / "warm-up-b.json", seed=2)
                counters = {name: -counter(url, name) for name in COUNTERS}
                print("server B: maru_hit ...", file=sys.stderr, flush=True)
                passes["maru_hit"] = bench(url, model, args, out / "maru_hit.json")
                counters = {name: counters[name] + counter(url, name) for name in COUNTERS}
    finally:
        config = maru.load_config(backend="shm", capacity="1GiB", shm={"name": pool})
        with maru.open_store(config) as store:
            store.destroy()
    ttft = {name: result["median_ttft_ms"] for name, result in passes.items()}
    report = {
        "median_ttft_ms": ttft,
        "ttfts_ms": {name: [t * 1e3 for t in result["ttfts"]] for name, result in passes.items()},
        "maru_hit_over_own_hit": ttft["maru_hit"] / ttft["own_hit"],
        "maru_hit_over_cold": ttft["maru_hit"] / ttft["cold"],
        "server_b_metrics": counters,
        "outputs_identical": passes["maru_hit"]["generated_texts"]
        == passes["cold"]["generated_texts"],
        "busy": args.busy,
        "workload": {
            "prompts": args.prompts,
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "concurrency": args.concurrency,
            "model": MODEL,
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(
        f"{args.prompts} prompts of {args.prefix_tokens} + {args.suffix_tokens} tokens, "
        f"concurrency {args.concurrency}{', one core kept busy' if args.busy else ''}; "
        f"median time to first token:"
    )
    for name, value in ttft.items():
        print(f"  {name:<9} {value:8.1f} ms")
    print(f"maru hit / own hit: {report['maru_hit_over_own_hit']:.2f}")
    print(f"server B's /metrics: {counters}")
    print(f"outputs identical (B's maru hits vs A's cold pass): {report['outputs_identical']}")
    print(f"written to {args.output}")
    return 0 if report["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
