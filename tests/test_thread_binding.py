"""The OpenMP binding the harness spawns its engines with, as vLLM binds its CPU workers."""

from __future__ import annotations

import os
from pathlib import Path

from maru.cli._thread_binding import (
    in_process_worker_binding,
    spawned_with,
    torch_libgomp,
    worker_binding,
)


def test_a_worker_gets_a_thread_bound_to_each_cpu_and_pytorchs_libgomp_preloaded(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    binding = worker_binding([0, 3])
    assert binding["OMP_NUM_THREADS"] == "2"
    assert binding["GOMP_CPU_AFFINITY"] == "0 3"
    assert Path(binding["LD_PRELOAD"]).is_file()
    assert Path(binding["LD_PRELOAD"]) == torch_libgomp()


def test_a_preload_already_asked_for_is_kept(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/libother.so")
    assert worker_binding([0])["LD_PRELOAD"] == f"/opt/libother.so:{torch_libgomp()}"


def test_a_libgomp_preloaded_already_is_bound_and_another_openmp_is_left_alone(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/libgomp.so.1")
    assert "LD_PRELOAD" not in worker_binding([0, 1])
    assert worker_binding([0, 1])["GOMP_CPU_AFFINITY"] == "0 1"
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc_minimal.so.4:libiomp5.so")
    assert worker_binding([0, 1]) == {}


def test_an_engine_with_worker_processes_or_binding_off_is_spawned_as_it_is(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)  # vLLM 0.18's lane preloads libiomp5
    cpus = " ".join(map(str, sorted(os.sched_getaffinity(0))))
    assert in_process_worker_binding({}, {})["GOMP_CPU_AFFINITY"] == cpus
    assert in_process_worker_binding({"distributed_executor_backend": "mp"}, {}) == {}
    assert in_process_worker_binding({}, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == {}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert in_process_worker_binding({}, {}) == {}


def test_the_environment_is_restored_after_the_spawn(monkeypatch):
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "5")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with spawned_with({"GOMP_CPU_AFFINITY": "0 1", "OMP_NUM_THREADS": "2"}):
        assert (os.environ["GOMP_CPU_AFFINITY"], os.environ["OMP_NUM_THREADS"]) == ("0 1", "2")
    assert os.environ["GOMP_CPU_AFFINITY"] == "5"
    assert "OMP_NUM_THREADS" not in os.environ
