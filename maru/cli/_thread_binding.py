"""The OpenMP thread binding of vLLM's CPU worker, for engines whose worker runs in-process.

vLLM's multiprocessing executor starts its CPU worker with its OpenMP threads bound one to
a CPU (`vllm/utils/ompmultiprocessing.py`: `OMP_NUM_THREADS`, `GOMP_CPU_AFFINITY`, and
PyTorch's libgomp preloaded, without which the binding put both threads of a 2-core engine
on one core). An engine core that runs its worker in its own process (the harness's
`VLLM_ENABLE_V1_MULTIPROCESSING=0`) gets none of that where the executor binds (vLLM 0.28
on; 0.18's worker binds its own threads), and its threads float: with another process
busy on one core, a third to a half of its prefix-cache hits took 2-10x as long, by
chance; bound, 1 to 4 of 48 (`benchmarks/hit_cost.py --busy`). So the harness spawns its
engines with the binding vLLM gives its workers, over the CPUs this process may use.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock


def in_process_worker_binding(
    llm_kwargs: Mapping[str, Any], env: Mapping[str, str]
) -> dict[str, str]:
    """What an engine whose worker runs in its process is spawned with: `worker_binding`
    over the CPUs this process may use; nothing where vLLM starts worker processes
    (`distributed_executor_backend="mp"`: they bind themselves) or binding is off
    (`VLLM_CPU_OMP_THREADS_BIND=nobind` in `env` or this environment)."""
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
    if llm_kwargs.get("distributed_executor_backend") == "mp" or bind == "nobind":
        return {}
    return worker_binding(sorted(os.sched_getaffinity(0)))


OTHER_OPENMP_RUNTIMES = ("libiomp", "libomp")
"""Intel's and LLVM's OpenMP, which vLLM binds its own way (`KMP_AFFINITY`, `OMP_PLACES`)."""


def worker_binding(cpus: Sequence[int]) -> dict[str, str]:
    """The environment of a vLLM CPU worker with an OpenMP thread bound to each of `cpus`:
    empty (no binding) where `LD_PRELOAD` names another OpenMP runtime (e.g. vLLM 0.18's
    libiomp5, whose worker binds its threads itself) or no PyTorch libgomp is found to
    preload; a libgomp preloaded already is kept."""
    preload = os.environ.get("LD_PRELOAD", "")
    if any(runtime in preload for runtime in OTHER_OPENMP_RUNTIMES):
        return {}
    binding = {"OMP_NUM_THREADS": str(len(cpus)), "GOMP_CPU_AFFINITY": " ".join(map(str, cpus))}
    if "libgomp" in preload:
        return binding
    libgomp = torch_libgomp()
    if libgomp is None:
        return {}
    return {**binding, "LD_PRELOAD": f"{preload}:{libgomp}" if preload else str(libgomp)}


def torch_libgomp() -> Path | None:
    """PyTorch's own libgomp (in `torch/lib` or the wheel's `torch.libs`), found without
    importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).parent
    for folder in (package / "lib", package.parent / "torch.libs"):
        found = sorted(folder.glob("libgomp*.so*"))
        if found:
            return found[0]
    return None


def spawned_with(env: Mapping[str, str]) -> contextlib.AbstractContextManager[Any]:
    """`env` in `os.environ` meanwhile: what a process spawned meanwhile starts with
    (multiprocessing's spawn passes this process's environment); restored after."""
    return mock.patch.dict(os.environ, env)
