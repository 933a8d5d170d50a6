"""The data path on a GPU, without vLLM: bit-exact round trips and throughput.

For each of vLLM's GPU KV layouts (built as vLLM builds them, on the device), a
chunk's pages go from one cache into the shm pool and back into other blocks of
a second cache, through `maru.transfer` exactly as the connector drives it, and
must come back bit-exact. Then gather + transfer throughput, both directions, as
a ratio to a pinned host<->device `copy_` of the same bytes measured in the same
run. Needs torch, numpy, pluggy, pydantic, PyYAML and xxhash; no vLLM.

    python benchmarks/gpu_transfer.py                 # on a CUDA machine
    python benchmarks/gpu_transfer.py --device cpu    # the same checks on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

import maru
from maru.layouts import BlocksFirst, KVFirst, recognise
from maru.transfer import Blocks, ChunkCopy, DataPath, host_tensor, pin


def layouts(
    blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    layers: int,
    dtype: torch.dtype,
    device: str,
) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    """Per-layer KV tensors as vLLM allocates them for its GPU attention backends."""
    nb, bs, h, d = blocks, block_size, heads, head_dim

    def per_layer(make: Callable[[], torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
        return lambda: {f"layer{i}": make() for i in range(layers)}

    def one_buffer(order: str) -> Callable[[], dict[str, torch.Tensor]]:
        """vLLM >= 0.29: one buffer, each layer a (NB, H, BS, 2D) view; `order` is the
        physical order of L(ayer), B(lock), H(ead), N (token), C (2D)."""

        def make() -> dict[str, torch.Tensor]:
            sizes = {"L": layers, "B": nb, "H": h, "N": bs, "C": 2 * d}
            strides, step = {}, 1
            for dim in reversed(order):
                strides[dim] = step
                step *= sizes[dim]
            buffer = torch.empty(step, dtype=dtype, device=device)
            return {
                f"layer{i}": buffer.as_strided(
                    (nb, h, bs, 2 * d), [strides[c] for c in "BHNC"], i * strides["L"]
                )
                for i in range(layers)
            }

        return make

    empty = lambda *shape: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
    return {
        "flash (2,NB,BS,H,D)": per_layer(lambda: empty(2, nb, bs, h, d)),
        "flash (NB,2,BS,H,D)": per_layer(lambda: empty(nb, 2, bs, h, d)),
        "flashinfer HND (NB,2,BS,H,D)": per_layer(
            lambda: empty(nb, 2, h, bs, d).permute(0, 1, 3, 2, 4)
        ),
        "mla (NB,BS,D)": per_layer(lambda: empty(nb, bs, 576)),
        ">=0.29 LBHNC views": one_buffer("LBHNC"),
        ">=0.29 BLHNC views (cross-layer)": one_buffer("BLHNC"),
    }


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    generator = torch.Generator(device=next(iter(caches.values())).device).manual_seed(seed)
    for cache in caches.values():
        raw = torch.randint(
            -128, 127, cache.shape, dtype=torch.int8, device=cache.device, generator=generator
        )
        cache.copy_(raw.to(cache.dtype))


def same_pages(
    a: dict[str, torch.Tensor],
    a_ids: list[int],
    b: dict[str, torch.Tensor],
    b_ids: list[int],
    num_blocks: int,
) -> bool:
    def page(t: torch.Tensor, block: int) -> torch.Tensor:
        dim = 1 if t.shape[:2] == (2, num_blocks) else 0
        return t.select(dim, block).contiguous().flatten().view(torch.uint8)

    return all(
        torch.equal(page(a[n], x), page(b[n], y))
        for n in a
        for x, y in zip(a_ids, b_ids, strict=True)
    )


def round_trip(
    store: maru.Backend,
    source: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    blocks: int,
    chunk_blocks: int,
) -> bool:
    """Save a chunk of `source` into the pool and load it into other blocks of `target`."""
    saver = DataPath(recognise(source, blocks, [KVFirst, BlocksFirst]))
    loader = DataPath(recognise(target, blocks, [KVFirst, BlocksFirst]))
    ids = torch.randperm(blocks)[: 2 * chunk_blocks].tolist()
    ids_from, ids_to = ids[:chunk_blocks], ids[chunk_blocks:]
    key = uuid.uuid4().hex
    with store.reserve(key, saver.payload_bytes(chunk_blocks)) as buffer:
        chunk = ChunkCopy(
            Blocks(ids_from), torch.frombuffer(buffer, dtype=torch.int8), chunk_blocks
        )
        for name in saver.adapter.layers:
            saver.save_layer(name, [chunk])
        saver.saves_done().wait()
    view = store.view(key)
    loader.load([ChunkCopy(Blocks(ids_to), host_tensor(view.data), chunk_blocks)])
    loader.loads_done().wait()
    return view.valid() and same_pages(source, ids_from, target, ids_to, blocks)


def seconds(work: Callable[[], None], done: Callable[[], None], repeats: int) -> float:
    """Best time of `repeats` runs of `work` (after one warm-up), each waited for."""
    best = float("inf")
    for index in range(repeats + 1):
        started = time.perf_counter()
        work()
        done()
        if index:
            best = min(best, time.perf_counter() - started)
    return best


def throughput(
    caches: dict[str, torch.Tensor], blocks: int, chunk_blocks: int, repeats: int
) -> dict[str, float]:
    """Save (gather + device->host) and load (host->device + scatter) of one chunk, as
    ratios to a pinned copy_ of the same bytes between one device tensor and host."""
    path = DataPath(recognise(caches, blocks, [KVFirst, BlocksFirst]))
    nbytes = path.payload_bytes(chunk_blocks)
    host = path.staging(nbytes)
    flat = torch.empty(nbytes, dtype=torch.int8, device=path.device)
    ids = torch.randperm(blocks)[:chunk_blocks].tolist()
    chunk = ChunkCopy(Blocks(ids), host, chunk_blocks)
    sync = (lambda: torch.cuda.synchronize(path.device)) if path.on_device else (lambda: None)

    def save() -> None:
        for name in path.adapter.layers:
            path.save_layer(name, [chunk])
        path.saves_done().wait()

    def load() -> None:
        path.load([chunk])
        path.loads_done().wait()

    save_s = seconds(save, sync, repeats)
    load_s = seconds(load, sync, repeats)
    to_host = seconds(lambda: host.copy_(flat, non_blocking=True), sync, repeats)
    to_device = seconds(lambda: flat.copy_(host, non_blocking=True), sync, repeats)
    return {
        "chunk_bytes": nbytes,
        "save_gb_s": nbytes / save_s / 1e9,
        "load_gb_s": nbytes / load_s / 1e9,
        "pinned_to_host_gb_s": nbytes / to_host / 1e9,
        "pinned_to_device_gb_s": nbytes / to_device / 1e9,
        "save_ratio": to_host / save_s,
        "load_ratio": to_device / load_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2048, help="blocks per cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/gpu_transfer.json"))
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "error: --device cuda: no CUDA device here (use --device cpu for the same checks "
            "on the CPU)",
            file=sys.stderr,
        )
        return 2
    chunk_blocks = args.chunk_tokens // args.block_size
    made = layouts(
        args.blocks,
        args.block_size,
        args.heads,
        args.head_dim,
        args.layers,
        torch.bfloat16,
        args.device,
    )
    capacity = 4 * chunk_blocks * args.layers * 2 * args.block_size * 576 * 2 + (64 << 20)
    store = maru.open_store(
        backend="shm", capacity=capacity, shm={"name": f"gpu-transfer-{uuid.uuid4().hex[:8]}"}
    )
    pinned = args.device != "cpu" and pin(store.host_memory())
    print(
        f"{args.layers} layers, {args.blocks} blocks of {args.block_size} tokens, chunk "
        f"{args.chunk_tokens} tokens, on {args.device}; pool page-locked: {pinned}"
    )
    results, exact = {}, True
    try:
        for name, make in made.items():
            source, target = make(), make()
            fill(source, 1)
            fill(target, 2)
            ok = round_trip(store, source, target, args.blocks, chunk_blocks)
            exact &= ok
            results[name] = {
                "bit_exact": ok,
                **throughput(source, args.blocks, chunk_blocks, args.repeats),
            }
            r = results[name]
            print(
                f"  {name:<34} exact {ok!s:<5}  save {r['save_gb_s']:6.1f} GB/s "
                f"({r['save_ratio']:.2f}x pinned)  load {r['load_gb_s']:6.1f} GB/s "
                f"({r['load_ratio']:.2f}x pinned)",
                flush=True,
            )
            del source, target
    finally:
        store.destroy()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "pool_page_locked": pinned,
                "layouts": results,
            },
            indent=2,
        )
    )
    print(f"written to {args.output}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
