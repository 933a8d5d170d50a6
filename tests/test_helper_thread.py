"""Work shared with a helper thread: every task runs once, both threads take tasks, a
helper that gets no core never holds the caller up, and a forked child has its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from maru.helper_thread import HelperThread, helper

WAIT_S = 30
"""How long a test waits for a thread it needs before it fails (never reached when
the code is right)."""


def test_every_task_runs_once_and_failures_come_back_by_index() -> None:
    ran: list[int] = []

    def task(index: int):
        def run() -> None:
            ran.append(index)
            if index % 3 == 0:
                raise ValueError(f"task {index}")

        return run

    outcomes = HelperThread().share([task(i) for i in range(10)])
    assert sorted(ran) == list(range(10))
    assert [str(exc) if exc else None for exc in outcomes] == [
        f"task {i}" if i % 3 == 0 else None for i in range(10)
    ]


def test_the_helper_takes_tasks_beside_the_caller() -> None:
    """Two tasks that can only finish together: each must run on a thread of its own."""
    together = threading.Barrier(2, timeout=WAIT_S)
    names: set[str] = set()

    def task() -> None:
        names.add(threading.current_thread().name)
        together.wait()

    assert HelperThread(name="the-helper").share([task, task]) == [None, None]
    assert names == {threading.current_thread().name, "the-helper"}


def test_a_helper_without_a_core_never_holds_the_caller_up() -> None:
    """The helper is stuck in other work: the caller runs every task itself."""
    shared, release = HelperThread(), threading.Event()
    shared.share([lambda: None, lambda: release.wait(WAIT_S)])  # leaves the helper waiting
    names: list[str] = []
    try:
        outcomes = shared.share([lambda: names.append(threading.current_thread().name)] * 5)
    finally:
        release.set()
    assert outcomes == [None] * 5 and set(names) == {threading.current_thread().name}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
def test_a_forked_child_shares_with_a_helper_of_its_own() -> None:
    helper().share([lambda: None, lambda: None])  # the parent's helper has started
    pid = os.fork()
    if pid == 0:
        together = threading.Barrier(2, timeout=WAIT_S)
        try:
            ok = helper().share([together.wait, together.wait]) == [None, None]
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


PINNED_CHILD = """
import json, os, threading, torch
torch.ones(256, 256) @ torch.ones(256, 256)  # the OpenMP runtime starts its threads
from maru.helper_thread import HelperThread
together, seen = threading.Barrier(2, timeout=30), {}
def task():
    seen[threading.current_thread().name] = sorted(os.sched_getaffinity(0))
    together.wait()
HelperThread(name="helper").share([task, task])
print(json.dumps([seen["MainThread"], seen["helper"]]))
"""


def openmp_binding(cpus: list[int]) -> dict[str, str]:
    """The environment vLLM's CPU executor gives a worker bound to `cpus`
    (`vllm.utils.ompmultiprocessing`): Intel's OpenMP where it is preloaded (the era
    lanes of vLLM 0.18), else torch's libgomp, preloaded as vLLM does."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "libiomp" in preload:
        listed = ",".join(map(str, cpus))
        return {"KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{listed}]"}
    torch_dir = Path(torch.__file__).parent
    libgomp = sorted(
        [*torch_dir.glob("lib/libgomp*.so*"), *torch_dir.parent.glob("torch.libs/libgomp*.so*")]
    )
    assert libgomp, f"no libgomp in {torch_dir}: torch's OpenMP runtime is not where vLLM looks"
    return {
        "LD_PRELOAD": ":".join(filter(None, [preload, str(libgomp[0])])),
        "GOMP_CPU_AFFINITY": " ".join(map(str, cpus)),
    }


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin apart")
def test_the_helper_leaves_the_cpu_openmp_pinned_its_starter_to() -> None:
    """As in vLLM's CPU worker under `vllm serve`: its OpenMP runtime pins the main
    thread to the first CPU, which a thread it starts inherits."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "OMP_NUM_THREADS": "2", **openmp_binding(cpus)}
    child = subprocess.run(
        [sys.executable, "-c", PINNED_CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    main, helper_cpus = json.loads(child.stdout)
    assert main == cpus[:1], "the OpenMP runtime pinned the main thread"
    assert cpus[0] not in helper_cpus and cpus[1] in helper_cpus
