"""Run a real vLLM engine on a tiny random model, each run in its own process.

Tests and benchmarks of maru's KV connector need a genuine vLLM engine, not a mock,
but must not download a model or leak vLLM state (global connector, Prometheus
registry, torch threads) into the caller. So:

- `maru.cli._tiny_model.build_tiny_llama` writes a random-weight Llama checkpoint to disk
  (no tokenizer; engines take token-id prompts), and
- `run_engine` starts a fresh `spawn`-ed Python process per call that builds a
  `vllm.LLM` with the engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`),
  generates greedily and sends back token ids, timings and cache-hit counts. Its
  worker runs in that process, which vLLM does not bind: the process is spawned with the
  OpenMP binding vLLM gives its CPU worker processes (`maru.cli._thread_binding`).

Two `run_engine` calls are two engine processes: what the second one gets from an
external KV store it cannot have from vLLM's own prefix cache.

vLLM is imported only inside the child process, so importing this module is cheap and
works without vLLM installed.
"""

from __future__ import annotations

import atexit
import itertools
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from maru.cli._cpu_caches import last_level_cache_bytes
from maru.cli._engine_inspect import (
    connector_description,
    connector_metrics,
    connector_totals,
    kv_cache_container,
    kv_cache_groups,
    prefix_metrics,
)
from maru.cli._engine_process import EngineProcess, EngineRun, EngineRunError, Turn
from maru.cli._thread_binding import in_process_worker_binding, spawned_with

MIB = 1 << 20


def run_engine(
    model_dir: str | os.PathLike[str], prompts: list[list[int]], **options: Any
) -> EngineRun:
    """Run `prompts` through a fresh vLLM engine in its own process and return the result
    (`options` as for `start_engine`)."""
    return start_engine(model_dir, prompts, **options).result()


def run_engine_in(
    python: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    prompts: list[list[int]],
    **options: Any,
) -> EngineRun:
    """`run_engine` under another interpreter, e.g. a virtual environment with another vLLM
    release (`tools/vllm_era.py`): it runs `python -m maru.cli._engine JOB RESULT`."""
    with tempfile.TemporaryDirectory(prefix="maru-engine-") as folder:
        job, result = Path(folder) / "job.json", Path(folder) / "result.json"
        job.write_text(
            json.dumps({"model_dir": str(model_dir), "prompts": prompts, "options": options})
        )
        finished = subprocess.run(
            [str(python), "-m", "maru.cli._engine", str(job), str(result)],
            capture_output=True,
            text=True,
            check=False,
        )
        if finished.returncode != 0 or not result.exists():
            raise EngineRunError(
                f"{python} -m maru.cli._engine failed "
                f"(exit {finished.returncode}):\n{finished.stderr[-6000:]}"
            )
        return EngineRun(**json.loads(result.read_text()))


def start_engine(
    model_dir: str | os.PathLike[str],
    prompts: list[list[int]],
    *,
    held: bool = False,
    max_tokens: int = 8,
    kv_transfer_config: dict[str, Any] | None = None,
    block_size: int = 32,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = True,
    kv_cache_bytes: int = 256 * MIB,
    seed: int = 0,
    env: dict[str, str] | None = None,
    sequential: bool = True,
    enforce_eager: bool = True,
    llm_kwargs: dict[str, Any] | None = None,
    timeout_s: float = 900.0,
    log_path: str | os.PathLike[str] | None = None,
    reset_after: dict[str, Any] | None = None,
    memcpy_bytes: int = 0,
    turns: list[int] | None = None,
) -> EngineProcess:
    """Start a fresh vLLM engine in a spawned process that runs `prompts`.

    A `held` engine builds its LLM and then waits for `release()` (or `result()`), so
    engines can start up side by side and still generate one after another.

    Sampling is greedy (temperature 0) with exactly `max_tokens` new tokens per prompt
    (EOS ignored). `block_size` must be a multiple of 32 on the CPU backend.
    `kv_cache_bytes` caps the KV cache (else vLLM's CPU worker reserves 90% of RAM).
    `env` is applied in the child before vLLM is imported (a `PYTHONPATH` in it is also
    put on `sys.path`, e.g. for a `kv_connector_module_path`). With `sequential=True`
    prompts run one `generate` call each (clean per-prompt TTFT and external-hit
    counts, and a later prompt can hit what an earlier one stored); with False they run
    as one batch. `enforce_eager` skips torch.compile, which costs minutes on CPU.
    `llm_kwargs` are passed on to `vllm.LLM` and override the ones set here.
    With `log_path`, the engine's output (vLLM logs, warnings) goes to that file.
    With `reset_after`, `llm.reset_prefix_cache(**reset_after)` runs once every prompt
    has, and what it returned is `extra["reset"]`.
    With `memcpy_bytes` (sequential runs), each prompt is preceded by a single-threaded
    memcpy of that many bytes in the engine's process, from and to memory the CPU's
    caches do not hold, timed (`extra["memcpy_s_before_prompt"]`): a baseline next to
    each prompt in time, on a machine whose memory speed drifts; and every prompt then
    starts with caches that hold none of its KV (`timed_memcpy`).
    With `turns` (sequential runs; the sizes of consecutive groups of `prompts`, summing
    to their number), the engine runs one group each time `EngineProcess.take_turn()`
    lets it and waits in between: engines up side by side can take turns prompt by
    prompt, so a machine whose speed drifts over seconds touches each of them alike.

    Uses the `spawn` start method, so a calling script needs an
    `if __name__ == "__main__":` guard (pytest needs none). Raises `EngineRunError`
    with the child's traceback if the engine fails, dies or exceeds `timeout_s`.
    """
    if turns is not None and (not sequential or sum(turns) != len(prompts) or min(turns) < 1):
        raise ValueError(
            f"turns={turns} must be sizes of at least 1 that sum to the {len(prompts)} "
            f"prompts, of a sequential run (sequential={sequential})"
        )
    job = {
        "model_dir": str(model_dir),
        "prompts": [list(map(int, p)) for p in prompts],
        "max_tokens": max_tokens,
        "kv_transfer_config": kv_transfer_config,
        "block_size": block_size,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enable_prefix_caching": enable_prefix_caching,
        "kv_cache_bytes": kv_cache_bytes,
        "seed": seed,
        "env": dict(env or {}),
        "sequential": sequential,
        "enforce_eager": enforce_eager,
        "llm_kwargs": dict(llm_kwargs or {}),
        "log_path": str(log_path) if log_path else None,
        "reset_after": reset_after,
        "memcpy_bytes": memcpy_bytes,
        "turns": turns,
    }
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    built, go = ctx.Event(), ctx.Event()
    turn = Turn(ctx.Semaphore(0), ctx.Semaphore(0))
    if not held:
        go.set()
    proc = ctx.Process(
        target=_engine_child, args=(job, send, built, go, turn), name="maru-vllm-engine"
    )
    started = time.perf_counter()
    with spawned_with(in_process_worker_binding(job["llm_kwargs"], job["env"])):
        proc.start()
    send.close()
    return EngineProcess(proc, recv, built, go, turn, started, timeout_s)


def _engine_child(job: dict[str, Any], send: Any, built: Any, go: Any, turn: Turn) -> None:
    """Spawned process entry point: run the job, send ("ok", fields) or ("error", text)."""
    try:
        if job["log_path"]:
            log = os.open(job["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
        result: tuple[str, Any] = ("ok", _run_job(job, built, go, turn))
    except BaseException:  # report everything, including SystemExit from vLLM
        result = ("error", traceback.format_exc())
    try:
        send.send(result)
    finally:
        send.close()
    # Run the Python exit hooks (vLLM shutdown, multiprocessing finalizers that
    # unlink semaphores), then skip native teardown, which takes ~3 s after a vLLM
    # engine (static destructors, no Python frames left) and can only lose time.
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


EVICTING_CACHES = 4
"""How many last-level caches of other memory `timed_memcpy` reads after each copy."""


def timed_memcpy(nbytes: int, slots: int = 4) -> Callable[[], float]:
    """A function that copies `nbytes` once (numpy, in this thread), each call from and
    to other memory of `slots` rotating slots, and returns the seconds it took; then it
    reads `EVICTING_CACHES` times the last-level cache, untimed, so what runs next finds
    nothing of its own in the caches (after the copy alone, 34 MB through a 32 MB L3, a
    vLLM prefix-cache hit still found about 1 ms of its forward's KV there)."""
    source, target = np.ones(slots * nbytes, np.uint8), np.ones(slots * nbytes, np.uint8)
    evicting = np.ones(EVICTING_CACHES * last_level_cache_bytes(), np.uint8)
    turns = itertools.count()

    def copy() -> float:
        at = next(turns) % slots * nbytes
        started = time.perf_counter()
        np.copyto(target[at : at + nbytes], source[at : at + nbytes])
        took = time.perf_counter() - started
        evicting.max()
        return took

    return copy


def _run_job(job: dict[str, Any], built: Any, go: Any, turn: Turn) -> dict[str, Any]:
    """Build the LLM and generate, in the child. Returns `EngineRun` fields."""
    os.environ.update(job["env"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not os.environ.get("XDG_CACHE_HOME"):  # empty means unset (XDG), not the cwd to vLLM
        os.environ.pop("XDG_CACHE_HOME", None)
    extra_paths = job["env"].get("PYTHONPATH", "").split(os.pathsep)
    for entry in reversed([p for p in extra_paths if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm_kwargs: dict[str, Any] = {
        "model": job["model_dir"],
        "skip_tokenizer_init": True,
        "block_size": job["block_size"],
        "enable_prefix_caching": job["enable_prefix_caching"],
        "kv_cache_memory_bytes": job["kv_cache_bytes"],
        "seed": job["seed"],
        "enforce_eager": job["enforce_eager"],
        "disable_log_stats": False,  # RequestOutput.metrics and prefix-cache counters
    }
    if job["max_num_batched_tokens"] is not None:
        llm_kwargs["max_num_batched_tokens"] = job["max_num_batched_tokens"]
    if job["kv_transfer_config"] is not None:
        llm_kwargs["kv_transfer_config"] = job["kv_transfer_config"]
    llm_kwargs.update(job["llm_kwargs"])
    if isinstance(llm_kwargs.get("kv_events_config"), dict):  # LLM converts only the other
        from vllm.config import KVEventsConfig

        llm_kwargs["kv_events_config"] = KVEventsConfig(**llm_kwargs["kv_events_config"])
    llm = LLM(**llm_kwargs)
    startup_s = time.perf_counter() - t0
    built.set()
    go.wait()

    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    sequential = job["sequential"]
    has_connector = job["kv_transfer_config"] is not None

    outputs: list[Any] = []
    external: list[int | None] = []
    totals_after: list[dict[str, float]] = []
    memcpy_s: list[float] = []
    copy = timed_memcpy(job["memcpy_bytes"]) if job["memcpy_bytes"] else None
    turn_starts = set(itertools.accumulate([0, *job["turns"][:-1]])) if job["turns"] else set()
    t1, waited_s = time.perf_counter(), 0.0
    if sequential:
        for index, prompt in enumerate(prompts):
            if index in turn_starts:
                if index:
                    turn.ended.release()
                waiting = time.perf_counter()
                turn.begin.acquire()
                waited_s += time.perf_counter() - waiting
            if copy:
                memcpy_s.append(copy())
            before = prefix_metrics(llm)
            outputs.extend(llm.generate([prompt], params, use_tqdm=False))
            after = prefix_metrics(llm)
            key = "vllm:external_prefix_cache_hits"
            hits = after.get(key, 0.0) - before.get(key, 0.0)
            external.append(int(hits) if has_connector else None)
            if has_connector:
                totals_after.append(connector_totals(llm))
        if turn_starts:
            turn.ended.release()
            # Idle until asked for the result: ending now would run beside other turns.
            turn.begin.acquire()
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        external = [None] * len(prompts)
    generate_s = time.perf_counter() - t1 - waited_s
    reset = llm.reset_prefix_cache(**job["reset_after"]) if job["reset_after"] else None

    ttft: list[float | None] = []
    for out in outputs:
        stats = getattr(out, "metrics", None)
        latency = getattr(stats, "first_token_latency", None)
        ttft.append(float(latency) if latency else None)

    extra: dict[str, Any] = {"vllm_version": vllm.__version__, "reset": reset}
    extra["memcpy_s_before_prompt"] = memcpy_s
    cache_config = llm.llm_engine.vllm_config.cache_config
    extra["block_size"] = cache_config.block_size
    extra["num_gpu_blocks"] = cache_config.num_gpu_blocks
    extra["cache_dtype"] = str(cache_config.cache_dtype)
    extra["model_dtype"] = str(llm.llm_engine.vllm_config.model_config.dtype)
    extra["kv_cache_groups"] = kv_cache_groups(llm)

    kv_connector = None
    if has_connector:
        kv_connector = job["kv_transfer_config"].get("kv_connector")
        extra["connector_totals"] = connector_totals(llm)
        extra["connector"] = connector_description(llm)
        extra["connector_metrics"] = connector_metrics(llm)
        extra["kv_cache_container"] = kv_cache_container(llm)
        extra["connector_totals_after_prompt"] = totals_after

    run = EngineRun(
        token_ids=[list(out.outputs[0].token_ids) for out in outputs],
        ttft_s=ttft,
        num_cached_tokens=[getattr(out, "num_cached_tokens", None) for out in outputs],
        external_cached_tokens=external,
        kv_transfer_params=[getattr(out, "kv_transfer_params", None) for out in outputs],
        metrics=prefix_metrics(llm),
        startup_s=startup_s,
        generate_s=generate_s,
        kv_connector=kv_connector,
        extra=extra,
    )
    return asdict(run)


def main(argv: list[str] | None = None) -> int:
    """`python -m maru.cli._engine JOB RESULT`: run the JSON job (model_dir, prompts, options of
    `run_engine`) and write the `EngineRun` as JSON (see `run_engine_in`)."""
    from maru.cli import (
        _engine as engine,  # the importable module, not __main__: spawn pickles by name
    )

    job_path, result_path = argv if argv is not None else sys.argv[1:]
    job = json.loads(Path(job_path).read_text())
    run = engine.run_engine(job["model_dir"], job["prompts"], **job["options"])
    Path(result_path).write_text(json.dumps(asdict(run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
