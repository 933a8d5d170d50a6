"""`maru pool`, `maru bench` and what `maru info` says about the configured backend."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import maru
from maru.backends.shm import shm_path
from maru.bench import format_report, run_bench
from maru.cli import main


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


def test_pool_commands_refuse_a_backend_without_a_pool(capsys, monkeypatch) -> None:
    monkeypatch.setenv("MARU_BACKEND", "mock")
    code, _, err = run(capsys, "pool", "stats")
    assert code == 2 and "allowed: shm, cxl" in err


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
    for when in ("at_once", "populated"):
        assert first[when]["put_ratio"] == pytest.approx(
            first[when]["put_gbps"] / first["memcpy_gbps"]
        )
    assert "ratio to memcpy" in format_report(report)
    assert "first pass of a fresh 64 MiB pool" in format_report(report)


PRIVATE_POOL_IMPORT = re.compile(r"^\s*(from|import)\s+maru\.backends\.(pool\.|_)", re.M)


def test_code_outside_the_backends_uses_only_the_public_pool_interface() -> None:
    root = Path(__file__).resolve().parent.parent
    sources = [
        path
        for folder in ("maru", "tools", "benchmarks", "examples")
        for path in (root / folder).rglob("*.py")
        if "backends" not in path.relative_to(root).parts
    ]
    assert len(sources) > 10
    offenders = [str(p) for p in sources if PRIVATE_POOL_IMPORT.search(p.read_text())]
    assert offenders == [], "import what they need from maru.backends.pool"
