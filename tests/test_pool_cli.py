"""`maru pool`, `maru bench` and what `maru info` says about the configured backend."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import maru
from maru.backends.shm import shm_path
from maru.cli import main
from maru.cli.bench import format_report, run_bench


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_pool_lifecycle_from_the_command_line(capsys, pool_config) -> None:
    config, name = pool_config
    code, _, err = run(capsys, "pool", "stats", "--config", config)
    assert code == 1 and "does not exist" in err
    assert run(capsys, "pool", "create", "--config", config)[0] == 0
    with maru.open_store(maru.load_config(config)) as store:
        store.put(b"a", b"1")
        store.put(b"b", b"2")
        store.get(b"a")
    code, out, _ = run(capsys, "pool", "stats", "--config", config, "--json")
    stats = json.loads(out)
    assert code == 0
    assert (stats["objects"], stats["hits"], stats["capacity"]) == (2, 1, 64 * 2**20)
    assert stats["label"].startswith(f"shm pool '{name}'")
    code, out, _ = run(
        capsys, "pool", "stats", "--config", config, "--watch", "0.01", "--count", "3", "--json"
    )
    assert [json.loads(line)["objects"] for line in out.splitlines()] == [2, 2, 2]
    code, out, _ = run(capsys, "pool", "clear", "--config", config, "--json")
    assert json.loads(out) == {"removed": 2}
    assert run(capsys, "pool", "destroy", "--config", config)[0] == 0
    assert not shm_path(name).exists()


def test_clear_with_a_namespace_removes_only_its_keys(capsys, pool_config) -> None:
    config, _ = pool_config
    assert run(capsys, "pool", "create", "--config", config)[0] == 0
    ours = [b"maru/tenant-a/model-1/k1", b"maru/tenant-a/model-2/k1"]
    theirs = [b"maru/tenant-b/model-1/k1", b"maru/tenant-ab/model-1/k1"]
    with maru.open_store(maru.load_config(config)) as store:
        for key in ours + theirs:
            store.put(key, b"x")
    code, out, _ = run(
        capsys, "pool", "clear", "--config", config, "--namespace", "tenant-a/model-1", "--json"
    )
    assert (code, json.loads(out)["removed"]) == (0, 1)
    code, out, _ = run(capsys, "pool", "clear", "--config", config, "--namespace", "tenant-a")
    assert code == 0 and "removed 1 objects of namespace 'tenant-a'" in out
    with maru.open_store(maru.load_config(config)) as store:
        assert store.contains(ours + theirs) == [False, False, True, True]
    for bad in ("", "a//b", "/a", "a/b/c"):
        code, _, err = run(capsys, "pool", "clear", "--config", config, "--namespace", bad)
        assert code == 2 and f"--namespace = {bad!r}" in err
    code, _, err = run(capsys, "pool", "stats", "--config", config, "--namespace", "tenant-a")
    assert code == 2 and "only 'maru pool clear'" in err
    with maru.open_store(maru.load_config(config)) as store:
        assert store.stats().objects == 2, "a refused command removed nothing"
    assert run(capsys, "pool", "destroy", "--config", config)[0] == 0


def test_stats_watch_shows_sizes_and_rates_for_people(capsys, pool_config) -> None:
    config, _ = pool_config
    assert run(capsys, "pool", "create", "--config", config)[0] == 0
    with maru.open_store(maru.load_config(config)) as store:
        store.put(b"a", b"1" * 4096)
        code, out, _ = run(
            capsys, "pool", "stats", "--config", config, "--watch", "0.2", "--count", "2", "--json"
        )
        assert code == 0 and json.loads(out.splitlines()[-1])["hits_per_s"] == 0
        store.get(b"a")
        code, out, _ = run(
            capsys, "pool", "stats", "--config", config, "--watch", "0.01", "--count", "2"
        )
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2
    assert re.search(r"used [\d.]+ KiB of 64 MiB  objects 1 ", lines[0]), lines[0]
    assert re.search(r"hits 1 \(0\.0/s, ~0\.00 GB/s\)", lines[1]), lines[1]
    assert run(capsys, "pool", "destroy", "--config", config)[0] == 0


@pytest.mark.parametrize(
    ("action", "operation"),
    [("stats", "info()"), ("create", "info()"), ("clear", "clear()"), ("destroy", "destroy()")],
)
def test_pool_commands_name_the_operation_a_backend_lacks(
    capsys, monkeypatch, action, operation
) -> None:
    monkeypatch.setenv("MARU_BACKEND", "mock")
    code, _, err = run(capsys, "pool", action)
    assert code == 2, err
    assert f"backend = 'mock': maru pool {action} needs an operation it lacks" in err
    assert f"the mock backend does not support {operation}" in err


def test_pool_commands_ask_a_plugin_backend_what_it_can_do(capsys, tmp_path) -> None:
    config = tmp_path / "maru.yaml"
    config.write_text(f"backend: dirstore\ndirstore:\n  path: {tmp_path / 'objects'}\n")
    code, _, err = run(capsys, "pool", "stats", "--config", str(config), "--json")
    assert code == 2 and "the dirstore backend does not support info()" in err


def test_info_says_when_cxl_is_only_emulated(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MARU_BACKEND", "cxl")
    monkeypatch.setenv("MARU_CXL__MODE", "emulated")
    monkeypatch.setenv("MARU_CXL__DEVICE", str(tmp_path / "dax"))
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0
    assert json.loads(out)["configured"] == {
        "backend": "cxl",
        "detail": f"file emulation over {tmp_path / 'dax'} (not CXL memory)",
    }


def test_bench_reports_every_size_as_a_ratio_to_memcpy() -> None:
    report = run_bench(
        "shm", sizes=(64 * 1024, 2**20), capacity=64 * 2**20, progress=lambda line: None
    )
    assert [r["size"] for r in report["sizes"]] == [64 * 1024, 2**20]
    for row in report["sizes"]:
        assert row["put_ratio"] == pytest.approx(row["put_gbps"] / row["memcpy_gbps"])
        assert row["put_gbps"] > 0 and row["get_into_gbps"] > 0
    assert set(report["latency"]) == {"contains_128_us", "put_4k_us", "get_4k_us"}
    first = report["first_pass"]
    assert first["put_ratio"] == pytest.approx(first["put_gbps"] / first["memcpy_gbps"])
    assert "ratio to memcpy" in format_report(report)
    assert "first pass of a fresh 64 MiB pool" in format_report(report)


PRIVATE_POOL_IMPORT = re.compile(r"^\s*(from|import)\s+maru\.backends\.(_|pool\b)", re.M)
"""An import of the private pool package (or of any private module of the backends),
or of the pool package by its old, public-looking name."""


def test_the_pool_package_is_private_to_the_backends() -> None:
    for line in (
        "from maru.backends._pool import memory_of",
        "    from maru.backends._pool.core import Pool",
        "import maru.backends._pool",
        "from maru.backends.pool import PoolBackend",
    ):
        assert PRIVATE_POOL_IMPORT.search(line), line
    for line in ("from maru.backends.base import Backend", "from maru.backends.shm import x"):
        assert not PRIVATE_POOL_IMPORT.search(line), line
    root = Path(__file__).resolve().parent.parent
    sources = [
        path
        for folder in ("maru", "tools", "benchmarks", "examples")
        for path in (root / folder).rglob("*.py")
        if "backends" not in path.relative_to(root).parts
    ]
    assert len(sources) > 10
    offenders = [str(p) for p in sources if PRIVATE_POOL_IMPORT.search(p.read_text())]
    assert offenders == [], "ask the Backend (maru.backends.base) instead of the pool"


def test_the_pool_commands_work_on_a_disk_store(capsys, tmp_path) -> None:
    """Namespaces, their records, stats, clearing one namespace and destroying the store,
    as on a shm pool."""
    from maru.vllm.keys import namespace_prefix, rank_key
    from maru.vllm.records import write_record

    config = tmp_path / "maru.yaml"
    config.write_text(f"backend: disk\ndisk:\n  path: {tmp_path / 'store'}\n")
    code, _, err = run(capsys, "pool", "stats", "--config", str(config))
    assert code == 1 and "does not exist" in err and not (tmp_path / "store").exists()
    digest = "0123456789abcdef" * 2
    ours, theirs = namespace_prefix("tenant-a", digest), namespace_prefix("tenant-b", digest)
    chunks = [rank_key(prefix + b"chunk", 0) for prefix in (ours, theirs)]
    with maru.open_store(maru.load_config(config)) as store:
        for prefix, chunk in zip((ours, theirs), chunks, strict=True):
            store.put(chunk, b"kv")
            write_record(store, prefix, {"model": "m"})
    code, out, _ = run(capsys, "pool", "namespaces", "--config", str(config))
    assert code == 0
    assert f"tenant-a/{digest}  objects 1" in out and f"tenant-b/{digest}  objects 1" in out
    code, out, _ = run(capsys, "pool", "stats", "--config", str(config), "--json")
    assert (code, json.loads(out)["objects"]) == (0, 4)
    code, out, _ = run(
        capsys, "pool", "clear", "--config", str(config), "--namespace", f"tenant-a/{digest}"
    )
    assert code == 0
    with maru.open_store(maru.load_config(config)) as store:
        assert store.contains(chunks) == [False, True]
    assert run(capsys, "pool", "destroy", "--config", str(config))[0] == 0
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("configured", [None, "128MiB"])
@pytest.mark.parametrize(
    "command",
    [
        ("pool", "stats"),
        ("pool", "namespaces"),
        ("pool", "clear"),
        ("doctor",),
        ("pool", "destroy"),
    ],
)
def test_every_command_on_an_existing_pool_uses_the_capacity_it_was_created_with(
    capsys, monkeypatch, pool_names, command, configured
) -> None:
    """An operator inspecting a pool (one vLLM made from its extra config, say) need not
    know its capacity: the command attaches as the pool is, and notes the difference."""
    name = pool_names()
    monkeypatch.setenv("MARU_BACKEND", "shm")
    monkeypatch.setenv("MARU_SHM__NAME", name)
    monkeypatch.setenv("MARU_CAPACITY", "64MiB")
    assert run(capsys, "pool", "create")[0] == 0
    with maru.open_store(maru.MaruConfig(backend="shm", capacity="64MiB", shm={"name": name})) as s:
        s.put(b"maru/default/k", b"x")
    if configured is None:
        monkeypatch.delenv("MARU_CAPACITY")
    else:
        monkeypatch.setenv("MARU_CAPACITY", configured)
    code, out, err = run(capsys, *command)
    assert code == 0, err
    configured_text = "128 MiB" if configured else "4 GiB"
    assert err.count("note:") == 1
    assert f"has capacity 64 MiB (configured: {configured_text}" in err
    if command == ("pool", "stats"):
        assert "67108864" in out
    assert shm_path(name).exists() == (command != ("pool", "destroy"))


def test_a_command_on_a_pool_with_the_configured_capacity_notes_nothing(
    capsys, pool_config
) -> None:
    config, _ = pool_config
    assert run(capsys, "pool", "create", "--config", config)[0] == 0
    code, _, err = run(capsys, "pool", "stats", "--config", config)
    assert code == 0 and "note:" not in err


def test_a_process_that_creates_the_store_still_refuses_another_capacity(pool_names) -> None:
    """Only tools adopt the pool's capacity: an engine configured otherwise is told."""
    name = pool_names()
    with maru.open_store(maru.MaruConfig(backend="shm", capacity="64MiB", shm={"name": name})):
        pass
    with pytest.raises(maru.ConfigError, match="already exists with capacity 67108864"):
        maru.open_store(maru.MaruConfig(backend="shm", capacity="128MiB", shm={"name": name}))
